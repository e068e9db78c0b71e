//! Parity of the three decode paths on the same seeded inputs: the f64 CPU
//! reference, the WGSL kernels on a wgpu adapter and the CUDA kernels
//! (`--features cuda`). Each case runs the whole pipeline on both GPU paths
//! from host inputs: write_kv into shuffled blocks, copy_blocks (one
//! sequence moved onto copies of its blocks, the originals then
//! overwritten), decode. Tolerance: relative L2 < 1e-5 for f32 KV, < 2e-3
//! for f16, between every pair.
//!
//! Without an NVIDIA driver the test says so and passes, unless
//! `PAGEDATTN_REQUIRE_CUDA=1`; a missing wgpu adapter follows
//! `PAGEDATTN_REQUIRE_GPU` as in the other GPU tests.
#![cfg(feature = "cuda")]

use pagedattn_test_support::common;

use common::*;
use pagedattn::cuda::{Cuda, CudaAttention, CudaError, CudaKvCache};
use pagedattn::gpu::{AttnOptions, Gpu, KvCache, KvCacheConfig, KvDtype, PagedAttention, Split};
use pagedattn::reference::{self, rel_l2, AttnParams};
use pagedattn::rng::SplitMix64;

/// The CUDA device, or `None` (skip) when CUDA is not there.
fn cuda() -> Option<Cuda> {
    match Cuda::new(0) {
        Ok(c) => {
            eprintln!("CUDA: {}", c.describe());
            Some(c)
        }
        Err(e) if e.is_unavailable() => {
            if std::env::var("PAGEDATTN_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
                panic!("PAGEDATTN_REQUIRE_CUDA=1 but CUDA: {e}");
            }
            eprintln!("CUDA: {e}, parity test skipped");
            None
        }
        Err(e) => panic!("CUDA is present but failed: {e}"),
    }
}

#[derive(Clone)]
struct Case {
    name: &'static str,
    block_size: u32,
    num_kv_heads: u32,
    group: u32,
    head_dim: u32,
    dtype: KvDtype,
    lens: Vec<usize>,
    opts: AttnOptions,
}

/// Everything a case feeds the three paths.
struct Inputs {
    cfg: KvCacheConfig,
    writes: Vec<(Vec<u32>, Vec<f32>, Vec<f32>)>,
    copies: Vec<[u32; 2]>,
    kv_indptr: Vec<u32>,
    kv_indices: Vec<u32>,
    seq_lens: Vec<u32>,
    q: Vec<f32>,
    num_heads: u32,
}

fn inputs(rng: &mut SplitMix64, c: &Case) -> Inputs {
    let first = c.lens[0].div_ceil(c.block_size as usize) as u32;
    let nb = blocks_for(&c.lens, c.block_size, first + 3);
    let (_m, _ids, view) = shuffled_batch(rng, nb, c.block_size, &c.lens);
    let cfg = KvCacheConfig::new(nb, c.block_size, c.num_kv_heads, c.head_dim)
        .with_layers(2)
        .with_dtype(c.dtype);
    let row = (c.num_kv_heads * c.head_dim) as usize;
    let mut writes = Vec::new();
    let slots = view.slot_mapping.clone();
    writes.push((
        slots.clone(),
        rng.signed_vec(slots.len() * row),
        rng.signed_vec(slots.len() * row),
    ));

    // Move sequence 0 onto copies of its blocks in free blocks, then
    // overwrite its original blocks: decode must read the copies.
    let (s0, s1) = (view.kv_indptr[0] as usize, view.kv_indptr[1] as usize);
    let used: std::collections::HashSet<u32> = view.kv_indices.iter().copied().collect();
    let mut free = (0..nb).filter(|b| !used.contains(b));
    let mut kv_indices = view.kv_indices.clone();
    let mut copies = Vec::new();
    for entry in &mut kv_indices[s0..s1] {
        let dst = free.next().expect("slack blocks for the copies");
        copies.push([*entry, dst]);
        *entry = dst;
    }
    let bs = c.block_size;
    let clobber: Vec<u32> = copies
        .iter()
        .flat_map(|&[src, _]| (0..bs).map(move |o| src * bs + o))
        .collect();
    writes.push((
        clobber.clone(),
        rng.signed_vec(clobber.len() * row),
        rng.signed_vec(clobber.len() * row),
    ));

    // An extra empty sequence: every path must write zeros for it.
    let mut kv_indptr = view.kv_indptr.clone();
    kv_indptr.push(*kv_indptr.last().unwrap());
    let mut seq_lens = view.seq_lens.clone();
    seq_lens.push(0);

    let num_heads = c.num_kv_heads * c.group;
    let q = rng
        .signed_vec(seq_lens.len() * (num_heads * c.head_dim) as usize)
        .iter()
        .map(|x| x * 2.0)
        .collect();
    Inputs {
        cfg,
        writes,
        copies,
        kv_indptr,
        kv_indices,
        seq_lens,
        q,
        num_heads,
    }
}

fn reference_out(c: &Case, inp: &Inputs) -> Vec<f64> {
    let cfg = &inp.cfg;
    let mut host = HostPool::new(
        cfg.num_blocks as usize,
        cfg.num_kv_heads as usize,
        cfg.block_size as usize,
        cfg.head_dim as usize,
    );
    host.write(
        &inp.writes[0].0,
        &inp.writes[0].1,
        &inp.writes[0].2,
        Stored::from(c.dtype),
    );
    for &[src, dst] in &inp.copies {
        host.copy(src, dst);
    }
    host.write(
        &inp.writes[1].0,
        &inp.writes[1].1,
        &inp.writes[1].2,
        Stored::from(c.dtype),
    );
    let mut p = AttnParams::new(inp.num_heads as usize, cfg.head_dim as usize);
    if let Some(s) = c.opts.scale {
        p.scale = s;
    }
    p.soft_cap = c.opts.soft_cap;
    p.sliding_window = c.opts.sliding_window;
    p.alibi_slopes = c.opts.alibi_slopes.clone();
    reference::decode(
        &host.view(),
        &p,
        &inp.q,
        &inp.kv_indptr,
        &inp.kv_indices,
        &inp.seq_lens,
    )
}

/// The pipeline on wgpu, in layer 1 (layer 0 gets the same writes, so the
/// per-layer copy is exercised too).
fn wgpu_out(gpu: &Gpu, inp: &Inputs, opts: &AttnOptions) -> Vec<f32> {
    let cache = KvCache::new(gpu, inp.cfg).unwrap();
    for layer in 0..2 {
        let (s, k, v) = &inp.writes[0];
        cache.write_kv(gpu, layer, k, v, s).unwrap();
    }
    cache.copy_blocks(gpu, &inp.copies).unwrap();
    for layer in 0..2 {
        let (s, k, v) = &inp.writes[1];
        cache.write_kv(gpu, layer, k, v, s).unwrap();
    }
    let attn = PagedAttention::new(gpu, &cache, inp.num_heads, &Default::default()).unwrap();
    attn.decode(
        gpu,
        &cache,
        1,
        &inp.q,
        &inp.kv_indptr,
        &inp.kv_indices,
        &inp.seq_lens,
        opts,
    )
    .unwrap()
}

fn cuda_out(cuda: &Cuda, inp: &Inputs, opts: &AttnOptions) -> Result<Vec<f32>, CudaError> {
    let mut cache = CudaKvCache::new(cuda, inp.cfg)?;
    for layer in 0..2 {
        let (s, k, v) = &inp.writes[0];
        cache.write_kv(cuda, layer, k, v, s)?;
    }
    cache.copy_blocks(cuda, &inp.copies)?;
    for layer in 0..2 {
        let (s, k, v) = &inp.writes[1];
        cache.write_kv(cuda, layer, k, v, s)?;
    }
    let attn = CudaAttention::new(cuda, &cache, inp.num_heads)?;
    attn.decode(
        cuda,
        &cache,
        1,
        &inp.q,
        &inp.kv_indptr,
        &inp.kv_indices,
        &inp.seq_lens,
        opts,
    )
}

fn check(cuda: &Cuda, gpu: Option<&Gpu>, c: &Case) {
    let s = seed(c.name);
    let mut rng = SplitMix64::new(s);
    let inp = inputs(&mut rng, c);
    let want = reference_out(c, &inp);
    let t = common::decode_tol(c.dtype);
    let got_cuda = cuda_out(cuda, &inp, &c.opts)
        .unwrap_or_else(|e| panic!("{}: CUDA failed: {e} (seed {s})", c.name));
    let err = rel_l2(&got_cuda, &want);
    eprintln!(
        "{}: CUDA vs reference rel L2 {err:.3e} (tolerance {t:.0e})",
        c.name
    );
    assert!(
        err < t,
        "{}: CUDA vs reference {err:.3e} >= {t:.0e} (seed {s})",
        c.name
    );
    let empty = &got_cuda[got_cuda.len() - (inp.num_heads * inp.cfg.head_dim) as usize..];
    assert!(
        empty.iter().all(|&x| x == 0.0),
        "{}: empty sequence not zero",
        c.name
    );

    let Some(gpu) = gpu else { return };
    let got_wgpu = wgpu_out(gpu, &inp, &c.opts);
    let err = rel_l2(&got_wgpu, &want);
    eprintln!("{}: wgpu vs reference rel L2 {err:.3e}", c.name);
    assert!(
        err < t,
        "{}: wgpu vs reference {err:.3e} >= {t:.0e} on {} (seed {s})",
        c.name,
        gpu.describe()
    );
    let as_f64: Vec<f64> = got_wgpu.iter().map(|&x| x as f64).collect();
    let err = rel_l2(&got_cuda, &as_f64);
    eprintln!("{}: CUDA vs wgpu rel L2 {err:.3e}", c.name);
    assert!(
        err < t,
        "{}: CUDA vs wgpu {err:.3e} >= {t:.0e} on {} (seed {s})",
        c.name,
        gpu.describe()
    );
}

fn cases() -> Vec<Case> {
    let plain = AttnOptions::default();
    let mut base = vec![
        Case {
            name: "f32 bs16 gqa4 d128 edges",
            block_size: 16,
            num_kv_heads: 2,
            group: 4,
            head_dim: 128,
            dtype: KvDtype::F32,
            lens: vec![17, 1, 15, 16, 300],
            opts: plain.clone(),
        },
        Case {
            name: "f16 bs8 gqa8 d64",
            block_size: 8,
            num_kv_heads: 1,
            group: 8,
            head_dim: 64,
            dtype: KvDtype::F16,
            lens: vec![9, 7, 8, 250],
            opts: plain.clone(),
        },
        Case {
            name: "f32 bs32 mha d80 variants",
            block_size: 32,
            num_kv_heads: 3,
            group: 1,
            head_dim: 80,
            dtype: KvDtype::F32,
            lens: vec![33, 100, 64],
            opts: AttnOptions {
                scale: Some(0.05),
                soft_cap: Some(30.0),
                sliding_window: Some(50),
                alibi_slopes: Some(vec![0.5, 0.25, 0.125]),
                ..Default::default()
            },
        },
        Case {
            name: "f16 bs16 gqa4 d256 long",
            block_size: 16,
            num_kv_heads: 1,
            group: 4,
            head_dim: 256,
            dtype: KvDtype::F16,
            lens: vec![40, 1800],
            opts: plain,
        },
    ];
    // Split-K on the CUDA twin: partitions of 64 tokens (some empty, some
    // cut by the window), merged by its own launch; and forced unsplit.
    let split = |c: &Case, name, split| Case {
        name,
        opts: AttnOptions {
            split,
            ..c.opts.clone()
        },
        ..c.clone()
    };
    let more = [
        split(&base[0], "f32 bs16 gqa4 d128 split 64", Split::Tokens(64)),
        split(
            &base[2],
            "f32 bs32 mha d80 variants split 64",
            Split::Tokens(64),
        ),
        split(&base[3], "f16 bs16 gqa4 d256 long unsplit", Split::Never),
    ];
    base.extend(more);
    base
}

#[test]
fn decode_parity_reference_wgpu_cuda() {
    let Some(cuda) = cuda() else { return };
    let gpu = gpu();
    for c in cases() {
        check(&cuda, gpu.as_ref(), &c);
    }
}

#[test]
fn cuda_rejects_bad_tables() {
    let Some(cuda) = cuda() else { return };
    let cfg = KvCacheConfig::new(4, 16, 1, 64);
    let cache = CudaKvCache::new(&cuda, cfg).unwrap();
    let attn = CudaAttention::new(&cuda, &cache, 2).unwrap();
    let q = vec![0.0; 2 * 64];
    let opts = AttnOptions::default();
    // A block outside the pool, and more tokens than the table holds.
    let e = attn.decode(&cuda, &cache, 0, &q, &[0, 1], &[4], &[3], &opts);
    assert!(matches!(e, Err(CudaError::InvalidArgument(_))), "{e:?}");
    let e = attn.decode(&cuda, &cache, 0, &q, &[0, 1], &[0], &[17], &opts);
    assert!(matches!(e, Err(CudaError::InvalidArgument(_))), "{e:?}");
}
