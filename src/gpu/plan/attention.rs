//! Planning and running a step's attention: the plan made, the step
//! checked and uploaded, each layer recorded.

use super::binding::{cached_group, check_binding, Grow, RangeKey};
use super::tables::{DecodeTables, PrefillTables, StepTables};
use super::types::*;
use std::collections::HashMap;

use crate::gpu::attention::{pack_into, AttnOptions, PackedMeta, PagedAttention};
use crate::gpu::compose::{Shader, ShaderShape};
use crate::gpu::context::Gpu;
use crate::gpu::dtype::ActDtype;
use crate::gpu::error::{BatchError, BindingError, GpuError, PlanMismatch};
use crate::gpu::kernels::{self};
use crate::gpu::kv_cache::KvCache;
use crate::gpu::params;
use crate::gpu::pass::{dispatch, pipeline};

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
    pub(super) fn pipes_for(
        &self,
        gpu: &Gpu,
        act: ActDtype,
        prefill: bool,
    ) -> Result<[wgpu::ComputePipeline; 3], GpuError> {
        let f16 = act != ActDtype::F32;
        let act_bf16 = act == ActDtype::Bf16;
        let (name, shape) = if prefill {
            (Shader::Attention, self.prefill_shape)
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
            Shader::Reduce,
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
    pub(in crate::gpu) fn plan_any(
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
    pub(super) fn bytes_per_token(&self) -> u64 {
        let c = &self.cache_cfg;
        c.block_bytes() / c.block_size as u64
    }

    /// Checks a step's variants, tables (when `checked`), queries and Q
    /// stride; returns its query rows.
    pub(super) fn check_step(
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

    /// Uploads the packed tables, sizes the split-K workspace and writes
    /// each variant's uniform.
    pub(super) fn upload_step(
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
    pub(super) fn check_run(
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
