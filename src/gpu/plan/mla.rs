//! MLA's plans, in GQA's idiom: the latent pool plans a step's writes and
//! copies into a [`WritePlan`] (the type a `KvCache` plans into) and
//! records them into the engine's encoder; [`MlaAttention`] plans the
//! step's attention from the batch view's tables into a reused [`MlaPlan`]
//! and records each layer over the engine's buffer ranges. After the first
//! steps no call here creates a buffer, bind group or pipeline.

use super::binding::{cached_group, check_binding, duplicate_slot, Grow, RangeKey};
use super::tables::{DecodeTables, PrefillTables};
use super::write::{WriteKey, WritePlan};
use std::collections::HashMap;

use crate::gpu::attention::{check_csr_tables, AttnOptions, MAX_SEQ_LEN};
use crate::gpu::cascade::Cascade;
use crate::gpu::compose::Shader;
use crate::gpu::context::Gpu;
use crate::gpu::dtype::ActDtype;
use crate::gpu::error::{BatchError, BindingError, GpuError, MlaError, PlanMismatch};
use crate::gpu::mla::{
    mla_pipeline, MlaAttention, MlaCache, MlaParams, MAX_ROWS_PER_CALL, MLA_MAX_QUERIES,
};
use crate::gpu::pass::{bind_ranges, dispatch, grid_1d};

/// The pipelines a plan's activation dtype runs.
#[derive(Clone)]
struct MlaPipes {
    /// Unsplit decode: writes the output in the activation dtype.
    whole: wgpu::ComputePipeline,
    /// Split decode: writes f32 partials.
    split: wgpu::ComputePipeline,
    /// The merge of the partials into the output.
    merge: wgpu::ComputePipeline,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct MlaKey {
    cache: u64,
    layer: u32,
    variant: usize,
    merge: bool,
    act: ActDtype,
    q: RangeKey,
    out: RangeKey,
}

/// A step's MLA attention, planned by an [`MlaAttention`]
/// ([`plan`](MlaAttention::plan), then
/// [`plan_decode`](MlaAttention::plan_decode) or
/// [`plan_prefill`](MlaAttention::plan_prefill) each step) and recorded
/// per layer by [`run`](MlaAttention::run). Its buffers and bind groups
/// are reused from step to step. It belongs to one attention object, and
/// to one pool and write step once it first runs.
pub struct MlaPlan {
    owner: u64,
    planned: bool,
    bound: Option<(u64, u64)>,
    num_queries: u32,
    act: ActDtype,
    q_stride: u32,
    /// Per variant: (tokens per partition, partitions).
    splits: Vec<(u32, u32)>,
    params: Vec<wgpu::Buffer>,
    queries: Grow,
    tables: Grow,
    acc: Grow,
    ml: Grow,
    rows: Vec<[u32; 2]>,
    packed: Vec<u32>,
    pipes: Option<MlaPipes>,
    groups: HashMap<MlaKey, wgpu::BindGroup>,
}

impl MlaPlan {
    /// The element type of `q` and the output (default f32). Takes effect
    /// at the next `plan_decode` or `plan_prefill`.
    pub fn set_activations(&mut self, act: ActDtype) {
        self.act = act;
        self.planned = false;
    }

    /// Elements from one query row to the next (for `q` read from a wider
    /// projection output); `None`: packed rows. A multiple of 4, at least
    /// a row. Takes effect at the next `plan_decode` or `plan_prefill`.
    pub fn set_q_stride(&mut self, elems: Option<u32>) {
        self.q_stride = elems.unwrap_or(0);
        self.planned = false;
    }

    /// Query rows: what `q` holds rows of, and `out` receives.
    pub fn num_queries(&self) -> u32 {
        self.num_queries
    }

    /// Split-K partitions per query row of `variant` (1: unsplit).
    pub fn partitions(&self, variant: usize) -> u32 {
        self.splits.get(variant).map_or(0, |s| s.1)
    }

    /// Tokens per partition of `variant`.
    pub fn partition_tokens(&self, variant: usize) -> u32 {
        self.splits.get(variant).map_or(0, |s| s.0)
    }
}

impl MlaAttention {
    /// An empty plan, to fill each step.
    pub fn plan(&self) -> MlaPlan {
        MlaPlan {
            owner: self.id,
            planned: false,
            bound: None,
            num_queries: 0,
            act: ActDtype::F32,
            q_stride: 0,
            splits: Vec::new(),
            params: Vec::new(),
            queries: Grow::default(),
            tables: Grow::default(),
            acc: Grow::default(),
            ml: Grow::default(),
            rows: Vec::new(),
            packed: Vec::new(),
            pipes: None,
            groups: HashMap::new(),
        }
    }

    /// The decode and merge pipelines for `act` activations.
    fn pipes(&self, gpu: &Gpu, act: ActDtype) -> Result<MlaPipes, GpuError> {
        let s = self.shape;
        Ok(MlaPipes {
            whole: mla_pipeline(gpu, Shader::MlaDecode, &s.with_io(act, act))?,
            split: mla_pipeline(gpu, Shader::MlaDecode, &s.with_io(act, ActDtype::F32))?,
            merge: mla_pipeline(gpu, Shader::MlaMerge, &s.with_io(ActDtype::F32, act))?,
        })
    }

    /// Compiles every pipeline a step can need for each of `acts` (unsplit
    /// and split decode, the merge), so that no step pays for a compile.
    pub fn warm_up(&self, gpu: &Gpu, acts: &[ActDtype]) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        for &act in acts {
            self.pipes(gpu, act)?;
        }
        Ok(())
    }

    /// Plans a decode step: one query row per sequence, at its last
    /// position, seeing its whole table. `variants`: the options each
    /// layer kind runs with (MLA takes `scale`, which overrides the one it
    /// was made with, and `split`; any other option is refused). Checked
    /// against the pool before anything is uploaded; on an error the plan
    /// holds no step.
    pub fn plan_decode(
        &self,
        gpu: &Gpu,
        plan: &mut MlaPlan,
        t: &DecodeTables,
        variants: &[AttnOptions],
    ) -> Result<(), GpuError> {
        plan.planned = false;
        self.check_tables(t.kv_indptr, t.kv_indices, t.seq_lens)?;
        let mut rows = std::mem::take(&mut plan.rows);
        rows.clear();
        rows.extend(t.seq_lens.iter().enumerate().map(|(i, &l)| [i as u32, l]));
        let r = self.plan_rows(gpu, plan, t.kv_indptr, t.kv_indices, &rows, variants);
        plan.rows = rows;
        r
    }

    /// Plans a prefill (or mixed) step: sequence `i`'s queries are its
    /// newest `qo_indptr[i + 1] - qo_indptr[i]` tokens (whose rows the pool
    /// already holds), each seeing the tokens up to its own (the causal
    /// mask). Query rows are ordered by sequence, then position. See
    /// [`plan_decode`](Self::plan_decode).
    pub fn plan_prefill(
        &self,
        gpu: &Gpu,
        plan: &mut MlaPlan,
        t: &PrefillTables,
        variants: &[AttnOptions],
    ) -> Result<(), GpuError> {
        plan.planned = false;
        self.check_tables(t.kv_indptr, t.kv_indices, t.seq_lens)?;
        let n = t.seq_lens.len();
        let qo = t.qo_indptr;
        if qo.len() != n + 1 || qo[0] != 0 || qo.windows(2).any(|w| w[0] > w[1]) {
            return Err(BatchError::QoIndptr { need: n as u64 + 1 }.into());
        }
        let total = qo[n] as u64;
        if total == 0 || total > MLA_MAX_QUERIES as u64 {
            return Err(MlaError::Queries {
                count: total,
                limit: MLA_MAX_QUERIES,
            }
            .into());
        }
        let mut rows = std::mem::take(&mut plan.rows);
        rows.clear();
        for i in 0..n {
            let new = qo[i + 1] - qo[i];
            let len = t.seq_lens[i];
            if new > len {
                plan.rows = rows;
                return Err(BatchError::MoreQueries {
                    seq: i as u32,
                    queries: new,
                    tokens: len,
                }
                .into());
            }
            rows.extend((0..new).map(|k| [i as u32, len - new + k + 1]));
        }
        let r = self.plan_rows(gpu, plan, t.kv_indptr, t.kv_indices, &rows, variants);
        plan.rows = rows;
        r
    }

    /// The tables' shape, and every entry inside the pool (or
    /// [`RELEASED`](crate::blocks::RELEASED), which the kernel skips), as
    /// GQA's plans check them.
    fn check_tables(
        &self,
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
    ) -> Result<(), GpuError> {
        let bs = self.cfg.block_size;
        check_csr_tables(self.cfg.num_blocks, bs, kv_indptr, kv_indices, seq_lens)?;
        Ok(())
    }

    /// What MLA's kernels take of an option set: the scale and the split.
    fn check_variant(&self, o: &AttnOptions) -> Result<f32, GpuError> {
        let refused = [
            ("soft_cap", o.soft_cap.is_some()),
            ("sliding_window", o.sliding_window.is_some()),
            ("alibi_slopes", o.alibi_slopes.is_some()),
            ("sinks", o.sinks.is_some()),
            ("sink_tokens", o.sink_tokens.is_some()),
            ("cascade", o.cascade == Cascade::On),
        ];
        if let Some((name, _)) = refused.iter().find(|r| r.1) {
            return Err(MlaError::Option(name).into());
        }
        let scale = o.scale.unwrap_or(self.scale);
        if !(scale.is_finite() && scale > 0.0) {
            return Err(MlaError::Scale(scale).into());
        }
        Ok(scale)
    }

    /// Plans query rows `(sequence, tokens visible)`: checks each against
    /// its table, packs the tables, chooses each variant's split and
    /// writes its uniform, sizes the partials; nothing is recorded.
    fn plan_rows(
        &self,
        gpu: &Gpu,
        plan: &mut MlaPlan,
        kv_indptr: &[u32],
        kv_indices: &[u32],
        rows: &[[u32; 2]],
        variants: &[AttnOptions],
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        if plan.owner != self.id {
            return Err(MlaError::Mismatch("this plan was made by another MlaAttention").into());
        }
        if rows.is_empty() || rows.len() > MLA_MAX_QUERIES as usize {
            return Err(MlaError::Queries {
                count: rows.len() as u64,
                limit: MLA_MAX_QUERIES,
            }
            .into());
        }
        if variants.is_empty() {
            return Err(BatchError::NoVariant.into());
        }
        let scales = variants
            .iter()
            .map(|o| self.check_variant(o))
            .collect::<Result<Vec<f32>, _>>()?;
        let row4 = self.cfg.row_elems() / 4;
        let packed_row = self.heads * row4;
        let stride4 = if plan.q_stride == 0 {
            packed_row
        } else {
            if !plan.q_stride.is_multiple_of(4) || plan.q_stride / 4 < packed_row {
                return Err(BatchError::Stride {
                    what: "q",
                    stride: plan.q_stride,
                    row: packed_row * 4,
                }
                .into());
            }
            plan.q_stride / 4
        };
        let bs = self.cfg.block_size as u64;
        let n = kv_indptr.len() - 1;
        let stride = (0..n)
            .map(|i| (kv_indptr[i + 1] - kv_indptr[i]) as usize)
            .max()
            .unwrap_or(0)
            .max(1);
        let cells = stride as u64 * n.max(1) as u64;
        if cells > u32::MAX as u64 / 2 || stride as u64 * bs > MAX_SEQ_LEN as u64 {
            return Err(MlaError::Len {
                what: "table entries",
                got: cells,
                want: (MAX_SEQ_LEN as u64 / bs).min(u32::MAX as u64 / 2),
            }
            .into());
        }
        for (qi, &[seq, visible]) in rows.iter().enumerate() {
            let s = seq as usize;
            let held = (kv_indptr[s + 1] - kv_indptr[s]) as u64 * bs;
            if visible == 0 || visible as u64 > held {
                return Err(MlaError::Visible {
                    query: qi,
                    visible: visible as u64,
                    held,
                }
                .into());
            }
        }
        let max_visible = rows.iter().map(|q| q[1]).max().unwrap_or(1);
        let mut splits = Vec::with_capacity(variants.len());
        for o in variants {
            let pt = self.partition_tokens(rows.len() as u64, max_visible, o.split)?;
            splits.push((pt, max_visible.div_ceil(pt)));
        }
        let pipes = self.pipes(gpu, plan.act)?;
        // Checked: now upload into the plan's buffers.
        plan.packed.clear();
        plan.packed.resize(stride * n.max(1), u32::MAX);
        for i in 0..n {
            let t = &kv_indices[kv_indptr[i] as usize..kv_indptr[i + 1] as usize];
            plan.packed[i * stride..i * stride + t.len()].copy_from_slice(t);
        }
        let most_parts = splits.iter().map(|s| s.1).max().unwrap_or(1);
        let slots = rows.len() as u64 * self.heads as u64 * most_parts as u64;
        let mut grew = plan
            .queries
            .ensure(gpu, "mla queries", rows.len() as u64 * 8)?;
        grew |= plan
            .tables
            .ensure(gpu, "mla tables", plan.packed.len() as u64 * 4)?;
        if most_parts > 1 {
            grew |= plan
                .acc
                .ensure(gpu, "mla partials", slots * self.shape.v4 as u64 * 16)?;
            grew |= plan.ml.ensure(gpu, "mla partial max and sum", slots * 8)?;
        } else {
            grew |= plan.acc.ensure(gpu, "mla partials", 16)?;
            grew |= plan.ml.ensure(gpu, "mla partial max and sum", 16)?;
        }
        if grew {
            plan.groups.clear();
        }
        if plan.groups.len() > 4096 {
            plan.groups.clear();
        }
        while plan.params.len() < variants.len() {
            let made = gpu.uniform("mla params", &MlaParams::default())?;
            plan.params.push(made);
        }
        gpu.queue
            .write_buffer(plan.queries.get(), 0, bytemuck::cast_slice(rows));
        gpu.queue
            .write_buffer(plan.tables.get(), 0, bytemuck::cast_slice(&plan.packed));
        for (i, (&(part_tokens, parts), &scale)) in splits.iter().zip(&scales).enumerate() {
            let p = MlaParams {
                num_queries: rows.len() as u32,
                num_heads: self.heads,
                num_blocks: self.cfg.num_blocks,
                table_stride: stride as u32,
                parts,
                part_tokens,
                scale,
                count: 0,
                stride: stride4,
                _pad: [0; 3],
            };
            gpu.queue
                .write_buffer(&plan.params[i], 0, bytemuck::bytes_of(&p));
        }
        plan.num_queries = rows.len() as u32;
        plan.splits = splits;
        plan.pipes = Some(pipes);
        plan.bound = None;
        plan.planned = true;
        Ok(())
    }

    /// Records one layer's attention of a planned step into `enc`: `q`
    /// holds the plan's query rows ([`q_row_elems`](Self::q_row_elems)
    /// values each in the plan's activation dtype, RoPE part last, rows
    /// `set_q_stride` apart), `out` receives
    /// [`out_row_elems`](Self::out_row_elems) per row. `variant` indexes
    /// the options given to the plan. Refused before anything is recorded:
    /// a plan of another attention object, of another pool or write step
    /// (stale), a layer outside the pool, a binding too small, misaligned
    /// or without `STORAGE`. Bind groups are reused across steps.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        gpu: &Gpu,
        enc: &mut wgpu::CommandEncoder,
        plan: &mut MlaPlan,
        cache: &MlaCache,
        layer: u32,
        variant: usize,
        q: &wgpu::BufferBinding,
        out: &wgpu::BufferBinding,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        self.check_run(gpu, plan, cache, layer, variant, q, out)?;
        plan.bound = Some((cache.id, cache.write_epoch()));
        let pool = cache.layer_buffer(layer)?.as_entire_buffer_binding();
        let pipes = plan.pipes.clone().expect("planned");
        let (_, parts) = plan.splits[variant];
        let split = parts > 1;
        let key = MlaKey {
            cache: cache.id,
            layer,
            variant,
            merge: false,
            act: plan.act,
            q: RangeKey::of(q),
            out: RangeKey::of(out),
        };
        let params = plan.params[variant].as_entire_buffer_binding();
        let acc = plan.acc.get().as_entire_buffer_binding();
        let ml = plan.ml.get().as_entire_buffer_binding();
        let target = if split { acc.clone() } else { out.clone() };
        let pipe = if split { &pipes.split } else { &pipes.whole };
        let entries = [
            params.clone(),
            q.clone(),
            plan.queries.get().as_entire_buffer_binding(),
            plan.tables.get().as_entire_buffer_binding(),
            pool,
            target,
            ml.clone(),
        ];
        let grid = (self.heads.div_ceil(self.shape.hg), plan.num_queries, parts);
        let bg = cached_group(&mut plan.groups, key.clone(), gpu, pipe, &entries)?;
        dispatch(enc, "mla_decode", pipe, bg, grid);
        if split {
            let mkey = MlaKey { merge: true, ..key };
            let entries = [params, acc, ml, out.clone()];
            let bg = cached_group(&mut plan.groups, mkey, gpu, &pipes.merge, &entries)?;
            let o = plan.num_queries as u64 * self.heads as u64;
            let y = o.min(65535) as u32;
            let z = o.div_ceil(y as u64) as u32;
            let grid = (self.shape.v4.div_ceil(64), y, z);
            dispatch(enc, "mla_merge", &pipes.merge, bg, grid);
        }
        Ok(())
    }

    /// What `run` checks before recording anything.
    #[allow(clippy::too_many_arguments)]
    fn check_run(
        &self,
        gpu: &Gpu,
        plan: &MlaPlan,
        cache: &MlaCache,
        layer: u32,
        variant: usize,
        q: &wgpu::BufferBinding,
        out: &wgpu::BufferBinding,
    ) -> Result<(), GpuError> {
        gpu.alive()?;
        if plan.owner != self.id {
            return Err(MlaError::Mismatch("this plan was made by another MlaAttention").into());
        }
        self.check_cache(cache)?;
        if !plan.planned {
            return Err(GpuError::Plan(PlanMismatch::NotPlanned));
        }
        let epoch = cache.write_epoch();
        match plan.bound {
            Some((id, _)) if id != cache.id => {
                return Err(MlaError::Mismatch("this plan ran on another latent pool in this step: plan the step for this pool").into());
            }
            Some((_, planned)) if planned != epoch => {
                return Err(GpuError::Plan(PlanMismatch::Stale {
                    planned,
                    current: epoch,
                }));
            }
            _ => {}
        }
        if variant >= plan.splits.len() {
            return Err(BatchError::Variant {
                variant,
                variants: plan.splits.len(),
            }
            .into());
        }
        cache.layer_buffer(layer)?;
        let rows = plan.num_queries as u64;
        let elem = plan.act.bytes();
        let row = self.q_row_elems() * elem;
        let stride = if plan.q_stride == 0 {
            row
        } else {
            plan.q_stride as u64 * elem
        };
        check_binding(gpu, "q", q, (rows - 1) * stride + row)?;
        check_binding(gpu, "out", out, rows * self.out_row_elems() * elem)?;
        if q.buffer == out.buffer {
            return Err(GpuError::Binding {
                which: "q and out",
                problem: BindingError::SameBuffer,
            });
        }
        Ok(())
    }
}

impl MlaCache {
    /// An empty plan for this pool's writes and copies.
    pub fn plan(&self) -> WritePlan {
        WritePlan::empty(self.id)
    }

    /// Compiles the write pipeline for each of `acts` (f32's is made with
    /// the pool), so that no step pays for a compile.
    pub fn warm_up(&self, gpu: &Gpu, acts: &[ActDtype]) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        for &act in acts {
            self.write_pipeline(gpu, act)?;
        }
        Ok(())
    }

    fn write_pipeline(&self, gpu: &Gpu, act: ActDtype) -> Result<wgpu::ComputePipeline, GpuError> {
        mla_pipeline(
            gpu,
            Shader::MlaWrite,
            &self.shape.with_io(act, ActDtype::F32),
        )
    }

    /// Plans a step's writes and copies: the new tokens' `slots` (from the
    /// batch view; [`SKIP_WRITE`](crate::blocks::SKIP_WRITE) for a token
    /// already in the pool) and the copy-on-write pairs, checked against
    /// the pool and uploaded into buffers the plan reuses. Starts a write
    /// step: attention plans that ran in the last one are stale.
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
    /// calls' one-call plans.
    pub(in crate::gpu) fn plan_write_step(
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
        let stride4 = self.row_stride4(plan)?;
        plan.write_pipe = Some(self.write_pipeline(gpu, plan.act)?);
        let params = |count: usize| MlaParams {
            num_blocks: self.cfg.num_blocks,
            count: count as u32,
            stride: stride4,
            ..Default::default()
        };
        plan.upload(
            gpu,
            slots,
            copies,
            &params(slots.len()),
            &params(copies.len()),
        )?;
        if new_step {
            self.write_epoch
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// ACT4s from one new row to the next.
    fn row_stride4(&self, plan: &WritePlan) -> Result<u32, GpuError> {
        let row4 = self.cfg.row_elems() / 4;
        if plan.kv_stride == 0 {
            return Ok(row4);
        }
        if !plan.kv_stride.is_multiple_of(4) || plan.kv_stride / 4 < row4 {
            return Err(BatchError::Stride {
                what: "latent row",
                stride: plan.kv_stride,
                row: row4 * 4,
            }
            .into());
        }
        Ok(plan.kv_stride / 4)
    }

    /// Slots inside the pool (or `SKIP_WRITE`), none twice; copies inside
    /// the pool, none racing; counts one dispatch indexes.
    fn check_write(
        &self,
        plan: &mut WritePlan,
        slots: &[u32],
        copies: &[[u32; 2]],
    ) -> Result<(), GpuError> {
        for (what, len) in [("slots", slots.len()), ("copies", copies.len())] {
            if len > MAX_ROWS_PER_CALL {
                return Err(MlaError::Len {
                    what,
                    got: len as u64,
                    want: MAX_ROWS_PER_CALL as u64,
                }
                .into());
            }
        }
        if let Some(&slot) = slots
            .iter()
            .find(|&&s| s as u64 >= self.slots() && s != crate::blocks::SKIP_WRITE)
        {
            return Err(MlaError::Slot {
                slot,
                slots: self.slots(),
            }
            .into());
        }
        if let Some(s) = duplicate_slot(slots, &mut plan.scratch) {
            return Err(MlaError::SlotTwice(s).into());
        }
        let blocks = self.cfg.num_blocks;
        if let Some(&b) = copies.iter().flatten().find(|&&b| b >= blocks) {
            return Err(MlaError::Block {
                what: "copy",
                block: b,
                blocks,
            }
            .into());
        }
        if let Some(b) = super::write::racing_copy(copies) {
            return Err(MlaError::CopyOverlap(b).into());
        }
        Ok(())
    }

    /// Records the planned copy-on-write copies in every layer. Record it
    /// before the step's writes.
    pub fn run_copy_blocks(
        &self,
        gpu: &Gpu,
        enc: &mut wgpu::CommandEncoder,
        plan: &mut WritePlan,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        plan.check(gpu, self.id)?;
        if plan.copy_groups.len() != self.layers.len() {
            plan.copy_groups.clear();
            let params = plan.copy_params.as_ref().expect("planned");
            for pool in &self.layers {
                plan.copy_groups.push(bind_ranges(
                    gpu,
                    &self.copy,
                    &[
                        params.as_entire_buffer_binding(),
                        plan.copies.get().as_entire_buffer_binding(),
                        pool.as_entire_buffer_binding(),
                    ],
                ));
            }
        }
        if plan.num_copies == 0 {
            return Ok(());
        }
        let threads = plan.num_copies as u64 * self.cfg.block_size as u64 * self.shape.row4 as u64;
        let (x, y) = grid_1d(threads);
        for bg in &plan.copy_groups {
            dispatch(enc, "mla_copy", &self.copy, bg, (x, y, 1));
        }
        Ok(())
    }

    /// Records one layer's write of the planned tokens' rows: `rows` holds
    /// `[num_tokens][kv_lora_rank + rope_dim]` in the plan's activation
    /// dtype (latent first; rows `set_kv_stride` apart), stored in the
    /// pool's dtype (rounded to nearest, saturating). The binding is
    /// checked before recording.
    pub fn run_write(
        &self,
        gpu: &Gpu,
        enc: &mut wgpu::CommandEncoder,
        plan: &mut WritePlan,
        layer: u32,
        rows: &wgpu::BufferBinding,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        plan.check(gpu, self.id)?;
        let pool = self.layer_buffer(layer)?;
        let n = plan.num_tokens as u64;
        let elem = plan.act.bytes();
        let row = self.cfg.row_elems() as u64 * elem;
        let stride = self.row_stride4(plan)? as u64 * 4 * elem;
        let need = if n == 0 { 0 } else { (n - 1) * stride + row };
        check_binding(gpu, "rows", rows, need)?;
        if n == 0 {
            return Ok(());
        }
        if plan.write_groups.len() > 4096 {
            plan.write_groups.clear();
        }
        let key = WriteKey {
            layer,
            act: plan.act,
            k: RangeKey::of(rows),
            v: RangeKey::of(rows),
        };
        let Some(pipe) = plan.write_pipe.clone() else {
            return Err(GpuError::Plan(PlanMismatch::NotPlanned));
        };
        let entries = [
            plan.write_params
                .as_ref()
                .expect("planned")
                .as_entire_buffer_binding(),
            plan.slots.get().as_entire_buffer_binding(),
            rows.clone(),
            pool.as_entire_buffer_binding(),
        ];
        let bg = cached_group(&mut plan.write_groups, key, gpu, &pipe, &entries)?;
        let (x, y) = grid_1d(n * self.shape.row4 as u64);
        dispatch(enc, "mla_write", &pipe, bg, (x, y, 1));
        Ok(())
    }
}
