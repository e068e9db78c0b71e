//! Host bookkeeping of one decode step at batch 256: append one token to each
//! of 256 sequences of ~500-1000 tokens and build the CSR batch view into a
//! reused `BatchView`. A sequence that reaches 1000 tokens is freed and
//! replaced by a new 500-token prompt (staggered, about one every other step),
//! so the pool never runs out and the figure includes that churn.

use std::hint::black_box;

use criterion::{criterion_group, Criterion, Throughput};
use pagedattn::blocks::{BatchView, BlockManager, BlockManagerConfig, SeqId};
use pagedattn::rng::SplitMix64;

const BATCH: usize = 256;
const PROMPT: usize = 500;
const MAX_LEN: usize = 1000;
const BLOCK_SIZE: u32 = 16;
const VOCAB: u64 = 32_000;

struct DecodeBatch {
    m: BlockManager,
    ids: Vec<SeqId>,
    lens: Vec<usize>,
    view: BatchView,
    rng: SplitMix64,
    prompt: Vec<u32>,
}

impl DecodeBatch {
    fn new(prefix_caching: bool) -> Self {
        let per_seq = MAX_LEN.div_ceil(BLOCK_SIZE as usize) as u32 + 1;
        let cfg = BlockManagerConfig::new(BATCH as u32 * per_seq + 64, BLOCK_SIZE)
            .with_prefix_caching(prefix_caching);
        let mut m = BlockManager::new(cfg).unwrap();
        let mut rng = SplitMix64::new(0xB00C);
        let mut ids = Vec::with_capacity(BATCH);
        let mut lens = Vec::with_capacity(BATCH);
        for i in 0..BATCH {
            // Lengths spread over [500, 1000) so completions are staggered.
            let len = PROMPT + i * (MAX_LEN - PROMPT) / BATCH;
            let prompt: Vec<u32> = (0..len).map(|_| rng.below(VOCAB) as u32).collect();
            ids.push(m.add_sequence(&prompt).unwrap());
            lens.push(len);
        }
        let mut view = BatchView::default();
        m.batch_view_into(&ids, &mut view).unwrap();
        DecodeBatch {
            m,
            ids,
            lens,
            view,
            rng,
            prompt: vec![0; PROMPT],
        }
    }

    fn step(&mut self) {
        for i in 0..BATCH {
            if self.lens[i] >= MAX_LEN {
                self.m.free(self.ids[i]).unwrap();
                for t in &mut self.prompt {
                    *t = self.rng.below(VOCAB) as u32;
                }
                self.ids[i] = self.m.add_sequence(&self.prompt).unwrap();
                self.lens[i] = PROMPT;
            } else {
                let token = self.rng.below(VOCAB) as u32;
                black_box(self.m.append(self.ids[i], &[token]).unwrap());
                self.lens[i] += 1;
            }
        }
        self.m.batch_view_into(&self.ids, &mut self.view).unwrap();
        black_box(&self.view);
    }
}

fn decode_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("bookkeeping");
    g.throughput(Throughput::Elements(BATCH as u64));
    for (name, prefix) in [
        ("decode_step_batch256", false),
        ("decode_step_batch256_prefix_cache", true),
    ] {
        let mut batch = DecodeBatch::new(prefix);
        g.bench_function(name, |b| b.iter(|| batch.step()));
    }
    // The view alone: CSR tables of 256 sequences, no new tokens.
    let mut batch = DecodeBatch::new(false);
    g.bench_function("batch_view_only_batch256", |b| {
        b.iter(|| {
            batch
                .m
                .batch_view_into(&batch.ids, &mut batch.view)
                .unwrap();
            black_box(&batch.view);
        })
    });
    g.finish();
}

criterion_group!(benches, decode_step);
