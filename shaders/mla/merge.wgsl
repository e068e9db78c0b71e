//#import mla_constants R4 V4 BLOCK_SIZE HG LANES WG TILE_ROWS QN AN (generated from the shape: src/gpu/mla.rs)
//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
//#import kv            KV4 kv_load kv_store (shared/kv_<pool dtype>.wgsl)
//#import act           ACT4 act_load act_store (shared/act_<activation dtype>.wgsl)
//#import out           OUT4 out_load out_store (shared/out_<activation dtype>.wgsl)
//#import mla_common    MlaParams NEG INVALID (mla/common.wgsl)
// Split-K merge of the MLA partials (decode.wgsl with parts > 1): the
// log-sum-exp of the partitions' (max, sum) weights their accumulators.
// Thread (x) owns vec4 column x of output row o = (query row, head); an
// empty partition (sum 0) adds nothing.

@group(0) @binding(0) var<uniform> params: MlaParams;
// [query row][head][part][V4]
@group(0) @binding(1) var<storage, read> part_acc: array<vec4<f32>>;
// [query row][head][part]
@group(0) @binding(2) var<storage, read> part_ml: array<vec2<f32>>;
// [query row][head][V4], in the output type.
@group(0) @binding(3) var<storage, read_write> out: array<OUT4>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c = gid.x;
    let o = wg.y + wg.z * nwg.y;
    let np = params.parts;
    if c >= V4 || o >= params.num_queries * params.num_heads || (o + 1u) * np > arrayLength(&part_ml) {
        return;
    }
    var m = NEG;
    for (var i = 0u; i < np; i++) {
        m = max(m, part_ml[o * np + i].x);
    }
    var l = 0.0;
    var a = vec4<f32>(0.0);
    for (var i = 0u; i < np; i++) {
        let w_ml = part_ml[o * np + i];
        let at = (o * np + i) * V4 + c;
        if w_ml.y > 0.0 && at < arrayLength(&part_acc) {
            let w = exp(w_ml.x - m);
            l += w_ml.y * w;
            a += part_acc[at] * w;
        }
    }
    if o * V4 + c < arrayLength(&out) {
        out[o * V4 + c] = out_store(select(vec4<f32>(0.0), a / l, l > 0.0));
    }
}
