//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
// KV codec of f32 pools: a KV4 is four f32.
alias KV4 = vec4<f32>;
const KV_QUANT: u32 = 0u;
fn kv_load(x: KV4) -> vec4<f32> { return x; }
fn kv_store(x: vec4<f32>) -> KV4 { return kv_sat(x, KV_MAX); }
