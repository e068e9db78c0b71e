// ACT4, act_load, act_store: the activations read (Q in attention, new K/V in write_kv), as f32.
alias ACT4 = vec4<f32>;
fn act_load(x: ACT4) -> vec4<f32> { return x; }
fn act_store(x: vec4<f32>) -> ACT4 { return x; }
