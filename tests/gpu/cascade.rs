//! Cascade decode (shared prefixes read once) on a real adapter against the
//! f64 reference: random copy-on-write trees of block tables (parallel
//! samples of one prompt, beams forking at random depths, a system prompt
//! shared across requests, sequences of very different lengths), with
//! scale, soft-cap, ALiBi, a sliding window cutting through shared segments
//! and RELEASED entries; every decode kernel for the suffixes; f32 (< 1e-5)
//! and f16 (< 2e-3); output poisoned first. The cascade output must also
//! match plain decode, and the plan must report fewer K/V bytes.

use crate::common;

use common::*;
use pagedattn::blocks::RELEASED;
use pagedattn::gpu::{
    find_segments, ActDtype, AttnOptions, Cascade, DecodeTables, Gpu, Kernel, KvCache,
    KvCacheConfig, KvDtype, PagedAttention, Split,
};
use pagedattn::reference::{self, rel_l2, AttnParams};
use pagedattn::rng::SplitMix64;

const KVH: u32 = 2;
const GROUP: u32 = 4;
const HD: u32 = 64;
const BS: u32 = 16;

/// A random tree: `roots` prompts; each sequence picks an existing node to
/// fork from (sharing its ancestors' blocks) and adds private blocks.
/// Returns (kv_indptr, kv_indices, seq_lens, blocks used).
fn random_tree(
    rng: &mut SplitMix64,
    num_seqs: usize,
    roots: usize,
) -> (Vec<u32>, Vec<u32>, Vec<u32>, u32) {
    let mut next = 0u32;
    let mut alloc = |n: usize| -> Vec<u32> {
        let v: Vec<u32> = (next..next + n as u32).collect();
        next += n as u32;
        v
    };
    // Nodes: (parent, own blocks).
    let mut nodes: Vec<(Option<usize>, Vec<u32>)> = Vec::new();
    for _ in 0..roots {
        let n = rng.range(2, 9) as usize;
        nodes.push((None, alloc(n)));
    }
    let mut tables = Vec::new();
    for _ in 0..num_seqs {
        let parent = rng.below(nodes.len() as u64) as usize;
        let own = alloc(rng.range(0, 4) as usize + 1);
        nodes.push((Some(parent), own.clone()));
        // Path from the root.
        let mut path = Vec::new();
        let mut cur = Some(parent);
        while let Some(c) = cur {
            path.push(c);
            cur = nodes[c].0;
        }
        let mut table: Vec<u32> = Vec::new();
        for &c in path.iter().rev() {
            table.extend_from_slice(&nodes[c].1);
        }
        table.extend_from_slice(&own);
        tables.push(table);
    }
    let mut indptr = vec![0u32];
    let mut indices = Vec::new();
    let mut lens = Vec::new();
    for t in &tables {
        indices.extend_from_slice(t);
        indptr.push(indices.len() as u32);
        // The last block is partly filled, at least one token.
        lens.push((t.len() as u32 - 1) * BS + 1 + rng.below(BS as u64) as u32);
    }
    (indptr, indices, lens, next)
}

struct Batch {
    cache: KvCache,
    host: HostPool,
    indptr: Vec<u32>,
    indices: Vec<u32>,
    lens: Vec<u32>,
    /// Query heads.
    heads: u32,
}

fn batch(gpu: &Gpu, rng: &mut SplitMix64, dtype: KvDtype, seqs: usize, roots: usize) -> Batch {
    batch_with(gpu, rng, dtype, seqs, roots, |_| {})
}

/// [`batch`], with `prepare` run on the pool before anything is written.
fn batch_with(
    gpu: &Gpu,
    rng: &mut SplitMix64,
    dtype: KvDtype,
    seqs: usize,
    roots: usize,
    prepare: impl FnOnce(&KvCache),
) -> Batch {
    batch_shaped(gpu, rng, dtype, seqs, roots, (KVH, GROUP, HD), prepare)
}

/// [`batch_with`] for a head shape (KV heads, GQA group, head_dim).
fn batch_shaped(
    gpu: &Gpu,
    rng: &mut SplitMix64,
    dtype: KvDtype,
    seqs: usize,
    roots: usize,
    (kvh, group, hd): (u32, u32, u32),
    prepare: impl FnOnce(&KvCache),
) -> Batch {
    let (indptr, indices, lens, nb) = random_tree(rng, seqs, roots);
    let cfg = KvCacheConfig::new(nb, BS, kvh, hd).with_dtype(dtype);
    let cache = KvCache::new(gpu, cfg).unwrap();
    prepare(&cache);
    let slots: Vec<u32> = (0..nb * BS).collect();
    let row = (kvh * hd) as usize;
    let k = rng.signed_vec(slots.len() * row);
    let v = rng.signed_vec(slots.len() * row);
    cache.write_kv(gpu, 0, &k, &v, &slots).unwrap();
    let mut host = HostPool::new(nb as usize, kvh as usize, BS as usize, hd as usize);
    host.write(&slots, &k, &v, Stored::from(dtype));
    Batch {
        cache,
        host,
        indptr,
        indices,
        lens,
        heads: kvh * group,
    }
}

/// One decode through the plan API: (output, the plan's cascade report).
fn run(
    gpu: &Gpu,
    b: &Batch,
    kernel: Kernel,
    q: &[f32],
    o: &AttnOptions,
) -> (Vec<f32>, Option<(u64, u64, usize)>) {
    run_with(gpu, b, kernel, ActDtype::F32, q, f32::NAN, o)
}

/// One cascade run's checks: it took the cascade (segments, fewer K/V
/// bytes than plain decode) and its output is within `tol` of `want`.
fn assert_cascade(
    what: &str,
    (out, rep): (Vec<f32>, Option<(u64, u64, usize)>),
    want: &[f64],
    tol: f64,
    seed: u64,
) {
    let (cb, pb, segs) = rep.expect("a tree with shared blocks runs the cascade");
    assert!(segs > 0 && cb < pb, "{what}: {cb} >= {pb} bytes");
    let e = rel_l2(&out, want);
    eprintln!(
        "{what}: rel L2 {e:.3e}, {segs} segments, K/V bytes {:.2} of plain",
        cb as f64 / pb as f64
    );
    assert!(e < tol, "{what}: rel L2 {e:.3e} (seed {seed})");
}

/// [`run`] with bf16 activations: Q given as bf16, the output read as bf16.
fn run_bf16(
    gpu: &Gpu,
    b: &Batch,
    kernel: Kernel,
    q: &[half::bf16],
    o: &AttnOptions,
) -> (Vec<f32>, Option<(u64, u64, usize)>) {
    // 0xffff is a bf16 NaN.
    let nan = half::bf16::from_bits(0xffff);
    let (out, rep) = run_with(gpu, b, kernel, ActDtype::Bf16, q, nan, o);
    (out.iter().map(|x| x.to_f32()).collect(), rep)
}

/// One decode with activations `act` of element type `T`, the output
/// filled with `poison` first.
fn run_with<T: bytemuck::Pod>(
    gpu: &Gpu,
    b: &Batch,
    kernel: Kernel,
    act: ActDtype,
    q: &[T],
    poison: T,
    o: &AttnOptions,
) -> (Vec<T>, Option<(u64, u64, usize)>) {
    let attn = PagedAttention::new(
        gpu,
        &b.cache,
        b.heads,
        &pagedattn::gpu::AttentionConfig::new().kernel(kernel),
    )
    .unwrap();
    let mut plan = attn.plan();
    plan.set_activations(act);
    let t = DecodeTables {
        kv_indptr: &b.indptr,
        kv_indices: &b.indices,
        seq_lens: &b.lens,
    };
    attn.plan_decode(gpu, &mut plan, &t, std::slice::from_ref(o))
        .unwrap();
    let report = plan.cascade();
    let qb = gpu.storage_init("q", q).unwrap();
    let out = gpu.storage_init("out", &vec![poison; q.len()]).unwrap();
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    attn.run(
        gpu,
        &mut enc,
        &mut plan,
        &b.cache,
        0,
        0,
        &qb.as_entire_buffer_binding(),
        &out.as_entire_buffer_binding(),
    )
    .unwrap();
    gpu.queue.submit([enc.finish()]);
    let bytes = std::mem::size_of_val(q) as u64;
    (gpu.read(&out, bytes).unwrap(), report)
}

fn params(o: &AttnOptions) -> AttnParams {
    let mut p = AttnParams::new((KVH * GROUP) as usize, HD as usize);
    if let Some(s) = o.scale {
        p.scale = s;
    }
    p.soft_cap = o.soft_cap;
    p.sliding_window = o.sliding_window;
    p.alibi_slopes = o.alibi_slopes.clone();
    p.sinks = o.sinks.clone();
    p
}

#[test]
fn cascade_matches_the_reference_on_random_trees() {
    let Some(gpu) = gpu() else { return };
    let heads = KVH * GROUP;
    let slopes: Vec<f32> = (0..heads).map(|h| 2f32.powf(-(h as f32 + 1.0))).collect();
    let variants: Vec<(&str, AttnOptions)> = vec![
        ("plain", AttnOptions::default()),
        (
            "scale + soft-cap",
            AttnOptions {
                scale: Some(0.2),
                soft_cap: Some(5.0),
                ..Default::default()
            },
        ),
        (
            "alibi",
            AttnOptions {
                alibi_slopes: Some(slopes.clone()),
                ..Default::default()
            },
        ),
        (
            "window 70 (cuts shared segments)",
            AttnOptions {
                sliding_window: Some(70),
                ..Default::default()
            },
        ),
        (
            "split-K suffixes",
            AttnOptions {
                split: Split::Tokens(64),
                alibi_slopes: Some(slopes.clone()),
                ..Default::default()
            },
        ),
        (
            // Sinks join the denominator once, where the shared segments'
            // and the suffixes' partials merge.
            "sinks, split-K suffixes",
            AttnOptions {
                split: Split::Tokens(64),
                sinks: Some((0..heads).map(|h| h as f32 * 0.5 - 1.5).collect()),
                ..Default::default()
            },
        ),
    ];
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let tol = if dtype == KvDtype::F32 { 1e-5 } else { 2e-3 };
        for trial in grid("cascade trials", &[0, 1, 2], &[1, 2]) {
            let name = format!("cascade {dtype:?} trial {trial}");
            let s = seed(&name);
            let mut rng = SplitMix64::new(s);
            let mut b = batch(&gpu, &mut rng, dtype, 6 + 4 * trial, 1 + trial);
            if trial == 2 {
                // RELEASED entries: a windowed sequence dropped its oldest
                // block (shared by others), so its tree path ends there.
                b.indices[b.indptr[0] as usize] = RELEASED;
            }
            let q = rng.signed_vec(b.lens.len() * (heads * HD) as usize);
            for (vname, base) in &variants {
                if trial == 2 && base.sliding_window.is_none() {
                    continue;
                }
                let o = AttnOptions {
                    cascade: Cascade::On,
                    ..base.clone()
                };
                let want = reference::decode(
                    &b.host.view(),
                    &params(&o),
                    &q,
                    &b.indptr,
                    &b.indices,
                    &b.lens,
                );
                for kernel in [Kernel::Tiled, Kernel::Lanes, Kernel::Serial] {
                    let what = format!("{name} {vname} [{kernel}]");
                    let ran = run(&gpu, &b, kernel, &q, &o);
                    assert_cascade(&what, ran, &want, tol, s);
                }
                // And plain decode gives the same.
                let plain = AttnOptions {
                    cascade: Cascade::Off,
                    ..base.clone()
                };
                let (out, rep) = run(&gpu, &b, Kernel::Tiled, &q, &plain);
                assert!(rep.is_none());
                assert!(rel_l2(&out, &want) < tol);
            }
        }
    }
}

/// bf16 activations through the cascade: Q and the output as bf16 on every
/// kernel's segment pass, against the reference over the rounded Q;
/// tolerance 8e-3 (the output rounded once to an 8-bit mantissa).
#[test]
fn cascade_takes_bf16_activations() {
    let Some(gpu) = gpu() else { return };
    let s = seed("cascade::cascade_takes_bf16_activations");
    let mut rng = SplitMix64::new(s);
    let b = batch(&gpu, &mut rng, KvDtype::Bf16, 8, 2);
    let q: Vec<half::bf16> = rng
        .signed_vec(b.lens.len() * (b.heads * HD) as usize)
        .iter()
        .map(|&x| half::bf16::from_f32(x))
        .collect();
    let q32: Vec<f32> = q.iter().map(|x| x.to_f32()).collect();
    let o = AttnOptions {
        cascade: Cascade::On,
        ..Default::default()
    };
    let want = reference::decode(
        &b.host.view(),
        &params(&o),
        &q32,
        &b.indptr,
        &b.indices,
        &b.lens,
    );
    for kernel in [Kernel::Tiled, Kernel::Lanes, Kernel::Serial] {
        let what = format!("bf16 activations, cascade [{kernel}]");
        assert_cascade(&what, run_bf16(&gpu, &b, kernel, &q, &o), &want, 8e-3, s);
    }
}

/// The planner: one sequence runs plain decode even when forced; many
/// samples of a long prompt read a sixth of the bytes with the cascade,
/// which Auto picks where the segment pass runs on the serial kernel (its
/// K/V loads halve) and, on GPUs, where the bytes saved pass a floor.
#[test]
fn the_planner_uses_the_cascade_when_it_pays() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("cascade planner"));
    // 8 samples of a 64-block prompt, 1 private block each.
    let prompt: Vec<u32> = (0..64).collect();
    let mut indptr = vec![0u32];
    let mut indices = Vec::new();
    for s in 0..8u32 {
        indices.extend_from_slice(&prompt);
        indices.push(64 + s);
        indptr.push(indices.len() as u32);
    }
    let lens = vec![64 * BS + 5; 8];
    let t = find_segments(72, BS, &indptr, &indices, &lens, 2048 / BS);
    assert!(t.pays(2 * (KVH * HD) as u64 * 4, 8 * 8, 2 * (HD as u64 * 4 + 8)));
    // Token visits on the serial kernel: the 1024 shared tokens once per
    // pair of samples (2 slots), the 5 private ones per sample.
    assert_eq!(t.serial_visits(2), (4 * 1024 + 8 * 5, 8 * 1029));
    let bpt = 2 * (KVH * HD) as u64 * 4;
    assert!(t.pays_serial(2, bpt));
    // One slot per invocation reads as much as plain decode: no gain.
    assert!(!t.pays_serial(1, bpt));
    // Saving too little to cover the extra dispatches: plain.
    assert!(!t.pays_serial(2, 16));
    let cfg = KvCacheConfig::new(72, BS, KVH, HD);
    let cache = KvCache::new(&gpu, cfg).unwrap();
    let slots: Vec<u32> = (0..72 * BS).collect();
    let row = (KVH * HD) as usize;
    let (k, v) = (
        rng.signed_vec(slots.len() * row),
        rng.signed_vec(slots.len() * row),
    );
    cache.write_kv(&gpu, 0, &k, &v, &slots).unwrap();
    let mut host = HostPool::new(72, KVH as usize, BS as usize, HD as usize);
    host.write(&slots, &k, &v, Stored::from(KvDtype::F32));
    let b = Batch {
        cache,
        host,
        indptr,
        indices,
        lens,
        heads: KVH * GROUP,
    };
    let q = rng.signed_vec(8 * (KVH * GROUP * HD) as usize);
    // The GPU rule (rows segment pass): the bytes model, and at least
    // CASCADE_MIN_SAVED_BYTES saved. This batch saves 7 MiB of its 8 MiB:
    // too little to pay for the extra passes on a GPU; at 256x the bytes
    // per token it saves 1.75 GiB, and pays.
    let partial = 2 * (HD as u64 * 4 + 8);
    let saved = (t.plain_tokens - t.cascade_tokens) * bpt;
    assert_eq!(saved, 7 << 20);
    assert!(!t.pays_gpu(bpt, 8 * 8, partial));
    assert!(t.pays_gpu(bpt * 256, 8 * 8, partial));
    // Auto: the cascade on the serial kernel; on lanes (the rows segment
    // pass) only where CASCADE_AUTO is on, the adapter is a GPU and the
    // GPU rule pays (not here); never on tiled.
    let (_, auto) = run(&gpu, &b, Kernel::Serial, &q, &AttnOptions::default());
    assert_eq!(auto.is_some(), pagedattn::gpu::SERIAL_CASCADE_AUTO);
    for kernel in [Kernel::Lanes, Kernel::Tiled] {
        let (_, auto) = run(&gpu, &b, kernel, &q, &AttnOptions::default());
        assert!(auto.is_none(), "[{kernel}] {}", gpu.describe());
    }
    let on = AttnOptions {
        cascade: Cascade::On,
        ..Default::default()
    };
    let (out, rep) = run(&gpu, &b, Kernel::Serial, &q, &on);
    let (cb, pb, _) = rep.expect("the cascade runs when forced");
    eprintln!(
        "8 samples of 1024 tokens: cascade reads {:.3} of plain decode's K/V bytes",
        cb as f64 / pb as f64
    );
    assert!(cb * 6 <= pb, "{cb} vs {pb}: at most 1/6");
    let want = reference::decode(
        &b.host.view(),
        &params(&AttnOptions::default()),
        &q,
        &b.indptr,
        &b.indices,
        &b.lens,
    );
    assert!(rel_l2(&out, &want) < 1e-5);
    // One sequence: nothing to share, plain decode.
    let one = Batch {
        indptr: b.indptr[..2].to_vec(),
        indices: b.indices[..65].to_vec(),
        lens: b.lens[..1].to_vec(),
        ..b
    };
    let (_, rep) = run(
        &gpu,
        &one,
        Kernel::Serial,
        &q[..(KVH * GROUP * HD) as usize],
        &on,
    );
    assert!(rep.is_none());
}

/// The cascade over quantized pools (int8, fp8, with outlier channels set so
/// the residuals are read too) and bf16 pools gives plain decode's output
/// on every decode kernel: the segment pass decodes as every kernel does.
#[test]
fn cascade_over_quantized_pools_matches_plain_decode() {
    let Some(gpu) = gpu() else { return };
    for dtype in [KvDtype::Int8, KvDtype::Fp8E4M3, KvDtype::Bf16] {
        let s = seed(&format!("cascade {}", dtype.name()));
        let mut rng = SplitMix64::new(s);
        let m = u32::MAX;
        let b = batch_with(&gpu, &mut rng, dtype, 10, 2, |cache| {
            if dtype.quantized() {
                cache
                    .set_k_outlier_channels(&gpu, 0, &[3, 17, m, m, 40, m, m, m])
                    .unwrap()
            }
        });
        let heads = KVH * GROUP;
        let q = rng.signed_vec(b.lens.len() * (heads * HD) as usize);
        let p = AttnParams::new(heads as usize, HD as usize);
        let want = reference::decode(&b.host.view(), &p, &q, &b.indptr, &b.indices, &b.lens);
        let bound = match dtype {
            KvDtype::Int8 => 1e-2,
            KvDtype::Fp8E4M3 => 5e-2,
            // The mirror holds the rounded values: f32 accumulation only.
            _ => 1e-5,
        };
        for kernel in PagedAttention::eligible_kernels(&gpu, &b.cache, heads) {
            let off = AttnOptions {
                cascade: Cascade::Off,
                ..Default::default()
            };
            let on = AttnOptions {
                cascade: Cascade::On,
                ..Default::default()
            };
            let (plain, _) = run(&gpu, &b, kernel, &q, &off);
            let (cas, report) = run(&gpu, &b, kernel, &q, &on);
            assert!(report.is_some(), "[{kernel}] the cascade did not run");
            let plain64: Vec<f64> = plain.iter().map(|&x| x as f64).collect();
            let same = rel_l2(&cas, &plain64);
            let e = rel_l2(&cas, &want);
            eprintln!(
                "{} [{kernel}]: cascade vs plain {same:.2e}, vs reference {e:.2e}",
                dtype.name()
            );
            assert!(
                same < 1e-5,
                "{} [{kernel}]: {same:.3e} (seed {s})",
                dtype.name()
            );
            assert!(e < bound, "{} [{kernel}]: {e:.3e} (seed {s})", dtype.name());
        }
    }
}

/// The GPU segment pass (`attention_rows.wgsl`, the cascade of the `lanes`
/// kernel) over head shapes that change its layout: lanes per row 1, 2, 4
/// and 8 (head_dim 32, 48, 80, 128, 256), head tiles that do not divide its
/// rows (groups of 3 and 20), MHA, and more sequences than a tile holds;
/// against the f64 reference with ALiBi, and a sliding window on f32 pools.
/// One pool dtype per shape, f32 and f16 in turn (each shape compiles its
/// own pipelines: on llvmpipe's GL that is most of this test's time).
#[test]
fn rows_segment_pass_matches_the_reference_over_head_shapes() {
    let Some(gpu) = gpu() else { return };
    let shapes = [
        (2, 8, 32, KvDtype::F32),
        (1, 3, 80, KvDtype::F16),
        (2, 1, 128, KvDtype::F32),
        (1, 20, 48, KvDtype::F16),
        (1, 2, 256, KvDtype::F32),
    ];
    // A secondary backend: an odd group over f16, and the widest head.
    for (kvh, group, hd, dtype) in grid("rows pass shapes", &shapes, &[1, 4]) {
        let heads = kvh * group;
        let slopes: Vec<f32> = (0..heads)
            .map(|h| 2f32.powf(-(h as f32 + 1.0) / 2.0))
            .collect();
        let name = format!("rows kvh {kvh} group {group} d{hd} {dtype:?}");
        let s = seed(&name);
        let mut rng = SplitMix64::new(s);
        let b = batch_shaped(&gpu, &mut rng, dtype, 19, 2, (kvh, group, hd), |_| {});
        let q = rng.signed_vec(b.lens.len() * (heads * hd) as usize);
        let o = AttnOptions {
            cascade: Cascade::On,
            alibi_slopes: Some(slopes),
            sliding_window: (dtype == KvDtype::F32).then_some(90),
            ..Default::default()
        };
        let mut p = AttnParams::new(heads as usize, hd as usize);
        p.alibi_slopes = o.alibi_slopes.clone();
        p.sliding_window = o.sliding_window;
        let want = reference::decode(&b.host.view(), &p, &q, &b.indptr, &b.indices, &b.lens);
        let (out, rep) = run(&gpu, &b, Kernel::Lanes, &q, &o);
        assert!(rep.is_some(), "{name}: the cascade did not run");
        let e = rel_l2(&out, &want);
        eprintln!("{name}: rel L2 {e:.3e}");
        let tol = if dtype == KvDtype::F32 { 1e-5 } else { 2e-3 };
        assert!(e < tol, "{name}: rel L2 {e:.3e} (seed {s})");
    }
}
