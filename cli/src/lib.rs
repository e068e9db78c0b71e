//! The applications of pagedattn: the end-to-end demo (native and, through
//! `web/`, in the browser), the multi-tenant memory simulator and the
//! benchmark, behind the `pagedattn` command line (`src/main.rs`).

/// The command line: clap's parser and the checks every command makes
/// before it opens an adapter (the binary's, the fuzz target's and the
/// tests').
#[cfg(not(target_arch = "wasm32"))]
pub mod args;
#[cfg(not(target_arch = "wasm32"))]
pub mod bench;
pub mod demo;
#[cfg(not(target_arch = "wasm32"))]
pub mod env;
#[cfg(not(target_arch = "wasm32"))]
pub mod loadgen;
pub mod sim;

/// The real model behind `pagedattn generate` (SmolLM2-135M through the paged cache).
#[cfg(not(target_arch = "wasm32"))]
pub use pagedattn_model as model;

/// `pagedattn serve`: the OpenAI-compatible server over the real model.
#[cfg(not(target_arch = "wasm32"))]
pub use pagedattn_server as server;
