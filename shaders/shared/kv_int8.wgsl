// KV codec of int8 pools: a KV4 is four snorm bytes in a u32; the scales
// are applied by the kernels (k_scale / v_scale, shared/scales_int8.wgsl).
alias KV4 = u32;
const KV_QUANT: u32 = 1u;
fn kv_load(x: KV4) -> vec4<f32> { return unpack4x8snorm(x); }
fn kv_store(x: vec4<f32>) -> KV4 { return pack4x8snorm(x); }
// write_kv_q's fp8 branch, never taken:
fn fp8x4_enc(x: vec4<f32>) -> u32 { return 0u; }
fn fp8_enc(x: f32) -> u32 { return 0u; }
fn fp8_dec(b: u32) -> f32 { return 0.0; }
