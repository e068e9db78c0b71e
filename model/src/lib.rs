//! A real model on pagedattn: SmolLM2-135M-Instruct (llama architecture),
//! loaded from its GGUF file and served as an engine would serve it.
//!
//! - [`gguf`]: the GGUF container (header, metadata, tensor infos,
//!   alignment); F32, Q8_0 and Q4_1 tensors read as they are.
//! - [`config`]: the llama hyper-parameters and tensor names, checked.
//! - [`tokenizer`]: byte-level BPE from the GGUF's own vocabulary and
//!   merges, and the Instruct model's chat template.
//! - [`engine`]: the GPU model: the engine's own WGSL kernels (embedding
//!   gather, RMSNorm, RoPE, Q4_1/Q8_0 matmuls, SiLU gate, residuals, tied LM
//!   head) around pagedattn's paged KV cache and attention (plan/run), one
//!   encoder and one submit per step.
//! - [`sample`]: greedy, temperature / top-k / top-p with a seed.
//! - [`serve`]: requests through the library `Scheduler`: continuous
//!   batching, chunked prefill, parallel sampling and beam search sharing
//!   their prompt, prefix caching, preemption.
//!
//! The `pagedattn` library itself stays model-agnostic: this crate uses
//! only its public API.

mod arch;
#[cfg(not(target_arch = "wasm32"))]
pub mod bench;
mod clock;
pub mod config;
pub mod engine;
mod error;
#[cfg(not(target_arch = "wasm32"))]
pub mod generate;
pub mod gguf;
pub mod load;
pub mod sample;
pub mod serve;
pub mod tokenizer;
pub mod weights;

pub use error::ModelError;
