//! WGSL sources and their specialisation.
//!
//! Each kernel is `shaders/<kernel>.wgsl`, with the shared structs of
//! `shaders/common.wgsl`. Shapes that set loop trip counts and workgroup
//! array sizes (head_dim, GQA group, block size, KV element type) are baked
//! in by a generated prelude, so loops have constant bounds the compiler can
//! unroll, and a pipeline exists per shape actually used.

use super::KvDtype;

/// The common structs and helpers.
pub const COMMON: &str = include_str!("../../shaders/common.wgsl");

/// Every kernel: (name, source without prelude and common part).
pub const KERNELS: &[(&str, &str)] = &[
    ("write_kv", include_str!("../../shaders/write_kv.wgsl")),
    ("write_kv_q", include_str!("../../shaders/write_kv_q.wgsl")),
    (
        "copy_blocks_q",
        include_str!("../../shaders/copy_blocks_q.wgsl"),
    ),
    (
        "copy_blocks",
        include_str!("../../shaders/copy_blocks.wgsl"),
    ),
    ("attention", include_str!("../../shaders/attention.wgsl")),
    (
        "attention_lanes",
        include_str!("../../shaders/attention_lanes.wgsl"),
    ),
    (
        "attention_serial",
        include_str!("../../shaders/attention_serial.wgsl"),
    ),
    (
        "attention_rows",
        include_str!("../../shaders/attention_rows.wgsl"),
    ),
    ("reduce", include_str!("../../shaders/reduce.wgsl")),
    (
        "stream_read",
        include_str!("../../shaders/stream_read.wgsl"),
    ),
];

/// The compile-time shape of a kernel instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShaderShape {
    /// Elements per head; a multiple of 4, at most 256.
    pub head_dim: u32,
    /// Query heads per KV head.
    pub group: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Element type of the pool.
    pub dtype: KvDtype,
    /// Queries per attention workgroup: 1 for decode, more for prefill.
    pub qtile: u32,
    /// Walk the block table (true), or assume each sequence's blocks are
    /// consecutive from its first one (the contiguous baseline).
    pub paged: bool,
    /// Activations read (Q in attention, new K/V in write_kv) are f16,
    /// packed two per `u32` (the same bytes as an `f16` array), instead of f32.
    pub q_f16: bool,
    /// The output written (attention's unsplit output, reduce's output) is
    /// packed f16 instead of f32. Split-K partials stay f32.
    pub out_f16: bool,
    /// Query heads of one GQA group served by one attention pass (a head
    /// tile); 0 means the whole group. A group larger than a pass can hold
    /// runs as `ceil(group / htile)` tiles, each re-reading the K/V rows.
    pub htile: u32,
    /// `attention_lanes`: lanes that share one token's row (each reads every
    /// `lpt`-th vec4 of it); a power of two dividing `head_dim / 4`.
    pub lpt: u32,
    /// `attention_lanes`: reduce across a token's lanes with subgroup
    /// shuffles (the device has `SUBGROUP` with subgroups of at least
    /// `lpt`), instead of workgroup memory and a barrier.
    pub subgroups: bool,
}

impl Default for ShaderShape {
    /// head_dim 128, group 1, block 16, f32, decode, paged, f32 activations.
    fn default() -> Self {
        Self {
            head_dim: 128,
            group: 1,
            block_size: 16,
            dtype: KvDtype::F32,
            qtile: 1,
            paged: true,
            q_f16: false,
            out_f16: false,
            htile: 0,
            lpt: 1,
            subgroups: false,
        }
    }
}

impl ShaderShape {
    /// Query heads per attention pass (`htile`, or the whole group).
    pub fn head_tile(&self) -> u32 {
        if self.htile == 0 {
            self.group.max(1)
        } else {
            self.htile.min(self.group).max(1)
        }
    }

    /// Head tiles per KV head.
    pub fn head_tiles(&self) -> u32 {
        self.group.max(1).div_ceil(self.head_tile())
    }
}

/// The shared WGSL of `shaders/shared/`, composed into the kernels by
/// [`source`] (one file per piece: a reader finds each in one place, and
/// `cargo run --example shaders` writes every kernel as composed).
mod shared {
    /// `kv_sat`, `KV_MAX`, `F16_MAX`: stored values saturate.
    pub const SATURATE: &str = include_str!("../../shaders/shared/saturate.wgsl");
    /// The KV codecs: `KV4`, `kv_load`, `kv_store`, per pool dtype.
    pub const KV_F32: &str = include_str!("../../shaders/shared/kv_f32.wgsl");
    pub const KV_F16: &str = include_str!("../../shaders/shared/kv_f16.wgsl");
    pub const KV_INT8: &str = include_str!("../../shaders/shared/kv_int8.wgsl");
    pub const KV_FP8: &str = include_str!("../../shaders/shared/kv_fp8.wgsl");
    /// Activations (`ACT4`) and outputs (`OUT4`), f32 or packed f16.
    pub const ACT_F32: &str = include_str!("../../shaders/shared/act_f32.wgsl");
    pub const ACT_F16: &str = include_str!("../../shaders/shared/act_f16.wgsl");
    pub const OUT_F32: &str = include_str!("../../shaders/shared/out_f32.wgsl");
    pub const OUT_F16: &str = include_str!("../../shaders/shared/out_f16.wgsl");
    /// `QV4`, `q_conv`, `k_dot`.
    pub const QDOT: &str = include_str!("../../shaders/shared/qdot.wgsl");
    /// The block-table walk every attention kernel shares.
    pub const TABLE_WALK: &str = include_str!("../../shaders/shared/table_walk.wgsl");
    /// Per-token K/V scales and K outlier residuals, per pool dtype.
    pub const SCALES_PLAIN: &str = include_str!("../../shaders/shared/scales_plain.wgsl");
    pub const SCALES_INT8: &str = include_str!("../../shaders/shared/scales_int8.wgsl");
    pub const SCALES_FP8: &str = include_str!("../../shaders/shared/scales_fp8.wgsl");
    pub const Q_RES: &str = include_str!("../../shaders/shared/q_res.wgsl");
    /// A quantized pool's u32 words, through the pools' own view.
    pub const POOL_WORDS: &str = include_str!("../../shaders/shared/pool_words.wgsl");
    pub const POOL_WORDS_WIDE: &str = include_str!("../../shaders/shared/pool_words_wide.wgsl");
}

/// Every shared file, by name (for the shader tests and the dump).
pub const SHARED: &[(&str, &str)] = &[
    ("saturate", shared::SATURATE),
    ("kv_f32", shared::KV_F32),
    ("kv_f16", shared::KV_F16),
    ("kv_int8", shared::KV_INT8),
    ("kv_fp8", shared::KV_FP8),
    ("act_f32", shared::ACT_F32),
    ("act_f16", shared::ACT_F16),
    ("out_f32", shared::OUT_F32),
    ("out_f16", shared::OUT_F16),
    ("qdot", shared::QDOT),
    ("table_walk", shared::TABLE_WALK),
    ("scales_plain", shared::SCALES_PLAIN),
    ("scales_int8", shared::SCALES_INT8),
    ("scales_fp8", shared::SCALES_FP8),
    ("q_res", shared::Q_RES),
    ("pool_words", shared::POOL_WORDS),
    ("pool_words_wide", shared::POOL_WORDS_WIDE),
];

/// The attention kernels' per-token K and V scales and K outlier channels
/// for a pool of `dtype` (`shaders/shared/scales_*.wgsl`, and `q_res.wgsl`
/// for the quantized pools).
fn scale_helpers(dtype: KvDtype) -> [&'static str; 2] {
    match dtype {
        KvDtype::F32 | KvDtype::F16 => [shared::SCALES_PLAIN, ""],
        KvDtype::Int8 => [shared::SCALES_INT8, shared::Q_RES],
        KvDtype::Fp8E4M3 => [shared::SCALES_FP8, shared::Q_RES],
    }
}

/// The prelude of every kernel: the shape's constants, generated (this is
/// all the Rust side writes besides the unrolled row code below), then the
/// shared files its dtypes select: saturation, the KV codec, the query
/// dot, the activation and output types.
pub fn prelude(s: &ShaderShape) -> String {
    let kv = match s.dtype {
        KvDtype::F32 => shared::KV_F32,
        KvDtype::F16 => shared::KV_F16,
        KvDtype::Int8 => shared::KV_INT8,
        KvDtype::Fp8E4M3 => shared::KV_FP8,
    };
    let act = if s.q_f16 {
        shared::ACT_F16
    } else {
        shared::ACT_F32
    };
    let out = if s.out_f16 {
        shared::OUT_F16
    } else {
        shared::OUT_F32
    };
    let ht = s.head_tile();
    let lpt = s.lpt.max(1);
    let jn = (s.head_dim / 4 / lpt).max(1);
    // Subgroup builtins need no `enable` in naga (wgpu's SUBGROUP feature
    // allows them; naga refuses the directive). Subgroups are native-only
    // in wgpu, so a browser never gets a subgroup shape.
    format!(
        "// generated by src/gpu/shader.rs: the shape's constants\n\
         const HEAD_DIM4: u32 = {}u;\nconst GROUP: u32 = {}u;\nconst BLOCK_SIZE: u32 = {}u;\nconst QTILE: u32 = {}u;\nconst PAGED: bool = {};\n\
         const HT: u32 = {ht}u;\nconst HTILES: u32 = {}u;\nconst LPT: u32 = {lpt}u;\nconst JN: u32 = {jn}u;\nconst SUBGROUPS: bool = {};\n\
         {}{kv}{}{act}{out}\n",
        s.head_dim / 4,
        s.group,
        s.block_size,
        s.qtile.max(1),
        s.paged,
        s.head_tiles(),
        s.subgroups,
        shared::SATURATE,
        shared::QDOT,
    )
}

/// Straight-line code over the HT rows of a head tile, for the kernels that
/// keep the rows in `var<private>` arrays (`attention_lanes`,
/// `attention_serial`): generated rather than looped, so that a software
/// adapter that counts loop iterations (llvmpipe) counts one per vec4, not
/// one per row and vec4, and every compiler sees constant indices.
/// `stride` is the vec4s of one row held per invocation.
/// With `shuffle`, `rows_shuffle(mask)` adds each row's score from the lane
/// `mask` away in the subgroup (else it is empty and never called).
fn row_helpers(ht: u32, stride: &str, shuffle: bool) -> String {
    let mut k = String::new();
    let mut v = String::new();
    let mut sc = String::new();
    let mut sh = String::new();
    for r in 0..ht {
        k += &format!("    s[{r}u] += k_dot(qv[{r}u * {stride} + j], x);\n");
        v += &format!(
            "    acc[{r}u * {stride} + j] = acc[{r}u * {stride} + j] * alpha[{r}u] + pw[{r}u] * x;\n"
        );
        sc += &format!("    acc[{r}u * {stride} + j] *= alpha[{r}u];\n");
        sh += &format!("    s[{r}u] += subgroupShuffleXor(s[{r}u], mask);\n");
    }
    let mut out = format!(
        "// generated by src/gpu/shader.rs: HT = {ht} rows\n\
         fn rows_k(j: u32, x: KV4) {{\n{k}}}\n\
         fn rows_v(j: u32, x: vec4<f32>) {{\n{v}}}\n\
         fn rows_scale(j: u32) {{\n{sc}}}\n"
    );
    if shuffle {
        out += &format!("fn rows_shuffle(mask: u32) {{\n{sh}}}\n");
    } else {
        out += "fn rows_shuffle(mask: u32) {}\n";
    }
    out
}

/// KV4s per load in `attention_serial.wgsl` (it reads its pools as
/// `vec4<u32>` where that holds whole KV4s of a row): 4 for int8 and fp8
/// when head_dim is a multiple of 16, 2 for f16 (packed) when it is a
/// multiple of 8, else 1. Quantized layer buffers are padded to 16 bytes
/// (`KvCacheConfig::layer_bytes`) so the view reaches their tails.
pub fn serial_wide(s: &ShaderShape) -> u32 {
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
pub fn serial_workgroup_size(qs: u32) -> u32 {
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
fn serial_helpers(ht: u32, qs: u32, d4: u32, quant: bool, wide: u32) -> String {
    use std::fmt::Write;
    let qs = qs.max(1);
    let rows = ht * qs;
    let wide = wide.max(1);
    let mut o = String::from("// generated by src/gpu/shader.rs: the serial kernel's rows\n");
    let _ = writeln!(o, "const WGS: u32 = {}u;", serial_workgroup_size(qs));
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

/// Token groups of `attention_rows.wgsl` (each of `ROWS x LPR` lanes walks
/// every TG-th token of the segment; merged once at the end): 4, so a
/// workgroup of 64-lane groups has 256 invocations and 4 tokens in flight.
/// On an H200 the segment pass's time fell as 1 / token groups (1, 2, 4:
/// `benches/NOTES.md` item 31).
pub const ROWS_TOKEN_GROUPS: u32 = 4;

/// Invocations per workgroup of `attention_rows.wgsl` for `s`: its rows
/// (`qtile` x head tile) x lanes per row (`lpt`) x token groups.
pub fn rows_workgroup_size(s: &ShaderShape) -> u32 {
    s.qtile.max(1) * s.head_tile() * s.lpt.max(1) * ROWS_TOKEN_GROUPS
}

/// Bytes of workgroup memory attention_rows.wgsl uses for `s`.
pub fn rows_workgroup_bytes(s: &ShaderShape) -> u32 {
    let lanes = s.qtile.max(1) * s.head_tile() * s.lpt.max(1);
    let jn = (s.head_dim / 4 / s.lpt.max(1)).max(1);
    let red = if s.subgroups {
        1
    } else {
        rows_workgroup_size(s)
    };
    16 * lanes * jn + 8 * lanes + 4 * red
}

/// The generated constants of `attention_rows.wgsl`, and `lane_sum`: a
/// row's partial dots summed over its lanes by subgroup shuffles (without
/// subgroups it is never called, and holds no subgroup builtin, which
/// naga refuses on such a device even in dead code).
fn rows_consts(s: &ShaderShape) -> String {
    let sum = if s.subgroups {
        "    var t = s;\n    for (var mask = 1u; mask < LPR; mask <<= 1u) {\n        \
         t += subgroupShuffleXor(t, mask);\n    }\n    return t;\n"
    } else {
        "    return s;\n"
    };
    format!(
        "// generated by src/gpu/shader.rs: the rows kernel's layout\n\
         const ROWS: u32 = {}u;\nconst TG: u32 = {}u;\nconst WGS: u32 = {}u;\n\
         fn lane_sum(s: f32) -> f32 {{\n{sum}}}\n",
        s.qtile.max(1) * s.head_tile(),
        ROWS_TOKEN_GROUPS,
        rows_workgroup_size(s)
    )
}

/// Whether `kernel` is built for pools of `dtype`: the `_q` kernels for
/// quantized pools only, their plain twins for f32 and f16 only.
pub fn kernel_takes(kernel: &str, dtype: KvDtype) -> bool {
    match kernel {
        "write_kv_q" | "copy_blocks_q" => dtype.quantized(),
        "write_kv" | "copy_blocks" => !dtype.quantized(),
        _ => true,
    }
}

/// The full source of `kernel` for `shape`; `None` for an unknown kernel name.
pub fn source(kernel: &str, shape: &ShaderShape) -> Option<String> {
    let body = KERNELS.iter().find(|(n, _)| *n == kernel)?.1;
    let mut shape = *shape;
    if kernel != "attention_lanes" && kernel != "attention_rows" {
        // Only the lanes and rows kernels read subgroups.
        shape.subgroups = false;
    }
    let ([scales, q_res], span) = if kernel.starts_with("attention") {
        (scale_helpers(shape.dtype), shared::TABLE_WALK)
    } else {
        (["", ""], "")
    };
    // KV4s per pool load: wide only in the serial kernel.
    let wide = if kernel == "attention_serial" {
        serial_wide(&shape)
    } else {
        1
    };
    let rows = match kernel {
        "attention_lanes" => row_helpers(shape.head_tile(), "JN", shape.subgroups),
        "attention_serial" => serial_helpers(
            shape.head_tile(),
            shape.qtile.max(1),
            shape.head_dim / 4,
            shape.dtype.quantized(),
            wide,
        ),
        "attention_rows" => rows_consts(&shape),
        _ => String::new(),
    };
    // Quantized pools' u32 words for the scale helpers: through the
    // serial kernel's vec4<u32> view where it has one.
    let words = if !kernel.starts_with("attention") || !shape.dtype.quantized() {
        ""
    } else if wide == 4 {
        shared::POOL_WORDS_WIDE
    } else {
        shared::POOL_WORDS
    };
    Some(format!(
        "{}{COMMON}\n{span}{words}{scales}{q_res}{rows}{body}",
        prelude(&shape)
    ))
}

/// Bytes of workgroup memory attention.wgsl uses for `shape`.
pub fn attention_workgroup_bytes(s: &ShaderShape) -> u32 {
    let (rows, d4, tile, wg) = (s.head_tile() * s.qtile.max(1), s.head_dim / 4, 64, 64);
    let segs = (wg / rows).max(1);
    16 * rows * d4 + 2 * (4 * rows * tile + 4 * tile) + 4 * rows * segs + 24 * rows + 20 * wg
}

/// Queries per prefill workgroup for `shape` (its `qtile` ignored): the most
/// query rows (queries x group heads, up to 16) whose workgroup memory fits
/// `limit` bytes; at least 1.
pub fn prefill_qtile(shape: &ShaderShape, limit: u32) -> u32 {
    let most = (16 / shape.head_tile()).max(1);
    // Largest power of two not above `most`.
    let mut qt = 1 << (31 - most.leading_zeros());
    while qt > 1
        && attention_workgroup_bytes(&ShaderShape {
            qtile: qt,
            ..*shape
        }) > limit
    {
        qt /= 2;
    }
    qt
}

/// Bytes of workgroup memory attention_lanes.wgsl uses for `shape`.
pub fn lanes_workgroup_bytes(s: &ShaderShape) -> u32 {
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
    while lpt > 1 && d4 % lpt != 0 {
        lpt /= 2;
    }
    lpt
}

/// The head tile of at most `most` rows that splits `group` most evenly:
/// `ceil(group / tiles)` for the fewest tiles that respect `most`.
pub fn balanced_head_tile(group: u32, most: u32) -> u32 {
    let group = group.max(1);
    let tiles = group.div_ceil(most.max(1));
    group.div_ceil(tiles)
}
