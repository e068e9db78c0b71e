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

// Paged decode: one query token per sequence against its paged K/V.
//
// One thread block per (sequence, kv head) serves all GROUP query heads of
// that kv head, so each K and V row is read once per group (GQA/MQA).
// Tokens go in tiles of TILE. Scores: one warp per token, lanes across
// head_dim (coalesced K reads), the GROUP dot products reduced by shuffles.
// Then the running max, the rescale factor and the running sum of each head
// (online softmax), and the V product: thread (r, c) owns column c (and
// c + HD_T, ... when HEAD_DIM > NT) of every head's accumulator over every
// ROWS-th token of the tile. The ROWS partial accumulators are summed once
// at the end and the output written once.
//
// Same masking as attention.wgsl: tokens whose table entry is past the CSR
// range or names a block outside the pool are skipped, never read; a
// sequence with no readable token writes zeros.

#define NT 128
#define NWARPS (NT / 32)
#define TILE 64
#define HD_T (HEAD_DIM < NT ? HEAD_DIM : NT)
#define ROWS (NT / HD_T)
#define COLS ((HEAD_DIM + HD_T - 1) / HD_T)
// Finite, as NEG_INF in common.wgsl: exp(m_old - m_new) never sees inf - inf.
#define NEG_BIG (-3.40282347e+38f)
#define NO_ROW 0xffffffffffffffffull
#define FULL_MASK 0xffffffffu

extern "C" __global__ void __launch_bounds__(NT) decode(
    const float* __restrict__ q,          // [num_seqs][num_heads][HEAD_DIM]
    const kv_t* __restrict__ k_pool,
    const kv_t* __restrict__ v_pool,
    const u32* __restrict__ kv_indptr,    // [num_seqs + 1]
    const u32* __restrict__ kv_indices,   // [indices_len]
    const u32* __restrict__ seq_lens,     // [num_seqs]
    const float* __restrict__ slopes,     // [num_heads], read when alibi != 0
    float* __restrict__ out,              // [num_seqs][num_heads][HEAD_DIM]
    u32 num_heads, u32 num_kv_heads, u32 num_blocks, u32 indices_len,
    float scale, float soft_cap, u32 sliding_window, u32 alibi)
{
    __shared__ float q_sh[GROUP][HEAD_DIM];
    // Scores of the tile, then their probabilities.
    __shared__ float sc[GROUP][TILE];
    // Pool offset of each tile token's row, NO_ROW when masked.
    __shared__ u64 row_of[TILE];
    __shared__ float m_run[GROUP];
    __shared__ float l_run[GROUP];
    __shared__ float alpha[GROUP];
    __shared__ float red[ROWS][HEAD_DIM];

    const u32 seq = blockIdx.x;
    const u32 kvh = blockIdx.y;
    const u32 tid = threadIdx.x;
    const u32 lane = tid % 32;
    const u32 warp = tid / 32;
    const u32 h0 = kvh * GROUP;

    const u32 ind_end = min_u32(kv_indptr[seq + 1], indices_len);
    const u32 ind_start = min_u32(kv_indptr[seq], ind_end);
    // As attention.wgsl: a length past what the table holds is cut to it.
    const u32 held = ind_end - ind_start;
    u32 len = seq_lens[seq];
    if (held <= 0xFFFFFFFFu / BLOCK_SIZE) len = min_u32(len, held * BLOCK_SIZE);
    // Only used when len > 0.
    const u32 q_pos = len - 1;
    u32 t_begin = 0;
    if (sliding_window != 0 && len > sliding_window) t_begin = len - sliding_window;

    for (u32 i = tid; i < GROUP * HEAD_DIM; i += NT)
        q_sh[i / HEAD_DIM][i % HEAD_DIM] = q[((u64)seq * num_heads + h0) * HEAD_DIM + i];
    for (u32 h = tid; h < GROUP; h += NT) {
        m_run[h] = NEG_BIG;
        l_run[h] = 0.0f;
    }
    const u32 r = tid / HD_T;
    const u32 c = tid % HD_T;
    float acc[GROUP][COLS];
#pragma unroll
    for (u32 h = 0; h < GROUP; ++h)
#pragma unroll
        for (u32 k = 0; k < COLS; ++k) acc[h][k] = 0.0f;
    __syncthreads();

    for (u32 tile = t_begin; tile < len; tile += TILE) {
        if (tid < TILE) {
            const u32 tok = tile + tid;
            u64 row = NO_ROW;
            if (tok < len) {
                const u32 j = ind_start + tok / BLOCK_SIZE;
                if (j < ind_end) {
                    const u32 blk = kv_indices[j];
                    if (blk < num_blocks)
                        row = (((u64)blk * num_kv_heads + kvh) * BLOCK_SIZE + tok % BLOCK_SIZE)
                              * HEAD_DIM;
                }
            }
            row_of[tid] = row;
        }
        __syncthreads();

        // Scores. `row` is the same for the whole warp, so every lane takes
        // part in the shuffles.
        for (u32 t = warp; t < TILE; t += NWARPS) {
            const u64 row = row_of[t];
            float s[GROUP];
#pragma unroll
            for (u32 h = 0; h < GROUP; ++h) s[h] = 0.0f;
            if (row != NO_ROW) {
                for (u32 d = lane; d < HEAD_DIM; d += 32) {
                    const float kd = kv_load(k_pool[row + d]);
#pragma unroll
                    for (u32 h = 0; h < GROUP; ++h) s[h] += q_sh[h][d] * kd;
                }
            }
#pragma unroll
            for (u32 h = 0; h < GROUP; ++h)
#pragma unroll
                for (u32 off = 16; off > 0; off >>= 1)
                    s[h] += __shfl_xor_sync(FULL_MASK, s[h], off);
            if (lane == 0) {
#pragma unroll
                for (u32 h = 0; h < GROUP; ++h) {
                    float v = NEG_BIG;
                    if (row != NO_ROW) {
                        // The rules of logit() in common.wgsl.
                        v = s[h] * scale;
                        if (soft_cap > 0.0f) v = soft_cap * tanhf(v / soft_cap);
                        if (alibi != 0)
                            v += slopes[h0 + h] * ((float)(tile + t) - (float)q_pos);
                    }
                    sc[h][t] = v;
                }
            }
        }
        __syncthreads();

        // Running max per head and the factor that rescales what came before.
        for (u32 h = warp; h < GROUP; h += NWARPS) {
            float mt = NEG_BIG;
            for (u32 t = lane; t < TILE; t += 32) mt = fmaxf(mt, sc[h][t]);
#pragma unroll
            for (u32 off = 16; off > 0; off >>= 1)
                mt = fmaxf(mt, __shfl_xor_sync(FULL_MASK, mt, off));
            if (lane == 0) {
                const float m_new = fmaxf(m_run[h], mt);
                alpha[h] = expf(m_run[h] - m_new);
                m_run[h] = m_new;
            }
        }
        __syncthreads();

        for (u32 i = tid; i < GROUP * TILE; i += NT) {
            const u32 h = i / TILE;
            const u32 t = i % TILE;
            const float v = sc[h][t];
            sc[h][t] = v == NEG_BIG ? 0.0f : expf(v - m_run[h]);
        }
        __syncthreads();

        for (u32 h = warp; h < GROUP; h += NWARPS) {
            float sum = 0.0f;
            for (u32 t = lane; t < TILE; t += 32) sum += sc[h][t];
#pragma unroll
            for (u32 off = 16; off > 0; off >>= 1)
                sum += __shfl_xor_sync(FULL_MASK, sum, off);
            if (lane == 0) l_run[h] = l_run[h] * alpha[h] + sum;
        }
        // V: reads sc, alpha and row_of, which nothing writes until the
        // barrier below.
        if (r < ROWS) {
#pragma unroll
            for (u32 h = 0; h < GROUP; ++h)
#pragma unroll
                for (u32 k = 0; k < COLS; ++k) acc[h][k] *= alpha[h];
            for (u32 t = r; t < TILE; t += ROWS) {
                const u64 row = row_of[t];
                if (row == NO_ROW) continue;
#pragma unroll
                for (u32 k = 0; k < COLS; ++k) {
                    const u32 col = c + k * HD_T;
                    if (col < HEAD_DIM) {
                        const float vd = kv_load(v_pool[row + col]);
#pragma unroll
                        for (u32 h = 0; h < GROUP; ++h) acc[h][k] += sc[h][t] * vd;
                    }
                }
            }
        }
        __syncthreads();
    }

    // Sum the ROWS partial accumulators of each head and write it once.
    // Unrolled so acc stays in registers (constant indices).
#pragma unroll
    for (u32 h = 0; h < GROUP; ++h) {
        if (r < ROWS) {
#pragma unroll
            for (u32 k = 0; k < COLS; ++k) {
                const u32 col = c + k * HD_T;
                if (col < HEAD_DIM) red[r][col] = acc[h][k];
            }
        }
        __syncthreads();
        const float l = l_run[h];
        for (u32 col = tid; col < HEAD_DIM; col += NT) {
            float a = 0.0f;
#pragma unroll
            for (u32 rr = 0; rr < ROWS; ++rr) a += red[rr][col];
            out[((u64)seq * num_heads + h0 + h) * HEAD_DIM + col] = l == 0.0f ? 0.0f : a / l;
        }
        __syncthreads();
    }
}
