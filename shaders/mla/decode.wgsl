//#import mla_constants R4 V4 BLOCK_SIZE HG LANES WG TILE_ROWS QN AN (generated from the shape: src/gpu/mla.rs)
//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
//#import kv            KV4 kv_load kv_store (shared/kv_<pool dtype>.wgsl)
//#import act           ACT4 act_load act_store (shared/act_<activation dtype>.wgsl)
//#import out           OUT4 out_load out_store (shared/out_<activation dtype>.wgsl)
//#import mla_common    MlaParams NEG INVALID (mla/common.wgsl)
// MLA attention in the absorbed form, for decode and prefill alike: each
// query row attends to the first `visible` tokens of its sequence (decode:
// all of them; prefill: up to its own position, which is the causal mask).
// The engine has folded W_UK into the query's no-RoPE part, so a query
// head's vector is [W_UK^T q_nope; q_rope] (R4 vec4s, pre-scaled here) and
// its score against a token is a dot with the token's whole latent row. The
// output is the probability-weighted latent part (V4 vec4s): the engine
// applies W_UV after.
//
// One workgroup serves HG query heads of one query row and one partition of
// its tokens. All heads read the same latent rows, so a tile of TILE_ROWS
// rows is loaded once into workgroup memory (widened to f32) and used by
// every head. LANES threads serve a head: lane l holds the query's vec4s
// l, l + LANES, ... in registers and owns the same vec4 columns of the
// output accumulator. A head's score is its lanes' partial dots summed
// through workgroup memory; the online softmax rescales once per tile.

@group(0) @binding(0) var<uniform> params: MlaParams;
// [query row][head][R4] in the activation type, rows `stride` ACT4s apart.
@group(0) @binding(1) var<storage, read> q: array<ACT4>;
// Per query row: (sequence, visible tokens).
@group(0) @binding(2) var<storage, read> queries: array<vec2<u32>>;
// [sequence][table_stride] block ids.
@group(0) @binding(3) var<storage, read> tables: array<u32>;
// One layer of the latent pool.
@group(0) @binding(4) var<storage, read> pool: array<KV4>;
// parts == 1: [query row][head][V4], normalised, in the output type. Else
// the partials, [query row][head][part][V4], not normalised (this kernel
// is then composed with f32 outputs).
@group(0) @binding(5) var<storage, read_write> out: array<OUT4>;
// [query row][head][part]: (running max, running sum) when split.
@group(0) @binding(6) var<storage, read_write> ml: array<vec2<f32>>;

var<workgroup> tile: array<vec4<f32>, TILE_ROWS * R4>;
var<workgroup> dots: array<f32, TILE_ROWS * WG>;
var<workgroup> rows: array<u32, TILE_ROWS>;
var<workgroup> scores: array<f32, HG * TILE_ROWS>;

// The first KV4 of token `tok`'s row, or INVALID when its table entry is
// past the table or names a block outside the pool.
fn row_of(seq: u32, tok: u32) -> u32 {
    let j = seq * params.table_stride + tok / BLOCK_SIZE;
    if j >= arrayLength(&tables) {
        return INVALID;
    }
    let blk = tables[j];
    if blk >= params.num_blocks {
        return INVALID;
    }
    return (blk * BLOCK_SIZE + tok % BLOCK_SIZE) * R4;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let p = params;
    let qi = wg.y;
    let part = wg.z;
    let hl = lid / LANES;
    let lane = lid % LANES;
    let head = wg.x * HG + hl;
    let live = head < p.num_heads && qi < p.num_queries;

    var info = vec2<u32>(0u, 0u);
    if qi < arrayLength(&queries) {
        info = queries[qi];
    }
    // No walk outruns the sequence's table row (the host refuses such a
    // query; this holds even for one it did not see).
    let visible = min(info.y, p.table_stride * BLOCK_SIZE);
    let t_begin = min(part * p.part_tokens, visible);
    let t_end = min(t_begin + p.part_tokens, visible);

    var qr = array<vec4<f32>, QN>();
    let qbase = qi * p.stride + head * R4;
    for (var j = 0u; j < QN; j++) {
        let c = lane + j * LANES;
        if live && c < R4 && qbase + c < arrayLength(&q) {
            qr[j] = act_load(q[qbase + c]) * p.scale;
        }
    }
    var acc = array<vec4<f32>, AN>();
    var m = NEG;
    var l = 0.0;
    for (var t0 = t_begin; t0 < t_end; t0 += TILE_ROWS) {
        if lid < TILE_ROWS {
            rows[lid] = select(INVALID, row_of(info.x, t0 + lid), t0 + lid < t_end);
        }
        workgroupBarrier();
        // 1. The tile's rows, widened, in workgroup memory (zero where unreadable).
        for (var e = lid; e < TILE_ROWS * R4; e += WG) {
            let row = rows[e / R4];
            var v = vec4<f32>(0.0);
            if row != INVALID {
                v = kv_load(pool[row + e % R4]);
            }
            tile[e] = v;
        }
        workgroupBarrier();
        // 2. Each lane's share of every row's score.
        for (var r = 0u; r < TILE_ROWS; r++) {
            var s = 0.0;
            for (var j = 0u; j < QN; j++) {
                let c = lane + j * LANES;
                if c < R4 {
                    s += dot(qr[j], tile[r * R4 + c]);
                }
            }
            dots[r * WG + lid] = s;
        }
        workgroupBarrier();
        // 3. The head's scores: lane r sums row r's shares (once per head,
        // not once per lane), then every lane rescales once for the tile.
        if lane < TILE_ROWS {
            var s = 0.0;
            for (var k = 0u; k < LANES; k++) {
                s += dots[lane * WG + hl * LANES + k];
            }
            scores[hl * TILE_ROWS + lane] = select(NEG, s, t0 + lane < t_end);
        }
        workgroupBarrier();
        var sc = array<f32, TILE_ROWS>();
        var m_new = m;
        for (var r = 0u; r < TILE_ROWS; r++) {
            sc[r] = scores[hl * TILE_ROWS + r];
            m_new = max(m_new, sc[r]);
        }
        let alpha = exp(m - m_new);
        l *= alpha;
        for (var j = 0u; j < AN; j++) {
            acc[j] *= alpha;
        }
        for (var r = 0u; r < TILE_ROWS; r++) {
            let pr = select(0.0, exp(sc[r] - m_new), t0 + r < t_end);
            l += pr;
            for (var j = 0u; j < AN; j++) {
                let c = lane + j * LANES;
                if c < V4 {
                    acc[j] += pr * tile[r * R4 + c];
                }
            }
        }
        m = m_new;
        // The next tile overwrites `rows`, `tile` and `dots`.
        workgroupBarrier();
    }
    if !live {
        return;
    }
    let o = qi * p.num_heads + head;
    if p.parts == 1u {
        // A row that saw no token (refused on the host) stays zero.
        let inv = select(0.0, 1.0 / l, l > 0.0);
        for (var j = 0u; j < AN; j++) {
            let c = lane + j * LANES;
            if c < V4 && o * V4 + c < arrayLength(&out) {
                out[o * V4 + c] = out_store(acc[j] * inv);
            }
        }
    } else {
        let slot = o * p.parts + part;
        for (var j = 0u; j < AN; j++) {
            let c = lane + j * LANES;
            if c < V4 && slot * V4 + c < arrayLength(&out) {
                out[slot * V4 + c] = out_store(acc[j]);
            }
        }
        if lane == 0u && slot < arrayLength(&ml) {
            ml[slot] = vec2<f32>(m, l);
        }
    }
}
