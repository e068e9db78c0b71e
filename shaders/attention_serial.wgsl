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
//#import generated     ser_token WGS SKV4 (shaders/templates/serial_token.wgsl, expanded by src/gpu/kernels/serial.rs)
// Paged decode without barriers or workgroup memory, for software adapters
// (llvmpipe, SwiftShader, WARP), where a barrier is a coroutine switch over
// the workgroup's SIMD chunks and a lane-varying load is a gather whatever
// the layout: there, the fewest instructions per byte of K/V win.
//
// One invocation serves one (sequence, KV head, head tile, partition): it
// holds the HT query rows of its head tile in private memory and walks the
// partition's tokens one by one. Per token, the generated ser_token
// (src/gpu/kernels/serial.rs, unrolled over rows and vec4s) scores the K row for
// every row, updates each row's running max (rescaling that row's
// accumulator only when the max grows) and adds the weighted V row.
// Invocations never talk to each other. Scores are in log2 units (exp2).
//
// Unsplit (partition_tokens == 0) it writes the normalised output; split it
// writes the partition's unnormalised accumulator and (max, sum), max in
// natural-log units, for reduce.wgsl. In a cascade pass (qmap_off != 0) an
// invocation serves QTILE queries of one shared segment (the segment's
// tables are a prefill's, in tiles of QTILE queries), so each K/V load
// serves QTILE x HT rows, and writes each query's partial at the
// segment's slot, as attention.wgsl's cascade mode does. Decode has
// QTILE = 1. Table entries outside the pool are skipped; a row with no
// readable token writes zeros (or sum 0).

// WGS (invocations per workgroup) is generated: 64 for decode, fewer for a
// cascade segment pass (src/gpu/kernels/serial.rs: workgroup_size).
const LOG2E: f32 = 1.4426950408889634;
const LN2: f32 = 0.6931471805599453;

@group(0) @binding(0) var<uniform> params: AttnParams;
@group(0) @binding(1) var<storage, read> q: array<ACT4>;
// SKV4 (generated): KV4, or vec4<u32> holding several KV4s of a row.
@group(0) @binding(2) var<storage, read> k_pool: array<SKV4>;
@group(0) @binding(3) var<storage, read> v_pool: array<SKV4>;
@group(0) @binding(4) var<storage, read> table: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<OUT4>;
@group(0) @binding(6) var<storage, read_write> out_ml: array<vec2<f32>>;

// The rows (QTILE query slots of HT head rows) and accumulators, and per
// row the ALiBi slope, running max (log2 units) and sum; per slot its
// query's position. Indexed by constants only in the token loop.
var<private> qv: array<QV4, QTILE * HT * HEAD_DIM4>;
var<private> acc: array<vec4<f32>, QTILE * HT * HEAD_DIM4>;
var<private> slope: array<f32, QTILE * HT>;
var<private> m: array<f32, QTILE * HT>;
var<private> l: array<f32, QTILE * HT>;
var<private> qpos: array<u32, QTILE>;
// Quantized pools: each row at its KV head's outlier channels (q_res), and
// whether any is set (else the residuals are not read).
var<private> qf: array<vec4<f32>, QTILE * HT>;
var<private> has_res: bool;

@compute @workgroup_size(WGS)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let p = params;
    // The GQA group and its head tiles come from the uniforms (the source
    // is compiled at one head tile of the group, GROUP = HT): one pipeline
    // serves every group with this head tile.
    let group = p.num_heads / max(p.num_kv_heads, 1u);
    let htiles = (group + HT - 1u) / HT;
    let units = p.num_kv_heads * htiles;
    // Flattened over a 2D grid (more than 65535 workgroups of 64 in x).
    let flat = gid.x + gid.y * nwg.x * WGS;
    let np = p.num_partitions;
    var seq = 0u;
    var unit = 0u;
    // Per slot: the query row, or INVALID for an empty slot; the tokens
    // walked; where the output (or the partial: slot `slot` of np) goes.
    var q_rows: array<u32, QTILE>;
    var range = Keys(0u, 0u, 0u, 0u);
    var slot = 0u;
    var span: Span;
    if p.qmap_off != 0u {
        // Cascade pass: entry e of the tile list is up to QTILE queries of
        // one shared segment; the segment's tokens all precede them,
        // positions are relative to the segment's first token. The
        // partials go to the segment's slot.
        let e = flat / units;
        unit = flat % units;
        // The plan packs the (row, position) map right after the tile list.
        let tiles_off = p.qo_off + p.num_seqs + 1u;
        if tiles_off + 2u * e + 1u >= p.qmap_off {
            return;
        }
        seq = table_at(tiles_off + 2u * e);
        let q0 = table_at(p.qo_off + seq);
        let nq = max(table_at(p.qo_off + seq + 1u), q0) - q0;
        let first = table_at(tiles_off + 2u * e + 1u);
        span = seq_span(p, seq);
        range = Keys(span.len, span.len, 0u, 0u);
        for (var s = 0u; s < QTILE; s++) {
            q_rows[s] = INVALID;
            if first + s < nq {
                let qi = q0 + first + s;
                q_rows[s] = table_at(p.qmap_off + 2u * qi);
                qpos[s] = table_at(p.qmap_off + 2u * qi + 1u);
                // q_pos - tok < window: tokens from q_pos + 1 - window on;
                // the union over the slots is walked.
                var begin = 0u;
                if p.sliding_window != 0u && qpos[s] + 1u > p.sliding_window {
                    begin = min(qpos[s] + 1u - p.sliding_window, span.len);
                }
                range.begin = min(range.begin, begin);
            }
        }
        slot = table_at(p.slot_off + seq);
    } else {
        let parts = max(np, 1u);
        let part = flat % parts;
        unit = (flat / parts) % units;
        seq = flat / parts / units;
        if seq >= p.num_seqs {
            return;
        }
        span = seq_span(p, seq);
        // Decode: the one query sits at position len - 1.
        for (var s = 0u; s < QTILE; s++) {
            q_rows[s] = INVALID;
        }
        q_rows[0] = seq;
        qpos[0] = max(span.len, 1u) - 1u;
        range = decode_range(p, span.len, part);
        slot = part;
    }
    let kvh = unit / htiles;
    let hg0 = (unit % htiles) * HT;
    let h0 = kvh * group + hg0;
    // Rows of this tile that are real heads (the last tile of an odd group is partial).
    let live = min(group - hg0, HT);

    let q_stride = select(p.num_heads * HEAD_DIM4, p.q_stride, p.q_stride != 0u);
    for (var s = 0u; s < QTILE; s++) {
        if q_rows[s] != INVALID {
            ser_load_q(s, q_rows[s] * q_stride + h0 * HEAD_DIM4, live, kvh);
        }
        for (var r = 0u; r < HT; r++) {
            if r < live && p.alibi != 0u {
                slope[s * HT + r] = bitcast<f32>(table_at(p.slopes_off + h0 + r));
            }
            m[s * HT + r] = NEG_INF;
        }
    }

    for (var i = range.begin; i < range.end; i++) {
        let tok = key_at(range, i);
        let row = token_row(p, span, kvh, tok);
        if row != INVALID {
            ser_token(row, kvh, tok);
        }
    }

    for (var s = 0u; s < QTILE; s++) {
        if q_rows[s] == INVALID {
            continue;
        }
        let o = q_rows[s] * p.num_heads + h0;
        if p.partition_tokens == 0u && p.qmap_off == 0u {
            ser_out(s, o * HEAD_DIM4, HEAD_DIM4, live, false, 0u, 0u);
        } else {
            ser_out(s, (o * np + slot) * HEAD_DIM4, np * HEAD_DIM4, live, true, o * np + slot, np);
        }
    }
}
