//! Paged decode over a grid of batch x context, paged (shuffled physical
//! blocks) vs the same kernel with an identity table, with K+V bytes as the
//! throughput, beside the adapter's copy_buffer_to_buffer and streaming-read
//! bandwidth measured in the same run. GPU time comes from timestamp queries
//! where the adapter has them (criterion's `iter_custom`), else wall time.
//! Shape: 32 query heads over 8 KV heads, head_dim 128, block 16, f16 KV.

use std::time::Duration;

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use pagedattn::gpu::{AttentionPlan, Gpu, KvCache, KvDtype, PagedAttention, Split};
use pagedattn::rng::SplitMix64;
use pagedattn_cli::bench::{
    decode_plan, filled_cache, tables, StreamRead, Timer, BLOCK, HEADS, HEAD_DIM, KV_HEADS,
};

fn gpu_time(
    timer: &Timer,
    iters: u64,
    record: &mut dyn FnMut(usize, &mut wgpu::CommandEncoder),
) -> Duration {
    let mut total = 0.0;
    for i in 0..iters {
        total += timer.once(i as usize, record).expect("GPU run");
    }
    Duration::from_secs_f64(total / 1e3)
}

/// One decode cell: a filled two-layer cache, its kernels, Q and output.
struct Cell<'a> {
    gpu: &'a Gpu,
    cache: KvCache,
    attn: PagedAttention,
    q: wgpu::Buffer,
    out: wgpu::Buffer,
}

impl<'a> Cell<'a> {
    fn new(gpu: &'a Gpu, cache: KvCache, batch: u32, rng: &mut SplitMix64) -> Self {
        let attn = PagedAttention::new(gpu, &cache, HEADS, &Default::default()).expect("kernels");
        let q = gpu
            .storage_init("q", &rng.signed_vec((batch * HEADS * HEAD_DIM) as usize))
            .unwrap();
        let out = gpu
            .storage("out", (batch * HEADS * HEAD_DIM * 4) as u64)
            .unwrap();
        Self {
            gpu,
            cache,
            attn,
            q,
            out,
        }
    }

    /// GPU time of `iters` runs of `plan`, layers alternating.
    fn time(&self, timer: &Timer, iters: u64, plan: &mut AttentionPlan) -> Duration {
        gpu_time(timer, iters, &mut |run, enc| {
            self.attn
                .run(
                    self.gpu,
                    enc,
                    plan,
                    &self.cache,
                    run as u32 % 2,
                    0,
                    &self.q.as_entire_buffer_binding(),
                    &self.out.as_entire_buffer_binding(),
                )
                .expect("decode");
        })
    }
}

fn decode(c: &mut Criterion) {
    let gpu = match Gpu::new() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("decode bench skipped: {e}");
            return;
        }
    };
    let timer = Timer::new(&gpu, false);
    eprintln!(
        "decode bench on {} ({:?} timing)",
        gpu.describe(),
        timer.source()
    );
    let mut rng = SplitMix64::new(42);
    let mut g = c.benchmark_group("decode");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(1));
    for &batch in &[1u32, 8, 32, 64] {
        for &ctx in &[128u32, 512, 2048, 8192] {
            // Two layers, rotated, so a run never finds the last run's data cached.
            let Some(cache) =
                filled_cache(&gpu, batch * ctx, KvDtype::F16, 2, &mut rng).expect("cache")
            else {
                eprintln!("decode b{batch} c{ctx}: over the adapter's binding limit, skipped");
                continue;
            };
            let cell = Cell::new(&gpu, cache, batch, &mut rng);
            let attn = &cell.attn;
            let bytes = 2 * batch as u64 * ctx as u64 * (KV_HEADS * HEAD_DIM) as u64 * 2;
            g.throughput(Throughput::Bytes(bytes));
            for (name, shuffled) in [("paged", true), ("identity", false)] {
                let t = tables(batch, ctx, shuffled, &mut rng);
                let mut plan = decode_plan(&gpu, attn, &t, Split::Auto).expect("plan");
                let id = BenchmarkId::new(name, format!("b{batch}/c{ctx}"));
                g.bench_function(id, |b| {
                    b.iter_custom(|iters| cell.time(&timer, iters, &mut plan))
                });
            }
        }
    }
    g.finish();

    // Split-K vs one workgroup per (sequence, kv head) where it matters:
    // few sequences, long contexts.
    let mut g = c.benchmark_group("decode_split");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(1));
    for &batch in &[1u32, 4] {
        for &ctx in &[2048u32, 8192, 32768] {
            let Some(cache) =
                filled_cache(&gpu, batch * ctx, KvDtype::F16, 2, &mut rng).expect("cache")
            else {
                eprintln!(
                    "decode_split b{batch} c{ctx}: over the adapter's binding limit, skipped"
                );
                continue;
            };
            let cell = Cell::new(&gpu, cache, batch, &mut rng);
            let attn = &cell.attn;
            g.throughput(Throughput::Bytes(
                2 * batch as u64 * ctx as u64 * (KV_HEADS * HEAD_DIM) as u64 * 2,
            ));
            let t = tables(batch, ctx, true, &mut rng);
            for (name, split) in [("whole", Split::Never), ("split512", Split::Tokens(512))] {
                let mut plan = decode_plan(&gpu, attn, &t, split).expect("plan");
                let id = BenchmarkId::new(name, format!("b{batch}/c{ctx}"));
                g.bench_function(id, |b| {
                    b.iter_custom(|iters| cell.time(&timer, iters, &mut plan))
                });
            }
        }
    }
    g.finish();

    // The adapter's own bandwidth in the same run, over a pool the size of
    // the largest decode cell that fits.
    let mut g = c.benchmark_group("bandwidth");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(1));
    let tokens = (gpu.max_binding_bytes() / (KV_HEADS * HEAD_DIM * 2) as u64).min(32 * 2048) as u32
        / BLOCK
        * BLOCK;
    let cache = filled_cache(&gpu, tokens, KvDtype::F16, 2, &mut rng)
        .expect("cache")
        .expect("fits by construction");
    let stream = StreamRead::new(&gpu, &cache).expect("stream kernel");
    g.throughput(Throughput::Bytes(stream.bytes));
    g.bench_function("stream_read", |b| {
        b.iter_custom(|iters| gpu_time(&timer, iters, &mut |run, enc| stream.record(enc, run)))
    });
    let [k0, _] = cache.layer(0).expect("layer");
    let [k1, _] = cache.layer(1).expect("layer");
    let half = cache.config().layer_bytes();
    g.throughput(Throughput::Bytes(half));
    g.bench_function("copy_buffer_to_buffer", |b| {
        b.iter_custom(|iters| {
            gpu_time(&timer, iters, &mut |run, enc| {
                let (src, dst) = if run % 2 == 0 { (k0, k1) } else { (k1, k0) };
                enc.copy_buffer_to_buffer(src, 0, dst, 0, half);
            })
        })
    });
    g.finish();
}

criterion_group!(benches, decode);
