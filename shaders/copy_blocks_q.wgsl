//#import constants     HEAD_DIM4 GROUP BLOCK_SIZE QTILE PAGED HT HTILES LPT JN SUBGROUPS (generated from the shape: src/gpu/compose.rs)
//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
//#import kv            KV4 kv_load kv_store (shared/kv_<pool dtype>.wgsl)
//#import qdot          QV4 q_conv k_dot (shared/qdot.wgsl)
//#import act           ACT4 act_load act_store (shared/act_<activation dtype>.wgsl)
//#import out           OUT4 out_load out_store (shared/out_<activation dtype>.wgsl)
//#import common        WriteKvParams CopyParams AttnParams NEG_INF INVALID K_OUTLIERS logit ... (common.wgsl)
// copy_blocks for quantized pools: copies a block's packed words and its
// side words, for K and V: K's num_kv_heads * BLOCK_SIZE words at
// DATA_WORDS + block * num_kv_heads * BLOCK_SIZE (int8's row scale, the
// outlier residuals); int8 V's half as many (bf16 scales in pairs; as many
// at BLOCK_SIZE 1); fp8 V has none. fp8's per-head scales, int8's smoothing
// factors and the outlier channels belong to the layer and stay. One
// thread per word.

@group(0) @binding(0) var<uniform> params: CopyParams;
@group(0) @binding(1) var<storage, read> copies: array<vec2<u32>>;
@group(0) @binding(2) var<storage, read_write> k_pool: array<u32>;
@group(0) @binding(3) var<storage, read_write> v_pool: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    let per = params.block_elems;
    // Rows of a block: block_elems / HEAD_DIM4.
    let rows = per / HEAD_DIM4;
    let scales = rows;
    let v_scales = select(0u, select(rows, rows / 2u, BLOCK_SIZE >= 2u), KV_QUANT == 1u);
    let each = per + scales;
    if i >= params.num_copies * each {
        return;
    }
    let pair = copies[i / each];
    if pair.x >= params.num_blocks || pair.y >= params.num_blocks {
        return;
    }
    let e = i % each;
    if e < per {
        k_pool[pair.y * per + e] = k_pool[pair.x * per + e];
        v_pool[pair.y * per + e] = v_pool[pair.x * per + e];
    } else {
        let data_words = params.num_blocks * per;
        let s = e - per;
        k_pool[data_words + pair.y * rows + s] = k_pool[data_words + pair.x * rows + s];
        if s < v_scales {
            v_pool[data_words + pair.y * v_scales + s] = v_pool[data_words + pair.x * v_scales + s];
        }
    }
}
