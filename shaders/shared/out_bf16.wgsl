//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
// OUT4, out_load, out_store: the output written (attention's unsplit output, reduce's output), as bfloat16 packed two per u32 (the bytes of a bf16 array): stores round to nearest (ties to even) after saturating at KV_MAX.
alias OUT4 = vec2<u32>;
fn out_bf16_pair(w: u32) -> vec2<f32> { return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u)); }
fn out_bf16_round(v: vec2<f32>) -> u32 {
    let b = bitcast<vec2<u32>>(v);
    let r = (b + vec2<u32>(0x7fffu) + ((b >> vec2<u32>(16u)) & vec2<u32>(1u))) >> vec2<u32>(16u);
    return r.x | (r.y << 16u);
}
fn out_load(x: OUT4) -> vec4<f32> { return vec4<f32>(out_bf16_pair(x.x), out_bf16_pair(x.y)); }
fn out_store(x: vec4<f32>) -> OUT4 { let y = kv_sat(x, KV_MAX); return vec2<u32>(out_bf16_round(y.xy), out_bf16_round(y.zw)); }
