// Paged decode: one query token per sequence against its paged K/V.
//
// One workgroup per (sequence, kv head, partition). The workgroup serves all
// GROUP query heads that share the kv head, so each K and V row is read once
// per group (GQA/MQA). Tokens go in tiles of TILE: one thread scores one
// token for every head of the group, then the running max / sum / rescaled
// accumulator of each head are updated (online softmax) and the V product is
// fused in: the thread grid is ROWS x HEAD_DIM4, each thread owning one vec4
// column of V for every head, over every ROWS-th token of the tile.
//
// With partition_tokens == 0 the workgroup covers the whole sequence and
// writes the normalised output. Otherwise it covers one partition and writes
// its partial (max, sum) and unnormalised accumulator; reduce.wgsl merges them.
//
// Table entries outside the pool (or a CSR range past the indices) are
// skipped: those tokens are masked, never read. A sequence with no readable
// token writes zeros.

const WG: u32 = 64u;
const TILE: u32 = WG;
const ROWS: u32 = WG / HEAD_DIM4;

@group(0) @binding(0) var<uniform> params: AttnParams;
// [num_seqs][num_heads][HEAD_DIM4]
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
// [num_blocks][num_kv_heads][BLOCK_SIZE][HEAD_DIM4]
@group(0) @binding(2) var<storage, read> k_pool: array<KV4>;
@group(0) @binding(3) var<storage, read> v_pool: array<KV4>;
// Packed: kv_indptr[num_seqs + 1] | seq_lens | kv_indices | alibi slopes.
@group(0) @binding(4) var<storage, read> table: array<u32>;
// Whole: [num_seqs][num_heads][HEAD_DIM4]. Split: [num_seqs][num_heads][num_partitions][HEAD_DIM4].
@group(0) @binding(5) var<storage, read_write> out: array<vec4<f32>>;
// Split only: (max, sum) per [num_seqs][num_heads][num_partitions].
@group(0) @binding(6) var<storage, read_write> out_ml: array<vec2<f32>>;

var<workgroup> q_sh: array<vec4<f32>, GROUP * HEAD_DIM4>;
// Scores of the tile, then their probabilities.
var<workgroup> sc: array<f32, GROUP * TILE>;
// Pool offset of each token's row in the tile, INVALID when masked.
var<workgroup> row_of: array<u32, TILE>;
var<workgroup> m_run: array<f32, GROUP>;
var<workgroup> l_run: array<f32, GROUP>;
var<workgroup> alpha: array<f32, GROUP>;
var<workgroup> red: array<vec4<f32>, WG>;

fn table_at(i: u32) -> u32 {
    if i < arrayLength(&table) {
        return table[i];
    }
    return INVALID;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let seq = wg.x;
    let kvh = wg.y;
    let part = wg.z;
    let p = params;
    let h0 = kvh * GROUP;

    let len = table_at(p.lens_off + seq);
    let ind_end = min(table_at(seq + 1u), p.indices_len);
    let ind_start = min(table_at(seq), ind_end);
    let q_pos = len - 1u;

    var t_begin = 0u;
    var t_end = len;
    if p.partition_tokens != 0u {
        t_begin = min(part * p.partition_tokens, len);
        t_end = min(t_begin + p.partition_tokens, len);
    }
    if p.sliding_window != 0u && len > p.sliding_window {
        t_begin = max(t_begin, len - p.sliding_window);
        t_end = max(t_end, t_begin);
    }

    for (var i = lid; i < GROUP * HEAD_DIM4; i += WG) {
        q_sh[i] = q[(seq * p.num_heads + h0) * HEAD_DIM4 + i];
    }
    for (var h = lid; h < GROUP; h += WG) {
        m_run[h] = NEG_INF;
        l_run[h] = 0.0;
    }
    var acc: array<vec4<f32>, GROUP>;
    let r = lid / HEAD_DIM4;
    let c = lid % HEAD_DIM4;
    workgroupBarrier();

    for (var tile = t_begin; tile < t_end; tile += TILE) {
        // Score: thread lid takes token tile + lid, for every head of the group.
        let tok = tile + lid;
        var row = INVALID;
        if tok < t_end {
            let j = ind_start + tok / BLOCK_SIZE;
            if j < ind_end {
                let blk = table_at(p.indices_off + j);
                if blk < p.num_blocks {
                    row = ((blk * p.num_kv_heads + kvh) * BLOCK_SIZE + tok % BLOCK_SIZE) * HEAD_DIM4;
                }
            }
        }
        row_of[lid] = row;
        var s: array<f32, GROUP>;
        if row != INVALID {
            for (var d = 0u; d < HEAD_DIM4; d++) {
                let k = kv_load(k_pool[row + d]);
                for (var h = 0u; h < GROUP; h++) {
                    s[h] += dot(q_sh[h * HEAD_DIM4 + d], k);
                }
            }
        }
        for (var h = 0u; h < GROUP; h++) {
            var v = NEG_INF;
            if row != INVALID {
                let slope = bitcast<f32>(table_at(p.slopes_off + h0 + h));
                v = logit(p, s[h], slope, q_pos, tok);
            }
            sc[h * TILE + lid] = v;
        }
        workgroupBarrier();

        // Running max per head and the factor that rescales what came before.
        for (var h = lid; h < GROUP; h += WG) {
            var mt = NEG_INF;
            for (var t = 0u; t < TILE; t++) {
                mt = max(mt, sc[h * TILE + t]);
            }
            let m_new = max(m_run[h], mt);
            alpha[h] = exp(m_run[h] - m_new);
            m_run[h] = m_new;
        }
        workgroupBarrier();

        for (var h = 0u; h < GROUP; h++) {
            let v = sc[h * TILE + lid];
            sc[h * TILE + lid] = select(exp(v - m_run[h]), 0.0, v == NEG_INF);
        }
        workgroupBarrier();

        for (var h = lid; h < GROUP; h += WG) {
            var sum = 0.0;
            for (var t = 0u; t < TILE; t++) {
                sum += sc[h * TILE + t];
            }
            l_run[h] = l_run[h] * alpha[h] + sum;
        }
        // V: thread (r, c) adds column c of every ROWS-th token, for all heads.
        if r < ROWS {
            for (var h = 0u; h < GROUP; h++) {
                acc[h] *= alpha[h];
            }
            for (var t = r; t < TILE; t += ROWS) {
                let vrow = row_of[t];
                if vrow != INVALID {
                    let v = kv_load(v_pool[vrow + c]);
                    for (var h = 0u; h < GROUP; h++) {
                        acc[h] += sc[h * TILE + t] * v;
                    }
                }
            }
        }
        workgroupBarrier();
    }

    // Sum the ROWS partial accumulators of each head and write it once.
    for (var h = 0u; h < GROUP; h++) {
        if r < ROWS {
            red[lid] = acc[h];
        }
        workgroupBarrier();
        if lid < HEAD_DIM4 {
            var a = red[lid];
            for (var rr = 1u; rr < ROWS; rr++) {
                a += red[rr * HEAD_DIM4 + lid];
            }
            let hq = h0 + h;
            if p.partition_tokens == 0u {
                let l = l_run[h];
                out[(seq * p.num_heads + hq) * HEAD_DIM4 + lid] = select(a / l, vec4<f32>(0.0), l == 0.0);
            } else {
                let o = (seq * p.num_heads + hq) * p.num_partitions + part;
                out[o * HEAD_DIM4 + lid] = a;
                if lid == 0u {
                    out_ml[o] = vec2<f32>(m_run[h], l_run[h]);
                }
            }
        }
        workgroupBarrier();
    }
}
