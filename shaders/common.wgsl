// Shared structs and helpers of every kernel. The host prepends a generated
// prelude (see src/gpu/compose.rs) that defines:
//   HEAD_DIM4  : u32   head_dim / 4 (rows are handled as vec4)
//   GROUP      : u32   query heads per kv head (GQA group size)
//   BLOCK_SIZE : u32   tokens per block
//   KV4               storage type of 4 cache elements: vec4<f32>, or vec2<u32>
//                     holding four f16 packed two per u32
//   kv_load(KV4) -> vec4<f32>, kv_store(vec4<f32>) -> KV4
//
// Keep the structs in sync with src/gpu/params.rs (a test compares sizes).

struct WriteKvParams {
    num_tokens: u32,
    num_kv_heads: u32,
    num_slots: u32,
    // vec4s from one token's K (and V) row to the next; 0: packed rows
    // (a fused QKV output has a longer stride).
    kv_stride: u32,
}

struct CopyParams {
    num_copies: u32,
    num_blocks: u32,
    // KV4 elements per block: num_kv_heads * BLOCK_SIZE * HEAD_DIM4.
    block_elems: u32,
    _pad: u32,
}

struct AttnParams {
    num_seqs: u32,
    num_heads: u32,
    num_kv_heads: u32,
    num_blocks: u32,
    scale: f32,
    // 0 disables soft-capping.
    soft_cap: f32,
    // 0 disables the sliding window.
    sliding_window: u32,
    // 1: ALiBi slopes at table[slopes_off + head] (bitcast f32).
    alibi: u32,
    // Tokens per split-K partition; 0: one partition per sequence.
    partition_tokens: u32,
    num_partitions: u32,
    // Offsets into the packed table buffer (PackedTables in src/gpu/attention.rs).
    lens_off: u32,
    indices_off: u32,
    indices_len: u32,
    slopes_off: u32,
    qo_off: u32,
    // vec4s from one query's row of Q to the next; 0: packed rows.
    q_stride: u32,
    // Cascade passes (attention.wgsl): offset of the (query row, position)
    // pairs and of each segment's partial slot in the table; 0: off.
    qmap_off: u32,
    slot_off: u32,
    // Attention sink logit per query head at table[sinks_off + head]
    // (bitcast f32), joined to the denominator by reduce.wgsl; 0: none.
    sinks_off: u32,
    // StreamingLLM: positions [0, sink_tokens) stay visible beside the
    // sliding window (0: none; only set with a window).
    sink_tokens: u32,
}

// -f32::MAX written exactly: Tint (Chrome's WebGPU) rejects the decimal
// -3.40282347e+38f as out of f32 range, though naga accepts it.
const NEG_INF: f32 = -0x1.fffffep+127f;
const INVALID: u32 = 0xffffffffu;
// K channels per (layer, KV head) kept to higher precision in quantized
// pools (src/gpu/kv_cache.rs: K_OUTLIERS).
const K_OUTLIERS: u32 = 4u;

// cap * tanh(s / cap), accurate to f32 at any finite cap: a cap far above
// the scores makes s / cap tiny, where tanh from exponentials cancels
// (relative error 0.8 at cap 1e8) and s / cap may be subnormal. There the
// odd series to the 7th power is exact to f32 (|s / cap| < 1/8: the next
// term is under 2e-9 relative), and s itself carries the magnitude.
fn soft_capped(s: f32, cap: f32) -> f32 {
    let r = s / cap;
    if abs(r) < 0.125 {
        let r2 = r * r;
        return s * (1.0 - r2 * (1.0 / 3.0 - r2 * (2.0 / 15.0 - r2 * (17.0 / 315.0))));
    }
    return cap * tanh(r);
}

// The logit of a score after the variant rules (custom scale, soft-cap,
// ALiBi). Masking (causal, window) is decided by the caller.
fn logit(p: AttnParams, dot_qk: f32, slope: f32, q_pos: u32, k_pos: u32) -> f32 {
    var s = dot_qk * p.scale;
    if p.soft_cap > 0.0 {
        s = soft_capped(s, p.soft_cap);
    }
    if p.alibi != 0u {
        s += slope * (f32(k_pos) - f32(q_pos));
    }
    return s;
}
