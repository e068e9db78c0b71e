//! `attention_serial.wgsl`, for software adapters (llvmpipe, SwiftShader,
//! WARP): one invocation per (sequence, KV head, head tile, partition), no
//! barriers, no workgroup memory; its per-token code is generated here,
//! unrolled over rows and vec4s. Its cascade mode holds query slots.

use super::{DecodeKernel, SegmentFamily};
use crate::gpu::shader::{balanced_head_tile, ShaderShape};
use crate::gpu::{Gpu, KvDtype};

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
    fn shader(&self) -> &'static str {
        "attention_serial"
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
        KvDtype::Int8 | KvDtype::Fp8E4M3 if d4 % 4 == 0 => 4,
        KvDtype::F16 if d4 % 2 == 0 => 2,
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

/// The per-token code of `attention_serial.wgsl`, fully unrolled over the
/// invocation's rows and the head's vec4s: every private array is indexed
/// by constants only, so a compiler keeps it in registers (Mesa's NIR turns
/// a dynamically indexed private array into a ladder of selects, which made
/// this kernel take 16 s to compile on llvmpipe), and the only loop an
/// invocation runs per token is the token loop itself.
/// The rows are `qs` query slots of `ht` head rows each: decode has one
/// slot (its sequence's query); a cascade segment pass holds `qs` queries
/// of the sequences sharing the segment, so each K/V load serves `qs` x
/// `ht` rows. With several slots each row masks the tokens outside its own
/// query's sliding window (the token range walked is their union).
/// With `quant`, each row also holds `qf`, its values at the KV head's
/// outlier channels, and each token adds `dot(qf, k_res)` to its scores.
fn token_code(ht: u32, qs: u32, d4: u32, quant: bool, wide: u32) -> String {
    use std::fmt::Write;
    let qs = qs.max(1);
    let rows = ht * qs;
    let wide = wide.max(1);
    let mut o =
        String::from("// generated by src/gpu/kernels/serial.rs: the serial kernel's rows\n");
    let _ = writeln!(o, "const WGS: u32 = {}u;", workgroup_size(qs));
    // The pools' element: `wide` KV4s per vec4<u32> load (fewer, wider
    // loads: on llvmpipe each lane-varying load is a loop over the lanes).
    if wide > 1 {
        let _ = writeln!(o, "alias SKV4 = vec4<u32>;");
    } else {
        let _ = writeln!(o, "alias SKV4 = KV4;");
    }
    // KV4 `d` of the row at `row` (in KV4s) of `pool`, from the loads `{pool}w{j}`.
    let part = |pool: &str, d: u32| -> String {
        match wide {
            4 => format!(
                "{pool}w{}.{}",
                d / 4,
                ["x", "y", "z", "w"][(d % 4) as usize]
            ),
            2 => format!("{pool}w{}.{}", d / 2, ["xy", "zw"][(d % 2) as usize]),
            _ => format!("{pool}_pool[row + {d}u]"),
        }
    };
    let loads = |o: &mut String, pool: &str| {
        if wide > 1 {
            for j in 0..d4 / wide {
                let _ = writeln!(o, "    let {pool}w{j} = {pool}_pool[row / {wide}u + {j}u];");
            }
        }
    };
    // Query rows of slot `s`; rows at or past `live` are zero.
    let _ = writeln!(
        o,
        "fn ser_load_q(s: u32, qbase: u32, live: u32, kvh: u32) {{"
    );
    for slot in 0..qs {
        let _ = writeln!(o, "    if s == {slot}u {{");
        for h in 0..ht {
            let r = slot * ht + h;
            let _ = writeln!(o, "        if {h}u < live {{");
            for d in 0..d4 {
                let _ = writeln!(
                    o,
                    "            qv[{}u] = q_conv(act_load(q[qbase + {}u]) * q_smooth(kvh, {d}u));",
                    r * d4 + d,
                    h * d4 + d
                );
            }
            if quant {
                let _ = writeln!(
                    o,
                    "            qf[{r}u] = q_res(qbase + {}u, kvh);\n            has_res = has_res || any(qf[{r}u] != vec4<f32>(0.0));",
                    h * d4
                );
            }
            let _ = writeln!(o, "        }}");
        }
        let _ = writeln!(o, "    }}");
    }
    let _ = writeln!(o, "}}");
    // One token: scores, online softmax with a lazy rescale, V.
    let _ = writeln!(o, "fn ser_token(row: u32, kvh: u32, tok: u32) {{");
    // The token's K and V scales (1 unless the pool is quantized).
    let _ = writeln!(
        o,
        "    let ks = k_scale(row, kvh);\n    let vs = v_scale(row, kvh);"
    );
    for r in 0..rows {
        let _ = writeln!(o, "    var s{r} = 0.0;");
    }
    loads(&mut o, "k");
    for d in 0..d4 {
        let _ = writeln!(o, "    let k{d} = {};", part("k", d));
        for r in 0..rows {
            let _ = writeln!(o, "    s{r} += k_dot(qv[{}u], k{d});", r * d4 + d);
        }
    }
    if quant {
        // Only where the head has outlier channels: one branch per token,
        // the same way for the whole invocation.
        let _ = writeln!(o, "    if has_res {{\n        let kr = k_res(row, kvh);");
        for r in 0..rows {
            let _ = writeln!(o, "        s{r} += dot(qf[{r}u], kr);");
        }
        let _ = writeln!(o, "    }}");
    }
    if qs > 1 {
        // Per slot: whether the token lies in its query's window.
        for slot in 0..qs {
            let _ = writeln!(
                o,
                "    let in{slot} = params.sliding_window == 0u || qpos[{slot}u] - tok < params.sliding_window;"
            );
        }
    }
    // Branch-free: every row rescales by f (1 unless its max grew), so the
    // code is one basic block (a branch per row made the compile several
    // times slower on llvmpipe). The V scale goes into the weight.
    for r in 0..rows {
        let slot = r / ht;
        let _ = writeln!(
            o,
            "    let x{r} = logit(params, s{r} * ks, slope[{r}u], qpos[{slot}u], tok) * LOG2E;"
        );
        if qs > 1 {
            // Outside the window: no weight, and the max does not move.
            let _ = writeln!(
                o,
                "    let mn{r} = select(m[{r}u], max(m[{r}u], x{r}), in{slot});\n    \
                 let f{r} = exp2(m[{r}u] - mn{r});\n    \
                 let w{r} = select(0.0, exp2(x{r} - mn{r}), in{slot});"
            );
        } else {
            let _ = writeln!(
                o,
                "    let mn{r} = max(m[{r}u], x{r});\n    let f{r} = exp2(m[{r}u] - mn{r});\n    \
                 let w{r} = exp2(x{r} - mn{r});"
            );
        }
        let _ = writeln!(
            o,
            "    l[{r}u] = l[{r}u] * f{r} + w{r};\n    m[{r}u] = mn{r};\n    let wv{r} = w{r} * vs;"
        );
    }
    loads(&mut o, "v");
    for d in 0..d4 {
        let _ = writeln!(o, "    let v{d} = kv_load({});", part("v", d));
        for r in 0..rows {
            let i = r * d4 + d;
            let _ = writeln!(o, "    acc[{i}u] = acc[{i}u] * f{r} + wv{r} * v{d};");
        }
    }
    let _ = writeln!(o, "}}");
    // Output rows of slot `s` (`live` of them): `base` + h * `stride`
    // vec4s; split partials also write (max in natural-log units, sum) at
    // ml + h * ml_stride.
    let _ = writeln!(
        o,
        "fn ser_out(s: u32, base: u32, stride: u32, live: u32, split: bool, ml: u32, ml_stride: u32) {{"
    );
    for slot in 0..qs {
        let _ = writeln!(o, "    if s == {slot}u {{");
        for h in 0..ht {
            let r = slot * ht + h;
            let _ = writeln!(o, "        if {h}u < live {{");
            let _ = writeln!(
                o,
                "            let inv = select(1.0 / l[{r}u], 0.0, l[{r}u] == 0.0);\n            \
                 let sc = select(inv, 1.0, split);"
            );
            for d in 0..d4 {
                let _ = writeln!(
                    o,
                    "            out[base + {h}u * stride + {d}u] = out_store(acc[{}u] * sc);",
                    r * d4 + d
                );
            }
            let _ = writeln!(
                o,
                "            if split {{\n                out_ml[ml + {h}u * ml_stride] = vec2<f32>(m[{r}u] * LN2, l[{r}u]);\n            }}\n        }}"
            );
        }
        let _ = writeln!(o, "    }}");
    }
    let _ = writeln!(o, "}}");
    o
}
