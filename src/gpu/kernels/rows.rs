//! `attention_rows.wgsl`, the cascade's segment pass on GPUs (where decode
//! runs `lanes`): lanes over query rows, each row's query and accumulator
//! in a few lanes' registers, every row walking the same tokens, so each
//! K/V load serves all of a segment's query rows.

use super::spec::cap_for;
use crate::gpu::compose::{balanced_head_tile, ShaderShape};
use crate::gpu::context::Gpu;
use crate::gpu::kernel::PORTABLE_WORKGROUP_BYTES;

/// Token groups of `attention_rows.wgsl` (each of `ROWS x LPR` lanes walks
/// every TG-th token of the segment; merged once at the end): 4, so a
/// workgroup of 64-lane groups has 256 invocations and 4 tokens in flight.
/// On an H200 the segment pass's time fell as 1 / token groups (1, 2, 4:
/// `benches/NOTES.md` item 31).
pub const TOKEN_GROUPS: u32 = 4;

/// Invocations per workgroup of `attention_rows.wgsl` for `s`: its rows
/// (`qtile` x head tile) x lanes per row (`lpt`) x token groups.
pub fn workgroup_size(s: &ShaderShape) -> u32 {
    s.qtile.max(1) * s.head_tile() * s.lpt.max(1) * TOKEN_GROUPS
}

/// Bytes of workgroup memory attention_rows.wgsl uses for `s`.
pub fn workgroup_bytes(s: &ShaderShape) -> u32 {
    let lanes = s.qtile.max(1) * s.head_tile() * s.lpt.max(1);
    let jn = (s.head_dim / 4 / s.lpt.max(1)).max(1);
    let red = if s.subgroups { 1 } else { workgroup_size(s) };
    16 * lanes * jn + 8 * lanes + 4 * red
}

/// The generated constants of `attention_rows.wgsl`, and `lane_sum`: a
/// row's partial dots summed over its lanes by subgroup shuffles (without
/// subgroups it is never called, and holds no subgroup builtin, which
/// naga refuses on such a device even in dead code).
pub(in crate::gpu) fn consts(s: &ShaderShape) -> String {
    let vars = [
        ("rows", (s.qtile.max(1) * s.head_tile()) as i64),
        ("tg", TOKEN_GROUPS as i64),
        ("wgs", workgroup_size(s) as i64),
        ("subgroups", s.subgroups as i64),
    ];
    crate::gpu::template::expand(LAYOUT_TEMPLATE, &vars).expect("the rows layout template expands")
}

/// The template of the rows kernel's layout.
pub const LAYOUT_TEMPLATE: &str = include_str!("../../../shaders/templates/rows_layout.wgsl");

/// Most vec4 columns of a row one lane of `attention_rows.wgsl` keeps (and
/// as many of accumulator): with at most 64 lanes of rows per token group,
/// the end-of-pass merge buffer stays within 16 KiB.
const ROWS_MAX_COLUMNS: u32 = 8;

/// The shape of the cascade segment pass on GPUs (`attention_rows.wgsl`)
/// for a cache shape (`base`: head_dim, group, block size, dtype): the
/// fewest lanes per row (`lpt`, a power of two dividing head_dim / 4) that
/// keep at most 8 vec4 columns per lane, 64 lanes of rows per token group
/// (head tile x `qtile` queries), and subgroup sums where the device's
/// subgroups hold a row's lanes. `None` where its workgroup memory does not
/// fit the device (then the tiled kernel runs the pass).
pub(in crate::gpu) fn shape(gpu: &Gpu, base: &ShaderShape) -> Option<ShaderShape> {
    let limit = gpu
        .limits
        .max_compute_workgroup_storage_size
        .min(PORTABLE_WORKGROUP_BYTES);
    let sub_min = if gpu.features.contains(wgpu::Features::SUBGROUP) {
        gpu.info.subgroup_min_size
    } else {
        0
    };
    let d4 = (base.head_dim / 4).max(1);
    // Lanes per row: powers of two dividing d4, up to 16, until a lane
    // keeps at most ROWS_MAX_COLUMNS columns.
    let mut lpr = 1;
    while lpr < 16 && d4 / lpr > ROWS_MAX_COLUMNS && d4.is_multiple_of(lpr * 2) {
        lpr *= 2;
    }
    let rows = (64 / lpr).max(1);
    let ht = balanced_head_tile(base.group, rows);
    let s = ShaderShape {
        htile: ht,
        qtile: (rows / ht).max(1),
        lpt: lpr,
        subgroups: lpr > 1 && sub_min >= lpr,
        q_f16: false,
        out_f16: false,
        unroll: 0,
        workgroup: 0,
        ..*base
    };
    (workgroup_bytes(&s) <= limit
        && workgroup_size(&s) <= gpu.limits.max_compute_invocations_per_workgroup)
        .then_some(s)
}

/// On an adapter that ends loops early, the most tokens one pass of the
/// rows kernel may walk; `None` elsewhere.
pub(in crate::gpu) fn pass_cap(gpu: &Gpu, s: &ShaderShape) -> Option<u32> {
    let lpr = s.lpt.max(1);
    let jn = (s.head_dim / 4 / lpr).max(1);
    let red = if s.subgroups { 4 } else { lpr };
    let tg = TOKEN_GROUPS;
    cap_for(gpu, s.head_dim, (2 * jn + red + 2).div_ceil(tg) + 1)
}
