//! The decode kernel variants an engine names ([`Kernel`]): passed by the
//! engine (its own choice, or a [`Tuner`](super::Tuner)'s measurement), or
//! a default. What each variant is, needs and chooses lives in its module
//! under `kernels/` ([`kernels`](super::kernels)).
//!
//! Every variant computes the same math (`logit` in `shaders/common.wgsl`,
//! online softmax, log-sum-exp merge in `reduce.wgsl`); they differ in
//! layout and parallelism only.

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
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Workgroup memory every kernel stays within, whatever the adapter offers:
/// WebGPU's default limit, so one shape runs the same everywhere.
pub const PORTABLE_WORKGROUP_BYTES: u32 = 16384;

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
