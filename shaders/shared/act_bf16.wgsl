//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
// ACT4, act_load, act_store: the activations read (Q in attention, new K/V in write_kv), as bfloat16 packed two per u32 (the bytes of a bf16 array, low half first): widened by a shift, stored rounded to nearest (ties to even) after saturating at KV_MAX.
alias ACT4 = vec2<u32>;
fn act_bf16_pair(w: u32) -> vec2<f32> { return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u)); }
fn act_bf16_round(v: vec2<f32>) -> u32 {
    let b = bitcast<vec2<u32>>(v);
    let r = (b + vec2<u32>(0x7fffu) + ((b >> vec2<u32>(16u)) & vec2<u32>(1u))) >> vec2<u32>(16u);
    return r.x | (r.y << 16u);
}
fn act_load(x: ACT4) -> vec4<f32> { return vec4<f32>(act_bf16_pair(x.x), act_bf16_pair(x.y)); }
fn act_store(x: vec4<f32>) -> ACT4 { let y = kv_sat(x, KV_MAX); return vec2<u32>(act_bf16_round(y.xy), act_bf16_round(y.zw)); }
