//! pagedattn: PagedAttention for every GPU.
//!
//! The KV cache of an LLM lives in fixed-size blocks on a preallocated pool;
//! [`blocks`] keeps the per-sequence block tables, reference counts,
//! copy-on-write and prefix cache on the host, and the WGSL kernels walk the
//! block tables with online softmax on any wgpu adapter.

#[cfg(not(target_arch = "wasm32"))]
pub mod bench;
pub mod blocks;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod demo;
pub mod gpu;
pub mod reference;
pub mod rng;
pub mod sim;
#[cfg(target_arch = "wasm32")]
pub mod web;
