//! Plan, then run: a step's host work done once, so that recording each
//! layer only binds and dispatches.
//!
//! Per step, an engine
//! 1. plans the attention of the batch ([`PagedAttention::plan_decode`] or
//!    [`PagedAttention::plan_prefill`]): the tables are validated, packed and
//!    written into a buffer the [`AttentionPlan`] owns and reuses (grown
//!    geometrically), split-K is chosen and its workspace sized, and one
//!    uniform per option set ("variant": e.g. full and sliding-window
//!    layers) is written;
//! 2. plans the cache side ([`KvCache::plan_write`]): the new tokens' slots
//!    and the copy-on-write list, into buffers a [`WritePlan`] reuses;
//! 3. records every layer ([`KvCache::run_copy_blocks`] once, then per layer
//!    [`KvCache::run_write_kv`] and [`PagedAttention::run`]) into its own
//!    encoder, with its own buffers as `wgpu::BufferBinding`s (offsets into
//!    an arena, and a row stride for a fused QKV output, are fine).
//!
//! Bind groups are cached by (layer, variant, buffer ranges): once buffers
//! and batch shape settle, a step creates no buffer and no bind group
//! ([`Gpu::counters`] shows it; `tests/gpu/embed.rs` checks it).

mod attention;
mod binding;
mod cascade;
mod mla;
mod tables;
mod types;
mod write;

pub use mla::MlaPlan;
pub(in crate::gpu) use tables::StepTables;
pub use tables::{DecodeTables, PrefillTables};
pub use types::AttentionPlan;
pub use write::{check_copies, WritePlan};
