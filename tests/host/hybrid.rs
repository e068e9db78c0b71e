//! Layer groups (`blocks::LayerGroups`, `blocks::HybridManager`): a
//! declaration that does not cover the stack exactly once is refused with
//! its reason; a window group keeps only the blocks its window reads, as
//! the arithmetic says, while the full group keeps all; an all-window stack
//! matches `release_outside_window` on one manager; forks share per group;
//! a call that one group cannot take changes no group.

use pagedattn::blocks::{
    BlockError, BlockManager, BlockManagerConfig, GroupError, GroupKind, HybridError,
    HybridManager, LayerGroup, LayerGroups, RELEASED,
};
use pagedattn::rng::SplitMix64;

use crate::common::seed;

fn group(kind: GroupKind, layers: &[u32]) -> LayerGroup {
    LayerGroup {
        kind,
        layers: layers.to_vec(),
    }
}

#[test]
fn a_layout_must_cover_every_layer_once() {
    let w = GroupKind::Window(8);
    let full = GroupKind::Full;
    for (layers, groups, want) in [
        (
            4,
            vec![group(full, &[0, 1]), group(w, &[2])],
            GroupError::Uncovered(3),
        ),
        (
            4,
            vec![group(full, &[0, 1, 2]), group(w, &[2, 3])],
            GroupError::Twice(2),
        ),
        (
            4,
            vec![group(full, &[0, 1, 2, 3, 4])],
            GroupError::LayerOutOfRange {
                group: 0,
                layer: 4,
                layers: 4,
            },
        ),
        (
            2,
            vec![group(full, &[0]), group(GroupKind::Window(0), &[1])],
            GroupError::ZeroWindow(1),
        ),
        (
            2,
            vec![
                group(full, &[0]),
                group(
                    GroupKind::SinksAndWindow {
                        sinks: 4,
                        window: 0,
                    },
                    &[1],
                ),
            ],
            GroupError::ZeroWindow(1),
        ),
        (
            2,
            vec![group(full, &[0, 1]), group(w, &[])],
            GroupError::EmptyGroup(1),
        ),
        (
            0,
            vec![group(full, &[0])],
            GroupError::Empty {
                layers: 0,
                groups: 1,
            },
        ),
    ] {
        assert_eq!(
            LayerGroups::new(layers, groups),
            Err(want.clone()),
            "{want}"
        );
        eprintln!("refused: {want}");
    }
    assert_eq!(
        LayerGroups::interleaved(18, 0, w),
        Err(GroupError::ZeroPeriod(0))
    );
    let l = LayerGroups::interleaved(18, 6, GroupKind::Window(512)).unwrap();
    assert!(matches!(
        HybridManager::new(l, &[8], 16, false),
        Err(HybridError::Groups(GroupError::PoolCount {
            given: 1,
            groups: 2
        }))
    ));
}

/// Gemma 3 270M: 18 layers, one global every 6 (layers 5, 11, 17), a window
/// of 512. At 4,096 tokens the groups keep 3 x 4,096 + 15 x 512 positions,
/// in 16-token blocks 27.4 % of full retention (target: at most 30 %).
#[test]
fn gemma3_keeps_what_the_arithmetic_says() {
    let l = LayerGroups::interleaved(18, 6, GroupKind::Window(512)).unwrap();
    assert_eq!(l.groups()[1].layers, vec![5, 11, 17]);
    assert_eq!(l.group_of(11), Some((1, 1)));
    assert_eq!(l.group_of(12), Some((0, 10)));
    assert_eq!(l.group_of(18), None);
    for (tokens, most) in [(1024u64, 0.61), (2048, 0.39), (4096, 0.30)] {
        let (kept, full) = l.layer_blocks(tokens, 16);
        let share = kept as f64 / full as f64;
        eprintln!(
            "gemma3 at {tokens} tokens: {kept} of {full} layer-blocks ({:.1} %)",
            100.0 * share
        );
        assert!(share <= most, "{tokens}: {share}");
    }
    // Exact at 4,096: 3 x 256 + 15 x 32 blocks.
    assert_eq!(l.layer_blocks(4096, 16), (3 * 256 + 15 * 32, 18 * 256));
    // The manager holds exactly that after a decode past the window.
    let mut m = HybridManager::new(l.clone(), &[64, 300], 16, false).unwrap();
    let mut rng = SplitMix64::new(seed("gemma3 blocks"));
    let prompt: Vec<u32> = (0..700).map(|_| rng.below(262_144) as u32).collect();
    let s = m.add_sequence(&prompt).unwrap();
    m.batch_view(std::slice::from_ref(&s)).unwrap();
    for step in 0..300 {
        m.append(&s, &[step]).unwrap();
        m.batch_view(std::slice::from_ref(&s)).unwrap();
        let len = 701 + step as u64;
        let held: Vec<u64> = m
            .blocks_held(&s)
            .unwrap()
            .iter()
            .map(|&b| b as u64)
            .collect();
        assert_eq!(held, l.blocks_kept(len, 16), "at {len} tokens");
    }
}

/// A stack where every layer has the same window (Mistral-7B v0.1) keeps,
/// in its one group, exactly what `release_outside_window` keeps on a
/// plain manager.
#[test]
fn an_all_window_stack_is_release_outside_window() {
    let mut rng = SplitMix64::new(seed("all window"));
    let (bs, w) = (8u32, 40u32);
    let l = LayerGroups::uniform(32, GroupKind::Window(w)).unwrap();
    let mut h = HybridManager::new(l, &[64], bs, true).unwrap();
    let mut plain =
        BlockManager::new(BlockManagerConfig::new(64, bs).with_prefix_caching(true)).unwrap();
    let prompt: Vec<u32> = (0..37).map(|_| rng.below(100) as u32).collect();
    let s = h.add_sequence(&prompt).unwrap();
    let p = plain.add_sequence(&prompt).unwrap();
    for step in 0..120u32 {
        let hv = h.batch_view(std::slice::from_ref(&s)).unwrap();
        let pv = plain.batch_view(&[p]).unwrap();
        plain.release_outside_window(p, w as usize).unwrap();
        assert_eq!(hv[0], pv, "step {step}");
        assert_eq!(
            h.manager(0)
                .unwrap()
                .block_table(s.in_group(0).unwrap())
                .unwrap(),
            plain.block_table(p).unwrap(),
            "step {step}"
        );
        let t = rng.below(100) as u32;
        h.append(&s, &[t]).unwrap();
        plain.append(p, &[t]).unwrap();
    }
    let table = plain.block_table(p).unwrap();
    assert!(table.iter().filter(|&&b| b == RELEASED).count() > 10);
}

/// Forks share their parent's blocks in every group; appending to them
/// copies the shared partial block in every group (the views say which);
/// freeing everything gives every block back.
#[test]
fn forks_share_and_copy_per_group() {
    let l = LayerGroups::new(
        4,
        vec![
            group(GroupKind::Window(16), &[0, 2]),
            group(GroupKind::Full, &[1, 3]),
        ],
    )
    .unwrap();
    let mut m = HybridManager::new(l, &[32, 32], 8, false).unwrap();
    let prompt: Vec<u32> = (0..21).collect();
    let parent = m.add_sequence(&prompt).unwrap();
    m.batch_view(std::slice::from_ref(&parent)).unwrap();
    let kids: Vec<_> = (0..3).map(|_| m.fork(&parent).unwrap()).collect();
    for g in 0..2 {
        assert!(m.stats()[g].shared > 0, "group {g} shares the prompt");
    }
    m.free(&parent).unwrap();
    let mut copies = [0usize; 2];
    for step in 0..30u32 {
        for k in &kids {
            m.append(k, &[step]).unwrap();
        }
        let views = m.batch_view(&kids).unwrap();
        for (g, v) in views.iter().enumerate() {
            copies[g] += v.copies.len();
        }
        for k in &kids {
            let held = m.blocks_held(k).unwrap();
            // The window of 16 reads at most 3 blocks of 8.
            assert!(held[0] <= 3, "step {step}: {held:?}");
            assert_eq!(held[1], (22 + step as usize).div_ceil(8));
        }
    }
    // The shared partial block is copied for two of the three samples (the
    // last holder keeps it), in each group.
    assert_eq!(copies, [2, 2]);
    for k in &kids {
        m.free(k).unwrap();
    }
    for (g, s) in m.stats().iter().enumerate() {
        assert_eq!(s.used, 0, "group {g}");
        assert_eq!(s.free + s.evictable, s.total, "group {g}");
    }
    assert!(matches!(
        m.append(&kids[0], &[1]),
        Err(HybridError::UnknownSequence)
    ));
}

/// A call that one group's pool cannot take is refused in every group:
/// the other groups' tables and pools are as they were.
#[test]
fn a_call_one_group_cannot_take_changes_no_group() {
    let l = LayerGroups::new(
        2,
        vec![
            group(GroupKind::Full, &[0]),
            group(GroupKind::Window(8), &[1]),
        ],
    )
    .unwrap();
    // The window group's pool is the small one: 3 blocks of 4 tokens.
    let mut m = HybridManager::new(l, &[16, 3], 4, false).unwrap();
    let s = m.add_sequence(&[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    let before = (m.stats(), m.blocks_held(&s).unwrap());
    // 8 more tokens need 2 blocks in each group; the window group has 1.
    let e = m.append(&s, &[9; 8]).unwrap_err();
    assert!(
        matches!(
            e,
            HybridError::Block {
                group: 1,
                source: BlockError::OutOfBlocks { .. }
            }
        ),
        "{e}"
    );
    assert_eq!((m.stats(), m.blocks_held(&s).unwrap()), before);
    let e = m.add_sequence(&[7; 16]).unwrap_err();
    assert!(matches!(e, HybridError::Block { group: 1, .. }), "{e}");
    assert_eq!((m.stats(), m.blocks_held(&s).unwrap()), before);
    // After the view releases what the window no longer reads, the same
    // tokens fit one at a time.
    m.batch_view(std::slice::from_ref(&s)).unwrap();
    for t in 0..40 {
        m.append(&s, &[t]).unwrap();
        m.batch_view(std::slice::from_ref(&s)).unwrap();
    }
    // 48 tokens: all 12 blocks in the full group, the window's 8 in 2.
    assert_eq!(m.blocks_held(&s).unwrap(), vec![12, 2]);
}

/// A fixed budget of layer-blocks serves more sequences of 2,048 tokens
/// when Gemma 3's window groups keep only their windows: what the
/// managers admit, not only the arithmetic.
#[test]
fn a_fixed_budget_serves_more_gemma3_sequences() {
    let l = LayerGroups::interleaved(18, 6, GroupKind::Window(512)).unwrap();
    let (bs, tokens) = (16u32, 2048usize);
    // The budget: 16 sequences under full retention.
    let budget = 16 * 18 * (tokens as u64).div_ceil(bs as u64);
    let served = |layout: &LayerGroups, full: bool| -> usize {
        // Split the budget by each group's steady need per sequence.
        let per_seq = if full {
            vec![(tokens as u64).div_ceil(bs as u64); layout.groups().len()]
        } else {
            layout.blocks_kept(tokens as u64, bs)
        };
        let weight: u64 = per_seq
            .iter()
            .zip(layout.groups())
            .map(|(b, g)| b * g.layers.len() as u64)
            .sum();
        let seqs = budget / weight;
        // A prompt's blocks until its prefill step releases them: one
        // sequence's worth of headroom per window group.
        let blocks: Vec<u32> = per_seq
            .iter()
            .map(|&b| (seqs * b + (tokens as u64).div_ceil(bs as u64)) as u32)
            .collect();
        let mut m = HybridManager::new(layout.clone(), &blocks, bs, false).unwrap();
        let mut n = 0;
        loop {
            let prompt: Vec<u32> = (0..tokens as u32).map(|t| t + n as u32 * 7).collect();
            let Ok(s) = m.add_sequence(&prompt) else {
                break;
            };
            m.batch_view(std::slice::from_ref(&s)).unwrap();
            n += 1;
        }
        n
    };
    let hybrid = served(&l, false);
    let full = served(&LayerGroups::uniform(18, GroupKind::Full).unwrap(), true);
    let ratio = hybrid as f64 / full as f64;
    eprintln!("2,048-token sequences on one budget: hybrid {hybrid}, full {full} ({ratio:.2}x)");
    assert_eq!(full, 17);
    assert!(ratio > 2.5, "{ratio}");
}

/// The hybrid shapes of today's models, run through the managers to 4,096
/// tokens: each group keeps what the arithmetic says at every length, and
/// the share of full retention is printed for 1k, 2k and 4k tokens.
#[test]
fn model_layouts_keep_their_windows() {
    let shapes: [(&str, LayerGroups); 5] = [
        (
            "Gemma 3 270M (5:1, W 512)",
            LayerGroups::interleaved(18, 6, GroupKind::Window(512)).unwrap(),
        ),
        (
            "Gemma 3 4B (5:1, W 1024)",
            LayerGroups::interleaved(34, 6, GroupKind::Window(1024)).unwrap(),
        ),
        (
            "gpt-oss-20b (1:1, W 128)",
            LayerGroups::interleaved(24, 2, GroupKind::Window(128)).unwrap(),
        ),
        (
            "Mistral-7B v0.1 (all W 4096)",
            LayerGroups::uniform(32, GroupKind::Window(4096)).unwrap(),
        ),
        (
            "StreamingLLM (4 sinks, W 1020)",
            LayerGroups::uniform(
                24,
                GroupKind::SinksAndWindow {
                    sinks: 4,
                    window: 1020,
                },
            )
            .unwrap(),
        ),
    ];
    let bs = 16;
    for (name, l) in shapes {
        let blocks: Vec<u32> = l.groups().iter().map(|_| 300).collect();
        let mut m = HybridManager::new(l.clone(), &blocks, bs, false).unwrap();
        let s = m.add_sequence(&(0..64).collect::<Vec<u32>>()).unwrap();
        m.batch_view(std::slice::from_ref(&s)).unwrap();
        let mut shares = Vec::new();
        for len in 65..=4096u64 {
            m.append(&s, &[len as u32]).unwrap();
            m.batch_view(std::slice::from_ref(&s)).unwrap();
            let held: Vec<u64> = m
                .blocks_held(&s)
                .unwrap()
                .iter()
                .map(|&b| b as u64)
                .collect();
            assert_eq!(held, l.blocks_kept(len, bs), "{name} at {len}");
            if [1024, 2048, 4096].contains(&len) {
                let (kept, full) = l.layer_blocks(len, bs);
                shares.push(format!("{len}: {:.1} %", 100.0 * kept as f64 / full as f64));
            }
        }
        eprintln!("{name}: {}", shares.join(", "));
    }
}

/// Three groups (a window of 8, 4 sinks beside a window of 12, full) for
/// a 6-layer stack.
fn three_groups() -> LayerGroups {
    LayerGroups::new(
        6,
        vec![
            group(GroupKind::Window(8), &[0, 3]),
            group(
                GroupKind::SinksAndWindow {
                    sinks: 4,
                    window: 12,
                },
                &[1, 4],
            ),
            group(GroupKind::Full, &[2, 5]),
        ],
    )
    .unwrap()
}

/// The library `Scheduler` over layer groups, on random workloads under
/// every preemption policy: every group's tables are replayed on that
/// group's own simulated pool (a window group's rows must read every
/// position their window sees), the finished sequences are those a
/// one-pool scheduler finishes, every block of every group comes back,
/// and a decoding sequence never holds more in a window group than its
/// window's blocks.
#[test]
fn a_scheduler_over_layer_groups_generates_what_one_pool_does() {
    use crate::scheduler::run_workload_peaks;
    use pagedattn::blocks::{Preemption, Reservation};
    let layout = three_groups();
    let bs = 4;
    // What the groups keep of a decoding sequence, at most, over the
    // lengths the workload makes (under 72 tokens).
    let bound: Vec<u64> = (1..72u64)
        .map(|n| layout.blocks_kept(n, bs))
        .fold(vec![0; 3], |m, k| {
            m.iter().zip(&k).map(|(a, b)| *a.max(b)).collect()
        });
    let base = seed("a_scheduler_over_layer_groups_generates_what_one_pool_does");
    for k in 0..6u64 {
        let s = base.wrapping_add(k);
        for (preemption, swap) in [
            (Preemption::Recompute, 0),
            (Preemption::Swap, 64),
            (Preemption::Auto, 16),
        ] {
            let prefix = k % 2 == 0;
            // Ample pools, then each group's pool the tight one in turn.
            for pools in [[48u32, 48, 48], [28, 48, 48], [48, 30, 48], [48, 48, 28]] {
                let one = run_workload_peaks(
                    s,
                    preemption,
                    swap,
                    prefix,
                    14,
                    pools[2],
                    Reservation::Paged,
                    None,
                )
                .0;
                let (grouped, _, peaks) = run_workload_peaks(
                    s,
                    preemption,
                    swap,
                    prefix,
                    14,
                    0,
                    Reservation::Paged,
                    Some((&layout, &pools)),
                );
                let ctx = format!("seed {s:#x}, {preemption:?}, pools {pools:?}");
                // A request the tightest pool cannot hold alone is dropped
                // by both alike; the rest finish identically.
                assert!(!grouped.done.is_empty(), "{ctx}");
                for d in &grouped.done {
                    assert!(
                        one.done.contains(d) || one.aborted.contains(&d.0 .0),
                        "{ctx}: {d:?}"
                    );
                }
                if pools[2] <= pools[0].min(pools[1]) {
                    assert_eq!(grouped.done, one.done, "{ctx}");
                    assert_eq!(grouped.aborted, one.aborted, "{ctx}");
                }
                for g in 0..2 {
                    assert!(
                        peaks[g] as u64 <= bound[g],
                        "{ctx}: group {g} held {} blocks, its window {}",
                        peaks[g],
                        bound[g]
                    );
                }
                assert!(
                    peaks[0] < peaks[2] && peaks[1] < peaks[2],
                    "{ctx}: {peaks:?}"
                );
            }
        }
    }
}

/// Groups must agree on one prefix hit: a prompt whose blocks the full
/// group still caches but whose window group evicted all but its first
/// two shares only those two in both groups, and computes the rest.
#[test]
fn a_prefix_hit_is_what_every_group_still_holds() {
    use pagedattn::blocks::{Child, GroupOutput, Scheduler, SchedulerConfig};
    let layout = LayerGroups::new(
        2,
        vec![
            group(GroupKind::Window(8), &[0]),
            group(GroupKind::Full, &[1]),
        ],
    )
    .unwrap();
    let cfg = |n| BlockManagerConfig::new(n, 4).with_prefix_caching(true);
    let mut s =
        Scheduler::with_groups(&layout, &[cfg(12), cfg(64)], SchedulerConfig::new(64, 4)).unwrap();
    let run = |s: &mut Scheduler, prompt: &[u32]| -> usize {
        s.add_request(prompt, 1, b"").unwrap();
        let mut first = None;
        while s.has_work() {
            let step = s.schedule().unwrap();
            for g in 0..2 {
                let v = step.group(g).unwrap().view;
                assert_eq!(v.seq_lens, step.view().seq_lens);
            }
            if let Some(r) = step.rows().first() {
                first.get_or_insert(r.positions.start);
            }
            let out: Vec<GroupOutput> = step
                .sample()
                .iter()
                .map(|&request| GroupOutput {
                    request,
                    children: vec![Child {
                        parent: 0,
                        token: 7,
                        finished: true,
                    }],
                })
                .collect();
            s.commit(&step, &out).unwrap();
        }
        first.unwrap()
    };
    let a: Vec<u32> = (0..40).collect();
    let c: Vec<u32> = (100..140).collect();
    assert_eq!(run(&mut s, &a), 0);
    // Both groups cache A whole: its repeat computes only its last token.
    assert_eq!(run(&mut s, &a), 39);
    // C takes 10 of the window group's 12 blocks: A's tail goes first, so
    // that group keeps A's first blocks only; the full group keeps all.
    assert_eq!(run(&mut s, &c), 0);
    let kept = s.group_blocks(0).unwrap().blocks_to_add(&a, b"");
    assert!(kept > 0, "the window group evicted some of A");
    let hit = run(&mut s, &a);
    assert!(
        hit % 4 == 0 && hit < 39,
        "the hit stops at the window group's first evicted block: {hit}"
    );
    assert_eq!(
        hit,
        (10 - kept) * 4,
        "exactly the blocks the window group still held"
    );
    let h0 = s.group_blocks(0).unwrap().prefix_hit_tokens();
    let h1 = s.group_blocks(1).unwrap().prefix_hit_tokens();
    assert_eq!(h0, h1, "one hit for both groups");
}

/// What a scheduler over layer groups refuses, changing nothing: a pool
/// count other than the layout's, pools that disagree on the block size,
/// and a reservation baseline.
#[test]
fn a_scheduler_refuses_pools_that_do_not_fit_the_layout() {
    use pagedattn::blocks::{Reservation, Scheduler, SchedulerConfig, SchedulerError};
    let layout = three_groups();
    let c = BlockManagerConfig::new(16, 4);
    let sc = SchedulerConfig::new(16, 4);
    assert!(matches!(
        Scheduler::with_groups(&layout, &[c, c], sc),
        Err(SchedulerError::Groups(GroupError::PoolCount {
            given: 2,
            groups: 3
        }))
    ));
    let odd = BlockManagerConfig::new(16, 8);
    let e = Scheduler::with_groups(&layout, &[c, odd, c], sc).unwrap_err();
    assert!(e.to_string().contains("block size"), "{e}");
    let mut r = sc;
    r.reservation = Reservation::Max;
    let e = Scheduler::with_groups(&layout, &[c, c, c], r).unwrap_err();
    assert!(e.to_string().contains("reservation"), "{e}");
    let s = Scheduler::with_groups(&layout, &[c, c, c], sc).unwrap();
    assert_eq!(s.num_groups(), 3);
    assert_eq!(s.group_kinds()[0], GroupKind::Window(8));
}
