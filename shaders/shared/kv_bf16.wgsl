//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
// KV codec of bf16 pools: a KV4 is four bfloat16 packed two per u32 (low
// half first). A bf16 is the high 16 bits of an f32, so reading widens by
// a shift (no extension needed); writing rounds to nearest, ties to even,
// after saturating at KV_MAX (a NaN stays a NaN: its rounding carries into
// the mantissa, never into the exponent).
alias KV4 = vec2<u32>;
const KV_QUANT: u32 = 0u;
fn bf16_widen(w: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}
fn kv_load(x: KV4) -> vec4<f32> { return vec4<f32>(bf16_widen(x.x), bf16_widen(x.y)); }
fn bf16_round(v: vec2<f32>) -> u32 {
    let b = bitcast<vec2<u32>>(v);
    let r = (b + vec2<u32>(0x7fffu) + ((b >> vec2<u32>(16u)) & vec2<u32>(1u))) >> vec2<u32>(16u);
    return r.x | (r.y << 16u);
}
fn kv_store(x: vec4<f32>) -> KV4 { let y = kv_sat(x, KV_MAX); return vec2<u32>(bf16_round(y.xy), bf16_round(y.zw)); }
