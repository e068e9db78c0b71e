// Paged decode without barriers or workgroup memory, for software adapters
// (llvmpipe, SwiftShader, WARP), where a barrier is a coroutine switch over
// the workgroup's SIMD chunks and a lane-varying load is a gather whatever
// the layout: there, the fewest instructions per byte of K/V win.
//
// One invocation serves one (sequence, KV head, head tile, partition): it
// holds the HT query rows of its head tile in private memory and walks the
// partition's tokens one by one. Per token, the generated ser_token
// (src/gpu/shader.rs, unrolled over rows and vec4s) scores the K row for
// every row, updates each row's running max (rescaling that row's
// accumulator only when the max grows) and adds the weighted V row.
// Invocations never talk to each other. Scores are in log2 units (exp2).
//
// Unsplit (partition_tokens == 0) it writes the normalised output; split it
// writes the partition's unnormalised accumulator and (max, sum), max in
// natural-log units, for reduce.wgsl. Table entries outside the pool are
// skipped; a row with no readable token writes zeros (or sum 0).

const WGS: u32 = 64u;
const LOG2E: f32 = 1.4426950408889634;
const LN2: f32 = 0.6931471805599453;

@group(0) @binding(0) var<uniform> params: AttnParams;
@group(0) @binding(1) var<storage, read> q: array<ACT4>;
@group(0) @binding(2) var<storage, read> k_pool: array<KV4>;
@group(0) @binding(3) var<storage, read> v_pool: array<KV4>;
@group(0) @binding(4) var<storage, read> table: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<OUT4>;
@group(0) @binding(6) var<storage, read_write> out_ml: array<vec2<f32>>;

// The head tile's query rows and accumulators, and per row the ALiBi
// slope, running max (log2 units) and sum. Indexed by constants only.
var<private> qv: array<QV4, HT * HEAD_DIM4>;
var<private> acc: array<vec4<f32>, HT * HEAD_DIM4>;
var<private> slope: array<f32, HT>;
var<private> m: array<f32, HT>;
var<private> l: array<f32, HT>;
// Quantized pools: each row at its KV head's outlier channels (q_res).
var<private> qf: array<vec4<f32>, HT>;

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
    let hg0 = (unit % HTILES) * HT;
    let h0 = kvh * GROUP + hg0;
    // Rows of this tile that are real heads (the last tile of an odd group is partial).
    let live = min(GROUP - hg0, HT);

    let span = seq_span(p, seq);
    // Decode: the one query sits at position len - 1.
    let q_pos = max(span.len, 1u) - 1u;
    let range = decode_range(p, span.len, part);

    let q_stride = select(p.num_heads * HEAD_DIM4, p.q_stride, p.q_stride != 0u);
    ser_load_q(seq * q_stride + h0 * HEAD_DIM4, live, kvh);
    for (var r = 0u; r < HT; r++) {
        if r < live && p.alibi != 0u {
            slope[r] = bitcast<f32>(table_at(p.slopes_off + h0 + r));
        }
        m[r] = NEG_INF;
    }

    for (var tok = range.x; tok < range.y; tok++) {
        let row = token_row(p, span, kvh, tok);
        if row != INVALID {
            ser_token(row, kvh, tok, q_pos);
        }
    }

    let o = seq * p.num_heads + h0;
    if p.partition_tokens == 0u {
        ser_out(o * HEAD_DIM4, HEAD_DIM4, live, false, 0u, 0u);
    } else {
        let np = p.num_partitions;
        ser_out((o * np + part) * HEAD_DIM4, np * HEAD_DIM4, live, true, o * np + part, np);
    }
}
