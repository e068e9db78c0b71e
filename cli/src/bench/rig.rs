//! What every timed section stands on: a filled pool, tables, a decode rig, interleaved medians.

use super::*;

/// The decode tables of `t`.
pub fn decode_tables(t: &HostTables) -> DecodeTables<'_> {
    DecodeTables {
        kv_indptr: &t.0,
        kv_indices: &t.1,
        seq_lens: &t.2,
    }
}

/// A decode plan of `t` under `split`, made once and run many times.
pub fn decode_plan(
    gpu: &Gpu,
    attn: &PagedAttention,
    t: &HostTables,
    split: Split,
) -> Result<AttentionPlan, GpuError> {
    let mut plan = attn.plan();
    let opts = AttnOptions {
        split,
        ..Default::default()
    };
    attn.plan_decode(gpu, &mut plan, &decode_tables(t), &[opts])?;
    Ok(plan)
}

/// A cache of `layers` layers holding `tokens` tokens of the grid's shape,
/// filled with a repeating random pattern; `None` if a layer would not fit.
pub fn filled_cache(
    gpu: &Gpu,
    tokens: u32,
    dtype: KvDtype,
    layers: u32,
    rng: &mut SplitMix64,
) -> Result<Option<KvCache>, GpuError> {
    let cfg = grid_config(layers, tokens.div_ceil(BLOCK), dtype);
    if cfg.layer_bytes() > gpu.max_binding_bytes() {
        return Ok(None);
    }
    let cache = KvCache::new(gpu, cfg)?;
    let pattern: Vec<u8> = match dtype {
        KvDtype::F32 => bytemuck::cast_slice(&rng.signed_vec(1 << 16)).to_vec(),
        KvDtype::F16 => {
            let h: Vec<half::f16> = rng
                .signed_vec(1 << 17)
                .iter()
                .map(|&x| half::f16::from_f32(x))
                .collect();
            bytemuck::cast_slice(&h).to_vec()
        }
        KvDtype::Bf16 => {
            let h: Vec<half::bf16> = rng
                .signed_vec(1 << 17)
                .iter()
                .map(|&x| half::bf16::from_f32(x))
                .collect();
            bytemuck::cast_slice(&h).to_vec()
        }
        // Random bytes (E4M3's NaN pattern avoided); scales written below.
        KvDtype::Int8 | KvDtype::Fp8E4M3 => (0..1 << 18)
            .map(|_| (rng.next_u64() as u8) & 0x77)
            .collect(),
    };
    for l in 0..layers {
        for (kv, buf) in cache.layer(l)?.iter().enumerate() {
            let size = buf.size();
            let mut off = 0;
            while off < size {
                let n = (pattern.len() as u64).min(size - off);
                gpu.queue.write_buffer(buf, off, &pattern[..n as usize]);
                off += n;
            }
            if dtype.quantized() {
                let at = cfg.data_words() * 4;
                let init = cfg.side_and_tail_init(kv == 0);
                gpu.queue.write_buffer(buf, at, bytemuck::cast_slice(&init));
            }
        }
    }
    gpu.wait()?;
    Ok(Some(cache))
}

/// CSR tables for `batch` sequences of `context` tokens over `batch *
/// blocks_per_seq` blocks: identity order, or a seeded shuffle.
pub fn tables(
    batch: u32,
    context: u32,
    shuffled: bool,
    rng: &mut SplitMix64,
) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let per = context.div_ceil(BLOCK);
    let mut ids: Vec<u32> = (0..batch * per).collect();
    if shuffled {
        rng.shuffle(&mut ids);
    }
    let indptr = (0..=batch).map(|s| s * per).collect();
    (indptr, ids, vec![context; batch as usize])
}

pub(crate) struct DecodeRig<'a> {
    pub(crate) gpu: &'a Gpu,
    pub(crate) cache: KvCache,
    pub(crate) layers: u32,
    pub(crate) q: wgpu::Buffer,
    pub(crate) out: wgpu::Buffer,
}

impl DecodeRig<'_> {
    /// Median ms of each of several decode variants, measured interleaved
    /// (variant 0, 1, 2, 0, 1, 2, ...) so that a slow drift of the machine
    /// lands on all of them alike; layers rotate so no run finds the
    /// previous run's data in a cache.
    pub(crate) fn time_interleaved(
        &self,
        timer: &Timer,
        variants: &[(&PagedAttention, &HostTables, Split)],
    ) -> Result<Vec<f64>, GpuError> {
        // Each variant planned once; a run only records.
        let mut plans = variants
            .iter()
            .map(|(a, t, split)| decode_plan(self.gpu, a, t, *split))
            .collect::<Result<Vec<_>, _>>()?;
        let mut err = None;
        let mut one = |run: usize, i: usize, n: usize| {
            let attn = variants[i].0;
            let plan = &mut plans[i];
            timer.batch(run, n, &mut |run, enc| {
                let layer = run as u32 % self.layers;
                if let Err(e) = attn.run(
                    self.gpu,
                    enc,
                    plan,
                    &self.cache,
                    layer,
                    0,
                    &self.q.as_entire_buffer_binding(),
                    &self.out.as_entire_buffer_binding(),
                ) {
                    err = Some(e);
                }
            })
        };
        // Warm-up of every variant; its time decides how many runs follow.
        let mut slowest: f64 = 0.0;
        for i in 0..variants.len() {
            slowest = slowest.max(one(0, i, 1)?);
        }
        let runs = if slowest > timer::SLOW_RUN_MS {
            3
        } else {
            timer.runs
        };
        let n = timer::per_submit(slowest);
        let mut times = vec![Vec::with_capacity(runs); variants.len()];
        for run in 1..=runs {
            for (i, t) in times.iter_mut().enumerate() {
                t.push(one(run, i, n)?);
            }
        }
        if let Some(e) = err {
            return Err(e);
        }
        Ok(times
            .into_iter()
            .map(|mut t| {
                t.sort_by(|a, b| a.total_cmp(b));
                t[t.len() / 2]
            })
            .collect())
    }
}

pub(crate) fn rig<'a>(
    gpu: &'a Gpu,
    batch: u32,
    context: u32,
    dtype: KvDtype,
    rng: &mut SplitMix64,
) -> Result<Option<DecodeRig<'a>>, GpuError> {
    let tokens = batch * context;
    let Some(cache) = filled_cache(gpu, tokens, dtype, 2, rng)? else {
        return Ok(None);
    };
    let q = gpu.storage_init("q", &rng.signed_vec((batch * HEADS * HEAD_DIM) as usize))?;
    let out = gpu.storage("out", (batch * HEADS * HEAD_DIM * 4) as u64)?;
    Ok(Some(DecodeRig {
        gpu,
        cache,
        layers: 2,
        q,
        out,
    }))
}

/// Median ms of each of `n` variants, one run of each in turn (variant 0,
/// 1, ..., 0, 1, ...) after a warm-up round, so a drift of the machine lands
/// on all alike. `record(variant, run, encoder)` records one run.
pub(crate) fn interleaved_medians(
    timer: &Timer,
    n: usize,
    record: &mut dyn FnMut(usize, usize, &mut wgpu::CommandEncoder) -> Result<(), GpuError>,
) -> Result<Vec<f64>, GpuError> {
    let mut err = None;
    let mut times = vec![Vec::new(); n];
    let runs = timer.runs.clamp(3, 7);
    // The warm-up round decides the runs per submit.
    let mut per = 1;
    for run in 0..=runs {
        let mut slowest: f64 = 0.0;
        for (i, t) in times.iter_mut().enumerate() {
            let ms = timer.batch(run, per, &mut |run, enc| {
                if let Err(e) = record(i, run, enc) {
                    err = Some(e);
                }
            })?;
            slowest = slowest.max(ms);
            if run > 0 {
                t.push(ms);
            }
        }
        if run == 0 {
            per = timer::per_submit(slowest);
        }
    }
    if let Some(e) = err {
        return Err(e);
    }
    Ok(times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect())
}

/// One cascade cell (f16 KV, the grid's head shape): `n` sequences sharing
/// a `prompt`-token prompt, each with 0-256 private tokens.
/// The grid's attention over `cache`: `PAGEDATTN_KERNEL` when set, else
/// the bench tuner's pick for the shape, else the adapter's default.
pub(crate) fn attention(
    gpu: &Gpu,
    picks: &pagedattn::gpu::Tuner,
    cache: &KvCache,
) -> Result<PagedAttention, BenchError> {
    let cfg =
        crate::env::attention_config(picks.kept(gpu, cache, HEADS)).map_err(BenchError::Config)?;
    Ok(PagedAttention::new(gpu, cache, HEADS, &cfg)?)
}

pub(crate) fn progress(cfg: &BenchConfig, msg: &str) {
    if cfg.progress {
        // Not eprint!: that panics when stderr is a closed pipe.
        use std::io::Write as _;
        let _ = write!(std::io::stderr(), "\r\x1b[2K[bench] {msg}");
    }
}
