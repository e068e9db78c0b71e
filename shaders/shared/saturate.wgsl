// Stored values saturate (f16: at its largest finite value): kv_sat clamps
// to +-m, infinities included, and keeps a NaN. KV_MAX is 2^100 (the
// library's KV_MAX), F16_MAX binary16's largest finite value.
const KV_MAX: f32 = 1.2676506002282294e30;
const F16_MAX: f32 = 65504.0;
fn kv_sat(x: vec4<f32>, m: f32) -> vec4<f32> {
    let nan = (bitcast<vec4<u32>>(x) & vec4<u32>(0x7fffffffu)) > vec4<u32>(0x7f800000u);
    return select(clamp(x, vec4<f32>(-m), vec4<f32>(m)), x, nan);
}
