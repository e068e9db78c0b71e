//! Decode kernel variants, what each needs, how each splits the KV range,
//! and the choice per adapter: passed by the engine (its own choice, or a
//! [`Tuner`](super::Tuner)'s measurement), or a default.
//!
//! Every variant computes the same math (`logit` in `shaders/common.wgsl`,
//! online softmax, log-sum-exp merge in `reduce.wgsl`); they differ in
//! layout and parallelism only.

use super::shader::{self, ShaderShape};
use super::Gpu;

/// A decode kernel variant. Prefill always runs [`Kernel::Tiled`]'s kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kernel {
    /// `attention.wgsl`: a workgroup of 64 per (sequence, KV head, head
    /// tile); one thread scores one token over tiles of 64 tokens, V is
    /// accumulated per vec4 column. Fits WebGPU's defaults on every shape.
    Tiled,
    /// `attention_lanes.wgsl`, the GPU-shaped kernel: up to 8 lanes share a
    /// token's row with vec4 loads (coalesced), 8+ tokens in flight per
    /// workgroup, partial dots summed by subgroup shuffles where the device
    /// has subgroups, online softmax per slot merged once at the end, exp2.
    Lanes,
    /// `attention_serial.wgsl`, for software adapters: one invocation per
    /// (sequence, KV head, head tile, partition), no barriers, no workgroup
    /// memory.
    Serial,
}

impl Kernel {
    /// Every variant.
    pub const ALL: [Kernel; 3] = [Kernel::Tiled, Kernel::Lanes, Kernel::Serial];

    /// The kernel's name: in tune files, the CLI's `PAGEDATTN_KERNEL` and the bench.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Tiled => "tiled",
            Kernel::Lanes => "lanes",
            Kernel::Serial => "serial",
        }
    }

    /// The variant called `name`, if any.
    pub fn from_name(name: &str) -> Option<Kernel> {
        Kernel::ALL.into_iter().find(|k| k.name() == name.trim())
    }

    pub(super) fn shader(self) -> &'static str {
        match self {
            Kernel::Tiled => "attention",
            Kernel::Lanes => "attention_lanes",
            Kernel::Serial => "attention_serial",
        }
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Workgroup memory every kernel stays within, whatever the adapter offers:
/// WebGPU's default limit, so one shape runs the same everywhere.
pub const PORTABLE_WORKGROUP_BYTES: u32 = 16384;

/// Query-row vec4s one `serial` invocation holds (and as many of
/// accumulator): a head tile of 4 rows at head_dim 128. On llvmpipe a
/// lane-varying load costs a loop over the SIMD lanes, so each K/V load
/// shared by more rows pays: 128 made decode 1.6-2.5x faster than 64 did
/// (lavapipe, bench 2026-11-30) for about 3 s more of a cold compile per
/// shape. Larger tiles compile slowly (about 23 s cold at 256).
pub const SERIAL_ROW_VEC4S: u32 = 128;

/// Query-row vec4s one invocation of a cascade segment pass on `serial`
/// holds: as many query slots (sequences sharing the segment) of a head
/// tile as fit, at most [`SERIAL_CASCADE_MAX_SLOTS`], so each K/V load
/// serves them all (2 slots of 4 rows at head_dim 128).
pub const SERIAL_CASCADE_ROW_VEC4S: u32 = 256;

/// Most query slots per invocation of the serial segment pass. Measured on
/// lavapipe at n = 8 over 4096 shared tokens, head_dim 128: 2 slots 1.37x
/// of plain decode, 4 slots 1.50x, but 4 slots (512 vec4 of rows) took
/// about 110 s more to compile cold, and 256 vec4 took 17 s in the browser
/// (SwiftShader) where 128 compile in about as long as plain decode's.
pub const SERIAL_CASCADE_MAX_SLOTS: u32 = 2;

/// Query slots of a cascade segment pass on `serial` for its decode shape.
pub(super) fn serial_cascade_queries(s: &ShaderShape) -> u32 {
    let per_slot = (s.head_tile() * (s.head_dim / 4)).max(1);
    (SERIAL_CASCADE_ROW_VEC4S / per_slot).clamp(1, SERIAL_CASCADE_MAX_SLOTS)
}

/// Most query rows the tiled kernel keeps per pass (per-thread registers).
const TILED_MAX_ROWS: u32 = 16;

/// The decode shape of `kernel` for a cache shape on `gpu`: head tile,
/// lanes per token and subgroups chosen; `None` when the kernel cannot run
/// this shape on this device (workgroup memory).
pub(super) fn decode_shape(gpu: &Gpu, kernel: Kernel, base: ShaderShape) -> Option<ShaderShape> {
    let limit = gpu
        .limits
        .max_compute_workgroup_storage_size
        .min(PORTABLE_WORKGROUP_BYTES);
    let base = ShaderShape {
        qtile: 1,
        htile: 0,
        lpt: 1,
        subgroups: false,
        ..base
    };
    match kernel {
        Kernel::Tiled => {
            let mut most = TILED_MAX_ROWS;
            loop {
                let s = ShaderShape {
                    htile: shader::balanced_head_tile(base.group, most),
                    ..base
                };
                if shader::attention_workgroup_bytes(&s) <= limit {
                    return Some(s);
                }
                if most == 1 {
                    return None;
                }
                most /= 2;
            }
        }
        Kernel::Lanes => {
            let sub =
                gpu.features.contains(wgpu::Features::SUBGROUP) && gpu.info.subgroup_min_size >= 2;
            let most = if sub {
                gpu.info.subgroup_min_size.min(8)
            } else {
                8
            };
            let lpt = shader::lanes_per_token(base.head_dim, most);
            let jn = (base.head_dim / 4 / lpt).max(1);
            // Registers: at most 32 vec4 of query (and as many of
            // accumulator) per lane.
            let rows = (32 / jn).clamp(1, 8);
            let s = ShaderShape {
                htile: shader::balanced_head_tile(base.group, rows),
                lpt,
                subgroups: sub && lpt > 1,
                ..base
            };
            (shader::lanes_workgroup_bytes(&s) <= limit).then_some(s)
        }
        // At most SERIAL_ROW_VEC4S vec4 of query rows (and as many of
        // accumulator) per invocation: the unrolled per-token code grows
        // with rows x vec4, and so does its compile time on llvmpipe.
        Kernel::Serial => Some(ShaderShape {
            htile: shader::balanced_head_tile(
                base.group,
                (SERIAL_ROW_VEC4S / (base.head_dim / 4).max(1)).clamp(1, 8),
            ),
            ..base
        }),
    }
}

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
pub(super) fn rows_shape(gpu: &Gpu, base: &ShaderShape) -> Option<ShaderShape> {
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
    while lpr < 16 && d4 / lpr > ROWS_MAX_COLUMNS && d4 % (lpr * 2) == 0 {
        lpr *= 2;
    }
    let rows = (64 / lpr).max(1);
    let ht = shader::balanced_head_tile(base.group, rows);
    let s = ShaderShape {
        htile: ht,
        qtile: (rows / ht).max(1),
        lpt: lpr,
        subgroups: lpr > 1 && sub_min >= lpr,
        q_f16: false,
        out_f16: false,
        ..*base
    };
    (shader::rows_workgroup_bytes(&s) <= limit
        && shader::rows_workgroup_size(&s) <= gpu.limits.max_compute_invocations_per_workgroup)
        .then_some(s)
}

/// On an adapter that ends loops early, the most tokens one pass of the
/// rows kernel may walk; `None` elsewhere.
pub(super) fn rows_pass_cap(gpu: &Gpu, s: &ShaderShape) -> Option<u32> {
    let lpr = s.lpt.max(1);
    let jn = (s.head_dim / 4 / lpr).max(1);
    let red = if s.subgroups { 4 } else { lpr };
    let tg = shader::ROWS_TOKEN_GROUPS;
    cap_for(gpu, s.head_dim, (2 * jn + red + 2).div_ceil(tg) + 1)
}

/// The loop cap's tokens per pass for a kernel that runs `ipt` loop
/// iterations per token (0: the tiled kernel's own cap): three quarters of
/// the cap, in whole tiles of 64; `None` on adapters without one.
fn cap_for(gpu: &Gpu, head_dim: u32, ipt: u32) -> Option<u32> {
    let tiled = gpu.max_tokens_per_pass(head_dim)?;
    if ipt == 0 {
        return Some(tiled);
    }
    let t = (65535 * 3 / 4) / ipt;
    Some((t / 64 * 64).clamp(64, tiled))
}

/// Loop iterations one invocation of `kernel` runs per token of context
/// (an upper bound), for adapters that end loops after 65535 iterations.
fn iterations_per_token(kernel: Kernel, s: &ShaderShape) -> u32 {
    let d4 = s.head_dim / 4;
    let ht = s.head_tile();
    match kernel {
        // One token per thread per tile of 64; the thread's loops per tile.
        Kernel::Tiled => 0,
        Kernel::Lanes => {
            let lpt = s.lpt.max(1);
            let nt = 64 / lpt;
            let jn = d4 / lpt;
            let red = if s.subgroups { 4 } else { ht * (lpt + 1) };
            (2 * jn + 2 * ht + red + 2).div_ceil(nt) + 1
        }
        // The token loop only: the per-token code is unrolled.
        _ => 2,
    }
}

/// On an adapter that ends loops early, the most tokens one pass of
/// `kernel` may walk; `None` elsewhere.
pub(super) fn pass_cap(gpu: &Gpu, kernel: Kernel, s: &ShaderShape) -> Option<u32> {
    cap_for(gpu, s.head_dim, iterations_per_token(kernel, s))
}

/// Split-K rule of `Split::Auto` for `kernel`: partitions so that a batch of
/// `passes` (sequence x KV-head-tile) units fills the device (a target
/// number of workgroups per kernel: the adapter's compute units are not
/// known through wgpu, so the batch decides), never shorter than a minimum,
/// and never longer than the adapter's loop cap where it has one.
pub(super) fn auto_partition(kernel: Kernel, passes: u64, max_len: u32, cap: Option<u32>) -> u32 {
    let (target, min_part) = match kernel {
        Kernel::Tiled => (256u64, 512u32),
        Kernel::Lanes => (1024, 256),
        // Invocations, not workgroups: 16 workgroups of 64.
        _ => (1024, 64),
    };
    let mut pt = 0;
    if passes < target && max_len >= 2 * min_part {
        let parts = target
            .div_ceil(passes.max(1))
            .min(max_len.div_ceil(min_part) as u64) as u32;
        pt = max_len.div_ceil(parts.max(1)).div_ceil(64) * 64;
    }
    if let Some(cap) = cap {
        if (pt == 0 && max_len > cap) || pt > cap {
            pt = cap;
        }
    }
    pt
}

/// The key of one tuning result: adapter, driver and shape.
pub(super) fn tune_key(gpu: &Gpu, s: &ShaderShape, num_heads: u32, num_kv_heads: u32) -> String {
    format!(
        "{}|{}|{:?}|{}x{}|d{}|b{}|{:?}",
        gpu.info.name,
        gpu.info.driver_info,
        gpu.info.backend,
        num_heads,
        num_kv_heads,
        s.head_dim,
        s.block_size,
        s.dtype
    )
    .replace(['\n', '='], " ")
}

/// The untuned default: the barrier-free kernel on software adapters, the
/// GPU-shaped one elsewhere.
pub(super) fn default_kernel(gpu: &Gpu) -> Kernel {
    if gpu.is_software() {
        Kernel::Serial
    } else {
        Kernel::Lanes
    }
}

/// Workgroup memory the smallest tiled decode shape of `base` takes: what
/// a device must have for any kernel to run the shape.
pub(super) fn min_workgroup_bytes(base: &ShaderShape) -> u32 {
    shader::attention_workgroup_bytes(&ShaderShape {
        qtile: 1,
        htile: shader::balanced_head_tile(base.group, 1),
        lpt: 1,
        subgroups: false,
        ..*base
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::GpuError;

    /// Every kernel name parses back; other names (the removed f16
    /// variants too) name none. Backend names parse the same way.
    #[test]
    fn kernel_and_backend_names_parse() {
        for k in Kernel::ALL {
            assert_eq!(Kernel::from_name(k.name()), Some(k));
        }
        assert_eq!(Kernel::from_name(" serial "), Some(Kernel::Serial));
        assert_eq!(Kernel::from_name("lanes-f16"), None, "removed");
        assert_eq!(Kernel::from_name(""), None);
        assert_eq!(crate::gpu::parse_backends("GL"), Ok(wgpu::Backends::GL));
        assert_eq!(crate::gpu::parse_backends(""), Ok(wgpu::Backends::all()));
        assert!(matches!(
            crate::gpu::parse_backends("vk\u{fffd}"),
            Err(GpuError::UnknownBackend(_))
        ));
    }
}
