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
//#import generated     ROWS TG WGS lane_sum (src/gpu/kernels/rows.rs)
// Cascade segment pass for GPUs: one shared segment's K/V read once for
// many query rows, with the lanes laid over the rows rather than over the
// tokens.
//
// The rows of a workgroup are ROWS = QTILE x HT (query, head) pairs: QTILE
// queries of the sequences that share the segment (a tile of its query
// list) times a head tile of the KV head's GQA group. LPR consecutive lanes
// hold one row: lane c keeps the row's vec4 columns c, c + LPR, ... (JN of
// them) of the query and of its accumulator, in registers. Every row walks
// the same tokens, so one load instruction of a warp or wave reads LPR
// consecutive vec4 of a K (or V) row, the same for all its rows: K/V are
// read once per workgroup whatever the number of rows, and each lane does
// JN multiply-adds per load. A token's partial dots are summed over the
// row's LPR lanes by subgroup shuffles (SUBGROUPS), else through workgroup
// memory (one barrier pair per token).
//
// TG token groups of ROWS x LPR lanes split the segment's tokens (group g
// takes every TG-th token from g), each with its own online softmax, merged
// once at the end by log-sum-exp through workgroup memory. Scores are in
// log2 units (exp2).
//
// The segment's tables are a prefill's (qo_off: per segment its queries,
// then the tile list of (segment, first query) pairs); qmap_off holds each
// query's (row, position relative to the segment's first token), every
// query after the whole segment; slot_off each segment's partial slot. It
// writes, per row, the unnormalised accumulator and (max in natural-log
// units, sum) at that slot, for reduce.wgsl. Each row masks the tokens
// outside its own query's sliding window. Table entries outside the pool
// are skipped; a row with no readable token writes sum 0.
//
// Generated (src/gpu/kernels/rows.rs, consts): ROWS, TG, WGS = ROWS x LPR x
// TG, and lane_sum (the subgroup sum of a row's lanes).

const LOG2E: f32 = 1.4426950408889634;
const LN2: f32 = 0.6931471805599453;
const LPR: u32 = LPT;
// Workgroup memory of the lane sums without subgroups (1 when unused).
const RED_LEN: u32 = select(WGS, 1u, SUBGROUPS);

@group(0) @binding(0) var<uniform> params: AttnParams;
@group(0) @binding(1) var<storage, read> q: array<ACT4>;
@group(0) @binding(2) var<storage, read> k_pool: array<KV4>;
@group(0) @binding(3) var<storage, read> v_pool: array<KV4>;
@group(0) @binding(4) var<storage, read> table: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<OUT4>;
@group(0) @binding(6) var<storage, read_write> out_ml: array<vec2<f32>>;

// This lane's columns of its row's query and accumulator.
var<private> qv: array<vec4<f32>, JN>;
var<private> acc: array<vec4<f32>, JN>;

var<workgroup> red: array<f32, RED_LEN>;
// End of pass: one token group's accumulators and (max, sum), per lane.
var<workgroup> mrg: array<vec4<f32>, ROWS * LPR * JN>;
var<workgroup> mrg_ml: array<vec2<f32>, ROWS * LPR>;

@compute @workgroup_size(WGS)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let p = params;
    let kvh = wg.y / HTILES;
    let hg0 = (wg.y % HTILES) * HT;
    let h0 = kvh * GROUP + hg0;
    // Lane c of row r of token group g; rl is the lane within the group.
    let c = lid % LPR;
    let rl = lid % (ROWS * LPR);
    let r = rl / LPR;
    let g = lid / (ROWS * LPR);
    let qi = r / HT;
    let h = r % HT;

    // The tile: segment `seg`, its queries from `first`. The plan packs the
    // (row, position) map right after the tile list.
    let tiles_off = p.qo_off + p.num_seqs + 1u;
    var seg = INVALID;
    var first = 0u;
    if p.qmap_off != 0u && tiles_off + 2u * wg.x + 1u < p.qmap_off {
        seg = table_at(tiles_off + 2u * wg.x);
        first = table_at(tiles_off + 2u * wg.x + 1u);
    }
    var live = false;
    var qrow = 0u;
    var qpos = 0u;
    var t_end = 0u;
    var span: Span;
    if seg < p.num_seqs {
        span = seq_span(p, seg);
        t_end = span.len;
        let q0 = table_at(p.qo_off + seg);
        let nq = max(table_at(p.qo_off + seg + 1u), q0) - q0;
        if first + qi < nq && hg0 + h < GROUP {
            live = true;
            qrow = table_at(p.qmap_off + 2u * (q0 + first + qi));
            qpos = table_at(p.qmap_off + 2u * (q0 + first + qi) + 1u);
        }
    }

    let q_stride = select(p.num_heads * HEAD_DIM4, p.q_stride, p.q_stride != 0u);
    let qbase = qrow * q_stride + (h0 + h) * HEAD_DIM4;
    var qf = vec4<f32>(0.0);
    var slope = 0.0;
    for (var j = 0u; j < JN; j++) {
        var x = vec4<f32>(0.0);
        if live {
            x = act_load(q[qbase + c + j * LPR]) * q_smooth(kvh, c + j * LPR);
        }
        qv[j] = x;
        acc[j] = vec4<f32>(0.0);
    }
    if live {
        if K_RES && c == 0u {
            qf = q_res(qbase, kvh);
        }
        if p.alibi != 0u {
            slope = bitcast<f32>(table_at(p.slopes_off + h0 + h));
        }
    }
    var m = NEG_INF;
    var l = 0.0;

    for (var base = 0u; base < t_end; base += TG) {
        let tok = base + g;
        var row = INVALID;
        if tok < t_end {
            row = token_row(p, span, kvh, tok);
        }
        var s = 0.0;
        if row != INVALID {
            for (var j = 0u; j < JN; j++) {
                s += dot(qv[j], kv_load(k_pool[row + c + j * LPR]));
            }
            if K_RES && c == 0u {
                s += dot(qf, k_res(row, kvh));
            }
        }
        // Sum the row's LPR partial dots: every lane of the row gets it.
        if SUBGROUPS {
            s = lane_sum(s);
        } else if LPR > 1u {
            red[lid] = s;
            workgroupBarrier();
            var t = 0.0;
            for (var i = 0u; i < LPR; i++) {
                t += red[lid - c + i];
            }
            s = t;
            workgroupBarrier();
        }
        // q_pos - tok < window: exact for any u32 window.
        let in_window = p.sliding_window == 0u || qpos - tok < p.sliding_window;
        if row != INVALID && live && in_window {
            let x = logit(p, s * k_scale(row, kvh), slope, qpos, tok) * LOG2E;
            let m_new = max(m, x);
            let alpha = exp2(m - m_new);
            let w = exp2(x - m_new);
            l = l * alpha + w;
            m = m_new;
            let wv = w * v_scale(row, kvh);
            for (var j = 0u; j < JN; j++) {
                acc[j] = acc[j] * alpha + wv * kv_load(v_pool[row + c + j * LPR]);
            }
        }
    }

    // Merge the token groups into group 0, one group at a time.
    for (var k = 1u; k < TG; k++) {
        workgroupBarrier();
        if g == k {
            for (var j = 0u; j < JN; j++) {
                mrg[rl * JN + j] = acc[j];
            }
            mrg_ml[rl] = vec2<f32>(m, l);
        }
        workgroupBarrier();
        if g == 0u {
            let o = mrg_ml[rl];
            let m_new = max(m, o.x);
            let a = exp2(m - m_new);
            let b = exp2(o.x - m_new);
            for (var j = 0u; j < JN; j++) {
                acc[j] = acc[j] * a + mrg[rl * JN + j] * b;
            }
            l = l * a + o.y * b;
            m = m_new;
        }
    }
    if g == 0u && live {
        let slot = table_at(p.slot_off + seg);
        let o = (qrow * p.num_heads + h0 + h) * p.num_partitions + slot;
        for (var j = 0u; j < JN; j++) {
            out[o * HEAD_DIM4 + c + j * LPR] = out_store(acc[j]);
        }
        if c == 0u {
            out_ml[o] = vec2<f32>(m * LN2, l);
        }
    }
}
