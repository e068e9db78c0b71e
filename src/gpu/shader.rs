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

/// FP8 E4M3 in WGSL, by bit operations (no hardware fp8 assumed): bias 7,
/// subnormals at 2^-9, no infinities; encoding rounds to nearest even and
/// saturates at +-448, NaN is stored as 0.
const FP8: &str = "alias KV4 = u32;\nconst KV_QUANT: u32 = 2u;\n\
fn fp8_dec(b: u32) -> f32 {\n\
    let mag = b & 0x7fu;\n\
    let e = mag >> 3u;\n\
    let m = f32(mag & 7u);\n\
    let v = select((8.0 + m) * exp2(f32(e) - 10.0), m * 0.001953125, e == 0u);\n\
    return select(v, -v, (b & 0x80u) != 0u);\n\
}\n\
// Decoding through f16: an E4M3 byte's exponent and mantissa, moved to\n\
// bits 7..14 of an f16 (sign to bit 15), are the same number x 2^-8, normals\n\
// and subnormals alike; two bytes per unpack2x16float.\n\
fn fp8_pair(y: u32) -> vec2<f32> {\n\
    let h = ((y & 0x007f007fu) << 7u) | ((y & 0x00800080u) << 8u);\n\
    return unpack2x16float(h) * 256.0;\n\
}\n\
// Bytes 0 and 2, then 1 and 3 (fp8_pair reads bits 0..7 and 16..23).\n\
fn kv_load(x: KV4) -> vec4<f32> {\n\
    let a = fp8_pair(x);\n\
    let b = fp8_pair(x >> 8u);\n\
    return vec4<f32>(a.x, b.x, a.y, b.y);\n\
}\n\
fn fp8_enc(v: f32) -> u32 {\n\
    let bits = bitcast<u32>(v);\n\
    let sign = (bits >> 24u) & 0x80u;\n\
    if (bits & 0x7fffffffu) > 0x7f800000u {\n\
        return 0u;\n\
    }\n\
    let a = min(abs(v), 448.0);\n\
    if a < 0.015625 {\n\
        return sign | u32(round(a * 512.0));\n\
    }\n\
    var e = i32((bitcast<u32>(a) >> 23u) & 0xffu) - 127;\n\
    var q = u32(round((a * exp2(f32(-e)) - 1.0) * 8.0));\n\
    if q == 8u {\n\
        q = 0u;\n\
        e += 1;\n\
    }\n\
    return sign | (u32(e + 7) << 3u) | q;\n\
}\n\
fn fp8x4_enc(x: vec4<f32>) -> u32 {\n\
    return fp8_enc(x.x) | (fp8_enc(x.y) << 8u) | (fp8_enc(x.z) << 16u) | (fp8_enc(x.w) << 24u);\n\
}\n\
fn kv_store(x: vec4<f32>) -> KV4 { return fp8x4_enc(x); }\n";

/// What every attention kernel reads the same way, for one sequence (or
/// cascade segment): the packed table with its bounds, the span of the
/// sequence's table entries and its length (cut to what the table holds and
/// to 2^31, so no loop outruns the table), a token's pool row (INVALID when
/// unreadable: past the table, or a block outside the pool), and decode's
/// token range for a partition and a window. Declared per kernel because it
/// reads the kernel's `table` binding.
const ATTN_SPAN: &str = "\
fn table_at(i: u32) -> u32 {
    if i < arrayLength(&table) {
        return table[i];
    }
    return INVALID;
}
struct Span {
    ind_start: u32,
    ind_end: u32,
    len: u32,
    first_blk: u32,
}
fn seq_span(p: AttnParams, seq: u32) -> Span {
    let ind_end = min(table_at(seq + 1u), p.indices_len);
    let ind_start = min(table_at(seq), ind_end);
    let held = ind_end - ind_start;
    var len = min(table_at(p.lens_off + seq), 0x80000000u);
    if held <= 0xFFFFFFFFu / BLOCK_SIZE {
        len = min(len, held * BLOCK_SIZE);
    }
    return Span(ind_start, ind_end, len, table_at(p.indices_off + ind_start));
}
fn token_row(p: AttnParams, s: Span, kvh: u32, tok: u32) -> u32 {
    let j = s.ind_start + tok / BLOCK_SIZE;
    if tok >= s.len || j >= s.ind_end {
        return INVALID;
    }
    // PAGED == false: the contiguous twin used as the benchmark baseline;
    // the sequence's blocks follow its first one.
    var blk = s.first_blk + tok / BLOCK_SIZE;
    if PAGED {
        blk = table_at(p.indices_off + j);
    }
    if blk >= p.num_blocks {
        return INVALID;
    }
    return ((blk * p.num_kv_heads + kvh) * BLOCK_SIZE + tok % BLOCK_SIZE) * HEAD_DIM4;
}
// Decode: the tokens [begin, end) partition `part` walks; the query sits at
// len - 1 and sees the last `sliding_window` positions when one is set.
fn decode_range(p: AttnParams, len: u32, part: u32) -> vec2<u32> {
    let q_pos = max(len, 1u) - 1u;
    var t_begin = 0u;
    var t_end = len;
    if p.partition_tokens != 0u {
        t_begin = min(part * p.partition_tokens, t_end);
        t_end = min(t_begin + p.partition_tokens, t_end);
    }
    if p.sliding_window != 0u && q_pos + 1u > p.sliding_window {
        t_begin = max(t_begin, q_pos + 1u - p.sliding_window);
        t_end = max(t_end, t_begin);
    }
    return vec2<u32>(t_begin, t_end);
}
";

/// `q_res` of the quantized pools: a query row (`qbase`, in vec4s) at its
/// KV head's outlier channels, 0 where a channel is unset.
macro_rules! q_res {
    () => {
        "const K_RES: bool = true;
fn q_res1(qbase: u32, kvh: u32, j: u32) -> f32 {
    let ch = k_chan(kvh, j);
    if ch >= HEAD_DIM4 * 4u {
        return 0.0;
    }
    return (act_load(q[qbase + ch / 4u]) * q_smooth(kvh, ch / 4u))[ch % 4u];
}
fn q_res(qbase: u32, kvh: u32) -> vec4<f32> {
    return vec4<f32>(q_res1(qbase, kvh, 0u), q_res1(qbase, kvh, 1u), q_res1(qbase, kvh, 2u), q_res1(qbase, kvh, 3u));
}
"
    };
}

/// The attention kernels' per-token K and V scales: 1 for f32 and f16
/// pools; int8 reads the bf16 in the low half of the row's side word and
/// fp8 the KV head's f32, from the words after the layer's blocks. And the
/// K outlier channels of quantized pools (`K_RES`): `q_res` gathers a query
/// row's values at its KV head's outlier channels (times int8's smoothing),
/// `k_res` a K row's residuals there, in the units of `kv_load` (before the
/// row's K scale), so `dot(q_res, k_res)` is what q.k lacks.
fn scale_helpers(dtype: KvDtype) -> &'static str {
    match dtype {
        KvDtype::F32 | KvDtype::F16 => {
            "const K_RES: bool = false;\n\
             fn k_scale(row: u32, kvh: u32) -> f32 { return 1.0; }\n\
             fn v_scale(row: u32, kvh: u32) -> f32 { return 1.0; }\n\
             fn q_smooth(kvh: u32, c: u32) -> vec4<f32> { return vec4<f32>(1.0); }\n\
             fn q_res(qbase: u32, kvh: u32) -> vec4<f32> { return vec4<f32>(0.0); }\n\
             fn k_res(row: u32, kvh: u32) -> vec4<f32> { return vec4<f32>(0.0); }\n"
        }
        // q_smooth: the query times int8's K smoothing factors (after the
        // row side words), so q.k is what it was before K was divided by them.
        KvDtype::Int8 => concat!(
            "fn data_words() -> u32 { return params.num_blocks * params.num_kv_heads * BLOCK_SIZE * HEAD_DIM4; }\n\
             fn layer_tail() -> u32 { return data_words() + params.num_blocks * params.num_kv_heads * BLOCK_SIZE; }\n\
             fn k_scale(row: u32, kvh: u32) -> f32 { return bitcast<f32>(kw(data_words() + row / HEAD_DIM4) << 16u); }\n\
             // V: bf16 scales two per word (rows 2i, 2i + 1), one at BLOCK_SIZE 1.\n\
             fn v_scale(row: u32, kvh: u32) -> f32 {\n\
                 let r = row / HEAD_DIM4;\n\
                 if BLOCK_SIZE == 1u { return bitcast<f32>(vw(data_words() + r) << 16u); }\n\
                 return bitcast<f32>(((vw(data_words() + r / 2u) >> ((r & 1u) * 16u)) & 0xffffu) << 16u);\n\
             }\n\
             fn q_smooth(kvh: u32, c: u32) -> vec4<f32> {\n\
                 let w = layer_tail() + (kvh * HEAD_DIM4 + c) * 4u;\n\
                 return bitcast<vec4<f32>>(vec4<u32>(kw(w), kw(w + 1u), kw(w + 2u), kw(w + 3u)));\n\
             }\n\
             fn k_chan(kvh: u32, j: u32) -> u32 { return kw(layer_tail() + params.num_kv_heads * HEAD_DIM4 * 4u + kvh * K_OUTLIERS + j); }\n\
             // Sixteenths of a step (1 / 127) in the side word's high half.\n\
             fn k_res(row: u32, kvh: u32) -> vec4<f32> {\n\
                 let w = bitcast<i32>(kw(data_words() + row / HEAD_DIM4));\n\
                 return vec4<f32>(f32(extractBits(w, 16u, 4u)), f32(extractBits(w, 20u, 4u)), f32(extractBits(w, 24u, 4u)), f32(extractBits(w, 28u, 4u))) * (1.0 / 1905.0);\n\
             }\n",
            q_res!()
        ),
        KvDtype::Fp8E4M3 => concat!(
            "fn data_words() -> u32 { return params.num_blocks * params.num_kv_heads * BLOCK_SIZE * HEAD_DIM4; }\n\
             fn layer_tail() -> u32 { return data_words() + params.num_blocks * params.num_kv_heads * BLOCK_SIZE; }\n\
             fn k_scale(row: u32, kvh: u32) -> f32 { return bitcast<f32>(kw(layer_tail() + kvh)); }\n\
             fn v_scale(row: u32, kvh: u32) -> f32 { return bitcast<f32>(kw(layer_tail() + params.num_kv_heads + kvh)); }\n\
             fn q_smooth(kvh: u32, c: u32) -> vec4<f32> { return vec4<f32>(1.0); }\n\
             fn k_chan(kvh: u32, j: u32) -> u32 { return kw(layer_tail() + 2u * params.num_kv_heads + kvh * K_OUTLIERS + j); }\n\
             // Sixteenths of the stored byte's ulp (bits 4j..), whose exponent\n\
             // field is at bits 16 + 4j.\n\
             fn k_res(row: u32, kvh: u32) -> vec4<f32> {\n\
                 let w = kw(data_words() + row / HEAD_DIM4);\n\
                 let iw = bitcast<i32>(w);\n\
                 let n = vec4<f32>(f32(extractBits(iw, 0u, 4u)), f32(extractBits(iw, 4u, 4u)), f32(extractBits(iw, 8u, 4u)), f32(extractBits(iw, 12u, 4u)));\n\
                 let e = max(vec4<u32>(extractBits(w, 16u, 4u), extractBits(w, 20u, 4u), extractBits(w, 24u, 4u), extractBits(w, 28u, 4u)), vec4<u32>(1u));\n\
                 // 2^(e - 10) built from its exponent bits (no exp2 per token).\n\
                 return n * bitcast<vec4<f32>>((e + vec4<u32>(117u)) << vec4<u32>(23u)) * (1.0 / 15.0);\n\
             }\n",
            q_res!()
        ),
    }
}

/// The generated prelude that defines the shape constants and KV4 helpers.
pub fn prelude(s: &ShaderShape) -> String {
    let kv = match s.dtype {
        KvDtype::F32 => "alias KV4 = vec4<f32>;\nconst KV_QUANT: u32 = 0u;\n\
             fn kv_load(x: KV4) -> vec4<f32> { return x; }\n\
             fn kv_store(x: vec4<f32>) -> KV4 { return kv_sat(x, KV_MAX); }\n",
        KvDtype::F16 => "alias KV4 = vec2<u32>;\nconst KV_QUANT: u32 = 0u;\n\
             fn kv_load(x: KV4) -> vec4<f32> { return vec4<f32>(unpack2x16float(x.x), unpack2x16float(x.y)); }\n\
             fn kv_store(x: vec4<f32>) -> KV4 { let y = kv_sat(x, F16_MAX); return vec2<u32>(pack2x16float(y.xy), pack2x16float(y.zw)); }\n",
        // Scales applied by the kernels (k_scale / v_scale).
        KvDtype::Int8 => "alias KV4 = u32;\nconst KV_QUANT: u32 = 1u;\n\
             fn kv_load(x: KV4) -> vec4<f32> { return unpack4x8snorm(x); }\n\
             fn kv_store(x: vec4<f32>) -> KV4 { return pack4x8snorm(x); }\n\
             // write_kv_q's fp8 branch, never taken:\n\
             fn fp8x4_enc(x: vec4<f32>) -> u32 { return 0u; }\n\
             fn fp8_enc(x: f32) -> u32 { return 0u; }\n\
             fn fp8_dec(b: u32) -> f32 { return 0.0; }\n",
        KvDtype::Fp8E4M3 => FP8,
    };
    let packed = |name: &str, load: &str, store: &str| {
        format!(
            "alias {name} = vec2<u32>;\n\
             fn {load}(x: {name}) -> vec4<f32> {{ return vec4<f32>(unpack2x16float(x.x), unpack2x16float(x.y)); }}\n\
             fn {store}(x: vec4<f32>) -> {name} {{ let y = kv_sat(x, F16_MAX); return vec2<u32>(pack2x16float(y.xy), pack2x16float(y.zw)); }}\n"
        )
    };
    let plain = |name: &str, load: &str, store: &str| {
        format!(
            "alias {name} = vec4<f32>;\n\
             fn {load}(x: {name}) -> vec4<f32> {{ return x; }}\n\
             fn {store}(x: vec4<f32>) -> {name} {{ return x; }}\n"
        )
    };
    let act = if s.q_f16 {
        packed("ACT4", "act_load", "act_store")
    } else {
        plain("ACT4", "act_load", "act_store")
    };
    let out = if s.out_f16 {
        packed("OUT4", "out_load", "out_store")
    } else {
        plain("OUT4", "out_load", "out_store")
    };
    let ht = s.head_tile();
    let lpt = s.lpt.max(1);
    let jn = (s.head_dim / 4 / lpt).max(1);
    // Subgroup builtins need no `enable` in naga (wgpu's SUBGROUP feature
    // allows them; naga refuses the directive). Subgroups are native-only
    // in wgpu, so a browser never gets a subgroup shape.
    // The query's storage in the row kernels, and q.k of one vec4.
    let qdot = "alias QV4 = vec4<f32>;\n\
         fn q_conv(x: vec4<f32>) -> QV4 { return x; }\n\
         fn k_dot(a: QV4, x: KV4) -> f32 { return dot(a, kv_load(x)); }\n";
    format!(
        "// generated by src/gpu/shader.rs\n\
         // Stored values saturate here (f16: at its largest finite value);\n\
         // kv_sat clamps to +-m, infinities included, and keeps a NaN.\n\
         const KV_MAX: f32 = 1.2676506002282294e30;\nconst F16_MAX: f32 = 65504.0;\n\
         fn kv_sat(x: vec4<f32>, m: f32) -> vec4<f32> {{\n\
             let nan = (bitcast<vec4<u32>>(x) & vec4<u32>(0x7fffffffu)) > vec4<u32>(0x7f800000u);\n\
             return select(clamp(x, vec4<f32>(-m), vec4<f32>(m)), x, nan);\n\
         }}\n\
         const HEAD_DIM4: u32 = {}u;\nconst GROUP: u32 = {}u;\nconst BLOCK_SIZE: u32 = {}u;\nconst QTILE: u32 = {}u;\nconst PAGED: bool = {};\n\
         const HT: u32 = {ht}u;\nconst HTILES: u32 = {}u;\nconst LPT: u32 = {lpt}u;\nconst JN: u32 = {jn}u;\nconst SUBGROUPS: bool = {};\n{kv}{qdot}{act}{out}\n",
        s.head_dim / 4,
        s.group,
        s.block_size,
        s.qtile.max(1),
        s.paged,
        s.head_tiles(),
        s.subgroups,
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
/// `PAGEDATTN_ROWS_TG` (1, 2 or 4) overrides it, for bench probes; read
/// once per process, as pipelines are cached by shape.
pub fn rows_token_groups() -> u32 {
    static TG: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *TG.get_or_init(|| {
        match std::env::var("PAGEDATTN_ROWS_TG")
            .ok()
            .as_deref()
            .map(str::trim)
        {
            Some("1") => 1,
            Some("2") => 2,
            _ => 4,
        }
    })
}

/// Invocations per workgroup of `attention_rows.wgsl` for `s`: its rows
/// (`qtile` x head tile) x lanes per row (`lpt`) x token groups.
pub fn rows_workgroup_size(s: &ShaderShape) -> u32 {
    s.qtile.max(1) * s.head_tile() * s.lpt.max(1) * rows_token_groups()
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
        rows_token_groups(),
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
    let (scales, span) = if kernel.starts_with("attention") {
        (scale_helpers(shape.dtype), ATTN_SPAN)
    } else {
        ("", "")
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
        "fn kw(i: u32) -> u32 { return k_pool[i >> 2u][i & 3u]; }\n\
         fn vw(i: u32) -> u32 { return v_pool[i >> 2u][i & 3u]; }\n"
    } else {
        "fn kw(i: u32) -> u32 { return k_pool[i]; }\nfn vw(i: u32) -> u32 { return v_pool[i]; }\n"
    };
    Some(format!(
        "{}{COMMON}\n{span}{words}{scales}{rows}{body}",
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
