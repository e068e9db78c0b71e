//! `KvCache::swap_out` / `swap_in` on a real adapter: blocks of every layer
//! go to host swap space and come back byte-identical (int8 row scales
//! with them) into other pool blocks, for every dtype; bad pairs are
//! refused. (Decode after a swap round trip is checked against the f64
//! reference by the demo test, `cli/tests/demo.rs`.)

use crate::common;

use common::{block_bytes as block, gpu, raw_layer as raw, seed};
use pagedattn::gpu::{GpuError, KvCache, KvCacheConfig, KvDtype};
use pagedattn::rng::SplitMix64;

fn fill(gpu: &pagedattn::gpu::Gpu, cache: &KvCache, rng: &mut SplitMix64) {
    let cfg = cache.config();
    let slots: Vec<u32> = (0..cfg.num_blocks * cfg.block_size).collect();
    let n = slots.len() * (cfg.num_kv_heads * cfg.head_dim) as usize;
    for l in 0..cfg.num_layers {
        let (k, v) = (rng.signed_vec(n), rng.signed_vec(n));
        cache.write_kv(gpu, l, &k, &v, &slots).unwrap();
    }
}

#[test]
fn swap_round_trip_is_byte_identical() {
    let Some(gpu) = gpu() else { return };
    for dtype in KvDtype::ALL {
        let mut rng = SplitMix64::new(seed(&format!("swap {}", dtype.name())));
        let cfg = KvCacheConfig::new(12, 4, 2, 16)
            .with_layers(3)
            .with_dtype(dtype);
        let cache = KvCache::new(&gpu, cfg).unwrap();
        fill(&gpu, &cache, &mut rng);
        let before: Vec<[Vec<u8>; 2]> = (0..3).map(|l| raw(&gpu, &cache, l)).collect();
        let mut space = cache.swap_space(6).unwrap();
        // A run of three consecutive blocks, and two loose ones.
        let out = [[3u32, 5], [4, 0], [5, 1], [9, 3], [1, 2]];
        cache.swap_out(&gpu, &out, &mut space).unwrap();
        // The pool blocks are reused (overwritten) before the swap-in.
        fill(&gpu, &cache, &mut rng);
        let back = [[5u32, 6], [0, 7], [1, 8], [3, 0], [2, 11]];
        cache.swap_in(&gpu, &back, &space).unwrap();
        for l in 0..3u32 {
            let after = raw(&gpu, &cache, l);
            for kv in 0..2 {
                for (o, b) in out.iter().zip(&back) {
                    assert_eq!(o[1], b[0]);
                    assert_eq!(
                        block(&cfg, &after[kv], b[1], kv == 0),
                        block(&cfg, &before[l as usize][kv], o[0], kv == 0),
                        "{} layer {l} kv {kv}: block {} -> host {} -> block {}",
                        dtype.name(),
                        o[0],
                        o[1],
                        b[1]
                    );
                }
            }
        }
        // A pool block read twice is fine (two groups may share it).
        cache.swap_out(&gpu, &[[1, 0], [1, 2]], &mut space).unwrap();
        // Bad pairs are refused before any GPU work: out of range, or a
        // host block written twice.
        for bad in [vec![[12u32, 0]], vec![[0, 6]], vec![[1, 0], [2, 0]]] {
            match cache.swap_out(&gpu, &bad, &mut space) {
                Err(GpuError::Pool(_)) => {}
                r => panic!("{bad:?}: {r:?}"),
            }
        }
        let other = KvCache::new(
            &gpu,
            KvCacheConfig {
                num_blocks: 8,
                ..cfg
            },
        )
        .unwrap();
        assert!(matches!(
            other.swap_in(&gpu, &[[0, 0]], &space),
            Err(GpuError::Pool(_))
        ));
    }
}

/// A group swapped out by the block manager and back in (to other blocks)
/// decodes to the same bits, for every dtype: the tables changed, the K/V
/// did not.
#[test]
fn decode_after_a_swap_round_trip_is_identical() {
    use pagedattn::blocks::{BlockManager, BlockManagerConfig};
    use pagedattn::gpu::{AttnOptions, PagedAttention};
    let Some(gpu) = gpu() else { return };
    for dtype in KvDtype::ALL {
        let mut rng = SplitMix64::new(seed(&format!("swap decode {}", dtype.name())));
        let cfg = KvCacheConfig::new(40, 4, 2, 16)
            .with_layers(2)
            .with_dtype(dtype);
        let cache = KvCache::new(&gpu, cfg).unwrap();
        let mut m = BlockManager::new(BlockManagerConfig::new(40, 4).with_swap_space(40)).unwrap();
        m.scramble_free_list(7);
        // A prompt, two samples forked off it (shared blocks), and a bystander.
        let a = m.add_sequence(&(0..21).collect::<Vec<u32>>()).unwrap();
        let by = m.add_sequence(&[9; 7]).unwrap();
        let row = (cfg.num_kv_heads * cfg.head_dim) as usize;
        let write = |m: &mut BlockManager, ids: &[_], rng: &mut SplitMix64| {
            let view = m.batch_view(ids).unwrap();
            cache.copy_blocks(&gpu, &view.copies).unwrap();
            let n = view.slot_mapping.len() * row;
            for l in 0..2 {
                let (k, v) = (rng.signed_vec(n), rng.signed_vec(n));
                cache.write_kv(&gpu, l, &k, &v, &view.slot_mapping).unwrap();
            }
        };
        write(&mut m, &[a, by], &mut rng);
        let b = m.fork(a).unwrap();
        m.append(a, &[1]).unwrap();
        m.append(b, &[2]).unwrap();
        write(&mut m, &[a, b, by], &mut rng);
        let attn = PagedAttention::new(&gpu, &cache, 4, &Default::default()).unwrap();
        let q = rng.signed_vec(2 * 4 * 16);
        let decode = |m: &BlockManager| -> Vec<Vec<f32>> {
            let (ta, tb) = (m.block_table(a).unwrap(), m.block_table(b).unwrap());
            let indices: Vec<u32> = ta.iter().chain(tb).copied().collect();
            let indptr = [0, ta.len() as u32, indices.len() as u32];
            let lens = [m.seq_len(a).unwrap() as u32, m.seq_len(b).unwrap() as u32];
            (0..2)
                .map(|l| {
                    attn.decode(
                        &gpu,
                        &cache,
                        l,
                        &q,
                        &indptr,
                        &indices,
                        &lens,
                        &AttnOptions::default(),
                    )
                    .unwrap()
                })
                .collect()
        };
        let before = decode(&m);
        let old = m.block_table(a).unwrap().to_vec();
        let mut space = cache.swap_space(40).unwrap();
        let out = m.swap_out(&[a, b]).unwrap();
        cache.swap_out(&gpu, &out, &mut space).unwrap();
        // The freed blocks are reused and overwritten before the swap-in.
        let c = m.add_sequence(&[5; 40]).unwrap();
        write(&mut m, &[c, by], &mut rng);
        m.free(c).unwrap();
        let back = m.swap_in(&[a, b]).unwrap();
        cache.swap_in(&gpu, &back, &space).unwrap();
        assert_ne!(
            m.block_table(a).unwrap(),
            &old[..],
            "{}: same blocks",
            dtype.name()
        );
        let after = decode(&m);
        for (x, y) in before.iter().zip(&after) {
            assert!(x.iter().all(|v| v.is_finite()));
            assert!(
                x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{}: decode changed across the swap",
                dtype.name()
            );
        }
    }
}
