//! The kernels, one module each, so a kernel's facts live in one place:
//! its WGSL file (`shaders/<name>.wgsl`), the shape it takes for a cache
//! shape on a device (and whether it can run it there), its workgroup
//! memory, its loop iterations per token (for adapters that end loops
//! early), its split-K rule, its grid, the family of its cascade segment
//! pass, and the code generated for it. Plan and attention code ask the
//! kernel through [`DecodeKernel`]; they do not match on names.
//!
//! Adding a decode kernel: its module here, its WGSL file, a `Kernel`
//! variant, and one arm in [`decode`]. The cascade's GPU segment pass
//! (`attention_rows.wgsl`, not a decode kernel) is [`rows`].

use super::shader::ShaderShape;
use super::{Gpu, Kernel};

pub(super) mod lanes;
pub(super) mod rows;
pub(super) mod serial;
pub(super) mod stream;
pub(super) mod template;
pub(super) mod tiled;

/// The pass a decode kernel's cascade runs its shared segments on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SegmentFamily {
    /// The tiled kernel in its multi-query (prefill) shape.
    Tiled,
    /// `attention_rows.wgsl` (lanes over query rows), where it fits the
    /// device; else the tiled kernel.
    Rows,
    /// The serial kernel's cascade mode (query slots).
    Serial,
}

/// What a decode kernel is. Every method is a fact of the kernel alone.
pub(super) trait DecodeKernel: Sync {
    /// Its WGSL file, `shaders/<shader>.wgsl`.
    fn shader(&self) -> &'static str;
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
    /// The WGSL Rust writes for it at shape `s` (unrolled row code), placed
    /// before its file; empty for none.
    fn generated(&self, _s: &ShaderShape) -> String {
        String::new()
    }
}

/// The kernel behind `k`: the one registration line per kernel (the
/// match is exhaustive, so a new `Kernel` variant does not compile without
/// its module).
pub(super) fn decode(k: Kernel) -> &'static dyn DecodeKernel {
    match k {
        Kernel::Tiled => &tiled::Tiled,
        Kernel::Lanes => &lanes::Lanes,
        Kernel::Serial => &serial::Serial,
        Kernel::Stream => &stream::Stream,
    }
}

/// The decode kernel whose WGSL file is `shader`, if any.
pub(super) fn by_shader(shader: &str) -> Option<&'static dyn DecodeKernel> {
    Kernel::ALL
        .into_iter()
        .map(decode)
        .find(|d| d.shader() == shader)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The registry holds every variant once, each under its own file.
    #[test]
    fn every_kernel_is_registered_once() {
        let shaders: Vec<&str> = Kernel::ALL.map(|k| decode(k).shader()).to_vec();
        for (i, s) in shaders.iter().enumerate() {
            assert!(!shaders[..i].contains(s), "{s} registered twice");
            assert_eq!(by_shader(s).map(|d| d.shader()), Some(*s));
        }
        assert!(
            by_shader("attention_rows").is_none(),
            "a segment pass, not a decode kernel"
        );
    }
}
