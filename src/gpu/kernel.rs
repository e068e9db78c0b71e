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
    /// `attention_stream.wgsl`, decode shaped for GPU memory: 16-byte
    /// loads, lanes per row so a warp reads whole rows, several tokens' K
    /// and V loads issued before their first use, one table lookup per
    /// block fetched a step ahead, one rescale per step, straight-line
    /// step code.
    Stream,
}

impl Kernel {
    /// Every variant.
    pub const ALL: [Kernel; 4] = [Kernel::Tiled, Kernel::Lanes, Kernel::Serial, Kernel::Stream];

    /// The kernel's name: in tune files, the CLI's `PAGEDATTN_KERNEL` and the bench.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Tiled => "tiled",
            Kernel::Lanes => "lanes",
            Kernel::Serial => "serial",
            Kernel::Stream => "stream",
        }
    }

    /// The variant called `name`, if any.
    pub fn from_name(name: &str) -> Option<Kernel> {
        Kernel::ALL.into_iter().find(|k| k.name() == name.trim())
    }

    /// Its WGSL file (`shaders/<name>.wgsl`).
    pub(super) fn shader(self) -> &'static str {
        super::kernels::decode(self).shader()
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
    super::kernels::decode(kernel).shape(gpu, base, limit)
}

/// The loop cap's tokens per pass for a kernel that runs `ipt` loop
/// iterations per token (0: the tiled kernel's own cap): three quarters of
/// the cap, in whole tiles of 64; `None` on adapters without one.
pub(super) fn cap_for(gpu: &Gpu, head_dim: u32, ipt: u32) -> Option<u32> {
    let tiled = gpu.max_tokens_per_pass(head_dim)?;
    if ipt == 0 {
        return Some(tiled);
    }
    let t = (65535 * 3 / 4) / ipt;
    Some((t / 64 * 64).clamp(64, tiled))
}

/// On an adapter that ends loops early, the most tokens one pass of
/// `kernel` may walk; `None` elsewhere.
pub(super) fn pass_cap(gpu: &Gpu, kernel: Kernel, s: &ShaderShape) -> Option<u32> {
    cap_for(
        gpu,
        s.head_dim,
        super::kernels::decode(kernel).iterations_per_token(s),
    )
}

/// Shortest partition `Split::Auto` makes on a device whose compute units
/// are known, in tokens: vLLM's partitions are 512 tokens too, and shorter
/// ones pay more for the merge than they gain in parallelism.
pub const DEVICE_MIN_PARTITION: u32 = 512;

/// Split-K rule of `Split::Auto` for `kernel` at shape `s`: partitions so
/// that a batch of `passes` (sequence x KV-head-tile) units fills the
/// device, never shorter than a minimum, and never longer than the
/// adapter's loop cap where it has one. Where the device's compute units
/// are known (`units`: SMs), it is filled once: `round(units x
/// resident workgroups per unit / passes)` partitions. Elsewhere the kernel's
/// fixed target of units of work stands in for the device.
pub(super) fn auto_partition(
    kernel: Kernel,
    s: &ShaderShape,
    passes: u64,
    max_len: u32,
    cap: Option<u32>,
    units: Option<u32>,
) -> u32 {
    let k = super::kernels::decode(kernel);
    let resident = k.resident_per_unit(s) as u64;
    let mut pt = 0;
    match units {
        Some(u) if resident > 0 => {
            let slots = u as u64 * resident;
            let parts = ((slots + passes.max(1) / 2) / passes.max(1))
                .min((max_len / DEVICE_MIN_PARTITION) as u64);
            if parts >= 2 {
                pt = max_len.div_ceil(parts as u32).div_ceil(64) * 64;
            }
        }
        _ => {
            let (target, min_part) = k.split_target();
            if passes < target && max_len >= 2 * min_part {
                let parts = target
                    .div_ceil(passes.max(1))
                    .min(max_len.div_ceil(min_part) as u64) as u32;
                pt = max_len.div_ceil(parts.max(1)).div_ceil(64) * 64;
            }
        }
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
    super::kernels::tiled::workgroup_bytes(&ShaderShape {
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
    /// Where the compute units are known, the device is filled once: the
    /// design note's cell (32 sequences x 8 KV heads on 132 SMs, 4 stream
    /// workgroups each) splits 8192 tokens in 2; a batch that fills the
    /// device alone is not split; short contexts keep 512-token partitions.
    /// Unknown devices keep the kernel's fixed target.
    #[test]
    fn auto_split_fills_a_known_device_once() {
        let s = ShaderShape {
            workgroup: 128,
            ..Default::default()
        };
        let pt = |passes, len, units| auto_partition(Kernel::Stream, &s, passes, len, None, units);
        assert_eq!(pt(256, 8192, Some(132)), 4096);
        assert_eq!(pt(64, 2048, Some(132)), 512);
        assert_eq!(pt(1024, 8192, Some(132)), 0);
        assert_eq!(pt(8, 32768, Some(132)), 512);
        assert_eq!(pt(256, 8192, None), 2048, "fixed target 1024 / 256 units");
        assert_eq!(pt(256, 600, Some(132)), 0, "shorter than two partitions");
    }

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
