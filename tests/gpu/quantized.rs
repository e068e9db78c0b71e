//! Quantized KV pools (int8 with a scale per token and KV head, fp8 E4M3
//! with a scale per layer and KV head) on a real adapter against the f64
//! reference over the *exact* inputs: fresh random inputs (seed printed),
//! shuffled blocks, output poisoned (NaN) first. Bounds, relative L2 of the
//! attention output, the targets: int8 < 1e-2, fp8 < 5e-2, on unit-normal
//! K/V and on keys with 4 of 128 channels x20 once the pool is calibrated
//! (int8: K smoothing and outlier channels; fp8: outlier channels);
//! uncalibrated, int8 < 6e-2 and fp8 < 1.2e-1 (see `bound`).
//! Every decode kernel variant, split and unsplit, and chunked prefill
//! (split-KV included).

use crate::common;

use common::*;
use pagedattn::gpu::{
    AttnOptions, Gpu, GpuError, Kernel, KvCache, KvCacheConfig, KvDtype, PagedAttention, Split,
};
use pagedattn::reference::{self, rel_l2, AttnParams};
use pagedattn::rng::SplitMix64;

/// The bound: the targets (`common::decode_tol`: int8 1e-2, fp8 5e-2) on
/// unit-normal K/V, and on outlier keys once calibrated; uncalibrated
/// outlier keys (measured int8
/// 4.2e-2, fp8 8.6e-2) get 6e-2 and 1.2e-1. A x20 channel's rounding error
/// is 20 times an ordinary one's, and so is its share of q.k's error: it
/// needs the 4 extra bits of an outlier channel (int8 also needs K
/// smoothing, so the outliers do not set every row's scale).
fn bound(d: KvDtype, outliers: usize, calibrated: bool) -> f64 {
    match (d, outliers > 0 && !calibrated) {
        (KvDtype::Int8 | KvDtype::Fp8E4M3, false) => common::decode_tol(d),
        (KvDtype::Int8, true) => 6e-2,
        (KvDtype::Fp8E4M3, true) => 1.2e-1,
        _ => unreachable!(),
    }
}

/// |x| rounded up to bf16, as int8 row scales are stored.
fn bf16_up(x: f32) -> f32 {
    f32::from_bits((x.abs().to_bits() + 0xffff) >> 16 << 16)
}

/// Unit-normal values (Box-Muller).
fn normal(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u = rng.next_f64().max(1e-12);
            let v = rng.next_f64();
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect()
}

struct Rig {
    cache: KvCache,
    /// The K smoothing factors set (int8 with smoothing).
    smoothing: Option<Vec<f32>>,
    host: HostPool,
    view: pagedattn::blocks::BatchView,
    kvh: u32,
    hd: u32,
}

/// A pool of `dtype` holding sequences of `lens`: K with `outliers` channels
/// scaled x20 (the shape of real keys), V unit-normal. fp8 scales are
/// calibrated from the data; with `calibrated`, so are the K outlier
/// channels (and int8's K smoothing).
fn rig(
    gpu: &Gpu,
    rng: &mut SplitMix64,
    dtype: KvDtype,
    lens: &[usize],
    outliers: usize,
    calibrated: bool,
) -> Rig {
    let (kvh, hd, bs) = (2u32, 128u32, 16u32);
    let nb = blocks_for(lens, bs, 3);
    let (_m, _ids, view) = shuffled_batch(rng, nb, bs, lens);
    let cfg = KvCacheConfig::new(nb, bs, kvh, hd).with_dtype(dtype);
    let cache = KvCache::new(gpu, cfg).unwrap();
    let ntok = view.slot_mapping.len();
    let row = (kvh * hd) as usize;
    let mut k = normal(rng, ntok * row);
    let v = normal(rng, ntok * row);
    // The same few channels of every head are outliers.
    let chans: Vec<usize> = (0..outliers).map(|i| (i * 37 + 5) % hd as usize).collect();
    for (i, x) in k.iter_mut().enumerate() {
        if chans.contains(&(i % hd as usize)) {
            *x *= 20.0;
        }
    }
    let smoothing =
        (calibrated && dtype == KvDtype::Int8).then(|| KvCache::calibrate_k_smoothing(&cfg, &k));
    if let Some(f) = &smoothing {
        cache.set_k_smoothing(gpu, 0, f).unwrap();
    }
    if calibrated {
        let chans = KvCache::calibrate_k_outlier_channels(&cfg, &k);
        assert_eq!(
            chans.iter().filter(|&&c| c != u32::MAX).count(),
            outliers.min(4) * kvh as usize,
            "{chans:?}"
        );
        cache.set_k_outlier_channels(gpu, 0, &chans).unwrap();
    }
    if dtype == KvDtype::Fp8E4M3 {
        let ks = KvCache::calibrate_fp8_scales(&cfg, &k);
        let vs = KvCache::calibrate_fp8_scales(&cfg, &v);
        cache.set_fp8_scales(gpu, 0, &ks, &vs).unwrap();
    }
    cache.write_kv(gpu, 0, &k, &v, &view.slot_mapping).unwrap();
    let mut host = HostPool::new(nb as usize, kvh as usize, bs as usize, hd as usize);
    host.write(&view.slot_mapping, &k, &v, Stored::from(dtype));
    Rig {
        cache,
        smoothing,
        host,
        view,
        kvh,
        hd,
    }
}

#[test]
fn decode_and_prefill_within_the_bounds() {
    let Some(gpu) = gpu() else { return };
    let lens = [1usize, 40, 333, 1200];
    let configs = [
        (KvDtype::Int8, 0, false),
        (KvDtype::Int8, 4, false),
        (KvDtype::Int8, 4, true),
        (KvDtype::Fp8E4M3, 0, false),
        (KvDtype::Fp8E4M3, 4, false),
        (KvDtype::Fp8E4M3, 4, true),
    ];
    // A secondary backend: each dtype once, the outliers and the
    // calibration through one of them.
    for (dtype, outliers, calibrated) in grid("quantized pools", &configs, &[0, 5]) {
        {
            let name = format!(
                "{} outliers {outliers}{}",
                dtype.name(),
                if calibrated { " calibrated" } else { "" }
            );
            let s = seed(&name);
            let mut rng = SplitMix64::new(s);
            let r = rig(&gpu, &mut rng, dtype, &lens, outliers, calibrated);
            let heads = r.kvh * 4;
            let p = AttnParams::new(heads as usize, r.hd as usize);
            let q = normal(&mut rng, lens.len() * (heads * r.hd) as usize);
            let v = &r.view;
            let want = reference::decode(
                &r.host.view(),
                &p,
                &q,
                &v.kv_indptr,
                &v.kv_indices,
                &v.seq_lens,
            );
            let kernels = PagedAttention::eligible_kernels(&gpu, &r.cache, heads);
            assert!(kernels.len() >= 3, "{kernels:?}");
            for kernel in kernels {
                let attn = PagedAttention::new(
                    &gpu,
                    &r.cache,
                    heads,
                    &pagedattn::gpu::AttentionConfig::new().kernel(kernel),
                )
                .unwrap();
                for split in [Split::Auto, Split::Tokens(128)] {
                    let o = AttnOptions {
                        split,
                        ..Default::default()
                    };
                    let out = decode_view(&attn, &gpu, &r.cache, &q, v, &o).unwrap();
                    let e = rel_l2(&out, &want);
                    eprintln!(
                        "{name} decode [{kernel} {split:?}]: rel L2 {e:.3e} (bound {:.1e})",
                        bound(dtype, outliers, calibrated)
                    );
                    assert!(
                        e < bound(dtype, outliers, calibrated),
                        "{name} [{kernel} {split:?}]: {e:.3e} (seed {s})"
                    );
                }
            }
            // Chunked prefill: the newest 8 positions of each sequence (1 for
            // the one-token one), split-KV under Split::Auto.
            let attn = PagedAttention::new(&gpu, &r.cache, heads, &Default::default()).unwrap();
            let mut qo = vec![0u32];
            for &l in &lens {
                qo.push(qo.last().unwrap() + 8.min(l as u32));
            }
            let q = normal(
                &mut rng,
                *qo.last().unwrap() as usize * (heads * r.hd) as usize,
            );
            let want = reference::prefill(
                &r.host.view(),
                &p,
                &q,
                &qo,
                &v.kv_indptr,
                &v.kv_indices,
                &v.seq_lens,
            );
            let out = attn
                .prefill(
                    &gpu,
                    &r.cache,
                    0,
                    &q,
                    &qo,
                    &v.kv_indptr,
                    &v.kv_indices,
                    &v.seq_lens,
                    &AttnOptions::default(),
                )
                .unwrap();
            let e = rel_l2(&out, &want);
            eprintln!(
                "{name} prefill: rel L2 {e:.3e} (bound {:.1e})",
                bound(dtype, outliers, calibrated)
            );
            assert!(
                e < bound(dtype, outliers, calibrated),
                "{name} prefill: {e:.3e} (seed {s})"
            );
        }
    }
}

/// write_kv then read_layer: every value within the format's own rounding
/// (int8: half a step of the row's scale; fp8: half a unit in the last of
/// 3 mantissa bits, or 2^-10 x scale below the normal range).
#[test]
fn write_then_read_round_trips_within_the_rounding() {
    let Some(gpu) = gpu() else { return };
    for dtype in [KvDtype::Int8, KvDtype::Fp8E4M3] {
        let s = seed(&format!("round trip {}", dtype.name()));
        let mut rng = SplitMix64::new(s);
        let r = rig(&gpu, &mut rng, dtype, &[50, 17], 3, false);
        let (k, v) = r.cache.read_layer(&gpu, 0).unwrap();
        let d = r.hd as usize;
        let mut worst = 0.0f64;
        for (got, want) in [(&k, &r.host.k), (&v, &r.host.v)] {
            assert_eq!(got.len(), want.len());
            // fp8's scale is per KV head (calibrated over every row of the
            // head): bounded here by the largest |value| of the pool.
            let pool_amax = want.iter().fold(0.0f32, |a, x| a.max(x.abs()));
            for (row, (g, w)) in got.chunks(d).zip(want.chunks(d)).enumerate() {
                let amax = w.iter().fold(0.0f32, |a, x| a.max(x.abs()));
                for (i, (&g, &w)) in g.iter().zip(w).enumerate() {
                    assert!(g.is_finite(), "row {row} [{i}] is {g}");
                    let allowed = match dtype {
                        // Half a step of the row's scale (amax rounded up to bf16).
                        KvDtype::Int8 => bf16_up(amax) as f64 / 254.0 * 1.0001 + 1e-7,
                        // Scale calibrated per head: |w| / scale <= 448.
                        _ => {
                            (w.abs() as f64 / 16.0).max(pool_amax as f64 / 448.0 * 2f64.powi(-10))
                                * 1.0001
                                + 1e-7
                        }
                    };
                    let err = (g as f64 - w as f64).abs();
                    worst = worst.max(err / allowed.max(1e-30));
                    assert!(
                        err <= allowed,
                        "{} row {row} [{i}]: wrote {w}, read {g} (allowed {allowed:.3e}, seed {s})",
                        dtype.name()
                    );
                }
            }
        }
        eprintln!(
            "{}: worst error {worst:.3} of the rounding bound",
            dtype.name()
        );
    }
}

/// Every pool saturates what it stores, never inf or NaN: fp8 at +-448
/// times the scale (infinities too; NaN is stored as 0); int8 at +-KV_MAX
/// (2^100; NaN as 0); f16 at +-65504; f32 and bf16 at +-KV_MAX. (f32 and f16 store
/// an engine's NaN as given.)
#[test]
fn out_of_range_values_saturate_never_nan() {
    let Some(gpu) = gpu() else { return };
    let max = pagedattn::gpu::KV_MAX;
    for dtype in KvDtype::ALL {
        let cfg = KvCacheConfig::new(1, 1, 1, 8).with_dtype(dtype);
        let cache = KvCache::new(&gpu, cfg).unwrap();
        let nan = if dtype.quantized() { f32::NAN } else { 0.0 };
        let k = [
            1e30f32,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            nan,
            1.0,
            -500.0,
            f32::MAX,
        ];
        cache.write_kv(&gpu, 0, &k, &k, &[0]).unwrap();
        let (got, gv) = cache.read_layer(&gpu, 0).unwrap();
        assert!(
            got.iter().chain(&gv).all(|x| x.is_finite()),
            "{} {got:?} {gv:?}",
            dtype.name()
        );
        match dtype {
            KvDtype::Fp8E4M3 => assert_eq!(
                got,
                vec![448.0, -448.0, 448.0, -448.0, 0.0, 1.0, -448.0, 448.0]
            ),
            KvDtype::F16 => assert_eq!(
                got,
                vec![65504.0, -65504.0, 65504.0, -65504.0, 0.0, 1.0, -500.0, 65504.0]
            ),
            KvDtype::F32 => assert_eq!(got, vec![1e30, -1e30, max, -max, 0.0, 1.0, -500.0, max]),
            // bf16 keeps f32's range: 1e30 rounded, the rest at +-KV_MAX.
            KvDtype::Bf16 => {
                let b = half::bf16::from_f32(1e30).to_f32();
                assert_eq!(got, vec![b, -b, max, -max, 0.0, 1.0, -500.0, max])
            }
            KvDtype::Int8 => {
                // Row scale KV_MAX (the saturated infinities): 1e30 within
                // half a step (KV_MAX / 254) of itself, NaN as 0, and the
                // saturated values at +-KV_MAX exactly.
                assert_eq!(got[4], 0.0);
                assert_eq!([got[2], got[3], got[7]], [max, -max, max]);
                assert!(
                    (got[0] - 1e30).abs() <= max / 254.0 && (got[1] + 1e30).abs() <= max / 254.0,
                    "{got:?}"
                );
            }
        }
    }
}

/// Decode of finite inputs is finite on every dtype and kernel, even with
/// a row of -f32::MAX in the pool (the probe got 64 of 128 int8 outputs
/// non-finite), and the other sequences of the batch are untouched: they
/// match the reference within the dtype's tolerance.
#[test]
fn huge_rows_never_make_decode_non_finite() {
    let Some(gpu) = gpu() else { return };
    let s = seed("huge rows");
    let mut rng = SplitMix64::new(s);
    // The shape of the rig above (its kernels are compiled already).
    let (kvh, hd, bs) = (2u32, 128u32, 16u32);
    for dtype in KvDtype::ALL {
        let cfg = KvCacheConfig::new(4, bs, kvh, hd).with_dtype(dtype);
        let cache = KvCache::new(&gpu, cfg).unwrap();
        let row = (kvh * hd) as usize;
        // Sequence 0: block 0, 16 tokens, one of them a row of -f32::MAX.
        // Sequence 1: block 2, 16 ordinary tokens.
        let mut k = rng.signed_vec(32 * row);
        let mut v = rng.signed_vec(32 * row);
        for x in &mut k[5 * row..6 * row] {
            *x = -f32::MAX;
        }
        for x in &mut v[5 * row..6 * row] {
            *x = -f32::MAX;
        }
        let slots: Vec<u32> = (0..16).chain(32..48).collect();
        cache.write_kv(&gpu, 0, &k, &v, &slots).unwrap();
        let mut host = HostPool::new(4, kvh as usize, bs as usize, hd as usize);
        host.write(
            &slots[16..],
            &k[16 * row..],
            &v[16 * row..],
            Stored::from(dtype),
        );
        for kernel in PagedAttention::eligible_kernels(&gpu, &cache, kvh * 4) {
            let attn = PagedAttention::new(
                &gpu,
                &cache,
                kvh * 4,
                &pagedattn::gpu::AttentionConfig::new().kernel(kernel),
            )
            .unwrap();
            let q = rng.signed_vec(2 * (kvh * 4 * hd) as usize);
            let out = attn
                .decode(
                    &gpu,
                    &cache,
                    0,
                    &q,
                    &[0, 1, 2],
                    &[0, 2],
                    &[16, 16],
                    &AttnOptions::default(),
                )
                .unwrap();
            assert!(
                out.iter().all(|x| x.is_finite()),
                "{} {kernel}: non-finite output (seed {s})",
                dtype.name()
            );
            let half = out.len() / 2;
            let want = reference::decode(
                &host.view(),
                &AttnParams::new((kvh * 4) as usize, hd as usize),
                &q[half..],
                &[0, 1],
                &[2],
                &[16],
            );
            let err = rel_l2(&out[half..], &want);
            let tol = match dtype {
                KvDtype::F32 => 1e-5,
                KvDtype::F16 => 2e-3,
                _ => 0.1,
            };
            assert!(
                err < tol,
                "{} {kernel}: the other sequence, rel L2 {err:.3e} (seed {s})",
                dtype.name()
            );
        }
    }
}

/// Calibration values outside the range that keeps every stored value
/// finite are refused, changing nothing: K smoothing factors outside
/// 2^-32..=2^32 (the probe's 3.4e38 made every output non-finite), fp8
/// scales outside 2^-100..=2^91 (subnormal 1e-45, huge 3.4e38). Outlier
/// channels name a channel below head_dim or K_OUTLIER_UNUSED (a list of
/// only that sets none). The calibration helpers stay inside the ranges.
#[test]
fn calibration_values_are_bounded() {
    use pagedattn::gpu::{FP8_SCALE_RANGE, K_OUTLIERS, K_OUTLIER_UNUSED, K_SMOOTHING_RANGE};
    let Some(gpu) = gpu() else { return };
    let base = KvCacheConfig::new(1, 1, 1, 64).with_dtype(KvDtype::Int8);
    let int8 = KvCache::new(&gpu, base).unwrap();
    for bad in [3.4e38f32, 1e-20, 0.0, -1.0, f32::NAN, f32::INFINITY, 1e-45] {
        match int8.set_k_smoothing(&gpu, 0, &[bad; 64]) {
            Err(e @ GpuError::Pool(_)) => {
                assert!(e.to_string().contains("K smoothing factor 0"), "{e}")
            }
            other => panic!("smoothing {bad}: {other:?}"),
        }
    }
    int8.set_k_smoothing(&gpu, 0, &[K_SMOOTHING_RANGE[1]; 64])
        .unwrap();
    int8.set_k_smoothing(&gpu, 0, &[K_SMOOTHING_RANGE[0]; 64])
        .unwrap();
    let n = K_OUTLIERS as usize;
    int8.set_k_outlier_channels(&gpu, 0, &vec![K_OUTLIER_UNUSED; n])
        .unwrap();
    for bad in [u32::MAX - 1, 64, 1 << 31] {
        let mut ch = vec![K_OUTLIER_UNUSED; n];
        ch[1] = bad;
        match int8.set_k_outlier_channels(&gpu, 0, &ch) {
            Err(e @ GpuError::Pool(_)) => assert!(e.to_string().contains("below head_dim"), "{e}"),
            other => panic!("channel {bad}: {other:?}"),
        }
    }
    let fp8 = KvCache::new(
        &gpu,
        KvCacheConfig {
            dtype: KvDtype::Fp8E4M3,
            ..base
        },
    )
    .unwrap();
    for bad in [1e-45f32, 3.4e38, 1e-31, 1e28] {
        match fp8.set_fp8_scales(&gpu, 0, &[bad], &[1.0]) {
            Err(e @ GpuError::Pool(_)) => assert!(e.to_string().contains("fp8 scales must"), "{e}"),
            other => panic!("fp8 scale {bad}: {other:?}"),
        }
    }
    fp8.set_fp8_scales(&gpu, 0, &[FP8_SCALE_RANGE[0]], &[FP8_SCALE_RANGE[1]])
        .unwrap();
    // Calibrating on extreme rows stays in range.
    let rows = [f32::MAX, 1.0, 1e-38, 0.0].repeat(16);
    let sm = KvCache::calibrate_k_smoothing(&base, &rows);
    assert!(
        sm.iter()
            .all(|f| (K_SMOOTHING_RANGE[0]..=K_SMOOTHING_RANGE[1]).contains(f)),
        "{sm:?}"
    );
    int8.set_k_smoothing(&gpu, 0, &sm).unwrap();
    for r in [rows.clone(), vec![1e-40; 64]] {
        let sc = KvCache::calibrate_fp8_scales(&base, &r);
        assert!(
            sc.iter()
                .all(|f| (FP8_SCALE_RANGE[0]..=FP8_SCALE_RANGE[1]).contains(f)),
            "{sc:?}"
        );
        fp8.set_fp8_scales(&gpu, 0, &sc, &sc).unwrap();
    }
}

/// copy_blocks moves a block's scales with its values (int8), and the
/// copied block decodes like the original.
#[test]
fn copy_blocks_moves_the_scales() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("quantized copy"));
    for dtype in [KvDtype::Int8, KvDtype::Fp8E4M3] {
        let cfg = KvCacheConfig::new(4, 4, 2, 8)
            .with_layers(2)
            .with_dtype(dtype);
        let cache = KvCache::new(&gpu, cfg).unwrap();
        // Rows of very different magnitudes, so scales differ per row.
        let k: Vec<f32> = (0..4 * 16)
            .map(|i| rng.next_signed() * (1 + i / 16) as f32 * 10.0)
            .collect();
        let v = normal(&mut rng, 4 * 16);
        for layer in 0..2 {
            cache.write_kv(&gpu, layer, &k, &v, &[4, 5, 6, 7]).unwrap();
        }
        cache.copy_blocks(&gpu, &[[1, 3]]).unwrap();
        for layer in 0..2 {
            let (gk, gv) = cache.read_layer(&gpu, layer).unwrap();
            let per = 2 * 4 * 8;
            assert_eq!(gk[3 * per..4 * per], gk[per..2 * per], "{} K", dtype.name());
            assert_eq!(gv[3 * per..4 * per], gv[per..2 * per], "{} V", dtype.name());
            assert!(gk[per..2 * per].iter().any(|x| *x != 0.0));
        }
    }
}

/// Bad fp8 scales are refused with a message and change nothing; the
/// other dtypes refuse set_fp8_scales.
#[test]
fn bad_fp8_scales_are_refused() {
    let Some(gpu) = gpu() else { return };
    let cfg = KvCacheConfig::new(1, 1, 2, 4).with_dtype(KvDtype::Fp8E4M3);
    let cache = KvCache::new(&gpu, cfg).unwrap();
    cache
        .set_fp8_scales(&gpu, 0, &[2.0, 2.0], &[2.0, 2.0])
        .unwrap();
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        match cache.set_fp8_scales(&gpu, 0, &[1.0, bad], &[1.0, 1.0]) {
            Err(e @ GpuError::Pool(_)) => {
                assert!(e.to_string().contains("finite and positive"), "{e}")
            }
            other => panic!("scale {bad}: {other:?}"),
        }
    }
    match cache.set_fp8_scales(&gpu, 0, &[1.0], &[1.0, 1.0]) {
        Err(e @ GpuError::Pool(_)) => assert!(e.to_string().contains("KV heads"), "{e}"),
        other => panic!("{other:?}"),
    }
    match cache.set_fp8_scales(&gpu, 1, &[1.0, 1.0], &[1.0, 1.0]) {
        Err(e @ GpuError::Pool(_)) => assert!(e.to_string().contains("layer"), "{e}"),
        other => panic!("{other:?}"),
    }
    // The scales are still 2: a written 2.0 reads back as 2.0 (1.0 x 2).
    cache.write_kv(&gpu, 0, &[2.0; 8], &[2.0; 8], &[0]).unwrap();
    let (k, _) = cache.read_layer(&gpu, 0).unwrap();
    assert_eq!(k, vec![2.0; 8]);
    let f16 = KvCache::new(
        &gpu,
        KvCacheConfig {
            dtype: KvDtype::F16,
            ..cfg
        },
    )
    .unwrap();
    match f16.set_fp8_scales(&gpu, 0, &[1.0, 1.0], &[1.0, 1.0]) {
        Err(e @ GpuError::Pool(_)) => assert!(e.to_string().contains("fp8 pools only"), "{e}"),
        other => panic!("{other:?}"),
    }
}

/// Capacity: int8 and fp8 blocks take at most 0.53x the bytes of f16
/// (side words included) from head_dim 64 on, and a pool of a fixed byte
/// budget holds that many more blocks.
#[test]
fn quantized_blocks_are_about_half_of_f16() {
    for hd in [64u32, 128, 256] {
        let cfg = |dtype| KvCacheConfig::new(1000, 16, 8, hd).with_dtype(dtype);
        let f16 = cfg(KvDtype::F16).block_bytes() as f64;
        for dtype in [KvDtype::Int8, KvDtype::Fp8E4M3] {
            let r = cfg(dtype).block_bytes() as f64 / f16;
            eprintln!("head_dim {hd}: {} / f16 = {r:.3}", dtype.name());
            // Exactly the payload plus the side words per row: K's word
            // (int8's scale and the outlier residuals) and int8's bf16 V
            // scale: (2 head_dim + 6) / (4 head_dim) for int8, (2 head_dim
            // + 4) / (4 head_dim) for fp8.
            let side = if dtype == KvDtype::Int8 { 6 } else { 4 };
            let want = (2 * hd + side) as f64 / (4 * hd) as f64;
            assert_eq!(r, want, "head_dim {hd} {}", dtype.name());
            assert!(r <= 0.53, "head_dim {hd} {}: {r}", dtype.name());
            let budget = 64 << 20;
            assert!(
                cfg(dtype).max_blocks_for(budget) as f64
                    >= 1.88 * cfg(KvDtype::F16).max_blocks_for(budget) as f64
            );
        }
    }
}

/// K smoothing round trip: read_layer gives back K (times nothing) within
/// the rounding of the smoothed row, and bad factors are refused.
#[test]
fn k_smoothing_round_trips_and_refuses_bad_factors() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("k smoothing"));
    let r = rig(&gpu, &mut rng, KvDtype::Int8, &[40, 9], 4, true);
    let cfg = *r.cache.config();
    let d = r.hd as usize;
    let (k, _) = r.cache.read_layer(&gpu, 0).unwrap();
    let f = r.smoothing.clone().unwrap();
    assert!(
        f.iter().any(|&x| x > 5.0),
        "outlier channels get large factors"
    );
    for (row, (g, w)) in k.chunks(d).zip(r.host.k.chunks(d)).enumerate() {
        let h = (row / cfg.block_size as usize) % cfg.num_kv_heads as usize;
        let fh = &f[h * d..(h + 1) * d];
        let amax = w
            .iter()
            .zip(fh)
            .fold(0.0f32, |a, (x, s)| a.max((x / s).abs()));
        for (i, (&g, &w)) in g.iter().zip(w).enumerate() {
            let allowed = (bf16_up(amax) / 254.0 * fh[i]) as f64 * 1.001 + 1e-6;
            assert!(
                ((g - w) as f64).abs() <= allowed,
                "row {row} [{i}]: {w} read as {g} (allowed {allowed:.2e})"
            );
        }
    }
    let n = (cfg.num_kv_heads * cfg.head_dim) as usize;
    for bad in [0.0, -2.0, f32::NAN] {
        let mut f = vec![1.0; n];
        f[3] = bad;
        match r.cache.set_k_smoothing(&gpu, 0, &f) {
            Err(e @ GpuError::Pool(_)) => {
                assert!(e.to_string().contains("finite and positive"), "{e}")
            }
            other => panic!("{other:?}"),
        }
    }
    match r.cache.set_k_smoothing(&gpu, 0, &[1.0; 3]) {
        Err(e @ GpuError::Pool(_)) => assert!(e.to_string().contains("smoothing factors"), "{e}"),
        other => panic!("{other:?}"),
    }
}

/// Outlier channels: bad lists are refused with a message and change
/// nothing; the channels set keep their values to about 12 bits (int8: a
/// fifteenth of the row's step) or 7 mantissa bits (fp8) through write_kv
/// and read_layer, the others to the format's own rounding.
#[test]
fn outlier_channels_round_trip_and_refuse_bad_lists() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("outlier channels"));
    for dtype in [KvDtype::Int8, KvDtype::Fp8E4M3] {
        let cfg = KvCacheConfig::new(2, 4, 2, 16).with_dtype(dtype);
        let cache = KvCache::new(&gpu, cfg).unwrap();
        let m = u32::MAX;
        let good = [3, 7, m, m, 0, 15, 8, m];
        cache.set_k_outlier_channels(&gpu, 0, &good).unwrap();
        for (bad, why) in [
            (&[3, 7, m, m, 0, 15, 8][..], "outlier channels for"),
            (&[3, 16, m, m, 0, 15, 8, m][..], "not below head_dim"),
            (&[3, 7, m, m, 0, 15, 0, m][..], "named twice"),
        ] {
            match cache.set_k_outlier_channels(&gpu, 0, bad) {
                Err(e @ GpuError::Pool(_)) => assert!(e.to_string().contains(why), "{e}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        match cache.set_k_outlier_channels(&gpu, 1, &good) {
            Err(e @ GpuError::Pool(_)) => assert!(e.to_string().contains("layer"), "{e}"),
            other => panic!("{other:?}"),
        }
        // Eight rows of head-dim 16 per head; the outlier channels x20.
        let n = 8 * 2 * 16;
        let mut k = normal(&mut rng, n);
        for (i, x) in k.iter_mut().enumerate() {
            let (h, c) = ((i / 16) % 2, i % 16);
            if good[h * 4..h * 4 + 4].contains(&(c as u32)) {
                *x *= 20.0;
            }
        }
        let v = normal(&mut rng, n);
        let slots: Vec<u32> = (0..8).collect();
        cache.write_kv(&gpu, 0, &k, &v, &slots).unwrap();
        let (got, _) = cache.read_layer(&gpu, 0).unwrap();
        let mut worst = [0.0f64; 2];
        for t in 0..8usize {
            for h in 0..2usize {
                let src = &k[(t * 2 + h) * 16..(t * 2 + h + 1) * 16];
                // Pool row: block t / 4, head h, offset t % 4.
                let at = ((t / 4 * 2 + h) * 4 + t % 4) * 16;
                let amax = src.iter().fold(0.0f32, |a, x| a.max(x.abs()));
                for c in 0..16 {
                    let (w, g) = (src[c] as f64, got[at + c] as f64);
                    let outlier = good[h * 4..h * 4 + 4].contains(&(c as u32));
                    let allowed = match (dtype, outlier) {
                        (KvDtype::Int8, true) => bf16_up(amax) as f64 / 127.0 / 30.0,
                        (KvDtype::Int8, false) => bf16_up(amax) as f64 / 254.0,
                        (_, true) => w.abs() / 240.0,
                        _ => w.abs() / 16.0 + 2f64.powi(-10),
                    } * 1.001
                        + 1e-6;
                    let err = (g - w).abs();
                    worst[outlier as usize] = worst[outlier as usize].max(err / allowed);
                    assert!(
                        err <= allowed,
                        "{} token {t} head {h} [{c}]: {w} read as {g} (allowed {allowed:.2e})",
                        dtype.name()
                    );
                }
            }
        }
        eprintln!(
            "{}: worst error / bound: ordinary {:.3}, outlier channels {:.3}",
            dtype.name(),
            worst[0],
            worst[1]
        );
    }
    let f16 = KvCache::new(
        &gpu,
        KvCacheConfig::new(1, 1, 1, 4).with_dtype(KvDtype::F16),
    )
    .unwrap();
    match f16.set_k_outlier_channels(&gpu, 0, &[0, 1, 2, 3]) {
        Err(e @ GpuError::Pool(_)) => {
            assert!(e.to_string().contains("int8 and fp8 pools only"), "{e}")
        }
        other => panic!("{other:?}"),
    }
}

/// The serial kernel reads its pools as `vec4<u32>` where a load holds
/// whole KV4s of a row (int8/fp8 at head_dim % 16 == 0, f16 at % 8), and
/// quantized layer buffers are padded to 16 bytes so that view reaches the
/// tail (scales, outlier channels). Small shapes whose tails end inside
/// the padding, head dims with and without wide loads, block size 1 (int8
/// V: one scale per word), fp8 scales other than 1 and outlier channels
/// set: serial decode equals the f64 reference over what the pool holds
/// (`read_layer`, residuals and scales applied), as the tiled kernel
/// (plain word loads) does. The padding itself is asserted: lavapipe
/// bounds-checks each word of a load, so a vec4 straddling an unpadded
/// end still reads right there (tried), where a stricter driver may not.
#[test]
fn serial_wide_loads_reach_every_word_of_the_pool() {
    let Some(gpu) = gpu() else { return };
    // Quantized shapes whose K buffer needed the padding (its unpadded
    // end off a 16-byte boundary): there the tail's last words lie past
    // the last whole vec4 of an unpadded buffer.
    let mut padded = 0;
    for dtype in [KvDtype::Int8, KvDtype::Fp8E4M3, KvDtype::F16] {
        let shapes: [(u32, u32, u32, &[usize]); 4] = [
            (16, 1, 1, &[1, 2]),
            (48, 1, 2, &[3, 5, 1]),
            (24, 3, 4, &[5, 4, 9]),
            (20, 1, 16, &[17, 3]),
        ];
        for (hd, kvh, bs, lens) in shapes {
            let nb = blocks_for(lens, bs, 1);
            let name = format!("wide {} hd {hd} kvh {kvh} bs {bs}", dtype.name());
            let s = seed(&name);
            let mut rng = SplitMix64::new(s);
            let cfg = KvCacheConfig::new(nb, bs, kvh, hd).with_dtype(dtype);
            if dtype.quantized() {
                padded += !(cfg.tail_offset() + cfg.tail_bytes()).is_multiple_of(16) as u32;
                assert_eq!(cfg.layer_bytes() % 16, 0, "{name}");
                assert_eq!(cfg.v_layer_bytes() % 16, 0, "{name}");
                assert!(cfg.tail_offset() + cfg.tail_bytes() <= cfg.layer_bytes());
            }
            let cache = KvCache::new(&gpu, cfg).unwrap();
            // Tables over shuffled blocks, and the slot of every token.
            let (_m, _ids, view) = shuffled_batch(&mut rng, nb, bs, lens);
            let slots = &view.slot_mapping;
            let row = (kvh * hd) as usize;
            let ntok = slots.len();
            let k = normal(&mut rng, ntok * row);
            let v = normal(&mut rng, ntok * row);
            if dtype.quantized() {
                // Scales other than 1 and an outlier channel per head, all
                // in the tail.
                if dtype == KvDtype::Fp8E4M3 {
                    let ks: Vec<f32> = (0..kvh).map(|h| 0.01 + 0.004 * h as f32).collect();
                    let vs: Vec<f32> = (0..kvh).map(|h| 0.02 + 0.003 * h as f32).collect();
                    cache.set_fp8_scales(&gpu, 0, &ks, &vs).unwrap();
                }
                let chans: Vec<u32> = (0..kvh)
                    .flat_map(|h| [(3 + 5 * h) % hd, u32::MAX, hd - 1 - h, u32::MAX])
                    .collect();
                cache.set_k_outlier_channels(&gpu, 0, &chans).unwrap();
            }
            cache.write_kv(&gpu, 0, &k, &v, slots).unwrap();
            let (gk, gv) = cache.read_layer(&gpu, 0).unwrap();
            let host = HostPool {
                k: gk,
                v: gv,
                num_kv_heads: kvh as usize,
                block_size: bs as usize,
                head_dim: hd as usize,
            };
            let heads = kvh * 2;
            let q = normal(&mut rng, lens.len() * (heads * hd) as usize);
            let want = reference::decode(
                &host.view(),
                &AttnParams::new(heads as usize, hd as usize),
                &q,
                &view.kv_indptr,
                &view.kv_indices,
                &view.seq_lens,
            );
            for kernel in [Kernel::Serial, Kernel::Tiled] {
                let attn = PagedAttention::new(
                    &gpu,
                    &cache,
                    heads,
                    &pagedattn::gpu::AttentionConfig::new().kernel(kernel),
                )
                .unwrap();
                let out =
                    decode_view(&attn, &gpu, &cache, &q, &view, &AttnOptions::default()).unwrap();
                let e = rel_l2(&out, &want);
                eprintln!("{name} [{kernel}]: rel L2 {e:.3e}");
                assert!(e < 1e-5, "{name} [{kernel}]: {e:.3e} (seed {s})");
            }
        }
    }
    assert!(padded >= 2, "{padded} shapes needed the padding");
}
