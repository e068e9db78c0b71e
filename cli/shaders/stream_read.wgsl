//#import constants     HEAD_DIM4 GROUP BLOCK_SIZE QTILE PAGED HT HTILES LPT JN SUBGROUPS (generated from the shape: src/gpu/compose.rs)
//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
//#import kv            KV4 kv_load kv_store (shared/kv_<pool dtype>.wgsl)
//#import qdot          QV4 q_conv k_dot (shared/qdot.wgsl)
//#import act           ACT4 act_load act_store (shared/act_<activation dtype>.wgsl)
//#import out           OUT4 out_load out_store (shared/out_<activation dtype>.wgsl)
//#import common        WriteKvParams CopyParams AttnParams NEG_INF INVALID K_OUTLIERS logit ... (common.wgsl)
//#import generated     LOADS (cli/src/bench/stream.rs)
// Streaming-read reference for the benchmark: reads two buffers (a layer's K
// and V pools, or a ceiling's chunks) once with 16-byte loads, grid-stride,
// LOADS independent loads per thread per iteration (generated: see
// cli/src/bench/stream.rs), and writes almost nothing. Decode's effective
// bandwidth is reported against it.

@group(0) @binding(0) var<storage, read> a: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> b: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> sink: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let threads = nwg.x * 64u;
    let n = min(arrayLength(&a), arrayLength(&b));
    var acc = vec4<f32>(0.0);
    for (var i = gid.x; i < n; i += threads * LOADS) {
        for (var j = 0u; j < LOADS; j++) {
            let k = i + j * threads;
            if k < n {
                acc += a[k] + b[k];
            }
        }
    }
    // A write no compiler can prove dead, which (almost) never happens.
    if acc.x == 1.2345e30 {
        sink[0] = acc.y + acc.z + acc.w;
    }
}
