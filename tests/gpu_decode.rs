//! Paged decode on a real adapter against the f64 reference: fresh random
//! inputs (seed printed), shuffled physical blocks, output poisoned (NaN)
//! before each run. Tolerance: relative L2 < 1e-5 for f32 KV, < 2e-3 for f16.

mod common;

use common::*;
use pagedattn::gpu::{AttnOptions, Gpu, KvCache, KvCacheConfig, KvDtype, PagedAttention, Split};
use pagedattn::reference::{self, rel_l2, AttnParams};
use pagedattn::rng::SplitMix64;

struct Case {
    block_size: u32,
    num_kv_heads: u32,
    group: u32,
    head_dim: u32,
    dtype: KvDtype,
    lens: Vec<usize>,
    opts: AttnOptions,
}

fn tol(d: KvDtype) -> f64 {
    match d {
        KvDtype::F32 => 1e-5,
        KvDtype::F16 => 2e-3,
    }
}

/// Runs one case and returns the relative L2 error.
fn run(gpu: &Gpu, seed: u64, c: &Case) -> f64 {
    let mut rng = SplitMix64::new(seed);
    let nb = blocks_for(&c.lens, c.block_size, 7);
    let (_m, _ids, view) = shuffled_batch(&mut rng, nb, c.block_size, &c.lens);
    let cfg = KvCacheConfig {
        num_layers: 1,
        num_blocks: nb,
        block_size: c.block_size,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        dtype: c.dtype,
    };
    let cache = KvCache::new(gpu, cfg).unwrap();
    let row = (c.num_kv_heads * c.head_dim) as usize;
    let ntok = view.slot_mapping.len();
    let k = rng.signed_vec(ntok * row);
    let v = rng.signed_vec(ntok * row);
    cache.write_kv(gpu, 0, &k, &v, &view.slot_mapping).unwrap();
    let mut host = HostPool::new(
        nb as usize,
        c.num_kv_heads as usize,
        c.block_size as usize,
        c.head_dim as usize,
    );
    host.write(&view.slot_mapping, &k, &v, c.dtype);

    let num_heads = c.num_kv_heads * c.group;
    let attn = PagedAttention::new(gpu, &cache, num_heads).unwrap();
    let q: Vec<f32> = rng
        .signed_vec(c.lens.len() * (num_heads * c.head_dim) as usize)
        .iter()
        .map(|x| x * 2.0)
        .collect();
    let out = attn
        .decode(
            gpu,
            &cache,
            0,
            &q,
            &view.kv_indptr,
            &view.kv_indices,
            &view.seq_lens,
            &c.opts,
        )
        .unwrap();
    let mut p = AttnParams::new(num_heads as usize, c.head_dim as usize);
    if let Some(s) = c.opts.scale {
        p.scale = s;
    }
    p.soft_cap = c.opts.soft_cap;
    p.sliding_window = c.opts.sliding_window;
    p.alibi_slopes = c.opts.alibi_slopes.clone();
    let want = reference::decode(
        &host.view(),
        &p,
        &q,
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
    let t = tol(c.dtype);
    eprintln!("{name}: rel L2 {err:.3e} (tolerance {t:.0e})");
    assert!(
        err < t,
        "{name}: rel L2 {err:.3e} >= {t:.0e} on {} (seed {s})",
        gpu.describe()
    );
}

fn case(
    block_size: u32,
    kvh: u32,
    group: u32,
    head_dim: u32,
    dtype: KvDtype,
    lens: &[usize],
) -> Case {
    Case {
        block_size,
        num_kv_heads: kvh,
        group,
        head_dim,
        dtype,
        lens: lens.to_vec(),
        opts: AttnOptions {
            split: Split::Never,
            ..Default::default()
        },
    }
}

#[test]
fn edge_lengths_f32() {
    for bs in [8, 16, 32] {
        let lens = [
            1,
            bs as usize - 1,
            bs as usize,
            bs as usize + 1,
            3 * bs as usize + 5,
        ];
        check(
            &format!("edge bs{bs}"),
            case(bs, 2, 4, 64, KvDtype::F32, &lens),
        );
    }
}

#[test]
fn gqa_ratios_and_head_dims() {
    for (group, hd) in [(1, 64), (4, 80), (8, 96), (4, 128), (1, 256), (8, 256)] {
        check(
            &format!("group {group} head_dim {hd}"),
            case(16, 2, group, hd, KvDtype::F32, &[17, 40, 1, 99]),
        );
    }
}

#[test]
fn long_context_f32() {
    check(
        "long 1500",
        case(16, 1, 4, 128, KvDtype::F32, &[1500, 1031]),
    );
}

#[test]
fn mixed_batch_f16() {
    check(
        "f16 mixed",
        case(16, 2, 4, 128, KvDtype::F16, &[1, 15, 16, 17, 300, 1200]),
    );
    check(
        "f16 bs8 gqa8",
        case(8, 1, 8, 64, KvDtype::F16, &[7, 8, 9, 250]),
    );
}
