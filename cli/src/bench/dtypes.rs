//! `--only dtypes,cascade,copy`: decode per KV dtype, the cascade's rows, write and copy.

use super::*;

/// Decode of `batch` x `context` over f32, f16, int8 and fp8 pools, one
/// run of each in turn (interleaved), median of the runs.
pub(crate) fn dtype_rows(
    gpu: &Gpu,
    picks: &pagedattn::gpu::Tuner,
    timer: &Timer,
    rng: &mut SplitMix64,
    batch: u32,
    context: u32,
) -> Result<Vec<DtypeRow>, BenchError> {
    let all = [
        (KvDtype::F32, false),
        (KvDtype::F16, false),
        (KvDtype::Bf16, false),
        (KvDtype::Int8, false),
        (KvDtype::Fp8E4M3, false),
        (KvDtype::Int8, true),
        (KvDtype::Fp8E4M3, true),
    ];
    let mut rigs = Vec::new();
    for (dtype, outliers) in all {
        let Some(r) = rig(gpu, batch, context, dtype, rng)? else {
            continue;
        };
        if outliers {
            let chans: Vec<u32> = (0..KV_HEADS).flat_map(|_| [5, 42, 79, 116]).collect();
            for l in 0..r.layers {
                r.cache.set_k_outlier_channels(gpu, l, &chans)?;
            }
        }
        let name = match (dtype, outliers) {
            (KvDtype::Int8, true) => "int8+outliers",
            (KvDtype::Fp8E4M3, true) => "fp8+outliers",
            _ => dtype.name(),
        };
        let attn = attention(gpu, picks, &r.cache)?;
        let t = tables(batch, context, true, rng);
        let plan = decode_plan(gpu, &attn, &t, Split::Auto)?;
        rigs.push((name, r, attn, plan));
    }
    let ms = interleaved_medians(timer, rigs.len(), &mut |i, run, enc| {
        let (_, r, attn, plan) = &mut rigs[i];
        let layer = run as u32 % r.layers;
        attn.run(
            gpu,
            enc,
            plan,
            &r.cache,
            layer,
            0,
            &r.q.as_entire_buffer_binding(),
            &r.out.as_entire_buffer_binding(),
        )
    })?;
    let f16_block = KvCacheConfig::new(1, BLOCK, KV_HEADS, HEAD_DIM)
        .with_dtype(KvDtype::F16)
        .block_bytes() as f64;
    let mut rows: Vec<DtypeRow> = rigs
        .iter()
        .zip(&ms)
        .map(|((dtype, r, attn, _), &ms)| {
            let c = r.cache.config();
            DtypeRow {
                dtype,
                batch,
                context,
                kernel: attn.kernel().name(),
                ms,
                kv_bytes: (batch * context / BLOCK) as u64 * c.block_bytes(),
                block_bytes_over_f16: c.block_bytes() as f64 / f16_block,
                time_over_f16: 0.0,
            }
        })
        .collect();
    let f16_ms = rows
        .iter()
        .find(|r| r.dtype == "f16")
        .map_or(f64::NAN, |r| r.ms);
    for r in &mut rows {
        r.time_over_f16 = r.ms / f16_ms;
    }
    Ok(rows)
}

pub(crate) fn cascade_row(
    gpu: &Gpu,
    picks: &pagedattn::gpu::Tuner,
    timer: &Timer,
    rng: &mut SplitMix64,
    n: u32,
    prompt: u32,
) -> Result<Option<CascadeRow>, BenchError> {
    use pagedattn::gpu::{Cascade, DecodeTables};
    let private: Vec<u32> = (0..n).map(|_| rng.below(257) as u32).collect();
    let pblocks = prompt / BLOCK;
    let mut indptr = vec![0u32];
    let mut indices = Vec::new();
    let mut next = pblocks;
    let mut lens = Vec::new();
    for &p in &private {
        indices.extend(0..pblocks);
        let own = p.div_ceil(BLOCK).max(1);
        indices.extend(next..next + own);
        next += own;
        indptr.push(indices.len() as u32);
        lens.push(prompt + p.max(1));
    }
    let Some(cache) = filled_cache(gpu, next * BLOCK, KvDtype::F16, 1, rng)? else {
        return Ok(None);
    };
    let attn = attention(gpu, picks, &cache)?;
    let t = DecodeTables {
        kv_indptr: &indptr,
        kv_indices: &indices,
        seq_lens: &lens,
    };
    let mut plain = attn.plan();
    let off = AttnOptions {
        cascade: Cascade::Off,
        ..Default::default()
    };
    attn.plan_decode(gpu, &mut plain, &t, &[off])?;
    let mut cas = attn.plan();
    let on = AttnOptions {
        cascade: Cascade::On,
        ..Default::default()
    };
    attn.plan_decode(gpu, &mut cas, &t, &[on])?;
    let mut auto = attn.plan();
    attn.plan_decode(gpu, &mut auto, &t, &[AttnOptions::default()])?;
    let q = gpu.storage_init("q", &rng.signed_vec((n * HEADS * HEAD_DIM) as usize))?;
    let out = gpu.storage("out", (n * HEADS * HEAD_DIM * 4) as u64)?;
    let mut plans = [&mut plain, &mut cas];
    let t = interleaved_medians(timer, 2, &mut |i, _, enc| {
        attn.run(
            gpu,
            enc,
            plans[i],
            &cache,
            0,
            0,
            &q.as_entire_buffer_binding(),
            &out.as_entire_buffer_binding(),
        )
    })?;
    let (pm, cm) = (t[0], t[1]);
    Ok(Some(CascadeRow {
        n,
        prompt,
        private_mean: private.iter().map(|&p| p as f64).sum::<f64>() / n as f64,
        plain_ms: pm,
        cascade_ms: cm,
        speedup: pm / cm,
        plain_bytes: plain.kv_bytes_per_layer(),
        cascade_bytes: cas.kv_bytes_per_layer(),
        used: cas.cascade().is_some(),
        auto_uses: auto.cascade().is_some(),
        kernel: attn.kernel().name(),
    }))
}

pub(crate) fn write_and_copy(
    gpu: &Gpu,
    timer: &Timer,
    rng: &mut SplitMix64,
) -> Result<(f64, f64, f64, f64), BenchError> {
    let blocks = 1024u32;
    let cache = filled_cache(gpu, blocks * BLOCK, KvDtype::F32, 1, rng)?
        .ok_or_else(|| BenchError::Config("bench pool does not fit".into()))?;
    let ntok = 256u32;
    let row = (KV_HEADS * HEAD_DIM) as usize;
    let k = gpu.storage_init("k", &rng.signed_vec(ntok as usize * row))?;
    let v = gpu.storage_init("v", &rng.signed_vec(ntok as usize * row))?;
    let mut slots: Vec<u32> = (0..blocks * BLOCK).collect();
    rng.shuffle(&mut slots);
    slots.truncate(ntok as usize);
    let mut plan = cache.plan();
    cache.plan_write(gpu, &mut plan, &slots, &[])?;
    let mut err = None;
    let ms = timer.median(|_, enc| {
        let (k, v) = (k.as_entire_buffer_binding(), v.as_entire_buffer_binding());
        if let Err(e) = cache.run_write_kv(gpu, enc, &mut plan, 0, &k, &v) {
            err = Some(e);
        }
    })?;
    let wk_tps = ntok as f64 / ms * 1e3;
    let wk_gbs = 2.0 * (ntok as usize * row * 4) as f64 / ms / 1e6;
    let ncopies = 256u32;
    let mut ids: Vec<u32> = (0..blocks).collect();
    rng.shuffle(&mut ids);
    let copies: Vec<[u32; 2]> = (0..ncopies as usize)
        .map(|i| [ids[2 * i], ids[2 * i + 1]])
        .collect();
    cache.plan_write(gpu, &mut plan, &[], &copies)?;
    let ms_c = timer.median(|_, enc| {
        if let Err(e) = cache.run_copy_blocks(gpu, enc, &mut plan) {
            err = Some(e);
        }
    })?;
    if let Some(e) = err {
        return Err(e.into());
    }
    // K and V of every layer.
    let block_bytes = cache.config().block_bytes() as f64 * cache.config().num_layers as f64;
    Ok((
        wk_tps,
        wk_gbs,
        ncopies as f64 / ms_c * 1e3,
        ncopies as f64 * block_bytes / ms_c / 1e6,
    ))
}
