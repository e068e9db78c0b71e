//#import kv            KV4 kv_load kv_store (shared/kv_<pool dtype>.wgsl)
// The query's storage in the row kernels, and q.k of one vec4.
alias QV4 = vec4<f32>;
fn q_conv(x: vec4<f32>) -> QV4 { return x; }
fn k_dot(a: QV4, x: KV4) -> f32 { return dot(a, kv_load(x)); }
