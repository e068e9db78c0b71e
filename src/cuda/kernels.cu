// The CUDA twins of shaders/write_kv.wgsl, shaders/copy_blocks.wgsl and
// shaders/attention.wgsl (decode), over the same pool layout
// [num_blocks][num_kv_heads][BLOCK_SIZE][HEAD_DIM] and the same CSR block
// tables. Compiled at run time by NVRTC (src/cuda/mod.rs), once per shape,
// with the shape given as macros so loops have constant trip counts:
//   HEAD_DIM    elements per head
//   GROUP       query heads per kv head (GQA group)
//   BLOCK_SIZE  tokens per block
//   KV_F16      1: the pool holds IEEE halves (the same bytes as the wgpu
//               pool's two-per-u32 packing), 0: f32
//
// No #include: NVRTC has no C library headers, and cuda_fp16.h is not
// needed: halves are converted with the PTX cvt instruction directly.

typedef unsigned int u32;
typedef unsigned long long u64;

// Our own, so nothing depends on which overloads NVRTC declares.
__device__ __forceinline__ u32 min_u32(u32 a, u32 b) { return a < b ? a : b; }

#if KV_F16
typedef unsigned short kv_t;
__device__ __forceinline__ float kv_load(kv_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// Round to nearest even, as half::f16::from_f32 and pack2x16float do.
__device__ __forceinline__ kv_t kv_store(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#else
typedef float kv_t;
__device__ __forceinline__ float kv_load(kv_t x) { return x; }
__device__ __forceinline__ kv_t kv_store(float x) { return x; }
#endif

// Scatters new tokens' K and V rows into their slots
// (slot = block * BLOCK_SIZE + offset). One thread per element.
// Slots outside the pool are skipped, as in write_kv.wgsl.
extern "C" __global__ void write_kv(
    const float* __restrict__ k_new,   // [num_tokens][num_kv_heads][HEAD_DIM]
    const float* __restrict__ v_new,
    const u32* __restrict__ slots,     // [num_tokens]
    kv_t* __restrict__ k_pool,
    kv_t* __restrict__ v_pool,
    u32 num_tokens, u32 num_kv_heads, u32 num_slots)
{
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 per_token = (u64)num_kv_heads * HEAD_DIM;
    if (i >= (u64)num_tokens * per_token) return;
    const u32 tok = (u32)(i / per_token);
    const u32 rem = (u32)(i % per_token);
    const u32 slot = slots[tok];
    if (slot >= num_slots) return;
    const u32 h = rem / HEAD_DIM;
    const u32 c = rem % HEAD_DIM;
    const u64 dst = (((u64)(slot / BLOCK_SIZE) * num_kv_heads + h) * BLOCK_SIZE
                     + slot % BLOCK_SIZE) * HEAD_DIM + c;
    k_pool[dst] = kv_store(k_new[i]);
    v_pool[dst] = kv_store(v_new[i]);
}

// Applies a copy-on-write list inside one layer's pool: block dst becomes a
// copy of block src, for K and V. One thread per element; pairs naming a
// block outside the pool are skipped, as in copy_blocks.wgsl.
extern "C" __global__ void copy_blocks(
    const u32* __restrict__ copies,    // (src, dst) pairs
    kv_t* k_pool,                      // not restrict: read and written
    kv_t* v_pool,
    u32 num_copies, u32 num_blocks, u32 block_elems)
{
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)num_copies * block_elems) return;
    const u32 pair = (u32)(i / block_elems);
    const u32 e = (u32)(i % block_elems);
    const u32 src = copies[2 * pair];
    const u32 dst = copies[2 * pair + 1];
    if (src >= num_blocks || dst >= num_blocks) return;
    k_pool[(u64)dst * block_elems + e] = k_pool[(u64)src * block_elems + e];
    v_pool[(u64)dst * block_elems + e] = v_pool[(u64)src * block_elems + e];
}

// Paged decode: one query token per sequence against its paged K/V. The
// algorithm of shaders/attention_lanes.wgsl (the GPU-shaped variant), so an
// NVIDIA profile of one tells us about the other:
//
// A block of NT = 64 threads serves one (sequence, kv head, head tile of HT
// query heads). LPT consecutive lanes share one token: lane c reads float4
// c, c + LPT, ... of its K and V rows (coalesced 16-byte loads), so NSLOT =
// 64 / LPT tokens are in flight per block. Each lane keeps its JN float4
// columns of the HT query rows and accumulators and, per slot, the running
// max (log2 units: exp2 throughout) and sum: the partial dot products are
// summed by __shfl_xor_sync across the slot's LPT lanes, and the token
// loop has no barrier. The NSLOT slots are merged once at the end by
// log-sum-exp through shared memory. Head tiles: blockIdx.y = kv head x
// HTILES + tile; rows past GROUP in the last tile are computed on zeros
// and never written.
//
// Extra macros (src/cuda/mod.rs computes them as the WGSL host does):
//   LPT  lanes per token (power of two <= 8 dividing HEAD_DIM / 4)
//   HT   query heads per block (head tile)
//
// Same masking as attention.wgsl: tokens whose table entry is past the CSR
// range or names a block outside the pool are skipped, never read; a
// sequence with no readable token writes zeros.

#define NT 64
#define HD4 (HEAD_DIM / 4)
#define JN (HD4 / LPT)
#define NSLOT (NT / LPT)
#define HTILES ((GROUP + HT - 1) / HT)
// Finite, as NEG_INF in common.wgsl: exp2(m_old - m_new) never sees inf - inf.
#define NEG_BIG (-3.40282347e+38f)
#define FULL_MASK 0xffffffffu
#define LOG2E_F 1.4426950408889634f

__device__ __forceinline__ float4 load4(const kv_t* __restrict__ p, u64 i4) {
#if KV_F16
    const uint2 w = reinterpret_cast<const uint2*>(p)[i4];
    return make_float4(kv_load((unsigned short)(w.x & 0xffffu)), kv_load((unsigned short)(w.x >> 16)),
                       kv_load((unsigned short)(w.y & 0xffffu)), kv_load((unsigned short)(w.y >> 16)));
#else
    return reinterpret_cast<const float4*>(p)[i4];
#endif
}

__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

extern "C" __global__ void __launch_bounds__(NT) decode(
    const float* __restrict__ q,          // [num_seqs][num_heads][HEAD_DIM]
    const kv_t* __restrict__ k_pool,
    const kv_t* __restrict__ v_pool,
    const u32* __restrict__ kv_indptr,    // [num_seqs + 1]
    const u32* __restrict__ kv_indices,   // [indices_len]
    const u32* __restrict__ seq_lens,     // [num_seqs]
    const float* __restrict__ slopes,     // [num_heads], read when alibi != 0
    float* __restrict__ out,              // [num_seqs][num_heads][HEAD_DIM]
    float* __restrict__ part_out,         // split: [num_seqs][num_heads][num_partitions][HEAD_DIM]
    float2* __restrict__ part_ml,         // split: (max in log2 units, sum) per partial
    u32 num_heads, u32 num_kv_heads, u32 num_blocks, u32 indices_len,
    float scale, float soft_cap, u32 sliding_window, u32 alibi,
    u32 partition_tokens, u32 num_partitions)
{
    // End of pass: one head's accumulators and (max, sum) of every slot.
    __shared__ float4 mrg[NSLOT][HD4];
    __shared__ float2 mrg_ml[NSLOT];

    const u32 seq = blockIdx.x;
    const u32 kvh = blockIdx.y / HTILES;
    const u32 hg0 = (blockIdx.y % HTILES) * HT;
    const u32 h0 = kvh * GROUP + hg0;
    const u32 tid = threadIdx.x;
    const u32 c = tid % LPT;
    const u32 slot = tid / LPT;

    const u32 ind_end = min_u32(kv_indptr[seq + 1], indices_len);
    const u32 ind_start = min_u32(kv_indptr[seq], ind_end);
    const u32 held = ind_end - ind_start;
    u32 len = seq_lens[seq];
    if (held <= 0xFFFFFFFFu / BLOCK_SIZE) len = min_u32(len, held * BLOCK_SIZE);
    const u32 q_pos = len > 0 ? len - 1 : 0;
    u32 t_begin = 0;
    if (sliding_window != 0 && len > sliding_window) t_begin = len - sliding_window;
    // Split-K: partition blockIdx.z walks its share of [0, len), the
    // window's start kept (reduce merges the partials by log-sum-exp).
    u32 t_end = len;
    const u32 part = blockIdx.z;
    if (partition_tokens != 0) {
        const u64 pb = (u64)part * partition_tokens;
        const u32 b = pb < len ? (u32)pb : len;
        t_end = (u64)b + partition_tokens < len ? b + partition_tokens : len;
        t_begin = t_begin > b ? t_begin : b;
        if (t_begin > t_end) t_begin = t_end;
    }

    float4 qv[HT][JN];
    float4 acc[HT][JN];
    float m[HT], l[HT], slope[HT];
#pragma unroll
    for (u32 r = 0; r < HT; ++r) {
        const bool live = hg0 + r < GROUP;
#pragma unroll
        for (u32 j = 0; j < JN; ++j) {
            qv[r][j] = live ? reinterpret_cast<const float4*>(q)[((u64)seq * num_heads + h0 + r) * HD4 + c + j * LPT]
                            : make_float4(0.f, 0.f, 0.f, 0.f);
            acc[r][j] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
        m[r] = NEG_BIG;
        l[r] = 0.0f;
        slope[r] = (live && alibi != 0) ? slopes[h0 + r] : 0.0f;
    }

    // Every lane runs the same trip count, so the shuffles see full warps.
    for (u32 base = t_begin; base < t_end; base += NSLOT) {
        const u32 tok = base + slot;
        bool valid = false;
        u64 row = 0;
        if (tok < t_end) {
            const u32 jb = ind_start + tok / BLOCK_SIZE;
            if (jb < ind_end) {
                const u32 blk = kv_indices[jb];
                if (blk < num_blocks) {
                    valid = true;
                    row = (((u64)blk * num_kv_heads + kvh) * BLOCK_SIZE + tok % BLOCK_SIZE) * HD4;
                }
            }
        }
        float s[HT];
#pragma unroll
        for (u32 r = 0; r < HT; ++r) s[r] = 0.0f;
        if (valid) {
#pragma unroll
            for (u32 j = 0; j < JN; ++j) {
                const float4 kx = load4(k_pool, row + c + j * LPT);
#pragma unroll
                for (u32 r = 0; r < HT; ++r) s[r] += dot4(qv[r][j], kx);
            }
        }
#pragma unroll
        for (u32 r = 0; r < HT; ++r)
#pragma unroll
            for (u32 off = 1; off < LPT; off <<= 1)
                s[r] += __shfl_xor_sync(FULL_MASK, s[r], off);
        if (valid) {
            float w[HT], f[HT];
#pragma unroll
            for (u32 r = 0; r < HT; ++r) {
                // The rules of logit() in common.wgsl, in log2 units.
                float x = s[r] * scale;
                if (soft_cap > 0.0f) x = soft_cap * tanhf(x / soft_cap);
                if (alibi != 0) x += slope[r] * ((float)tok - (float)q_pos);
                x *= LOG2E_F;
                const float mn = fmaxf(m[r], x);
                f[r] = exp2f(m[r] - mn);
                w[r] = exp2f(x - mn);
                l[r] = l[r] * f[r] + w[r];
                m[r] = mn;
            }
#pragma unroll
            for (u32 j = 0; j < JN; ++j) {
                const float4 vx = load4(v_pool, row + c + j * LPT);
#pragma unroll
                for (u32 r = 0; r < HT; ++r) {
                    acc[r][j].x = acc[r][j].x * f[r] + w[r] * vx.x;
                    acc[r][j].y = acc[r][j].y * f[r] + w[r] * vx.y;
                    acc[r][j].z = acc[r][j].z * f[r] + w[r] * vx.z;
                    acc[r][j].w = acc[r][j].w * f[r] + w[r] * vx.w;
                }
            }
        }
    }

    // Merge the slots of each head by log-sum-exp; write once.
#pragma unroll
    for (u32 r = 0; r < HT; ++r) {
        __syncthreads();
#pragma unroll
        for (u32 j = 0; j < JN; ++j) mrg[slot][c + j * LPT] = acc[r][j];
        if (c == 0) mrg_ml[slot] = make_float2(m[r], l[r]);
        __syncthreads();
        if (hg0 + r < GROUP) {
            for (u32 col = tid; col < HD4; col += NT) {
                float mx = NEG_BIG;
                for (u32 i = 0; i < NSLOT; ++i) mx = fmaxf(mx, mrg_ml[i].x);
                float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
                float lt = 0.0f;
                for (u32 i = 0; i < NSLOT; ++i) {
                    const float2 ml = mrg_ml[i];
                    if (ml.y > 0.0f) {
                        const float wt = exp2f(ml.x - mx);
                        lt += ml.y * wt;
                        const float4 x = mrg[i][col];
                        a.x += x.x * wt; a.y += x.y * wt; a.z += x.z * wt; a.w += x.w * wt;
                    }
                }
                if (partition_tokens == 0) {
                    const float inv = lt == 0.0f ? 0.0f : 1.0f / lt;
                    reinterpret_cast<float4*>(out)[((u64)seq * num_heads + h0 + r) * HD4 + col] =
                        make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv);
                } else {
                    const u64 o = ((u64)seq * num_heads + h0 + r) * num_partitions + part;
                    reinterpret_cast<float4*>(part_out)[o * HD4 + col] = a;
                    if (col == 0) part_ml[o] = make_float2(mx, lt);
                }
            }
        }
    }
}

// Split-K merge: one block per (sequence, query head) row, its partials
// combined by log-sum-exp (log2 units, as decode wrote them); a row with no
// readable token writes zeros.
extern "C" __global__ void __launch_bounds__(NT) merge(
    const float* __restrict__ part_out,
    const float2* __restrict__ part_ml,
    float* __restrict__ out,
    u32 rows, u32 num_partitions)
{
    const u32 row = blockIdx.x;
    if (row >= rows) return;
    float mx = NEG_BIG;
    for (u32 p = 0; p < num_partitions; ++p) mx = fmaxf(mx, part_ml[(u64)row * num_partitions + p].x);
    for (u32 col = threadIdx.x; col < HD4; col += NT) {
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        float lt = 0.0f;
        for (u32 p = 0; p < num_partitions; ++p) {
            const u64 o = (u64)row * num_partitions + p;
            const float2 ml = part_ml[o];
            if (ml.y > 0.0f) {
                const float wt = exp2f(ml.x - mx);
                lt += ml.y * wt;
                const float4 x = reinterpret_cast<const float4*>(part_out)[o * HD4 + col];
                a.x += x.x * wt; a.y += x.y * wt; a.z += x.z * wt; a.w += x.w * wt;
            }
        }
        const float inv = lt == 0.0f ? 0.0f : 1.0f / lt;
        reinterpret_cast<float4*>(out)[(u64)row * HD4 + col] =
            make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv);
    }
}
