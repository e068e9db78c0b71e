//#import constants     HEAD_DIM4 GROUP BLOCK_SIZE QTILE PAGED HT HTILES LPT JN SUBGROUPS (generated from the shape: src/gpu/compose.rs)
//#import common        WriteKvParams CopyParams AttnParams NEG_INF INVALID K_OUTLIERS logit ... (common.wgsl)
// Per-token K and V scales of fp8 pools: one f32 per (layer, KV head), in
// the words after the layer's blocks (read through kw, shared/pool_words*);
// and the K outlier channels' residuals (see scales_int8.wgsl).
fn data_words() -> u32 { return params.num_blocks * params.num_kv_heads * BLOCK_SIZE * HEAD_DIM4; }
fn layer_tail() -> u32 { return data_words() + params.num_blocks * params.num_kv_heads * BLOCK_SIZE; }
fn k_scale(row: u32, kvh: u32) -> f32 { return bitcast<f32>(kw(layer_tail() + kvh)); }
fn v_scale(row: u32, kvh: u32) -> f32 { return bitcast<f32>(kw(layer_tail() + params.num_kv_heads + kvh)); }
fn q_smooth(kvh: u32, c: u32) -> vec4<f32> { return vec4<f32>(1.0); }
fn k_chan(kvh: u32, j: u32) -> u32 { return kw(layer_tail() + 2u * params.num_kv_heads + kvh * K_OUTLIERS + j); }
// Sixteenths of the stored byte's ulp (bits 4j..), whose exponent
// field is at bits 16 + 4j.
fn k_res(row: u32, kvh: u32) -> vec4<f32> {
    let w = kw(data_words() + row / HEAD_DIM4);
    let iw = bitcast<i32>(w);
    let n = vec4<f32>(f32(extractBits(iw, 0u, 4u)), f32(extractBits(iw, 4u, 4u)), f32(extractBits(iw, 8u, 4u)), f32(extractBits(iw, 12u, 4u)));
    let e = max(vec4<u32>(extractBits(w, 16u, 4u), extractBits(w, 20u, 4u), extractBits(w, 24u, 4u), extractBits(w, 28u, 4u)), vec4<u32>(1u));
    // 2^(e - 10) built from its exponent bits (no exp2 per token).
    return n * bitcast<vec4<f32>>((e + vec4<u32>(117u)) << vec4<u32>(23u)) * (1.0 / 15.0);
}
