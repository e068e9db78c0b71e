//! MLA the way an engine runs it, in GQA's idiom: per step the latent
//! pool plans its writes and copies from the batch view into a reused
//! `WritePlan`, the attention plans from the view's tables into a reused
//! `MlaPlan`, and every layer is recorded into one encoder over ranges of
//! the engine's own arenas, in f32, f16 or bf16 activations. Checked
//! against the f64 absorbed reference over the test's own record of every
//! sequence's rows (forks included, so the copy-on-write copies are
//! checked too), on a NaN-poisoned output; after the first decode step no
//! step may create a buffer or bind group.

use crate::common::{self, gpu};
use pagedattn::blocks::{BatchView, BlockManager, BlockManagerConfig, SeqId};
use pagedattn::gpu::{
    ActDtype, AttnOptions, DecodeTables, Gpu, KvDtype, MlaAttention, MlaCache, MlaCacheConfig,
    PrefillTables, Split,
};
use pagedattn::reference::{mla::absorbed, rel_l2};
use pagedattn::rng::SplitMix64;

const HEADS: usize = 4;
const RANK: usize = 64;
const ROPE: usize = 16;
const ROW: usize = RANK + ROPE;
const LAYERS: u32 = 2;
const BS: u32 = 16;
const NB: u32 = 32;
const SCALE: f32 = 0.125;
/// Rows of the arenas' fixed ranges (the bind groups then do not depend on
/// the batch size, as an engine binds its arena).
const MAX_ROWS: u64 = 128;

/// The output against the f64 reference over the rows and queries as the
/// GPU saw them: f32 accumulation, then the output's own rounding.
fn tolerance(act: ActDtype) -> f64 {
    match act {
        ActDtype::F16 => 1e-3,
        ActDtype::Bf16 => 5e-3,
        _ => 1e-5,
    }
}

/// `x` as the activation dtype rounds it, and its bytes.
fn encode(xs: &[f32], act: ActDtype) -> (Vec<f32>, Vec<u8>) {
    match act {
        ActDtype::F16 => {
            let h: Vec<half::f16> = xs.iter().map(|&x| half::f16::from_f32(x)).collect();
            (
                h.iter().map(|x| x.to_f32()).collect(),
                bytemuck::cast_slice(&h).to_vec(),
            )
        }
        ActDtype::Bf16 => {
            let h: Vec<half::bf16> = xs.iter().map(|&x| half::bf16::from_f32(x)).collect();
            (
                h.iter().map(|x| x.to_f32()).collect(),
                bytemuck::cast_slice(&h).to_vec(),
            )
        }
        _ => (xs.to_vec(), bytemuck::cast_slice(xs).to_vec()),
    }
}

fn decode_out(bytes: &[u8], act: ActDtype) -> Vec<f32> {
    match act {
        ActDtype::F16 => bytes
            .chunks(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        ActDtype::Bf16 => bytes
            .chunks(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => bytemuck::cast_slice(bytes).to_vec(),
    }
}

/// The engine's arenas: new rows, queries and outputs, one range per
/// layer, at offsets the device must honour.
struct Arenas {
    rows: wgpu::Buffer,
    q: wgpu::Buffer,
    out: wgpu::Buffer,
    slot: u64,
}

impl Arenas {
    fn new(gpu: &Gpu) -> Self {
        let align = gpu.limits.min_storage_buffer_offset_alignment as u64;
        let slot = (MAX_ROWS * (HEADS * ROW) as u64 * 4).next_multiple_of(align);
        // One aligned range before layer 0's, so no range starts at 0.
        let bytes = slot * (LAYERS as u64 + 1);
        Self {
            rows: gpu.storage("engine rows", bytes).unwrap(),
            q: gpu.storage("engine q", bytes).unwrap(),
            out: gpu.storage("engine out", bytes).unwrap(),
            slot,
        }
    }

    fn range<'a>(&self, buf: &'a wgpu::Buffer, layer: u32) -> wgpu::BufferBinding<'a> {
        wgpu::BufferBinding {
            buffer: buf,
            offset: (layer as u64 + 1) * self.slot,
            size: std::num::NonZeroU64::new(self.slot),
        }
    }
}

#[test]
fn engine_steps_create_nothing_and_take_16_bit_activations() {
    let Some(gpu) = gpu() else { return };
    for act in [ActDtype::F32, ActDtype::F16, ActDtype::Bf16] {
        run_engine(&gpu, act);
    }
}

fn run_engine(gpu: &Gpu, act: ActDtype) {
    let seed = common::seed(&format!("mla_engine {}", act.name()));
    let mut rng = SplitMix64::new(seed);
    let cfg = MlaCacheConfig {
        num_layers: LAYERS,
        num_blocks: NB,
        block_size: BS,
        kv_lora_rank: RANK as u32,
        rope_dim: ROPE as u32,
        dtype: KvDtype::F16,
    };
    let cache = MlaCache::new(gpu, cfg).unwrap();
    let attn = MlaAttention::new(gpu, &cache, HEADS as u32, SCALE).unwrap();
    cache.warm_up(gpu, &[act]).unwrap();
    attn.warm_up(gpu, &[act]).unwrap();
    // Layer 0 unsplit, layer 1 in partitions of 32 tokens (its scale
    // overridden), so both the direct output and the merge are checked.
    let variants = [
        AttnOptions::default(),
        AttnOptions {
            split: Split::Tokens(32),
            scale: Some(SCALE * 0.5),
            ..Default::default()
        },
    ];
    let arenas = Arenas::new(gpu);
    let mut mgr = BlockManager::new(BlockManagerConfig::new(NB, BS)).unwrap();
    mgr.scramble_free_list(rng.next_u64());
    let mut wplan = cache.plan();
    let mut aplan = attn.plan();
    wplan.set_activations(act);
    aplan.set_activations(act);
    // The test's own record: per layer, per sequence, the rows as stored.
    let mut record: Vec<Vec<Vec<f32>>> = vec![Vec::new(); LAYERS as usize];
    let prompt = |rng: &mut SplitMix64, n: usize| -> Vec<u32> {
        (0..n).map(|_| rng.below(1000) as u32).collect()
    };
    let mut seqs: Vec<SeqId> = vec![
        mgr.add_sequence(&prompt(&mut rng, 37)).unwrap(),
        mgr.add_sequence(&prompt(&mut rng, 20)).unwrap(),
    ];
    for r in &mut record {
        r.resize(2, Vec::new());
    }
    let mut baseline = None;
    for step in 0..7 {
        if step == 1 {
            // Two samples of the first sequence share its blocks.
            for _ in 0..2 {
                seqs.push(mgr.fork(seqs[0]).unwrap());
                for r in &mut record {
                    let parent = r[0].clone();
                    r.push(parent);
                }
            }
        }
        if step > 0 {
            for &id in &seqs {
                mgr.append(id, &[rng.below(1000) as u32]).unwrap();
            }
        }
        let view = mgr.batch_view(&seqs).unwrap();
        let before = gpu.counters();
        let mut got = record_step(
            gpu,
            &mut rng,
            &cache,
            &attn,
            &mut wplan,
            &mut aplan,
            &arenas,
            &view,
            step == 0,
            &variants,
            act,
            &mut record,
        );
        let after = gpu.counters();
        if step >= 2 {
            assert_eq!(
                (after.buffers, after.bind_groups),
                (before.buffers, before.bind_groups),
                "{}: step {step} created objects",
                act.name()
            );
        }
        if step == 1 {
            baseline = Some(after);
        }
        read_outputs(gpu, &arenas, &mut got, act);
        check_step(&view, &got, &record, &variants, act, step, seed);
    }
    assert!(
        mgr.stats().shared > 0,
        "the samples share the prompt's blocks"
    );
    eprintln!(
        "mla engine {}: 5 steady steps; objects after the first decode {:?}",
        act.name(),
        baseline.unwrap()
    );
}

/// The query rows and outputs of one step, per layer.
struct Got {
    q: Vec<Vec<f32>>,
    out: Vec<Vec<f32>>,
    /// Per query row: (sequence, tokens it sees).
    rows: Vec<(usize, usize)>,
    out_bytes: usize,
}

#[allow(clippy::too_many_arguments)]
fn record_step(
    gpu: &Gpu,
    rng: &mut SplitMix64,
    cache: &MlaCache,
    attn: &MlaAttention,
    wplan: &mut pagedattn::gpu::WritePlan,
    aplan: &mut pagedattn::gpu::MlaPlan,
    arenas: &Arenas,
    view: &BatchView,
    prefill: bool,
    variants: &[AttnOptions],
    act: ActDtype,
    record: &mut [Vec<Vec<f32>>],
) -> Got {
    let ntok = view.slot_mapping.len();
    cache
        .plan_write(gpu, wplan, &view.slot_mapping, &view.copies)
        .unwrap();
    if prefill {
        attn.plan_prefill(gpu, aplan, &PrefillTables::from_view(view), variants)
            .unwrap();
    } else {
        attn.plan_decode(gpu, aplan, &DecodeTables::from_view(view), variants)
            .unwrap();
    }
    let nq = aplan.num_queries() as usize;
    assert!(ntok as u64 <= MAX_ROWS && nq as u64 <= MAX_ROWS);
    let mut rows_seen = Vec::new();
    for s in 0..view.num_seqs() {
        let len = view.seq_lens[s] as usize;
        let new = (view.new_indptr[s + 1] - view.new_indptr[s]) as usize;
        let queries = if prefill { new } else { 1 };
        rows_seen.extend((0..queries).map(|k| (s, len - queries + k + 1)));
    }
    assert_eq!(rows_seen.len(), nq);
    let mut got = Got {
        q: Vec::new(),
        out: Vec::new(),
        rows: rows_seen,
        out_bytes: 0,
    };
    let out_bytes = (nq * HEADS * RANK) as u64 * act.bytes();
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    cache.run_copy_blocks(gpu, &mut enc, wplan).unwrap();
    for l in 0..LAYERS {
        let (rows, row_bytes) = encode(&rng.signed_vec(ntok * ROW), act);
        let (q, q_bytes) = encode(&rng.signed_vec(nq * HEADS * ROW), act);
        let rr = arenas.range(&arenas.rows, l);
        let qr = arenas.range(&arenas.q, l);
        let or = arenas.range(&arenas.out, l);
        gpu.queue.write_buffer(&arenas.rows, rr.offset, &row_bytes);
        gpu.queue.write_buffer(&arenas.q, qr.offset, &q_bytes);
        // Poison the output range.
        let (_, nan) = encode(&vec![f32::NAN; nq * HEADS * RANK], act);
        gpu.queue.write_buffer(&arenas.out, or.offset, &nan);
        cache.run_write(gpu, &mut enc, wplan, l, &rr).unwrap();
        let variant = l as usize % variants.len();
        attn.run(gpu, &mut enc, aplan, cache, l, variant, &qr, &or)
            .unwrap();
        // The record: each new token's row, as the f16 pool stores it.
        let mut t = 0;
        for s in 0..view.num_seqs() {
            let new = (view.new_indptr[s + 1] - view.new_indptr[s]) as usize;
            for _ in 0..new {
                let row = &rows[t * ROW..(t + 1) * ROW];
                record[l as usize][s].extend(row.iter().map(|&x| half::f16::from_f32(x).to_f32()));
                t += 1;
            }
        }
        got.q.push(q);
    }
    gpu.queue.submit([enc.finish()]);
    got.out_bytes = out_bytes as usize;
    got
}

/// Reads the step's outputs back (a staging buffer: after the counters).
fn read_outputs(gpu: &Gpu, arenas: &Arenas, got: &mut Got, act: ActDtype) {
    let all: Vec<u8> = gpu.read(&arenas.out, arenas.out.size()).unwrap();
    for l in 0..LAYERS {
        let at = ((l as u64 + 1) * arenas.slot) as usize;
        got.out.push(decode_out(&all[at..at + got.out_bytes], act));
    }
}

fn check_step(
    view: &BatchView,
    got: &Got,
    record: &[Vec<Vec<f32>>],
    variants: &[AttnOptions],
    act: ActDtype,
    step: usize,
    seed: u64,
) {
    let tol = tolerance(act);
    let mut worst = 0.0f64;
    for l in 0..LAYERS as usize {
        let scale = variants[l % variants.len()].scale.unwrap_or(SCALE) as f64;
        for (r, &(s, seen)) in got.rows.iter().enumerate() {
            assert_eq!(record[l][s].len(), view.seq_lens[s] as usize * ROW);
            let rows: Vec<&[f32]> = record[l][s].chunks(ROW).take(seen).collect();
            for h in 0..HEADS {
                let at = (r * HEADS + h) * ROW;
                let q: Vec<f64> = got.q[l][at..at + ROW].iter().map(|&x| x as f64).collect();
                let want = absorbed(&q, &rows, RANK, scale);
                let o = (r * HEADS + h) * RANK;
                let g = &got.out[l][o..o + RANK];
                assert!(g.iter().all(|x| x.is_finite()), "NaN in the output");
                let e = rel_l2(g, &want);
                assert!(
                    e < tol,
                    "{} step {step} layer {l} row {r} head {h}: rel L2 {e:e} >= {tol:e} (seed {seed})",
                    act.name()
                );
                worst = worst.max(e);
            }
        }
    }
    eprintln!(
        "mla engine {} step {step}: {} query rows, worst rel L2 {worst:.2e}",
        act.name(),
        got.rows.len()
    );
}
