//#import constants     HEAD_DIM4 GROUP BLOCK_SIZE QTILE PAGED HT HTILES LPT JN SUBGROUPS (generated from the shape: src/gpu/compose.rs)
//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
//#import kv            KV4 kv_load kv_store (shared/kv_<pool dtype>.wgsl)
//#import qdot          QV4 q_conv k_dot (shared/qdot.wgsl)
//#import act           ACT4 act_load act_store (shared/act_<activation dtype>.wgsl)
//#import out           OUT4 out_load out_store (shared/out_<activation dtype>.wgsl)
//#import common        WriteKvParams CopyParams AttnParams NEG_INF INVALID K_OUTLIERS logit ... (common.wgsl)
//#import table_walk    the block-table walk (shared/table_walk.wgsl)
//#import pool_words    a quantized pool's u32 words (shared/pool_words[_wide].wgsl; nothing for plain pools)
//#import scales        per-token K/V scales, K outlier residuals (shared/scales_<pool dtype>.wgsl, q_res.wgsl)
// Paged attention: decode (one query per sequence) and chunked prefill (a
// causal chunk of queries per sequence), one code path.
//
// A workgroup serves QTILE consecutive queries of one sequence for the HT
// query heads of one head tile of a kv head's GQA group: NROW = QTILE * HT
// rows, so each K and V row is read once per head tile and query tile
// (GQA/MQA; a group of up to 16 rows is one tile, larger ones are tiled). Tokens go in
// tiles of TILE: one thread scores one token for every row, then each row's
// running max, sum and rescaled accumulator are updated (online softmax) and
// the V product is fused in: the thread grid is VROWS x HEAD_DIM4, each
// thread owning one vec4 column of V for every row, over every VROWS-th token.
//
// Decode (qo_off == 0): workgroup x is the sequence, its one query sits at
// position seq_len - 1. With partition_tokens != 0 a workgroup covers one
// partition (z) of the tokens and writes its partial (max, sum) and
// unnormalised accumulator; reduce.wgsl merges them by log-sum-exp.
// Prefill (qo_off != 0): workgroup x is an entry of the tile list (sequence,
// first query); the sequence's queries are the newest qo_len positions.
// Prefill splits the same way (split-KV): partials per (query row, head).
// Workgroup y is (kv head, head tile).
//
// Table entries outside the pool (or a CSR range past the indices) are
// skipped: those tokens are masked, never read. A row with no readable token
// writes zeros.

const WG: u32 = 64u;
// Tokens per tile: each thread scores TPT tokens.
const TPT: u32 = 1u;
const TILE: u32 = WG * TPT;
const VROWS: u32 = WG / HEAD_DIM4;
const NROW: u32 = QTILE * HT;
// The row max of a tile is found by SEGS threads per row, each over TILE / SEGS scores.
const SEGS: u32 = max(WG / NROW, 1u);

@group(0) @binding(0) var<uniform> params: AttnParams;
// [num_queries][num_heads][HEAD_DIM4], rows q_stride vec4s apart when set
@group(0) @binding(1) var<storage, read> q: array<ACT4>;
// [num_blocks][num_kv_heads][BLOCK_SIZE][HEAD_DIM4]
@group(0) @binding(2) var<storage, read> k_pool: array<KV4>;
@group(0) @binding(3) var<storage, read> v_pool: array<KV4>;
// Packed: kv_indptr[num_seqs + 1] | seq_lens | kv_indices | alibi slopes |
// qo_indptr[num_seqs + 1] | tile list (sequence, first query) pairs.
@group(0) @binding(4) var<storage, read> table: array<u32>;
// Whole: [num_queries][num_heads][HEAD_DIM4]. Split: [num_seqs][num_heads][num_partitions][HEAD_DIM4].
@group(0) @binding(5) var<storage, read_write> out: array<OUT4>;
// Split only: (max, sum) per [num_seqs][num_heads][num_partitions].
@group(0) @binding(6) var<storage, read_write> out_ml: array<vec2<f32>>;

var<workgroup> q_sh: array<vec4<f32>, NROW * HEAD_DIM4>;
// Quantized pools: each row at its KV head's K outlier channels (q_res).
var<workgroup> qf_sh: array<vec4<f32>, NROW>;
// Scores of a tile, then their probabilities, [NROW][TILE]; double-buffered
// by tile parity so the next tile's scores never wait for this tile's V pass.
var<workgroup> sc: array<array<f32, NROW * TILE>, 2>;
// Pool offset of each token's row in the tile, INVALID when unreadable.
var<workgroup> row_of: array<array<u32, TILE>, 2>;
// Per-(row, segment) maxima of the current tile.
var<workgroup> seg_max: array<f32, NROW * SEGS>;
// Running max per row, and the factor of the current tile's rescale.
var<workgroup> m_sh: array<f32, NROW>;
var<workgroup> alpha_sh: array<f32, NROW>;
// End of pass: partial accumulators (VROWS per row) and partial sums.
var<workgroup> red: array<vec4<f32>, WG>;
var<workgroup> red_l: array<f32, WG>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let p = params;
    let kvh = wg.y / HTILES;
    let hg0 = (wg.y % HTILES) * HT;
    let h0 = kvh * GROUP + hg0;
    let part = wg.z;

    // Which sequence and queries this workgroup serves.
    var seq = wg.x;
    var q_first = 0u;
    var q_count = 1u;
    var q_row0 = seq;
    if p.qo_off != 0u {
        let tiles_off = p.qo_off + p.num_seqs + 1u;
        seq = table_at(tiles_off + 2u * wg.x);
        q_first = table_at(tiles_off + 2u * wg.x + 1u);
        let qo_start = table_at(p.qo_off + seq);
        let qo_end = max(table_at(p.qo_off + seq + 1u), qo_start);
        q_count = min(qo_end - qo_start - min(q_first, qo_end - qo_start), QTILE);
        q_row0 = qo_start + q_first;
    }
    let span = seq_span(p, seq);
    let len = span.len;
    let qo_len = select(1u, table_at(p.qo_off + seq + 1u) - table_at(p.qo_off + seq), p.qo_off != 0u);
    // Position of the first query; causal: it sees tokens [0, pos0 + i].
    let pos0 = len - min(qo_len, len) + q_first;

    // Cascade pass (qmap_off != 0): the "sequence" is a segment of blocks
    // shared by several sequences, and its queries are rows of other
    // sequences: (query row, position relative to the segment's first
    // token) pairs at qmap_off, each after the whole segment. It writes
    // partials at the segment's slot (slot_off).
    let qmap = p.qmap_off != 0u;
    var qrow = array<u32, QTILE>();
    var qpos = array<u32, QTILE>();
    for (var qi = 0u; qi < QTILE; qi++) {
        if qmap {
            qrow[qi] = table_at(p.qmap_off + 2u * (q_row0 + qi));
            qpos[qi] = table_at(p.qmap_off + 2u * (q_row0 + qi) + 1u);
        } else {
            qrow[qi] = q_row0 + qi;
            qpos[qi] = pos0 + qi;
        }
    }

    var t_begin = 0u;
    var t_end = select(min(pos0 + q_count, len), len, qmap);
    let windowed = !qmap && p.sliding_window != 0u && pos0 + 1u > p.sliding_window;
    var keys = Keys(0u, 0u, 0u, 0u);
    if windowed && p.sink_tokens != 0u {
        // The first query's window (the widest of the tile) and the sink
        // tokens, as one run; each row's own window is masked below.
        keys = sink_keys(p, pos0 + 1u - p.sliding_window, t_end, part);
    } else {
        if p.partition_tokens != 0u {
            t_begin = min(part * p.partition_tokens, t_end);
            t_end = min(t_begin + p.partition_tokens, t_end);
        }
        if windowed {
            t_begin = max(t_begin, pos0 + 1u - p.sliding_window);
            t_end = max(t_end, t_begin);
        }
        keys = Keys(t_begin, t_end, 0u, 0u);
    }
    t_begin = keys.begin;
    t_end = keys.end;

    for (var i = lid; i < NROW * HEAD_DIM4; i += WG) {
        let qi = i / (HT * HEAD_DIM4);
        let within = i % (HT * HEAD_DIM4);
        var v = vec4<f32>(0.0);
        if qi < q_count && hg0 + within / HEAD_DIM4 < GROUP {
            let q_stride = select(p.num_heads * HEAD_DIM4, p.q_stride, p.q_stride != 0u);
            v = act_load(q[qrow[qi] * q_stride + h0 * HEAD_DIM4 + within]) * q_smooth(kvh, within % HEAD_DIM4);
        }
        q_sh[i] = v;
    }
    for (var r = lid; r < NROW; r += WG) {
        let qi = r / HT;
        var f = vec4<f32>(0.0);
        if K_RES && qi < q_count && hg0 + r % HT < GROUP {
            let q_stride = select(p.num_heads * HEAD_DIM4, p.q_stride, p.q_stride != 0u);
            f = q_res(qrow[qi] * q_stride + (h0 + r % HT) * HEAD_DIM4, kvh);
        }
        qf_sh[r] = f;
    }
    // Each thread keeps its share of the V accumulator and of the running
    // sum; the running max lives in workgroup memory. Explicit zeros: some
    // WGSL compilers have been seen not to zero a bare `var` array.
    var l_run = array<f32, NROW>();
    var acc = array<vec4<f32>, NROW>();
    for (var r = lid; r < NROW; r += WG) {
        m_sh[r] = NEG_INF;
    }
    let vr = lid / HEAD_DIM4;
    let c = lid % HEAD_DIM4;
    workgroupBarrier();

    var buf = 0u;
    for (var tile = t_begin; tile < t_end; tile += TILE) {
        // 1. Score: thread lid takes tokens tile + lid + k * WG, every row.
        for (var k = 0u; k < TPT; k++) {
            let t = lid + k * WG;
            let tok = key_at(keys, tile + t);
            var row = INVALID;
            if tile + t < t_end {
                row = token_row(p, span, kvh, tok);
            }
            row_of[buf][t] = row;
            // Zeroed explicitly: Chrome's WebGPU (seen on SwiftShader) does not re-zero a
            // `var` without initializer each time a loop body runs it, so the
            // scores of one tile leaked into the next (naga/Vulkan did re-zero).
            var s = array<f32, NROW>();
            // The token's K scale (1 unless the pool is quantized).
            var ks = 1.0;
            if row != INVALID {
                ks = k_scale(row, kvh);
                for (var d = 0u; d < HEAD_DIM4; d++) {
                    let kv = kv_load(k_pool[row + d]);
                    for (var r = 0u; r < NROW; r++) {
                        s[r] += dot(q_sh[r * HEAD_DIM4 + d], kv);
                    }
                }
                if K_RES {
                    let kr = k_res(row, kvh);
                    for (var r = 0u; r < NROW; r++) {
                        s[r] += dot(qf_sh[r], kr);
                    }
                }
            }
            for (var r = 0u; r < NROW; r++) {
                let qi = r / HT;
                let q_pos = qpos[qi];
                var v = NEG_INF;
                // q_pos - tok, never tok + window: exact for any u32 window.
                let in_window = p.sliding_window == 0u || q_pos - tok < p.sliding_window || tok < p.sink_tokens;
                if row != INVALID && qi < q_count && tok <= q_pos && in_window {
                    let slope = bitcast<f32>(table_at(p.slopes_off + h0 + r % HT));
                    v = logit(p, s[r] * ks, slope, q_pos, tok);
                }
                sc[buf][r * TILE + t] = v;
            }
        }
        workgroupBarrier();

        // 2. Segment maxima: SEGS threads per row, in parallel.
        for (var i = lid; i < NROW * SEGS; i += WG) {
            let r = i / SEGS;
            let seg = i % SEGS;
            var mt = NEG_INF;
            for (var t = seg; t < TILE; t += SEGS) {
                mt = max(mt, sc[buf][r * TILE + t]);
            }
            seg_max[i] = mt;
        }
        workgroupBarrier();

        // 3. One thread per row folds the segment maxima into the running
        // max and the factor that rescales what came before.
        for (var r = lid; r < NROW; r += WG) {
            var m_new = m_sh[r];
            for (var seg = 0u; seg < SEGS; seg++) {
                m_new = max(m_new, seg_max[r * SEGS + seg]);
            }
            alpha_sh[r] = exp(m_sh[r] - m_new);
            m_sh[r] = m_new;
        }
        workgroupBarrier();

        // 4. Each thread turns its token's scores into weights.
        for (var k = 0u; k < TPT; k++) {
            let t = lid + k * WG;
            for (var r = 0u; r < NROW; r++) {
                let v = sc[buf][r * TILE + t];
                sc[buf][r * TILE + t] = select(exp(v - m_sh[r]), 0.0, v == NEG_INF);
            }
        }
        workgroupBarrier();

        // 5. V: thread (vr, c) adds column c of every VROWS-th token, for all
        // rows; column-0 threads also add the weights themselves (the sum).
        if vr < VROWS {
            for (var r = 0u; r < NROW; r++) {
                acc[r] *= alpha_sh[r];
                l_run[r] *= alpha_sh[r];
            }
            for (var t = vr; t < TILE; t += VROWS) {
                let vrow = row_of[buf][t];
                if vrow != INVALID {
                    let v = kv_load(v_pool[vrow + c]) * v_scale(vrow, kvh);
                    for (var r = 0u; r < NROW; r++) {
                        let w = sc[buf][r * TILE + t];
                        acc[r] += w * v;
                        l_run[r] += w;
                    }
                }
            }
        }
        buf ^= 1u;
    }
    workgroupBarrier();

    // Sum the VROWS partial accumulators and sums of each row; write once.
    for (var r = 0u; r < NROW; r++) {
        if vr < VROWS {
            red[lid] = acc[r];
            red_l[lid] = l_run[r];
        }
        workgroupBarrier();
        let qi = r / HT;
        if lid < HEAD_DIM4 && qi < q_count && hg0 + r % HT < GROUP {
            var a = red[lid];
            var l = red_l[0];
            for (var k = 1u; k < VROWS; k++) {
                a += red[k * HEAD_DIM4 + lid];
                l += red_l[k * HEAD_DIM4];
            }
            let hq = h0 + r % HT;
            if p.partition_tokens == 0u && !qmap {
                out[(qrow[qi] * p.num_heads + hq) * HEAD_DIM4 + lid] = out_store(select(a / l, vec4<f32>(0.0), l == 0.0));
            } else {
                let slot = select(part, table_at(p.slot_off + seq), qmap);
                let o = (qrow[qi] * p.num_heads + hq) * p.num_partitions + slot;
                out[o * HEAD_DIM4 + lid] = out_store(a);
                if lid == 0u {
                    out_ml[o] = vec2<f32>(m_sh[r], l);
                }
            }
        }
        workgroupBarrier();
    }
}
