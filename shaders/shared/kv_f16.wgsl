//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
// KV codec of f16 pools: a KV4 is four f16 packed two per u32 (read with
// unpack2x16float, so no shader-f16 feature is needed).
alias KV4 = vec2<u32>;
const KV_QUANT: u32 = 0u;
fn kv_load(x: KV4) -> vec4<f32> { return vec4<f32>(unpack2x16float(x.x), unpack2x16float(x.y)); }
fn kv_store(x: vec4<f32>) -> KV4 { let y = kv_sat(x, F16_MAX); return vec2<u32>(pack2x16float(y.xy), pack2x16float(y.zw)); }
