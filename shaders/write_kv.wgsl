//#import constants     HEAD_DIM4 GROUP BLOCK_SIZE QTILE PAGED HT HTILES LPT JN SUBGROUPS (generated from the shape: src/gpu/compose.rs)
//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
//#import kv            KV4 kv_load kv_store (shared/kv_<pool dtype>.wgsl)
//#import qdot          QV4 q_conv k_dot (shared/qdot.wgsl)
//#import act           ACT4 act_load act_store (shared/act_<activation dtype>.wgsl)
//#import out           OUT4 out_load out_store (shared/out_<activation dtype>.wgsl)
//#import common        WriteKvParams CopyParams AttnParams NEG_INF INVALID K_OUTLIERS logit ... (common.wgsl)
// Scatters new tokens' K and V rows into their slots of the paged pool
// (slot = block * BLOCK_SIZE + offset). One thread per vec4 of K (and of V).
// Slots outside the pool are skipped.

@group(0) @binding(0) var<uniform> params: WriteKvParams;
// [num_tokens][num_kv_heads][HEAD_DIM4], rows kv_stride vec4s apart when set
@group(0) @binding(1) var<storage, read> k_new: array<ACT4>;
@group(0) @binding(2) var<storage, read> v_new: array<ACT4>;
@group(0) @binding(3) var<storage, read> slots: array<u32>;
@group(0) @binding(4) var<storage, read_write> k_pool: array<KV4>;
@group(0) @binding(5) var<storage, read_write> v_pool: array<KV4>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    // 2D dispatch when one dimension's 65535 workgroups are not enough.
    let i = gid.x + gid.y * nwg.x * 64u;
    let per_token = params.num_kv_heads * HEAD_DIM4;
    if i >= params.num_tokens * per_token {
        return;
    }
    let tok = i / per_token;
    let rem = i % per_token;
    let slot = slots[tok];
    if slot >= params.num_slots {
        return;
    }
    let h = rem / HEAD_DIM4;
    let c = rem % HEAD_DIM4;
    let dst = ((slot / BLOCK_SIZE * params.num_kv_heads + h) * BLOCK_SIZE + slot % BLOCK_SIZE) * HEAD_DIM4 + c;
    if dst < arrayLength(&k_pool) {
        let src = select(i, tok * params.kv_stride + rem, params.kv_stride != 0u);
        k_pool[dst] = kv_store(act_load(k_new[src]));
        v_pool[dst] = kv_store(act_load(v_new[src]));
    }
}
