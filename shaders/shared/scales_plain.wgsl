// Per-token K and V scales of f32 and f16 pools: 1, and no K outlier
// channels (see scales_int8.wgsl for what each function means).
const K_RES: bool = false;
fn k_scale(row: u32, kvh: u32) -> f32 { return 1.0; }
fn v_scale(row: u32, kvh: u32) -> f32 { return 1.0; }
fn q_smooth(kvh: u32, c: u32) -> vec4<f32> { return vec4<f32>(1.0); }
fn q_res(qbase: u32, kvh: u32) -> vec4<f32> { return vec4<f32>(0.0); }
fn k_res(row: u32, kvh: u32) -> vec4<f32> { return vec4<f32>(0.0); }
