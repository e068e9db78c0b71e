//#import constants     HEAD_DIM4 GROUP BLOCK_SIZE QTILE PAGED HT HTILES LPT JN SUBGROUPS (generated from the shape: src/gpu/compose.rs)
//#import kv            KV4 kv_load kv_store (shared/kv_<pool dtype>.wgsl)
//#import common        WriteKvParams CopyParams AttnParams NEG_INF INVALID K_OUTLIERS logit ... (common.wgsl)
// Per-token K and V scales of int8 pools, from the side words after the
// layer's blocks (read through kw / vw, shared/pool_words*.wgsl): K's bf16
// scale in the low half of the row's side word, V's two per word. The K
// outlier channels (K_RES): k_res is a K row's residuals at its KV head's
// outlier channels, in the units of kv_load (before the row's K scale), so
// dot(q_res, k_res) is what q.k lacks (q_res: shared/q_res.wgsl).
fn data_words() -> u32 { return params.num_blocks * params.num_kv_heads * BLOCK_SIZE * HEAD_DIM4; }
fn layer_tail() -> u32 { return data_words() + params.num_blocks * params.num_kv_heads * BLOCK_SIZE; }
fn k_scale(row: u32, kvh: u32) -> f32 { return bitcast<f32>(kw(data_words() + row / HEAD_DIM4) << 16u); }
// V: bf16 scales two per word (rows 2i, 2i + 1), one at BLOCK_SIZE 1.
fn v_scale(row: u32, kvh: u32) -> f32 {
    let r = row / HEAD_DIM4;
    if BLOCK_SIZE == 1u { return bitcast<f32>(vw(data_words() + r) << 16u); }
    return bitcast<f32>(((vw(data_words() + r / 2u) >> ((r & 1u) * 16u)) & 0xffffu) << 16u);
}
// The query times int8's K smoothing factors (after the row side words),
// so q.k is what it was before K was divided by them.
fn q_smooth(kvh: u32, c: u32) -> vec4<f32> {
    let w = layer_tail() + (kvh * HEAD_DIM4 + c) * 4u;
    return bitcast<vec4<f32>>(vec4<u32>(kw(w), kw(w + 1u), kw(w + 2u), kw(w + 3u)));
}
fn k_chan(kvh: u32, j: u32) -> u32 { return kw(layer_tail() + params.num_kv_heads * HEAD_DIM4 * 4u + kvh * K_OUTLIERS + j); }
// Sixteenths of a step (1 / 127) in the side word's high half.
fn k_res(row: u32, kvh: u32) -> vec4<f32> {
    let w = bitcast<i32>(kw(data_words() + row / HEAD_DIM4));
    return vec4<f32>(f32(extractBits(w, 16u, 4u)), f32(extractBits(w, 20u, 4u)), f32(extractBits(w, 24u, 4u)), f32(extractBits(w, 28u, 4u))) * (1.0 / 1905.0);
}
