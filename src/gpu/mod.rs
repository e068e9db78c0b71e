//! The GPU layer (wgpu): device, the paged KV pool, and the kernels.
//! It takes block tables, slot mappings and copy lists from
//! [`blocks`](crate::blocks) as plain integers and never decides allocation.

// Floors, each importing only those below it: `dtype`, `kernel`, `params`,
// `units`, `cascade`, `error`, `template`; `compose` (shapes, WGSL composition);
// `context` (the device); `kernels` (one module per kernel, its registry);
// `pass` (pipelines, bind groups, passes); `kv_cache`, `mla`;
// `attention`; `plan`; `host`, `swap`, `transfer`, `tune`.
mod attention;
mod cascade;
mod compose;
mod context;
mod dtype;
mod error;
mod host;
mod kernel;
mod kernels;
mod kv_cache;
mod mla;
/// The uniform structs the shaders read (the shader tests check their
/// layout against `shaders/common.wgsl`): not API.
#[doc(hidden)]
pub mod params;
mod pass;
mod plan;
mod swap;
mod template;
mod transfer;
mod tune;
mod units;

/// WGSL as compiled (`shader::source`), for the shader tests, the bench
/// and `examples/shaders.rs`: not API an engine should rely on. The
/// composition is `compose.rs`; what each kernel adds is its module's.
#[doc(hidden)]
pub mod shader {
    pub use super::compose::{
        balanced_head_tile, compose_file, imports, prelude, Family, Shader, ShaderEntry,
        ShaderShape, COMMON, IMPORTS, REGISTRY, SHARED,
    };
    pub use super::kernels::lanes::lanes_per_token;
    pub use super::kernels::rows::workgroup_size as rows_workgroup_size;
    pub use super::kernels::serial::workgroup_size as serial_workgroup_size;
    pub use super::kernels::source;
    pub use super::kernels::stream::wide as stream_wide;
}

/// The host packing of block tables (what a plan uploads), for the fuzz
/// targets and tests of its bounds: not API an engine needs.
#[doc(hidden)]
pub use attention::PackedTables;
pub use attention::{
    check_csr_tables, AttentionConfig, AttnOptions, PagedAttention, ShaderChecks, Split, MAX_BATCH,
    MAX_SEQ_LEN,
};
pub use cascade::{
    find_segments, Cascade, CASCADE_AUTO, CASCADE_CHUNK_TOKENS, CASCADE_MIN_SAVED_BYTES,
    SERIAL_CASCADE_AUTO,
};
pub use context::{adapter_backends, parse_backends, Counters, Gpu};
pub use dtype::{ActDtype, KvDtype};
pub use error::{
    BatchError, BindingError, GpuError, MlaError, OptionError, PlanMismatch, PoolError, ShapeError,
    TransferError,
};
pub use kernel::{Kernel, PORTABLE_WORKGROUP_BYTES};
pub use kv_cache::{
    KvCache, KvCacheConfig, FP8_SCALE_RANGE, KV_MAX, K_OUTLIERS, K_OUTLIER_UNUSED,
    K_SMOOTHING_RANGE, MAX_KV_HEADS, MAX_LAYERS,
};
/// The MLA kernels' shapes and sources, for the shader tests and
/// `examples/shaders.rs`: not API an engine needs.
#[doc(hidden)]
pub use mla::{mla_source, MlaShape, MLA_HEADS_PER_WORKGROUP, MLA_LANES};
pub use mla::{
    MlaAttention, MlaCache, MlaCacheConfig, MLA_MAX_HEADS, MLA_MAX_LAYERS, MLA_MAX_QUERIES,
};
/// Kernel plumbing for the benchmark in the CLI crate (`stream_read`): not
/// part of the API an engine should rely on.
#[doc(hidden)]
pub use pass::{
    bind as bind_buffers, dispatch as dispatch_pass, dispatches_recorded, pipeline_from_file,
};
pub use plan::{check_copies, AttentionPlan, DecodeTables, MlaPlan, PrefillTables, WritePlan};
pub use swap::SwapSpace;
pub use transfer::{check_import_payload, KvLayout, KV_LAYOUT_BYTES, KV_LAYOUT_VERSION};
pub use tune::{TuneReport, Tuner};
pub use units::ComputeUnits;
