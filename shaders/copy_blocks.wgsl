//#import constants     HEAD_DIM4 GROUP BLOCK_SIZE QTILE PAGED HT HTILES LPT JN SUBGROUPS (generated from the shape: src/gpu/compose.rs)
//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
//#import kv            KV4 kv_load kv_store (shared/kv_<pool dtype>.wgsl)
//#import qdot          QV4 q_conv k_dot (shared/qdot.wgsl)
//#import act           ACT4 act_load act_store (shared/act_<activation dtype>.wgsl)
//#import out           OUT4 out_load out_store (shared/out_<activation dtype>.wgsl)
//#import common        WriteKvParams CopyParams AttnParams NEG_INF INVALID K_OUTLIERS logit ... (common.wgsl)
// Applies a copy-on-write list inside one layer's pool: block dst becomes a
// copy of block src, for K and V. A compute kernel because WebGPU forbids
// copy_buffer_to_buffer within one buffer. One thread per KV4 element.
// Pairs naming a block outside the pool are skipped.

@group(0) @binding(0) var<uniform> params: CopyParams;
// (src, dst) pairs.
@group(0) @binding(1) var<storage, read> copies: array<vec2<u32>>;
@group(0) @binding(2) var<storage, read_write> k_pool: array<KV4>;
@group(0) @binding(3) var<storage, read_write> v_pool: array<KV4>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    let per = params.block_elems;
    if i >= params.num_copies * per {
        return;
    }
    let pair = copies[i / per];
    if pair.x >= params.num_blocks || pair.y >= params.num_blocks {
        return;
    }
    let e = i % per;
    k_pool[pair.y * per + e] = k_pool[pair.x * per + e];
    v_pool[pair.y * per + e] = v_pool[pair.x * per + e];
}
