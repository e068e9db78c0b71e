//! The GPU layer (wgpu): device, the paged KV pool, and the kernels.
//! It takes block tables, slot mappings and copy lists from
//! [`blocks`](crate::blocks) as plain integers and never decides allocation.

mod attention;
mod cascade;
mod context;
mod error;
mod kernel;
mod kernels;
mod kv_cache;
mod mla;
/// The uniform structs the shaders read (the shader tests check their
/// layout against `shaders/common.wgsl`): not API.
#[doc(hidden)]
pub mod params;
mod plan;
/// WGSL composition (`shader::source`), for the shader tests, the bench
/// and `examples/shaders.rs`: not API an engine should rely on.
#[doc(hidden)]
pub mod shader;
mod swap;
mod transfer;
mod tune;
mod units;

/// The host packing of block tables (what a plan uploads), for the fuzz
/// targets and tests of its bounds: not API an engine needs.
#[doc(hidden)]
pub use attention::PackedTables;
pub use attention::{
    check_csr_tables, AttentionConfig, AttnOptions, PagedAttention, ShaderChecks, Split, MAX_BATCH,
    MAX_SEQ_LEN,
};
pub use cascade::{find_segments, Cascade, CascadeTables, CASCADE_MIN_SAVED_BYTES};
pub use context::{adapter_backends, parse_backends, Counters, Gpu};
pub use error::{
    BatchError, BindingError, GpuError, MlaError, OptionError, PlanMismatch, PoolError, ShapeError,
    TransferError,
};
pub use kernel::{Kernel, PORTABLE_WORKGROUP_BYTES};
/// Kernel plumbing for the benchmark in the CLI crate (`stream_read`): not
/// part of the API an engine should rely on.
#[doc(hidden)]
pub use kv_cache::{
    bind as bind_buffers, dispatch as dispatch_pass, pipeline as kv_cache_pipeline,
};
pub use kv_cache::{
    KvCache, KvCacheConfig, KvDtype, FP8_SCALE_RANGE, KV_MAX, K_OUTLIERS, K_OUTLIER_UNUSED,
    K_SMOOTHING_RANGE, MAX_KV_HEADS, MAX_LAYERS,
};
/// The MLA kernels' shapes and sources, for the shader tests and
/// `examples/shaders.rs`: not API an engine needs.
#[doc(hidden)]
pub use mla::{mla_source, MlaShape, MLA_HEADS_PER_WORKGROUP, MLA_KERNELS, MLA_LANES};
pub use mla::{
    MlaAttention, MlaCache, MlaCacheConfig, MlaPlan, MLA_MAX_HEADS, MLA_MAX_LAYERS,
    MLA_MAX_QUERIES, MLA_MAX_ROW,
};
pub use plan::{
    ActDtype, AttentionPlan, DecodeTables, PrefillTables, WritePlan, CASCADE_AUTO,
    CASCADE_CHUNK_TOKENS, SERIAL_CASCADE_AUTO,
};
pub use swap::{SwapSpace, MAX_SWAP_BYTES};
pub use transfer::{KvLayout, KV_LAYOUT_BYTES, KV_LAYOUT_VERSION};
pub use tune::{TuneReport, Tuner};
pub use units::{ComputeUnits, UnitsSource, KNOWN_ADAPTERS};
