//! Choices a plan makes: split-K per variant, and whether a cascade (shared
//! prefixes attended once) pays, with its segment pass.

use super::tables::StepTables;
use super::types::*;

use crate::gpu::attention::{pack_into, AttnOptions, PackedMeta, PagedAttention};
use crate::gpu::cascade::{
    find_segments, Cascade, CASCADE_AUTO, CASCADE_CHUNK_TOKENS, SERIAL_CASCADE_AUTO,
    SERIAL_CASCADE_CHUNK_TOKENS,
};
use crate::gpu::compose::ShaderShape;
use crate::gpu::context::Gpu;
use crate::gpu::dtype::ActDtype;
use crate::gpu::error::{BatchError, GpuError};
use crate::gpu::kernels::{self, SegmentFamily, SegmentPass};
use crate::gpu::params;
use crate::gpu::pass::pipeline;

impl PagedAttention {
    /// The kernel of the cascade's segment pass, as the kernels' registry
    /// resolves it for this kernel and adapter.
    pub(super) fn segment_pass(&self, gpu: &Gpu) -> SegmentPass {
        kernels::segment_pass(gpu, self.kernel, &self.decode_shape, &self.prefill_shape)
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
    pub(super) fn choose_cascade(
        &self,
        gpu: &Gpu,
        t: &StepTables,
        variants: &[AttnOptions],
    ) -> Result<Option<CascadeChoice>, GpuError> {
        let forced = variants.iter().any(|o| o.cascade == Cascade::On);
        let seg = self.segment_pass(gpu);
        let may_auto = match seg.family {
            SegmentFamily::Serial => SERIAL_CASCADE_AUTO,
            SegmentFamily::Rows => CASCADE_AUTO && !gpu.is_software(),
            SegmentFamily::Tiled => false,
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
        let chunk_tokens = seg.cap.unwrap_or(u32::MAX).min(match seg.family {
            SegmentFamily::Serial => SERIAL_CASCADE_CHUNK_TOKENS,
            SegmentFamily::Rows => self.cascade_chunk,
            SegmentFamily::Tiled => CASCADE_CHUNK_TOKENS,
        });
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
            && match seg.family {
                SegmentFamily::Serial => tables.pays_serial(seg.qtile, self.bytes_per_token()),
                _ => tables.pays_gpu(self.bytes_per_token(), n as u64 * heads, partial),
            };
        // The rows and tiled passes take a workgroup per query tile in x.
        let tiles: u64 = (0..tables.num_segments())
            .map(|i| (tables.seg_qo[i + 1] - tables.seg_qo[i]).div_ceil(seg.qtile) as u64)
            .sum();
        if seg.family != SegmentFamily::Serial && tiles > 65535 {
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
        Ok((forced || auto).then_some(CascadeChoice { t: tables, seg }))
    }

    /// Each variant's split (partition tokens, partitions) and ALiBi
    /// slopes (appended to the packed words), and the rows of partials the
    /// largest split needs.
    pub(super) fn variant_splits(
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

    /// The segment pass: its tables (segments as pseudo-sequences with
    /// their query tiles), the (row, position) map, per-variant slopes and
    /// slots, per-variant params, and its pipeline.
    pub(super) fn plan_segments(
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
            Some((&t.seg_qo, c.seg.qtile)),
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
        let pipe = match c.seg.family {
            // The tiled kernel's f32 prefill pipeline is already built.
            SegmentFamily::Tiled if !q_f16 => self.prefill_pipeline(gpu)?.clone(),
            // The rows kernel, the serial kernel with its query slots (the
            // split pipeline itself when that is 1), the tiled kernel in
            // its prefill shape: f32 partials, this plan's activations.
            _ => pipeline(
                gpu,
                c.seg.shader,
                &ShaderShape {
                    q_f16,
                    out_f16: false,
                    act_bf16,
                    ..c.seg.shape
                },
            )?,
        };
        let bpt = self.bytes_per_token();
        Ok(CascadeStep {
            num_tiles: cmeta.num_tiles,
            serial_wg: c.seg.serial_wg,
            head_tiles: c.seg.head_tiles,
            pipe,
            bytes: (t.cascade_tokens * bpt, t.plain_tokens * bpt),
            segments: t.num_segments(),
        })
    }
}
