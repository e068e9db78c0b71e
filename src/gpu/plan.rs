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

use std::collections::HashMap;

use super::attention::{pack_into, AttnOptions, PackedMeta, PagedAttention};
use super::cascade::{
    find_segments, Cascade, CascadeTables, CASCADE_AUTO, CASCADE_CHUNK_TOKENS, SERIAL_CASCADE_AUTO,
    SERIAL_CASCADE_CHUNK_TOKENS,
};
use super::compose::ShaderShape;
use super::context::Gpu;
use super::dtype::ActDtype;
use super::error::{BatchError, BindingError, GpuError, PlanMismatch, PoolError};
use super::kernel::Kernel;
use super::kernels::{self, serial, SegmentFamily};
use super::kv_cache::KvCache;
use super::params;
use super::pass::{bind_ranges, dispatch, grid_1d, pipeline};

/// The first slot written twice in `slots` (`SKIP_WRITE` aside), found by
/// sorting a copy in `scratch`.
pub(crate) fn duplicate_slot(slots: &[u32], scratch: &mut Vec<u32>) -> Option<u32> {
    if slots.len() < 2 {
        return None;
    }
    scratch.clear();
    scratch.extend(
        slots
            .iter()
            .copied()
            .filter(|&s| s != crate::blocks::SKIP_WRITE),
    );
    scratch.sort_unstable();
    scratch.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}

/// A buffer the library owns and reuses, reallocated (to twice what is
/// needed) only when too small.
#[derive(Default)]
struct Grow {
    buf: Option<wgpu::Buffer>,
}

impl Grow {
    /// Makes room for `bytes`; true when the buffer was (re)allocated.
    fn ensure(&mut self, gpu: &Gpu, label: &str, bytes: u64) -> Result<bool, GpuError> {
        let bytes = bytes.max(4096);
        if self.buf.as_ref().is_some_and(|b| b.size() >= bytes) {
            return Ok(false);
        }
        let want = bytes
            .saturating_mul(2)
            .min(gpu.max_binding_bytes())
            .max(bytes);
        self.buf = Some(gpu.storage(label, want)?);
        Ok(true)
    }

    fn get(&self) -> &wgpu::Buffer {
        self.buf.as_ref().expect("ensured before use")
    }
}

/// A buffer range as a cache key: which buffer, where, how much.
#[derive(Clone, PartialEq, Eq, Hash)]
struct RangeKey(wgpu::Buffer, u64, Option<u64>);

impl RangeKey {
    fn of(b: &wgpu::BufferBinding) -> Self {
        Self(b.buffer.clone(), b.offset, b.size.map(|s| s.get()))
    }
}

/// A bind group of an engine's buffer ranges, made in an error scope so
/// that a buffer wgpu refuses (one from another device or instance, say)
/// is an error on this call, not a panic or an error for someone else.
fn bind_checked(
    gpu: &Gpu,
    pipeline: &wgpu::ComputePipeline,
    bindings: &[wgpu::BufferBinding],
) -> Result<wgpu::BindGroup, GpuError> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            gpu.scoped_blocking(|| bind_ranges(gpu, pipeline, bindings))
        }));
        match made {
            Ok(Ok(bg)) => Ok(bg),
            Ok(Err(GpuError::Validation(m))) => Err(GpuError::Binding {
                which: "bindings",
                problem: BindingError::Refused(m),
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(GpuError::Binding {
                which: "bindings",
                problem: BindingError::Unresolved,
            }),
        }
    }
    #[cfg(target_arch = "wasm32")]
    {
        Ok(bind_ranges(gpu, pipeline, bindings))
    }
}

/// Bytes a binding covers.
fn binding_bytes(b: &wgpu::BufferBinding) -> u64 {
    match b.size {
        Some(s) => s.get(),
        None => b.buffer.size().saturating_sub(b.offset),
    }
}

/// Checks an engine buffer range before anything is recorded: STORAGE
/// usage, an offset the device can bind, inside the buffer, and at least
/// `need` bytes.
fn check_binding(
    gpu: &Gpu,
    what: &'static str,
    b: &wgpu::BufferBinding,
    need: u64,
) -> Result<(), GpuError> {
    let bad = |problem| {
        Err(GpuError::Binding {
            which: what,
            problem,
        })
    };
    if !b.buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
        return bad(BindingError::NotStorage {
            usage: format!("{:?}", b.buffer.usage()),
        });
    }
    let align = gpu.limits.min_storage_buffer_offset_alignment as u64;
    if !b.offset.is_multiple_of(align) {
        return bad(BindingError::Misaligned {
            offset: b.offset,
            align,
        });
    }
    let end = b.offset.checked_add(binding_bytes(b));
    if end.is_none_or(|e| e > b.buffer.size()) || b.offset > b.buffer.size() {
        return bad(BindingError::PastEnd {
            offset: b.offset,
            size: binding_bytes(b),
            buffer: b.buffer.size(),
        });
    }
    if binding_bytes(b) < need {
        return bad(BindingError::TooSmall {
            bound: binding_bytes(b),
            needed: need,
        });
    }
    if binding_bytes(b) > gpu.max_binding_bytes() {
        return bad(BindingError::OverLimit {
            bound: binding_bytes(b),
            limit: gpu.max_binding_bytes(),
        });
    }
    Ok(())
}

/// Decode tables, from a batch view: sequence `i` owns
/// `kv_indices[kv_indptr[i]..kv_indptr[i + 1]]`, holds `seq_lens[i]` tokens
/// (its new token included), and has one query, at position
/// `seq_lens[i] - 1`.
#[derive(Clone, Copy, Debug)]
pub struct DecodeTables<'a> {
    /// `num_seqs + 1` offsets into `kv_indices`.
    pub kv_indptr: &'a [u32],
    /// Physical block ids.
    pub kv_indices: &'a [u32],
    /// Tokens held by each sequence, the new one included.
    pub seq_lens: &'a [u32],
}

impl<'a> DecodeTables<'a> {
    /// The decode tables of a batch view.
    pub fn from_view(v: &'a crate::blocks::BatchView) -> Self {
        Self {
            kv_indptr: &v.kv_indptr,
            kv_indices: &v.kv_indices,
            seq_lens: &v.seq_lens,
        }
    }
}

/// Prefill tables (chunked prefill, and mixed steps): sequence `i` has
/// queries `qo_indptr[i]..qo_indptr[i + 1]`, its newest positions (a chunk
/// of `qo_len` tokens at positions `seq_lens[i] - qo_len ..`), which attend
/// causally to its whole paged context including the chunk.
#[derive(Clone, Copy, Debug)]
pub struct PrefillTables<'a> {
    /// `num_seqs + 1` offsets into `kv_indices`.
    pub kv_indptr: &'a [u32],
    /// Physical block ids.
    pub kv_indices: &'a [u32],
    /// Tokens held by each sequence, the chunk included.
    pub seq_lens: &'a [u32],
    /// `num_seqs + 1` offsets into the query rows.
    pub qo_indptr: &'a [u32],
}

impl<'a> PrefillTables<'a> {
    /// The prefill tables of a batch view: the queries are the tokens each
    /// sequence gained since its previous view (`new_indptr`), so a view
    /// mixing new prompts (or chunks) and decodes is one prefill.
    pub fn from_view(v: &'a crate::blocks::BatchView) -> Self {
        Self {
            kv_indptr: &v.kv_indptr,
            kv_indices: &v.kv_indices,
            seq_lens: &v.seq_lens,
            qo_indptr: &v.new_indptr,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Decode,
    Prefill,
}

/// The passes of one attention run, each with its own bind group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Pass {
    /// Decode or prefill (split or not).
    Main,
    /// The cascade's segment pass.
    Segments,
    /// The split-K merge.
    Reduce,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct GroupKey {
    /// The cache whose layer buffers the group binds.
    cache: u64,
    layer: u32,
    variant: usize,
    /// Which of the step's passes binds it.
    pass: Pass,
    act: ActDtype,
    /// Bind groups belong to one pipeline's layout.
    prefill: bool,
    split: bool,
    q: RangeKey,
    out: RangeKey,
}

/// One step's attention, planned by a [`PagedAttention`]: its tables on the
/// GPU, split-K workspace and per-variant parameters, reused from step to
/// step. Make one with [`PagedAttention::plan`] and keep it.
pub struct AttentionPlan {
    owner: u64,
    kind: Option<Kind>,
    /// The cache and its write step this plan first ran on since it was
    /// planned: later runs must name the same (see [`PlanMismatch`]).
    bound: Option<(u64, u64)>,
    meta: PackedMeta,
    num_queries: u32,
    words: Vec<u32>,
    tables: Grow,
    acc: Grow,
    ml: Grow,
    variants: usize,
    /// Per variant: (partition tokens, partitions).
    splits: Vec<(u32, u32)>,
    params: Vec<wgpu::Buffer>,
    q_stride: u32,
    act: ActDtype,
    /// Pipelines for this plan's activations: (unsplit or prefill,
    /// split-K partials, reduce).
    pipes: Option<[wgpu::ComputePipeline; 3]>,
    groups: HashMap<GroupKey, wgpu::BindGroup>,
    kv_bytes: u64,
    /// The cascade of this step, when it uses one.
    cascade: Option<CascadeStep>,
    /// Reused cascade tables buffer and params (kept across steps).
    c_tables: Grow,
    c_params: Vec<wgpu::Buffer>,
    c_words: Vec<u32>,
}

/// Which kernel runs a cascade's segment pass: the decode kernel's family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SegPass {
    /// `attention_serial.wgsl` with query slots (software adapters).
    Serial,
    /// `attention_rows.wgsl` in this shape (GPUs, where decode runs `lanes`).
    Rows(ShaderShape),
    /// `attention.wgsl` in its prefill shape.
    Tiled,
}

/// A step's tables as `plan_any` takes them: decode without `qo_indptr`.
pub(super) struct StepTables<'a> {
    pub(super) kv_indptr: &'a [u32],
    pub(super) kv_indices: &'a [u32],
    pub(super) seq_lens: &'a [u32],
    pub(super) qo_indptr: Option<&'a [u32]>,
}

impl<'a> StepTables<'a> {
    pub(super) fn decode(kv_indptr: &'a [u32], kv_indices: &'a [u32], seq_lens: &'a [u32]) -> Self {
        Self {
            kv_indptr,
            kv_indices,
            seq_lens,
            qo_indptr: None,
        }
    }
}

/// The cascade a step takes: its segments and the kernel of their pass.
struct CascadeChoice {
    t: CascadeTables,
    seg: SegPass,
    /// Queries per tile (query slots, for `serial`) of the segment pass.
    seg_qtile: u32,
}

/// Each variant's split, as `variant_splits` chose it.
struct Splits {
    /// (partition tokens, partitions or partial slots) per variant.
    parts: Vec<(u32, u32)>,
    /// Where each variant's ALiBi slopes start in the packed words.
    slopes_offs: Vec<u32>,
    /// Where each variant's sink logits start (0: none).
    sinks_offs: Vec<u32>,
    /// With a cascade: each variant's partitions of the suffix pass.
    suffix_parts: Vec<u32>,
    /// Rows of partials the largest split needs (0: none splits).
    max_rows: u64,
}

/// A planned cascade: shared segments attended once (attention_rows.wgsl
/// where decode runs `lanes`, the cascade mode of attention_serial.wgsl
/// where it runs `serial`, else of attention.wgsl), suffixes split, all
/// merged by reduce.
struct CascadeStep {
    /// Query tiles of the segment pass (tiles of query slots, for `serial`).
    num_tiles: u32,
    /// Where the segment pass runs on the serial kernel: its invocations
    /// per workgroup (a flattened grid); `None` on the rows and tiled ones.
    serial_wg: Option<u32>,
    /// Head tiles per KV head of the rows or tiled segment pass.
    head_tiles: u32,
    /// The segment pass's pipeline (f32 partials): the rows kernel's
    /// shape, the serial kernel with its query slots, or the tiled
    /// kernel's prefill shape.
    pipe: wgpu::ComputePipeline,
    /// K/V bytes one layer reads with the cascade, and plain decode would.
    bytes: (u64, u64),
    segments: usize,
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

impl PagedAttention {
    /// An empty plan for this kernel, to fill with
    /// [`plan_decode`](Self::plan_decode) or
    /// [`plan_prefill`](Self::plan_prefill) each step.
    pub fn plan(&self) -> AttentionPlan {
        AttentionPlan {
            owner: self.id,
            kind: None,
            bound: None,
            meta: PackedMeta::default(),
            num_queries: 0,
            words: Vec::new(),
            tables: Grow::default(),
            acc: Grow::default(),
            ml: Grow::default(),
            variants: 0,
            splits: Vec::new(),
            params: Vec::new(),
            q_stride: 0,
            act: ActDtype::F32,
            pipes: None,
            groups: HashMap::new(),
            kv_bytes: 0,
            cascade: None,
            c_tables: Grow::default(),
            c_params: Vec::new(),
            c_words: Vec::new(),
        }
    }

    /// The pipelines a plan of `act` activations and `kind` runs:
    /// (unsplit or prefill, split-K partials, reduce).
    fn pipes_for(
        &self,
        gpu: &Gpu,
        act: ActDtype,
        prefill: bool,
    ) -> Result<[wgpu::ComputePipeline; 3], GpuError> {
        let f16 = act != ActDtype::F32;
        let act_bf16 = act == ActDtype::Bf16;
        let (name, shape) = if prefill {
            ("attention", self.prefill_shape)
        } else {
            (kernels::decode(self.kernel).shader(), self.decode_shape)
        };
        if !f16 {
            let main = if prefill {
                self.prefill_pipeline(gpu)?.clone()
            } else {
                self.decode_pipeline(gpu)?.clone()
            };
            return Ok([main.clone(), main, self.reduce.clone()]);
        }
        let base = ShaderShape {
            q_f16: true,
            out_f16: true,
            act_bf16,
            ..shape
        };
        let main = pipeline(gpu, name, &base)?;
        let split = pipeline(
            gpu,
            name,
            &ShaderShape {
                out_f16: false,
                ..base
            },
        )?;
        let reduce = pipeline(
            gpu,
            "reduce",
            &ShaderShape {
                qtile: 1,
                q_f16: false,
                out_f16: true,
                act_bf16,
                ..self.prefill_shape
            },
        )?;
        Ok([main, split, reduce])
    }

    /// Compiles every pipeline a step of this kernel can need for each of
    /// `acts` (the activation dtypes the engine's plans use): decode,
    /// split-K and its reduction, and prefill, so that no step pays for a
    /// compile.
    pub fn warm_up(&self, gpu: &Gpu, acts: &[ActDtype]) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        self.decode_pipeline(gpu)?;
        self.prefill_pipeline(gpu)?;
        for &act in acts {
            self.pipes_for(gpu, act, false)?;
            self.pipes_for(gpu, act, true)?;
        }
        Ok(())
    }

    /// Plans a decode step: validates the tables against this kernel's pool
    /// and every variant's options, packs and uploads the tables, chooses
    /// split-K per variant and sizes its workspace. Nothing is recorded; on
    /// an error the plan is left empty (no run until planned again).
    pub fn plan_decode(
        &self,
        gpu: &Gpu,
        plan: &mut AttentionPlan,
        t: &DecodeTables,
        variants: &[AttnOptions],
    ) -> Result<(), GpuError> {
        let t = StepTables::decode(t.kv_indptr, t.kv_indices, t.seq_lens);
        self.plan_any(gpu, plan, &t, variants, true)
    }

    /// Plans a prefill (or mixed prefill and decode) step; see
    /// [`plan_decode`](Self::plan_decode). Compiles the prefill pipeline if
    /// [`warm_up`](Self::warm_up) did not.
    pub fn plan_prefill(
        &self,
        gpu: &Gpu,
        plan: &mut AttentionPlan,
        t: &PrefillTables,
        variants: &[AttnOptions],
    ) -> Result<(), GpuError> {
        self.prefill_pipeline(gpu)?;
        let t = StepTables {
            kv_indptr: t.kv_indptr,
            kv_indices: t.kv_indices,
            seq_lens: t.seq_lens,
            qo_indptr: Some(t.qo_indptr),
        };
        self.plan_any(gpu, plan, &t, variants, true)
    }

    /// Plans a decode step from tables that are not checked against the
    /// pool: only what the packing itself needs (batch and length limits,
    /// u32 offsets) is enforced, and no cascade is sought. For tests of
    /// the kernels' own bounds (entries outside the pool, offsets past the
    /// indices, lengths past a table are skipped or clipped by the
    /// shaders); an engine uses [`plan_decode`](Self::plan_decode).
    #[doc(hidden)]
    pub fn plan_decode_unchecked(
        &self,
        gpu: &Gpu,
        plan: &mut AttentionPlan,
        t: &DecodeTables,
        variants: &[AttnOptions],
    ) -> Result<(), GpuError> {
        let t = StepTables::decode(t.kv_indptr, t.kv_indices, t.seq_lens);
        self.plan_any(gpu, plan, &t, variants, false)
    }

    /// Plans a step: checks it, chooses the cascade, packs and uploads the
    /// tables, chooses each variant's split and writes its uniform, and
    /// plans the cascade's segment pass. On an error the plan holds no step.
    pub(super) fn plan_any(
        &self,
        gpu: &Gpu,
        plan: &mut AttentionPlan,
        t: &StepTables,
        variants: &[AttnOptions],
        checked: bool,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        if plan.owner != self.id {
            return Err(GpuError::Plan(PlanMismatch::OtherAttention));
        }
        plan.kind = None;
        plan.bound = None;
        gpu.alive()?;
        let num_queries = self.check_step(plan, t, variants, checked)?;
        let cascade = match checked {
            true => self.choose_cascade(gpu, t, variants)?,
            false => None,
        };
        let (ip, ix, ln) = match &cascade {
            Some(c) => (
                &c.t.suffix_indptr[..],
                &c.t.suffix_indices[..],
                &c.t.suffix_lens[..],
            ),
            None => (t.kv_indptr, t.kv_indices, t.seq_lens),
        };
        let qtile = self.prefill_shape.qtile;
        let meta = pack_into(
            &mut plan.words,
            ip,
            ix,
            ln,
            None,
            t.qo_indptr.map(|q| (q, qtile)),
        )?;
        let splits = self.variant_splits(gpu, plan, t, &meta, cascade.as_ref(), variants)?;
        let pipes = self.pipes_for(gpu, plan.act, t.qo_indptr.is_some())?;
        // GPU side: nothing above failed, so the plan can change now.
        plan.pipes = Some(pipes);
        self.upload_step(gpu, plan, &meta, num_queries, &splits, variants)?;
        plan.cascade = None;
        if let Some(c) = &cascade {
            plan.cascade = Some(self.plan_segments(gpu, plan, c, &splits, variants)?);
        }
        // K and V of every token, side words (quantized scales) included:
        // the same count the cascade's figures use.
        plan.kv_bytes = t
            .seq_lens
            .iter()
            .map(|&l| l as u64 * self.bytes_per_token())
            .sum();
        plan.splits = splits.parts;
        plan.variants = variants.len();
        plan.meta = meta;
        plan.num_queries = num_queries;
        plan.kind = Some(if t.qo_indptr.is_some() {
            Kind::Prefill
        } else {
            Kind::Decode
        });
        Ok(())
    }

    /// K and V bytes one token takes in the pool (side words included).
    fn bytes_per_token(&self) -> u64 {
        let c = &self.cache_cfg;
        c.block_bytes() / c.block_size as u64
    }

    /// Checks a step's variants, tables (when `checked`), queries and Q
    /// stride; returns its query rows.
    fn check_step(
        &self,
        plan: &AttentionPlan,
        t: &StepTables,
        variants: &[AttnOptions],
        checked: bool,
    ) -> Result<u32, GpuError> {
        if variants.is_empty() {
            return Err(BatchError::NoVariant.into());
        }
        for o in variants {
            self.check_options(o)?;
        }
        if checked {
            self.check_tables(t.kv_indptr, t.kv_indices, t.seq_lens)?;
        }
        let n = t.seq_lens.len();
        let num_queries = match t.qo_indptr {
            None => n as u32,
            Some(qo) => {
                if qo.len() != n + 1 || qo[0] != 0 || qo.windows(2).any(|w| w[0] > w[1]) {
                    return Err(BatchError::QoIndptr { need: n as u64 + 1 }.into());
                }
                if let Some(s) = (0..n).find(|&s| qo[s + 1] - qo[s] > t.seq_lens[s]) {
                    return Err(BatchError::MoreQueries {
                        seq: s as u32,
                        queries: qo[s + 1] - qo[s],
                        tokens: t.seq_lens[s],
                    }
                    .into());
                }
                qo[n]
            }
        };
        let row4 = self.num_heads * (self.head_dim / 4);
        if plan.q_stride != 0 && (!plan.q_stride.is_multiple_of(4) || plan.q_stride / 4 < row4) {
            return Err(BatchError::Stride {
                what: "q",
                stride: plan.q_stride,
                row: row4 * 4,
            }
            .into());
        }
        Ok(num_queries)
    }

    /// The kernel of the cascade's segment pass: the decode kernel's
    /// family, with its query slots or tile.
    fn segment_pass(&self, gpu: &Gpu) -> (SegPass, u32) {
        let seg = match kernels::decode(self.kernel).segment_family() {
            SegmentFamily::Serial => SegPass::Serial,
            SegmentFamily::Rows => {
                kernels::rows::shape(gpu, &self.decode_shape).map_or(SegPass::Tiled, SegPass::Rows)
            }
            SegmentFamily::Tiled => SegPass::Tiled,
        };
        // Queries per tile of the segment pass.
        let qtile = match seg {
            SegPass::Serial => serial::cascade_queries(&self.decode_shape),
            SegPass::Rows(rs) => rs.qtile,
            SegPass::Tiled => self.prefill_shape.qtile,
        };
        (seg, qtile)
    }

    /// Cascade (decode): shared segments from the tables, used when a
    /// variant forces it or the cost model pays; the main tables then hold
    /// each sequence's private suffix. The segment pass runs on the decode
    /// kernel's family: the serial kernel where that is the decode kernel
    /// (software adapters), the rows kernel where it is `lanes` (GPUs),
    /// else the tiled kernel in its multi-query (prefill) shape. Auto may
    /// take the cascade on the serial kernel (SERIAL_CASCADE_AUTO) and,
    /// where CASCADE_AUTO allows, on the rows kernel: the search is skipped
    /// otherwise.
    fn choose_cascade(
        &self,
        gpu: &Gpu,
        t: &StepTables,
        variants: &[AttnOptions],
    ) -> Result<Option<CascadeChoice>, GpuError> {
        let forced = variants.iter().any(|o| o.cascade == Cascade::On);
        let (seg, seg_qtile) = self.segment_pass(gpu);
        let may_auto = match seg {
            SegPass::Serial => SERIAL_CASCADE_AUTO,
            SegPass::Rows(_) => CASCADE_AUTO && !gpu.is_software(),
            SegPass::Tiled => false,
        };
        let n = t.seq_lens.len();
        if t.qo_indptr.is_some()
            || n < 2
            || variants.iter().any(|o| o.cascade == Cascade::Off)
            // A segment's positions are relative to it: no sink tokens
            // (Cascade::On with them is refused by validate).
            || variants.iter().any(|o| o.sink_tokens.is_some())
            || !(forced || may_auto)
        {
            return Ok(None);
        }
        let chunk_tokens = match seg {
            SegPass::Serial => kernels::pass_cap(gpu, self.kernel, &self.decode_shape)
                .unwrap_or(u32::MAX)
                .min(SERIAL_CASCADE_CHUNK_TOKENS),
            SegPass::Rows(rs) => kernels::rows::pass_cap(gpu, &rs)
                .unwrap_or(u32::MAX)
                .min(self.cascade_chunk),
            SegPass::Tiled => kernels::pass_cap(gpu, Kernel::Tiled, &self.prefill_shape)
                .unwrap_or(u32::MAX)
                .min(CASCADE_CHUNK_TOKENS),
        };
        let tables = find_segments(
            self.num_blocks,
            self.block_size,
            t.kv_indptr,
            t.kv_indices,
            t.seq_lens,
            (chunk_tokens / self.block_size).max(1),
        );
        if tables.num_segments() == 0 {
            return Ok(None);
        }
        let partial = 2 * (self.head_dim as u64 * 4 + 8);
        let heads = self.num_heads as u64;
        // The serial segment pass pays in K/V loads (token visits), the
        // rows pass in bytes saved (see CASCADE_AUTO).
        let auto = may_auto
            && match seg {
                SegPass::Serial => tables.pays_serial(seg_qtile, self.bytes_per_token()),
                _ => tables.pays_gpu(self.bytes_per_token(), n as u64 * heads, partial),
            };
        // The rows and tiled passes take a workgroup per query tile in x.
        let tiles: u64 = (0..tables.num_segments())
            .map(|i| (tables.seg_qo[i + 1] - tables.seg_qo[i]).div_ceil(seg_qtile) as u64)
            .sum();
        if seg != SegPass::Serial && tiles > 65535 {
            if forced {
                return Err(BatchError::Dispatch {
                    what: "cascade query tiles (use Cascade::Auto or Off)",
                    count: tiles,
                    limit: 65535,
                }
                .into());
            }
            return Ok(None);
        }
        Ok((forced || auto).then_some(CascadeChoice {
            t: tables,
            seg,
            seg_qtile,
        }))
    }

    /// Each variant's split (partition tokens, partitions) and ALiBi
    /// slopes (appended to the packed words), and the rows of partials the
    /// largest split needs.
    fn variant_splits(
        &self,
        gpu: &Gpu,
        plan: &mut AttentionPlan,
        t: &StepTables,
        meta: &PackedMeta,
        cascade: Option<&CascadeChoice>,
        variants: &[AttnOptions],
    ) -> Result<Splits, GpuError> {
        let mut s = Splits {
            parts: std::mem::take(&mut plan.splits),
            slopes_offs: Vec::with_capacity(variants.len()),
            sinks_offs: Vec::with_capacity(variants.len()),
            suffix_parts: Vec::new(),
            max_rows: 0,
        };
        s.parts.clear();
        for o in variants {
            s.slopes_offs.push(plan.words.len() as u32);
            if let Some(sl) = &o.alibi_slopes {
                plan.words.extend(sl.iter().map(|x| x.to_bits()));
            }
            s.sinks_offs.push(match &o.sinks {
                Some(sk) => {
                    let at = plan.words.len() as u32;
                    plan.words.extend(sk.iter().map(|x| x.to_bits()));
                    at
                }
                None => 0,
            });
            let (pt, parts) = match t.qo_indptr {
                Some(_) => self.prefill_split(
                    gpu,
                    o.split,
                    meta.num_tiles,
                    meta.num_queries,
                    meta.max_len,
                )?,
                None => {
                    let (pt, parts) =
                        self.decode_split(gpu, o.split, meta.num_seqs, meta.max_len)?;
                    match cascade {
                        None => (pt, parts),
                        // Always partials (one partition when unsplit), and
                        // after the suffix's partitions one slot per
                        // segment depth, written by the segment pass.
                        Some(c) => {
                            let (pt, parts) = if pt == 0 {
                                (meta.max_len.max(1).div_ceil(64) * 64, 1)
                            } else {
                                (pt, parts)
                            };
                            s.suffix_parts.push(parts);
                            let slots = parts + c.t.max_depth;
                            if slots > 65535 {
                                return Err(BatchError::Dispatch {
                                    what: "partial slots",
                                    count: slots as u64,
                                    limit: 65535,
                                }
                                .into());
                            }
                            (pt, slots)
                        }
                    }
                }
            };
            // Sinks join the denominator where partials merge: one
            // partition of partials when the variant would not split.
            let (pt, parts) = match (pt, &o.sinks) {
                (0, Some(_)) => (meta.max_len.max(1).div_ceil(64) * 64, 1),
                _ => (pt, parts),
            };
            // The merge runs a workgroup per query row in x.
            if pt != 0 && meta.num_queries > 65535 {
                return Err(BatchError::Dispatch {
                    what: "query rows merged from partials",
                    count: meta.num_queries as u64,
                    limit: 65535,
                }
                .into());
            }
            if pt != 0 {
                let rows = meta.num_queries as u64 * self.num_heads as u64 * parts as u64;
                s.max_rows = s.max_rows.max(rows);
            }
            s.parts.push((pt, parts));
        }
        Ok(s)
    }

    /// Uploads the packed tables, sizes the split-K workspace and writes
    /// each variant's uniform.
    fn upload_step(
        &self,
        gpu: &Gpu,
        plan: &mut AttentionPlan,
        meta: &PackedMeta,
        num_queries: u32,
        splits: &Splits,
        variants: &[AttnOptions],
    ) -> Result<(), GpuError> {
        debug_assert_eq!(meta.num_queries, num_queries);
        let mut regrown = plan
            .tables
            .ensure(gpu, "plan tables", plan.words.len() as u64 * 4)?;
        gpu.queue
            .write_buffer(plan.tables.get(), 0, bytemuck::cast_slice(&plan.words));
        if splits.max_rows > 0 {
            let scratch = splits.max_rows * self.head_dim as u64 * 4;
            if scratch > gpu.max_binding_bytes() {
                return Err(BatchError::Partials {
                    bytes: scratch,
                    limit: gpu.max_binding_bytes(),
                }
                .into());
            }
            regrown |= plan.acc.ensure(gpu, "plan split acc", scratch)?;
            regrown |= plan.ml.ensure(gpu, "plan split ml", splits.max_rows * 8)?;
        }
        while plan.params.len() < variants.len() {
            let p = params::AttnParams::default();
            plan.params.push(gpu.uniform("plan params", &p)?);
        }
        if regrown {
            plan.groups.clear();
        }
        for (i, o) in variants.iter().enumerate() {
            let (pt, parts) = splits.parts[i];
            let mut p =
                self.params_for(o, meta, pt, parts, splits.slopes_offs[i], plan.q_stride / 4);
            p.sinks_off = splits.sinks_offs[i];
            gpu.queue
                .write_buffer(&plan.params[i], 0, bytemuck::bytes_of(&p));
        }
        Ok(())
    }

    /// The segment pass: its tables (segments as pseudo-sequences with
    /// their query tiles), the (row, position) map, per-variant slopes and
    /// slots, per-variant params, and its pipeline.
    fn plan_segments(
        &self,
        gpu: &Gpu,
        plan: &mut AttentionPlan,
        c: &CascadeChoice,
        splits: &Splits,
        variants: &[AttnOptions],
    ) -> Result<CascadeStep, GpuError> {
        let t = &c.t;
        let cmeta = pack_into(
            &mut plan.c_words,
            &t.seg_indptr,
            &t.seg_indices,
            &t.seg_lens,
            None,
            Some((&t.seg_qo, c.seg_qtile)),
        )?;
        let qmap_off = plan.c_words.len() as u32;
        plan.c_words.extend_from_slice(&t.qmap);
        let mut offs = Vec::with_capacity(variants.len());
        for (i, o) in variants.iter().enumerate() {
            let slopes_off = plan.c_words.len() as u32;
            if let Some(sl) = &o.alibi_slopes {
                plan.c_words.extend(sl.iter().map(|x| x.to_bits()));
            }
            let slot_off = plan.c_words.len() as u32;
            plan.c_words
                .extend(t.seg_depth.iter().map(|d| splits.suffix_parts[i] + d));
            offs.push((slopes_off, slot_off));
        }
        let regrown =
            plan.c_tables
                .ensure(gpu, "plan cascade tables", plan.c_words.len() as u64 * 4)?;
        if regrown {
            plan.groups.clear();
        }
        gpu.queue
            .write_buffer(plan.c_tables.get(), 0, bytemuck::cast_slice(&plan.c_words));
        while plan.c_params.len() < variants.len() {
            let p = params::AttnParams::default();
            plan.c_params.push(gpu.uniform("plan cascade params", &p)?);
        }
        for (i, o) in variants.iter().enumerate() {
            let parts = splits.parts[i].1;
            let mut p = self.params_for(o, &cmeta, 0, parts, offs[i].0, plan.q_stride / 4);
            p.qmap_off = qmap_off;
            p.slot_off = offs[i].1;
            // Positions are past the segment: the window is not cut to the
            // segment's length.
            p.sliding_window = o.sliding_window.unwrap_or(0);
            gpu.queue
                .write_buffer(&plan.c_params[i], 0, bytemuck::bytes_of(&p));
        }
        let q_f16 = plan.act != ActDtype::F32;
        let act_bf16 = plan.act == ActDtype::Bf16;
        let pipe = match c.seg {
            // The rows kernel (f32 partials).
            SegPass::Rows(rs) => pipeline(
                gpu,
                "attention_rows",
                &ShaderShape {
                    q_f16,
                    act_bf16,
                    ..rs
                },
            )?,
            // The serial kernel with its query slots (f32 partials; the
            // split pipeline itself when that is 1).
            SegPass::Serial => pipeline(
                gpu,
                kernels::decode(self.kernel).shader(),
                &ShaderShape {
                    qtile: c.seg_qtile,
                    q_f16,
                    out_f16: false,
                    act_bf16,
                    ..self.decode_shape
                },
            )?,
            SegPass::Tiled if !q_f16 => self.prefill_pipeline(gpu)?.clone(),
            SegPass::Tiled => pipeline(
                gpu,
                "attention",
                &ShaderShape {
                    q_f16: true,
                    out_f16: false,
                    act_bf16,
                    ..self.prefill_shape
                },
            )?,
        };
        let bpt = self.bytes_per_token();
        Ok(CascadeStep {
            num_tiles: cmeta.num_tiles,
            serial_wg: (c.seg == SegPass::Serial).then(|| serial::workgroup_size(c.seg_qtile)),
            head_tiles: match c.seg {
                SegPass::Rows(rs) => rs.head_tiles(),
                _ => self.prefill_shape.head_tiles(),
            },
            pipe,
            bytes: (t.cascade_tokens * bpt, t.plain_tokens * bpt),
            segments: t.num_segments(),
        })
    }

    /// Records one layer's attention of a planned step into `enc`: `q` holds
    /// the plan's query rows (`[num_queries][num_heads][head_dim]` f32, rows
    /// `set_q_stride` apart), `out` receives `[num_queries][num_heads][head_dim]`.
    /// `variant` indexes the options given to the plan. The bindings are
    /// checked (usage, alignment, size) before anything is recorded; bind
    /// groups are reused across steps.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        gpu: &Gpu,
        enc: &mut wgpu::CommandEncoder,
        plan: &mut AttentionPlan,
        cache: &KvCache,
        layer: u32,
        variant: usize,
        q: &wgpu::BufferBinding,
        out: &wgpu::BufferBinding,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        let kind = self.check_run(gpu, plan, cache, (layer, variant), q, out)?;
        plan.bound = Some((cache.id, cache.write_epoch()));
        if plan.num_queries == 0 || (kind == Kind::Prefill && plan.meta.num_tiles == 0) {
            return Ok(());
        }
        let [k, v] = cache.layer(layer)?;
        let (k, v) = (k.as_entire_buffer_binding(), v.as_entire_buffer_binding());
        let (pt, parts) = plan.splits[variant];
        let [main, split_pipe, reduce] = plan.pipes.clone().expect("planned");
        let key = GroupKey {
            cache: cache.id,
            layer,
            variant,
            pass: Pass::Main,
            act: plan.act,
            prefill: kind == Kind::Prefill,
            split: pt != 0,
            q: RangeKey::of(q),
            out: RangeKey::of(out),
        };
        if plan.groups.len() > 4096 {
            plan.groups.clear();
        }
        let params = plan.params[variant].as_entire_buffer_binding();
        let tables = plan.tables.get().as_entire_buffer_binding();
        let grid = |parts: u32| -> Result<(u32, u32, u32), GpuError> {
            match kind {
                Kind::Prefill => {
                    let units = self.num_kv_heads * self.prefill_shape.head_tiles();
                    Ok((plan.meta.num_tiles, units, parts))
                }
                Kind::Decode => self.decode_grid(plan.meta.num_seqs, parts),
            }
        };
        let (grid1, grid_parts) = (grid(1)?, grid(parts)?);
        if pt == 0 {
            // One pass writes the output.
            let unused = self.unused_ml.as_entire_buffer_binding();
            let entries = [params, q.clone(), k, v, tables, out.clone(), unused];
            let bg = cached_group(&mut plan.groups, key, gpu, &main, &entries)?;
            let label = match kind {
                Kind::Prefill => "prefill",
                Kind::Decode => "decode",
            };
            dispatch(enc, label, &main, bg, grid1);
            return Ok(());
        }
        // Split: partials per (query row, head, partition), then the merge.
        let acc = plan.acc.get().as_entire_buffer_binding();
        let ml = plan.ml.get().as_entire_buffer_binding();
        let entries = [
            params.clone(),
            q.clone(),
            k.clone(),
            v.clone(),
            tables.clone(),
            acc.clone(),
            ml.clone(),
        ];
        let bg = cached_group(&mut plan.groups, key.clone(), gpu, &split_pipe, &entries)?;
        dispatch(enc, "attention split", &split_pipe, bg, grid_parts);
        // Cascade: the shared segments, once for all their queries, into
        // their slots (after the suffix pass, which wrote empty partials there).
        if let (Kind::Decode, Some(c)) = (kind, &plan.cascade) {
            let ckey = GroupKey {
                pass: Pass::Segments,
                prefill: true,
                ..key.clone()
            };
            let entries = [
                plan.c_params[variant].as_entire_buffer_binding(),
                q.clone(),
                k,
                v,
                plan.c_tables.get().as_entire_buffer_binding(),
                acc.clone(),
                ml.clone(),
            ];
            let bg = cached_group(&mut plan.groups, ckey, gpu, &c.pipe, &entries)?;
            if c.num_tiles > 0 {
                let grid = match c.serial_wg {
                    Some(wg) => self.serial_grid(c.num_tiles, 1, wg)?,
                    None => (c.num_tiles, self.num_kv_heads * c.head_tiles, 1),
                };
                dispatch(enc, "cascade", &c.pipe, bg, grid);
            }
        }
        // The reduce's group: same key, another pass.
        let rkey = GroupKey {
            pass: Pass::Reduce,
            ..key
        };
        let entries = [params, acc, ml, out.clone(), tables];
        let bg = cached_group(&mut plan.groups, rkey, gpu, &reduce, &entries)?;
        let grid = (plan.num_queries, self.num_heads, 1);
        dispatch(enc, "reduce", &reduce, bg, grid);
        Ok(())
    }

    /// What `run` checks before recording anything: the cache, the plan's
    /// owner, step and cache, the layer and variant, and the bindings of
    /// `q` and `out`. Returns the plan's kind.
    fn check_run(
        &self,
        gpu: &Gpu,
        plan: &AttentionPlan,
        cache: &KvCache,
        (layer, variant): (u32, usize),
        q: &wgpu::BufferBinding,
        out: &wgpu::BufferBinding,
    ) -> Result<Kind, GpuError> {
        self.check_cache(gpu, cache)?;
        if plan.owner != self.id {
            return Err(GpuError::Plan(PlanMismatch::OtherAttention));
        }
        let Some(kind) = plan.kind else {
            return Err(GpuError::Plan(PlanMismatch::NotPlanned));
        };
        // A plan belongs to one step of one cache: the first run binds it;
        // another cache, or a write step planned since, is refused.
        let epoch = cache.write_epoch();
        match plan.bound {
            Some((id, _)) if id != cache.id => {
                return Err(GpuError::Plan(PlanMismatch::BoundToOtherCache));
            }
            Some((_, planned)) if planned != epoch => {
                return Err(GpuError::Plan(PlanMismatch::Stale {
                    planned,
                    current: epoch,
                }));
            }
            _ => {}
        }
        if variant >= plan.variants {
            return Err(BatchError::Variant {
                variant,
                variants: plan.variants,
            }
            .into());
        }
        cache.layer(layer)?;
        let nq = plan.num_queries as u64;
        let elem = plan.act.bytes();
        let row = self.num_heads as u64 * self.head_dim as u64 * elem;
        let stride = if plan.q_stride == 0 {
            row
        } else {
            plan.q_stride as u64 * elem
        };
        let q_need = if nq == 0 { 0 } else { (nq - 1) * stride + row };
        check_binding(gpu, "q", q, q_need)?;
        check_binding(gpu, "out", out, nq * row)?;
        if q.buffer == out.buffer {
            return Err(GpuError::Binding {
                which: "q and out",
                problem: BindingError::SameBuffer,
            });
        }
        Ok(kind)
    }
}

/// The bind group of `key`, made (checked) on first use and kept.
fn cached_group<'g, K: std::hash::Hash + Eq>(
    groups: &'g mut HashMap<K, wgpu::BindGroup>,
    key: K,
    gpu: &Gpu,
    pipe: &wgpu::ComputePipeline,
    entries: &[wgpu::BufferBinding],
) -> Result<&'g wgpu::BindGroup, GpuError> {
    use std::collections::hash_map::Entry;
    match groups.entry(key) {
        Entry::Occupied(e) => Ok(e.into_mut()),
        Entry::Vacant(e) => Ok(e.insert(bind_checked(gpu, pipe, entries)?)),
    }
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct WriteKey {
    layer: u32,
    act: ActDtype,
    k: RangeKey,
    v: RangeKey,
}

/// One step's cache-side work, planned by a [`KvCache`]: the new tokens'
/// slots and the copy-on-write list in reused buffers.
pub struct WritePlan {
    owner: u64,
    /// Reused for the duplicate-slot check (no allocation per step).
    scratch: Vec<u32>,
    planned: bool,
    num_tokens: u32,
    num_copies: u32,
    kv_stride: u32,
    act: ActDtype,
    write_pipe: Option<wgpu::ComputePipeline>,
    slots: Grow,
    copies: Grow,
    write_params: Option<wgpu::Buffer>,
    copy_params: Option<wgpu::Buffer>,
    write_groups: HashMap<WriteKey, wgpu::BindGroup>,
    copy_groups: Vec<wgpu::BindGroup>,
}

impl WritePlan {
    /// Elements from one token's K (and V) row to the next, for K and V
    /// read straight from a fused QKV output; `None`: packed rows
    /// (`num_kv_heads * head_dim` apart). A multiple of 4, at least that.
    /// Takes effect at the next `plan_write`.
    pub fn set_kv_stride(&mut self, floats: Option<u32>) {
        self.kv_stride = floats.unwrap_or(0);
        self.planned = false;
    }

    /// The element type of the new K and V rows (default f32; the pool keeps
    /// its own `KvDtype`). Takes effect at the next `plan_write`.
    pub fn set_activations(&mut self, act: ActDtype) {
        self.act = act;
        self.planned = false;
    }
}

impl KvCache {
    /// An empty plan for this cache's `write_kv` and `copy_blocks`.
    pub fn plan(&self) -> WritePlan {
        WritePlan {
            owner: self.id,
            scratch: Vec::new(),
            planned: false,
            num_tokens: 0,
            num_copies: 0,
            kv_stride: 0,
            act: ActDtype::F32,
            write_pipe: None,
            slots: Grow::default(),
            copies: Grow::default(),
            write_params: None,
            copy_params: None,
            write_groups: HashMap::new(),
            copy_groups: Vec::new(),
        }
    }

    /// Compiles the K/V write pipeline for each of `acts` now (f32's is
    /// made with the cache), so that no step pays for a compile.
    pub fn warm_up(&self, gpu: &Gpu, acts: &[ActDtype]) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        for &act in acts {
            self.write_pipeline(gpu, act)?;
        }
        Ok(())
    }

    /// The K/V write pipeline of `act` activations.
    fn write_pipeline(&self, gpu: &Gpu, act: ActDtype) -> Result<wgpu::ComputePipeline, GpuError> {
        Ok(match act {
            ActDtype::F32 => self.write_kv.clone(),
            ActDtype::F16 | ActDtype::Bf16 => pipeline(
                gpu,
                super::kv_cache::write_kv_kernel(self.cfg.dtype),
                &ShaderShape {
                    head_dim: self.cfg.head_dim,
                    block_size: self.cfg.block_size,
                    dtype: self.cfg.dtype,
                    q_f16: true,
                    act_bf16: act == ActDtype::Bf16,
                    ..ShaderShape::default()
                },
            )?,
        })
    }

    /// Plans a step's writes and copies: `slots` of the new tokens (from the
    /// batch view) and the copy-on-write pairs, checked against the pool and
    /// uploaded into buffers the plan reuses.
    pub fn plan_write(
        &self,
        gpu: &Gpu,
        plan: &mut WritePlan,
        slots: &[u32],
        copies: &[[u32; 2]],
    ) -> Result<(), GpuError> {
        self.plan_write_step(gpu, plan, slots, copies, true)
    }

    /// [`plan_write`](Self::plan_write); `new_step: false` for the host
    /// calls' one-call plans (`write_kv`, `copy_blocks`), which write into
    /// the step under way and so leave its attention plans current.
    pub(super) fn plan_write_step(
        &self,
        gpu: &Gpu,
        plan: &mut WritePlan,
        slots: &[u32],
        copies: &[[u32; 2]],
        new_step: bool,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        if plan.owner != self.id {
            return Err(GpuError::Plan(PlanMismatch::OtherCache));
        }
        plan.planned = false;
        gpu.alive()?;
        self.check_write(plan, slots, copies)?;
        plan.write_pipe = Some(self.write_pipeline(gpu, plan.act)?);
        if plan
            .slots
            .ensure(gpu, "plan slots", slots.len() as u64 * 4)?
        {
            plan.write_groups.clear();
        }
        if plan
            .copies
            .ensure(gpu, "plan copies", copies.len() as u64 * 8)?
        {
            plan.copy_groups.clear();
        }
        if !slots.is_empty() {
            gpu.queue
                .write_buffer(plan.slots.get(), 0, bytemuck::cast_slice(slots));
        }
        if !copies.is_empty() {
            gpu.queue
                .write_buffer(plan.copies.get(), 0, bytemuck::cast_slice(copies));
        }
        let wp = params::WriteKvParams {
            num_tokens: slots.len() as u32,
            num_kv_heads: self.cfg.num_kv_heads,
            num_slots: self.cfg.num_blocks * self.cfg.block_size,
            kv_stride: plan.kv_stride / 4,
        };
        let cp = params::CopyParams {
            num_copies: copies.len() as u32,
            num_blocks: self.cfg.num_blocks,
            block_elems: self.cfg.block_elems4(),
            _pad: 0,
        };
        match &plan.write_params {
            Some(b) => gpu.queue.write_buffer(b, 0, bytemuck::bytes_of(&wp)),
            None => plan.write_params = Some(gpu.uniform("plan write_kv params", &wp)?),
        }
        match &plan.copy_params {
            Some(b) => gpu.queue.write_buffer(b, 0, bytemuck::bytes_of(&cp)),
            None => plan.copy_params = Some(gpu.uniform("plan copy params", &cp)?),
        }
        plan.num_tokens = slots.len() as u32;
        plan.num_copies = copies.len() as u32;
        plan.planned = true;
        // A new write step: attention plans of the last one are stale.
        if new_step {
            self.write_epoch
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// What `plan_write` checks: slots and copies in the pool, no slot
    /// twice, the K/V stride, and thread counts one dispatch indexes.
    fn check_write(
        &self,
        plan: &mut WritePlan,
        slots: &[u32],
        copies: &[[u32; 2]],
    ) -> Result<(), GpuError> {
        let cap = self.cfg.num_blocks as u64 * self.cfg.block_size as u64;
        // SKIP_WRITE (u32::MAX): a token whose K/V is in the pool already
        // (a prompt cached to its end); the kernels skip it.
        if let Some(&s) = slots
            .iter()
            .find(|&&s| s as u64 >= cap && s != crate::blocks::SKIP_WRITE)
        {
            return Err(PoolError::SlotOutsidePool {
                slot: s,
                slots: cap,
            }
            .into());
        }
        check_copies(self.cfg.num_blocks, copies)?;
        // One step writes a slot at most once: the GPU writes a step's
        // tokens in parallel, so two writes of one slot would race.
        if let Some(s) = duplicate_slot(slots, &mut plan.scratch) {
            return Err(PoolError::SlotTwice { slot: s }.into());
        }
        let row4 = self.cfg.num_kv_heads * self.cfg.head_dim / 4;
        if plan.kv_stride != 0 && (!plan.kv_stride.is_multiple_of(4) || plan.kv_stride / 4 < row4) {
            return Err(BatchError::Stride {
                what: "K/V",
                stride: plan.kv_stride,
                row: row4 * 4,
            }
            .into());
        }
        for (what, count) in [
            (
                "write_kv threads",
                slots.len() as u64 * self.cfg.write_threads_per_token(),
            ),
            (
                "copy_blocks threads",
                copies.len() as u64 * self.cfg.copy_threads_per_block(),
            ),
        ] {
            if count > u32::MAX as u64 {
                return Err(PoolError::TooMany {
                    what,
                    count,
                    limit: u32::MAX as u64,
                }
                .into());
            }
        }
        Ok(())
    }

    fn check_plan(&self, gpu: &Gpu, plan: &WritePlan) -> Result<(), GpuError> {
        gpu.alive()?;
        if plan.owner != self.id {
            return Err(GpuError::Plan(PlanMismatch::OtherCache));
        }
        if !plan.planned {
            return Err(GpuError::Plan(PlanMismatch::NotPlanned));
        }
        Ok(())
    }

    /// Records the planned copy-on-write copies for every layer. Record it
    /// before the step's writes.
    pub fn run_copy_blocks(
        &self,
        gpu: &Gpu,
        enc: &mut wgpu::CommandEncoder,
        plan: &mut WritePlan,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        self.check_plan(gpu, plan)?;
        // Made on the first step, copies or not, so a later step's first
        // copy creates nothing.
        if plan.copy_groups.len() != self.layers.len() {
            plan.copy_groups.clear();
            for [k, v] in &self.layers {
                let params = plan.copy_params.as_ref().expect("planned");
                plan.copy_groups.push(bind_ranges(
                    gpu,
                    &self.copy_blocks,
                    &[
                        params.as_entire_buffer_binding(),
                        plan.copies.get().as_entire_buffer_binding(),
                        k.as_entire_buffer_binding(),
                        v.as_entire_buffer_binding(),
                    ],
                ));
            }
        }
        if plan.num_copies == 0 {
            return Ok(());
        }
        let (x, y) = grid_1d(plan.num_copies as u64 * self.cfg.copy_threads_per_block());
        for bg in &plan.copy_groups {
            dispatch(enc, "copy_blocks", &self.copy_blocks, bg, (x, y, 1));
        }
        Ok(())
    }

    /// Records one layer's `write_kv` of the planned tokens: `k` and `v`
    /// hold `[num_tokens][num_kv_heads][head_dim]` f32 (rows
    /// `set_kv_stride` apart). Bindings are checked before recording.
    pub fn run_write_kv(
        &self,
        gpu: &Gpu,
        enc: &mut wgpu::CommandEncoder,
        plan: &mut WritePlan,
        layer: u32,
        k: &wgpu::BufferBinding,
        v: &wgpu::BufferBinding,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        self.check_plan(gpu, plan)?;
        let [kp, vp] = self.layer(layer)?;
        let n = plan.num_tokens as u64;
        let elem = plan.act.bytes();
        let row = self.cfg.num_kv_heads as u64 * self.cfg.head_dim as u64 * elem;
        let stride = if plan.kv_stride == 0 {
            row
        } else {
            plan.kv_stride as u64 * elem
        };
        let need = if n == 0 { 0 } else { (n - 1) * stride + row };
        check_binding(gpu, "k", k, need)?;
        check_binding(gpu, "v", v, need)?;
        if n == 0 {
            return Ok(());
        }
        if plan.write_groups.len() > 4096 {
            plan.write_groups.clear();
        }
        let key = WriteKey {
            layer,
            act: plan.act,
            k: RangeKey::of(k),
            v: RangeKey::of(v),
        };
        let params = plan.write_params.as_ref().expect("planned");
        let Some(pipe) = plan.write_pipe.as_ref() else {
            return Err(GpuError::Plan(PlanMismatch::NotPlanned));
        };
        let slots = plan.slots.get();
        if !plan.write_groups.contains_key(&key) {
            let made = {
                bind_checked(
                    gpu,
                    pipe,
                    &[
                        params.as_entire_buffer_binding(),
                        k.clone(),
                        v.clone(),
                        slots.as_entire_buffer_binding(),
                        kp.as_entire_buffer_binding(),
                        vp.as_entire_buffer_binding(),
                    ],
                )
            }?;
            plan.write_groups.insert(key.clone(), made);
        }
        let bg = &plan.write_groups[&key];
        let (x, y) = grid_1d(n * self.cfg.write_threads_per_token());
        dispatch(enc, "write_kv", pipe, bg, (x, y, 1));
        Ok(())
    }
}

/// Checks a copy-on-write list for a pool of `num_blocks` blocks: every
/// block inside the pool, and no two copies racing (a destination named
/// twice, or named as another copy's source; a self-copy included), since
/// the copies run in parallel. What `KvCache::copy_blocks` and
/// `plan_write` check before anything is recorded; needs no device.
pub fn check_copies(num_blocks: u32, copies: &[[u32; 2]]) -> Result<(), GpuError> {
    if let Some(c) = copies
        .iter()
        .find(|c| c[0] >= num_blocks || c[1] >= num_blocks)
    {
        return Err(PoolError::CopyOutsidePool {
            pair: *c,
            blocks: num_blocks,
        }
        .into());
    }
    if let Some(block) = racing_copy(copies) {
        return Err(PoolError::CopyRace { block }.into());
    }
    Ok(())
}

/// A block a copy list names as the destination of one copy and the
/// destination or source of another (a self-copy included): the copies
/// run in parallel, so such a list would tear the block. The block
/// manager never makes one.
fn racing_copy(copies: &[[u32; 2]]) -> Option<u32> {
    if copies.is_empty() {
        return None;
    }
    let mut dst: Vec<u32> = copies.iter().map(|c| c[1]).collect();
    dst.sort_unstable();
    if let Some(w) = dst.windows(2).find(|w| w[0] == w[1]) {
        return Some(w[0]);
    }
    copies
        .iter()
        .find(|c| dst.binary_search(&c[0]).is_ok())
        .map(|c| c[0])
}

#[cfg(test)]
mod copy_tests {
    use super::racing_copy;

    #[test]
    fn racing_copy_lists_are_found() {
        assert_eq!(racing_copy(&[]), None);
        assert_eq!(racing_copy(&[[1, 2], [3, 4], [5, 6]]), None);
        assert_eq!(
            racing_copy(&[[1, 3], [2, 3]]),
            Some(3),
            "two copies into one block"
        );
        assert_eq!(racing_copy(&[[1, 2], [2, 3]]), Some(2), "a chain");
        assert_eq!(racing_copy(&[[4, 5], [5, 4]]), Some(4), "a swap");
        assert_eq!(racing_copy(&[[7, 7]]), Some(7), "a self-copy");
        assert_eq!(
            racing_copy(&[[1, 9], [1, 8]]),
            None,
            "one source, two destinations"
        );
    }
}
