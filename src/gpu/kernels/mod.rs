//! The kernels, one module each, so a kernel's facts live in one place:
//! its WGSL file (`shaders/<name>.wgsl`), the shape it takes for a cache
//! shape on a device (and whether it can run it there), its workgroup
//! memory, its loop iterations per token (for adapters that end loops
//! early), its split-K rule, its grid, the family of its cascade segment
//! pass, and the code generated for it. Plan and attention code ask the
//! kernel through [`DecodeKernel`]; they do not match on names.
//!
//! Adding a decode kernel: its module here; its WGSL file, naming its
//! imports; its `Shader` variant and its line in `compose::REGISTRY`; a
//! `Kernel` variant (with its `Kernel::ALL` entry and `name()`); and one
//! arm in [`decode`] (the match is exhaustive, so a `Kernel` without it does
//! not compile, and `every_wgsl_file_names_its_imports` fails a kernel file
//! the registry lacks). The cascade's GPU segment pass
//! (`attention_rows.wgsl`, not a decode kernel) is [`rows`].
//!
//! `spec.rs` says what a kernel is (the trait, the loop cap); the kernels'
//! modules implement it; this file is the registry above them: the kernel
//! behind a name, a kernel's full source ([`source`]), and the choices made
//! among kernels (the decode shape, the default, `Split::Auto`'s rule).

use super::compose::{self, Shader, ShaderShape};
use super::context::Gpu;
use super::kernel::{Kernel, PORTABLE_WORKGROUP_BYTES};
use spec::cap_for;
pub(super) use spec::{DecodeKernel, SegmentFamily};

pub(super) mod lanes;
pub(super) mod rows;
pub(super) mod serial;
mod spec;
pub(super) mod stream;

pub(super) mod tiled;

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
pub(super) fn by_shader(shader: Shader) -> Option<&'static dyn DecodeKernel> {
    Kernel::ALL
        .into_iter()
        .map(decode)
        .find(|d| d.shader() == shader)
}

/// The shape `kernel` (a file of `shaders/`) is compiled at for `shape`
/// ([`DecodeKernel::compiled_shape`]): what its pipeline is cached by.
pub(super) fn compiled_shape(kernel: Shader, shape: &ShaderShape) -> ShaderShape {
    by_shader(kernel).map_or(*shape, |k| k.compiled_shape(shape))
}

/// The full source of `kernel` (a file of `shaders/`) at `shape`, as
/// compiled: the shared composition (`compose.rs`) with what the
/// kernel adds (its KV4s per pool load, the code generated for it); `None`
/// for an MLA kernel.
pub fn source(kernel: Shader, shape: &ShaderShape) -> Option<String> {
    let mut shape = compiled_shape(kernel, shape);
    let decode = by_shader(kernel);
    if kernel != Shader::AttentionRows && !decode.is_some_and(|k| k.reads_subgroups()) {
        // Only the lanes and rows kernels read subgroups.
        shape.subgroups = false;
    }
    let wide = decode.map_or(1, |k| k.wide_loads(&shape));
    let generated = match decode {
        Some(k) => k.generated(&shape),
        None if kernel == Shader::AttentionRows => rows::consts(&shape),
        None => String::new(),
    };
    compose::compose(kernel, &shape, wide, &generated)
}

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
    decode(kernel).shape(gpu, base, limit)
}

/// On an adapter that ends loops early, the most tokens one pass of
/// `kernel` may walk; `None` elsewhere.
pub(super) fn pass_cap(gpu: &Gpu, kernel: Kernel, s: &ShaderShape) -> Option<u32> {
    cap_for(gpu, s.head_dim, decode(kernel).iterations_per_token(s))
}

/// The cascade's segment pass for decode kernel `kernel` on `gpu`: its
/// family's kernel and shape (the serial kernel with query slots, the rows
/// kernel where it fits, else the tiled kernel in its prefill shape), the
/// query rows per tile, the serial pass's workgroup, and the longest
/// segment one pass may walk here. Plan code asks this; it does not reach
/// into the kernels' modules.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct SegmentPass {
    /// Which kernel family the pass is.
    pub(super) family: SegmentFamily,
    /// Its kernel.
    pub(super) shader: Shader,
    /// Its shape (f32 activations; the plan sets its own).
    pub(super) shape: ShaderShape,
    /// Query rows (serial: query slots) per tile.
    pub(super) qtile: u32,
    /// The serial pass's invocations per workgroup; `None` otherwise.
    pub(super) serial_wg: Option<u32>,
    /// Passes per KV head.
    pub(super) head_tiles: u32,
    /// The longest segment one pass may walk on this adapter, before the
    /// library's own chunk limit.
    pub(super) cap: Option<u32>,
}

/// The segment pass of `kernel` at its `decode` and `prefill` shapes.
pub(super) fn segment_pass(
    gpu: &Gpu,
    kernel: Kernel,
    decode_shape: &ShaderShape,
    prefill_shape: &ShaderShape,
) -> SegmentPass {
    let tiled = SegmentPass {
        family: SegmentFamily::Tiled,
        shader: Shader::Attention,
        shape: *prefill_shape,
        qtile: prefill_shape.qtile,
        serial_wg: None,
        head_tiles: prefill_shape.head_tiles(),
        cap: pass_cap(gpu, Kernel::Tiled, prefill_shape),
    };
    match decode(kernel).segment_family() {
        SegmentFamily::Serial => {
            let q = serial::cascade_queries(decode_shape);
            SegmentPass {
                family: SegmentFamily::Serial,
                shader: decode(kernel).shader(),
                shape: ShaderShape {
                    qtile: q,
                    out_f16: false,
                    ..*decode_shape
                },
                qtile: q,
                serial_wg: Some(serial::workgroup_size(q)),
                head_tiles: prefill_shape.head_tiles(),
                cap: pass_cap(gpu, kernel, decode_shape),
            }
        }
        SegmentFamily::Rows => match rows::shape(gpu, decode_shape) {
            Some(rs) => SegmentPass {
                family: SegmentFamily::Rows,
                shader: Shader::AttentionRows,
                shape: rs,
                qtile: rs.qtile,
                serial_wg: None,
                head_tiles: rs.head_tiles(),
                cap: rows::pass_cap(gpu, &rs),
            },
            None => tiled,
        },
        SegmentFamily::Tiled => tiled,
    }
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
    let k = decode(kernel);
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
    tiled::workgroup_bytes(&ShaderShape {
        qtile: 1,
        htile: compose::balanced_head_tile(base.group, 1),
        lpt: 1,
        subgroups: false,
        ..*base
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The registry holds every variant once, each under its own file.
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

    /// The serial kernel reads its GQA group from the uniforms: shapes
    /// that differ only in the group (same head tile) compose one source
    /// and key one pipeline, and its WGSL names neither group constant
    /// outside comments. The tiled kernel keeps the group in its source.
    #[test]
    fn serial_shapes_share_a_source_across_groups() {
        let at = |group, htile| ShaderShape {
            head_dim: 64,
            group,
            htile,
            ..Default::default()
        };
        let serial = |s| source(Shader::AttentionSerial, &s).expect("serial composes");
        let one = serial(at(4, 4));
        for (group, htile) in [(8, 4), (12, 4), (6, 4)] {
            assert_eq!(serial(at(group, htile)), one, "group {group}");
            assert_eq!(
                compiled_shape(Shader::AttentionSerial, &at(group, htile)),
                compiled_shape(Shader::AttentionSerial, &at(4, 4))
            );
        }
        assert_ne!(serial(at(8, 8)), one, "another head tile is another source");
        let body = Shader::AttentionSerial.entry().text;
        for line in body.lines().filter(|l| !l.trim_start().starts_with("//")) {
            assert!(
                !line.contains("GROUP") && !line.contains("HTILES"),
                "serial reads the group from its uniforms: {line}"
            );
        }
        assert_ne!(
            source(Shader::Attention, &at(8, 4)),
            source(Shader::Attention, &at(4, 4)),
            "tiled keeps the group"
        );
    }

    #[test]
    fn every_kernel_is_registered_once() {
        let shaders: Vec<Shader> = Kernel::ALL.map(|k| decode(k).shader()).to_vec();
        for (i, s) in shaders.iter().enumerate() {
            assert!(!shaders[..i].contains(s), "{s:?} registered twice");
            assert_eq!(by_shader(*s).map(|d| d.shader()), Some(*s));
        }
        assert!(
            by_shader(Shader::AttentionRows).is_none(),
            "a segment pass, not a decode kernel"
        );
    }
}
