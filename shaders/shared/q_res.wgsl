//#import constants     HEAD_DIM4 GROUP BLOCK_SIZE QTILE PAGED HT HTILES LPT JN SUBGROUPS (generated from the shape: src/gpu/compose.rs)
//#import act           ACT4 act_load act_store (shared/act_<activation dtype>.wgsl)
// q_res of the quantized pools: a query row (qbase, in vec4s) at its KV
// head's outlier channels (times int8's smoothing), 0 where a channel is
// unset.
const K_RES: bool = true;
fn q_res1(qbase: u32, kvh: u32, j: u32) -> f32 {
    let ch = k_chan(kvh, j);
    if ch >= HEAD_DIM4 * 4u {
        return 0.0;
    }
    return (act_load(q[qbase + ch / 4u]) * q_smooth(kvh, ch / 4u))[ch % 4u];
}
fn q_res(qbase: u32, kvh: u32) -> vec4<f32> {
    return vec4<f32>(q_res1(qbase, kvh, 0u), q_res1(qbase, kvh, 1u), q_res1(qbase, kvh, 2u), q_res1(qbase, kvh, 3u));
}
