//! `--only host`: the host's bookkeeping per sequence and a step's host time.

use super::*;

/// Host bookkeeping of one decode step at batch 256 (append one token to
/// each sequence, build the CSR view into a reused BatchView), µs per sequence.
pub fn host_bookkeeping_us_per_seq(steps: usize) -> f64 {
    bookkeeping(steps, false)
}

/// [`host_bookkeeping_us_per_seq`] with prefix caching on: each block a
/// sequence fills is digested (SHA-256 chain) and registered.
pub fn host_bookkeeping_us_per_seq_prefix_cache(steps: usize) -> f64 {
    bookkeeping(steps, true)
}

/// The library [`Scheduler`]'s host cost of a decode step at batch 256
/// (`schedule` + `commit`, one token a sequence), microseconds per sequence.
pub fn scheduler_us_per_seq(steps: usize) -> f64 {
    let batch = 256usize;
    let mut s = Scheduler::new(
        BlockManagerConfig::new((batch * 64) as u32, BLOCK),
        SchedulerConfig::new(4096, batch),
    )
    .expect("valid scheduler");
    for i in 0..batch {
        s.add_request(&vec![i as u32; 500], 1, b"")
            .expect("pool sized for the batch");
    }
    let run = |s: &mut Scheduler| -> usize {
        let step = s.schedule().expect("pool sized for the run");
        let outs: Vec<GroupOutput> = step
            .sample()
            .iter()
            .map(|&request| GroupOutput {
                request,
                children: vec![Child {
                    parent: 0,
                    token: 1,
                    finished: false,
                }],
            })
            .collect();
        s.commit(&step, &outs).expect("outputs match the step");
        step.rows().len()
    };
    // Prefill in chunks until every sequence decodes.
    while run(&mut s) < batch || s.queue_lengths().0 > 0 {}
    let t0 = std::time::Instant::now();
    for _ in 0..steps {
        run(&mut s);
    }
    t0.elapsed().as_secs_f64() * 1e6 / (steps * batch) as f64
}

/// Host bookkeeping of a decode step of Gemma 3's layer groups (18
/// layers, a window of 512 on 15 of them) at batch 256, past the window
/// (prompts of 600 tokens): append one token to each sequence and take the
/// step's views, the window group releasing what it no longer reads.
/// Returns µs per sequence: (two groups with release, one full group).
pub fn hybrid_us_per_seq(steps: usize) -> (f64, f64) {
    use pagedattn::blocks::{GroupKind, HybridManager, LayerGroups};
    let batch = 256usize;
    let run = |layout: LayerGroups| -> f64 {
        let blocks: Vec<u32> = layout
            .groups()
            .iter()
            .map(|_| (batch * (600 + steps).div_ceil(BLOCK as usize) + 64) as u32)
            .collect();
        let mut m = HybridManager::new(layout, &blocks, BLOCK, false).expect("valid pools");
        let seqs: Vec<_> = (0..batch)
            .map(|i| {
                m.add_sequence(&vec![i as u32; 600])
                    .expect("pools sized for the batch")
            })
            .collect();
        m.batch_view(&seqs).expect("live sequences");
        let t0 = std::time::Instant::now();
        for step in 0..steps {
            for s in &seqs {
                m.append(s, &[step as u32])
                    .expect("pools sized for the run");
            }
            m.batch_view(&seqs).expect("live sequences");
        }
        t0.elapsed().as_secs_f64() * 1e6 / (steps * batch) as f64
    };
    let hybrid =
        run(LayerGroups::interleaved(18, 6, GroupKind::Window(512)).expect("valid layout"));
    let full = run(LayerGroups::uniform(18, GroupKind::Full).expect("valid layout"));
    (hybrid, full)
}

pub(crate) fn bookkeeping(steps: usize, prefix: bool) -> f64 {
    let batch = 256;
    let mut m =
        BlockManager::new(BlockManagerConfig::new(batch * 64, BLOCK).with_prefix_caching(prefix))
            .expect("valid pool");
    let ids: Vec<SeqId> = (0..batch)
        .map(|i| {
            m.add_sequence(&vec![i; 500])
                .expect("pool sized for the batch")
        })
        .collect();
    let mut view = BatchView::default();
    m.batch_view_into(&ids, &mut view).expect("live ids");
    let t0 = std::time::Instant::now();
    for step in 0..steps {
        for &id in &ids {
            m.append(id, &[step as u32])
                .expect("pool sized for the run");
        }
        m.batch_view_into(&ids, &mut view).expect("live ids");
    }
    t0.elapsed().as_secs_f64() * 1e6 / (steps * batch as usize) as f64
}

/// The host side of one planned decode step (`pagedattn::gpu` plan/run):
/// bookkeeping (`batch_view_into`), `plan_write` + `plan_decode`, and
/// recording `run_copy_blocks` and, per layer, `run_write_kv` + `run` into
/// one encoder (finished, not submitted).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct HostStep {
    /// Layers recorded.
    pub layers: u32,
    /// Sequences in the batch.
    pub batch: u32,
    /// Context per sequence, tokens.
    pub context: u32,
    /// Median microseconds per step.
    pub us_per_step: f64,
    /// Buffers the library created over the timed steps (target 0).
    pub buffers_created: u64,
    /// Bind groups the library created over the timed steps (target 0).
    pub bind_groups_created: u64,
}

/// Measures [`HostStep`] at 32 layers, batch 64, context 2048 (tiny heads:
/// the host work depends on the tables, not on the head shape).
pub fn host_step(gpu: &Gpu, steps: usize) -> Result<HostStep, BenchError> {
    use pagedattn::gpu::{DecodeTables, KvCacheConfig, PagedAttention};
    let (layers, batch, context) = (32u32, 64u32, 2048u32);
    let (kvh, hd) = (1u32, 16u32);
    let blocks_per_seq = context / BLOCK + 2;
    let num_blocks = batch * blocks_per_seq;
    let cache = KvCache::new(
        gpu,
        KvCacheConfig::new(num_blocks, BLOCK, kvh, hd)
            .with_layers(layers)
            .with_dtype(KvDtype::F16),
    )?;
    let attn = PagedAttention::new(gpu, &cache, 2 * kvh, &Default::default())?;
    let mut m = BlockManager::new(BlockManagerConfig::new(num_blocks, BLOCK))?;
    let ids: Vec<SeqId> = (0..batch)
        .map(|i| m.add_sequence(&vec![i; context as usize - 1 - steps]))
        .collect::<Result<_, _>>()?;
    let mut view = BatchView::default();
    m.batch_view_into(&ids, &mut view)?;
    let q = gpu.storage("host step q", (batch * 2 * kvh * hd * 4) as u64)?;
    let out = gpu.storage("host step out", (batch * 2 * kvh * hd * 4) as u64)?;
    let kv = gpu.storage("host step k/v", (batch * kvh * hd * 4) as u64)?;
    let (mut wplan, mut aplan) = (cache.plan(), attn.plan());
    let opts = [pagedattn::gpu::AttnOptions::default()];
    let mut times = Vec::with_capacity(steps);
    let mut before = None;
    for step in 0..steps + 2 {
        if step == 2 {
            before = Some(gpu.counters());
        }
        let t0 = std::time::Instant::now();
        for &id in &ids {
            m.append(id, &[step as u32])?;
        }
        m.batch_view_into(&ids, &mut view)?;
        cache.plan_write(gpu, &mut wplan, &view.slot_mapping, &view.copies)?;
        attn.plan_decode(gpu, &mut aplan, &DecodeTables::from_view(&view), &opts)?;
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        cache.run_copy_blocks(gpu, &mut enc, &mut wplan)?;
        let kvb = kv.as_entire_buffer_binding();
        for l in 0..layers {
            cache.run_write_kv(gpu, &mut enc, &mut wplan, l, &kvb, &kvb)?;
            attn.run(
                gpu,
                &mut enc,
                &mut aplan,
                &cache,
                l,
                0,
                &q.as_entire_buffer_binding(),
                &out.as_entire_buffer_binding(),
            )?;
        }
        let cmd = enc.finish();
        if step >= 2 {
            times.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        drop(cmd);
    }
    let after = gpu.counters();
    let before = before.unwrap_or(after);
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(HostStep {
        layers,
        batch,
        context,
        us_per_step: times.get(times.len() / 2).copied().unwrap_or(0.0),
        buffers_created: after.buffers - before.buffers,
        bind_groups_created: after.bind_groups - before.bind_groups,
    })
}
