//! The bad-input matrix: every row feeds the library something wrong and
//! checks that it answers with a clear error (or a documented, bounds-safe
//! result) and that nothing changed: the block manager equals a copy taken
//! before the call, the GPU pool reads back the same bytes.
//!
//! Rows without a GPU run everywhere; GPU rows use `common::gpu()` (skipped
//! without an adapter unless `PAGEDATTN_REQUIRE_GPU=1`). See GUARANTEES.md.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use pagedattn::blocks::{BatchView, BlockError, BlockManager, BlockManagerConfig, SeqId, RELEASED};
use pagedattn::gpu::{
    AttnOptions, BatchError, BindingError, DecodeTables, Gpu, GpuError, KvCache, KvCacheConfig,
    KvDtype, PagedAttention, PoolError, Split,
};
use pagedattn::reference::{self, rel_l2, AttnParams};
use pagedattn::rng::SplitMix64;

// ---------------------------------------------------------------------------
// Block manager (no GPU)
// ---------------------------------------------------------------------------

/// A manager with a forked pair, a pending copy and an unviewed sequence, so
/// that "unchanged" covers every part of its state.
fn busy_manager(prefix: bool) -> (BlockManager, Vec<SeqId>) {
    let cfg = BlockManagerConfig {
        max_seq_len: 64,
        ..BlockManagerConfig::new(16, 4).with_prefix_caching(prefix)
    };
    let mut m = BlockManager::new(cfg).unwrap();
    let a = m.add_sequence(&[1, 2, 3, 4, 5, 6]).unwrap();
    m.batch_view(&[a]).unwrap();
    let b = m.fork(a).unwrap();
    m.append(b, &[7]).unwrap(); // copy-on-write pending
    let c = m.add_sequence(&[9; 9]).unwrap(); // not viewed yet
    assert_eq!(m.pending_copies().len(), 1);
    (m, vec![a, b, c])
}

/// Runs `f` on the manager and checks it failed with `want` and changed nothing.
#[track_caller]
fn refused<T: std::fmt::Debug>(
    m: &mut BlockManager,
    want: BlockError,
    f: impl FnOnce(&mut BlockManager) -> Result<T, BlockError>,
) {
    let before = m.clone();
    let got = f(m);
    match got {
        Err(e) => assert_eq!(e, want),
        Ok(v) => panic!("expected {want:?}, got Ok({v:?})"),
    }
    assert!(*m == before, "a failing call changed the manager");
    assert!(!want.to_string().is_empty());
}

fn every_id_call_refuses(m: &mut BlockManager, id: SeqId) {
    let e = BlockError::UnknownSequence(id);
    refused(m, e.clone(), |m| m.append(id, &[1]));
    refused(m, e.clone(), |m| m.append(id, &[]));
    refused(m, e.clone(), |m| m.fork(id));
    refused(m, e.clone(), |m| m.free(id));
    refused(m, e.clone(), |m| m.batch_view(&[id]));
    let live = m.sequence_ids();
    refused(m, e.clone(), |m| m.batch_view(&[live[0], id]));
    let mut view = BatchView::default();
    refused(m, e.clone(), |m| m.batch_view_into(&[id], &mut view));
    assert_eq!(
        view,
        BatchView::default(),
        "a failing view touched its output"
    );
    refused(m, e.clone(), |m| m.slot(id, 0));
    refused(m, e.clone(), |m| m.block_table(id).map(|t| t.to_vec()));
    refused(m, e.clone(), |m| m.seq_len(id));
    refused(m, e.clone(), |m| m.tokens(id).map(|t| t.to_vec()));
    refused(m, e.clone(), |m| m.pending_tokens(id));
    refused(m, e.clone(), |m| m.release_outside_window(id, 4));
    refused(m, e.clone(), |m| m.release_outside_window(id, 0));
    refused(m, e, |m| m.blocks_needed_to_append(&[live[0], id], 1));
}

#[test]
fn unknown_sequence_every_call() {
    for prefix in [false, true] {
        let (mut m, _) = busy_manager(prefix);
        // Handles cannot be forged: an unknown one is another manager's,
        // or a freed one whose slot a new sequence took (generation moved on).
        let mut other = BlockManager::new(BlockManagerConfig::new(8, 4)).unwrap();
        let foreign = other.add_sequence(&[1, 2, 3]).unwrap();
        let stale = m.add_sequence(&[9]).unwrap();
        m.free(stale).unwrap();
        let reused = m.add_sequence(&[9]).unwrap();
        assert_ne!(stale, reused);
        assert!(m.contains(reused) && !m.contains(stale) && !m.contains(foreign));
        for id in [foreign, stale] {
            every_id_call_refuses(&mut m, id);
        }
    }
}

#[test]
fn freed_sequence_every_call() {
    for prefix in [false, true] {
        let (mut m, ids) = busy_manager(prefix);
        for &id in &ids[1..] {
            m.free(id).unwrap();
            every_id_call_refuses(&mut m, id);
        }
        // The pending copy's destination went with its sequence.
        assert!(m.pending_copies().is_empty());
    }
}

#[test]
fn zero_tokens() {
    let (mut m, ids) = busy_manager(true);
    refused(&mut m, BlockError::EmptyPrompt, |m| m.add_sequence(&[]));
    // An empty append is a no-op that succeeds, for every live sequence.
    for &id in &ids {
        let before = m.clone();
        assert_eq!(m.append(id, &[]), Ok(Vec::new()));
        assert!(m == before);
    }
    assert_eq!(m.blocks_needed_to_append(&ids, 0), Ok(0));
    assert_eq!(m.blocks_needed_to_append(&[], 5), Ok(0));
    refused(&mut m, BlockError::ZeroWindow, |m| {
        m.release_outside_window(ids[0], 0)
    });
}

#[test]
fn huge_token_counts() {
    let (mut m, ids) = busy_manager(true);
    let (a, c) = (ids[0], ids[2]);
    // Past max_seq_len (64): prompt and append.
    refused(
        &mut m,
        BlockError::TooManyTokens {
            requested: 65,
            limit: 64,
        },
        |m| m.add_sequence(&[0; 65]),
    );
    refused(
        &mut m,
        BlockError::TooManyTokens {
            requested: 6 + 59,
            limit: 64,
        },
        |m| m.append(a, &[0; 59]),
    );
    // Within the limit but past the pool: 16 blocks of 4, 5 held.
    let free = m.available_blocks();
    refused(&mut m, BlockError::OutOfBlocks { needed: 16, free }, |m| {
        m.add_sequence(&[0; 64])
    });
    refused(
        &mut m,
        BlockError::OutOfBlocks {
            needed: 16 - 3,
            free,
        },
        |m| m.append(c, &[0; 64 - 9]),
    );
    // A window longer than any sequence releases nothing and changes nothing.
    for &id in &ids {
        let before = m.clone();
        assert_eq!(m.release_outside_window(id, usize::MAX), Ok(0));
        assert!(m == before);
    }
    // Queries with absurd numbers: a saturated bound, an out-of-range position.
    assert!(m.blocks_needed_to_append(&ids, usize::MAX).unwrap() > 1 << 60);
    let many = vec![a; 8];
    assert_eq!(m.blocks_needed_to_append(&many, usize::MAX), Ok(usize::MAX));
    refused(
        &mut m,
        BlockError::PositionOutOfRange { pos: 6, len: 6 },
        |m| m.slot(a, 6),
    );
    refused(
        &mut m,
        BlockError::PositionOutOfRange {
            pos: usize::MAX,
            len: 6,
        },
        |m| m.slot(a, usize::MAX),
    );
    // A pool of more than u32::MAX slots is refused (slots are u32 on the GPU).
    let e = BlockManager::new(BlockManagerConfig::new(u32::MAX / 256 + 1, 256)).unwrap_err();
    assert_eq!(
        e,
        BlockError::BadPoolSize {
            num_blocks: u32::MAX / 256 + 1,
            block_size: 256,
            max: u32::MAX / 256
        }
    );
}

#[test]
fn block_size_not_a_power_of_two() {
    for bs in [0u32, 3, 6, 12, 24, 100, 255, 257, 512, u32::MAX] {
        let e = BlockManager::new(BlockManagerConfig::new(8, bs)).unwrap_err();
        assert_eq!(e, BlockError::BadBlockSize(bs));
        assert!(e.to_string().contains("power of two"), "{e}");
        let kv = KvCacheConfig::new(8, bs, 1, 64);
        match kv.validate() {
            Err(e @ GpuError::Pool(PoolError::BlockSize(b))) => {
                assert_eq!(b, bs);
                assert!(e.to_string().contains("power of two"), "{e}")
            }
            other => panic!("block size {bs}: {other:?}"),
        }
    }
    for bs in [1u32, 2, 4, 8, 16, 32, 64, 128, 256] {
        BlockManager::new(BlockManagerConfig::new(8, bs)).unwrap();
    }
}

#[test]
fn pool_size_out_of_range() {
    for (nb, bs) in [
        (0u32, 16u32),
        (0, 1),
        (u32::MAX, 16),
        (u32::MAX / 16 + 1, 16),
        (u32::MAX, 2),
    ] {
        let e = BlockManager::new(BlockManagerConfig::new(nb, bs)).unwrap_err();
        assert_eq!(
            e,
            BlockError::BadPoolSize {
                num_blocks: nb,
                block_size: bs,
                max: (u32::MAX / bs).min(pagedattn::blocks::MAX_BLOCKS)
            }
        );
    }
    let zero = |f: fn(&mut KvCacheConfig)| {
        let mut c = KvCacheConfig::new(8, 16, 1, 64).with_dtype(KvDtype::F16);
        f(&mut c);
        assert!(
            matches!(
                c.validate(),
                Err(GpuError::Pool(PoolError::EmptyShape { .. }))
            ),
            "{c:?}"
        );
    };
    zero(|c| c.num_blocks = 0);
    zero(|c| c.num_layers = 0);
    zero(|c| c.num_kv_heads = 0);
}

#[test]
fn duplicate_sequence_in_a_batch() {
    let (mut m, ids) = busy_manager(true);
    let (a, b) = (ids[0], ids[1]);
    refused(&mut m, BlockError::DuplicateInBatch(a), |m| {
        m.batch_view(&[a, b, a])
    });
    let mut view = m.clone().batch_view(&[b]).unwrap();
    let kept = view.clone();
    refused(&mut m, BlockError::DuplicateInBatch(b), |m| {
        m.batch_view_into(&[b, b], &mut view)
    });
    assert_eq!(view, kept, "a failing view touched its output");
}

#[test]
fn fork_before_the_view() {
    let (mut m, ids) = busy_manager(false);
    let (b, c) = (ids[1], ids[2]);
    refused(
        &mut m,
        BlockError::PendingTokens { seq: b, pending: 1 },
        |m| m.fork(b),
    );
    refused(
        &mut m,
        BlockError::PendingTokens { seq: c, pending: 9 },
        |m| m.fork(c),
    );
}

/// An empty batch is a valid view: CSR offsets `[0]`, nothing else. Taking
/// it hands out the pending copies (a view always does) and nothing more.
#[test]
fn empty_batch_view() {
    let (mut m, _) = busy_manager(true);
    let copies = m.pending_copies().to_vec();
    let stats = m.stats();
    let v = m.batch_view(&[]).unwrap();
    assert_eq!(v.num_seqs(), 0);
    assert_eq!((&v.kv_indptr[..], &v.new_indptr[..]), (&[0][..], &[0][..]));
    assert!(v.kv_indices.is_empty() && v.seq_lens.is_empty() && v.slot_mapping.is_empty());
    assert_eq!(v.copies, copies);
    let after = m.stats();
    assert_eq!(
        (after.used, after.sequences, after.pending_copies),
        (stats.used, stats.sequences, 0)
    );
}

// ---------------------------------------------------------------------------
// GPU
// ---------------------------------------------------------------------------

const HEADS: u32 = 8;
const KVH: u32 = 2;
const HD: u32 = 64;

fn kv_config(num_blocks: u32, bs: u32) -> KvCacheConfig {
    KvCacheConfig::new(num_blocks, bs, KVH, HD).with_layers(2)
}

/// A small pool filled with random K/V, its host mirror and the kernels.
struct Filled {
    kv: KvCache,
    attn: PagedAttention,
    host: HostPool,
    nb: u32,
    bs: u32,
}

fn filled(gpu: &Gpu, rng: &mut SplitMix64) -> Filled {
    let (nb, bs) = (8u32, 16u32);
    let kv = KvCache::new(gpu, kv_config(nb, bs)).unwrap();
    let attn = PagedAttention::new(gpu, &kv, HEADS, &Default::default()).unwrap();
    let slots: Vec<u32> = (0..nb * bs).collect();
    let row = (KVH * HD) as usize;
    let (k, v) = (
        rng.signed_vec(slots.len() * row),
        rng.signed_vec(slots.len() * row),
    );
    let mut host = HostPool::new(nb as usize, KVH as usize, bs as usize, HD as usize);
    host.write(&slots, &k, &v, Stored::from(KvDtype::F32));
    for layer in 0..2 {
        kv.write_kv(gpu, layer, &k, &v, &slots).unwrap();
    }
    Filled {
        kv,
        attn,
        host,
        nb,
        bs,
    }
}

fn snapshot(gpu: &Gpu, kv: &KvCache) -> Vec<(Vec<f32>, Vec<f32>)> {
    (0..kv.config().num_layers)
        .map(|l| kv.read_layer(gpu, l).unwrap())
        .collect()
}

#[track_caller]
fn invalid<T: std::fmt::Debug>(r: Result<T, GpuError>, needle: &str) {
    match r {
        Err(
            e
            @ (GpuError::Pool(_) | GpuError::Batch(_) | GpuError::Options(_) | GpuError::Shape(_)),
        ) => {
            let m = e.to_string();
            assert!(
                m.contains(needle),
                "message {m:?} does not mention {needle:?}"
            )
        }
        other => panic!("expected an argument error mentioning {needle:?}, got {other:?}"),
    }
}

/// A pool over the adapter's binding limit is refused before anything is
/// allocated, and the error names the largest pool that fits.
#[test]
fn gpu_pool_larger_than_the_adapter_allows() {
    let Some(gpu) = gpu() else { return };
    let limit = gpu.max_binding_bytes();
    let mut cfg = KvCacheConfig::new(1, 256, 8, 256);
    let block = cfg.buffer_block_bytes(true); // 2 MiB
    let fit = cfg.max_blocks_for(limit);
    assert!(fit > 0 && fit as u64 * block <= limit);
    for nb in [fit + 1, u32::MAX] {
        cfg.num_blocks = nb;
        match KvCache::new(&gpu, cfg) {
            Err(e @ GpuError::CacheTooLarge { .. }) => {
                let GpuError::CacheTooLarge {
                    num_blocks,
                    bytes,
                    limit: l,
                    max_blocks,
                } = e.clone()
                else {
                    unreachable!()
                };
                assert_eq!((num_blocks, l, max_blocks), (nb, limit, fit));
                assert_eq!(bytes, nb as u64 * block);
                assert!(
                    e.to_string().contains(&format!("at most {fit} blocks")),
                    "{e}"
                );
            }
            other => panic!("{nb} blocks: {:?}", other.map(|_| ())),
        }
    }
    assert!(gpu.take_error().is_ok());
}

/// Allocations the device must refuse come back as errors, never as
/// wgpu's default panic: inside an error scope directly; outside one,
/// recorded and reported by the next `wait()`/`take_error()`; and a cache
/// whose layers each fit but together exceed the device's memory (run on
/// real GPUs only: a CPU adapter allocates lazily and would say yes).
#[test]
fn gpu_allocation_the_adapter_must_refuse() {
    let needs = Needs::none().except(
        "memory exhaustion",
        Adapter::Cpu,
        "a CPU adapter allocates lazily and would say yes",
    );
    let Some(gpu) = gpu_for(&needs) else { return };
    let too_big = gpu.limits.max_buffer_size.saturating_add(256) & !3;
    // The library's own helper refuses it before wgpu sees it, naming the limit.
    for bytes in [too_big, u64::MAX] {
        match gpu.storage("too big", bytes) {
            Err(e @ GpuError::DeviceLimit { .. }) => {
                assert!(e.to_string().contains("max_buffer_size"), "{e}")
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
    }
    assert!(
        gpu.take_error().is_ok(),
        "refused before anything was created"
    );
    // wgpu itself, in a scope: the error comes back from the scope.
    let raw = |label| {
        gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: too_big,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })
    };
    let r = gpu.scoped_blocking(|| raw("too big"));
    assert!(
        matches!(r, Err(GpuError::Validation(_))),
        "{:?}",
        r.map(|_| ())
    );
    // Outside a scope: no panic; the error surfaces once, at the next check.
    let _b = raw("too big, unscoped");
    assert!(matches!(gpu.take_error(), Err(GpuError::Validation(_))));
    assert!(gpu.take_error().is_ok());
    let _b = raw("too big again");
    assert!(matches!(gpu.wait(), Err(GpuError::Validation(_))));
    assert!(gpu.wait().is_ok());
    if needs.skips(&gpu, "memory exhaustion") {
        return;
    }
    // Layers of up to 1 GiB each, 1 TiB in all: more than any device holds.
    let mut cfg = KvCacheConfig::new(1, 256, 8, 128);
    cfg.num_blocks = cfg.max_blocks_for(gpu.max_binding_bytes().min(1 << 30));
    cfg.num_layers = ((1u64 << 40) / (2 * cfg.layer_bytes())).max(2) as u32;
    let t = Instant::now();
    let r = KvCache::new(&gpu, cfg);
    eprintln!(
        "{} layers of {} MiB: {:?} in {:.1?}",
        cfg.num_layers,
        cfg.layer_bytes() >> 20,
        r.as_ref().map(|_| ()),
        t.elapsed()
    );
    assert!(
        matches!(r, Err(GpuError::OutOfMemory(_) | GpuError::Validation(_))),
        "1 TiB of KV cache was accepted"
    );
    // The device still works afterwards.
    let mut rng = SplitMix64::new(1);
    let f = filled(&gpu, &mut rng);
    assert_eq!(f.kv.read_layer(&gpu, 1).unwrap().0.len(), f.host.k.len());
}

#[test]
fn gpu_head_counts_and_head_dims() {
    let Some(gpu) = gpu() else { return };
    let kv = KvCache::new(&gpu, kv_config(4, 16)).unwrap();
    for heads in [0, 1, 3, 5, 7] {
        invalid(
            PagedAttention::new(&gpu, &kv, heads, &Default::default()).map(|_| ()),
            "multiple of num_kv_heads",
        );
    }
    for hd in [0u32, 2, 6, 66, 260, 512, u32::MAX] {
        let cfg = KvCacheConfig {
            head_dim: hd,
            ..kv_config(4, 16)
        };
        match KvCache::new(&gpu, cfg) {
            Err(e @ GpuError::Shape(_)) => assert!(e.to_string().contains("head_dim"), "{e}"),
            other => panic!("head_dim {hd}: {:?}", other.map(|_| ())),
        }
    }
    // A GQA group far past any pass: tiled over heads, not refused.
    let wide = KvCache::new(
        &gpu,
        KvCacheConfig {
            num_kv_heads: 1,
            head_dim: 256,
            ..kv_config(4, 16)
        },
    )
    .unwrap();
    let a = PagedAttention::new(&gpu, &wide, 4096, &Default::default()).unwrap();
    assert!(a.decode_head_tile() <= 16, "{}", a.decode_head_tile());
    // More KV heads than one dispatch dimension holds (a workgroup each).
    let too_many = gpu.limits.max_compute_workgroups_per_dimension + 1;
    let many = KvCache::new(
        &gpu,
        KvCacheConfig {
            num_layers: 1,
            num_kv_heads: too_many,
            head_dim: 4,
            ..kv_config(4, 1)
        },
    );
    match many {
        Err(e @ GpuError::Shape(_)) => assert!(e.to_string().contains("dispatch"), "{e}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
    assert!(gpu.take_error().is_ok());
}

/// Q/K/V/slot slices of the wrong length and out-of-range indices: refused
/// with a message, the pool byte-for-byte as it was.
#[test]
fn gpu_wrong_lengths_and_out_of_range_indices() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("wrong lengths"));
    let f = filled(&gpu, &mut rng);
    let before = snapshot(&gpu, &f.kv);
    let row = (KVH * HD) as usize;
    let k = rng.signed_vec(3 * row);
    let slots = [0u32, 17, 40];
    invalid(
        f.kv.write_kv(&gpu, 0, &k[..3 * row - 1], &k, &slots),
        "K and V",
    );
    invalid(f.kv.write_kv(&gpu, 0, &k, &k[..row], &slots), "K and V");
    invalid(f.kv.write_kv(&gpu, 0, &k, &k, &slots[..2]), "K and V");
    invalid(
        f.kv.write_kv(&gpu, 0, &k, &k, &[0, f.nb * f.bs, 1]),
        "outside the pool",
    );
    invalid(
        // u32::MAX is SKIP_WRITE (a token already in the pool), accepted.
        f.kv.write_kv(&gpu, 0, &k, &k, &[0, u32::MAX - 1, 1]),
        "outside the pool",
    );
    invalid(
        f.kv.write_kv(&gpu, 2, &k, &k, &slots),
        "layer 2 out of range",
    );
    invalid(
        f.kv.copy_blocks(&gpu, &[[0, 1], [2, f.nb]]),
        "outside the pool",
    );
    invalid(f.kv.copy_blocks(&gpu, &[[u32::MAX, 1]]), "outside the pool");
    // Copy lists whose copies would race (they run in parallel): two into
    // one block, a chain, a swap, a self-copy.
    for racing in [
        &[[1, 3], [2, 3]][..],
        &[[1, 2], [2, 3]],
        &[[4, 5], [5, 4]],
        &[[6, 6]],
    ] {
        invalid(f.kv.copy_blocks(&gpu, racing), "would race");
    }
    invalid(f.kv.read_layer(&gpu, 7), "out of range");

    let opts = AttnOptions::default();
    let q1 = rng.signed_vec((HEADS * HD) as usize);
    let dec = |q: &[f32], indptr: &[u32], idx: &[u32], lens: &[u32], o: &AttnOptions| {
        f.attn.decode(&gpu, &f.kv, 0, q, indptr, idx, lens, o)
    };
    invalid(dec(&q1[1..], &[0, 1], &[3], &[5], &opts), "q has");
    invalid(
        dec(
            &[q1.clone(), q1.clone()].concat(),
            &[0, 1],
            &[3],
            &[5],
            &opts,
        ),
        "q has",
    );
    invalid(dec(&q1, &[0, 1], &[f.nb], &[5], &opts), "outside the pool");
    invalid(
        dec(&q1, &[0, 1], &[u32::MAX - 1], &[5], &opts),
        "outside the pool",
    );
    // u32::MAX is RELEASED (a block a sliding window dropped): accepted and
    // skipped, so a sequence with nothing else reads no token: zeros.
    let zeros = dec(&q1, &[0, 1], &[RELEASED], &[5], &opts).unwrap();
    assert!(zeros.iter().all(|&x| x == 0.0));
    invalid(dec(&q1, &[0, 1, 1], &[3], &[5], &opts), "kv_indptr has");
    invalid(dec(&q1, &[], &[3], &[5], &opts), "kv_indptr has");
    invalid(dec(&q1, &[1, 1], &[3], &[5], &opts), "kv_indptr must");
    invalid(dec(&q1, &[0, 2], &[3], &[5], &opts), "kv_indptr must");
    invalid(dec(&q1, &[0, 1], &[3], &[17], &opts), "only 1 blocks");
    invalid(dec(&q1, &[0, 1], &[3], &[u32::MAX], &opts), "only 1 blocks");
    let q2 = [q1.clone(), q1.clone()].concat();
    invalid(dec(&q2, &[0, 1, 0], &[3], &[5, 0], &opts), "kv_indptr must");
    let bad_opts = [
        AttnOptions {
            split: Split::Tokens(0),
            ..Default::default()
        },
        AttnOptions {
            split: Split::Tokens(100),
            ..Default::default()
        },
        AttnOptions {
            soft_cap: Some(f32::NAN),
            ..Default::default()
        },
        AttnOptions {
            soft_cap: Some(-1.0),
            ..Default::default()
        },
        AttnOptions {
            sliding_window: Some(0),
            ..Default::default()
        },
        AttnOptions {
            alibi_slopes: Some(vec![0.5; HEADS as usize - 1]),
            ..Default::default()
        },
        AttnOptions {
            sinks: Some(vec![0.5; HEADS as usize + 1]),
            ..Default::default()
        },
        AttnOptions {
            sinks: Some(vec![f32::INFINITY; HEADS as usize]),
            ..Default::default()
        },
    ];
    for o in &bad_opts {
        assert!(
            matches!(dec(&q1, &[0, 1], &[3], &[5], o), Err(GpuError::Options(_))),
            "{o:?}"
        );
    }
    invalid(
        f.attn
            .decode(&gpu, &f.kv, 2, &q1, &[0, 1], &[3], &[5], &opts),
        "layer 2",
    );
    // Prefill: the same checks, and query offsets.
    let pre = |q: &[f32], qo: &[u32], lens: &[u32]| {
        f.attn
            .prefill(&gpu, &f.kv, 0, q, qo, &[0, 1], &[3], lens, &opts)
    };
    invalid(pre(&q1, &[0, 2], &[5]), "q has");
    invalid(pre(&q2, &[0, 2], &[1]), "only 1 tokens");
    invalid(pre(&q1, &[0], &[5]), "qo_indptr");
    invalid(pre(&q1, &[1, 1], &[5]), "qo_indptr");
    assert!(
        before == snapshot(&gpu, &f.kv),
        "a refused call changed the pool"
    );
    assert!(gpu.take_error().is_ok());
}

/// Tables the host path cannot check (the encoder API takes them as they
/// are): entries past the pool, repeated entries, CSR ranges past
/// `kv_indices`, decreasing offsets, and a length far past its table. The
/// kernel must finish promptly, write nothing but its output, and give
/// every sequence with a sane length what the reference gives with the bad
/// tokens skipped. The sequence whose length is u32::MAX has no promised
/// value (GUARANTEES.md): the kernel walks its length, so on lavapipe the
/// loop limit ends it and on a real GPU it runs ~2^26 empty tiles, unless
/// the kernel cuts the length to what the table holds
/// (`STRICT_OVERLONG` then checks it against the clamped reference).
#[test]
fn gpu_corrupt_tables_are_bounded() {
    // Whether the over-long sequence (index 0) must match the reference with
    // its length cut to its table: true once the kernel clamps it.
    const STRICT_OVERLONG: bool = true;
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("corrupt tables, bounded"));
    let f = filled(&gpu, &mut rng);
    let before = snapshot(&gpu, &f.kv);
    let nb = f.nb;
    // seq 0: length u32::MAX over a 2-block table; seq 1: repeated entries
    // and one past the pool; seq 2: offsets that decrease (8 -> 5) and run
    // past kv_indices; seq 3: an empty table with a length.
    let kv_indptr = vec![0u32, 2, 6, 5, 99, 99];
    let kv_indices = vec![1u32, 6, 3, 3, nb + 1, 3, 0, 4];
    // u32::MAX itself is refused when the tables are packed (a length
    // the kernels' u32 positions could wrap on); the longest accepted one
    // is cut to its table by the kernel.
    let over = [u32::MAX, 64, 40, 30, 16];
    match run_unchecked(
        &gpu,
        &f,
        &[],
        &kv_indptr,
        &kv_indices,
        &over,
        &Default::default(),
    ) {
        Err(e @ GpuError::Batch(BatchError::TooLong { .. })) => {
            assert!(e.to_string().contains("over the limit"), "{e}")
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    // The checked plan refuses these tables outright.
    let mut plan = f.attn.plan();
    let checked = f.attn.plan_decode(
        &gpu,
        &mut plan,
        &DecodeTables {
            kv_indptr: &kv_indptr,
            kv_indices: &kv_indices,
            seq_lens: &[64, 64, 40, 30, 16],
        },
        &[AttnOptions::default()],
    );
    assert!(matches!(checked, Err(GpuError::Batch(_))), "{checked:?}");
    // An over-long length at the limit (refused unsplit where loops are
    // capped) and one a capped adapter can walk unsplit.
    for over in [pagedattn::gpu::MAX_SEQ_LEN, 8000] {
        let seq_lens = vec![over, 64, 40, 30, 16];
        let n = seq_lens.len();
        let q = rng.signed_vec(n * (HEADS * HD) as usize);
        for split in [Split::Never, Split::Auto, Split::Tokens(64)] {
            let opts = AttnOptions {
                split,
                ..Default::default()
            };
            let t = Instant::now();
            let got = run_unchecked(&gpu, &f, &q, &kv_indptr, &kv_indices, &seq_lens, &opts);
            let took = t.elapsed();
            eprintln!("{split:?}: {took:.2?}, {:?}", got.as_ref().map(|v| v.len()));
            assert!(took < Duration::from_secs(30), "{split:?} took {took:?}");
            let Ok(got) = got else {
                // The split path sizes its partitions from the lengths: refused.
                // Unsplit, an adapter that caps loops refuses a pass it could
                // not finish.
                assert!(
                    !matches!(split, Split::Never)
                        || gpu.caps_loops() && matches!(got, Err(GpuError::PassTooLong { .. })),
                    "{got:?}"
                );
                continue;
            };
            // Reference: lengths clamped to what each (clamped) table range holds.
            let clamped: Vec<u32> = (0..n)
                .map(|s| {
                    let end = (kv_indptr[s + 1] as usize).min(kv_indices.len());
                    let start = (kv_indptr[s] as usize).min(end);
                    seq_lens[s].min(((end - start) as u32) * f.bs)
                })
                .collect();
            let want = reference_unchecked(&f, &q, &kv_indptr, &kv_indices, &clamped);
            let per = (HEADS * HD) as usize;
            let checked = if STRICT_OVERLONG { 0 } else { 1 };
            let errs: Vec<f64> = (checked..n)
                .map(|s| {
                    let (g, w) = (&got[s * per..(s + 1) * per], &want[s * per..(s + 1) * per]);
                    if w.iter().all(|&x| x == 0.0) {
                        // No readable token: zeros, exactly.
                        if g.iter().all(|&x| x == 0.0) {
                            0.0
                        } else {
                            f64::INFINITY
                        }
                    } else {
                        rel_l2(g, w)
                    }
                })
                .collect();
            assert!(
                errs.iter().all(|&e| e < 1e-5),
                "{split:?}: rel L2 per sequence {errs:?}"
            );
        }
    }
    assert!(before == snapshot(&gpu, &f.kv), "decode wrote to the pool");
    assert!(gpu.take_error().is_ok());
}

fn run_unchecked(
    gpu: &Gpu,
    f: &Filled,
    q: &[f32],
    kv_indptr: &[u32],
    kv_indices: &[u32],
    seq_lens: &[u32],
    opts: &AttnOptions,
) -> Result<Vec<f32>, GpuError> {
    // Tables past the host check go to the kernels as they are: their own
    // bounds are what is tested.
    let mut plan = f.attn.plan();
    let t = DecodeTables {
        kv_indptr,
        kv_indices,
        seq_lens,
    };
    f.attn
        .plan_decode_unchecked(gpu, &mut plan, &t, std::slice::from_ref(opts))?;
    let qb = gpu.storage_init("q", q).unwrap();
    let bytes = (q.len() * 4) as u64;
    let out = gpu.storage("out", bytes.max(4)).unwrap();
    gpu.queue.write_buffer(
        &out,
        0,
        bytemuck::cast_slice(&vec![f32::NAN; q.len().max(1)]),
    );
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    let (qr, outr) = (
        qb.as_entire_buffer_binding(),
        out.as_entire_buffer_binding(),
    );
    f.attn
        .run(gpu, &mut enc, &mut plan, &f.kv, 0, 0, &qr, &outr)?;
    gpu.queue.submit([enc.finish()]);
    gpu.read(&out, bytes)
}

/// The reference over a table the kernel sees as corrupt: each sequence's
/// CSR range clamped to `kv_indices` the way the kernel clamps it.
fn reference_unchecked(
    f: &Filled,
    q: &[f32],
    kv_indptr: &[u32],
    kv_indices: &[u32],
    seq_lens: &[u32],
) -> Vec<f64> {
    let n = seq_lens.len();
    let per = (HEADS * HD) as usize;
    let mut out = Vec::with_capacity(q.len());
    for s in 0..n {
        let end = (kv_indptr[s + 1] as usize).min(kv_indices.len());
        let start = (kv_indptr[s] as usize).min(end);
        let table = &kv_indices[start..end];
        out.extend(reference::decode(
            &f.host.view(),
            &AttnParams::new(HEADS as usize, HD as usize),
            &q[s * per..(s + 1) * per],
            &[0, table.len() as u32],
            table,
            &[seq_lens[s]],
        ));
    }
    out
}

/// Repeated block ids in a checked table are allowed: the sequence reads
/// that block at each position it appears, as the reference does.
#[test]
fn gpu_repeated_table_entries() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("repeated entries"));
    let f = filled(&gpu, &mut rng);
    let (kv_indptr, kv_indices, seq_lens) = (
        vec![0u32, 4, 7],
        vec![2u32, 2, 2, 5, 5, 0, 5],
        vec![60u32, 33],
    );
    let q = rng.signed_vec(2 * (HEADS * HD) as usize);
    let got = f
        .attn
        .decode(
            &gpu,
            &f.kv,
            1,
            &q,
            &kv_indptr,
            &kv_indices,
            &seq_lens,
            &Default::default(),
        )
        .unwrap();
    let want = reference::decode(
        &f.host.view(),
        &AttnParams::new(HEADS as usize, HD as usize),
        &q,
        &kv_indptr,
        &kv_indices,
        &seq_lens,
    );
    let e = rel_l2(&got, &want);
    assert!(e < 1e-5, "rel L2 {e:.2e}");
}

/// NaN or infinity in Q, K or V: no error, no crash, and only the rows that
/// read the bad value are affected. Their values are whatever the adapter's
/// float arithmetic makes of it (IEEE adapters such as lavapipe give NaN;
/// WGSL lets others give any value), so only the other rows are compared.
#[test]
fn gpu_nan_and_inf_inputs() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("nan inputs"));
    let f = filled(&gpu, &mut rng);
    let (bs, row) = (f.bs as usize, (KVH * HD) as usize);
    let per = (HEADS * HD) as usize;
    // Three sequences over disjoint blocks: [0, 1], [2, 3], [4, 5].
    let (kv_indptr, kv_indices, seq_lens) = (
        vec![0u32, 2, 4, 6],
        vec![0u32, 1, 2, 3, 4, 5],
        vec![20u32, 32, 17],
    );
    let params = AttnParams::new(HEADS as usize, HD as usize);
    for case in ["q nan", "q inf", "k nan", "k inf", "v nan", "v -inf"] {
        let mut q = rng.signed_vec(3 * per);
        let mut host = HostPool::new(f.nb as usize, KVH as usize, bs, HD as usize);
        host.k.copy_from_slice(&f.host.k);
        host.v.copy_from_slice(&f.host.v);
        let (bad, val) = match case {
            "q nan" | "k nan" | "v nan" => (1usize, f32::NAN),
            "q inf" | "k inf" => (1, f32::INFINITY),
            _ => (1, f32::NEG_INFINITY),
        };
        let layer = 1;
        if case.starts_with('q') {
            q[bad * per + 5] = val;
        } else {
            // Token 3 of sequence 1 (block 2, offset 3), kv head 0, element 7.
            let slot = 2 * f.bs + 3;
            let (mut k, mut v) = (rng.signed_vec(row), rng.signed_vec(row));
            if case.starts_with('k') {
                k[7] = val;
            } else {
                v[7] = val;
            }
            f.kv.write_kv(&gpu, layer, &k, &v, &[slot]).unwrap();
            host.write(&[slot], &k, &v, Stored::from(KvDtype::F32));
        }
        let got = f
            .attn
            .decode(
                &gpu,
                &f.kv,
                layer,
                &q,
                &kv_indptr,
                &kv_indices,
                &seq_lens,
                &Default::default(),
            )
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(got.len(), q.len());
        let want = reference::decode(
            &host.view(),
            &params,
            &q,
            &kv_indptr,
            &kv_indices,
            &seq_lens,
        );
        for s in [0, 2] {
            let e = rel_l2(&got[s * per..(s + 1) * per], &want[s * per..(s + 1) * per]);
            assert!(e < 1e-5, "{case}: clean sequence {s} rel L2 {e:.2e}");
        }
        let bad_rows = &got[bad * per..(bad + 1) * per];
        let non_finite = bad_rows.iter().filter(|x| !x.is_finite()).count();
        eprintln!("{case}: {non_finite} of {per} outputs of the poisoned sequence are non-finite");
        if gpu.info.device_type == wgpu::DeviceType::Cpu && case.contains("nan") {
            // IEEE arithmetic: a NaN reaches the output.
            assert!(non_finite > 0, "{case}: poisoned sequence came out finite");
        }
        // Put the clean values back for the next case.
        if !case.starts_with('q') {
            let slot = 2 * f.bs + 3;
            let b = slot as usize / bs;
            let o = slot as usize % bs;
            let mut k = vec![0.0; row];
            let mut v = vec![0.0; row];
            for h in 0..KVH as usize {
                let src = ((b * KVH as usize + h) * bs + o) * HD as usize;
                k[h * HD as usize..][..HD as usize]
                    .copy_from_slice(&f.host.k[src..][..HD as usize]);
                v[h * HD as usize..][..HD as usize]
                    .copy_from_slice(&f.host.v[src..][..HD as usize]);
            }
            f.kv.write_kv(&gpu, layer, &k, &v, &[slot]).unwrap();
        }
    }
    // A non-finite scale would poison every row: refused, naming it.
    let q = rng.signed_vec(3 * per);
    for x in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let opts = AttnOptions {
            scale: Some(x),
            ..Default::default()
        };
        let got = f.attn.decode(
            &gpu,
            &f.kv,
            0,
            &q,
            &kv_indptr,
            &kv_indices,
            &seq_lens,
            &opts,
        );
        match got {
            Err(e @ GpuError::Options(_)) => assert!(e.to_string().contains("scale"), "{e}"),
            other => panic!("scale {x}: {other:?}"),
        }
    }
    assert!(gpu.take_error().is_ok());
}

/// The plan/run calls take an engine's GPU buffers, and check them before
/// recording: one of the wrong kind (no STORAGE usage) or too short for the
/// step is refused with a typed binding error, nothing reaches wgpu (no
/// validation error later) and the pool is untouched.
#[test]
fn gpu_run_refuses_wrong_buffers() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("run buffers"));
    let f = filled(&gpu, &mut rng);
    let before = snapshot(&gpu, &f.kv);
    let per = (HEADS * HD) as usize;
    let q = gpu.storage_init("q", &rng.signed_vec(per)).unwrap();
    let out = gpu.storage("out", (per * 4) as u64).unwrap();
    let wrong = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("not a storage buffer"),
        size: (per * 4) as u64,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let short = gpu.storage("short", 4).unwrap();
    let mut plan = f.attn.plan();
    let t = DecodeTables {
        kv_indptr: &[0, 1],
        kv_indices: &[2],
        seq_lens: &[9],
    };
    f.attn
        .plan_decode(&gpu, &mut plan, &t, &[AttnOptions::default()])
        .unwrap();
    let mut wplan = f.kv.plan();
    f.kv.plan_write(&gpu, &mut wplan, &[5, 6, 7], &[]).unwrap();
    fn b(x: &wgpu::Buffer) -> wgpu::BufferBinding<'_> {
        x.as_entire_buffer_binding()
    }
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    for (what, qb, ob) in [
        ("out without STORAGE", &q, &wrong),
        ("short q", &short, &out),
        ("short out", &q, &short),
    ] {
        let r = f
            .attn
            .run(&gpu, &mut enc, &mut plan, &f.kv, 0, 0, &b(qb), &b(ob));
        assert!(matches!(r, Err(GpuError::Binding { .. })), "{what}: {r:?}");
    }
    let r =
        f.kv.run_write_kv(&gpu, &mut enc, &mut wplan, 1, &b(&short), &b(&short));
    assert!(
        matches!(r, Err(GpuError::Binding { .. })),
        "short K/V: {r:?}"
    );
    gpu.queue.submit([enc.finish()]);
    gpu.wait().unwrap();
    assert!(before == snapshot(&gpu, &f.kv), "the pool changed");
}

/// Empty batches everywhere: valid, do nothing, return empty results.
#[test]
fn gpu_empty_batches() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("empty batches"));
    let f = filled(&gpu, &mut rng);
    let before = snapshot(&gpu, &f.kv);
    let opts = AttnOptions::default();
    assert_eq!(
        f.attn.decode(&gpu, &f.kv, 0, &[], &[0], &[], &[], &opts),
        Ok(Vec::new())
    );
    assert_eq!(
        f.attn
            .prefill(&gpu, &f.kv, 0, &[], &[0], &[0], &[], &[], &opts),
        Ok(Vec::new())
    );
    // Sequences with no queries in a prefill.
    assert_eq!(
        f.attn
            .prefill(&gpu, &f.kv, 0, &[], &[0, 0], &[0, 1], &[2], &[5], &opts),
        Ok(Vec::new())
    );
    f.kv.write_kv(&gpu, 0, &[], &[], &[]).unwrap();
    f.kv.copy_blocks(&gpu, &[]).unwrap();
    // The manager's view of an empty batch goes straight to decode.
    let mut m = BlockManager::new(BlockManagerConfig::new(f.nb, f.bs)).unwrap();
    let v = m.batch_view(&[]).unwrap();
    let out = f
        .attn
        .decode(
            &gpu,
            &f.kv,
            1,
            &[],
            &v.kv_indptr,
            &v.kv_indices,
            &v.seq_lens,
            &opts,
        )
        .unwrap();
    assert!(out.is_empty());
    // Plan/run: zero tokens, zero copies, zero sequences record nothing.
    let (empty, empty_out) = (
        gpu.storage_init::<u32>("empty", &[]).unwrap(),
        gpu.storage_init::<u32>("empty out", &[]).unwrap(),
    );
    let (mut wplan, mut aplan) = (f.kv.plan(), f.attn.plan());
    f.kv.plan_write(&gpu, &mut wplan, &[], &[]).unwrap();
    let t = DecodeTables {
        kv_indptr: &[0],
        kv_indices: &[],
        seq_lens: &[],
    };
    f.attn
        .plan_decode(&gpu, &mut aplan, &t, std::slice::from_ref(&opts))
        .unwrap();
    let (e, eo) = (
        empty.as_entire_buffer_binding(),
        empty_out.as_entire_buffer_binding(),
    );
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    f.kv.run_copy_blocks(&gpu, &mut enc, &mut wplan).unwrap();
    f.kv.run_write_kv(&gpu, &mut enc, &mut wplan, 0, &e, &e)
        .unwrap();
    f.attn
        .run(&gpu, &mut enc, &mut aplan, &f.kv, 0, 0, &e, &eo)
        .unwrap();
    gpu.queue.submit([enc.finish()]);
    gpu.wait().unwrap();
    assert!(before == snapshot(&gpu, &f.kv));
}

/// A device opened with the browser's limits (128 MiB per binding) and one
/// with tiny limits: what exceeds them is an error from the call, never a
/// panic from wgpu's default error handler.
#[test]
fn gpu_inputs_over_the_device_limits() {
    let Some(default_gpu) = gpu() else { return };
    drop(default_gpu);
    let backends = common::backends().unwrap();
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = backends;
    let inst = wgpu::Instance::new(desc);
    let open = |limits: fn(wgpu::Limits) -> wgpu::Limits| {
        let adapter = pollster::block_on(inst.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        }))
        .unwrap();
        let l = limits(adapter.limits());
        pollster::block_on(Gpu::from_adapter_with_limits(adapter, l)).unwrap()
    };
    // The browser's defaults: a pool over 128 MiB per layer is refused.
    let web = open(|a| wgpu::Limits::default().using_resolution(a));
    assert_eq!(web.max_binding_bytes(), 128 << 20);
    let cfg = KvCacheConfig {
        num_blocks: 1 + (128 << 20) / kv_config(1, 16).buffer_block_bytes(true) as u32,
        ..kv_config(1, 16)
    };
    let fit = ((128 << 20) / cfg.buffer_block_bytes(true)) as u32;
    match KvCache::new(&web, cfg) {
        Err(GpuError::CacheTooLarge { max_blocks, .. }) => assert_eq!(max_blocks, fit),
        other => panic!("{:?}", other.map(|_| ())),
    }
    drop(web);

    // Tiny limits: 64 KiB per binding, 1 MiB per buffer.
    let tiny = open(|a| wgpu::Limits {
        max_storage_buffer_binding_size: 64 << 10,
        max_buffer_size: 1 << 20,
        ..wgpu::Limits::default().using_resolution(a)
    });
    let kv = KvCache::new(&tiny, kv_config(8, 16)).unwrap(); // 64 KiB per layer
    let attn = PagedAttention::new(&tiny, &kv, HEADS, &Default::default()).unwrap();
    let per = (HEADS * HD) as usize; // 2 KiB of q per sequence
                                     // 40 sequences: q and out are 80 KiB, over the binding limit.
    let n = 40;
    let q = vec![0.5f32; n * per];
    let kv_indptr: Vec<u32> = (0..=n as u32).collect();
    let r = attn.decode(
        &tiny,
        &kv,
        0,
        &q,
        &kv_indptr,
        &vec![0; n],
        &vec![3; n],
        &AttnOptions::default(),
    );
    assert!(over_limit(&r), "{r:?}");
    // Split scratch: one sequence in 64-token partitions, 2 KiB each.
    let opts = AttnOptions {
        split: Split::Tokens(64),
        ..Default::default()
    };
    let table: Vec<u32> = (0..200).map(|i| i % 8).collect();
    let ok = attn.decode(
        &tiny,
        &kv,
        0,
        &q[..per],
        &[0, 8],
        &table[..8],
        &[128],
        &opts,
    );
    assert!(ok.is_ok(), "{ok:?}");
    // 33 partitions: 66 KiB of scratch, over the binding limit.
    let r = attn.decode(
        &tiny,
        &kv,
        0,
        &q[..per],
        &[0, 200],
        &table,
        &[33 * 64],
        &opts,
    );
    assert!(over_limit(&r), "{r:?}");
    // Distinct slots (a repeat is refused first), the rest skipped.
    let slots: Vec<u32> = (0..20_000)
        .map(|i| {
            if i < 128 {
                i
            } else {
                pagedattn::blocks::SKIP_WRITE
            }
        })
        .collect();
    let big = vec![0.0f32; slots.len() * (KVH * HD) as usize]; // 10 MB
    let r = kv.write_kv(&tiny, 0, &big, &big, &slots);
    assert!(over_limit(&r), "{r:?}");
    // 9000 copies in a pool of 8 blocks (72 KB of list, over the binding
    // limit): such a list must name a destination twice, so it races and
    // is refused before its size matters (a list that does not race holds
    // fewer copies than the pool has blocks).
    let copies: Vec<[u32; 2]> = (0..9000).map(|i| [i % 4, 4 + i % 4]).collect();
    let r = kv.copy_blocks(&tiny, &copies);
    assert!(
        matches!(r, Err(GpuError::Pool(PoolError::CopyRace { .. }))),
        "{r:?}"
    );
    // Nothing was left for the uncaptured handler, and the device still works.
    assert!(tiny.take_error().is_ok());
    let r = attn.decode(
        &tiny,
        &kv,
        0,
        &q[..per],
        &[0, 1],
        &[0],
        &[3],
        &AttnOptions::default(),
    );
    assert!(r.is_ok(), "{r:?}");
}

/// A lost device: every later call returns `GpuError::Device`, none panics.
#[test]
fn gpu_device_lost() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("device lost"));
    let f = filled(&gpu, &mut rng);
    gpu.device.destroy();
    // The callback may run on the next poll; any call gets there.
    let _ = gpu.wait();
    assert!(gpu.is_lost());
    let dev = |r: Result<(), GpuError>, what: &str| match r {
        Err(GpuError::Device(m)) => assert!(m.contains("lost"), "{what}: {m}"),
        other => panic!("{what}: {other:?}"),
    };
    let row = (KVH * HD) as usize;
    let k = rng.signed_vec(row);
    dev(f.kv.write_kv(&gpu, 0, &k, &k, &[3]), "write_kv");
    dev(f.kv.copy_blocks(&gpu, &[[0, 1]]), "copy_blocks");
    let q = rng.signed_vec((HEADS * HD) as usize);
    let r = f
        .attn
        .decode(&gpu, &f.kv, 0, &q, &[0, 1], &[2], &[9], &Default::default());
    dev(r.map(|_| ()), "decode");
    dev(f.kv.read_layer(&gpu, 0).map(|_| ()), "read_layer");
    dev(
        KvCache::new(&gpu, kv_config(4, 16)).map(|_| ()),
        "KvCache::new",
    );
    dev(
        PagedAttention::new(&gpu, &f.kv, HEADS, &Default::default()).map(|_| ()),
        "PagedAttention::new",
    );
    dev(gpu.wait(), "wait");
    dev(gpu.take_error(), "take_error");
}

/// A request over a device limit: refused by the library's size check
/// (naming the limit) or by wgpu's validation inside the call's scope.
fn over_limit<T>(r: &Result<T, GpuError>) -> bool {
    match r {
        Err(GpuError::Validation(_)) => true,
        Err(GpuError::DeviceLimit { .. } | GpuError::Batch(BatchError::Partials { .. })) => true,
        Err(GpuError::Binding {
            problem: BindingError::OverLimit { .. },
            ..
        }) => true,
        _ => false,
    }
}
