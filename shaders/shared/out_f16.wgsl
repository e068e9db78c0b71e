//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
// OUT4, out_load, out_store: the output written (attention's unsplit output, reduce's output), as f16 packed two per u32 (the bytes of an f16 array); stores saturate at f16's largest finite value.
alias OUT4 = vec2<u32>;
fn out_load(x: OUT4) -> vec4<f32> { return vec4<f32>(unpack2x16float(x.x), unpack2x16float(x.y)); }
fn out_store(x: vec4<f32>) -> OUT4 { let y = kv_sat(x, F16_MAX); return vec2<u32>(pack2x16float(y.xy), pack2x16float(y.zw)); }
