//! `KvCache::export_blocks` / `import_blocks` on a real adapter: blocks of
//! a layer range go to caller-owned bytes with their `KvLayout` and come
//! back into other block ids of another pool, byte-identical and decoding
//! bit-identically, for every dtype (quantized side words, and pools whose
//! per-layer state was set alike); imports whose descriptor, bytes or
//! blocks do not match are refused and write nothing.

use crate::common;

use common::{block_bytes as block, gpu, raw_layer as raw, seed};
use pagedattn::gpu::{
    AttnOptions, Gpu, GpuError, KvCache, KvCacheConfig, KvDtype, KvLayout, PagedAttention,
    TransferError, KV_LAYOUT_BYTES, KV_LAYOUT_VERSION, K_OUTLIERS, K_OUTLIER_UNUSED,
};
use pagedattn::rng::SplitMix64;

fn all_raw(gpu: &Gpu, cache: &KvCache) -> Vec<[Vec<u8>; 2]> {
    (0..cache.config().num_layers)
        .map(|l| raw(gpu, cache, l))
        .collect()
}

fn config(dtype: KvDtype) -> KvCacheConfig {
    KvCacheConfig::new(12, 4, 2, 16)
        .with_layers(3)
        .with_dtype(dtype)
}

/// A pool with its per-layer state set as a calibrated engine would (fp8
/// scales from `scale`, int8 K smoothing, both differing by layer; outlier
/// channels), then every slot of
/// every layer written with random K/V.
fn pool(gpu: &Gpu, cfg: KvCacheConfig, scale: f32, rng: Option<&mut SplitMix64>) -> KvCache {
    let cache = KvCache::new(gpu, cfg).unwrap();
    let h = cfg.num_kv_heads as usize;
    for l in 0..cfg.num_layers {
        match cfg.dtype {
            KvDtype::Fp8E4M3 => {
                let s: Vec<f32> = (0..h)
                    .map(|i| scale * (1.0 + i as f32 + l as f32) / 64.0)
                    .collect();
                cache.set_fp8_scales(gpu, l, &s, &s).unwrap();
            }
            KvDtype::Int8 => {
                let f: Vec<f32> = (0..h * cfg.head_dim as usize)
                    .map(|i| scale * (1.0 + ((i + l as usize) % 5) as f32 * 0.25))
                    .collect();
                cache.set_k_smoothing(gpu, l, &f).unwrap();
            }
            _ => {}
        }
        if cfg.dtype.quantized() {
            let mut ch = vec![K_OUTLIER_UNUSED; h * K_OUTLIERS as usize];
            ch[0] = 3;
            if h > 1 {
                ch[K_OUTLIERS as usize] = 7;
            }
            cache.set_k_outlier_channels(gpu, l, &ch).unwrap();
        }
    }
    if let Some(rng) = rng {
        let slots: Vec<u32> = (0..cfg.num_blocks * cfg.block_size).collect();
        let n = slots.len() * (cfg.num_kv_heads * cfg.head_dim) as usize;
        for l in 0..cfg.num_layers {
            let (k, v) = (rng.signed_vec(n), rng.signed_vec(n));
            cache.write_kv(gpu, l, &k, &v, &slots).unwrap();
        }
    }
    cache
}

/// Decode of one sequence over `table` (full blocks) on `layer`.
fn decode(gpu: &Gpu, cache: &KvCache, layer: u32, table: &[u32], q: &[f32]) -> Vec<f32> {
    let attn = PagedAttention::new(gpu, cache, 4, &Default::default()).unwrap();
    let len = table.len() as u32 * cache.config().block_size;
    attn.decode(
        gpu,
        cache,
        layer,
        q,
        &[0, table.len() as u32],
        table,
        &[len],
        &AttnOptions::default(),
    )
    .unwrap()
}

/// Every dtype: five blocks (a run of three consecutive and two loose) of
/// all three layers exported from pool A, the descriptor through its
/// bytes, imported into other ids of a fresh pool B set up alike: each
/// block byte-identical, B's other blocks untouched, and decode over the
/// imported blocks bit-identical to decode over the originals.
#[test]
fn export_import_round_trips_every_dtype_between_pools() {
    let Some(gpu) = gpu() else { return };
    for dtype in KvDtype::ALL {
        let mut rng = SplitMix64::new(seed(&format!("transfer {}", dtype.name())));
        let cfg = config(dtype);
        let a = pool(&gpu, cfg, 1.0, Some(&mut rng));
        let b = pool(&gpu, cfg, 1.0, None);
        let (from, to) = ([3u32, 4, 5, 9, 1], [6u32, 7, 8, 0, 11]);
        let n = a.export_bytes(from.len(), 0..3).unwrap();
        let mut bytes = vec![0xA5u8; n as usize];
        let layout = a.export_blocks(&gpu, &from, 0..3, &mut bytes).unwrap();
        assert_eq!(layout.block_bytes() * from.len() as u64, n);
        assert_eq!(layout.version, KV_LAYOUT_VERSION);
        assert_eq!(layout, a.kv_layout(&gpu, 0..3).unwrap());
        let wire = layout.to_bytes();
        assert_eq!(wire.len(), KV_LAYOUT_BYTES);
        let layout = KvLayout::from_bytes(&wire).unwrap();
        let before_a = all_raw(&gpu, &a);
        let before_b = all_raw(&gpu, &b);
        b.import_blocks(&gpu, &layout, &bytes, &to).unwrap();
        let after_b = all_raw(&gpu, &b);
        for l in 0..3usize {
            for kv in 0..2 {
                for blk in 0..cfg.num_blocks {
                    let got = block(&cfg, &after_b[l][kv], blk, kv == 0);
                    let want = match to.iter().position(|&t| t == blk) {
                        Some(i) => block(&cfg, &before_a[l][kv], from[i], kv == 0),
                        None => block(&cfg, &before_b[l][kv], blk, kv == 0),
                    };
                    assert!(
                        got == want,
                        "{} layer {l} kv {kv} block {blk}: not what the import should leave",
                        dtype.name()
                    );
                }
            }
            // The per-layer tail (scales, smoothing, channels) is B's own.
            let t = cfg.tail_offset() as usize;
            assert_eq!(after_b[l][0][t..], before_b[l][0][t..]);
        }
        // Exporting the imported blocks from B gives the same bytes.
        let mut again = vec![0u8; n as usize];
        let layout_b = b.export_blocks(&gpu, &to, 0..3, &mut again).unwrap();
        assert_eq!(layout_b, layout);
        assert!(again == bytes, "{}: re-export differs", dtype.name());
        let q = rng.signed_vec(4 * 16);
        for l in 0..3 {
            let da = decode(&gpu, &a, l, &from, &q);
            let db = decode(&gpu, &b, l, &to, &q);
            assert!(da.iter().all(|x| x.is_finite()));
            assert!(
                da == db,
                "{} layer {l}: decode differs after import",
                dtype.name()
            );
        }
        eprintln!(
            "{}: {} blocks x 3 layers, {} bytes a block, round trip byte-identical",
            dtype.name(),
            from.len(),
            layout.block_bytes()
        );
    }
}

/// A layer range moves those layers only (a transfer may overlap compute
/// layer by layer); its descriptor says which, and a descriptor forged to
/// name other layers is refused where their state differs (int8 K
/// smoothing differs by layer here).
#[test]
fn a_layer_range_moves_those_layers_only() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("transfer layer range"));
    let cfg = config(KvDtype::Int8);
    let a = pool(&gpu, cfg, 1.0, Some(&mut rng));
    let b = pool(&gpu, cfg, 1.0, Some(&mut rng));
    let mut bytes = vec![0u8; a.export_bytes(2, 1..2).unwrap() as usize];
    let layout = a.export_blocks(&gpu, &[2, 10], 1..2, &mut bytes).unwrap();
    assert_eq!(layout.layers, 1..2);
    let before_a = all_raw(&gpu, &a);
    let before_b = all_raw(&gpu, &b);
    b.import_blocks(&gpu, &layout, &bytes, &[5, 4]).unwrap();
    let after_b = all_raw(&gpu, &b);
    assert_eq!(after_b[0], before_b[0], "layer 0 untouched");
    assert_eq!(after_b[2], before_b[2], "layer 2 untouched");
    for kv in 0..2 {
        for (f, t) in [(2u32, 5u32), (10, 4)] {
            assert_eq!(
                block(&cfg, &after_b[1][kv], t, kv == 0),
                block(&cfg, &before_a[1][kv], f, kv == 0)
            );
        }
    }
    let mut other = layout.clone();
    other.layers = 2..3;
    let e = b.import_blocks(&gpu, &other, &bytes, &[5, 4]).unwrap_err();
    assert!(
        matches!(
            e,
            GpuError::Transfer(TransferError::LayerState | TransferError::Mismatch { .. })
        ),
        "{e}"
    );
}

/// Runs `f`, which must be refused with an error `want` accepts, and
/// leave `pool` as it was.
fn refused(
    gpu: &Gpu,
    pool: &KvCache,
    what: &str,
    f: impl FnOnce() -> Result<(), GpuError>,
    want: fn(&TransferError) -> bool,
) {
    let before = all_raw(gpu, pool);
    match f() {
        Err(GpuError::Transfer(e)) if want(&e) => {
            assert!(!e.to_string().is_empty());
            eprintln!("{what}: refused: {e}");
        }
        other => panic!("{what}: {other:?}"),
    }
    assert!(all_raw(gpu, pool) == before, "{what}: the pool changed");
}

/// An import is a pool write from elsewhere: payloads no write could
/// store (all `0xFF`: NaN in f32, f16, bf16 and the int8 row scales; all
/// `0x7F`: past `KV_MAX`) are refused with nothing written, on every dtype
/// that can hold such a value; fp8 reads every byte as a finite value, so
/// it takes them and decode over them stays finite.
#[test]
fn imports_of_values_no_write_stores_are_refused() {
    let Some(gpu) = gpu() else { return };
    for dtype in KvDtype::ALL {
        let mut rng = SplitMix64::new(seed(&format!("bad payload {}", dtype.name())));
        let cfg = config(dtype);
        let a = pool(&gpu, cfg, 1.0, Some(&mut rng));
        let mut bytes = vec![0u8; a.export_bytes(2, 0..3).unwrap() as usize];
        let layout = a.export_blocks(&gpu, &[0, 1], 0..3, &mut bytes).unwrap();
        let b = pool(&gpu, cfg, 1.0, Some(&mut rng));
        for fill in [0xFFu8, 0x7F] {
            let bad = vec![fill; bytes.len()];
            let what = format!("{} payload of {fill:#x}", dtype.name());
            if dtype == KvDtype::Fp8E4M3 {
                b.import_blocks(&gpu, &layout, &bad, &[3, 4]).unwrap();
                let q = rng.signed_vec(4 * 16);
                let out = decode(&gpu, &b, 1, &[3, 4], &q);
                assert!(
                    out.iter().all(|x| x.is_finite()),
                    "{what}: decode not finite"
                );
            } else {
                refused(
                    &gpu,
                    &b,
                    &what,
                    || b.import_blocks(&gpu, &layout, &bad, &[3, 4]),
                    |e| matches!(e, TransferError::Value { .. }),
                );
            }
        }
        // One bad value among good ones is enough, wherever it is.
        if dtype != KvDtype::Fp8E4M3 {
            let mut one = bytes.clone();
            let last = one.len() - 2;
            one[last..].copy_from_slice(&[0xFF, 0xFF]);
            refused(
                &gpu,
                &b,
                "one NaN at the end",
                || b.import_blocks(&gpu, &layout, &one, &[3, 4]),
                |e| matches!(e, TransferError::Value { .. }),
            );
        }
        // The real bytes still import.
        b.import_blocks(&gpu, &layout, &bytes, &[3, 4]).unwrap();
    }
}

/// Every way an import can be wrong is refused with its own error, before
/// anything is written: another shape (dtype, block size, heads, head_dim),
/// other per-layer state, another version, descriptor bytes that are not
/// one, truncated or padded bytes, blocks outside the pool or written
/// twice, layers the pool lacks. Exports refuse their bad arguments too.
#[test]
fn mismatched_truncated_or_corrupt_imports_are_refused() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("transfer refusals"));
    let cfg = config(KvDtype::Fp8E4M3);
    let a = pool(&gpu, cfg, 1.0, Some(&mut rng));
    let mut bytes = vec![0u8; a.export_bytes(3, 0..3).unwrap() as usize];
    let layout = a.export_blocks(&gpu, &[0, 1, 2], 0..3, &mut bytes).unwrap();
    let to = [4u32, 5, 6];

    // Other shapes.
    let shapes: [(&str, KvCacheConfig); 4] = [
        (
            "dtype",
            KvCacheConfig {
                dtype: KvDtype::Int8,
                ..cfg
            },
        ),
        (
            "block_size",
            KvCacheConfig {
                block_size: 8,
                ..cfg
            },
        ),
        (
            "num_kv_heads",
            KvCacheConfig {
                num_kv_heads: 1,
                ..cfg
            },
        ),
        (
            "head_dim",
            KvCacheConfig {
                head_dim: 32,
                ..cfg
            },
        ),
    ];
    for (field, c) in shapes {
        let b = pool(&gpu, c, 1.0, Some(&mut rng));
        refused(
            &gpu,
            &b,
            &format!("another {field}"),
            || b.import_blocks(&gpu, &layout, &bytes, &to),
            |e| matches!(e, TransferError::Mismatch { .. }),
        );
    }
    // Same shape, other fp8 scales: the bytes would be misread.
    let b = pool(&gpu, cfg, 2.0, Some(&mut rng));
    refused(
        &gpu,
        &b,
        "other fp8 scales",
        || b.import_blocks(&gpu, &layout, &bytes, &to),
        |e| *e == TransferError::LayerState,
    );
    // Fewer layers than the descriptor's.
    let b1 = pool(
        &gpu,
        KvCacheConfig {
            num_layers: 2,
            ..cfg
        },
        1.0,
        Some(&mut rng),
    );
    refused(
        &gpu,
        &b1,
        "layers the pool lacks",
        || b1.import_blocks(&gpu, &layout, &bytes, &to),
        |e| matches!(e, TransferError::Layers { .. }),
    );

    let b = pool(&gpu, cfg, 1.0, Some(&mut rng));
    // Another version.
    let mut v2 = layout.clone();
    v2.version = KV_LAYOUT_VERSION + 1;
    refused(
        &gpu,
        &b,
        "another version",
        || b.import_blocks(&gpu, &v2, &bytes, &to),
        |e| matches!(e, TransferError::Version { .. }),
    );
    // Descriptor bytes that are not one.
    let wire = layout.to_bytes();
    let mut bad_magic = wire;
    bad_magic[0] ^= 1;
    let mut bad_version = wire;
    bad_version[8] ^= 1;
    let mut bad_dtype = wire;
    bad_dtype[20] = 99;
    let mut bad_layers = wire;
    bad_layers[40..44].copy_from_slice(&0u32.to_le_bytes());
    for (what, w) in [
        ("magic", &bad_magic[..]),
        ("dtype", &bad_dtype[..]),
        ("layers", &bad_layers[..]),
        ("length", &wire[..KV_LAYOUT_BYTES - 1]),
    ] {
        let e = KvLayout::from_bytes(w).unwrap_err();
        assert!(matches!(e, TransferError::Descriptor(_)), "{what}: {e}");
    }
    assert!(matches!(
        KvLayout::from_bytes(&bad_version),
        Err(TransferError::Version { .. })
    ));
    // A flipped shape byte reads, then is refused by the import.
    let mut bad_hd = wire;
    bad_hd[32] ^= 0x20;
    let l = KvLayout::from_bytes(&bad_hd).unwrap();
    refused(
        &gpu,
        &b,
        "a corrupt head_dim",
        || b.import_blocks(&gpu, &l, &bytes, &to),
        |e| {
            matches!(
                e,
                TransferError::Mismatch {
                    field: "head_dim",
                    ..
                }
            )
        },
    );
    // Truncated, padded, or for another block count.
    refused(
        &gpu,
        &b,
        "truncated bytes",
        || b.import_blocks(&gpu, &layout, &bytes[..bytes.len() - 4], &to),
        |e| matches!(e, TransferError::Bytes { .. }),
    );
    let mut long = bytes.clone();
    long.push(0);
    refused(
        &gpu,
        &b,
        "padded bytes",
        || b.import_blocks(&gpu, &layout, &long, &to),
        |e| matches!(e, TransferError::Bytes { .. }),
    );
    refused(
        &gpu,
        &b,
        "fewer blocks",
        || b.import_blocks(&gpu, &layout, &bytes, &to[..2]),
        |e| matches!(e, TransferError::Bytes { .. }),
    );
    // Blocks outside the pool, or one written twice.
    refused(
        &gpu,
        &b,
        "a block past the pool",
        || b.import_blocks(&gpu, &layout, &bytes, &[4, 5, 12]),
        |e| {
            matches!(
                e,
                TransferError::Block {
                    block: 12,
                    pool: 12
                }
            )
        },
    );
    refused(
        &gpu,
        &b,
        "a block twice",
        || b.import_blocks(&gpu, &layout, &bytes, &[4, 5, 4]),
        |e| *e == TransferError::BlockTwice { block: 4 },
    );

    // Exports.
    let mut out = vec![0u8; bytes.len()];
    for (what, r) in [
        (
            "empty layers",
            a.export_blocks(&gpu, &[0, 1, 2], 1..1, &mut out),
        ),
        (
            "layers past the pool",
            a.export_blocks(&gpu, &[0, 1, 2], 2..4, &mut out),
        ),
        (
            "a block past the pool",
            a.export_blocks(&gpu, &[0, 1, 12], 0..3, &mut out),
        ),
        (
            "a short buffer",
            a.export_blocks(&gpu, &[0, 1], 0..3, &mut out),
        ),
    ] {
        let e = r.unwrap_err();
        assert!(matches!(e, GpuError::Transfer(_)), "{what}: {e}");
    }
    // An empty transfer is a no-op, not an error.
    let l = a.export_blocks(&gpu, &[], 0..3, &mut []).unwrap();
    b.import_blocks(&gpu, &l, &[], &[]).unwrap();
}

/// Descriptor bytes: a round trip is exact, and no byte string panics.
#[test]
fn descriptor_bytes_round_trip_and_never_panic() {
    let layout = KvLayout {
        version: KV_LAYOUT_VERSION,
        library: [0, 1, 0],
        dtype: KvDtype::Bf16,
        block_size: 16,
        num_kv_heads: 8,
        head_dim: 128,
        layer_group: 0,
        layers: 4..30,
        parts: [32768, 0, 32768, 0],
        layer_state: [7; 32],
    };
    assert_eq!(KvLayout::from_bytes(&layout.to_bytes()), Ok(layout.clone()));
    let mut rng = SplitMix64::new(seed("descriptor bytes"));
    let wire = layout.to_bytes();
    for i in 0..20000 {
        let mut b = wire.to_vec();
        match i % 3 {
            0 => {
                let at = rng.below(b.len() as u64) as usize;
                b[at] = rng.below(256) as u8;
            }
            1 => b.truncate(rng.below(b.len() as u64 + 1) as usize),
            _ => b = (0..rng.below(200)).map(|_| rng.below(256) as u8).collect(),
        }
        if let Ok(l) = KvLayout::from_bytes(&b) {
            assert!(l.layers.start < l.layers.end);
            let _ = l.block_bytes();
        }
    }
}
