//#import constants     HEAD_DIM4 GROUP BLOCK_SIZE QTILE PAGED HT HTILES LPT JN SUBGROUPS (generated from the shape: src/gpu/compose.rs)
//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
//#import kv            KV4 kv_load kv_store (shared/kv_<pool dtype>.wgsl)
//#import qdot          QV4 q_conv k_dot (shared/qdot.wgsl)
//#import act           ACT4 act_load act_store (shared/act_<activation dtype>.wgsl)
//#import out           OUT4 out_load out_store (shared/out_<activation dtype>.wgsl)
//#import common        WriteKvParams CopyParams AttnParams NEG_INF INVALID K_OUTLIERS logit ... (common.wgsl)
// Split-K merge: combines the per-partition (max, sum, accumulator) that
// attention.wgsl wrote (split-K decode) into the normalised output, by log-sum-exp.
// One workgroup per (sequence, query head); thread c owns vec4 column c.

@group(0) @binding(0) var<uniform> params: AttnParams;
// [num_seqs][num_heads][num_partitions][HEAD_DIM4]
@group(0) @binding(1) var<storage, read> part_acc: array<vec4<f32>>;
// [num_seqs][num_heads][num_partitions]
@group(0) @binding(2) var<storage, read> part_ml: array<vec2<f32>>;
// [num_seqs][num_heads][HEAD_DIM4]
@group(0) @binding(3) var<storage, read_write> out: array<OUT4>;
// The packed tables: the sink logits at sinks_off (PackedTables).
@group(0) @binding(4) var<storage, read> table: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) c: u32) {
    let o = wg.x * params.num_heads + wg.y;
    let np = params.num_partitions;
    if c >= HEAD_DIM4 {
        return;
    }
    var m = NEG_INF;
    for (var i = 0u; i < np; i++) {
        m = max(m, part_ml[o * np + i].x);
    }
    // A sink joins the denominator once per row, with no value; a row that
    // attended no key stays zero.
    var sink = NEG_INF;
    if params.sinks_off != 0u {
        sink = bitcast<f32>(table[min(params.sinks_off + wg.y, arrayLength(&table) - 1u)]);
        m = max(m, sink);
    }
    var l = 0.0;
    var a = vec4<f32>(0.0);
    for (var i = 0u; i < np; i++) {
        let ml = part_ml[o * np + i];
        if ml.y > 0.0 {
            let w = exp(ml.x - m);
            l += ml.y * w;
            a += part_acc[(o * np + i) * HEAD_DIM4 + c] * w;
        }
    }
    let attended = l > 0.0;
    if params.sinks_off != 0u {
        l += exp(sink - m);
    }
    out[o * HEAD_DIM4 + c] = out_store(select(vec4<f32>(0.0), a / l, attended));
}
