//! `attention_serial.wgsl`, for software adapters (llvmpipe, SwiftShader,
//! WARP): one invocation per (sequence, KV head, head tile, partition), no
//! barriers, no workgroup memory; its per-token code, unrolled over rows and
//! vec4s, is expanded from `shaders/templates/serial_token.wgsl`. Its
//! cascade mode holds query slots.

use super::spec::{DecodeKernel, SegmentFamily};
use crate::gpu::compose::{balanced_head_tile, Shader, ShaderShape};
use crate::gpu::context::Gpu;
use crate::gpu::dtype::KvDtype;

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
pub(in crate::gpu) fn cascade_queries(s: &ShaderShape) -> u32 {
    let per_slot = (s.head_tile() * (s.head_dim / 4)).max(1);
    (SERIAL_CASCADE_ROW_VEC4S / per_slot).clamp(1, SERIAL_CASCADE_MAX_SLOTS)
}

pub(in crate::gpu) struct Serial;

impl DecodeKernel for Serial {
    fn shader(&self) -> Shader {
        Shader::AttentionSerial
    }
    // At most SERIAL_ROW_VEC4S vec4 of query rows (and as many of
    // accumulator) per invocation: the unrolled per-token code grows with
    // rows x vec4, and so does its compile time on llvmpipe.
    fn shape(&self, _gpu: &Gpu, base: ShaderShape, _limit: u32) -> Option<ShaderShape> {
        Some(ShaderShape {
            htile: balanced_head_tile(
                base.group,
                (SERIAL_ROW_VEC4S / (base.head_dim / 4).max(1)).clamp(1, 8),
            ),
            ..base
        })
    }
    fn workgroup_bytes(&self, _s: &ShaderShape) -> u32 {
        0
    }
    // The token loop only: the per-token code is unrolled.
    fn iterations_per_token(&self, _s: &ShaderShape) -> u32 {
        2
    }
    // Invocations, not workgroups: 16 workgroups of 64.
    fn split_target(&self) -> (u64, u32) {
        (1024, 64)
    }
    fn flat_grid(&self) -> bool {
        true
    }
    fn segment_family(&self) -> SegmentFamily {
        SegmentFamily::Serial
    }
    // The GQA group and the head tiles per KV head are read from the
    // uniforms (num_heads / num_kv_heads), once per invocation: the source
    // is compiled at one head tile of the group, so GQA shapes with the
    // same head tile share a pipeline (and llvmpipe compiles it once).
    fn compiled_shape(&self, s: &ShaderShape) -> ShaderShape {
        ShaderShape {
            group: s.head_tile(),
            htile: 0,
            ..*s
        }
    }
    fn wide_loads(&self, s: &ShaderShape) -> u32 {
        wide(s)
    }
    fn generated(&self, s: &ShaderShape) -> String {
        token_code(
            s.head_tile(),
            s.qtile.max(1),
            s.head_dim / 4,
            s.dtype.quantized(),
            wide(s),
        )
    }
}

/// KV4s per load in `attention_serial.wgsl` (it reads its pools as
/// `vec4<u32>` where that holds whole KV4s of a row): 4 for int8 and fp8
/// when head_dim is a multiple of 16, 2 for f16 (packed) when it is a
/// multiple of 8, else 1. Quantized layer buffers are padded to 16 bytes
/// (`KvCacheConfig::layer_bytes`) so the view reaches their tails.
pub fn wide(s: &ShaderShape) -> u32 {
    let d4 = s.head_dim / 4;
    match s.dtype {
        KvDtype::Int8 | KvDtype::Fp8E4M3 if d4.is_multiple_of(4) => 4,
        KvDtype::F16 | KvDtype::Bf16 if d4.is_multiple_of(2) => 2,
        _ => 1,
    }
}

/// Invocations per workgroup of `attention_serial.wgsl` with `qs` query
/// slots: 64 for decode; 8 (one SIMD chunk on llvmpipe) for a cascade
/// segment pass, whose few invocations (a segment's sharers / `qs`, per
/// KV head) would otherwise fill one workgroup and so one core.
pub fn workgroup_size(qs: u32) -> u32 {
    if qs > 1 {
        8
    } else {
        64
    }
}

/// The per-token code of `attention_serial.wgsl`, unrolled over the
/// invocation's `qs` query slots of `ht` head rows and the head's `d4`
/// vec4s: `shaders/templates/serial_token.wgsl` expanded (its header says
/// what each name means).
fn token_code(ht: u32, qs: u32, d4: u32, quant: bool, wide: u32) -> String {
    let qs = qs.max(1);
    let vars = [
        ("wgs", workgroup_size(qs) as i64),
        ("qs", qs as i64),
        ("ht", ht as i64),
        ("rows", (ht * qs) as i64),
        ("d4", d4 as i64),
        ("wide", wide.max(1) as i64),
        ("quant", quant as i64),
        ("multi", (qs > 1) as i64),
    ];
    crate::gpu::template::expand(TOKEN_TEMPLATE, &vars).expect("the serial token template expands")
}

/// The template of the serial kernel's per-token code.
pub const TOKEN_TEMPLATE: &str = include_str!("../../../shaders/templates/serial_token.wgsl");

#[cfg(test)]
mod tests {
    use super::token_code;

    /// The template expands for every shape: nothing of it left over, one
    /// score per row, one load per vec4 of K and of V. (Before the template,
    /// Rust string building wrote this code; on a grid of 1-8 head rows, 1-2
    /// slots, 1-64 vec4s, quantized or not and 1, 2 or 4 KV4s per load, the
    /// template's output was checked byte for byte against it.)
    #[test]
    fn the_template_expands_for_every_shape() {
        for ht in 1..=8 {
            for qs in 1..=2 {
                for d4 in [1u32, 2, 4, 8, 16, 32, 64] {
                    for (quant, wide) in [(false, 1), (false, 2), (true, 1), (true, 4)] {
                        if d4 % wide != 0 {
                            continue;
                        }
                        let c = token_code(ht, qs, d4, quant, wide);
                        let what = format!("ht {ht} qs {qs} d4 {d4} quant {quant} wide {wide}");
                        assert!(!c.contains("{{") && !c.contains("//#"), "{what}");
                        let count = |p: &str| {
                            c.lines().filter(|l| l.trim_start().starts_with(p)).count() as u32
                        };
                        assert_eq!(count("var s"), ht * qs, "{what}");
                        assert_eq!(
                            count("let k") - 1,
                            d4 + if wide > 1 { d4 / wide } else { 0 } + quant as u32,
                            "{what}"
                        );
                        assert_eq!(
                            count("let v"),
                            d4 + if wide > 1 { d4 / wide } else { 0 } + 1,
                            "{what}"
                        );
                        let windows = c.matches("params.sliding_window == 0u ||").count() as u32;
                        assert_eq!(windows, if qs > 1 { qs } else { 0 }, "{what}");
                    }
                }
            }
        }
    }
}
