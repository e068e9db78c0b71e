//! Multi-head latent attention (DeepSeek-V2-Lite and V3 shapes) over a
//! paged latent pool, against the f64 reference in both forms: the
//! absorbed one the kernels compute, and the unabsorbed one the model's
//! weights define (keys and values materialised per head). Fresh random
//! rows, queries and weights from a printed seed; every output buffer is
//! filled with NaN before the kernels run, and a NaN fails every check.

use crate::common::{self, gpu};
use pagedattn::blocks::{BlockManager, BlockManagerConfig};
use pagedattn::gpu::{
    AttnOptions, BatchError, BindingError, DecodeTables, Gpu, GpuError, KvDtype, MlaAttention,
    MlaCache, MlaCacheConfig, MlaError, MlaPlan, MlaShape, PlanMismatch, PoolError, Split,
};
use pagedattn::reference::{mla::Weights, rel_l2};
use pagedattn::rng::SplitMix64;

/// GPU latent output against the absorbed f64 reference over the rows as
/// stored: what is left is f32 accumulation over 576-wide dots and up to a
/// few thousand tokens.
const TOL_ABSORBED: f64 = 1e-5;
/// Up-projected GPU output against the unabsorbed f64 reference from the
/// original queries: adds the f32 rounding of the absorbed query.
const TOL_UNABSORBED: f64 = 1e-4;
/// The two reference forms against each other, both in f64.
const TOL_FORMS: f64 = 1e-10;

#[derive(Clone, Copy, Debug)]
pub struct Model {
    pub name: &'static str,
    pub heads: usize,
    pub rank: usize,
    pub rope: usize,
    pub nope: usize,
    pub v_dim: usize,
}

pub const V2_LITE: Model = Model {
    name: "DeepSeek-V2-Lite",
    heads: 16,
    rank: 512,
    rope: 64,
    nope: 128,
    v_dim: 128,
};
pub const V3: Model = Model {
    name: "DeepSeek-V3",
    heads: 128,
    rank: 512,
    rope: 64,
    nope: 128,
    v_dim: 128,
};

impl Model {
    fn row(&self) -> usize {
        self.rank + self.rope
    }
    fn scale(&self) -> f32 {
        1.0 / ((self.nope + self.rope) as f32).sqrt()
    }
    fn config(
        &self,
        num_layers: u32,
        num_blocks: u32,
        block_size: u32,
        dtype: KvDtype,
    ) -> MlaCacheConfig {
        MlaCacheConfig {
            num_layers,
            num_blocks,
            block_size,
            kv_lora_rank: self.rank as u32,
            rope_dim: self.rope as u32,
            dtype,
        }
    }
}

/// Rounds as a pool of `dtype` stores (to nearest, ties to even).
fn stored(x: f32, dtype: KvDtype) -> f32 {
    match dtype {
        KvDtype::F16 => half::f16::from_f32(x).to_f32(),
        KvDtype::Bf16 => half::bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Random queries for a batch: the heads in `checked` come from q_nope and
/// q_rope through W_UK (so the unabsorbed form can be computed for them);
/// the others are random absorbed queries of the same spread.
struct Queries {
    weights: Weights,
    checked: Vec<usize>,
    /// Per query row, per checked head: (q_nope, q_rope).
    originals: Vec<Vec<(Vec<f64>, Vec<f64>)>>,
    /// [row][head][rank + rope], f32 as the GPU reads them.
    absorbed: Vec<f32>,
    /// The absorbed queries of the checked heads in f64, before rounding.
    absorbed_f64: Vec<Vec<Vec<f64>>>,
}

fn queries(rng: &mut SplitMix64, m: &Model, rows: usize, checked: &[usize]) -> Queries {
    let n = checked.len();
    let mut w =
        |len: usize| -> Vec<f64> { (0..len).map(|_| rng.next_signed() as f64 * 0.5).collect() };
    let weights = Weights {
        heads: n,
        rank: m.rank,
        nope: m.nope,
        v_dim: m.v_dim,
        w_uk: w(n * m.rank * m.nope),
        w_uv: w(n * m.rank * m.v_dim),
    };
    let mut absorbed = Vec::with_capacity(rows * m.heads * m.row());
    let mut originals = Vec::new();
    let mut absorbed_f64 = Vec::new();
    for _ in 0..rows {
        let mut orig = Vec::new();
        let mut abs64 = Vec::new();
        for h in 0..m.heads {
            if let Some(i) = checked.iter().position(|&c| c == h) {
                let qn: Vec<f64> = (0..m.nope).map(|_| rng.next_signed() as f64).collect();
                let qr: Vec<f64> = (0..m.rope)
                    .map(|_| rng.next_signed() as f64 * 2.0)
                    .collect();
                let qa = weights.absorb(i, &qn, &qr);
                absorbed.extend(qa.iter().map(|&x| x as f32));
                abs64.push(qa);
                orig.push((qn, qr));
            } else {
                absorbed.extend((0..m.row()).map(|_| rng.next_signed() * 1.9));
            }
        }
        originals.push(orig);
        absorbed_f64.push(abs64);
    }
    Queries {
        weights,
        checked: checked.to_vec(),
        originals,
        absorbed,
        absorbed_f64,
    }
}

/// A pool of `cfg` holding random rows for sequences of `lens` (layer 1;
/// layer 0 holds other rows, which no check may see), with the rows as
/// stored, per sequence.
struct Filled {
    manager: BlockManager,
    ids: Vec<pagedattn::blocks::SeqId>,
    cache: MlaCache,
    rows: Vec<Vec<f32>>,
}

const LAYER: u32 = 1;

fn filled(
    gpu: &Gpu,
    rng: &mut SplitMix64,
    m: &Model,
    lens: &[usize],
    block_size: u32,
    dtype: KvDtype,
) -> Filled {
    let num_blocks = common::blocks_for(lens, block_size, 3);
    let (manager, ids, _) = common::shuffled_batch(rng, num_blocks, block_size, lens);
    let cfg = m.config(2, num_blocks, block_size, dtype);
    let cache = MlaCache::new(gpu, cfg).unwrap();
    let mut rows = Vec::new();
    for (&id, &len) in ids.iter().zip(lens) {
        let slots: Vec<u32> = (0..len).map(|p| manager.slot(id, p).unwrap()).collect();
        let r = rng.signed_vec(len * m.row());
        cache.write(gpu, LAYER, &slots, &r).unwrap();
        cache
            .write(gpu, 0, &slots, &rng.signed_vec(len * m.row()))
            .unwrap();
        let back = cache.read_rows(gpu, LAYER, &slots).unwrap();
        let want: Vec<f32> = r.iter().map(|&x| stored(x, dtype)).collect();
        assert!(
            back.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{}: the pool does not hold the rows rounded to {}",
            m.name,
            dtype.name()
        );
        rows.push(back);
    }
    Filled {
        manager,
        ids,
        cache,
        rows,
    }
}

/// A decode plan from per-sequence tables.
fn plan_decode(
    gpu: &Gpu,
    attn: &MlaAttention,
    tables: &[&[u32]],
    lens: &[u32],
    split: Split,
) -> Result<MlaPlan, GpuError> {
    let mut plan = attn.plan();
    attn.plan_decode_slices(gpu, &mut plan, tables, lens, split)?;
    Ok(plan)
}

/// A prefill plan from per-sequence tables, cached and new tokens.
fn plan_prefill(
    gpu: &Gpu,
    attn: &MlaAttention,
    tables: &[&[u32]],
    starts: &[u32],
    news: &[u32],
    split: Split,
) -> Result<MlaPlan, GpuError> {
    let mut plan = attn.plan();
    attn.plan_prefill_slices(gpu, &mut plan, tables, starts, news, split)?;
    Ok(plan)
}

/// Runs `plan` with q and a NaN-poisoned output; the output.
fn run_poisoned(
    gpu: &Gpu,
    attn: &MlaAttention,
    plan: &mut MlaPlan,
    cache: &MlaCache,
    q: &[f32],
) -> Vec<f32> {
    let n = plan.num_queries() as usize * attn.out_row_elems() as usize;
    let q_buf = gpu.storage_init("q", q).unwrap();
    let out = gpu.storage_init("out", &vec![f32::NAN; n]).unwrap();
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    attn.run(
        gpu,
        &mut enc,
        plan,
        cache,
        LAYER,
        0,
        &q_buf.as_entire_buffer_binding(),
        &out.as_entire_buffer_binding(),
    )
    .unwrap();
    gpu.queue.submit([enc.finish()]);
    let got: Vec<f32> = gpu.read(&out, n as u64 * 4).unwrap();
    gpu.wait().unwrap();
    assert!(got.iter().all(|x| x.is_finite()), "non-finite output");
    got
}

/// Checks one output row (all heads) against both reference forms; the
/// worst (absorbed, unabsorbed) errors.
fn check_row(m: &Model, qs: &Queries, qrow: usize, got: &[f32], rows: &[&[f32]]) -> (f64, f64) {
    check_row_forms(m, qs, qrow, got, rows, true)
}

/// [`check_row`], with the unabsorbed form only where `unabsorbed`.
fn check_row_forms(
    m: &Model,
    qs: &Queries,
    qrow: usize,
    got: &[f32],
    rows: &[&[f32]],
    unabsorbed: bool,
) -> (f64, f64) {
    let scale = m.scale() as f64;
    let (mut worst_a, mut worst_u) = (0.0f64, 0.0f64);
    for h in 0..m.heads {
        let qa: Vec<f64> = qs.absorbed[(qrow * m.heads + h) * m.row()..][..m.row()]
            .iter()
            .map(|&x| x as f64)
            .collect();
        let want = pagedattn::reference::mla::absorbed(&qa, rows, m.rank, scale);
        let g = &got[h * m.rank..(h + 1) * m.rank];
        let e = rel_l2(g, &want);
        assert!(
            e < TOL_ABSORBED,
            "{} head {h}: absorbed rel L2 {e:e} >= {TOL_ABSORBED}",
            m.name
        );
        worst_a = worst_a.max(e);
    }
    for (i, &h) in qs.checked.iter().enumerate().filter(|_| unabsorbed) {
        let (qn, qr) = &qs.originals[qrow][i];
        let un = qs.weights.unabsorbed(i, qn, qr, rows, scale);
        // The identity the absorbed form rests on, in f64.
        let lat =
            pagedattn::reference::mla::absorbed(&qs.absorbed_f64[qrow][i], rows, m.rank, scale);
        let via = qs.weights.up_project(i, &lat);
        let forms = via
            .iter()
            .zip(&un)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max)
            / un.iter().map(|x| x.abs()).fold(1e-300, f64::max);
        assert!(
            forms < TOL_FORMS,
            "{} head {h}: the two forms differ by {forms:e}",
            m.name
        );
        let g: Vec<f64> = got[h * m.rank..(h + 1) * m.rank]
            .iter()
            .map(|&x| x as f64)
            .collect();
        let up: Vec<f32> = qs
            .weights
            .up_project(i, &g)
            .iter()
            .map(|&x| x as f32)
            .collect();
        let e = rel_l2(&up, &un);
        assert!(
            e < TOL_UNABSORBED,
            "{} head {h}: unabsorbed rel L2 {e:e} >= {TOL_UNABSORBED}",
            m.name
        );
        worst_u = worst_u.max(e);
    }
    (worst_a, worst_u)
}

#[allow(clippy::too_many_arguments)]
pub fn decode_case(
    gpu: &Gpu,
    m: &Model,
    dtype: KvDtype,
    lens: &[usize],
    block_size: u32,
    split: Split,
    checked: &[usize],
    seed: u64,
) {
    let mut rng = SplitMix64::new(seed);
    let f = filled(gpu, &mut rng, m, lens, block_size, dtype);
    let qs = queries(&mut rng, m, lens.len(), checked);
    let attn = MlaAttention::new(gpu, &f.cache, m.heads as u32, m.scale()).unwrap();
    let tables: Vec<&[u32]> = f
        .ids
        .iter()
        .map(|&id| f.manager.block_table(id).unwrap())
        .collect();
    let lens32: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
    let mut plan = plan_decode(gpu, &attn, &tables, &lens32, split).unwrap();
    let got = run_poisoned(gpu, &attn, &mut plan, &f.cache, &qs.absorbed);
    let (mut wa, mut wu) = (0.0f64, 0.0f64);
    let per = attn.out_row_elems() as usize;
    for (s, &len) in lens.iter().enumerate() {
        let rows: Vec<&[f32]> = f.rows[s].chunks(m.row()).take(len).collect();
        let (a, u) = check_row(m, &qs, s, &got[s * per..(s + 1) * per], &rows);
        wa = wa.max(a);
        wu = wu.max(u);
    }
    eprintln!(
        "{} {} lens {lens:?} block {block_size} {split:?}: {} partition(s) of {} tokens; absorbed {wa:.2e}, unabsorbed ({} heads) {wu:.2e}",
        m.name,
        dtype.name(),
        plan.partitions(0),
        plan.partition_tokens(0),
        checked.len()
    );
}

#[test]
fn decode_matches_both_forms_on_deepseek_shapes() {
    let Some(gpu) = gpu() else { return };
    let seed = common::seed("mla::decode_matches_both_forms_on_deepseek_shapes");
    let all_lite: Vec<usize> = (0..16).collect();
    for (i, dtype) in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16]
        .into_iter()
        .enumerate()
    {
        // V2-Lite, every head checked in both forms; unsplit, split (with a
        // partition that holds no token of the short sequences), automatic.
        for (j, split) in [Split::Never, Split::Tokens(64), Split::Auto]
            .into_iter()
            .enumerate()
        {
            decode_case(
                &gpu,
                &V2_LITE,
                dtype,
                &[1, 77, 300],
                64,
                split,
                &all_lite,
                seed + (i * 3 + j) as u64,
            );
        }
        // V3's 128 heads (16 workgroups of 8 per query row); the unabsorbed
        // form on a sample of heads across the workgroups.
        decode_case(
            &gpu,
            &V3,
            dtype,
            &[5, 130],
            64,
            Split::Tokens(64),
            &[0, 9, 63, 127],
            seed + 100 + i as u64,
        );
    }
    // Another block size, and heads that do not fill a workgroup.
    let small = Model {
        name: "12 heads, rank 64 + 16",
        heads: 12,
        rank: 64,
        rope: 16,
        nope: 32,
        v_dim: 32,
    };
    decode_case(
        &gpu,
        &small,
        KvDtype::Bf16,
        &[3, 40, 129],
        16,
        Split::Tokens(32),
        &[0, 5, 11],
        seed + 200,
    );
}

/// Prefill of sequences with `starts[i]` cached tokens and `news[i]` new
/// ones: each new token's row sees its prefix (the causal mask).
#[allow(clippy::too_many_arguments)]
pub fn prefill_case(
    gpu: &Gpu,
    m: &Model,
    dtype: KvDtype,
    starts: &[u32],
    news: &[u32],
    split: Split,
    checked: &[usize],
    seed: u64,
) {
    let mut rng = SplitMix64::new(seed);
    let lens: Vec<usize> = starts
        .iter()
        .zip(news)
        .map(|(s, n)| (s + n) as usize)
        .collect();
    let f = filled(gpu, &mut rng, m, &lens, 64, dtype);
    let rows_n: usize = news.iter().map(|&n| n as usize).sum();
    let qs = queries(&mut rng, m, rows_n, checked);
    let attn = MlaAttention::new(gpu, &f.cache, m.heads as u32, m.scale()).unwrap();
    let tables: Vec<&[u32]> = f
        .ids
        .iter()
        .map(|&id| f.manager.block_table(id).unwrap())
        .collect();
    let mut plan = plan_prefill(gpu, &attn, &tables, starts, news, split).unwrap();
    assert_eq!(plan.num_queries() as usize, rows_n);
    let got = run_poisoned(gpu, &attn, &mut plan, &f.cache, &qs.absorbed);
    let per = attn.out_row_elems() as usize;
    let mut r = 0;
    let (mut wa, mut wu) = (0.0f64, 0.0f64);
    for s in 0..starts.len() {
        for k in 0..news[s] as usize {
            let visible = starts[s] as usize + k + 1;
            let rows: Vec<&[f32]> = f.rows[s].chunks(m.row()).take(visible).collect();
            // The unabsorbed form (per-token keys and values for every
            // query row) on every 8th row and each sequence's last.
            let un = k % 8 == 0 || k + 1 == news[s] as usize;
            let (a, u) = check_row_forms(m, &qs, r, &got[r * per..(r + 1) * per], &rows, un);
            wa = wa.max(a);
            wu = wu.max(u);
            r += 1;
        }
    }
    eprintln!(
        "{} prefill {} starts {starts:?} new {news:?} {split:?}: {rows_n} rows, {} partition(s); absorbed {wa:.2e}, unabsorbed {wu:.2e}",
        m.name,
        dtype.name(),
        plan.partitions(0)
    );
}

#[test]
fn prefill_is_causal_over_a_cached_prefix() {
    let Some(gpu) = gpu() else { return };
    let seed = common::seed("mla::prefill_is_causal_over_a_cached_prefix");
    // Sequence 0: 70 cached tokens, then 50 new; sequence 1: 20 new.
    prefill_case(
        &gpu,
        &V2_LITE,
        KvDtype::Bf16,
        &[70, 0],
        &[50, 20],
        Split::Tokens(64),
        &[0, 7, 15],
        seed,
    );
    prefill_case(
        &gpu,
        &V2_LITE,
        KvDtype::F16,
        &[70, 0],
        &[50, 20],
        Split::Never,
        &[0, 7, 15],
        seed + 1,
    );
}

#[test]
fn samples_share_latent_blocks_through_copy_on_write() {
    let Some(gpu) = gpu() else { return };
    let seed = common::seed("mla::samples_share_latent_blocks_through_copy_on_write");
    let mut rng = SplitMix64::new(seed);
    let m = V2_LITE;
    let bs = 16;
    let mut mgr = BlockManager::new(BlockManagerConfig::new(32, bs)).unwrap();
    mgr.scramble_free_list(rng.next_u64());
    let cache = MlaCache::new(&gpu, m.config(2, 32, bs, KvDtype::Bf16)).unwrap();
    let attn = MlaAttention::new(&gpu, &cache, m.heads as u32, m.scale()).unwrap();
    // A 40-token prompt (its last block two-thirds full), then three
    // samples that each append their own 12 tokens.
    let prompt: Vec<u32> = (0..40).map(|_| rng.below(32000) as u32).collect();
    let parent = mgr.add_sequence(&prompt).unwrap();
    let prompt_rows = rng.signed_vec(40 * m.row());
    let slots: Vec<u32> = (0..40).map(|p| mgr.slot(parent, p).unwrap()).collect();
    cache.write(&gpu, LAYER, &slots, &prompt_rows).unwrap();
    mgr.batch_view(&[parent]).unwrap(); // the prompt's step: its tokens are now written
    let samples: Vec<_> = (0..3).map(|_| mgr.fork(parent).unwrap()).collect();
    mgr.free(parent).unwrap();
    let shared = mgr.block_table(samples[0]).unwrap()[0];
    assert_eq!(
        mgr.ref_count(shared),
        Some(3),
        "the prompt's first block is shared by the three samples"
    );
    let mut logical: Vec<Vec<f32>> = vec![
        prompt_rows
            .iter()
            .map(|&x| stored(x, KvDtype::Bf16))
            .collect();
        3
    ];
    let mut copies_total = 0;
    for step in 0..12 {
        let mut step_slots = Vec::new();
        for &s in &samples {
            step_slots.push(mgr.append(s, &[step]).unwrap()[0]);
        }
        let copies = mgr.take_copies();
        copies_total += copies.len();
        cache.copy_blocks(&gpu, &copies).unwrap();
        let new_rows = rng.signed_vec(3 * m.row());
        cache.write(&gpu, LAYER, &step_slots, &new_rows).unwrap();
        for (i, l) in logical.iter_mut().enumerate() {
            l.extend(
                new_rows[i * m.row()..(i + 1) * m.row()]
                    .iter()
                    .map(|&x| stored(x, KvDtype::Bf16)),
            );
        }
    }
    assert!(
        copies_total >= 2,
        "the shared, partly filled last block was copied ({copies_total} copies)"
    );
    assert!(
        mgr.block_table(samples[0]).unwrap()[..2] == mgr.block_table(samples[1]).unwrap()[..2],
        "the prompt's full blocks stay shared"
    );
    let qs = queries(&mut rng, &m, 3, &[0, 15]);
    let tables: Vec<&[u32]> = samples
        .iter()
        .map(|&s| mgr.block_table(s).unwrap())
        .collect();
    let lens = [52u32; 3];
    // The host-slice path this time.
    let got = attn
        .decode(
            &gpu,
            &cache,
            LAYER,
            &qs.absorbed,
            &tables,
            &lens,
            Split::Auto,
        )
        .unwrap();
    assert!(got.iter().all(|x| x.is_finite()));
    let per = attn.out_row_elems() as usize;
    for (s, l) in logical.iter().enumerate() {
        let rows: Vec<&[f32]> = l.chunks(m.row()).collect();
        let (a, u) = check_row(&m, &qs, s, &got[s * per..(s + 1) * per], &rows);
        eprintln!("sample {s}: absorbed {a:.2e}, unabsorbed {u:.2e}");
    }
    eprintln!(
        "{copies_total} copy-on-write copies; blocks used {}",
        32 - mgr.available_blocks()
    );
}

#[test]
fn both_sides_of_the_loop_limit() {
    // A context long enough that one partition would outrun llvmpipe's
    // loop limit: refused there when asked unsplit, right when split.
    let Some(gpu) = gpu() else { return };
    let seed = common::seed("mla::both_sides_of_the_loop_limit");
    let m = V2_LITE;
    let mut rng = SplitMix64::new(seed);
    let lens = [3000usize];
    let f = filled(&gpu, &mut rng, &m, &lens, 64, KvDtype::Bf16);
    let qs = queries(&mut rng, &m, 1, &[3]);
    let attn = MlaAttention::new(&gpu, &f.cache, m.heads as u32, m.scale()).unwrap();
    let tables: Vec<&[u32]> = vec![f.manager.block_table(f.ids[0]).unwrap()];
    let never = plan_decode(&gpu, &attn, &tables, &[3000], Split::Never);
    if gpu.caps_loops() {
        let cap = match never {
            Err(GpuError::Mla(MlaError::PassTooLong { tokens, cap, .. })) => {
                assert!(tokens >= 3000 && cap < 3000, "{tokens} {cap}");
                cap
            }
            other => panic!("an unsplit 3000-token pass on llvmpipe: {:?}", other.err()),
        };
        // The longest pass allowed is answered right.
        let mut plan = plan_decode(&gpu, &attn, &tables, &[3000], Split::Tokens(cap)).unwrap();
        let got = run_poisoned(&gpu, &attn, &mut plan, &f.cache, &qs.absorbed);
        let rows: Vec<&[f32]> = f.rows[0].chunks(m.row()).collect();
        let (a, _) = check_row(&m, &qs, 0, &got, &rows);
        eprintln!("at the cap: partitions of {cap} tokens, absorbed {a:.2e}");
    } else {
        never.unwrap();
    }
    let mut plan = plan_decode(&gpu, &attn, &tables, &[3000], Split::Auto).unwrap();
    assert!(
        plan.partitions(0) >= 2,
        "Auto split a lone 3000-token query row"
    );
    let got = run_poisoned(&gpu, &attn, &mut plan, &f.cache, &qs.absorbed);
    let rows: Vec<&[f32]> = f.rows[0].chunks(m.row()).collect();
    let (a, u) = check_row(&m, &qs, 0, &got, &rows);
    eprintln!(
        "3000 tokens, {} partitions of {}: absorbed {a:.2e}, unabsorbed {u:.2e}",
        plan.partitions(0),
        plan.partition_tokens(0)
    );
}

#[test]
fn the_576_wide_kernel_fits_webgpus_16_kib() {
    // The browser's default workgroup memory is 16 KiB: the DeepSeek shape
    // fits it at every head count, and runs on a device opened with it.
    for heads in [1, 16, 128] {
        let s = MlaShape::new(&MlaCacheConfig::deepseek(1, 1), heads);
        assert!(
            s.workgroup_bytes() <= 16384,
            "{heads} heads: {} bytes",
            s.workgroup_bytes()
        );
    }
    let Some(probe) = gpu() else { return };
    let inst = wgpu::Instance::new({
        let mut d = wgpu::InstanceDescriptor::new_without_display_handle();
        d.backends = common::backends().unwrap();
        d
    });
    let adapter = pollster::block_on(inst.request_adapter(&Default::default())).unwrap();
    let mut limits = adapter.limits();
    limits.max_compute_workgroup_storage_size = 16384;
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("16 KiB of workgroup memory"),
        required_limits: limits,
        ..Default::default()
    }))
    .unwrap();
    let gpu = Gpu::from_device(&device, &queue);
    assert_eq!(
        gpu.limits.max_compute_workgroup_storage_size,
        16384,
        "on {}",
        probe.describe()
    );
    let seed = common::seed("mla::the_576_wide_kernel_fits_webgpus_16_kib");
    decode_case(
        &gpu,
        &V2_LITE,
        KvDtype::F16,
        &[33, 200],
        64,
        Split::Tokens(128),
        &[1],
        seed,
    );
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let Some(gpu) = gpu() else { return };
    let seed = common::seed("mla::bad_input_is_refused_and_changes_nothing");
    let mut rng = SplitMix64::new(seed);
    let m = Model {
        name: "small",
        heads: 4,
        rank: 64,
        rope: 16,
        nope: 16,
        v_dim: 16,
    };
    let mut cfg = m.config(2, 8, 16, KvDtype::F32);
    refuses_bad_shapes(&gpu, cfg);
    let cache = MlaCache::new(&gpu, cfg).unwrap();
    let row = m.row();
    let all: Vec<u32> = (0..8 * 16).collect();
    let rows = rng.signed_vec(all.len() * row);
    cache.write(&gpu, LAYER, &all, &rows).unwrap();
    let before = cache.read_rows(&gpu, LAYER, &all).unwrap();
    refuses_bad_writes(&gpu, &cache, &rows, row);
    let attn = MlaAttention::new(&gpu, &cache, m.heads as u32, 0.25).unwrap();
    refuses_bad_plans(&gpu, &attn, &cache);
    let t: &[u32] = &[2, 5];
    let mut good = plan_decode(&gpu, &attn, &[t], &[20], Split::Auto).unwrap();
    let q = rng.signed_vec(attn.q_row_elems() as usize);
    assert!(matches!(
        mla(attn
            .decode(&gpu, &cache, LAYER, &q[1..], &[t], &[20], Split::Auto)
            .map(|_| ())),
        MlaError::Len { what: "q", .. }
    ));
    let q_buf = gpu.storage_init("q", &q).unwrap();
    let out = gpu.storage("out", attn.out_row_elems() * 4).unwrap();
    let short = gpu.storage("short", 16).unwrap();
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    let (q_b, out_b, short_b) = (
        q_buf.as_entire_buffer_binding(),
        out.as_entire_buffer_binding(),
        short.as_entire_buffer_binding(),
    );
    assert!(matches!(
        attn.run(&gpu, &mut enc, &mut good, &cache, LAYER, 0, &short_b, &out_b),
        Err(GpuError::Binding {
            which: "q",
            problem: BindingError::TooSmall { .. }
        })
    ));
    assert!(matches!(
        attn.run(&gpu, &mut enc, &mut good, &cache, LAYER, 0, &q_b, &short_b),
        Err(GpuError::Binding {
            which: "out",
            problem: BindingError::TooSmall { .. }
        })
    ));
    assert!(matches!(
        mla(attn.run(&gpu, &mut enc, &mut good, &cache, 7, 0, &q_b, &out_b)),
        MlaError::Layer { layer: 7, .. }
    ));
    assert!(matches!(
        attn.run(&gpu, &mut enc, &mut good, &cache, LAYER, 1, &q_b, &out_b),
        Err(GpuError::Batch(BatchError::Variant { variant: 1, .. }))
    ));
    // The first run binds the plan to its pool and write step.
    attn.run(&gpu, &mut enc, &mut good, &cache, LAYER, 0, &q_b, &out_b)
        .unwrap();
    let other_cache = MlaCache::new(&gpu, cfg).unwrap();
    assert!(matches!(
        mla(attn.run(
            &gpu,
            &mut enc,
            &mut good,
            &other_cache,
            LAYER,
            0,
            &q_b,
            &out_b
        )),
        MlaError::Mismatch(_)
    ));
    let other_attn = MlaAttention::new(&gpu, &cache, m.heads as u32, 0.25).unwrap();
    assert!(matches!(
        mla(other_attn.run(&gpu, &mut enc, &mut good, &cache, LAYER, 0, &q_b, &out_b)),
        MlaError::Mismatch(_)
    ));
    // A write step planned since: the plan is stale.
    let mut wplan = cache.plan();
    cache.plan_write(&gpu, &mut wplan, &[], &[]).unwrap();
    assert!(matches!(
        attn.run(&gpu, &mut enc, &mut good, &cache, LAYER, 0, &q_b, &out_b),
        Err(GpuError::Plan(PlanMismatch::Stale { .. }))
    ));
    cfg.dtype = KvDtype::Bf16;
    let bf16_cache = MlaCache::new(&gpu, cfg).unwrap();
    let mut fresh = plan_decode(&gpu, &attn, &[t], &[20], Split::Auto).unwrap();
    assert!(matches!(
        mla(attn.run(
            &gpu,
            &mut enc,
            &mut fresh,
            &bf16_cache,
            LAYER,
            0,
            &q_b,
            &out_b
        )),
        MlaError::Mismatch(_)
    ));
    drop(enc);
    gpu.wait().unwrap();
    let after = cache.read_rows(&gpu, LAYER, &all).unwrap();
    assert!(
        before
            .iter()
            .zip(&after)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "a refused call changed the pool"
    );
    // And the pool still answers right.
    let got = attn
        .decode(&gpu, &cache, LAYER, &q, &[t], &[20], Split::Auto)
        .unwrap();
    let rows_seen: Vec<&[f32]> = [2u32, 5]
        .iter()
        .flat_map(|&b| (0..16).map(move |o| b * 16 + o))
        .take(20)
        .map(|s| &after[s as usize * row..(s as usize + 1) * row])
        .collect();
    for h in 0..m.heads {
        let qa: Vec<f64> = q[h * row..(h + 1) * row]
            .iter()
            .map(|&x| x as f64)
            .collect();
        let want = pagedattn::reference::mla::absorbed(&qa, &rows_seen, m.rank, 0.25);
        let e = rel_l2(&got[h * m.rank..(h + 1) * m.rank], &want);
        assert!(e < TOL_ABSORBED, "head {h}: {e:e}");
    }
}

/// The MLA error of a refused call (a panic on any other outcome).
fn mla(e: Result<(), GpuError>) -> MlaError {
    match e {
        Err(GpuError::Mla(e)) => e,
        Err(other) => panic!("not an MlaError: {other}"),
        Ok(()) => panic!("accepted"),
    }
}

/// Shapes: cache configs and attention settings out of range.
fn refuses_bad_shapes(gpu: &Gpu, cfg: MlaCacheConfig) {
    for (bad, want) in [
        (
            MlaCacheConfig {
                kv_lora_rank: 62,
                ..cfg
            },
            "Dims",
        ),
        (MlaCacheConfig { rope_dim: 2, ..cfg }, "Dims"),
        (
            MlaCacheConfig {
                kv_lora_rank: 1024,
                ..cfg
            },
            "Dims",
        ),
        (
            MlaCacheConfig {
                kv_lora_rank: 0,
                ..cfg
            },
            "Dims",
        ),
        (
            MlaCacheConfig {
                dtype: KvDtype::Int8,
                ..cfg
            },
            "Dtype",
        ),
        (
            MlaCacheConfig {
                dtype: KvDtype::Fp8E4M3,
                ..cfg
            },
            "Dtype",
        ),
        (
            MlaCacheConfig {
                num_layers: 0,
                ..cfg
            },
            "EmptyPool",
        ),
        (
            MlaCacheConfig {
                num_blocks: 0,
                ..cfg
            },
            "EmptyPool",
        ),
    ] {
        let e = mla(MlaCache::new(gpu, bad).map(|_| ()));
        assert!(format!("{e:?}").starts_with(want), "{bad:?}: {e:?}");
        eprintln!("refused: {e}");
    }
    assert!(matches!(
        MlaCache::new(
            gpu,
            MlaCacheConfig {
                block_size: 12,
                ..cfg
            }
        )
        .err(),
        Some(GpuError::Pool(PoolError::BlockSize(12)))
    ));
    let cache = MlaCache::new(gpu, cfg).unwrap();
    assert!(matches!(
        mla(MlaAttention::new(gpu, &cache, 0, 0.1).map(|_| ())),
        MlaError::Heads { heads: 0, .. }
    ));
    assert!(matches!(
        mla(MlaAttention::new(gpu, &cache, 300, 0.1).map(|_| ())),
        MlaError::Heads { .. }
    ));
    assert!(matches!(
        mla(MlaAttention::new(gpu, &cache, 4, f32::NAN).map(|_| ())),
        MlaError::Scale(_)
    ));
    assert!(matches!(
        mla(MlaAttention::new(gpu, &cache, 4, -1.0).map(|_| ())),
        MlaError::Scale(_)
    ));
}

/// Writes and copies out of range, to the wrong layer, or overlapping.
fn refuses_bad_writes(gpu: &Gpu, cache: &MlaCache, rows: &[f32], row: usize) {
    assert!(matches!(
        mla(cache.write(gpu, LAYER, &[0, 1], &rows[..row])),
        MlaError::Len { what: "rows", .. }
    ));
    assert!(matches!(
        mla(cache.write(gpu, LAYER, &[0, 128], &rows[..2 * row])),
        MlaError::Slot {
            slot: 128,
            slots: 128
        }
    ));
    assert!(matches!(
        mla(cache.write(gpu, LAYER, &[5, 5], &rows[..2 * row])),
        MlaError::SlotTwice(5)
    ));
    assert!(matches!(
        mla(cache.write(gpu, 2, &[0], &rows[..row])),
        MlaError::Layer {
            layer: 2,
            layers: 2
        }
    ));
    assert!(matches!(
        mla(cache.copy_blocks(gpu, &[[0, 8]])),
        MlaError::Block {
            what: "copy",
            block: 8,
            ..
        }
    ));
    assert!(matches!(
        mla(cache.copy_blocks(gpu, &[[0, 3], [1, 3]])),
        MlaError::CopyOverlap(3)
    ));
    assert!(matches!(
        mla(cache.copy_blocks(gpu, &[[0, 3], [3, 4]])),
        MlaError::CopyOverlap(3)
    ));
    assert!(matches!(
        mla(cache.read_rows(gpu, 0, &[999]).map(|_| ())),
        MlaError::Slot { slot: 999, .. }
    ));
}

/// Plans over tables, lengths and splits the cache cannot serve.
fn refuses_bad_plans(gpu: &Gpu, attn: &MlaAttention, cache: &MlaCache) {
    let t: &[u32] = &[2, 5];
    let _ = cache;
    let plan = |tables: &[&[u32]], lens: &[u32], split| {
        plan_decode(gpu, attn, tables, lens, split).map(|_| ())
    };
    assert!(matches!(
        plan(&[&[2, 8]], &[20], Split::Auto),
        Err(GpuError::Batch(BatchError::BlockOutsidePool {
            block: 8,
            ..
        }))
    ));
    assert!(matches!(
        mla(plan(&[t], &[0], Split::Auto)),
        MlaError::Visible {
            query: 0,
            visible: 0,
            held: 32
        }
    ));
    assert!(matches!(
        plan(&[t], &[33], Split::Auto),
        Err(GpuError::Batch(BatchError::ShortTable {
            tokens: 33,
            blocks: 2,
            ..
        }))
    ));
    assert!(matches!(
        mla(plan(&[t, t], &[3], Split::Auto)),
        MlaError::Len { what: "lens", .. }
    ));
    assert!(matches!(
        mla(plan(&[], &[], Split::Auto)),
        MlaError::Queries { count: 0, .. }
    ));
    assert!(matches!(
        mla(plan(&[t], &[9], Split::Tokens(3))),
        MlaError::Split { tokens: 3, .. }
    ));
    assert!(matches!(
        mla(plan(&[t], &[9], Split::Tokens(0))),
        MlaError::Split { tokens: 0, .. }
    ));
    assert!(matches!(
        plan_prefill(gpu, attn, &[t], &[30], &[3], Split::Auto).map(|_| ()),
        Err(GpuError::Batch(BatchError::ShortTable { tokens: 33, .. }))
    ));
    assert!(matches!(
        mla(plan_prefill(gpu, attn, &[t], &[3], &[0], Split::Auto).map(|_| ())),
        MlaError::Queries { count: 0, .. }
    ));
    // Options the MLA kernels do not take are named.
    let mut p = attn.plan();
    let (indptr, indices, lens) = ([0u32, 2], [2u32, 5], [20u32]);
    let tables = DecodeTables {
        kv_indptr: &indptr,
        kv_indices: &indices,
        seq_lens: &lens,
    };
    for (o, name) in [
        (
            AttnOptions {
                soft_cap: Some(30.0),
                ..Default::default()
            },
            "soft_cap",
        ),
        (
            AttnOptions {
                sliding_window: Some(8),
                ..Default::default()
            },
            "sliding_window",
        ),
    ] {
        let e = mla(attn.plan_decode(gpu, &mut p, &tables, &[o]));
        assert_eq!(e, MlaError::Option(name));
    }
    assert!(matches!(
        mla(attn.plan_decode(
            gpu,
            &mut p,
            &tables,
            &[AttnOptions {
                scale: Some(f32::INFINITY),
                ..Default::default()
            }]
        )),
        MlaError::Scale(_)
    ));
}
