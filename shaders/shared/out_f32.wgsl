// OUT4, out_load, out_store: the output written (attention's unsplit output, reduce's output), as f32.
alias OUT4 = vec4<f32>;
fn out_load(x: OUT4) -> vec4<f32> { return x; }
fn out_store(x: vec4<f32>) -> OUT4 { return x; }
