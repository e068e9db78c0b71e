//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
// ACT4, act_load, act_store: the activations read (Q in attention, new K/V in write_kv), as f16 packed two per u32 (the bytes of an f16 array); stores saturate at f16's largest finite value.
alias ACT4 = vec2<u32>;
fn act_load(x: ACT4) -> vec4<f32> { return vec4<f32>(unpack2x16float(x.x), unpack2x16float(x.y)); }
fn act_store(x: vec4<f32>) -> ACT4 { let y = kv_sat(x, F16_MAX); return vec2<u32>(pack2x16float(y.xy), pack2x16float(y.zw)); }
