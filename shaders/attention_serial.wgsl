// Paged decode without barriers or workgroup memory, for software adapters
// (llvmpipe, SwiftShader, WARP), where a barrier is a coroutine switch over
// the workgroup's SIMD chunks and a lane-varying load is a gather whatever
// the layout: there, the fewest instructions per byte of K/V win.
//
// One invocation serves one (sequence, KV head, head tile, partition): it
// holds the HT query rows of its head tile in private memory, walks the
// partition's tokens in chunks of CH, scores each token for every row
// (rows_k), updates the running max once per chunk (rows_scale), then adds
// each token's V row weighted per row (rows_v). Invocations never talk to
// each other. Scores are kept in log2 units (scale * log2(e) folded in), so
// every exponential is an exp2.
//
// Unsplit (partition_tokens == 0) it writes the normalised output; split it
// writes the partition's unnormalised accumulator and (max, sum), max in
// natural-log units, for reduce.wgsl. Table entries outside the pool are
// skipped, and a row with no readable token writes zeros (or sum 0).

const WGS: u32 = 64u;
const CH: u32 = 16u;
const LOG2E: f32 = 1.4426950408889634;
const LN2: f32 = 0.6931471805599453;

@group(0) @binding(0) var<uniform> params: AttnParams;
@group(0) @binding(1) var<storage, read> q: array<ACT4>;
@group(0) @binding(2) var<storage, read> k_pool: array<KV4>;
@group(0) @binding(3) var<storage, read> v_pool: array<KV4>;
@group(0) @binding(4) var<storage, read> table: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<OUT4>;
@group(0) @binding(6) var<storage, read_write> out_ml: array<vec2<f32>>;

// The head tile's query rows, accumulators, one token's scores and weights,
// and the rescale factor of the current chunk (read by the generated rows_*).
var<private> qv: array<vec4<f32>, HT * HEAD_DIM4>;
var<private> acc: array<vec4<f32>, HT * HEAD_DIM4>;
var<private> s: array<f32, HT>;
var<private> pw: array<f32, HT>;
var<private> alpha: array<f32, HT>;

fn table_at(i: u32) -> u32 {
    if i < arrayLength(&table) {
        return table[i];
    }
    return INVALID;
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let p = params;
    let parts = max(p.num_partitions, 1u);
    let units = p.num_kv_heads * HTILES;
    // Flattened over a 2D grid (more than 65535 workgroups of 64 in x).
    let flat = gid.x + gid.y * nwg.x * WGS;
    let part = flat % parts;
    let unit = (flat / parts) % units;
    let seq = flat / parts / units;
    if seq >= p.num_seqs {
        return;
    }
    let kvh = unit / HTILES;
    let ht = unit % HTILES;
    let hg0 = ht * HT;
    let h0 = kvh * GROUP + hg0;

    let ind_end = min(table_at(seq + 1u), p.indices_len);
    let ind_start = min(table_at(seq), ind_end);
    let held = ind_end - ind_start;
    var len = min(table_at(p.lens_off + seq), 0x80000000u);
    if held <= 0xFFFFFFFFu / BLOCK_SIZE {
        len = min(len, held * BLOCK_SIZE);
    }
    // Decode: the one query sits at position len - 1.
    let q_pos = max(len, 1u) - 1u;
    let first_blk = table_at(p.indices_off + ind_start);
    var t_begin = 0u;
    var t_end = len;
    if p.partition_tokens != 0u {
        t_begin = min(part * p.partition_tokens, t_end);
        t_end = min(t_begin + p.partition_tokens, t_end);
    }
    if p.sliding_window != 0u && q_pos + 1u > p.sliding_window {
        t_begin = max(t_begin, q_pos + 1u - p.sliding_window);
        t_end = max(t_end, t_begin);
    }

    let q_stride = select(p.num_heads * HEAD_DIM4, p.q_stride, p.q_stride != 0u);
    var slope = array<f32, HT>();
    var m = array<f32, HT>();
    var l = array<f32, HT>();
    for (var r = 0u; r < HT; r++) {
        let live = hg0 + r < GROUP;
        for (var d = 0u; d < HEAD_DIM4; d++) {
            var x = vec4<f32>(0.0);
            if live {
                x = act_load(q[seq * q_stride + (h0 + r) * HEAD_DIM4 + d]);
            }
            qv[r * HEAD_DIM4 + d] = x;
            acc[r * HEAD_DIM4 + d] = vec4<f32>(0.0);
        }
        if live && p.alibi != 0u {
            slope[r] = bitcast<f32>(table_at(p.slopes_off + h0 + r));
        }
        m[r] = NEG_INF;
        l[r] = 0.0;
    }

    var rows = array<u32, CH>();
    var sc = array<f32, CH * HT>();
    for (var c0 = t_begin; c0 < t_end; c0 += CH) {
        // Scores of the chunk, and its max per row.
        var cmax = array<f32, HT>();
        for (var r = 0u; r < HT; r++) {
            cmax[r] = NEG_INF;
        }
        for (var i = 0u; i < CH; i++) {
            let tok = c0 + i;
            var row = INVALID;
            if tok < t_end {
                let j = ind_start + tok / BLOCK_SIZE;
                if j < ind_end {
                    var blk = first_blk + tok / BLOCK_SIZE;
                    if PAGED {
                        blk = table_at(p.indices_off + j);
                    }
                    if blk < p.num_blocks {
                        row = ((blk * p.num_kv_heads + kvh) * BLOCK_SIZE + tok % BLOCK_SIZE) * HEAD_DIM4;
                    }
                }
            }
            rows[i] = row;
            if row != INVALID {
                for (var r = 0u; r < HT; r++) {
                    s[r] = 0.0;
                }
                for (var d = 0u; d < HEAD_DIM4; d++) {
                    rows_k(d, kv_load(k_pool[row + d]));
                }
                for (var r = 0u; r < HT; r++) {
                    let x = logit(p, s[r], slope[r], q_pos, tok) * LOG2E;
                    sc[i * HT + r] = x;
                    cmax[r] = max(cmax[r], x);
                }
            }
        }
        // One rescale per chunk.
        var grew = false;
        for (var r = 0u; r < HT; r++) {
            let m_new = max(m[r], cmax[r]);
            alpha[r] = exp2(m[r] - m_new);
            l[r] *= alpha[r];
            grew = grew || m_new > m[r];
            m[r] = m_new;
        }
        if grew {
            for (var d = 0u; d < HEAD_DIM4; d++) {
                rows_scale(d);
            }
        }
        for (var r = 0u; r < HT; r++) {
            alpha[r] = 1.0;
        }
        // Weighted V rows.
        for (var i = 0u; i < CH; i++) {
            let row = rows[i];
            if row != INVALID {
                for (var r = 0u; r < HT; r++) {
                    pw[r] = exp2(sc[i * HT + r] - m[r]);
                    l[r] += pw[r];
                }
                for (var d = 0u; d < HEAD_DIM4; d++) {
                    rows_v(d, kv_load(v_pool[row + d]));
                }
            }
        }
    }

    for (var r = 0u; r < HT; r++) {
        if hg0 + r >= GROUP {
            continue;
        }
        let hq = h0 + r;
        if p.partition_tokens == 0u {
            for (var d = 0u; d < HEAD_DIM4; d++) {
                let a = acc[r * HEAD_DIM4 + d];
                out[(seq * p.num_heads + hq) * HEAD_DIM4 + d] = out_store(select(a / l[r], vec4<f32>(0.0), l[r] == 0.0));
            }
        } else {
            let o = (seq * p.num_heads + hq) * p.num_partitions + part;
            for (var d = 0u; d < HEAD_DIM4; d++) {
                out[o * HEAD_DIM4 + d] = out_store(acc[r * HEAD_DIM4 + d]);
            }
            out_ml[o] = vec2<f32>(m[r] * LN2, l[r]);
        }
    }
}
