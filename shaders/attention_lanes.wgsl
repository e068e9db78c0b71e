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
//#import generated     rows_k rows_v rows_scale rows_shuffle (src/gpu/kernels/lanes.rs)
// Paged decode laid out for GPUs: LPT consecutive lanes share one token, each
// reading every LPT-th vec4 of its K and V rows, so one load instruction of
// a warp or wave reads whole 16-byte-aligned runs of LPT * 16 bytes of a
// few rows (coalesced), and NT = 64 / LPT tokens are in flight per
// workgroup.
//
// A workgroup serves one (sequence, KV head, head tile, partition). Each
// lane keeps, for the HT query rows of its head tile, its JN vec4 columns of
// the query, of the accumulator, and the running (max, sum) of the tokens
// its slot has seen: the online softmax runs per slot with no barrier in the
// token loop when the partial dot products are summed by subgroup shuffles
// (SUBGROUPS); without subgroups they go through workgroup memory, one
// barrier per NT tokens. The NT slots' states are merged once at the end by
// log-sum-exp. Scores are in log2 units (exp2 throughout).
//
// Unsplit it writes the normalised output; split it writes the partition's
// accumulator and (max, sum), max in natural-log units, for reduce.wgsl.

const WG: u32 = 64u;
const NT: u32 = WG / LPT;
const LOG2E: f32 = 1.4426950408889634;
const LN2: f32 = 0.6931471805599453;
// Workgroup memory of the reduction without subgroups (1 when unused).
const RED_LEN: u32 = select(2u * WG * HT, 1u, SUBGROUPS);

@group(0) @binding(0) var<uniform> params: AttnParams;
@group(0) @binding(1) var<storage, read> q: array<ACT4>;
@group(0) @binding(2) var<storage, read> k_pool: array<KV4>;
@group(0) @binding(3) var<storage, read> v_pool: array<KV4>;
@group(0) @binding(4) var<storage, read> table: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<OUT4>;
@group(0) @binding(6) var<storage, read_write> out_ml: array<vec2<f32>>;

// This lane's columns of the head tile's query rows and accumulators, one
// token's scores and weights, and the rescale factor (read by rows_*).
var<private> qv: array<QV4, HT * JN>;
var<private> acc: array<vec4<f32>, HT * JN>;
var<private> s: array<f32, HT>;
var<private> pw: array<f32, HT>;
var<private> alpha: array<f32, HT>;
// Quantized pools: each row at its KV head's K outlier channels (q_res).
var<private> qf: array<vec4<f32>, HT>;

var<workgroup> red: array<f32, RED_LEN>;
// End of pass: one row's accumulators and (max, sum) of every slot.
var<workgroup> mrg: array<vec4<f32>, NT * HEAD_DIM4>;
var<workgroup> mrg_ml: array<vec2<f32>, NT>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let p = params;
    let seq = wg.x;
    let kvh = wg.y / HTILES;
    let hg0 = (wg.y % HTILES) * HT;
    let h0 = kvh * GROUP + hg0;
    let part = wg.z;
    // Lane c of token slot `slot`.
    let c = lid % LPT;
    let slot = lid / LPT;

    let span = seq_span(p, seq);
    let q_pos = max(span.len, 1u) - 1u;
    let range = decode_range(p, span.len, part);
    let t_begin = range.begin;
    let t_end = range.end;

    let q_stride = select(p.num_heads * HEAD_DIM4, p.q_stride, p.q_stride != 0u);
    var slope = array<f32, HT>();
    var m = array<f32, HT>();
    var l = array<f32, HT>();
    for (var r = 0u; r < HT; r++) {
        let live = hg0 + r < GROUP;
        for (var j = 0u; j < JN; j++) {
            var x = vec4<f32>(0.0);
            if live {
                x = act_load(q[seq * q_stride + (h0 + r) * HEAD_DIM4 + c + j * LPT]) * q_smooth(kvh, c + j * LPT);
            }
            qv[r * JN + j] = q_conv(x);
            acc[r * JN + j] = vec4<f32>(0.0);
        }
        if K_RES && live {
            qf[r] = q_res(seq * q_stride + (h0 + r) * HEAD_DIM4, kvh);
        }
        if live && p.alibi != 0u {
            slope[r] = bitcast<f32>(table_at(p.slopes_off + h0 + r));
        }
        m[r] = NEG_INF;
        l[r] = 0.0;
    }

    var buf = 0u;
    for (var base = t_begin; base < t_end; base += NT) {
        let tok = key_at(range, base + slot);
        var row = INVALID;
        if base + slot < t_end {
            row = token_row(p, span, kvh, tok);
        }
        for (var r = 0u; r < HT; r++) {
            s[r] = 0.0;
        }
        if row != INVALID {
            for (var j = 0u; j < JN; j++) {
                rows_k(j, k_pool[row + c + j * LPT]);
            }
            // The outlier channels' residuals, once per token (lane 0).
            if K_RES && c == 0u {
                let kr = k_res(row, kvh);
                for (var r = 0u; r < HT; r++) {
                    s[r] += dot(qf[r], kr);
                }
            }
        }
        // Sum the partial dots of the slot's LPT lanes: every lane gets the total.
        if SUBGROUPS {
            for (var mask = 1u; mask < LPT; mask <<= 1u) {
                rows_shuffle(mask);
            }
        } else {
            for (var r = 0u; r < HT; r++) {
                red[(buf * WG + lid) * HT + r] = s[r];
            }
            workgroupBarrier();
            for (var r = 0u; r < HT; r++) {
                var t = 0.0;
                for (var i = 0u; i < LPT; i++) {
                    t += red[(buf * WG + slot * LPT + i) * HT + r];
                }
                s[r] = t;
            }
            buf ^= 1u;
        }
        if row != INVALID {
            // The token's K and V scales (1 unless the pool is quantized).
            let ks = k_scale(row, kvh);
            let vs = v_scale(row, kvh);
            for (var r = 0u; r < HT; r++) {
                let x = logit(p, s[r] * ks, slope[r], q_pos, tok) * LOG2E;
                let m_new = max(m[r], x);
                alpha[r] = exp2(m[r] - m_new);
                pw[r] = exp2(x - m_new);
                l[r] = l[r] * alpha[r] + pw[r];
                m[r] = m_new;
            }
            for (var j = 0u; j < JN; j++) {
                rows_v(j, kv_load(v_pool[row + c + j * LPT]) * vs);
            }
        }
    }

    // Merge the NT slots of each row by log-sum-exp; write once.
    for (var r = 0u; r < HT; r++) {
        workgroupBarrier();
        for (var j = 0u; j < JN; j++) {
            mrg[slot * HEAD_DIM4 + c + j * LPT] = acc[r * JN + j];
        }
        if c == 0u {
            mrg_ml[slot] = vec2<f32>(m[r], l[r]);
        }
        workgroupBarrier();
        if lid < HEAD_DIM4 && hg0 + r < GROUP {
            var mx = NEG_INF;
            for (var i = 0u; i < NT; i++) {
                mx = max(mx, mrg_ml[i].x);
            }
            var a = vec4<f32>(0.0);
            var lt = 0.0;
            for (var i = 0u; i < NT; i++) {
                let ml = mrg_ml[i];
                if ml.y > 0.0 {
                    let w = exp2(ml.x - mx);
                    lt += ml.y * w;
                    a += mrg[i * HEAD_DIM4 + lid] * w;
                }
            }
            let hq = h0 + r;
            if p.partition_tokens == 0u {
                out[(seq * p.num_heads + hq) * HEAD_DIM4 + lid] = out_store(select(a / lt, vec4<f32>(0.0), lt == 0.0));
            } else {
                let o = (seq * p.num_heads + hq) * p.num_partitions + part;
                out[o * HEAD_DIM4 + lid] = out_store(a);
                if lid == 0u {
                    out_ml[o] = vec2<f32>(mx * LN2, lt);
                }
            }
        }
    }
}
