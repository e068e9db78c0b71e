//! `attention_stream.wgsl`, decode shaped for GPU memory: 16-byte loads,
//! `lanes` lanes per token row (one warp instruction reads whole rows), each
//! lane group walking `unroll` consecutive tokens per step with every K and
//! V load of the step issued before the first use, the table read once per
//! run of tokens in one block and fetched a step ahead, one rescale per row
//! per step, and no dynamically indexed private arrays: the step is
//! straight-line code expanded from `shaders/templates/stream_step.wgsl`.
//! Its cascade runs on the rows pass, as `lanes`' does.

use super::spec::{DecodeKernel, SegmentFamily};
use crate::gpu::compose::{balanced_head_tile, Shader, ShaderShape};
use crate::gpu::context::Gpu;
use crate::gpu::dtype::KvDtype;

/// Tokens per lane group per step when the config leaves it open (on a
/// device with subgroups; 1 without): 4, so a
/// lane has 4 K and 4 V loads of 16 bytes in flight (128 bytes), and a
/// workgroup of 128 16 KiB (the design note's rule for keeping HBM busy:
/// at least 32 KiB in flight per SM, i.e. two such workgroups).
pub const STREAM_UNROLL: u32 = 4;

/// Invocations per workgroup when the config leaves it open.
pub const STREAM_WORKGROUP: u32 = 128;

/// Most query-row vec4s a lane holds (and as many of accumulator).
const MAX_ROW_VEC4S: u32 = 32;

pub(in crate::gpu) struct Stream;

/// KV4s per 16 bytes of a row for pools of `dtype`.
pub fn wide(dtype: KvDtype) -> u32 {
    match dtype {
        KvDtype::F32 => 1,
        KvDtype::F16 | KvDtype::Bf16 => 2,
        KvDtype::Int8 | KvDtype::Fp8E4M3 => 4,
    }
}

impl DecodeKernel for Stream {
    fn shader(&self) -> Shader {
        Shader::AttentionStream
    }
    /// Rows must be whole 16-byte chunks (head_dim a multiple of 4, 8 or
    /// 16 for f32, 16-bit and 8-bit pools). Lanes per row: the largest
    /// power of two up to 16 (and the subgroup size, where the device has
    /// subgroups) dividing the row's chunks. A step the config leaves open
    /// shrinks (unroll, then workgroup) to fit `limit`; a chosen one that
    /// does not fit is refused.
    fn shape(&self, gpu: &Gpu, base: ShaderShape, limit: u32) -> Option<ShaderShape> {
        let d4 = base.head_dim / 4;
        let w = wide(base.dtype);
        if d4 == 0 || !d4.is_multiple_of(w) {
            return None;
        }
        let chunks = d4 / w;
        let sub =
            gpu.features.contains(wgpu::Features::SUBGROUP) && gpu.info.subgroup_min_size >= 2;
        let most = if sub {
            gpu.info.subgroup_min_size.min(16)
        } else {
            16
        };
        let mut lanes = 1;
        while lanes * 2 <= most && chunks.is_multiple_of(lanes * 2) {
            lanes *= 2;
        }
        let lv = chunks / lanes * w;
        if lv > MAX_ROW_VEC4S {
            return None;
        }
        let rows = (MAX_ROW_VEC4S / lv).clamp(1, 8);
        let chosen = (base.unroll != 0, base.workgroup != 0);
        let mut s = ShaderShape {
            htile: balanced_head_tile(base.group, rows),
            lpt: lanes,
            subgroups: sub && lanes > 1,
            // Without subgroups (GL, the browser: software adapters here)
            // one token per group per step: 4 made the kernel's cold
            // compile on llvmpipe's GL 44 s against 5 s.
            unroll: if chosen.0 {
                base.unroll
            } else if sub {
                STREAM_UNROLL
            } else {
                1
            },
            workgroup: if chosen.1 {
                base.workgroup
            } else {
                STREAM_WORKGROUP
            },
            ..base
        };
        if !matches!(s.unroll, 1 | 2 | 4) || !matches!(s.workgroup, 64 | 128 | 256) {
            return None;
        }
        let invocations = gpu.limits.max_compute_invocations_per_workgroup;
        loop {
            if workgroup_bytes(&s) <= limit && s.workgroup <= invocations {
                return Some(s);
            }
            if !chosen.0 && s.unroll > 1 {
                s.unroll /= 2;
            } else if !chosen.1 && s.workgroup > 64 {
                s.workgroup /= 2;
            } else {
                return None;
            }
        }
    }
    fn workgroup_bytes(&self, s: &ShaderShape) -> u32 {
        workgroup_bytes(s)
    }
    // Per step of (workgroup / lanes) x unroll tokens: the token loop's one
    // iteration, and without subgroups the loop over the group's lanes;
    // the rest of the step is straight-line.
    fn iterations_per_token(&self, s: &ShaderShape) -> u32 {
        let lanes = s.lpt.max(1);
        let per_step = 1 + if s.subgroups { 0 } else { lanes };
        let nt = s.workgroup.max(64) / lanes * s.unroll.max(1);
        per_step.div_ceil(nt) + 1
    }
    fn split_target(&self) -> (u64, u32) {
        (1024, 256)
    }
    // 16 warps of 32 per SM (the design note's register budget of about
    // 128 per lane allows it): 4 workgroups of 128.
    fn resident_per_unit(&self, s: &ShaderShape) -> u32 {
        (512 / s.workgroup.max(64)).max(1)
    }
    fn segment_family(&self) -> SegmentFamily {
        SegmentFamily::Rows
    }
    fn reads_subgroups(&self) -> bool {
        true
    }
    fn wide_loads(&self, s: &ShaderShape) -> u32 {
        wide(s.dtype)
    }
    fn generated(&self, s: &ShaderShape) -> String {
        step_code(s)
    }
}

/// Bytes of workgroup memory attention_stream.wgsl uses at `s`: the
/// groups' states for the end-of-pass merge, and without subgroups every
/// lane's partial dots.
pub fn workgroup_bytes(s: &ShaderShape) -> u32 {
    let wg = s.workgroup.max(64);
    let ng = wg / s.lpt.max(1);
    let red = if s.subgroups {
        1
    } else {
        wg * s.head_tile() * s.unroll.max(1)
    };
    16 * ng * (s.head_dim / 4) + 8 * ng + 4 * red
}

/// The per-step code at `s`: `shaders/templates/stream_step.wgsl` expanded.
fn step_code(s: &ShaderShape) -> String {
    let w = wide(s.dtype);
    let lanes = s.lpt.max(1);
    let wg = s.workgroup.max(64);
    let chunks = (s.head_dim / 4 / w / lanes).max(1);
    let vars = [
        ("wg", wg as i64),
        ("lanes", lanes as i64),
        ("ng", (wg / lanes) as i64),
        ("u", s.unroll.max(1) as i64),
        ("chunks", chunks as i64),
        ("wide", w as i64),
        ("lv", (chunks * w) as i64),
        ("ht", s.head_tile() as i64),
        ("quant", s.dtype.quantized() as i64),
        ("sub", s.subgroups as i64),
    ];
    crate::gpu::template::expand(STEP_TEMPLATE, &vars).expect("the stream step template expands")
}

/// The template of the stream kernel's per-step code.
pub const STEP_TEMPLATE: &str = include_str!("../../../shaders/templates/stream_step.wgsl");

#[cfg(test)]
mod tests {
    use super::*;

    /// The template expands for every shape the kernel takes: nothing of it
    /// left over, one K and one V load per token and chunk, one score per
    /// row and token, shuffles only with subgroups.
    #[test]
    fn the_step_template_expands_for_every_shape() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8] {
            for head_dim in [64u32, 128, 256] {
                for lanes in [1u32, 2, 4, 8, 16] {
                    if !(head_dim / 4 / wide(dtype)).is_multiple_of(lanes) {
                        continue;
                    }
                    for unroll in [1u32, 2, 4] {
                        for sub in [false, true] {
                            let s = ShaderShape {
                                head_dim,
                                group: 4,
                                dtype,
                                lpt: lanes,
                                unroll,
                                workgroup: 128,
                                subgroups: sub && lanes > 1,
                                ..Default::default()
                            };
                            let chunks = head_dim / 4 / wide(dtype) / lanes;
                            let c = step_code(&s);
                            let what =
                                format!("{dtype:?} d{head_dim} lanes {lanes} u {unroll} sub {sub}");
                            assert!(!c.contains("{{") && !c.contains("//#"), "{what}");
                            assert_eq!(
                                c.matches("= k_pool[").count() as u32,
                                unroll * chunks,
                                "{what}"
                            );
                            assert_eq!(
                                c.matches("= v_pool[").count() as u32,
                                unroll * chunks,
                                "{what}"
                            );
                            assert_eq!(c.matches("var s").count() as u32, 4 * unroll, "{what}");
                            let shuffles = c.matches("subgroupShuffleXor").count() as u32;
                            let masks = if s.subgroups {
                                lanes.trailing_zeros()
                            } else {
                                0
                            };
                            assert_eq!(shuffles, 4 * unroll * masks, "{what}");
                        }
                    }
                }
            }
        }
    }
}
