//! The block manager's chunked steps, swap and handles, and the library
//! `Scheduler` driving random workloads on a simulated pool (each slot
//! holds the token id whose K/V it would hold), under every preemption
//! policy: every step's tables must read exactly each sequence's tokens,
//! and the finished sequences must not depend on the policy.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::scheduler_ops;

use pagedattn::blocks::{
    Admission, BlockError, BlockManager, BlockManagerConfig, Child, GroupOutput, LayerGroups,
    Preemption, RequestId, Reservation, Scheduler, SchedulerConfig, SchedulerError, Step,
};
use pagedattn::rng::SplitMix64;

fn toks(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}

#[test]
fn chunked_prefill_registers_blocks_as_chunks_are_written() {
    let mut m =
        BlockManager::new(BlockManagerConfig::new(32, 4).with_prefix_caching(true)).unwrap();
    let a = m.add_sequence(&toks(0, 10)).unwrap();
    let plan = m.plan_step(&[(a, 4)]).unwrap();
    assert_eq!(plan.chunks(), vec![4]);
    assert_eq!(plan.view().seq_lens, vec![4]);
    assert_eq!(
        plan.view().kv_indptr,
        vec![0, 1],
        "only the blocks the chunk reads"
    );
    assert!(!plan.completes()[0]);
    // Planning changes nothing.
    assert_eq!(m.pending_tokens(a).unwrap(), 10);
    m.commit_step(&plan).unwrap();
    assert_eq!(m.pending_tokens(a).unwrap(), 6);
    // Only the written block is in the cache.
    let b = m.add_sequence(&toks(0, 9)).unwrap();
    assert_eq!(m.prefix_hit_tokens(), 4);
    m.free(b).unwrap();
    let plan = m.plan_step(&[(a, 5)]).unwrap();
    assert_eq!(plan.view().seq_lens, vec![9]);
    assert_eq!(plan.view().slot_mapping.len(), 5);
    m.commit_step(&plan).unwrap();
    let plan = m.plan_step(&[(a, 5)]).unwrap();
    assert_eq!((plan.chunks()[0], plan.completes()[0]), (1, true));
    m.commit_step(&plan).unwrap();
    assert_eq!(m.pending_tokens(a).unwrap(), 0);
}

#[test]
fn a_stale_plan_is_refused_and_changes_nothing() {
    let mut m = BlockManager::new(BlockManagerConfig::new(8, 4)).unwrap();
    let a = m.add_sequence(&toks(0, 3)).unwrap();
    let plan = m.plan_step(&[(a, 8)]).unwrap();
    m.append(a, &[9]).unwrap();
    let before = m.clone();
    assert_eq!(m.commit_step(&plan), Err(BlockError::StalePlan));
    assert_eq!(m, before);
    // A plan of another manager too.
    let other = BlockManager::new(BlockManagerConfig::new(8, 4)).unwrap();
    assert_eq!(
        BlockManager::new(BlockManagerConfig::new(8, 4))
            .unwrap()
            .commit_step(&other.plan_step(&[]).unwrap()),
        Err(BlockError::StalePlan)
    );
}

#[test]
fn swap_keeps_sharing_and_is_atomic() {
    let cfg = BlockManagerConfig::new(16, 4).with_swap_space(6);
    let mut m = BlockManager::new(cfg).unwrap();
    let a = m.add_sequence(&toks(0, 10)).unwrap(); // 3 blocks
    m.batch_view(&[a]).unwrap();
    let b = m.fork(a).unwrap();
    m.append(b, &[50]).unwrap(); // copy-on-write of the partial block
    let other = m.add_sequence(&toks(100, 4)).unwrap();
    // Copies pending: refused until taken.
    assert_eq!(m.swap_out(&[a, b]), Err(BlockError::CopiesPending(1)));
    m.batch_view(&[a, b, other]).unwrap();
    let before = m.clone();
    assert_eq!(m.swap_out(&[a, a]), Err(BlockError::DuplicateInBatch(a)));
    assert_eq!(m, before);
    let free = m.available_blocks();
    let out = m.swap_out(&[a, b]).unwrap();
    // Two shared blocks once, plus each one's last block.
    assert_eq!(out.len(), 4);
    assert_eq!(m.available_blocks(), free + 4);
    assert_eq!(m.swap_free_blocks(), 2);
    assert_eq!(m.is_swapped(a), Ok(true));
    for e in [
        m.append(a, &[1]).unwrap_err(),
        m.fork(b).unwrap_err(),
        m.plan_step(&[(a, 1)]).unwrap_err(),
        m.block_table(b).unwrap_err(),
    ] {
        assert!(matches!(e, BlockError::Swapped(_)), "{e}");
    }
    // Too little swap space for another group: refused, nothing changed.
    let c = m.add_sequence(&toks(200, 12)).unwrap();
    m.batch_view(&[c]).unwrap();
    let before = m.clone();
    assert_eq!(
        m.swap_out(&[c]),
        Err(BlockError::SwapSpaceFull { needed: 3, free: 2 })
    );
    assert_eq!(m, before);
    let back = m.swap_in(&[a, b]).unwrap();
    assert_eq!(back.len(), 4);
    let (ta, tb) = (m.block_table(a).unwrap(), m.block_table(b).unwrap());
    assert_eq!(ta[..2], tb[..2], "shared blocks shared again");
    assert_ne!(ta[2], tb[2]);
    assert_eq!(m.ref_count(ta[0]), Some(2));
    assert_eq!(m.swap_free_blocks(), 6);
    // Host blocks map back one to one: (pool, host) out, (host, pool) in.
    let host_of: HashMap<u32, u32> = out.iter().map(|p| (p[0], p[1])).collect();
    assert_eq!(host_of.len(), 4);
    assert!(back.iter().all(|p| host_of.values().any(|&h| h == p[0])));
    // Freeing a swapped-out sequence returns its host blocks.
    let d = m.swap_out(&[other]).unwrap();
    assert_eq!(d.len(), 1);
    m.free(other).unwrap();
    assert_eq!(m.swap_free_blocks(), 6);
    assert_eq!(m.stats().swapped_sequences, 0);
}

/// Token of sample `s` of request `r` at position `p`: what the caller's
/// sampler returns, the same whatever the scheduler does.
fn token(r: u64, s: u64, p: usize) -> u32 {
    let mut x =
        r.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ s.wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ p as u64;
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    (x >> 40) as u32
}

struct Sim {
    sched: Scheduler,
    pool: scheduler_ops::SimPool,
    /// Per request: its key, output length, and its samples' identities
    /// (sample number, tokens generated), in its group's order.
    reqs: HashMap<RequestId, (u64, usize, usize, Vec<(u64, usize)>)>,
}

/// What a workload did: every finished sequence by (request key,
/// sample), the keys of the requests dropped, and the scheduler's counters.
pub(crate) struct Outcome {
    pub(crate) done: Vec<((u64, u64), Vec<u32>)>,
    pub(crate) aborted: Vec<u64>,
    pub(crate) stats: pagedattn::blocks::SchedulerStats,
}

/// Runs a random workload to the end.
fn workload(seed: u64, preemption: Preemption, swap_blocks: u32, prefix: bool) -> Outcome {
    run_workload(seed, preemption, swap_blocks, prefix, 14, 48)
}

fn run_workload(
    seed: u64,
    preemption: Preemption,
    swap_blocks: u32,
    prefix: bool,
    requests: u64,
    nb: u32,
) -> Outcome {
    run_workload_with(
        seed,
        preemption,
        swap_blocks,
        prefix,
        requests,
        nb,
        Reservation::Paged,
    )
    .0
}

/// [`run_workload`] under a reservation policy; also returns the most
/// requests that ran at once.
fn run_workload_with(
    seed: u64,
    preemption: Preemption,
    swap_blocks: u32,
    prefix: bool,
    requests: u64,
    nb: u32,
    reservation: Reservation,
) -> (Outcome, usize) {
    let (o, peak, _) = run_workload_peaks(
        seed,
        preemption,
        swap_blocks,
        prefix,
        requests,
        nb,
        reservation,
        None,
    );
    (o, peak)
}

/// The most blocks a sequence held in each layer group, over a workload.
pub(crate) type PeakHeld = Vec<usize>;

/// [`run_workload_with`], also over layer groups (`groups`: the layout and
/// each group's pool blocks, `nb` then unused): every group's tables are
/// replayed on its own simulated pool. Also returns, per group, the most
/// blocks a decoding sequence held after a commit.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_workload_peaks(
    seed: u64,
    preemption: Preemption,
    swap_blocks: u32,
    prefix: bool,
    requests: u64,
    nb: u32,
    reservation: Reservation,
    groups: Option<(&LayerGroups, &[u32])>,
) -> (Outcome, usize, PeakHeld) {
    let bs = 4usize;
    let mut cfg = BlockManagerConfig::new(nb, bs as u32)
        .with_prefix_caching(prefix)
        .with_swap_space(swap_blocks);
    if reservation != Reservation::Paged {
        // The longest sequence, what Max reserves: a third of the pool, so
        // that a group of 3 fits (the longest the workload makes is 62).
        cfg.max_seq_len = (nb as usize / 3) * bs;
    }
    let mut sc = SchedulerConfig::new(24, 12);
    sc.preemption = preemption;
    sc.reservation = reservation;
    let mut peak_running = 0;
    let (sched, pools) = match groups {
        None => (
            Scheduler::new(cfg, sc).unwrap(),
            vec![scheduler_ops::SimPool::new(nb, swap_blocks, bs as u32)],
        ),
        Some((layout, blocks)) => {
            let cfgs: Vec<BlockManagerConfig> = blocks
                .iter()
                .map(|&n| BlockManagerConfig {
                    num_blocks: n,
                    ..cfg
                })
                .collect();
            let pools = blocks
                .iter()
                .map(|&n| scheduler_ops::SimPool::new(n, swap_blocks, bs as u32))
                .collect();
            (Scheduler::with_groups(layout, &cfgs, sc).unwrap(), pools)
        }
    };
    let mut sims = pools;
    let mut peaks = vec![0usize; sims.len()];
    let mut sim = Sim {
        sched,
        pool: sims.remove(0),
        reqs: HashMap::new(),
    };
    let mut rng = SplitMix64::new(seed);
    let system: Vec<u32> = (0..8).map(|i| 1000 + i).collect();
    let mut done = Vec::new();
    let mut aborted = Vec::new();
    let mut arrivals = requests;
    let mut steps = 0;
    while arrivals > 0 || sim.sched.has_work() {
        if arrivals > 0 && rng.below(3) == 0 {
            let key = requests - arrivals;
            arrivals -= 1;
            let mut prompt = if rng.below(2) == 0 {
                system.clone()
            } else {
                Vec::new()
            };
            let extra = rng.range(1, 30) as usize;
            prompt.extend((0..extra).map(|i| token(key, 99, i)));
            let width = [1, 1, 2, 3][rng.below(4) as usize];
            let out = rng.range(1, 24) as usize;
            let admission = Admission {
                max_tokens: Some(out),
                ..Admission::default()
            };
            let id = sim
                .sched
                .add_request_with(&prompt, width, b"", admission)
                .unwrap();
            sim.reqs.insert(id, (key, out, width, Vec::new()));
        }
        let step = sim.sched.schedule().unwrap();
        assert!(sim.sched.reserved_blocks() <= nb as usize);
        peak_running = peak_running.max(sim.sched.queue_lengths().1);
        sim.pool.run_step(&sim.sched, &step);
        for (g, pool) in sims.iter_mut().enumerate() {
            pool.run_group(&sim.sched, &step, g + 1);
        }
        for r in step.aborted() {
            aborted.push(sim.reqs.remove(r).unwrap().0);
        }
        let mut outputs = Vec::new();
        for &r in step.sample() {
            let (key, out, width, samples) = sim.reqs.get_mut(&r).unwrap();
            let len_of = |i: usize| {
                step.rows()
                    .iter()
                    .find(|x| x.request == r && x.index == i)
                    .unwrap()
                    .positions
                    .end
            };
            let mut children = Vec::new();
            let mut next = Vec::new();
            if samples.is_empty() {
                for s in 0..*width as u64 {
                    let t = token(*key, s, len_of(0));
                    let fin = *out <= 1 + s as usize;
                    children.push(Child {
                        parent: 0,
                        token: t,
                        finished: fin,
                    });
                    if !fin {
                        next.push((s, 1));
                    }
                }
            } else {
                for (i, &(s, n)) in samples.iter().enumerate() {
                    let t = token(*key, s, len_of(i));
                    let fin = n + 1 >= *out - s as usize;
                    children.push(Child {
                        parent: i,
                        token: t,
                        finished: fin,
                    });
                    if !fin {
                        next.push((s, n + 1));
                    }
                }
            }
            // Finished children leave the group in order; the survivors'
            // order is the group's next order.
            *samples = next;
            outputs.push(GroupOutput {
                request: r,
                children,
            });
        }
        let ended = sim.sched.commit(&step, &outputs).unwrap();
        for (g, peak) in peaks.iter_mut().enumerate() {
            let m = sim.sched.group_blocks(g).unwrap();
            // Decoding sequences (a prompt holds its blocks until written).
            for id in m.sequence_ids() {
                if m.pending_tokens(id).unwrap() > 0 {
                    continue;
                }
                if let Ok(t) = m.block_table(id) {
                    *peak = (*peak).max(
                        t.iter()
                            .filter(|&&b| b != pagedattn::blocks::RELEASED)
                            .count(),
                    );
                }
            }
        }
        for f in ended {
            let (key, ..) = sim.reqs.remove(&f.request).unwrap();
            let mut seqs = f.sequences;
            seqs.sort();
            for (i, s) in seqs.into_iter().enumerate() {
                done.push(((key, i as u64), s));
            }
        }
        steps += 1;
        assert!(steps < 5000, "the workload never finished");
    }
    for g in 0..sim.sched.num_groups() {
        let st = sim.sched.group_blocks(g).unwrap().stats();
        assert_eq!(st.sequences, 0);
        assert_eq!(st.free + st.evictable, st.total, "every block came back");
        assert_eq!(st.swap_used, 0);
    }
    done.sort();
    aborted.sort();
    let outcome = Outcome {
        done,
        aborted,
        stats: sim.sched.stats(),
    };
    (outcome, peak_running, peaks)
}

/// The paper's baselines in the same scheduler: every reservation
/// generates what paging generates, a reservation never preempts (its
/// slab holds the whole sequence) and never holds more than the pool, and
/// the tighter the reservation the more requests run at once.
#[test]
fn reservations_generate_the_same_and_run_fewer_requests_at_once() {
    let mut peaks: HashMap<&str, usize> = HashMap::new();
    for seed in 0..6u64 {
        let run = |r| run_workload_with(seed, Preemption::Recompute, 0, false, 24, 64, r);
        let (paged, paged_peak) = run(Reservation::Paged);
        for r in Reservation::ALL {
            let (got, peak) = run(r);
            assert_eq!(got.done, paged.done, "seed {seed} {r:?}");
            assert!(got.aborted.is_empty() && paged.aborted.is_empty());
            if r != Reservation::Paged {
                assert_eq!(got.stats.recomputed_groups, 0, "seed {seed} {r:?}");
                assert!(
                    peak <= paged_peak,
                    "seed {seed} {r:?}: {peak} > {paged_peak}"
                );
            }
            *peaks.entry(r.name()).or_default() += peak;
        }
    }
    // Max reserves a third of the pool a sequence: at most 3 run at once.
    assert!(peaks["max"] <= 6 * 3, "{peaks:?}");
    assert!(
        peaks["oracle"] > peaks["pow2"] && peaks["pow2"] > peaks["max"],
        "{peaks:?}"
    );
    assert!(peaks["paged"] >= peaks["oracle"], "{peaks:?}");
}

#[test]
fn a_reservation_larger_than_the_pool_is_refused_at_once() {
    let mut sc = SchedulerConfig::new(24, 12);
    sc.reservation = Reservation::Max;
    let mut cfg = BlockManagerConfig::new(16, 4);
    cfg.max_seq_len = 100; // 25 blocks of 4 per sequence
    let mut s = Scheduler::new(cfg, sc).unwrap();
    let e = s.add_request(&[1, 2, 3], 1, b"").unwrap_err().to_string();
    assert!(
        e.contains("max reservation") && e.contains("25 blocks") && e.contains("16"),
        "{e}"
    );
    assert!(!s.has_work(), "nothing queued");
    // Pow2 of 3 + 5 tokens is 8 (2 blocks a sequence); three sequences fit.
    sc.reservation = Reservation::Pow2;
    let mut s = Scheduler::new(cfg, sc).unwrap();
    let admission = Admission {
        max_tokens: Some(5),
        ..Admission::default()
    };
    s.add_request_with(&[1, 2, 3], 3, b"", admission).unwrap();
    let step = s.schedule().unwrap();
    assert_eq!(s.reserved_blocks(), 6);
    assert_eq!(step.rows().len(), 1);
}

/// A remote import that fails: the step that would import it is
/// abandoned; no other sequence ever shared the unwritten blocks (they
/// join the cache only when their step commits), every sequence of the
/// step is dropped, and the prompt served again is computed, never a hit
/// on what the import left.
#[test]
fn a_failed_remote_import_leaves_nobody_on_its_blocks() {
    let cfg = BlockManagerConfig::new(32, 4).with_prefix_caching(true);
    let mut s = Scheduler::new(cfg, SchedulerConfig::new(64, 8)).unwrap();
    let prompt = toks(0, 14);
    let a = s.add_request_with_remote(&prompt, 1, b"t", 3).unwrap();
    let b = s.add_request(&prompt, 1, b"t").unwrap();
    let step = s.schedule().unwrap();
    assert_eq!(step.imports().len(), 1);
    let imported: Vec<u32> = step.imports()[0].1.iter().map(|x| x.0).collect();
    let row_b = step.rows().iter().find(|r| r.request == b).unwrap();
    assert_eq!(
        row_b.positions,
        0..14,
        "b computes its prompt: nothing to share yet"
    );
    let table_b = s.blocks().block_table(row_b.seq).unwrap().to_vec();
    assert!(imported.iter().all(|x| !table_b.contains(x)));
    // The import failed: the step is abandoned.
    let mut dropped = s.abandon(&step).unwrap();
    dropped.sort();
    assert_eq!(dropped, vec![a, b]);
    let st = s.blocks().stats();
    assert_eq!((st.used, st.sequences, st.evictable), (0, 0, 0));
    // Served again, the prompt is computed from its first token.
    let c = s.add_request(&prompt, 1, b"t").unwrap();
    let step = s.schedule().unwrap();
    assert_eq!(step.rows()[0].positions, 0..14);
    let out = GroupOutput {
        request: c,
        children: vec![Child {
            parent: 0,
            token: 1,
            finished: true,
        }],
    };
    s.commit(&step, &[out]).unwrap();
}

#[test]
fn an_abandoned_step_drops_what_it_touched_and_keeps_the_queue() {
    let cfg = BlockManagerConfig::new(16, 4).with_prefix_caching(true);
    let mut s = Scheduler::new(cfg, SchedulerConfig::new(6, 4)).unwrap();
    let a = s.add_request(&toks(0, 6), 2, b"").unwrap();
    let b = s.add_request(&toks(100, 6), 1, b"").unwrap();
    let step = s.schedule().unwrap();
    // The budget of 6 tokens admitted a; b waits.
    assert_eq!(s.queue_lengths(), (1, 1, 0));
    // Abandoning another step, or out of order, is refused.
    let e = s.abandon(&Step::default()).unwrap_err();
    assert!(matches!(e, SchedulerError::StepOrder(_)), "{e}");
    assert_eq!(s.abandon(&step).unwrap(), vec![a]);
    assert!(s.abandon(&step).is_err(), "only once");
    let st = s.blocks().stats();
    assert_eq!((st.used, st.sequences), (0, 0), "a's blocks came back");
    // Nothing of a was committed, so nothing of it is cached: b and a
    // new a run as if a had never been.
    let a2 = s.add_request(&toks(0, 6), 1, b"").unwrap();
    let step = s.schedule().unwrap();
    assert_eq!(
        step.rows().iter().map(|r| r.request).collect::<Vec<_>>(),
        vec![b]
    );
    assert_eq!(step.rows()[0].positions, 0..6);
    let out = GroupOutput {
        request: b,
        children: vec![Child {
            parent: 0,
            token: 7,
            finished: true,
        }],
    };
    assert_eq!(s.commit(&step, &[out]).unwrap()[0].request, b);
    let step = s.schedule().unwrap();
    assert_eq!(step.rows()[0].request, a2);
    assert_eq!(
        step.rows()[0].positions,
        0..6,
        "no prefix hit on a's unwritten blocks"
    );
}

#[test]
fn the_policy_never_changes_what_is_generated() {
    let (mut recomputed, mut swapped, mut fallbacks) = (0, 0, 0);
    for seed in 0..8u64 {
        for prefix in [false, true] {
            let Outcome {
                done: want,
                stats: plain,
                ..
            } = workload(seed, Preemption::Recompute, 0, prefix);
            recomputed += plain.recomputed_groups;
            for (p, swap) in [
                (Preemption::Swap, 64),
                (Preemption::Auto, 64),
                (Preemption::Swap, 3),
            ] {
                let Outcome {
                    done: got,
                    stats: st,
                    ..
                } = workload(seed, p, swap, prefix);
                assert_eq!(got, want, "seed {seed} {p:?} swap {swap} prefix {prefix}");
                assert_eq!(st.blocks_swapped_in, st.blocks_swapped_out, "{st:?}");
                if p == Preemption::Swap {
                    if swap == 64 {
                        swapped += st.swapped_groups;
                        assert_eq!(st.recomputed_groups, 0, "{st:?}");
                    } else {
                        fallbacks += st.swap_fallbacks;
                    }
                }
            }
        }
    }
    // The workloads did fill the pool, under every policy.
    assert!(
        recomputed > 10 && swapped > 10 && fallbacks > 0,
        "{recomputed} {swapped} {fallbacks}"
    );
}

/// The model checker's property: on the same pool, no preemption policy
/// drops a request that another finishes, and all of them generate the
/// same sequences. 100 random workloads on a tight pool, five policies.
#[test]
fn no_policy_drops_a_request_another_finishes() {
    let policies = [
        (Preemption::Recompute, 0),
        (Preemption::Swap, 64),
        (Preemption::Auto, 64),
        (Preemption::Swap, 3),
        (Preemption::Auto, 3),
    ];
    let (mut recomputed, mut aborted) = (0, 0);
    for seed in 0..100u64 {
        let prefix = seed % 2 == 1;
        let nb = 24 + (seed % 4) as u32 * 6;
        let runs: Vec<Outcome> = policies
            .iter()
            .map(|&(p, swap)| run_workload(seed, p, swap, prefix, 16, nb))
            .collect();
        recomputed += runs[0].stats.recomputed_groups;
        aborted += runs[0].aborted.len();
        for (r, &(p, swap)) in runs.iter().zip(&policies).skip(1) {
            assert_eq!(
                r.aborted, runs[0].aborted,
                "seed {seed} pool {nb}: {p:?} (swap {swap}) dropped other requests than Recompute"
            );
            assert_eq!(
                r.done, runs[0].done,
                "seed {seed} pool {nb}: {p:?} (swap {swap})"
            );
        }
    }
    // The pools were tight: groups were recomputed, and some requests
    // (grown past the whole pool) were dropped by every policy alike.
    assert!(recomputed > 50, "{recomputed}");
    eprintln!("100 workloads x 5 policies: {recomputed} recomputed groups, {aborted} requests dropped by all");
}

/// A recomputed group of parallel samples re-prefills its shared prompt
/// once and forks again: the prompt's positions are computed once more in
/// all, not once per sample, and its full blocks are shared again.
#[test]
fn recompute_reprefills_a_group_once_and_forks_it_again() {
    let bs = 4;
    let cfg = BlockManagerConfig::new(24, bs);
    let mut sc = SchedulerConfig::new(64, 8);
    sc.preemption = Preemption::Recompute;
    let mut s = Scheduler::new(cfg, sc).unwrap();
    // A long-lived request first; the group arrives second, so it is the
    // newest and the one preempted when the pool runs short.
    let other = s.add_request(&toks(500, 40), 1, b"").unwrap();
    let prompt = toks(100, 30);
    let r = s.add_request(&prompt, 3, b"").unwrap();
    let mut computed_prompt = 0;
    let mut preempted_at = None;
    let mut step_no = 0;
    let mut finished = Vec::new();
    let mut regrown_steps = 0;
    while s.has_work() {
        step_no += 1;
        let step = s.schedule().unwrap();
        if step.preempted().iter().any(|&(q, _)| q == r) {
            preempted_at = Some(step_no);
        }
        for row in step.rows().iter().filter(|row| row.request == r) {
            computed_prompt += row.positions.clone().filter(|&p| p < prompt.len()).count();
        }
        let outputs: Vec<GroupOutput> = step
            .sample()
            .iter()
            .map(|&q| {
                let n = s.sequences(q).unwrap().len();
                let children = if q == r && n == 1 {
                    (0..3)
                        .map(|i| Child {
                            parent: 0,
                            token: i,
                            finished: false,
                        })
                        .collect()
                } else {
                    (0..n)
                        .map(|i| Child {
                            parent: i,
                            token: 7 + i as u32,
                            finished: step_no > if q == other { 16 } else { 26 },
                        })
                        .collect()
                };
                GroupOutput {
                    request: q,
                    children,
                }
            })
            .collect();
        finished.extend(s.commit(&step, &outputs).unwrap());
        if preempted_at.is_some() && s.sequences(r).map_or(0, |x| x.len()) == 3 {
            // Regrown: the three samples share the prompt's full blocks again.
            let ids = s.sequences(r).unwrap().to_vec();
            let tables: Vec<Vec<u32>> = ids
                .iter()
                .map(|&id| s.blocks().block_table(id).unwrap().to_vec())
                .collect();
            let full = prompt.len() / bs as usize;
            regrown_steps += 1;
            for b in 0..full {
                assert!(
                    tables.iter().all(|t| t[b] == tables[0][b]),
                    "block {b}: {tables:?}"
                );
                assert_eq!(s.blocks().ref_count(tables[0][b]), Some(3));
            }
        }
        assert!(step_no < 200);
    }
    assert!(preempted_at.is_some(), "the group was never preempted");
    assert_eq!(s.stats().aborted, 0);
    assert!(regrown_steps > 3, "{regrown_steps}");
    // Once at admission, once after the recompute: not 1 + 3.
    assert_eq!(computed_prompt, 2 * prompt.len());
    let f = finished.iter().find(|f| f.request == r).unwrap();
    assert_eq!(f.sequences.len(), 3);
    for (i, seq) in f.sequences.iter().enumerate() {
        assert_eq!(&seq[..prompt.len()], &prompt[..]);
        assert_eq!(seq[prompt.len()], i as u32, "the samples kept their order");
    }
}

#[test]
fn bad_outputs_and_out_of_order_calls_are_refused() {
    let mut s =
        Scheduler::new(BlockManagerConfig::new(16, 4), SchedulerConfig::new(64, 4)).unwrap();
    assert!(matches!(
        s.add_request(&[], 1, b""),
        Err(SchedulerError::Blocks(BlockError::EmptyPrompt))
    ));
    assert!(matches!(
        s.add_request(&[1], 5, b""),
        Err(SchedulerError::Invalid(_))
    ));
    assert!(matches!(
        s.add_request(&[1; 70], 1, b""),
        Err(SchedulerError::Invalid(_))
    ));
    let r = s.add_request(&[1, 2, 3, 4, 5], 2, b"").unwrap();
    let step = s.schedule().unwrap();
    assert_eq!(step.sample(), vec![r]);
    assert!(matches!(s.schedule(), Err(SchedulerError::StepOrder(_))));
    for bad in [
        vec![],
        vec![GroupOutput {
            request: r,
            children: vec![Child {
                parent: 1,
                token: 0,
                finished: false,
            }],
        }],
        vec![GroupOutput {
            request: r,
            children: vec![
                Child {
                    parent: 0,
                    token: 0,
                    finished: false
                };
                3
            ],
        }],
    ] {
        assert!(
            matches!(s.commit(&step, &bad), Err(SchedulerError::BadOutput(_))),
            "{bad:?}"
        );
    }
    let ok = [GroupOutput {
        request: r,
        children: vec![
            Child {
                parent: 0,
                token: 7,
                finished: false
            };
            2
        ],
    }];
    assert!(s.commit(&step, &ok).unwrap().is_empty());
    assert!(matches!(
        s.commit(&step, &ok),
        Err(SchedulerError::StepOrder(_))
    ));
    let step = s.schedule().unwrap();
    assert_eq!(step.rows().len(), 2, "two samples decode");
    assert_eq!(step.tokens(), vec![7, 7]);
    s.commit(
        &step,
        &[GroupOutput {
            request: r,
            children: vec![],
        }],
    )
    .unwrap();
    assert!(!s.has_work());
    assert_eq!(s.blocks().stats().free, 16);
}

#[test]
fn a_request_that_outgrows_the_whole_pool_is_dropped_not_preempted_forever() {
    for preemption in [Preemption::Recompute, Preemption::Swap] {
        let mut cfg = SchedulerConfig::new(64, 4);
        cfg.preemption = preemption;
        let blocks = BlockManagerConfig::new(8, 4).with_swap_space(8);
        let mut s = Scheduler::new(blocks, cfg).unwrap();
        let r = s.add_request(&toks(0, 20), 1, b"").unwrap();
        let mut steps = 0;
        let aborted = loop {
            let step = s.schedule().unwrap();
            if !step.aborted().is_empty() {
                break step.aborted().to_vec();
            }
            let out: Vec<GroupOutput> = step
                .sample()
                .iter()
                .map(|&request| GroupOutput {
                    request,
                    children: vec![Child {
                        parent: 0,
                        token: 3,
                        finished: false,
                    }],
                })
                .collect();
            s.commit(&step, &out).unwrap();
            steps += 1;
            assert!(steps < 100, "{preemption:?}: never dropped");
        };
        assert_eq!(aborted, vec![r]);
        // 32 slots: the prompt and 12 tokens fit, the 13th does not.
        assert_eq!(steps, 13, "{preemption:?}");
        assert_eq!(s.stats().aborted, 1);
        assert_eq!(s.stats().swapped_groups + s.stats().recomputed_groups, 0);
        assert!(!s.has_work());
        assert_eq!(s.blocks().stats().free, 8);
    }
}

/// The watermark keeps room for running groups to grow: with nothing
/// running it does not keep a request that fits the pool waiting forever.
#[test]
fn the_watermark_never_starves_an_idle_pool() {
    let mut cfg = SchedulerConfig::new(64, 4);
    cfg.watermark_blocks = 1;
    let mut s = Scheduler::new(BlockManagerConfig::new(5, 16), cfg).unwrap();
    // One prompt block and four samples' growth: the whole pool.
    let r = s.add_request(&[1, 2, 3], 4, b"").unwrap();
    let step = s.schedule().unwrap();
    assert_eq!(step.sample(), vec![r], "admitted into an idle pool");
    let children = (0..4)
        .map(|_| Child {
            parent: 0,
            token: 9,
            finished: false,
        })
        .collect();
    s.commit(
        &step,
        &[GroupOutput {
            request: r,
            children,
        }],
    )
    .unwrap();
    let step = s.schedule().unwrap();
    assert_eq!(step.rows().len(), 4);
    assert!(step.aborted().is_empty() && step.preempted().is_empty());
    s.commit(
        &step,
        &[GroupOutput {
            request: r,
            children: vec![],
        }],
    )
    .unwrap();
    assert!(!s.has_work());
}

/// Handles and steps carry their scheduler: another scheduler's request
/// id or step is refused, changing nothing (the probe aborted s1's own r0
/// with s0's id, and both schedulers number steps from 1).
#[test]
fn handles_and_steps_never_cross_schedulers() {
    let new =
        || Scheduler::new(BlockManagerConfig::new(16, 4), SchedulerConfig::new(16, 4)).unwrap();
    let (mut s0, mut s1) = (new(), new());
    let r0 = s0.add_request(&[1, 2, 3], 1, b"").unwrap();
    let r1 = s1.add_request(&[4, 5, 6], 1, b"").unwrap();
    assert_eq!(r0.number(), r1.number());
    assert_ne!(r0, r1);
    assert!(matches!(
        s1.abort(r0),
        Err(SchedulerError::UnknownRequest(_))
    ));
    assert!(s1.sequences(r0).is_err());
    assert_eq!(s1.queue_lengths(), (1, 0, 0), "s1's own r0 is still queued");
    let st0 = s0.schedule().unwrap();
    let st1 = s1.schedule().unwrap();
    assert_eq!(st0.number(), st1.number());
    let out = |r: RequestId| {
        vec![GroupOutput {
            request: r,
            children: vec![Child {
                parent: 0,
                token: 9,
                finished: true,
            }],
        }]
    };
    // s0's step on s1, with outputs for s1's request or for s0's: refused.
    assert!(matches!(
        s1.commit(&st0, &out(r1)),
        Err(SchedulerError::StepOrder(_))
    ));
    assert!(s1.commit(&st0, &out(r0)).is_err());
    let before = s1.blocks().stats();
    // The right step still commits on each.
    assert_eq!(s1.blocks().stats(), before);
    assert_eq!(s1.commit(&st1, &out(r1)).unwrap().len(), 1);
    assert_eq!(s0.commit(&st0, &out(r0)).unwrap().len(), 1);
    // A step commits once.
    assert!(s0.commit(&st0, &out(r0)).is_err());
}

fn scheduler_corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/scheduler_ops")
}

/// Replays the scheduler fuzz target's committed corpus
/// (`fuzz/corpus/scheduler_ops/`, minimised by libFuzzer) through the same
/// harness (test-support/src/scheduler_ops.rs): forged, foreign and stale
/// commits and aborts refused with the scheduler unchanged, every table
/// read checked on a simulated pool, no livelock, every request ended.
/// Together the inputs must reach every outcome the harness counts.
/// `SCHEDULER_OPS_INPUT=<file>` replays one file.
#[test]
fn scheduler_fuzz_corpus_passes_and_covers_every_outcome() {
    let mut total = scheduler_ops::Coverage::default();
    let files: Vec<PathBuf> = match std::env::var_os("SCHEDULER_OPS_INPUT") {
        Some(one) => vec![one.into()],
        None => std::fs::read_dir(scheduler_corpus())
            .expect("the committed corpus")
            .map(|e| e.unwrap().path())
            .collect(),
    };
    for path in &files {
        let data = std::fs::read(path).unwrap();
        match std::panic::catch_unwind(|| scheduler_ops::run(&data)) {
            Ok(c) => total.add(&c),
            Err(p) => {
                eprintln!("corpus input {} failed", path.display());
                std::panic::resume_unwind(p);
            }
        }
    }
    eprintln!("{} inputs: {total:?}", files.len());
    if std::env::var_os("SCHEDULER_OPS_INPUT").is_none() {
        assert!(files.len() >= 20, "{} inputs", files.len());
        let c = total;
        for (what, n) in [
            ("steps", c.steps),
            ("finished", c.finished),
            ("aborted by policy", c.aborted_by_policy),
            ("aborted by caller", c.aborted_by_caller),
            ("recomputed", c.recomputed),
            ("swapped", c.swapped),
            ("refused adds", c.refused_adds),
            ("refused commits", c.refused_commits),
            ("refused aborts", c.refused_aborts),
            ("foreign refused", c.foreign_refused),
        ] {
            assert!(n > 0, "the corpus never reaches: {what}");
        }
    }
}

/// A soak of random scheduler traffic through the fuzz harness: 3000
/// random inputs from a fixed seed (`PAGEDATTN_SEED` overrides).
#[test]
fn scheduler_soak_of_random_traffic() {
    let seed = std::env::var("PAGEDATTN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5ced_u64);
    let mut rng = SplitMix64::new(seed);
    let mut total = scheduler_ops::Coverage::default();
    for i in 0..3000 {
        let len = rng.range(8, 400) as usize;
        let data: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
        match std::panic::catch_unwind(|| scheduler_ops::run(&data)) {
            Ok(c) => total.add(&c),
            Err(p) => {
                eprintln!("soak input {i} (seed {seed}) failed: {data:?}");
                std::panic::resume_unwind(p);
            }
        }
    }
    eprintln!("soak: {total:?}");
    assert!(total.steps > 10_000 && total.finished > 1000, "{total:?}");
}
