//! Property test of the block manager: seeded random operation sequences
//! through the one model checker (`test-support/src/block_ops.rs`), the same one
//! the fuzz target and its corpus replay (`tests/fuzz_corpus.rs`) use.
//!
//! Inputs are built for the checker's byte format with valid
//! configurations (small pools, so that `OutOfBlocks` is common; prefix
//! caching off or on; host swap space of 0 to 15 blocks) and random
//! operations: add with repeated prefixes, append, fork, free, batch views
//! of all or some sequences, chunked steps (`plan_step` with token budgets,
//! stale plans, `commit_step`), swap-out and swap-in of groups, calls on
//! swapped-out sequences, taking copies, evicting the cache, sliding
//! windows, and calls on unknown handles. The checker predicts every
//! result from its model, replays the copies and writes on a simulated
//! pool and swap space, and checks the invariants after every call (see
//! its module docs).
//!
//! Seeds are printed on failure; `BLOCKS_PROP_SEED=<seed>` reruns one run
//! (with `BLOCKS_PROP_CACHE=1` for the prefix-caching variant).

use crate::block_ops;

use std::panic::{catch_unwind, resume_unwind};

use block_ops::Coverage;
use pagedattn::rng::SplitMix64;

/// A valid configuration, then `ops` bytes of operations.
fn input(seed: u64, prefix: bool, ops: usize) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    let mut data = vec![
        rng.below(5) as u8,                         // block size 1..=16
        1 + rng.below(39) as u8,                    // 1..=39 blocks
        rng.below(256) as u8,                       // max_seq_len
        (rng.below(128) as u8) << 1 | prefix as u8, // swap space, scrambling
    ];
    data.extend((0..ops).map(|_| rng.below(256) as u8));
    data
}

fn run_one(seed: u64, prefix: bool) -> Coverage {
    let data = input(seed, prefix, 3000);
    match catch_unwind(|| block_ops::run(&data)) {
        Ok(c) => c,
        Err(p) => {
            eprintln!(
                "block manager property failed: BLOCKS_PROP_SEED={seed} BLOCKS_PROP_CACHE={}",
                prefix as u8
            );
            resume_unwind(p)
        }
    }
}

fn run_many(prefix: bool, base: u64) -> Coverage {
    if let Some(seed) = std::env::var("BLOCKS_PROP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        let cache = std::env::var("BLOCKS_PROP_CACHE").is_ok_and(|v| v == "1");
        return run_one(seed, cache);
    }
    let mut total = Coverage::default();
    for i in 0..200 {
        total.add(&run_one(base + i, prefix));
    }
    total
}

fn assert_exercised(c: &Coverage, prefix: bool) {
    let named = c.named();
    let get = |w: &str| named.iter().find(|(n, _)| *n == w).map_or(0, |x| x.1);
    let mut want = vec![
        "added",
        "appended",
        "copy-on-write",
        "forked",
        "freed",
        "views",
        "out of blocks",
        "unknown ids",
        "duplicates",
        "groups swapped out",
        "groups swapped in",
        "swap space full",
        "chunked steps",
        "stale plans refused",
        "calls refused on swapped sequences",
    ];
    if prefix {
        want.extend(["prefix hits", "revivals", "evictions"]);
    }
    for w in want {
        assert!(get(w) > 0, "never exercised {w}: {named:?}");
    }
}

#[test]
fn random_operations_match_the_model_without_prefix_caching() {
    let c = run_many(false, 0xB10C_0000);
    if std::env::var("BLOCKS_PROP_SEED").is_err() {
        assert_exercised(&c, false);
    }
}

#[test]
fn random_operations_match_the_model_with_prefix_caching() {
    let c = run_many(true, 0xCAC4_0000);
    if std::env::var("BLOCKS_PROP_SEED").is_err() {
        assert_exercised(&c, true);
    }
}
