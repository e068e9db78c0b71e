//! pagedattn: PagedAttention for every GPU.
//!
//! The KV cache of an LLM lives in fixed-size blocks on a preallocated pool;
//! [`blocks`] keeps the per-sequence block tables, reference counts,
//! copy-on-write and prefix cache on the host, and the WGSL kernels in
//! [`gpu`] walk the block tables with online softmax on any wgpu adapter.
//! [`reference`](mod@reference) is the same math in f64, for tests (engines' too).
//!
//! `ARCHITECTURE.md` is the design and the layout contract;
//! `GUARANTEES.md` what is promised under bad input. The command line
//! (demo, simulator, benchmark) and the browser demo are separate crates
//! (`cli/`, `web/`): this library depends on neither.

pub mod blocks;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod gpu;
pub mod reference;
pub mod rng;
