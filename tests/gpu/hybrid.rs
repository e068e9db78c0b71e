//! A hybrid stack on a real adapter: window layers and full layers in two
//! groups, each group its own pool (`KvCache`) and tables
//! (`HybridManager`), decoded step after step past the window with a fork,
//! while the window group releases the blocks behind its window. Every
//! layer's output, on a NaN-poisoned buffer, matches the f64 reference over
//! the sequence's whole history with the layer's window: the released
//! blocks were never read.

use crate::common::{self, gpu};
use pagedattn::blocks::{GroupKind, HybridManager, HybridSeq, LayerGroup, LayerGroups, RELEASED};
use pagedattn::gpu::{AttnOptions, KvCache, KvCacheConfig, PagedAttention};
use pagedattn::reference::{self, rel_l2, AttnParams, HostPool, Stored};
use pagedattn::rng::SplitMix64;

const KVH: usize = 2;
const HEADS: usize = 4;
const HD: usize = 64;
const BS: u32 = 8;
const WINDOW: u32 = 24;
/// Logical blocks per sequence in the reference pools (the whole history).
const REF_BLOCKS: usize = 16;
/// f32 pools and activations: what is left is f32 accumulation.
const TOL: f64 = 1e-5;

#[test]
fn window_layers_release_blocks_and_stay_exact() {
    let Some(gpu) = gpu() else { return };
    let s = common::seed("hybrid decode");
    let mut rng = SplitMix64::new(s);
    // Layers 0 and 2 attend through a window, 1 and 3 fully.
    let layout = LayerGroups::new(
        4,
        vec![
            LayerGroup {
                kind: GroupKind::Window(WINDOW),
                layers: vec![0, 2],
            },
            LayerGroup {
                kind: GroupKind::Full,
                layers: vec![1, 3],
            },
        ],
    )
    .unwrap();
    let pools = [24u32, 48];
    let mut m = HybridManager::new(layout.clone(), &pools, BS, false).unwrap();
    let caches: Vec<KvCache> = pools
        .iter()
        .map(|&n| {
            let cfg = KvCacheConfig::new(n, BS, KVH as u32, HD as u32).with_layers(2);
            KvCache::new(&gpu, cfg).unwrap()
        })
        .collect();
    let attns: Vec<PagedAttention> = caches
        .iter()
        .map(|c| PagedAttention::new(&gpu, c, HEADS as u32, &Default::default()).unwrap())
        .collect();
    let opts = [
        AttnOptions {
            sliding_window: Some(WINDOW),
            ..Default::default()
        },
        AttnOptions::default(),
    ];
    // The reference: per layer, every sequence's whole history in logical
    // order (sequence i at blocks i * REF_BLOCKS ..).
    let mut refs: Vec<HostPool> = (0..4)
        .map(|_| HostPool::new(4 * REF_BLOCKS, KVH, BS as usize, HD))
        .collect();
    let row = KVH * HD;
    let mut seqs: Vec<HybridSeq> = Vec::new();
    let mut lens: Vec<usize> = Vec::new();
    for len in [30usize, 13] {
        let prompt: Vec<u32> = (0..len as u32).collect();
        seqs.push(m.add_sequence(&prompt).unwrap());
        lens.push(0);
    }
    let mut released_seen = 0;
    for step in 0..40 {
        if step == 3 {
            // A sample of the first sequence shares its blocks in both groups.
            let kid = m.fork(&seqs[0]).unwrap();
            for r in &mut refs {
                let (src, dst) = (0u32, 2 * REF_BLOCKS as u32);
                for b in 0..REF_BLOCKS as u32 {
                    r.copy(src + b, dst + b);
                }
            }
            seqs.push(kid);
            lens.push(lens[0]);
        }
        if step > 0 {
            for s in &seqs {
                m.append(s, &[step]).unwrap();
            }
        }
        let views = m.batch_view(&seqs).unwrap();
        released_seen += views[0]
            .kv_indices
            .iter()
            .filter(|&&b| b == RELEASED)
            .count();
        for (g, v) in views.iter().enumerate() {
            caches[g].copy_blocks(&gpu, &v.copies).unwrap();
        }
        let new: Vec<usize> = (0..seqs.len())
            .map(|i| (views[0].new_indptr[i + 1] - views[0].new_indptr[i]) as usize)
            .collect();
        let ntok: usize = new.iter().sum();
        for layer in 0..4u32 {
            let (g, slot) = layout.group_of(layer).unwrap();
            let (k, v) = (rng.signed_vec(ntok * row), rng.signed_vec(ntok * row));
            caches[g]
                .write_kv(&gpu, slot as u32, &k, &v, &views[g].slot_mapping)
                .unwrap();
            // The reference's logical slots of the same tokens.
            let mut logical = Vec::with_capacity(ntok);
            for (i, &n) in new.iter().enumerate() {
                let base = (i * REF_BLOCKS) as u32 * BS;
                logical.extend((lens[i]..lens[i] + n).map(|p| base + p as u32));
            }
            refs[layer as usize].write(&logical, &k, &v, Stored::Exact);
        }
        for (i, &n) in new.iter().enumerate() {
            lens[i] += n;
        }
        // Every layer's decode over its group's (released) tables against
        // the whole history with its window.
        let indptr: Vec<u32> = (0..=seqs.len() as u32)
            .map(|i| i * REF_BLOCKS as u32)
            .collect();
        let indices: Vec<u32> = (0..(seqs.len() * REF_BLOCKS) as u32).collect();
        let seq_lens: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
        for layer in 0..4u32 {
            let (g, slot) = layout.group_of(layer).unwrap();
            let q = rng.signed_vec(seqs.len() * HEADS * HD);
            let v = &views[g];
            let got = attns[g]
                .decode(
                    &gpu,
                    &caches[g],
                    slot as u32,
                    &q,
                    &v.kv_indptr,
                    &v.kv_indices,
                    &v.seq_lens,
                    &opts[g],
                )
                .unwrap();
            assert_eq!(v.seq_lens, seq_lens, "the group sees every token");
            let mut p = AttnParams::new(HEADS, HD);
            p.sliding_window = opts[g].sliding_window;
            let want = reference::decode(
                &refs[layer as usize].view(),
                &p,
                &q,
                &indptr,
                &indices,
                &seq_lens,
            );
            assert!(got.iter().all(|x| x.is_finite()), "NaN at step {step}");
            let e = rel_l2(&got, &want);
            assert!(
                e < TOL,
                "step {step} layer {layer}: rel L2 {e:e} >= {TOL} (seed {s})"
            );
        }
        for s in &seqs {
            let held = m.blocks_held(s).unwrap();
            // The window of 24 reads at most 4 blocks of 8.
            assert!(held[0] <= 4, "step {step}: {held:?}");
        }
    }
    assert!(released_seen > 0, "the window group released blocks");
    let stats = m.stats();
    eprintln!(
        "after 40 steps: window group {} of {} blocks used, full group {} of {}; {released_seen} released entries seen",
        stats[0].used, stats[0].total, stats[1].used, stats[1].total
    );
    assert!(stats[0].used < stats[1].used);
}

/// Each layer group's pool exports blocks whose layout names the group;
/// another pool of that group imports them byte for byte, and a pool of
/// another group (of the same shape otherwise) refuses them by the field,
/// unchanged.
#[test]
fn exported_blocks_name_their_layer_group() {
    use pagedattn::gpu::{GpuError, TransferError};
    let Some(gpu) = gpu() else { return };
    let s = common::seed("hybrid export");
    let mut rng = SplitMix64::new(s);
    let cfg = |g: u16| {
        KvCacheConfig::new(8, BS, KVH as u32, HD as u32)
            .with_layers(2)
            .with_layer_group(g)
    };
    let src = KvCache::new(&gpu, cfg(1)).unwrap();
    let slots: Vec<u32> = (0..8 * BS).collect();
    let n = slots.len() * KVH * HD;
    for l in 0..2 {
        let (k, v) = (rng.signed_vec(n), rng.signed_vec(n));
        src.write_kv(&gpu, l, &k, &v, &slots).unwrap();
    }
    let bytes_of = |c: &KvCache, blocks: &[u32]| {
        let mut out = vec![0u8; c.export_bytes(blocks.len(), 0..2).unwrap() as usize];
        let l = c.export_blocks(&gpu, blocks, 0..2, &mut out).unwrap();
        (l, out)
    };
    let (layout, bytes) = bytes_of(&src, &[3, 5]);
    assert_eq!(layout.layer_group, 1);
    assert_eq!(
        pagedattn::gpu::KvLayout::from_bytes(&layout.to_bytes()).unwrap(),
        layout
    );
    // The same group's pool takes them.
    let same = KvCache::new(&gpu, cfg(1)).unwrap();
    same.import_blocks(&gpu, &layout, &bytes, &[0, 6]).unwrap();
    assert_eq!(bytes_of(&same, &[0, 6]).1, bytes);
    // Another group's refuses them, and is as it was.
    let other = KvCache::new(&gpu, cfg(0)).unwrap();
    let before = bytes_of(&other, &[0, 6]).1;
    let e = other
        .import_blocks(&gpu, &layout, &bytes, &[0, 6])
        .unwrap_err();
    assert!(
        matches!(
            e,
            GpuError::Transfer(TransferError::Mismatch {
                field: "layer_group",
                got: 1,
                want: 0
            })
        ),
        "{e}"
    );
    assert_eq!(bytes_of(&other, &[0, 6]).1, before);
}
