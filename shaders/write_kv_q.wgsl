//#import constants     HEAD_DIM4 GROUP BLOCK_SIZE QTILE PAGED HT HTILES LPT JN SUBGROUPS (generated from the shape: src/gpu/compose.rs)
//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
//#import kv            KV4 kv_load kv_store (shared/kv_<pool dtype>.wgsl)
//#import qdot          QV4 q_conv k_dot (shared/qdot.wgsl)
//#import act           ACT4 act_load act_store (shared/act_<activation dtype>.wgsl)
//#import out           OUT4 out_load out_store (shared/out_<activation dtype>.wgsl)
//#import common        WriteKvParams CopyParams AttnParams NEG_INF INVALID K_OUTLIERS logit ... (common.wgsl)
// write_kv for quantized pools (KV4 = u32: four 8-bit values). A layer
// buffer holds the packed rows, [num_blocks][num_kv_heads][BLOCK_SIZE]
// [HEAD_DIM4] words (DATA_WORDS = num_slots * num_kv_heads * HEAD_DIM4),
// then side words: K one per row (same order); V (int8 only) the rows' bf16
// scales two per word (rows 2i and 2i + 1, low half first; one per word when
// BLOCK_SIZE is 1). The K buffer then holds the layer's tail:
//   int8 (KV_QUANT 1): one K smoothing factor per (KV head, channel), f32,
//     that K is divided by first (the kernels multiply the query by it);
//   fp8 e4m3 (KV_QUANT 2): one f32 K scale per KV head, then one V scale
//     per KV head, set by the host;
//   then K_OUTLIERS outlier channel indices per KV head (>= head_dim: none).
// int8: one thread per (token, head) row finds the row's largest |x|, rounds
//   it up to bf16 (S, so the stored scale is what the values were divided
//   by) and writes every word with pack4x8snorm(x / S): symmetric, round to
//   nearest. K's side word holds S in its low half and in its high half
//   each outlier channel's residual, in fifteenths of a step, as 4-bit
//   two's complement (channel j at bit 16 + 4j). V's half word is set with
//   atomics (the other half belongs to another row, maybe another thread).
// fp8: one thread per word encodes x / scale, saturating at +-448
//   (infinities too); NaN is stored as 0. Never NaN in the pool. The thread
//   of a row's first word writes K's side word: per outlier channel j, the
//   residual in fifteenths of the stored byte's ulp (bits 4j..4j+3) and the
//   byte's exponent field (bits 16 + 4j..).
// int8: values saturate at +-KV_MAX (infinities too), NaN is stored as 0.
// Slots outside the pool are skipped.

@group(0) @binding(0) var<uniform> params: WriteKvParams;
@group(0) @binding(1) var<storage, read> k_new: array<ACT4>;
@group(0) @binding(2) var<storage, read> v_new: array<ACT4>;
@group(0) @binding(3) var<storage, read> slots: array<u32>;
@group(0) @binding(4) var<storage, read_write> k_pool: array<u32>;
// Atomic: two rows share a V side word.
@group(0) @binding(5) var<storage, read_write> v_pool: array<atomic<u32>>;

// Saturates at +-KV_MAX (infinities too); NaN becomes 0. Every stored
// int8 value, and so its row's scale, stays at most KV_MAX in magnitude.
fn sat4(x: vec4<f32>) -> vec4<f32> {
    let bits = bitcast<vec4<u32>>(x) & vec4<u32>(0x7fffffffu);
    return select(clamp(x, vec4<f32>(-KV_MAX), vec4<f32>(KV_MAX)), vec4<f32>(0.0), bits > vec4<u32>(0x7f800000u));
}

fn smooth4(w: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(vec4<u32>(k_pool[w], k_pool[w + 1u], k_pool[w + 2u], k_pool[w + 3u]));
}

fn amax4(x: vec4<f32>) -> f32 {
    let a = abs(x);
    return max(max(a.x, a.y), max(a.z, a.w));
}

// A finite |x| rounded up to bf16, as its 16 bits (at most bf16's largest finite).
fn bf16_up(x: f32) -> u32 {
    return min((bitcast<u32>(x) + 0xffffu) >> 16u, 0x7f7fu);
}

// A residual in fifteenths of a unit, as a 4-bit two's-complement nibble.
fn nibble(r: f32) -> u32 {
    return u32(i32(clamp(round(r * 15.0), -8.0, 7.0))) & 0xfu;
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    let kvh = params.num_kv_heads;
    let data_words = params.num_slots * kvh * HEAD_DIM4;
    let side0 = data_words;
    let tail = data_words + params.num_slots * kvh;
    let chan0 = tail + select(2u * kvh, kvh * HEAD_DIM4 * 4u, KV_QUANT == 1u);
    // V's side words (int8): paired rows, or one per row at BLOCK_SIZE 1.
    let v_side = select(0u, select(params.num_slots * kvh, params.num_slots * kvh / 2u, BLOCK_SIZE >= 2u), KV_QUANT == 1u);
    // The whole layout must fit the buffers (a pool made for another shape never does).
    if chan0 + kvh * K_OUTLIERS > arrayLength(&k_pool) || data_words + v_side > arrayLength(&v_pool) {
        return;
    }
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
        // K is divided by its channels' smoothing factors (1 unless the engine set them).
        let smooth0 = tail + h * HEAD_DIM4 * 4u;
        var ka = 0.0;
        var va = 0.0;
        for (var c = 0u; c < HEAD_DIM4; c++) {
            ka = max(ka, amax4(sat4(act_load(k_new[src0 + c]) / smooth4(smooth0 + 4u * c))));
            va = max(va, amax4(sat4(act_load(v_new[src0 + c]))));
        }
        let kb = bf16_up(ka);
        let vb = bf16_up(va);
        let ks = bitcast<f32>(kb << 16u);
        let vs = bitcast<f32>(vb << 16u);
        let ki = select(1.0 / ks, 0.0, ks == 0.0);
        let vi = select(1.0 / vs, 0.0, vs == 0.0);
        let dst0 = row * HEAD_DIM4;
        for (var c = 0u; c < HEAD_DIM4; c++) {
            k_pool[dst0 + c] = pack4x8snorm(sat4(act_load(k_new[src0 + c]) / smooth4(smooth0 + 4u * c)) * ki);
            atomicStore(&v_pool[dst0 + c], pack4x8snorm(sat4(act_load(v_new[src0 + c])) * vi));
        }
        // Each outlier channel's residual: the exact value in steps less
        // the stored step count.
        var nib = 0u;
        for (var j = 0u; j < K_OUTLIERS; j++) {
            let ch = k_pool[chan0 + h * K_OUTLIERS + j];
            if ch < HEAD_DIM4 * 4u {
                let c = ch / 4u;
                let x = sat4(act_load(k_new[src0 + c]) / smooth4(smooth0 + 4u * c)) * ki;
                let stored = unpack4x8snorm(pack4x8snorm(x))[ch % 4u];
                let r = (clamp(x[ch % 4u], -1.0, 1.0) - stored) * 127.0;
                nib |= nibble(r) << (4u * j);
            }
        }
        k_pool[side0 + row] = kb | (nib << 16u);
        if BLOCK_SIZE >= 2u {
            let sh = (row & 1u) * 16u;
            atomicAnd(&v_pool[side0 + row / 2u], ~(0xffffu << sh));
            atomicOr(&v_pool[side0 + row / 2u], vb << sh);
        } else {
            atomicStore(&v_pool[side0 + row], vb);
        }
    } else {
        let h = rem / HEAD_DIM4;
        let c = rem % HEAD_DIM4;
        let row = (slot / BLOCK_SIZE * kvh + h) * BLOCK_SIZE + slot % BLOCK_SIZE;
        let dst = row * HEAD_DIM4 + c;
        let src = select(i, tok * params.kv_stride + rem, params.kv_stride != 0u);
        let ks = bitcast<f32>(k_pool[tail + h]);
        let vs = bitcast<f32>(k_pool[tail + kvh + h]);
        // Past +-448 saturates (infinities too); NaN is stored as 0.
        k_pool[dst] = fp8x4_enc(act_load(k_new[src]) / ks);
        atomicStore(&v_pool[dst], fp8x4_enc(act_load(v_new[src]) / vs));
        if c == 0u {
            var side = 0u;
            for (var j = 0u; j < K_OUTLIERS; j++) {
                let ch = k_pool[chan0 + h * K_OUTLIERS + j];
                if ch < HEAD_DIM4 * 4u {
                    let x = act_load(k_new[src + ch / 4u])[ch % 4u] / ks;
                    if abs(x) <= 448.0 {
                        let e = fp8_enc(x);
                        let ex = (e >> 3u) & 0xfu;
                        let ulp = exp2(f32(max(ex, 1u)) - 10.0);
                        side |= (nibble((x - fp8_dec(e)) / ulp) << (4u * j)) | (ex << (16u + 4u * j));
                    }
                }
            }
            k_pool[side0 + row] = side;
        }
    }
}
