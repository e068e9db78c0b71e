//! Real models on pagedattn: SmolLM2-135M-Instruct (llama) and Gemma 3
//! 270M (gemma3), loaded from their GGUF files and served as an engine
//! would serve them.
//!
//! - [`gguf`]: the GGUF container (header, metadata, tensor infos,
//!   alignment).
//! - [`config`]: the hyper-parameters and tensor names, checked; what each
//!   architecture does differently is its module of `arch/` (an
//!   [`config::ArchSpec`]), the step loop is shared.
//! - [`weights`]: Q4_1, Q5_0, Q8_0, Q4_K, Q6_K and F32 matrices and the
//!   GPU blocks they are dequantized from.
//! - [`tokenizer`]: byte-level BPE (merges) and SentencePiece BPE (scores,
//!   byte fallback) from the GGUF's own vocabulary, and the chat formats.
//! - [`engine`]: the GPU model: the engine's own WGSL kernels (embedding
//!   gather, RMSNorm, per-head norms, RoPE, the matmuls, SiLU and
//!   GELU-tanh gates, residuals, the LM head in row chunks) around
//!   pagedattn's paged KV cache and attention (plan/run, a variant per
//!   window), one encoder and one submit per step.
//! - [`sample`]: greedy, temperature / top-k / min-p / top-p with a seed,
//!   logit bias and penalties; [`defaults`]: what a request that omits
//!   them gets, per architecture.
//! - [`synthetic`]: models of real shapes and formats with weights from
//!   a seed, written as GGUF bytes in memory and loaded as a file is
//!   ([`load::ModelSource`]: a file or one of these).
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
pub mod defaults;
pub mod engine;
mod error;
#[cfg(not(target_arch = "wasm32"))]
pub mod generate;
pub mod gguf;
pub mod load;
pub mod sample;
pub mod serve;
pub mod synthetic;
pub mod tokenizer;
pub mod weights;

pub use error::ModelError;
