//! The autotuner: times every eligible decode kernel on synthetic data for
//! one (adapter, driver, shape) and keeps the fastest, in this process and
//! in the `PAGEDATTN_TUNE_CACHE` file when one is named.

use super::kernel::{self, Kernel};
use super::plan::DecodeTables;
use super::{AttnOptions, Gpu, GpuError, KvCache, KvCacheConfig, PagedAttention};
use std::time::{Duration, Instant};

/// What [`PagedAttention::tune`] measured.
#[derive(Clone, Debug, PartialEq)]
pub struct TuneReport {
    /// Adapter, driver and shape the result is kept under.
    pub key: String,
    /// The fastest variant (or the cached choice).
    pub chosen: Kernel,
    /// Median microseconds of one synthetic decode per variant timed; empty
    /// when the choice came from the cache.
    pub micros: Vec<(Kernel, f64)>,
    /// The synthetic batch: (sequences, tokens each).
    pub batch: (u32, u32),
    /// Whether the choice came from the cache (nothing was timed).
    pub cached: bool,
}

/// Sequences of the synthetic batch.
const TUNE_SEQS: u32 = 8;
/// Bytes of K+V the synthetic batch reads, at most.
const TUNE_BYTES: u64 = 24 << 20;

impl PagedAttention {
    /// Times every variant that can run `num_heads` query heads over a
    /// cache shaped like `cache` on `gpu`, interleaved, on a synthetic batch
    /// in a scratch pool (the caller's pool is not touched), within about
    /// `budget` after the compiles, and keeps the fastest for this adapter,
    /// driver and shape: later [`new`](Self::new) calls use it. A choice
    /// already made in this process or in the `PAGEDATTN_TUNE_CACHE` file is
    /// returned without timing unless `retime`.
    pub fn tune(
        gpu: &Gpu,
        cache: &KvCache,
        num_heads: u32,
        budget: Duration,
        retime: bool,
    ) -> Result<TuneReport, GpuError> {
        let c = *cache.config();
        let eligible = Self::eligible_kernels(gpu, cache, num_heads);
        if eligible.is_empty() {
            return Err(GpuError::InvalidArgument(format!(
                "no kernel runs {num_heads} query heads over {} kv heads at head_dim {}",
                c.num_kv_heads, c.head_dim
            )));
        }
        let base = Self::base_shape(&c, num_heads, true);
        let key = kernel::tune_key(gpu, &base, num_heads, c.num_kv_heads);
        let per_token = 2 * c.num_kv_heads as u64 * c.head_dim as u64 * c.dtype.bytes();
        let tokens = (TUNE_BYTES / (TUNE_SEQS as u64 * per_token)).clamp(64, 2048) as u32;
        let batch = (TUNE_SEQS, tokens);
        if !retime {
            // A cached kernel that cannot run this shape here (a tune file
            // edited, or from another build) is not a choice: time again.
            if let Some(k) = kernel::tuned(&key).filter(|k| eligible.contains(k)) {
                return Ok(TuneReport {
                    key,
                    chosen: k,
                    micros: Vec::new(),
                    batch,
                    cached: true,
                });
            }
        }
        let blocks_per_seq = tokens.div_ceil(c.block_size);
        let scratch = KvCache::new(
            gpu,
            KvCacheConfig {
                num_layers: 1,
                num_blocks: TUNE_SEQS * blocks_per_seq,
                ..c
            },
        )?;
        // Random K/V and queries: the timing must not see a constant input.
        let mut rng = crate::rng::SplitMix64::new(0x7475_6e65);
        let [k, v] = scratch.layer(0)?;
        let elems = (k.size() / 4) as usize;
        let words: Vec<u32> = (0..elems)
            .map(|_| match c.dtype {
                super::KvDtype::F32 => rng.next_signed().to_bits(),
                super::KvDtype::F16 => {
                    let a = half::f16::from_f32(rng.next_signed()).to_bits() as u32;
                    let b = half::f16::from_f32(rng.next_signed()).to_bits() as u32;
                    a | b << 16
                }
                // Four random bytes; E4M3's NaN pattern avoided.
                _ => (rng.next_u64() as u32) & 0x7777_7777,
            })
            .collect();
        let mut words = words;
        let mut v_words = words[..(v.size() / 4) as usize].to_vec();
        if c.dtype.quantized() {
            // Scales of 1 after the data, no outlier channels.
            let at = scratch.config().data_words() as usize;
            let init = scratch.config().side_and_tail_init(true);
            words[at..at + init.len()].copy_from_slice(&init);
            let init = scratch.config().side_and_tail_init(false);
            v_words[at..at + init.len()].copy_from_slice(&init);
        }
        gpu.queue.write_buffer(k, 0, bytemuck::cast_slice(&words));
        gpu.queue.write_buffer(v, 0, bytemuck::cast_slice(&v_words));
        let q: Vec<f32> = (0..(TUNE_SEQS * num_heads * c.head_dim))
            .map(|_| rng.next_signed())
            .collect();
        let qb = gpu.storage_init("tune q", &q)?;
        let out = gpu.storage("tune out", q.len() as u64 * 4)?;
        // Sequences in shuffled blocks, as a paged pool holds them.
        let mut ids: Vec<u32> = (0..TUNE_SEQS * blocks_per_seq).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let indptr: Vec<u32> = (0..=TUNE_SEQS).map(|s| s * blocks_per_seq).collect();
        let lens = vec![tokens; TUNE_SEQS as usize];
        let tables = DecodeTables {
            kv_indptr: &indptr,
            kv_indices: &ids,
            seq_lens: &lens,
        };
        let mut runs = Vec::new();
        for &kern in &eligible {
            let attn = Self::with_kernel(gpu, &scratch, num_heads, kern)?;
            let mut plan = attn.plan();
            attn.plan_decode(gpu, &mut plan, &tables, &[AttnOptions::default()])?;
            runs.push((kern, attn, plan, Vec::<f64>::new()));
        }
        let time =
            |attn: &PagedAttention, plan: &mut super::AttentionPlan| -> Result<f64, GpuError> {
                let t0 = Instant::now();
                let mut enc = gpu.device.create_command_encoder(&Default::default());
                attn.run(
                    gpu,
                    &mut enc,
                    plan,
                    &scratch,
                    0,
                    0,
                    &qb.as_entire_buffer_binding(),
                    &out.as_entire_buffer_binding(),
                )?;
                gpu.queue.submit([enc.finish()]);
                gpu.wait()?;
                Ok(t0.elapsed().as_secs_f64() * 1e6)
            };
        // Warm-up: first dispatches pay for lazy driver work.
        for (_, attn, plan, _) in runs.iter_mut() {
            time(attn, plan)?;
        }
        let start = Instant::now();
        let mut rounds = 0;
        while rounds < 3 || (start.elapsed() < budget && rounds < 15) {
            for (_, attn, plan, t) in runs.iter_mut() {
                t.push(time(attn, plan)?);
            }
            rounds += 1;
            if start.elapsed() > budget * 2 {
                break;
            }
        }
        let micros: Vec<(Kernel, f64)> = runs
            .iter_mut()
            .map(|(k, _, _, t)| {
                t.sort_by(f64::total_cmp);
                (*k, t[t.len() / 2])
            })
            .collect();
        let chosen = micros
            .iter()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|m| m.0)
            .unwrap_or(eligible[0]);
        kernel::remember(&key, chosen);
        Ok(TuneReport {
            key,
            chosen,
            micros,
            batch,
            cached: false,
        })
    }

    /// [`tune`](Self::tune) (once per adapter, driver and shape, within
    /// about 1.5 s) and then [`new`](Self::new): the engine's constructor.
    /// `PAGEDATTN_KERNEL` still wins when set.
    pub fn tuned(
        gpu: &Gpu,
        cache: &KvCache,
        num_heads: u32,
    ) -> Result<(Self, TuneReport), GpuError> {
        let mut report = Self::tune(gpu, cache, num_heads, Duration::from_millis(1500), false)?;
        let attn = Self::new(gpu, cache, num_heads)?;
        // What runs: PAGEDATTN_KERNEL wins over the tuned choice.
        report.chosen = attn.kernel();
        Ok((attn, report))
    }
}
