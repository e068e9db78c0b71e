//! `--only mla`: MLA decode against GQA decode over the same bytes.

use super::*;

/// MLA decode (DeepSeek-V2-Lite: 16 heads over a bf16 latent row of
/// 512 + 64) against the grid's GQA decode (bf16 K/V) over the same bytes
/// of cache: the GQA context is shorter by the ratio of bytes per token.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MlaRow {
    /// Sequences.
    pub batch: u32,
    /// Tokens per sequence, MLA.
    pub mla_context: u32,
    /// Tokens per sequence, GQA.
    pub gqa_context: u32,
    /// Cache bytes each reads per step (one layer).
    pub bytes: u64,
    /// Median ms, MLA.
    pub mla_ms: f64,
    /// Median ms, GQA.
    pub gqa_ms: f64,
    /// Split-K partitions of the MLA plan.
    pub mla_partitions: u32,
}

/// The MLA row: both decodes measured interleaved.
pub(crate) fn mla_row(
    gpu: &Gpu,
    picks: &pagedattn::gpu::Tuner,
    timer: &Timer,
    rng: &mut SplitMix64,
    quick: bool,
) -> Result<MlaRow, BenchError> {
    use pagedattn::gpu::{MlaAttention, MlaCache, MlaCacheConfig};
    let (batch, gqa_context) = if quick { (4, 512) } else { (16, 2048) };
    let gqa_token = (KV_HEADS * HEAD_DIM * 2 * 2) as u64;
    let mcfg = MlaCacheConfig::deepseek(1, 1);
    let mla_token = mcfg.block_bytes() / mcfg.block_size as u64;
    let mla_context = (gqa_context as u64 * gqa_token / mla_token) as u32;
    let mcfg = MlaCacheConfig {
        num_blocks: batch * mla_context.div_ceil(mcfg.block_size),
        ..mcfg
    };
    let mla_cache = MlaCache::new(gpu, mcfg)?;
    let per_seq = mla_context.div_ceil(mcfg.block_size);
    let mut ids: Vec<u32> = (0..mcfg.num_blocks).collect();
    rng.shuffle(&mut ids);
    let mut mla_tables: Vec<Vec<u32>> = ids.chunks(per_seq as usize).map(|c| c.to_vec()).collect();
    mla_tables.truncate(batch as usize);
    for t in &mla_tables {
        let slots: Vec<u32> = (0..mla_context)
            .map(|p| t[(p / mcfg.block_size) as usize] * mcfg.block_size + p % mcfg.block_size)
            .collect();
        mla_cache.write(
            gpu,
            0,
            &slots,
            &rng.signed_vec(slots.len() * mcfg.row_elems() as usize),
        )?;
    }
    let heads = 16;
    let mla = MlaAttention::new(gpu, &mla_cache, heads, 1.0 / 192f32.sqrt())?;
    let refs: Vec<&[u32]> = mla_tables.iter().map(|t| t.as_slice()).collect();
    let mut plan = mla.plan();
    mla.plan_decode_slices(
        gpu,
        &mut plan,
        &refs,
        &vec![mla_context; batch as usize],
        Split::Auto,
    )?;
    let mq = gpu.storage_init(
        "mla q",
        &rng.signed_vec((batch as u64 * mla.q_row_elems()) as usize),
    )?;
    let mout = gpu.storage("mla out", batch as u64 * mla.out_row_elems() * 4)?;

    let Some(cache) = filled_cache(gpu, batch * gqa_context, KvDtype::Bf16, 1, rng)? else {
        return Err(BenchError::Config(
            "the GQA pool does not fit this adapter".into(),
        ));
    };
    let attn = attention(gpu, picks, &cache)?;
    let t = tables(batch, gqa_context, true, rng);
    let mut gplan = decode_plan(gpu, &attn, &t, Split::Auto)?;
    let gq = gpu.storage_init(
        "gqa q",
        &rng.signed_vec((batch * HEADS * HEAD_DIM) as usize),
    )?;
    let gout = gpu.storage("gqa out", (batch * HEADS * HEAD_DIM * 4) as u64)?;
    let ms = interleaved_medians(timer, 2, &mut |i, _run, enc| {
        if i == 0 {
            mla.run(
                gpu,
                enc,
                &mut plan,
                &mla_cache,
                0,
                0,
                &mq.as_entire_buffer_binding(),
                &mout.as_entire_buffer_binding(),
            )
        } else {
            attn.run(
                gpu,
                enc,
                &mut gplan,
                &cache,
                0,
                0,
                &gq.as_entire_buffer_binding(),
                &gout.as_entire_buffer_binding(),
            )
        }
    })?;
    Ok(MlaRow {
        batch,
        mla_context,
        gqa_context,
        bytes: batch as u64 * mla_context as u64 * mla_token,
        mla_ms: ms[0],
        gqa_ms: ms[1],
        mla_partitions: plan.partitions(0),
    })
}
