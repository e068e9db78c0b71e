//! `attention_lanes.wgsl`, the GPU-shaped decode kernel: up to 8 lanes
//! share a token's row with vec4 loads (coalesced), 8+ tokens in flight per
//! workgroup, partial dots summed by subgroup shuffles where the device has
//! subgroups, online softmax per slot merged once at the end, exp2. Its
//! cascade runs on the rows pass (`rows`).

use super::spec::{DecodeKernel, SegmentFamily};
use crate::gpu::compose::{balanced_head_tile, Shader, ShaderShape};
use crate::gpu::context::Gpu;

pub(in crate::gpu) struct Lanes;

impl DecodeKernel for Lanes {
    fn shader(&self) -> Shader {
        Shader::AttentionLanes
    }
    fn shape(&self, gpu: &Gpu, base: ShaderShape, limit: u32) -> Option<ShaderShape> {
        let sub =
            gpu.features.contains(wgpu::Features::SUBGROUP) && gpu.info.subgroup_min_size >= 2;
        let most = if sub {
            gpu.info.subgroup_min_size.min(8)
        } else {
            8
        };
        let lpt = lanes_per_token(base.head_dim, most);
        let jn = (base.head_dim / 4 / lpt).max(1);
        // Registers: at most 32 vec4 of query (and as many of
        // accumulator) per lane.
        let rows = (32 / jn).clamp(1, 8);
        let s = ShaderShape {
            htile: balanced_head_tile(base.group, rows),
            lpt,
            subgroups: sub && lpt > 1,
            ..base
        };
        (workgroup_bytes(&s) <= limit).then_some(s)
    }
    fn workgroup_bytes(&self, s: &ShaderShape) -> u32 {
        workgroup_bytes(s)
    }
    fn iterations_per_token(&self, s: &ShaderShape) -> u32 {
        let (d4, ht) = (s.head_dim / 4, s.head_tile());
        let lpt = s.lpt.max(1);
        let nt = 64 / lpt;
        let jn = d4 / lpt;
        let red = if s.subgroups { 4 } else { ht * (lpt + 1) };
        (2 * jn + 2 * ht + red + 2).div_ceil(nt) + 1
    }
    fn split_target(&self) -> (u64, u32) {
        (1024, 256)
    }
    // 64 invocations: 16 warps of 32 per SM at 8 workgroups.
    fn resident_per_unit(&self, _s: &ShaderShape) -> u32 {
        8
    }
    fn segment_family(&self) -> SegmentFamily {
        SegmentFamily::Rows
    }
    fn reads_subgroups(&self) -> bool {
        true
    }
    fn generated(&self, s: &ShaderShape) -> String {
        row_helpers(s.head_tile(), s.subgroups)
    }
}

/// Bytes of workgroup memory attention_lanes.wgsl uses for `shape`.
pub fn workgroup_bytes(s: &ShaderShape) -> u32 {
    let nt = 64 / s.lpt.max(1);
    let red = if s.subgroups {
        1
    } else {
        2 * 64 * s.head_tile()
    };
    16 * nt * (s.head_dim / 4) + 8 * nt + 4 * red
}

/// Lanes per token of attention_lanes.wgsl for a head of `head_dim`: the
/// largest power of two up to `most` (at most 8) that divides `head_dim / 4`.
pub fn lanes_per_token(head_dim: u32, most: u32) -> u32 {
    let d4 = (head_dim / 4).max(1);
    let mut lpt = most.clamp(1, 8).next_power_of_two();
    if lpt > most.max(1) {
        lpt /= 2;
    }
    while lpt > 1 && !d4.is_multiple_of(lpt) {
        lpt /= 2;
    }
    lpt
}

/// Straight-line code over the HT rows of a head tile, for the kernels that
/// keep the rows in `var<private>` arrays (`attention_lanes`), expanded
/// from `shaders/templates/lanes_rows.wgsl`: generated rather than looped,
/// so that a software adapter that counts loop iterations (llvmpipe)
/// counts one per vec4, not one per row and vec4, and every compiler sees
/// constant indices. A row holds `JN` vec4s per invocation.
/// With `shuffle`, `rows_shuffle(mask)` adds each row's score from the lane
/// `mask` away in the subgroup (else it is empty and never called).
pub(in crate::gpu) fn row_helpers(ht: u32, shuffle: bool) -> String {
    let vars = [("ht", ht as i64), ("shuffle", shuffle as i64)];
    crate::gpu::template::expand(ROWS_TEMPLATE, &vars).expect("the lanes rows template expands")
}

/// The template of the row helpers.
pub const ROWS_TEMPLATE: &str = include_str!("../../../shaders/templates/lanes_rows.wgsl");
