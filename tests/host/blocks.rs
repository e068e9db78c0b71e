//! Unit tests of the host-side block manager: block-size validation, block
//! growth, slots, fork and copy-on-write, freeing, prefix caching with LRU
//! eviction, stats, the CSR batch view, and the rule that every failing call
//! returns a precise error and leaves the manager exactly as it was.

use std::collections::HashSet;

use pagedattn::blocks::{
    BatchView, BlockError, BlockManager, BlockManagerConfig, BlockStats, SeqId, SKIP_WRITE,
};

fn manager(num_blocks: u32, block_size: u32) -> BlockManager {
    BlockManager::new(BlockManagerConfig::new(num_blocks, block_size)).unwrap()
}

fn cached_manager(num_blocks: u32, block_size: u32) -> BlockManager {
    BlockManager::new(BlockManagerConfig::new(num_blocks, block_size).with_prefix_caching(true))
        .unwrap()
}

/// Token ids `start..start + n`.
fn toks(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

/// Runs a call that must fail, checks that the manager is unchanged, and
/// returns the error with its message.
#[track_caller]
fn fails<T: std::fmt::Debug>(
    m: &mut BlockManager,
    call: impl FnOnce(&mut BlockManager) -> Result<T, BlockError>,
) -> (BlockError, String) {
    let snapshot = m.clone();
    let err = call(m).expect_err("the call should have failed");
    assert!(
        *m == snapshot,
        "a failing call changed the manager ({err:?})"
    );
    let msg = err.to_string();
    (err, msg)
}

#[track_caller]
fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} does not mention {p:?}");
    }
}

// ---------------------------------------------------------------- construction

#[test]
fn block_size_must_be_a_power_of_two_up_to_256() {
    for bs in [
        0u32,
        3,
        5,
        6,
        7,
        12,
        24,
        100,
        255,
        257,
        384,
        512,
        1024,
        u32::MAX,
    ] {
        let err = BlockManager::new(BlockManagerConfig::new(4, bs)).unwrap_err();
        assert_eq!(err, BlockError::BadBlockSize(bs));
        assert_mentions(&err.to_string(), &[&bs.to_string()]);
    }
    for shift in 0..=8 {
        let bs = 1u32 << shift;
        let m = BlockManager::new(BlockManagerConfig::new(4, bs)).unwrap();
        assert_eq!(m.block_size(), bs);
        assert_eq!(m.config().num_blocks, 4);
        assert_eq!(m.stats().free, 4);
    }
}

#[test]
fn pool_must_be_addressable_by_u32_slots() {
    let err = BlockManager::new(BlockManagerConfig::new(0, 16)).unwrap_err();
    let max = (u32::MAX / 16).min(pagedattn::blocks::MAX_BLOCKS);
    assert_eq!(
        err,
        BlockError::BadPoolSize {
            num_blocks: 0,
            block_size: 16,
            max
        }
    );
    assert_mentions(
        &err.to_string(),
        &["0 blocks", "16 tokens", &max.to_string()],
    );

    let too_many = u32::MAX / 256 + 1;
    let err = BlockManager::new(BlockManagerConfig::new(too_many, 256)).unwrap_err();
    assert_eq!(
        err,
        BlockError::BadPoolSize {
            num_blocks: too_many,
            block_size: 256,
            max: too_many - 1
        }
    );
    assert_mentions(
        &err.to_string(),
        &[&too_many.to_string(), &(too_many - 1).to_string()],
    );

    // One block is enough.
    let mut m = manager(1, 1);
    let a = m.add_sequence(&[7]).unwrap();
    assert_eq!(m.block_table(a).unwrap(), &[0]);
}

#[test]
fn a_fresh_pool_hands_out_blocks_in_order() {
    let mut m = manager(8, 4);
    let a = m.add_sequence(&toks(0, 9)).unwrap();
    assert_eq!(m.block_table(a).unwrap(), &[0, 1, 2]);
}

// ---------------------------------------------------------------- growth and slots

#[test]
fn append_fills_the_last_block_before_taking_a_new_one() {
    for bs in [1u32, 2, 4, 8, 16] {
        let mut m = manager(64, bs);
        let a = m.add_sequence(&[1]).unwrap();
        let mut table = m.block_table(a).unwrap().to_vec();
        for len in 2..=(5 * bs as usize + 3) {
            m.append(a, &[len as u32]).unwrap();
            let now = m.block_table(a).unwrap().to_vec();
            assert_eq!(now.len(), len.div_ceil(bs as usize), "bs {bs}, len {len}");
            // Existing entries never move; a new block only when the last one overflowed.
            assert_eq!(&now[..table.len()], &table[..]);
            let grew = now.len() > table.len();
            assert_eq!(grew, (len - 1) % bs as usize == 0, "bs {bs}, len {len}");
            let waste = now.len() * bs as usize - len;
            assert!(waste < bs as usize, "waste {waste} at bs {bs}");
            table = now;
        }
        assert_eq!(m.stats().used, table.len());
    }
}

#[test]
fn appending_many_tokens_takes_exactly_the_blocks_needed() {
    let mut m = manager(64, 8);
    let a = m.add_sequence(&toks(0, 5)).unwrap();
    let slots = m.append(a, &toks(5, 20)).unwrap(); // 25 tokens: 4 blocks
    assert_eq!(m.block_table(a).unwrap().len(), 4);
    assert_eq!(slots.len(), 20);
    assert_eq!(m.stats().free, 60);
    // Appending nothing is a no-op.
    let before = m.clone();
    assert_eq!(m.append(a, &[]).unwrap(), Vec::<u32>::new());
    assert!(m == before);
}

#[test]
fn slot_is_block_times_block_size_plus_offset() {
    for bs in [1u32, 4, 16] {
        let mut m = manager(40, bs);
        m.scramble_free_list(0x5eed ^ bs as u64);
        let a = m.add_sequence(&toks(100, 3 * bs + 1)).unwrap();
        let b = m.add_sequence(&toks(200, 2)).unwrap();
        let new_slots = m.append(a, &toks(300, 2 * bs)).unwrap();
        let len = m.seq_len(a).unwrap();
        let table = m.block_table(a).unwrap().to_vec();
        for pos in 0..len {
            let want = table[pos / bs as usize] * bs + (pos % bs as usize) as u32;
            assert_eq!(m.slot(a, pos).unwrap(), want);
        }
        let appended: Vec<u32> = (len - new_slots.len()..len)
            .map(|p| m.slot(a, p).unwrap())
            .collect();
        assert_eq!(new_slots, appended);
        // Two sequences never share a slot without sharing a block.
        let slots_a: HashSet<u32> = (0..len).map(|p| m.slot(a, p).unwrap()).collect();
        assert!((0..2).all(|p| !slots_a.contains(&m.slot(b, p).unwrap())));
        assert_eq!(slots_a.len(), len);
    }
}

#[test]
fn scrambled_free_list_still_hands_out_every_block_once() {
    let mut m = manager(32, 2);
    m.scramble_free_list(42);
    let a = m.add_sequence(&toks(0, 64)).unwrap();
    let mut t = m.block_table(a).unwrap().to_vec();
    assert_ne!(
        t,
        (0..32).collect::<Vec<_>>(),
        "scramble left the order unchanged"
    );
    t.sort();
    assert_eq!(t, (0..32).collect::<Vec<_>>());
}

// ---------------------------------------------------------------- fork, CoW, free

#[test]
fn fork_shares_every_block() {
    let mut m = manager(16, 4);
    let a = m.add_sequence(&toks(0, 10)).unwrap();
    m.batch_view(&[a]).unwrap();
    let b = m.fork(a).unwrap();
    let c = m.fork(b).unwrap();
    assert_ne!(a, b);
    assert_ne!(b, c);
    let table = m.block_table(a).unwrap().to_vec();
    assert_eq!(m.block_table(b).unwrap(), &table[..]);
    assert_eq!(m.block_table(c).unwrap(), &table[..]);
    assert_eq!(m.tokens(c).unwrap(), &toks(0, 10)[..]);
    assert_eq!(m.pending_tokens(c).unwrap(), 0);
    for &blk in &table {
        assert_eq!(m.ref_count(blk), Some(3));
    }
    let s = m.stats();
    assert_eq!((s.used, s.shared, s.free, s.sequences), (3, 3, 13, 3));
    assert_eq!(m.ref_count(16), None);
}

#[test]
fn first_write_into_a_shared_partial_block_copies_it() {
    let mut m = manager(16, 4);
    let a = m.add_sequence(&toks(0, 6)).unwrap(); // blocks [0, 1], block 1 half full
    m.batch_view(&[a]).unwrap();
    let b = m.fork(a).unwrap();
    let slots = m.append(b, &[99]).unwrap();
    let tb = m.block_table(b).unwrap().to_vec();
    assert_eq!(tb[0], 0, "the full first block stays shared");
    assert_ne!(tb[1], 1, "the shared partial block was written in place");
    assert_eq!(m.pending_copies(), &[[1, tb[1]]]);
    assert_eq!(slots, vec![tb[1] * 4 + 2]);
    assert_eq!(m.ref_count(0), Some(2));
    assert_eq!(
        m.ref_count(1),
        Some(1),
        "the old block keeps only the parent's reference"
    );
    assert_eq!(m.ref_count(tb[1]), Some(1));
    assert_eq!(m.block_table(a).unwrap(), &[0, 1]);

    // The second write into the child's own copy needs no copy.
    m.append(b, &[100]).unwrap();
    assert_eq!(m.pending_copies().len(), 1);
    // The parent now holds block 1 alone: it writes in place.
    let slots = m.append(a, &[7]).unwrap();
    assert_eq!(slots, vec![6]);
    assert_eq!(m.block_table(a).unwrap(), &[0, 1]);
    assert_eq!(m.take_copies(), vec![[1, tb[1]]]);
    assert!(m.take_copies().is_empty());
    assert_eq!(m.stats().pending_copies, 0);
}

#[test]
fn copy_on_write_also_grows_when_the_write_overflows() {
    let mut m = manager(16, 4);
    let a = m.add_sequence(&toks(0, 3)).unwrap();
    m.batch_view(&[a]).unwrap();
    let b = m.fork(a).unwrap();
    m.append(b, &toks(3, 3)).unwrap(); // fills the copied block and one more
    let tb = m.block_table(b).unwrap().to_vec();
    assert_eq!(tb.len(), 2);
    assert_eq!(m.pending_copies(), &[[0, tb[0]]]);
    assert_eq!(m.stats().free, 16 - 3);
}

#[test]
fn a_full_shared_last_block_is_not_copied() {
    let mut m = manager(16, 4);
    let a = m.add_sequence(&toks(0, 8)).unwrap();
    m.batch_view(&[a]).unwrap();
    let b = m.fork(a).unwrap();
    let slots = m.append(b, &[50]).unwrap();
    let tb = m.block_table(b).unwrap().to_vec();
    assert_eq!(&tb[..2], &[0, 1]);
    assert_eq!(tb.len(), 3);
    assert_eq!(slots, vec![tb[2] * 4]);
    assert!(m.pending_copies().is_empty());
    assert_eq!(m.ref_count(0), Some(2));
    assert_eq!(m.ref_count(1), Some(2));
}

#[test]
fn free_returns_blocks_once_the_last_holder_is_gone() {
    let mut m = manager(8, 4);
    let a = m.add_sequence(&toks(0, 6)).unwrap();
    m.batch_view(&[a]).unwrap();
    let b = m.fork(a).unwrap();
    m.append(b, &[1]).unwrap(); // CoW: b holds [0, new]
    assert_eq!(m.stats().free, 5);
    m.free(a).unwrap();
    // Block 1 had only a's reference left, but the pending copy still reads
    // it: it is held back until the copies are taken. Block 0 is still b's.
    assert_eq!((m.stats().free, m.stats().awaiting_copy), (5, 1));
    assert_eq!(m.take_copies().len(), 1);
    assert_eq!((m.stats().free, m.stats().awaiting_copy), (6, 0));
    assert_eq!(m.ref_count(0), Some(1));
    assert_eq!(m.ref_count(1), Some(0));
    m.free(b).unwrap();
    let s = m.stats();
    assert_eq!(
        (s.free, s.used, s.sequences, s.logical_tokens),
        (8, 0, 0, 0)
    );
    assert!((0..8).all(|blk| m.ref_count(blk) == Some(0)));
    // A freed id stays dead and is not reused.
    let c = m.add_sequence(&[1]).unwrap();
    assert!(c != a && c != b);
}

#[test]
fn freeing_a_copy_destination_drops_its_pending_copy() {
    let mut m = manager(8, 4);
    let a = m.add_sequence(&toks(0, 2)).unwrap();
    m.batch_view(&[a]).unwrap();
    let b = m.fork(a).unwrap();
    let c = m.fork(a).unwrap();
    m.append(b, &[9]).unwrap();
    m.append(c, &[9]).unwrap();
    let copies = m.pending_copies().to_vec();
    assert_eq!(copies.len(), 2);
    m.free(b).unwrap();
    let dst_c = m.block_table(c).unwrap()[0];
    assert_eq!(m.pending_copies(), &[[0, dst_c]]);
}

#[test]
fn fork_needs_the_pending_tokens_handed_over_first() {
    let mut m = manager(8, 4);
    let a = m.add_sequence(&toks(0, 5)).unwrap();
    let (err, msg) = fails(&mut m, |m| m.fork(a));
    assert_eq!(err, BlockError::PendingTokens { seq: a, pending: 5 });
    assert_mentions(&msg, &[&a.to_string(), "5 token"]);
    m.batch_view(&[a]).unwrap();
    m.append(a, &[1, 2]).unwrap();
    let (err, msg) = fails(&mut m, |m| m.fork(a));
    assert_eq!(err, BlockError::PendingTokens { seq: a, pending: 2 });
    assert_mentions(&msg, &[&a.to_string(), "2 token"]);
    m.batch_view(&[a]).unwrap();
    assert!(m.fork(a).is_ok());
}

// ---------------------------------------------------------------- prefix caching

#[test]
fn prefix_cache_reuses_full_blocks_handed_to_the_gpu() {
    let mut m = cached_manager(32, 4);
    let prompt = toks(0, 10); // 2 full blocks + 2 tokens
    let a = m.add_sequence(&prompt).unwrap();
    // Not yet viewed: the blocks' K/V are not written, nothing to share.
    let early = m.add_sequence(&prompt).unwrap();
    assert!(m
        .block_table(early)
        .unwrap()
        .iter()
        .all(|b| !m.block_table(a).unwrap().contains(b)));
    assert_eq!(m.prefix_hit_tokens(), 0);
    m.free(early).unwrap();

    m.batch_view(&[a]).unwrap();
    let mut p2 = toks(0, 8);
    p2.extend([77, 78, 79]);
    let b = m.add_sequence(&p2).unwrap();
    let ta = m.block_table(a).unwrap().to_vec();
    let tb = m.block_table(b).unwrap().to_vec();
    assert_eq!(&tb[..2], &ta[..2]);
    assert_ne!(tb[2], ta[2]);
    assert_eq!(m.ref_count(ta[0]), Some(2));
    assert_eq!(m.ref_count(ta[1]), Some(2));
    assert_eq!(m.prefix_hit_tokens(), 8);
    assert_eq!(
        m.pending_tokens(b).unwrap(),
        3,
        "only the uncached tail is pending"
    );
    let v = m.batch_view(&[b]).unwrap();
    assert_eq!(
        v.slot_mapping,
        vec![tb[2] * 4, tb[2] * 4 + 1, tb[2] * 4 + 2]
    );

    // A prompt that diverges inside the first block shares nothing.
    let mut p3 = toks(0, 8);
    p3[1] = 1000;
    let c = m.add_sequence(&p3).unwrap();
    assert!(m
        .block_table(c)
        .unwrap()
        .iter()
        .all(|blk| !ta.contains(blk)));
    // A prompt that diverges in the second block shares only the first.
    let mut p4 = toks(0, 8);
    p4[6] = 1000;
    let d = m.add_sequence(&p4).unwrap();
    let td = m.block_table(d).unwrap().to_vec();
    assert_eq!(td[0], ta[0]);
    assert_ne!(td[1], ta[1]);
    assert_eq!(m.prefix_hit_tokens(), 12);
}

#[test]
fn prefix_cache_matches_blocks_filled_by_appends() {
    let mut m = cached_manager(32, 4);
    let a = m.add_sequence(&toks(0, 3)).unwrap();
    m.batch_view(&[a]).unwrap();
    m.append(a, &toks(3, 6)).unwrap(); // now 9 tokens, 2 full blocks
                                       // Block 0 was partial at the view, block 1 is not viewed yet: nothing is cached.
    let b_early = m.add_sequence(&toks(0, 8)).unwrap();
    assert_eq!(m.prefix_hit_tokens(), 0);
    m.free(b_early).unwrap();
    m.batch_view(&[a]).unwrap();
    let b = m.add_sequence(&toks(0, 8)).unwrap();
    assert_eq!(m.block_table(b).unwrap(), &m.block_table(a).unwrap()[..2]);
    // The cache-hit cap: the last token is computed again for its logits,
    // its write skipped, so the last block stays shared.
    assert_eq!(
        m.pending_tokens(b).unwrap(),
        1,
        "a fully cached prompt computes its last token"
    );
    assert_eq!(m.prefix_hit_tokens(), 7);
    let plan = m.plan_step(&[(b, usize::MAX)]).unwrap();
    assert_eq!(plan.view().slot_mapping, vec![SKIP_WRITE]);
    assert_eq!(plan.view().seq_lens, vec![8]);
    assert!(plan.completes()[0]);
    m.commit_step(&plan).unwrap();
    assert_eq!(m.block_table(b).unwrap(), &m.block_table(a).unwrap()[..2]);
    // Its last block is full and shared: appending takes a new block, no copy.
    m.append(b, &[8]).unwrap();
    assert!(m.pending_copies().is_empty());
}

#[test]
fn prefix_caching_off_never_shares() {
    let mut m = manager(32, 4);
    let a = m.add_sequence(&toks(0, 8)).unwrap();
    m.batch_view(&[a]).unwrap();
    let b = m.add_sequence(&toks(0, 8)).unwrap();
    assert!(m
        .block_table(b)
        .unwrap()
        .iter()
        .all(|blk| m.ref_count(*blk) == Some(1)));
    m.free(a).unwrap();
    assert_eq!(m.stats().evictable, 0);
    assert_eq!(m.prefix_hit_tokens(), 0);
}

#[test]
fn freed_cached_blocks_stay_evictable_and_are_revived() {
    let mut m = cached_manager(8, 2);
    let a = m.add_sequence(&toks(0, 5)).unwrap(); // 2 full blocks + 1 token
    m.batch_view(&[a]).unwrap();
    let ta = m.block_table(a).unwrap().to_vec();
    m.free(a).unwrap();
    let s = m.stats();
    assert_eq!((s.free, s.evictable, s.used), (6, 2, 0));
    assert_eq!(m.available_blocks(), 8);

    let b = m.add_sequence(&toks(0, 6)).unwrap();
    let tb = m.block_table(b).unwrap().to_vec();
    assert_eq!(&tb[..2], &ta[..2], "the cached chain was not revived");
    assert_eq!(m.ref_count(ta[0]), Some(1));
    assert_eq!(m.pending_tokens(b).unwrap(), 2);
    let s = m.stats();
    assert_eq!((s.free, s.evictable, s.used), (5, 0, 3));
    assert_eq!(m.prefix_hit_tokens(), 4);
}

#[test]
fn evictable_blocks_are_taken_oldest_first_and_only_when_no_free_block_is_left() {
    let mut m = cached_manager(4, 2);
    let a = m.add_sequence(&toks(0, 4)).unwrap(); // blocks 0, 1
    m.batch_view(&[a]).unwrap();
    let ta = m.block_table(a).unwrap().to_vec();
    m.free(a).unwrap();
    assert_eq!(m.stats().evictable, 2);

    // Two plain free blocks remain: they go first, the cache is untouched.
    let b = m.add_sequence(&toks(100, 4)).unwrap();
    let tb = m.block_table(b).unwrap().to_vec();
    assert!(tb.iter().all(|blk| !ta.contains(blk)));
    assert_eq!(m.stats().evictable, 2);

    // Now the oldest release goes: a's tail block, released first.
    let c = m.add_sequence(&[200]).unwrap();
    assert_eq!(m.block_table(c).unwrap(), &[ta[1]]);
    assert_eq!(m.stats().evictable, 1);

    // The head of the chain survived and is still matched; its tail is gone.
    m.free(c).unwrap();
    let d = m.add_sequence(&toks(0, 4)).unwrap();
    let td = m.block_table(d).unwrap().to_vec();
    assert_eq!(td[0], ta[0]);
    assert_eq!(m.prefix_hit_tokens(), 2);
}

#[test]
fn lru_order_follows_release_time_across_sequences() {
    let mut m = cached_manager(6, 1);
    let a = m.add_sequence(&[1, 2]).unwrap();
    let b = m.add_sequence(&[3, 4]).unwrap();
    m.batch_view(&[a, b]).unwrap();
    let (ta, tb) = (
        m.block_table(a).unwrap().to_vec(),
        m.block_table(b).unwrap().to_vec(),
    );
    m.free(b).unwrap(); // released first: tb[1], tb[0]
    m.free(a).unwrap(); // then ta[1], ta[0]
    let filler = m.add_sequence(&[9, 9]).unwrap(); // the two plain free blocks
    m.batch_view(&[filler]).unwrap();
    let mut taken = Vec::new();
    for t in 0..4u32 {
        let s = m.add_sequence(&[500 + t]).unwrap();
        taken.push(m.block_table(s).unwrap()[0]);
    }
    assert_eq!(taken, vec![tb[1], tb[0], ta[1], ta[0]]);
}

#[test]
fn evict_all_cached_turns_cached_blocks_into_plain_free_ones() {
    let mut m = cached_manager(8, 2);
    let a = m.add_sequence(&toks(0, 6)).unwrap();
    m.batch_view(&[a]).unwrap();
    m.free(a).unwrap();
    assert_eq!(m.stats().evictable, 3);
    assert_eq!(m.evict_all_cached(), 3);
    let s = m.stats();
    assert_eq!((s.free, s.evictable), (8, 0));
    assert_eq!(m.evict_all_cached(), 0);
    let b = m.add_sequence(&toks(0, 6)).unwrap();
    assert_eq!(m.prefix_hit_tokens(), 0);
    assert_eq!(m.pending_tokens(b).unwrap(), 6);
    // The dropped blocks forgot their prefix: reused and freed unviewed, they
    // come back as plain free blocks, not as evictable ones.
    let c = m.add_sequence(&toks(50, 4)).unwrap();
    m.free(b).unwrap();
    m.free(c).unwrap();
    let s = m.stats();
    assert_eq!((s.free, s.evictable), (8, 0));
}

// ---------------------------------------------------------------- stats

#[test]
fn stats_count_every_field() {
    let mut m = cached_manager(16, 4);
    assert_eq!(
        m.stats(),
        BlockStats {
            total: 16,
            free: 16,
            ..BlockStats::default()
        }
    );
    let a = m.add_sequence(&toks(0, 6)).unwrap(); // blocks 0, 1; 6 tokens
    let d = m.add_sequence(&toks(100, 4)).unwrap(); // block 2, full
    m.batch_view(&[a, d]).unwrap();
    m.free(d).unwrap(); // its cached full block becomes evictable
    let b = m.fork(a).unwrap(); // shares both of a's blocks
    m.append(b, &[50, 51]).unwrap(); // CoW of the partial block: b = [0, 3], 8 tokens
    let c = m.add_sequence(&toks(0, 5)).unwrap(); // reuses the cached block 0 + block 4
    let s = m.stats();
    assert_eq!(
        s,
        BlockStats {
            total: 16,
            free: 11,
            evictable: 1,
            used: 4,
            shared: 1,
            sequences: 3,
            // block 0: 4, a's block 1: 2, b's copy: 4, c's block: 1
            tokens_stored: 11,
            logical_tokens: 6 + 8 + 5,
            capacity_held: 16,
            pending_copies: 1,
            awaiting_copy: 0,
            swapped_sequences: 0,
            swap_used: 0,
            swap_total: 0,
        }
    );
    assert_eq!(m.ref_count(0), Some(3));
    assert_eq!(s.free + s.evictable + s.used, s.total);
    assert_eq!(m.num_sequences(), 3);
    assert_eq!(m.sequence_ids(), vec![a, b, c]);
}

// ---------------------------------------------------------------- batch view

#[test]
fn batch_view_lists_tables_in_csr_form_and_only_new_slots() {
    let mut m = manager(32, 4);
    m.scramble_free_list(7);
    let a = m.add_sequence(&toks(0, 5)).unwrap();
    let b = m.add_sequence(&toks(0, 1)).unwrap();
    let c = m.add_sequence(&toks(0, 9)).unwrap();
    let (ta, tb, tc) = (
        m.block_table(a).unwrap().to_vec(),
        m.block_table(b).unwrap().to_vec(),
        m.block_table(c).unwrap().to_vec(),
    );
    let slots = |m: &BlockManager, s: SeqId, r: std::ops::Range<usize>| -> Vec<u32> {
        r.map(|p| m.slot(s, p).unwrap()).collect()
    };

    // Order follows the request, not the ids.
    let v = m.batch_view(&[c, a, b]).unwrap();
    assert_eq!(v.num_seqs(), 3);
    assert_eq!(v.kv_indptr, vec![0, 3, 5, 6]);
    assert_eq!(v.kv_indices, [&tc[..], &ta[..], &tb[..]].concat());
    assert_eq!(v.seq_lens, vec![9, 5, 1]);
    assert_eq!(v.new_indptr, vec![0, 9, 14, 15]);
    let want = [slots(&m, c, 0..9), slots(&m, a, 0..5), slots(&m, b, 0..1)].concat();
    assert_eq!(v.slot_mapping, want);
    assert!(v.copies.is_empty());
    assert_eq!(m.pending_tokens(a).unwrap(), 0);

    // A second view has nothing new to write.
    let v = m.batch_view(&[a, b, c]).unwrap();
    assert_eq!(v.new_indptr, vec![0, 0, 0, 0]);
    assert!(v.slot_mapping.is_empty());

    // Decode step: one token each, slots of the newest positions only.
    m.append(a, &[1]).unwrap();
    m.append(b, &[1, 2, 3, 4]).unwrap(); // b grows to 5 tokens: second block
    let v = m.batch_view(&[a, b]).unwrap();
    assert_eq!(v.seq_lens, vec![6, 5]);
    assert_eq!(v.new_indptr, vec![0, 1, 5]);
    assert_eq!(
        v.slot_mapping,
        [slots(&m, a, 5..6), slots(&m, b, 1..5)].concat()
    );
    assert_eq!(v.kv_indptr, vec![0, 2, 4]);

    // A sequence left out of a view keeps its pending tokens for the next one.
    m.append(a, &[2]).unwrap();
    m.append(c, &[2]).unwrap();
    let v = m.batch_view(&[c]).unwrap();
    assert_eq!(v.slot_mapping, slots(&m, c, 9..10));
    assert_eq!(m.pending_tokens(a).unwrap(), 1);
    let v = m.batch_view(&[]).unwrap();
    assert_eq!((&v.kv_indptr[..], &v.new_indptr[..]), (&[0][..], &[0][..]));
    assert_eq!(v.num_seqs(), 0);
}

#[test]
fn batch_view_hands_over_copies_once() {
    let mut m = manager(16, 4);
    let a = m.add_sequence(&toks(0, 2)).unwrap();
    m.batch_view(&[a]).unwrap();
    let b = m.fork(a).unwrap();
    m.append(b, &[5]).unwrap();
    let dst = m.block_table(b).unwrap()[0];
    // Copies are pool-wide: they come with any view, even one without b.
    let v = m.batch_view(&[a]).unwrap();
    assert_eq!(v.copies, vec![[0, dst]]);
    assert!(v.slot_mapping.is_empty());
    let v = m.batch_view(&[b]).unwrap();
    assert!(v.copies.is_empty());
    assert_eq!(v.slot_mapping, vec![dst * 4 + 2]);
}

#[test]
fn batch_view_into_reuses_the_view_and_matches_batch_view() {
    let mut m = manager(64, 4);
    let ids: Vec<SeqId> = (0..5)
        .map(|i| m.add_sequence(&toks(0, 3 + 4 * i)).unwrap())
        .collect();
    let mut reused = BatchView {
        kv_indptr: vec![9; 3],
        kv_indices: vec![9; 40],
        seq_lens: vec![9],
        new_indptr: vec![9; 2],
        slot_mapping: vec![9; 7],
        copies: vec![[9, 9]],
    };
    let mut twin = m.clone();
    m.batch_view_into(&ids, &mut reused).unwrap();
    let fresh = twin.batch_view(&ids).unwrap();
    assert_eq!(reused, fresh);
    assert!(m == twin);
    for step in 0..3u32 {
        for &s in &ids {
            m.append(s, &[step]).unwrap();
            twin.append(s, &[step]).unwrap();
        }
        m.batch_view_into(&ids, &mut reused).unwrap();
        assert_eq!(reused, twin.batch_view(&ids).unwrap());
    }
    // A failing call leaves the reused view as it was, too.
    let before = reused.clone();
    let (err, _) = fails(&mut m, |m| {
        m.batch_view_into(&[ids[0], ids[0]], &mut reused)
    });
    assert_eq!(err, BlockError::DuplicateInBatch(ids[0]));
    assert_eq!(reused, before);
}

// ---------------------------------------------------------------- failing calls

#[test]
fn out_of_blocks_on_add_leaves_the_manager_unchanged() {
    let mut m = manager(4, 4);
    m.add_sequence(&toks(0, 12)).unwrap(); // 3 blocks
    let (err, msg) = fails(&mut m, |m| m.add_sequence(&toks(0, 8)));
    assert_eq!(err, BlockError::OutOfBlocks { needed: 2, free: 1 });
    assert_mentions(&msg, &["need 2", "only 1"]);
    assert!(m.add_sequence(&toks(0, 4)).is_ok());
    let (err, msg) = fails(&mut m, |m| m.add_sequence(&[1]));
    assert_eq!(err, BlockError::OutOfBlocks { needed: 1, free: 0 });
    assert_mentions(&msg, &["need 1", "only 0"]);
}

#[test]
fn out_of_blocks_on_add_counts_revived_blocks_as_taken() {
    let mut m = cached_manager(3, 2);
    let a = m.add_sequence(&toks(0, 4)).unwrap();
    m.batch_view(&[a]).unwrap();
    m.free(a).unwrap(); // 2 evictable + 1 free
                        // Reviving both cached blocks leaves one block for the two new ones.
    let (err, msg) = fails(&mut m, |m| m.add_sequence(&toks(0, 8)));
    assert_eq!(err, BlockError::OutOfBlocks { needed: 2, free: 1 });
    assert_mentions(&msg, &["need 2", "only 1"]);
    assert!(m.add_sequence(&toks(0, 6)).is_ok());
    assert_eq!(m.stats().free + m.stats().evictable, 0);
}

#[test]
fn out_of_blocks_on_append_leaves_the_manager_unchanged() {
    let mut m = manager(3, 4);
    let a = m.add_sequence(&toks(0, 6)).unwrap();
    let (err, msg) = fails(&mut m, |m| m.append(a, &toks(6, 7))); // 13 tokens: 4 blocks
    assert_eq!(err, BlockError::OutOfBlocks { needed: 2, free: 1 });
    assert_mentions(&msg, &["need 2", "only 1"]);
    m.append(a, &toks(6, 6)).unwrap(); // 12 tokens: exactly 3 blocks
    let (err, msg) = fails(&mut m, |m| m.append(a, &[1]));
    assert_eq!(err, BlockError::OutOfBlocks { needed: 1, free: 0 });
    assert_mentions(&msg, &["need 1", "only 0"]);
}

#[test]
fn out_of_blocks_on_copy_on_write_leaves_the_manager_unchanged() {
    let mut m = manager(2, 4);
    let a = m.add_sequence(&toks(0, 6)).unwrap(); // both blocks
    m.batch_view(&[a]).unwrap();
    let b = m.fork(a).unwrap();
    let (err, msg) = fails(&mut m, |m| m.append(b, &[1]));
    assert_eq!(err, BlockError::OutOfBlocks { needed: 1, free: 0 });
    assert_mentions(&msg, &["need 1", "only 0"]);
    // Copy plus growth: two blocks.
    let (err, msg) = fails(&mut m, |m| m.append(a, &toks(0, 3)));
    assert_eq!(err, BlockError::OutOfBlocks { needed: 2, free: 0 });
    assert_mentions(&msg, &["need 2", "only 0"]);
    assert!(m.pending_copies().is_empty());
}

#[test]
fn unknown_or_freed_sequences_are_rejected_by_every_call() {
    let mut m = manager(8, 4);
    let a = m.add_sequence(&toks(0, 3)).unwrap();
    let gone = m.add_sequence(&toks(0, 3)).unwrap();
    m.batch_view(&[a, gone]).unwrap();
    m.free(gone).unwrap();
    // A handle that was never this manager's: another manager's.
    let never = manager(8, 4).add_sequence(&toks(0, 3)).unwrap();
    for bad in [gone, never] {
        let want = BlockError::UnknownSequence(bad);
        let label = format!("unknown sequence {bad}");
        let checks: Vec<(BlockError, String)> = vec![
            fails(&mut m, |m| m.append(bad, &[1])),
            fails(&mut m, |m| m.append(bad, &[])),
            fails(&mut m, |m| m.fork(bad)),
            fails(&mut m, |m| m.free(bad)),
            fails(&mut m, |m| m.batch_view(&[a, bad])),
            fails(&mut m, |m| m.batch_view(&[bad, a, a])),
            fails(&mut m, |m| {
                m.batch_view_into(&[bad], &mut BatchView::default())
            }),
            fails(&mut m, |m| m.block_table(bad).map(|t| t.to_vec())),
            fails(&mut m, |m| m.seq_len(bad)),
            fails(&mut m, |m| m.tokens(bad).map(|t| t.to_vec())),
            fails(&mut m, |m| m.pending_tokens(bad)),
            fails(&mut m, |m| m.slot(bad, 0)),
        ];
        for (err, msg) in checks {
            assert_eq!(err, want);
            assert_eq!(msg, label);
        }
    }
    // a is untouched by all of this.
    assert_eq!(m.seq_len(a).unwrap(), 3);
    assert_eq!(m.sequence_ids(), vec![a]);
}

#[test]
fn empty_prompt_is_rejected() {
    let mut m = cached_manager(8, 4);
    let (err, msg) = fails(&mut m, |m| m.add_sequence(&[]));
    assert_eq!(err, BlockError::EmptyPrompt);
    assert_eq!(msg, "empty prompt");
}

#[test]
fn too_many_tokens_is_rejected_with_the_limit() {
    let cfg = BlockManagerConfig {
        max_seq_len: 10,
        ..BlockManagerConfig::new(16, 4)
    };
    let mut m = BlockManager::new(cfg).unwrap();
    let (err, msg) = fails(&mut m, |m| m.add_sequence(&toks(0, 11)));
    assert_eq!(
        err,
        BlockError::TooManyTokens {
            requested: 11,
            limit: 10
        }
    );
    assert_mentions(&msg, &["11 tokens", "limit of 10"]);
    let a = m.add_sequence(&toks(0, 10)).unwrap();
    m.free(a).unwrap();
    let a = m.add_sequence(&toks(0, 7)).unwrap();
    let (err, msg) = fails(&mut m, |m| m.append(a, &toks(7, 5)));
    assert_eq!(
        err,
        BlockError::TooManyTokens {
            requested: 12,
            limit: 10
        }
    );
    assert_mentions(&msg, &["12 tokens", "limit of 10"]);
    m.append(a, &toks(7, 3)).unwrap();
    let (err, _) = fails(&mut m, |m| m.append(a, &[1]));
    assert_eq!(
        err,
        BlockError::TooManyTokens {
            requested: 11,
            limit: 10
        }
    );
    // The length limit wins over the block shortage.
    let small = BlockManagerConfig {
        max_seq_len: 4,
        ..BlockManagerConfig::new(1, 4)
    };
    let mut m = BlockManager::new(small).unwrap();
    m.add_sequence(&[1]).unwrap();
    let (err, _) = fails(&mut m, |m| m.add_sequence(&toks(0, 5)));
    assert_eq!(
        err,
        BlockError::TooManyTokens {
            requested: 5,
            limit: 4
        }
    );
}

#[test]
fn slot_past_the_end_is_an_error() {
    let mut m = manager(8, 4);
    let a = m.add_sequence(&toks(0, 3)).unwrap();
    let (err, msg) = fails(&mut m, |m| m.slot(a, 3));
    assert_eq!(err, BlockError::PositionOutOfRange { pos: 3, len: 3 });
    assert_mentions(&msg, &["position 3", "3 tokens"]);
}

#[test]
fn duplicates_in_a_batch_are_rejected() {
    let mut m = manager(8, 4);
    let a = m.add_sequence(&toks(0, 3)).unwrap();
    let b = m.add_sequence(&toks(0, 3)).unwrap();
    m.append(a, &[1]).unwrap();
    let (err, msg) = fails(&mut m, |m| m.batch_view(&[a, b, a]));
    assert_eq!(err, BlockError::DuplicateInBatch(a));
    assert_eq!(msg, format!("sequence {a} appears twice in one batch"));
    let (err, _) = fails(&mut m, |m| m.batch_view(&[b, b]));
    assert_eq!(err, BlockError::DuplicateInBatch(b));
    assert_eq!(m.pending_tokens(a).unwrap(), 4);
}

#[test]
fn every_error_message_names_its_numbers() {
    let mut m = manager(8, 4);
    let _ = m.add_sequence(&toks(0, 3)).unwrap();
    let id = m.add_sequence(&toks(0, 3)).unwrap();
    let name = id.to_string();
    assert_eq!(name, "#1v0");
    let cases = [
        (
            BlockError::OutOfBlocks { needed: 7, free: 3 },
            vec!["7", "3"],
        ),
        (BlockError::UnknownSequence(id), vec![name.as_str()]),
        (BlockError::BadBlockSize(48), vec!["48"]),
        (
            BlockError::BadPoolSize {
                num_blocks: 9,
                block_size: 32,
                max: 5,
            },
            vec!["9", "32", "5"],
        ),
        (
            BlockError::TooManyTokens {
                requested: 130,
                limit: 128,
            },
            vec!["130", "128"],
        ),
        (
            BlockError::PendingTokens {
                seq: id,
                pending: 17,
            },
            vec![name.as_str(), "17"],
        ),
        (BlockError::DuplicateInBatch(id), vec![name.as_str()]),
        (
            BlockError::SwapSpaceFull { needed: 6, free: 2 },
            vec!["6", "2"],
        ),
        (BlockError::CopiesPending(5), vec!["5"]),
    ];
    for (err, parts) in cases {
        assert_mentions(&err.to_string(), &parts);
    }
}

// ---------------------------------------------------------------- copy list ordering

/// The copy list must be safe for a `copy_blocks` kernel that runs all pairs
/// of one list at once (one dispatch per layer, ARCHITECTURE.md): no block may be
/// read by one pair and written by another pair of the same list, or the
/// result depends on the order the GPU happens to run them in.
#[test]
fn a_copy_list_never_writes_a_block_another_pair_reads() {
    let mut m = manager(8, 4);
    // d holds a viewed partial block that will be copied later.
    let d = m.add_sequence(&toks(0, 2)).unwrap();
    let a = m.add_sequence(&toks(10, 2)).unwrap();
    m.batch_view(&[d, a]).unwrap();
    // b forks a and writes: copy (a's block -> fresh block).
    let b = m.fork(a).unwrap();
    m.append(b, &[1]).unwrap();
    // a goes away: its block, the source of the pending copy, is free again.
    let src = m.block_table(a).unwrap()[0];
    m.free(a).unwrap();
    // e forks d and writes: copy (d's block -> the next free block).
    let e = m.fork(d).unwrap();
    m.append(e, &[2]).unwrap();
    let copies = m.pending_copies().to_vec();
    let srcs: HashSet<u32> = copies.iter().map(|c| c[0]).collect();
    let clash: Vec<[u32; 2]> = copies
        .iter()
        .copied()
        .filter(|c| srcs.contains(&c[1]))
        .collect();
    assert!(
        clash.is_empty(),
        "copy list {copies:?} writes block(s) {clash:?} that an earlier pair reads \
         (block {src} was freed while still the source of a pending copy and handed out \
         again as a copy destination)"
    );
}

#[test]
fn blocks_needed_to_append_counts_growth_and_copy_on_write() {
    let mut m = manager(16, 4);
    let a = m.add_sequence(&toks(0, 6)).unwrap(); // 2 blocks, 2 free slots
    m.batch_view(&[a]).unwrap();
    assert_eq!(m.blocks_needed_to_append(&[a], 2).unwrap(), 0);
    assert_eq!(m.blocks_needed_to_append(&[a], 3).unwrap(), 1);
    let b = m.fork(a).unwrap(); // the partial block is now shared
    assert_eq!(m.blocks_needed_to_append(&[b], 1).unwrap(), 1);
    assert_eq!(m.blocks_needed_to_append(&[b], 3).unwrap(), 2);
    let before = m.available_blocks();
    m.append(b, &[1, 2, 3]).unwrap();
    assert_eq!(
        before - m.available_blocks(),
        2,
        "the bound is exact for one writer"
    );
    assert_eq!(m.blocks_needed_to_append(&[a, b], 0).unwrap(), 0);
    assert!(matches!(
        m.blocks_needed_to_append(&[manager(8, 4).add_sequence(&[1]).unwrap()], 1),
        Err(BlockError::UnknownSequence(_))
    ));
}

#[test]
fn sliding_window_releases_blocks_wholly_outside_it() {
    use pagedattn::blocks::RELEASED;
    let mut m = manager(16, 4);
    let a = m.add_sequence(&toks(0, 18)).unwrap(); // blocks 0..5, 18 tokens
    assert_eq!(
        m.release_outside_window(a, 5).unwrap(),
        0,
        "pending tokens are never released"
    );
    m.batch_view(&[a]).unwrap();
    let before = m.clone();
    assert_eq!(m.release_outside_window(a, 0), Err(BlockError::ZeroWindow));
    assert_eq!(m, before, "a failed release changes nothing");
    // Window 5 over 18 tokens keeps positions 13..18: blocks 3 and 4; 0-2 go.
    assert_eq!(m.release_outside_window(a, 5).unwrap(), 3);
    let t = m.block_table(a).unwrap().to_vec();
    assert_eq!(&t[..3], &[RELEASED; 3]);
    assert!(t[3..].iter().all(|&b| b != RELEASED));
    let s = m.stats();
    assert_eq!((s.used, s.free), (2, 14));
    assert_eq!(s.tokens_stored, 4 + 2);
    assert_eq!(m.release_outside_window(a, 5).unwrap(), 0, "idempotent");
    assert!(matches!(
        m.slot(a, 2),
        Err(BlockError::PositionReleased { pos: 2 })
    ));
    assert!(m.slot(a, 13).is_ok());
    // The view carries the sentinel; fork and free skip it.
    let v = m.batch_view(&[a]).unwrap();
    assert_eq!(&v.kv_indices[..3], &[RELEASED; 3]);
    let b = m.fork(a).unwrap();
    m.append(b, &[7, 7, 7]).unwrap(); // copy-on-write of the partial block
    m.free(a).unwrap();
    m.take_copies();
    m.free(b).unwrap();
    assert_eq!(m.stats().free, 16, "every block back");
}

/// Remote prefix blocks: `prompt_hashes` are the chain digests the local
/// cache uses (per salt), `add_sequence_with_remote` gives the found
/// blocks fresh ids that join the cache once their step commits and skips
/// their tokens, events report what is stored and evicted, a failed import
/// leaves no other sequence on its blocks, and `uncache` drops blocks
/// found wrong later.
#[test]
fn remote_prefix_blocks_join_the_cache_and_skip_their_tokens() {
    use pagedattn::blocks::KvEvent;
    let cfg = BlockManagerConfig::new(8, 4).with_prefix_caching(true);
    let prompt: Vec<u32> = (0..14).collect();
    let mut a = BlockManager::new(cfg).unwrap();
    a.record_events(true);
    let ida = a.add_sequence_salted(&prompt, b"t1").unwrap();
    a.batch_view(&[ida]).unwrap();
    let stored: Vec<[u8; 32]> = a
        .take_events()
        .into_iter()
        .map(|e| match e {
            KvEvent::Stored { hash, .. } => hash,
            other => panic!("{other:?}"),
        })
        .collect();
    let hashes = a.prompt_hashes(&prompt, b"t1");
    assert_eq!(stored, hashes, "the stored digests are the prompt's");
    assert_eq!(hashes.len(), 3);
    assert!(a
        .prompt_hashes(&prompt, b"t2")
        .iter()
        .all(|h| !hashes.contains(h)));

    let mut b = BlockManager::new(cfg).unwrap();
    b.record_events(true);
    // More than the prompt's full blocks are cut to them.
    let (idb, imports) = b.add_sequence_with_remote(&prompt, b"t1", 9).unwrap();
    assert_eq!(imports.len(), 3);
    assert_eq!(imports.iter().map(|i| i.1).collect::<Vec<_>>(), hashes);
    assert_eq!(b.pending_tokens(idb).unwrap(), 2);
    assert_eq!(b.remote_hit_tokens(), 12);
    assert_eq!(b.prefix_hit_tokens(), 0);
    assert_eq!(
        b.block_table(idb).unwrap()[..3],
        imports.iter().map(|i| i.0).collect::<Vec<_>>()[..]
    );
    // Not cached before the step that imports them commits: a second
    // sequence admitted now computes its own, so a failed import leaves
    // nobody on an unwritten block.
    assert_eq!(b.take_events().len(), 0);
    let id2 = b.add_sequence_salted(&prompt, b"t1").unwrap();
    assert_eq!(b.pending_tokens(id2).unwrap(), 14);
    assert_eq!(b.prefix_hit_tokens(), 0);
    let t2 = b.block_table(id2).unwrap().to_vec();
    assert!(imports.iter().all(|i| !t2.contains(&i.0)));
    // A failed import: its sequence freed (the scheduler's recovery,
    // `abandon`), nothing to uncache; the prompt is then computed.
    let blocks: Vec<u32> = imports.iter().map(|i| i.0).collect();
    assert_eq!(b.uncache(&blocks), 0);
    b.free(idb).unwrap();
    b.free(id2).unwrap();
    let id3 = b.add_sequence_salted(&prompt, b"t1").unwrap();
    assert_eq!(
        b.pending_tokens(id3).unwrap(),
        14,
        "nothing of the failed import is found"
    );
    b.free(id3).unwrap();
    // A successful import: once its step commits, the blocks are cached
    // and a later sequence shares them.
    let (ide, imports) = b.add_sequence_with_remote(&prompt, b"t1", 3).unwrap();
    b.take_events();
    b.batch_view(&[ide]).unwrap();
    let stored = b.take_events();
    assert_eq!(
        stored
            .iter()
            .filter(|e| matches!(e, KvEvent::Stored { .. }))
            .count(),
        3,
        "{stored:?}"
    );
    let id4 = b.add_sequence_salted(&prompt, b"t1").unwrap();
    assert_eq!(
        b.block_table(id4).unwrap()[..3],
        imports.iter().map(|i| i.0).collect::<Vec<_>>()[..]
    );
    assert_eq!(b.prefix_hit_tokens(), 12);
    // Uncaching still drops them (an import found wrong later).
    let blocks: Vec<u32> = imports.iter().map(|i| i.0).collect();
    assert_eq!(b.uncache(&blocks), 3);
    assert_eq!(b.uncache(&blocks), 0);

    // Without prefix caching, remote blocks are refused and nothing changes.
    let mut c = BlockManager::new(BlockManagerConfig::new(8, 4)).unwrap();
    let before = c.clone();
    assert_eq!(
        c.add_sequence_with_remote(&prompt, b"", 1),
        Err(pagedattn::blocks::BlockError::PrefixCachingOff)
    );
    assert_eq!(c, before);
    // Out of blocks with the remote ones counted: refused, unchanged.
    let mut d = BlockManager::new(BlockManagerConfig::new(3, 4).with_prefix_caching(true)).unwrap();
    let before = d.clone();
    assert!(d.add_sequence_with_remote(&prompt, b"t1", 3).is_err());
    assert_eq!(d, before);
}

/// Pins keep a block a transfer reads from being reused after its
/// sequence ends; unpins must match them; a freed sequence is an event.
#[test]
fn pinned_blocks_outlive_their_sequence() {
    use pagedattn::blocks::{BlockError, KvEvent};
    let mut m = BlockManager::new(BlockManagerConfig::new(4, 4)).unwrap();
    m.record_events(true);
    let a = m.add_sequence(&[1, 2, 3, 4, 5]).unwrap();
    m.batch_view(&[a]).unwrap();
    let table = m.block_table(a).unwrap().to_vec();
    let free = m.available_blocks();
    assert_eq!(
        m.pin_blocks(&[table[0], 3]),
        Err(BlockError::NotPinnable { block: 3 })
    );
    assert_eq!(
        m.pin_blocks(&[99]),
        Err(BlockError::NotPinnable { block: 99 })
    );
    assert_eq!(m.available_blocks(), free, "a refused pin changes nothing");
    m.pin_blocks(&[table[0]]).unwrap();
    m.free(a).unwrap();
    assert_eq!(m.take_events(), vec![KvEvent::SequenceEnded { seq: a }]);
    assert_eq!(m.ref_count(table[0]), Some(1), "the pin holds it");
    assert_eq!(m.available_blocks(), 3);
    // A new sequence cannot take the pinned block.
    let b = m.add_sequence(&[9; 12]).unwrap();
    assert!(!m.block_table(b).unwrap().contains(&table[0]));
    assert_eq!(
        m.unpin_blocks(&[table[0], table[0]]),
        Err(BlockError::NotPinned { block: table[0] })
    );
    m.unpin_blocks(&[table[0]]).unwrap();
    assert_eq!(m.ref_count(table[0]), Some(0));
    assert_eq!(
        m.unpin_blocks(&[table[0]]),
        Err(BlockError::NotPinned { block: table[0] })
    );
    m.free(b).unwrap();
    assert_eq!(m.stats().free, 4);
}
