//! What a decode kernel is ([`DecodeKernel`]), and the loop cap its
//! passes respect on adapters that end loops early: what each kernel's
//! module implements, below the registry that picks among them.

use crate::gpu::compose::{Shader, ShaderShape};
use crate::gpu::context::Gpu;

/// The pass a decode kernel's cascade runs its shared segments on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::gpu) enum SegmentFamily {
    /// The tiled kernel in its multi-query (prefill) shape.
    Tiled,
    /// `attention_rows.wgsl` (lanes over query rows), where it fits the
    /// device; else the tiled kernel.
    Rows,
    /// The serial kernel's cascade mode (query slots).
    Serial,
}

/// What a decode kernel is. Every method is a fact of the kernel alone.
pub(in crate::gpu) trait DecodeKernel: Sync {
    /// Its WGSL file, `shaders/<shader>.wgsl`.
    fn shader(&self) -> Shader;
    /// Its decode shape for `base` (head_dim, group, block size, dtype;
    /// decode: one query, no head tile chosen yet) on `gpu`, within `limit`
    /// bytes of workgroup memory; `None` when it cannot run it there.
    fn shape(&self, gpu: &Gpu, base: ShaderShape, limit: u32) -> Option<ShaderShape>;
    /// Bytes of workgroup memory it uses at shape `s`.
    fn workgroup_bytes(&self, s: &ShaderShape) -> u32;
    /// Loop iterations one invocation runs per token of context (an upper
    /// bound; 0: the tiled kernel's own cap), for adapters that end loops
    /// after 65535 iterations.
    fn iterations_per_token(&self, s: &ShaderShape) -> u32;
    /// `Split::Auto` where the device's compute units are not known
    /// (software adapters, unknown hardware): (the units of work one
    /// dispatch should have, the shortest partition in tokens).
    fn split_target(&self) -> (u64, u32);
    /// Workgroups of shape `s` one compute unit (an SM) is assumed to hold
    /// at once, for `Split::Auto` on a device whose compute units are
    /// known; 0: the kernel is not sized from them (it keeps
    /// `split_target`).
    fn resident_per_unit(&self, _s: &ShaderShape) -> u32 {
        0
    }
    /// Whether its grid is flattened: invocations, not workgroups, serve
    /// the (sequence, KV head tile, partition) units.
    fn flat_grid(&self) -> bool {
        false
    }
    /// The pass its cascade runs shared segments on.
    fn segment_family(&self) -> SegmentFamily {
        SegmentFamily::Tiled
    }
    /// Whether it reads subgroup builtins (else a shape's `subgroups` is
    /// cleared before its source is composed).
    fn reads_subgroups(&self) -> bool {
        false
    }
    /// KV4s per pool load (its view of the pools: 1, or wide loads).
    fn wide_loads(&self, _s: &ShaderShape) -> u32 {
        1
    }
    /// The shape its source is compiled at for shape `s`: `s`, less what
    /// the kernel reads from its uniforms instead, so one pipeline serves
    /// every shape that differs only there.
    fn compiled_shape(&self, s: &ShaderShape) -> ShaderShape {
        *s
    }
    /// The WGSL Rust writes for it at shape `s` (unrolled row code), placed
    /// before its file; empty for none.
    fn generated(&self, _s: &ShaderShape) -> String {
        String::new()
    }
}

/// The loop cap's tokens per pass for a kernel that runs `ipt` loop
/// iterations per token (0: the tiled kernel's own cap): three quarters of
/// the cap, in whole tiles of 64; `None` on adapters without one.
pub(in crate::gpu) fn cap_for(gpu: &Gpu, head_dim: u32, ipt: u32) -> Option<u32> {
    let tiled = gpu.max_tokens_per_pass(head_dim)?;
    if ipt == 0 {
        return Some(tiled);
    }
    let t = (65535 * 3 / 4) / ipt;
    Some((t / 64 * 64).clamp(64, tiled))
}
