//! Paged chunked prefill on a real adapter against the f64 reference: a
//! chunk of new queries per sequence (their K/V already in the pool)
//! attending causally to the whole paged context. Mixed batches of context
//! and chunk lengths, shuffled blocks, output poisoned, f32 and packed f16.

use crate::common;

use common::*;
use pagedattn::gpu::{AttnOptions, Gpu, KvCache, KvCacheConfig, KvDtype, PagedAttention, Split};
use pagedattn::reference::{self, rel_l2};
use pagedattn::rng::SplitMix64;

struct Case {
    block_size: u32,
    num_kv_heads: u32,
    group: u32,
    head_dim: u32,
    dtype: KvDtype,
    /// (context length including the chunk, chunk length)
    seqs: Vec<(usize, usize)>,
    opts: AttnOptions,
}

fn run(gpu: &Gpu, seed: u64, c: &Case) -> f64 {
    let mut rng = SplitMix64::new(seed);
    let lens: Vec<usize> = c.seqs.iter().map(|s| s.0).collect();
    let kv = (c.num_kv_heads, c.head_dim);
    let FilledPool { view, cache, host } =
        filled_pool(gpu, &mut rng, &lens, c.block_size, 5, kv, c.dtype);
    let num_heads = c.num_kv_heads * c.group;
    let attn = PagedAttention::new(gpu, &cache, num_heads, &Default::default()).unwrap();
    let mut qo = vec![0u32];
    for s in &c.seqs {
        qo.push(qo.last().unwrap() + s.1 as u32);
    }
    let q = rng.signed_vec(*qo.last().unwrap() as usize * (num_heads * c.head_dim) as usize);
    let out = attn
        .prefill(
            gpu,
            &cache,
            0,
            &q,
            &qo,
            &view.kv_indptr,
            &view.kv_indices,
            &view.seq_lens,
            &c.opts,
        )
        .unwrap();
    let p = ref_params(num_heads, c.head_dim, &c.opts);
    let want = reference::prefill(
        &host.view(),
        &p,
        &q,
        &qo,
        &view.kv_indptr,
        &view.kv_indices,
        &view.seq_lens,
    );
    rel_l2(&out, &want)
}

fn check(name: &str, c: Case) {
    let Some(gpu) = gpu() else { return };
    let s = seed(name);
    let err = run(&gpu, s, &c);
    // f32 and bf16 (a mirror of the rounded values, widened exactly): f32
    // accumulation only; f16 2e-3.
    let t = match c.dtype {
        KvDtype::F32 | KvDtype::Bf16 => 1e-5,
        _ => 2e-3,
    };
    eprintln!("{name}: rel L2 {err:.3e} (tolerance {t:.0e})");
    assert!(
        err < t,
        "{name}: rel L2 {err:.3e} >= {t:.0e} on {} (seed {s})",
        gpu.describe()
    );
}

fn case(bs: u32, kvh: u32, group: u32, hd: u32, dtype: KvDtype, seqs: &[(usize, usize)]) -> Case {
    Case {
        block_size: bs,
        num_kv_heads: kvh,
        group,
        head_dim: hd,
        dtype,
        seqs: seqs.to_vec(),
        opts: AttnOptions::default(),
    }
}

#[test]
fn whole_prompts_and_chunks_mixed() {
    // Whole prompts (chunk == context), chunks after a cached context, single
    // queries (decode as prefill), chunks crossing block edges.
    let seqs = [(1, 1), (17, 17), (40, 9), (100, 1), (200, 64), (333, 70)];
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let shapes = [(16, 1, 64), (8, 4, 128), (32, 8, 80)];
        for (bs, group, hd) in grid("prefill shapes", &shapes, &[1]) {
            check(
                &format!("prefill bs{bs} g{group} hd{hd} {dtype:?}"),
                case(bs, 2, group, hd, dtype, &seqs),
            );
        }
    }
}

/// Prefill with attention sinks, unsplit and split-KV.
#[test]
fn prefill_with_sinks() {
    let seqs = [(1, 1), (40, 9), (333, 70)];
    let sinks: Vec<f32> = (0..8).map(|h| 1.0 - h as f32 * 0.5).collect();
    for split in [Split::Never, Split::Auto] {
        let mut c = case(16, 2, 4, 64, KvDtype::F32, &seqs);
        c.opts.sinks = Some(sinks.clone());
        c.opts.split = split;
        check(&format!("prefill sinks {split:?}"), c);
    }
}

/// Prefill with StreamingLLM sink tokens beside a window, unsplit and
/// split-KV: each query row sees the first 5 positions and its own window
/// (the tile walks the sinks and its first row's window as one run).
#[test]
fn prefill_with_sink_tokens() {
    let seqs = [(1, 1), (40, 9), (333, 70), (700, 33)];
    for split in [Split::Never, Split::Auto] {
        let mut c = case(16, 2, 4, 64, KvDtype::F16, &seqs);
        c.opts.sink_tokens = Some(5);
        c.opts.sliding_window = Some(50);
        c.opts.split = split;
        check(&format!("prefill sink tokens {split:?}"), c);
    }
}

/// Prefill over a bf16 pool: whole prompts, chunks after a context, a
/// single query.
#[test]
fn prefill_bf16() {
    let seqs = [(1, 1), (40, 9), (333, 70)];
    check("prefill bf16", case(16, 2, 4, 128, KvDtype::Bf16, &seqs));
}

#[test]
fn prefill_variants() {
    let seqs = [(50, 50), (300, 120), (129, 3)];
    let slopes: Vec<f32> = (0..8).map(|h| 2f32.powf(-0.5 * (h as f32 + 1.0))).collect();
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let mut c = case(16, 2, 4, 64, dtype, &seqs);
        c.opts.sliding_window = Some(33);
        check(&format!("prefill window {dtype:?}"), c);
        let mut c = case(16, 2, 4, 64, dtype, &seqs);
        c.opts.alibi_slopes = Some(slopes.clone());
        check(&format!("prefill alibi {dtype:?}"), c);
        let mut c = case(16, 2, 4, 64, dtype, &seqs);
        c.opts.soft_cap = Some(0.3);
        c.opts.scale = Some(1.5);
        check(&format!("prefill soft-cap + scale {dtype:?}"), c);
    }
}

#[test]
fn prefill_rejects_bad_query_offsets() {
    let Some(gpu) = gpu() else { return };
    let cfg = KvCacheConfig::new(4, 16, 1, 64);
    let cache = KvCache::new(&gpu, cfg).unwrap();
    let attn = PagedAttention::new(&gpu, &cache, 2, &Default::default()).unwrap();
    let q = vec![0.0; 3 * 2 * 64];
    // Three queries for a sequence of two tokens.
    let e = attn
        .prefill(
            &gpu,
            &cache,
            0,
            &q,
            &[0, 3],
            &[0, 1],
            &[0],
            &[2],
            &AttnOptions::default(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("3 queries"), "{e}");
    let e = attn
        .prefill(
            &gpu,
            &cache,
            0,
            &q,
            &[0],
            &[0, 1],
            &[0],
            &[3],
            &AttnOptions::default(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("qo_indptr"), "{e}");
}

/// Split-KV prefill: long contexts with short chunks split the KV range into
/// partitions merged by log-sum-exp (Split::Auto on a small batch), and
/// must match the reference as the unsplit pass does, with the variants.
#[test]
fn split_kv_prefill() {
    use pagedattn::gpu::Split;
    let seqs = [(2000, 8), (1500, 40), (30, 30), (1100, 1)];
    let slopes: Vec<f32> = (0..8).map(|h| 2f32.powf(-0.5 * (h as f32 + 1.0))).collect();
    for dtype in [KvDtype::F32, KvDtype::F16] {
        for split in [Split::Auto, Split::Never] {
            let mut c = case(16, 2, 4, 64, dtype, &seqs);
            c.opts.split = split;
            check(&format!("prefill {split:?} {dtype:?}"), c);
        }
        let mut c = case(16, 2, 4, 64, dtype, &seqs);
        c.opts.sliding_window = Some(700);
        c.opts.alibi_slopes = Some(slopes.clone());
        c.opts.soft_cap = Some(20.0);
        check(&format!("prefill split + variants {dtype:?}"), c);
    }
}

/// A 65600-token context: past the loop cap of llvmpipe for one pass (it
/// returned NaN before split-KV prefill); on other adapters the split comes
/// from occupancy.
#[test]
fn prefill_at_65k_tokens_of_context() {
    check(
        "prefill 65600",
        case(16, 1, 2, 64, KvDtype::F16, &[(65600, 16), (40, 5)]),
    );
}

/// The split-KV tests above reach the split path: a plan of those tables
/// splits under Split::Auto and not under Split::Never.
#[test]
fn split_kv_prefill_is_chosen_for_long_contexts() {
    use pagedattn::gpu::{PrefillTables, Split};
    let Some(gpu) = gpu() else { return };
    let cfg = KvCacheConfig::new(300, 16, 2, 64);
    let cache = KvCache::new(&gpu, cfg).unwrap();
    let attn = PagedAttention::new(&gpu, &cache, 8, &Default::default()).unwrap();
    let (lens, qo) = ([2000u32, 1500], [0u32, 8, 48]);
    let indptr = [0u32, 125, 219];
    let ids: Vec<u32> = (0..219).collect();
    let t = PrefillTables {
        kv_indptr: &indptr,
        kv_indices: &ids,
        seq_lens: &lens,
        qo_indptr: &qo,
    };
    let mut plan = attn.plan();
    for (split, want) in [(Split::Auto, true), (Split::Never, false)] {
        let o = AttnOptions {
            split,
            ..Default::default()
        };
        attn.plan_prefill(&gpu, &mut plan, &t, &[o]).unwrap();
        assert_eq!(plan.splits(), want, "{split:?}");
    }
}
