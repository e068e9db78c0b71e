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
//#import generated     WG LANES NG U NT LV RED_LEN SKV4 st_init st_rows ... (shaders/templates/stream_step.wgsl, expanded by src/gpu/kernels/stream.rs)
// Paged decode shaped for GPU memory: each lane reads 16 bytes at a time,
// LANES lanes share a token's row (one warp instruction reads whole rows),
// and each group of LANES lanes walks U consecutive tokens per step.
//
// A workgroup serves one (sequence, KV head, head tile, partition) with
// WG / LANES = NG lane groups. Per step a group issues the K and the V
// loads of all U tokens before it uses any (V's addresses do not wait on
// the scores), then the table lookups of its next step, then the math:
// partial dots over the lane's vec4s, summed across the group (subgroup
// shuffles, or workgroup memory without subgroups), and one max and one
// rescale per row per step of U tokens, not per token. The block table is
// read once per run of U tokens in one block. The per-step code is
// generated from shaders/templates/stream_step.wgsl (straight-line, every
// private array indexed by constants). At the end the NG groups' states are
// merged per row by log-sum-exp. Scores are in log2 units (exp2).
//
// Unsplit it writes the normalised output; split it writes the partition's
// accumulator and (max, sum), max in natural-log units, for reduce.wgsl.

const LOG2E: f32 = 1.4426950408889634;
const LN2: f32 = 0.6931471805599453;

@group(0) @binding(0) var<uniform> params: AttnParams;
@group(0) @binding(1) var<storage, read> q: array<ACT4>;
// SKV4 (generated): 16 bytes of a row (one or more KV4s).
@group(0) @binding(2) var<storage, read> k_pool: array<SKV4>;
@group(0) @binding(3) var<storage, read> v_pool: array<SKV4>;
@group(0) @binding(4) var<storage, read> table: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<OUT4>;
@group(0) @binding(6) var<storage, read_write> out_ml: array<vec2<f32>>;

// The lane's vec4s of the head tile's query rows and accumulators; per row
// the running max (log2 units), sum and ALiBi slope; quantized pools' rows
// at the KV head's outlier channels; the rows of the group's next step.
var<private> qv: array<QV4, HT * LV>;
var<private> acc: array<vec4<f32>, HT * LV>;
var<private> m: array<f32, HT>;
var<private> l: array<f32, HT>;
var<private> slope: array<f32, HT>;
var<private> qf: array<vec4<f32>, HT>;
var<private> nrows: vec4<u32>;

// Partial dots of every lane (without subgroups; 1 when unused).
var<workgroup> red: array<f32, RED_LEN>;
// End of pass: one row's accumulators and (max, sum) of every group.
var<workgroup> mrg: array<vec4<f32>, NG * HEAD_DIM4>;
var<workgroup> mrg_ml: array<vec2<f32>, NG>;

// One query row's output from the groups' states in `mrg`.
fn st_combine(p: AttnParams, seq: u32, hq: u32, part: u32, lid: u32) {
    if lid >= HEAD_DIM4 {
        return;
    }
    var mx = NEG_INF;
    for (var i = 0u; i < NG; i++) {
        mx = max(mx, mrg_ml[i].x);
    }
    var a = vec4<f32>(0.0);
    var lt = 0.0;
    for (var i = 0u; i < NG; i++) {
        let ml = mrg_ml[i];
        if ml.y > 0.0 {
            let w = exp2(ml.x - mx);
            lt += ml.y * w;
            a += mrg[i * HEAD_DIM4 + lid] * w;
        }
    }
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

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let p = params;
    let seq = wg.x;
    let kvh = wg.y / HTILES;
    let hg0 = (wg.y % HTILES) * HT;
    let h0 = kvh * GROUP + hg0;
    let part = wg.z;
    // Lane c of lane group g.
    let c = lid % LANES;
    let g = lid / LANES;

    let span = seq_span(p, seq);
    let q_pos = max(span.len, 1u) - 1u;
    let range = decode_range(p, span.len, part);
    let q_stride = select(p.num_heads * HEAD_DIM4, p.q_stride, p.q_stride != 0u);
    // Rows of this tile that are real heads (the last tile of an odd group is partial).
    let live = min(GROUP - hg0, HT);
    st_init(seq * q_stride + h0 * HEAD_DIM4, c, live, kvh, h0);

    nrows = st_rows(p, span, kvh, range, range.begin + g * U);
    for (var base = range.begin; base < range.end; base += NT) {
        st_step(p, span, range, kvh, c, lid, base + g * U, base + NT + g * U, q_pos);
    }
    st_merge(p, seq, h0, part, lid, c, g, live);
}
