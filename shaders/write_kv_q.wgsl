// write_kv for quantized pools (KV4 = u32: four 8-bit values). The layer
// buffer holds the packed rows, [num_blocks][num_kv_heads][BLOCK_SIZE]
// [HEAD_DIM4] words, then the scales from word DATA_WORDS on
// (DATA_WORDS = num_slots * num_kv_heads * HEAD_DIM4):
//   int8 (KV_QUANT 1): one f32 per row, the row's largest |x| (scale / 127),
//     then one K smoothing factor per (KV head, channel) that K is divided
//     by first (the kernels multiply the query by it);
//     one thread per (token, head) finds it, then writes every word with
//     pack4x8snorm(x / amax): symmetric, round to nearest.
//   fp8 e4m3 (KV_QUANT 2): one f32 per KV head, set by the host; one thread
//     per word encodes x / scale, saturating at +-448 (infinities too);
//     NaN is stored as 0. Never NaN in the pool.
// int8: non-finite inputs are stored as 0. Slots outside the pool are skipped.

@group(0) @binding(0) var<uniform> params: WriteKvParams;
@group(0) @binding(1) var<storage, read> k_new: array<ACT4>;
@group(0) @binding(2) var<storage, read> v_new: array<ACT4>;
@group(0) @binding(3) var<storage, read> slots: array<u32>;
@group(0) @binding(4) var<storage, read_write> k_pool: array<u32>;
@group(0) @binding(5) var<storage, read_write> v_pool: array<u32>;

fn finite4(x: vec4<f32>) -> vec4<f32> {
    let bits = bitcast<vec4<u32>>(x) & vec4<u32>(0x7fffffffu);
    return select(x, vec4<f32>(0.0), bits >= vec4<u32>(0x7f800000u));
}

fn smooth4(w: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(vec4<u32>(k_pool[w], k_pool[w + 1u], k_pool[w + 2u], k_pool[w + 3u]));
}

fn amax4(x: vec4<f32>) -> f32 {
    let a = abs(x);
    return max(max(a.x, a.y), max(a.z, a.w));
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    let kvh = params.num_kv_heads;
    let data_words = params.num_slots * kvh * HEAD_DIM4;
    let per_token = select(kvh * HEAD_DIM4, kvh, KV_QUANT == 1u);
    if i >= params.num_tokens * per_token {
        return;
    }
    let tok = i / per_token;
    let rem = i % per_token;
    let slot = slots[tok];
    if slot >= params.num_slots {
        return;
    }
    if KV_QUANT == 1u {
        let h = rem;
        let row = (slot / BLOCK_SIZE * kvh + h) * BLOCK_SIZE + slot % BLOCK_SIZE;
        let src0 = select(tok * kvh * HEAD_DIM4, tok * params.kv_stride, params.kv_stride != 0u) + h * HEAD_DIM4;
        // K is divided by its channels' smoothing factors (after the row
        // scales: one f32 per (KV head, channel); 1 unless the engine set them).
        let smooth0 = data_words + params.num_slots * kvh + h * HEAD_DIM4 * 4u;
        var ka = 0.0;
        var va = 0.0;
        for (var c = 0u; c < HEAD_DIM4; c++) {
            ka = max(ka, amax4(finite4(act_load(k_new[src0 + c]) / smooth4(smooth0 + 4u * c))));
            va = max(va, amax4(finite4(act_load(v_new[src0 + c]))));
        }
        let ki = select(1.0 / ka, 0.0, ka == 0.0);
        let vi = select(1.0 / va, 0.0, va == 0.0);
        let dst0 = row * HEAD_DIM4;
        if data_words + row < arrayLength(&k_pool) {
            for (var c = 0u; c < HEAD_DIM4; c++) {
                k_pool[dst0 + c] = pack4x8snorm(finite4(act_load(k_new[src0 + c]) / smooth4(smooth0 + 4u * c)) * ki);
                v_pool[dst0 + c] = pack4x8snorm(finite4(act_load(v_new[src0 + c])) * vi);
            }
            k_pool[data_words + row] = bitcast<u32>(ka);
            v_pool[data_words + row] = bitcast<u32>(va);
        }
    } else {
        let h = rem / HEAD_DIM4;
        let c = rem % HEAD_DIM4;
        let dst = ((slot / BLOCK_SIZE * kvh + h) * BLOCK_SIZE + slot % BLOCK_SIZE) * HEAD_DIM4 + c;
        if data_words + h < arrayLength(&k_pool) {
            let src = select(i, tok * params.kv_stride + rem, params.kv_stride != 0u);
            let ks = bitcast<f32>(k_pool[data_words + h]);
            let vs = bitcast<f32>(v_pool[data_words + h]);
            // Past +-448 saturates (infinities too); NaN is stored as 0.
            k_pool[dst] = fp8x4_enc(act_load(k_new[src]) / ks);
            v_pool[dst] = fp8x4_enc(act_load(v_new[src]) / vs);
        }
    }
}
