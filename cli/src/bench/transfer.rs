//! `--only swap,transfer`: swap and export/import rates, and a remote prefix's time to first token.

use super::*;

/// The pool the swap and transfer rates move blocks of: 4 layers, 256
/// blocks of the grid's shape, f16.
pub(crate) fn transfer_pool(gpu: &Gpu) -> Result<KvCache, GpuError> {
    KvCache::new(
        gpu,
        KvCacheConfig::new(256, BLOCK, KV_HEADS, HEAD_DIM)
            .with_layers(4)
            .with_dtype(KvDtype::F16),
    )
}

/// The median of `v` (sorted in place).
pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Swap-out and swap-in throughput (GB/s, wall clock, median of 5) of 128
/// scattered blocks of a 4-layer f16 pool of the grid's shape.
pub(crate) fn swap_rates(gpu: &Gpu) -> Result<(f64, f64), GpuError> {
    let cache = transfer_pool(gpu)?;
    let mut space = cache.swap_space(128)?;
    // Every other block: no runs to coalesce (the worst case).
    let out: Vec<[u32; 2]> = (0..128).map(|i| [i * 2, i]).collect();
    let back: Vec<[u32; 2]> = (0..128).map(|i| [i, i * 2 + 1]).collect();
    let bytes = 128.0 * space.block_bytes() as f64;
    let (mut to, mut ti) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = std::time::Instant::now();
        cache.swap_out(gpu, &out, &mut space)?;
        to.push(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        cache.swap_in(gpu, &back, &space)?;
        gpu.wait()?;
        ti.push(t.elapsed().as_secs_f64());
    }
    Ok((bytes / median(&mut to) / 1e9, bytes / median(&mut ti) / 1e9))
}

/// Export and import throughput (GB/s, wall clock, median of 5) of 128
/// scattered blocks of every layer of the swap bench's pool, into other
/// block ids.
pub(crate) fn transfer_rates(gpu: &Gpu) -> Result<(f64, f64), GpuError> {
    let cache = transfer_pool(gpu)?;
    let from: Vec<u32> = (0..128).map(|i| i * 2).collect();
    let to: Vec<u32> = (0..128).map(|i| i * 2 + 1).collect();
    let mut bytes = vec![0u8; cache.export_bytes(from.len(), 0..4)? as usize];
    let (mut te, mut ti) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = std::time::Instant::now();
        let layout = cache.export_blocks(gpu, &from, 0..4, &mut bytes)?;
        te.push(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        cache.import_blocks(gpu, &layout, &bytes, &to)?;
        gpu.wait()?;
        ti.push(t.elapsed().as_secs_f64());
    }
    let n = bytes.len() as f64;
    Ok((n / median(&mut te) / 1e9, n / median(&mut ti) / 1e9))
}

/// Time to first token of the attention path, 4 layers of the grid's
/// shape: a prompt of `total` tokens whose first `shared` tokens are a
/// prefix another engine computed. Cold: every token's K/V written and
/// the whole prompt's prefill attention, per layer. Remote hit: the
/// prefix's blocks imported (bytes exported from a pool that computed
/// them), then only the suffix written and attended. Best of 3, wall
/// clock, the output read back each layer.
pub(crate) fn remote_ttft(
    gpu: &Gpu,
    total: usize,
    shared: usize,
    rng: &mut SplitMix64,
) -> Result<(f64, f64), GpuError> {
    let layers = 4u32;
    let nb = total.div_ceil(BLOCK as usize) as u32;
    let cfg = KvCacheConfig::new(nb, BLOCK, KV_HEADS, HEAD_DIM)
        .with_layers(layers)
        .with_dtype(KvDtype::F16);
    let (a, b) = (KvCache::new(gpu, cfg)?, KvCache::new(gpu, cfg)?);
    let attn = PagedAttention::new(gpu, &a, HEADS, &Default::default())?;
    let row = (KV_HEADS * HEAD_DIM) as usize;
    let (k, v) = (rng.signed_vec(total * row), rng.signed_vec(total * row));
    let q = rng.signed_vec(total * (HEADS * HEAD_DIM) as usize);
    let table: Vec<u32> = (0..nb).collect();
    let slots: Vec<u32> = (0..total as u32).collect();
    let opts = AttnOptions::default();
    let shared_blocks = shared / BLOCK as usize;
    let prefix = shared_blocks * BLOCK as usize;
    // The exporter computed the prefix.
    for l in 0..layers {
        a.write_kv(
            gpu,
            l,
            &k[..prefix * row],
            &v[..prefix * row],
            &slots[..prefix],
        )?;
    }
    let blocks: Vec<u32> = (0..shared_blocks as u32).collect();
    let mut bytes = vec![0u8; a.export_bytes(blocks.len(), 0..layers)? as usize];
    let layout = a.export_blocks(gpu, &blocks, 0..layers, &mut bytes)?;
    let run = |from: usize| -> Result<f64, GpuError> {
        let t = std::time::Instant::now();
        if from > 0 {
            b.import_blocks(gpu, &layout, &bytes, &blocks)?;
        }
        let n = total - from;
        for l in 0..layers {
            b.write_kv(gpu, l, &k[from * row..], &v[from * row..], &slots[from..])?;
            attn.prefill(
                gpu,
                &b,
                l,
                &q[from * (HEADS * HEAD_DIM) as usize..],
                &[0, n as u32],
                &[0, nb],
                &table,
                &[total as u32],
                &opts,
            )?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    let (mut cold, mut hit) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..3 {
        cold = cold.min(run(0)?);
        hit = hit.min(run(prefix)?);
    }
    Ok((cold, hit))
}
