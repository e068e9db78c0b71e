//! The trust guarantees under adversarial input, host side (no GPU): the
//! prefix cache never lets two different prompts (or two tenants) share a
//! block, sizes that would abort are refused, and the argument checks of
//! the GPU layer refuse what the kernels cannot do exactly. Randomized
//! parts use a fixed seed per test (`PAGEDATTN_SEED` overrides; failures
//! print it).

use crate::common;

use std::collections::HashMap;
use std::time::Instant;

use common::seed;
use pagedattn::blocks::{BlockError, BlockManager, BlockManagerConfig, SeqId, MAX_BLOCKS};
use pagedattn::gpu::{
    check_csr_tables, AttnOptions, KvCacheConfig, KvDtype, PackedTables, Split, MAX_SEQ_LEN,
};
use pagedattn::rng::SplitMix64;

/// Two 16-token blocks that had equal chain hashes under the old 64-bit
/// mix (found by a 20-second search): B must not get A's block, before or
/// after both are freed.
#[test]
fn colliding_blocks_of_the_old_hash_never_share() {
    let mut a: Vec<u32> = vec![18236, 1841, 0];
    a.extend([1; 11]);
    a.extend([3627, 7]);
    let mut b: Vec<u32> = vec![11841, 1195, 0];
    b.extend([1; 11]);
    b.extend([0, 7]);
    assert_eq!((a.len(), b.len()), (16, 16));
    let mut m =
        BlockManager::new(BlockManagerConfig::new(8, 16).with_prefix_caching(true)).unwrap();
    let pa = [&a[..], &[11]].concat();
    let pb = [&b[..], &[22]].concat();
    let sa = m.add_sequence(&pa).unwrap();
    m.batch_view(&[sa]).unwrap();
    let sb = m.add_sequence(&pb).unwrap();
    let (ta, tb) = (m.block_table(sa).unwrap()[0], m.block_table(sb).unwrap()[0]);
    assert_ne!(ta, tb, "B was given A's block");
    assert_eq!(m.ref_count(ta), Some(1));
    assert_eq!(m.prefix_hit_tokens(), 0);
    m.batch_view(&[sb]).unwrap();
    m.free(sa).unwrap();
    m.free(sb).unwrap();
    // Both cached now; prompt B again revives B's block, never A's.
    let sb2 = m.add_sequence(&pb).unwrap();
    assert_eq!(m.block_table(sb2).unwrap()[0], tb);
    let sa2 = m.add_sequence(&pa).unwrap();
    assert_eq!(m.block_table(sa2).unwrap()[0], ta);
    assert_eq!(m.prefix_hit_tokens(), 32);
}

/// Every block a sequence holds, as the whole token prefix it stands for.
fn prefixes(m: &BlockManager, s: SeqId, bs: usize) -> Vec<(u32, Vec<u32>)> {
    let toks = m.tokens(s).unwrap();
    m.block_table(s)
        .unwrap()
        .iter()
        .enumerate()
        .filter(|(i, _)| (i + 1) * bs <= toks.len())
        .map(|(i, &b)| (b, toks[..(i + 1) * bs].to_vec()))
        .collect()
}

/// A randomized search for prompts that share a block without sharing the
/// whole prefix it stands for (or the tenant): tiny vocabularies and block
/// sizes make equal blocks under different chains, and equal prompts under
/// different salts, common. Every full block held by a live sequence is
/// checked against what it held when first written: a cache that keyed on
/// a block's own tokens, or on a weak hash, fails here.
#[test]
fn randomized_search_for_blocks_shared_across_prefixes_or_tenants() {
    let s = seed("prefix search");
    let mut rng = SplitMix64::new(s);
    let t0 = Instant::now();
    let mut checked = 0usize;
    let mut hits = 0u64;
    for round in 0..600 {
        let bs = [1u32, 2, 4][round % 3] as usize;
        let vocab = 2 + rng.below(3) as u32;
        let mut m =
            BlockManager::new(BlockManagerConfig::new(96, bs as u32).with_prefix_caching(true))
                .unwrap();
        // Physical block -> (salt, token prefix) of the content written there.
        let mut content: HashMap<u32, (u8, Vec<u32>)> = HashMap::new();
        let mut live: Vec<(SeqId, u8)> = Vec::new();
        for _ in 0..200 {
            match rng.below(5) {
                0..=2 => {
                    let len = 1 + rng.below(12) as usize;
                    let prompt: Vec<u32> =
                        (0..len).map(|_| rng.below(vocab as u64) as u32).collect();
                    let salt = rng.below(3) as u8;
                    let before = m.prefix_hit_tokens();
                    let Ok(id) = m.add_sequence_salted(&prompt, &[salt]) else {
                        continue;
                    };
                    m.batch_view(&[id]).unwrap();
                    // The leading blocks served from the cache must hold
                    // exactly this prefix, in this tenant; the rest were
                    // written now.
                    let hit_blocks = ((m.prefix_hit_tokens() - before) as usize) / bs;
                    for (i, (b, p)) in prefixes(&m, id, bs).into_iter().enumerate() {
                        if i < hit_blocks {
                            assert_eq!(
                                content.get(&b),
                                Some(&(salt, p)),
                                "block {b} shared across prefixes or tenants (seed {s})"
                            );
                        } else {
                            content.insert(b, (salt, p));
                        }
                        checked += 1;
                    }
                    live.push((id, salt));
                }
                3 if !live.is_empty() => {
                    let (id, salt) = live[rng.below(live.len() as u64) as usize];
                    let t = rng.below(vocab as u64) as u32;
                    if m.append(id, &[t]).is_ok() {
                        m.batch_view(&[id]).unwrap();
                        for (b, p) in prefixes(&m, id, bs) {
                            if m.ref_count(b).unwrap() == 1 {
                                content.insert(b, (salt, p));
                            } else {
                                assert_eq!(
                                    content.get(&b),
                                    Some(&(salt, p)),
                                    "shared block {b} (seed {s})"
                                );
                            }
                        }
                    }
                }
                _ if !live.is_empty() => {
                    let (id, _) = live.swap_remove(rng.below(live.len() as u64) as usize);
                    m.free(id).unwrap();
                }
                _ => {}
            }
        }
        hits += m.prefix_hit_tokens();
    }
    eprintln!(
        "{checked} held blocks checked, {hits} prefix-hit tokens, in {:.2?} (seed {s})",
        t0.elapsed()
    );
    assert!(hits > 1000, "the search must exercise the cache (seed {s})");
}

/// Salts are namespaces: equal prompts share within one, never across;
/// forks inherit their parent's.
#[test]
fn cache_salts_keep_tenants_apart() {
    let mut m =
        BlockManager::new(BlockManagerConfig::new(32, 4).with_prefix_caching(true)).unwrap();
    let p: Vec<u32> = (0..9).collect();
    let a = m.add_sequence_salted(&p, b"tenant-a").unwrap();
    m.batch_view(&[a]).unwrap();
    let b = m.add_sequence_salted(&p, b"tenant-b").unwrap();
    assert_eq!(m.prefix_hit_tokens(), 0, "no sharing across salts");
    let plain = m.add_sequence(&p).unwrap();
    assert_eq!(
        m.prefix_hit_tokens(),
        0,
        "the unsalted namespace is its own"
    );
    let a2 = m.add_sequence_salted(&p, b"tenant-a").unwrap();
    assert_eq!(m.prefix_hit_tokens(), 8, "equal salt, equal prompt: shared");
    assert_eq!(
        m.block_table(a2).unwrap()[..2],
        m.block_table(a).unwrap()[..2]
    );
    // A fork of tenant a's sequence fills a new block: cached under a's salt.
    let f = m.fork(a).unwrap();
    m.append(f, &[9, 10, 11]).unwrap();
    m.batch_view(&[f, b, plain, a2]).unwrap();
    let mut q = p.clone();
    q.extend([9, 10, 11, 12]);
    let before = m.prefix_hit_tokens();
    m.add_sequence_salted(&q, b"tenant-b").unwrap();
    assert_eq!(
        m.prefix_hit_tokens() - before,
        8,
        "tenant b hits only its own prompt blocks"
    );
    let before = m.prefix_hit_tokens();
    m.add_sequence_salted(&q, b"tenant-a").unwrap();
    assert_eq!(
        m.prefix_hit_tokens() - before,
        12,
        "tenant a hits the fork's block too"
    );
}

/// A pool too large to bookkeep is refused at once (no 17 GB allocation).
#[test]
fn huge_pools_are_refused_not_aborted() {
    for (nb, bs) in [
        (u32::MAX, 1),
        (MAX_BLOCKS + 1, 1),
        (u32::MAX / 256 + 1, 256),
    ] {
        let t = Instant::now();
        match BlockManager::new(BlockManagerConfig::new(nb, bs)) {
            Err(BlockError::BadPoolSize { max, .. }) => assert!(max <= MAX_BLOCKS),
            other => panic!("{nb} x {bs}: {:?}", other.map(|_| ())),
        }
        assert!(t.elapsed().as_secs() < 1);
    }
    assert!(BlockManager::new(BlockManagerConfig::new(MAX_BLOCKS, 1)).is_ok());
}

/// Options the kernels cannot run exactly are refused with their reason.
#[test]
fn options_must_be_finite() {
    let bad = [
        AttnOptions {
            scale: Some(f32::NAN),
            ..Default::default()
        },
        AttnOptions {
            scale: Some(f32::INFINITY),
            ..Default::default()
        },
        AttnOptions {
            scale: Some(f32::NEG_INFINITY),
            ..Default::default()
        },
        AttnOptions {
            soft_cap: Some(f32::INFINITY),
            ..Default::default()
        },
        AttnOptions {
            soft_cap: Some(f32::NAN),
            ..Default::default()
        },
        AttnOptions {
            soft_cap: Some(0.0),
            ..Default::default()
        },
        AttnOptions {
            soft_cap: Some(-1.0),
            ..Default::default()
        },
        AttnOptions {
            alibi_slopes: Some(vec![0.5, f32::NAN]),
            ..Default::default()
        },
        AttnOptions {
            alibi_slopes: Some(vec![f32::INFINITY, 0.5]),
            ..Default::default()
        },
        AttnOptions {
            alibi_slopes: Some(vec![0.5]),
            ..Default::default()
        },
        AttnOptions {
            sliding_window: Some(0),
            ..Default::default()
        },
        // Sink tokens need a window, at least one position, and no forced
        // cascade.
        AttnOptions {
            sink_tokens: Some(4),
            ..Default::default()
        },
        AttnOptions {
            sink_tokens: Some(0),
            sliding_window: Some(8),
            ..Default::default()
        },
        AttnOptions {
            sink_tokens: Some(4),
            sliding_window: Some(8),
            cascade: pagedattn::gpu::Cascade::On,
            ..Default::default()
        },
        AttnOptions {
            split: Split::Tokens(0),
            ..Default::default()
        },
        AttnOptions {
            split: Split::Tokens(100),
            ..Default::default()
        },
    ];
    for o in &bad {
        let e = o.validate(2).expect_err(&format!("{o:?} accepted"));
        assert!(!e.to_string().is_empty());
    }
    let good = AttnOptions {
        scale: Some(0.1),
        soft_cap: Some(50.0),
        sliding_window: Some(u32::MAX),
        alibi_slopes: Some(vec![0.5, -0.25]),
        split: Split::Tokens(64),
        cascade: pagedattn::gpu::Cascade::On,
        sinks: Some(vec![-1.0, 3.0]),
        sink_tokens: None,
    };
    assert_eq!(good.validate(2), Ok(()));
    let streaming = AttnOptions {
        sliding_window: Some(128),
        sink_tokens: Some(4),
        ..Default::default()
    };
    assert_eq!(streaming.validate(2), Ok(()));
}

/// `check_csr_tables` refuses a length the kernels cannot bound: past
/// `MAX_SEQ_LEN`, even over a table that holds it (2^24 entries of 256).
#[test]
fn lengths_the_kernels_cannot_bound_are_refused() {
    let n = 1usize << 24;
    let indices = vec![0u32; n];
    let r = check_csr_tables(1, 256, &[0, n as u32], &indices, &[u32::MAX]);
    let e = r.expect_err("u32::MAX tokens over 2^24 x 256 accepted");
    assert!(e.to_string().contains("over the limit"), "{e}");
    assert!(check_csr_tables(1, 256, &[0, n as u32], &indices, &[MAX_SEQ_LEN]).is_ok());
    assert!(check_csr_tables(1, 256, &[0, n as u32], &indices, &[MAX_SEQ_LEN + 1]).is_err());
}

/// Packing tables bounds what it would allocate: a query count of
/// `u32::MAX` is refused at once, not 4 billion tile entries later.
#[test]
fn table_packing_is_bounded() {
    let t = Instant::now();
    let r = PackedTables::pack(&[0, 1], &[0], &[16], None, Some((&[0, u32::MAX], 8)));
    match r {
        Err(e) => assert!(e.to_string().contains("query tiles"), "{e}"),
        Ok(p) => panic!("packed {} words", p.words.len()),
    }
    assert!(t.elapsed().as_secs() < 1);
    let lens = vec![1u32; 70_000];
    assert!(
        PackedTables::pack(&[0], &[], &lens, None, None).is_err(),
        "more sequences than one dispatch"
    );
    assert!(PackedTables::pack(&[0, 1], &[0], &[16], Some(&[f32::NAN]), None).is_err());
    let ok = PackedTables::pack(&[0, 1], &[5], &[16], Some(&[0.5]), Some((&[0, 3], 2))).unwrap();
    assert_eq!(
        ok.words,
        vec![0, 1, 16, 5, 0.5f32.to_bits(), 0, 3, 0, 0, 0, 2]
    );
    assert_eq!((ok.num_tiles, ok.qo_off, ok.max_len), (2, 5, 16));
}

/// Cache shapes whose sizes overflow are refused by the shape check alone
/// (no adapter needed), in debug and release.
#[test]
fn cache_shapes_that_overflow_fail_validation() {
    let base = KvCacheConfig::new(4, 16, 1, 64).with_dtype(KvDtype::F16);
    for cfg in [
        KvCacheConfig {
            block_size: 256,
            num_kv_heads: 65536,
            head_dim: 256,
            ..base
        },
        KvCacheConfig {
            num_kv_heads: 1_000_000,
            ..base
        },
        KvCacheConfig {
            num_layers: u32::MAX,
            ..base
        },
        KvCacheConfig {
            head_dim: 260,
            ..base
        },
        KvCacheConfig {
            block_size: 3,
            ..base
        },
    ] {
        assert!(cfg.validate().is_err(), "{cfg:?}");
        // The size helpers never divide by zero or overflow, valid or not.
        let _ = (
            cfg.block_bytes(),
            cfg.layer_bytes(),
            cfg.block_elems4(),
            cfg.max_blocks_for(u64::MAX),
        );
    }
    let big = KvCacheConfig {
        block_size: 256,
        num_kv_heads: 65535,
        head_dim: 256,
        ..base
    };
    assert!(big.validate().is_ok());
    assert_eq!(
        big.max_blocks_for(u64::MAX),
        4,
        "4 blocks of 2^30 vec4s fit u32 offsets"
    );
}
