//! The attention plan and what it holds: tables, split-K choices, the
//! cascade's segments, bind groups by pass.

use super::binding::{Grow, RangeKey};
use std::collections::HashMap;

use crate::gpu::attention::PackedMeta;
use crate::gpu::cascade::CascadeTables;
use crate::gpu::dtype::ActDtype;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Decode,
    Prefill,
}

/// The passes of one attention run, each with its own bind group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Pass {
    /// Decode or prefill (split or not).
    Main,
    /// The cascade's segment pass.
    Segments,
    /// The split-K merge.
    Reduce,
}

#[derive(Clone, PartialEq, Eq, Hash)]
pub(super) struct GroupKey {
    /// The cache whose layer buffers the group binds.
    pub(super) cache: u64,
    pub(super) layer: u32,
    pub(super) variant: usize,
    /// Which of the step's passes binds it.
    pub(super) pass: Pass,
    pub(super) act: ActDtype,
    /// Bind groups belong to one pipeline's layout.
    pub(super) prefill: bool,
    pub(super) split: bool,
    pub(super) q: RangeKey,
    pub(super) out: RangeKey,
}

/// One step's attention, planned by a [`PagedAttention`]: its tables on the
/// GPU, split-K workspace and per-variant parameters, reused from step to
/// step. Make one with [`PagedAttention::plan`] and keep it.
pub struct AttentionPlan {
    pub(super) owner: u64,
    pub(super) kind: Option<Kind>,
    /// The cache and its write step this plan first ran on since it was
    /// planned: later runs must name the same (see [`PlanMismatch`]).
    pub(super) bound: Option<(u64, u64)>,
    pub(super) meta: PackedMeta,
    pub(super) num_queries: u32,
    pub(super) words: Vec<u32>,
    pub(super) tables: Grow,
    pub(super) acc: Grow,
    pub(super) ml: Grow,
    pub(super) variants: usize,
    /// Per variant: (partition tokens, partitions).
    pub(super) splits: Vec<(u32, u32)>,
    pub(super) params: Vec<wgpu::Buffer>,
    pub(super) q_stride: u32,
    pub(super) act: ActDtype,
    /// Pipelines for this plan's activations: (unsplit or prefill,
    /// split-K partials, reduce).
    pub(super) pipes: Option<[wgpu::ComputePipeline; 3]>,
    pub(super) groups: HashMap<GroupKey, wgpu::BindGroup>,
    pub(super) kv_bytes: u64,
    /// The cascade of this step, when it uses one.
    pub(super) cascade: Option<CascadeStep>,
    /// Reused cascade tables buffer and params (kept across steps).
    pub(super) c_tables: Grow,
    pub(super) c_params: Vec<wgpu::Buffer>,
    pub(super) c_words: Vec<u32>,
}

/// The cascade a step takes: its segments and the kernel of their pass.
pub(super) struct CascadeChoice {
    pub(super) t: CascadeTables,
    /// The segment pass (its kernel, shape and query rows per tile).
    pub(super) seg: crate::gpu::kernels::SegmentPass,
}

/// Each variant's split, as `variant_splits` chose it.
pub(super) struct Splits {
    /// (partition tokens, partitions or partial slots) per variant.
    pub(super) parts: Vec<(u32, u32)>,
    /// Where each variant's ALiBi slopes start in the packed words.
    pub(super) slopes_offs: Vec<u32>,
    /// Where each variant's sink logits start (0: none).
    pub(super) sinks_offs: Vec<u32>,
    /// With a cascade: each variant's partitions of the suffix pass.
    pub(super) suffix_parts: Vec<u32>,
    /// Rows of partials the largest split needs (0: none splits).
    pub(super) max_rows: u64,
}

/// A planned cascade: shared segments attended once (attention_rows.wgsl
/// where decode runs `lanes`, the cascade mode of attention_serial.wgsl
/// where it runs `serial`, else of attention.wgsl), suffixes split, all
/// merged by reduce.
pub(super) struct CascadeStep {
    /// Query tiles of the segment pass (tiles of query slots, for `serial`).
    pub(super) num_tiles: u32,
    /// Where the segment pass runs on the serial kernel: its invocations
    /// per workgroup (a flattened grid); `None` on the rows and tiled ones.
    pub(super) serial_wg: Option<u32>,
    /// Head tiles per KV head of the rows or tiled segment pass.
    pub(super) head_tiles: u32,
    /// The segment pass's pipeline (f32 partials): the rows kernel's
    /// shape, the serial kernel with its query slots, or the tiled
    /// kernel's prefill shape.
    pub(super) pipe: wgpu::ComputePipeline,
    /// K/V bytes one layer reads with the cascade, and plain decode would.
    pub(super) bytes: (u64, u64),
    pub(super) segments: usize,
}

impl AttentionPlan {
    /// The element type of Q and of the output (default f32). Takes effect
    /// at the next `plan_decode` / `plan_prefill`.
    pub fn set_activations(&mut self, act: ActDtype) {
        self.act = act;
        self.kind = None;
    }

    /// Elements from one query's row of Q to the next, for Q read straight
    /// from a fused QKV output; `None` (the default): rows are packed,
    /// `num_heads * head_dim` apart. A multiple of 4, at least that. Takes
    /// effect at the next plan (the plan must be made again).
    pub fn set_q_stride(&mut self, floats: Option<u32>) {
        self.q_stride = floats.unwrap_or(0);
        self.kind = None;
    }

    /// Query rows the plan covers (sequences for decode).
    pub fn num_queries(&self) -> u32 {
        self.num_queries
    }

    /// Whether some variant splits the KV range (split-K).
    pub fn splits(&self) -> bool {
        self.splits.iter().any(|s| s.0 != 0)
    }

    /// Bytes of K and V one layer reads for this plan (window ignored):
    /// with a cascade, the shared segments once and the suffixes.
    pub fn kv_bytes_per_layer(&self) -> u64 {
        self.cascade.as_ref().map_or(self.kv_bytes, |c| c.bytes.0)
    }

    /// With a cascade (shared prefixes read once): (K/V bytes one layer
    /// reads, bytes plain decode would read, shared segments). `None`: this
    /// step runs plain paged decode.
    pub fn cascade(&self) -> Option<(u64, u64, usize)> {
        self.cascade
            .as_ref()
            .map(|c| (c.bytes.0, c.bytes.1, c.segments))
    }
}
