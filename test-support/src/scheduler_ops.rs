//! The scheduler's whole API driven by a byte string, with forged, foreign
//! and stale inputs mixed in, checked after every call.
//!
//! Shared by the fuzz target (`fuzz/fuzz_targets/scheduler_ops.rs`, which
//! includes this file by path) and `tests/fuzz_corpus_scheduler.rs` (which
//! replays the committed corpus and a seeded soak on stable Rust). Not
//! declared in `common/mod.rs`: only those two use it.
//!
//! An input is six configuration bytes (pool blocks, block size, prefix
//! caching and swap space, preemption policy, token budget, sequences per
//! step) and then operations, one tag byte each with its arguments
//! (missing bytes read as zero, so every byte string is a valid input):
//! add a request (random prompt from a small alphabet, some sharing a stem,
//! some empty or too wide), abort one (live, ended, or another
//! scheduler's), run a step (schedule, then commit what a sampler would,
//! after trying the bad commits the tag's bits ask for: outputs missing a
//! group or naming one that did not sample, a parent out of range, more
//! live children than the width, a group named twice, another scheduler's
//! step, a step committed twice), or touch a second scheduler (a request,
//! a step left in flight) so that its handles and steps exist to be
//! misused.
//!
//! Checked: nothing panics; every refused call leaves the scheduler equal
//! to a copy taken before it; every step's tables read back each row's own
//! tokens from a simulated pool (swap and copy-on-write replayed); a
//! request ends once, finished or aborted, never both; at the end, with
//! arrivals stopped, the work drains within a bound (no livelock), every
//! request added ended, and every block came back.
#![allow(dead_code)]

use std::collections::HashMap;

use pagedattn::blocks::{
    BlockManagerConfig, Child, GroupKind, GroupOutput, Preemption, RequestId, Scheduler,
    SchedulerConfig, Step, RELEASED, SKIP_WRITE,
};

/// Operations per input at most.
pub const MAX_OPS: usize = 600;
/// Steps the final drain may take before it counts as a livelock.
const DRAIN_STEPS: usize = 20_000;

pub use crate::harness;

tally! {
    /// How often each interesting outcome happened.
    pub struct Coverage: u64 {
        steps: "steps",
        finished: "finished",
        aborted_by_policy: "aborted by policy",
        aborted_by_caller: "aborted by caller",
        recomputed: "recomputed",
        swapped: "swapped",
        refused_adds: "refused adds",
        refused_commits: "refused commits",
        refused_aborts: "refused aborts",
        foreign_refused: "foreign refused",
    }
}

/// The input, read a byte at a time.
type Bytes<'a> = harness::Input<'a>;

/// Token of sample `s` of request `key` at position `p`: what a sampler
/// returns, whatever the scheduler does.
fn token(key: u64, s: u64, p: usize) -> u32 {
    let mut x =
        key.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ s.wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ p as u64;
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    (x >> 44) as u32 % 7
}

/// A simulated pool and host swap space: the token id each slot holds.
/// [`SimPool::run_step`] replays a step (swap-out, swap-in, copy-on-write,
/// the new tokens' writes) and checks that every row's table reads its
/// sequence's own tokens. Shared with `tests/scheduler.rs`.
pub struct SimPool {
    pool: Vec<Option<u32>>,
    swap: Vec<Option<u32>>,
    bs: usize,
}

impl SimPool {
    pub fn new(num_blocks: u32, swap_blocks: u32, block_size: u32) -> Self {
        let bs = block_size as usize;
        Self {
            pool: vec![None; num_blocks as usize * bs],
            swap: vec![None; swap_blocks as usize * bs],
            bs,
        }
    }

    pub fn run_step(&mut self, sched: &Scheduler, step: &Step) {
        self.run_group(sched, step, 0);
    }

    /// [`run_step`](Self::run_step) for layer group `g` of a scheduler made
    /// with groups, this pool standing for that group's: a window group's
    /// rows must read each position their window sees (the others may be
    /// released).
    pub fn run_group(&mut self, sched: &Scheduler, step: &Step, g: usize) {
        let bs = self.bs;
        let gs = step.group(g).expect("the step plans every group");
        let kind = sched.group_kinds()[g];
        for &[b, h] in gs.swap_out {
            for o in 0..bs {
                self.swap[h as usize * bs + o] = self.pool[b as usize * bs + o];
            }
        }
        for &[h, b] in gs.swap_in {
            for o in 0..bs {
                self.pool[b as usize * bs + o] = self.swap[h as usize * bs + o];
            }
        }
        let v = gs.view;
        for &[a, b] in &v.copies {
            for o in 0..bs {
                self.pool[b as usize * bs + o] = self.pool[a as usize * bs + o];
            }
        }
        assert_eq!(step.rows().len(), v.seq_lens.len());
        for (i, row) in step.rows().iter().enumerate() {
            let (lo, hi) = (v.new_indptr[i] as usize, v.new_indptr[i + 1] as usize);
            assert_eq!(hi - lo, row.positions.len());
            for (&slot, &t) in v.slot_mapping[lo..hi].iter().zip(&step.tokens()[lo..hi]) {
                if slot != SKIP_WRITE {
                    self.pool[slot as usize] = Some(t);
                }
            }
            // The attention of this row reads positions 0..end: each must
            // hold the sequence's token there.
            let seq = sched
                .blocks()
                .tokens(row.seq)
                .expect("a row's sequence is live");
            let table = &v.kv_indices[v.kv_indptr[i] as usize..v.kv_indptr[i + 1] as usize];
            assert_eq!(v.seq_lens[i] as usize, row.positions.end);
            // The positions the chunk's queries see.
            let (sinks, window) = match kind {
                GroupKind::Full => (0, usize::MAX),
                GroupKind::Window(w) => (0, w as usize),
                GroupKind::SinksAndWindow { sinks, window } => (sinks as usize, window as usize),
            };
            let first = (row.positions.start + 1).saturating_sub(window);
            for p in (0..sinks.min(first)).chain(first..row.positions.end) {
                let b = table[p / bs];
                assert_ne!(b, RELEASED);
                assert_eq!(
                    self.pool[b as usize * bs + p % bs],
                    Some(seq[p]),
                    "row {i} ({}) position {p}",
                    row.request
                );
            }
        }
    }
}

/// A request as the caller knows it.
struct Req {
    key: u64,
    out: usize,
    width: usize,
    /// Its samples (sample number, tokens generated), in group order.
    samples: Vec<(u64, usize)>,
    ended: bool,
}

struct Harness {
    s: Scheduler,
    other: Scheduler,
    other_step: Option<Step>,
    other_req: Option<RequestId>,
    sim: SimPool,
    reqs: HashMap<RequestId, Req>,
    order: Vec<RequestId>,
    next_key: u64,
    cov: Coverage,
}

impl Harness {
    /// The outputs a sampler gives for `step`; updates the callers' samples.
    fn outputs(&mut self, step: &Step) -> Vec<GroupOutput> {
        let mut outs = Vec::new();
        for &r in step.sample() {
            let req = self.reqs.get_mut(&r).expect("a sampled request is known");
            let len_of = |i: usize| {
                step.rows()
                    .iter()
                    .find(|x| x.request == r && x.index == i)
                    .expect("every sequence of a sampled group has a row")
                    .positions
                    .end
            };
            let mut children = Vec::new();
            let mut next = Vec::new();
            if req.samples.is_empty() {
                for s in 0..req.width as u64 {
                    let fin = req.out <= 1 + s as usize;
                    children.push(Child {
                        parent: 0,
                        token: token(req.key, s, len_of(0)),
                        finished: fin,
                    });
                    if !fin {
                        next.push((s, 1));
                    }
                }
            } else {
                for (i, &(s, n)) in req.samples.iter().enumerate() {
                    let fin = n + 1 >= req.out.saturating_sub(s as usize).max(1);
                    children.push(Child {
                        parent: i,
                        token: token(req.key, s, len_of(i)),
                        finished: fin,
                    });
                    if !fin {
                        next.push((s, n + 1));
                    }
                }
            }
            req.samples = next;
            outs.push(GroupOutput {
                request: r,
                children,
            });
        }
        outs
    }

    fn end(&mut self, r: RequestId, finished: bool) {
        let req = self.reqs.get_mut(&r).expect("an ended request is known");
        assert!(!req.ended, "request {r} ended twice");
        req.ended = true;
        if finished {
            self.cov.finished += 1;
        }
    }

    /// Tries the bad commits `bits` asks for, each refused and changing
    /// nothing; then commits `outs`.
    fn commit(&mut self, step: &Step, outs: Vec<GroupOutput>, bits: u8) {
        let mut bad: Vec<Vec<GroupOutput>> = Vec::new();
        if bits & 1 != 0 && !outs.is_empty() {
            bad.push(outs[1..].to_vec());
        }
        if bits & 2 != 0 {
            // A request that did not sample (or another scheduler's).
            let stranger = self
                .order
                .iter()
                .copied()
                .find(|r| !step.sample().contains(r))
                .or(self.other_req);
            if let Some(r) = stranger {
                let mut o = outs.clone();
                o.push(GroupOutput {
                    request: r,
                    children: vec![Child {
                        parent: 0,
                        token: 1,
                        finished: true,
                    }],
                });
                bad.push(o);
            }
        }
        if bits & 4 != 0 && !outs.is_empty() {
            let mut o = outs.clone();
            let n = self.s.sequences(o[0].request).map_or(0, |x| x.len());
            o[0].children.push(Child {
                parent: n,
                token: 1,
                finished: false,
            });
            bad.push(o);
        }
        if bits & 8 != 0 && !outs.is_empty() {
            let mut o = outs.clone();
            let w = self.reqs[&o[0].request].width;
            o[0].children = (0..=w)
                .map(|_| Child {
                    parent: 0,
                    token: 2,
                    finished: false,
                })
                .collect();
            bad.push(o);
        }
        if bits & 16 != 0 && !outs.is_empty() {
            let mut o = outs.clone();
            o.push(o[0].clone());
            bad.push(o);
        }
        for o in &bad {
            let before = self.s.clone();
            assert!(
                self.s.commit(step, o).is_err(),
                "a bad commit was accepted: {o:?}"
            );
            assert!(self.s == before, "a refused commit changed the scheduler");
            self.cov.refused_commits += 1;
        }
        if bits & 32 != 0 {
            if let Some(foreign) = &self.other_step {
                let before = self.s.clone();
                assert!(
                    self.s.commit(foreign, &outs).is_err(),
                    "another scheduler's step was accepted"
                );
                assert!(self.s == before);
                self.cov.foreign_refused += 1;
            }
        }
        let ended = self
            .s
            .commit(step, &outs)
            .expect("the sampler's outputs are valid");
        for f in ended {
            let req = &self.reqs[&f.request];
            assert_eq!(
                f.sequences.len(),
                req.width,
                "request {} lost a sequence",
                f.request
            );
            self.end(f.request, true);
        }
        // The same step again: not in flight any more.
        if bits & 64 != 0 {
            let before = self.s.clone();
            assert!(
                self.s.commit(step, &[]).is_err(),
                "a step was committed twice"
            );
            assert!(self.s == before);
            self.cov.refused_commits += 1;
        }
    }

    fn step(&mut self, bits: u8) {
        let step = self
            .s
            .schedule()
            .expect("schedule never fails on valid traffic");
        self.cov.steps += 1;
        // A second schedule while this one is in flight: refused.
        if bits & 128 != 0 {
            let before = self.s.clone();
            assert!(self.s.schedule().is_err());
            assert!(self.s == before);
        }
        for &(_, p) in step.preempted() {
            match p {
                Preemption::Swap => self.cov.swapped += 1,
                _ => self.cov.recomputed += 1,
            }
        }
        for &r in step.aborted() {
            self.cov.aborted_by_policy += 1;
            self.end(r, false);
        }
        self.sim.run_step(&self.s, &step);
        let outs = self.outputs(&step);
        self.commit(&step, outs, bits);
    }
}

/// Runs one input; returns what it covered.
pub fn run(data: &[u8]) -> Coverage {
    let mut b = Bytes::new(data);
    let nb = 4 + b.byte() as u32 % 48;
    let bs = [1u32, 2, 4, 8, 16][b.byte() as usize % 5];
    let flags = b.byte();
    let prefix = flags & 1 != 0;
    let swap_blocks = (flags >> 1) as u32 % 24;
    let preemption =
        [Preemption::Recompute, Preemption::Swap, Preemption::Auto][b.byte() as usize % 3];
    let max_tokens = 1 + b.byte() as usize % 48;
    let max_seqs = 1 + b.byte() as usize % 8;
    let cfg = BlockManagerConfig::new(nb, bs)
        .with_prefix_caching(prefix)
        .with_swap_space(swap_blocks);
    let mut sc = SchedulerConfig::new(max_tokens, max_seqs);
    sc.preemption = preemption;
    let s = Scheduler::new(cfg, sc).expect("a valid configuration");
    let other = Scheduler::new(cfg, sc).expect("a valid configuration");
    let mut h = Harness {
        s,
        other,
        other_step: None,
        other_req: None,
        sim: SimPool::new(nb, swap_blocks, bs),
        reqs: HashMap::new(),
        order: Vec::new(),
        next_key: 0,
        cov: Coverage::default(),
    };
    let stem: Vec<u32> = (0..24).map(|i| 10 + i % 5).collect();
    let mut ops = 0;
    while !b.done() && ops < MAX_OPS {
        ops += 1;
        let tag = b.byte();
        match tag % 8 {
            0 | 1 => {
                let len = b.byte() as usize % 40;
                let width = [1usize, 1, 2, 3, 4, 9][b.byte() as usize % 6];
                let out = 1 + b.byte() as usize % 12;
                let key = h.next_key;
                let mut prompt: Vec<u32> = if tag & 8 != 0 {
                    stem[..len.min(24)].to_vec()
                } else {
                    Vec::new()
                };
                prompt.extend((prompt.len()..len).map(|p| token(key, 99, p)));
                let salt: &[u8] = if tag & 16 != 0 { b"t1" } else { b"" };
                let before = h.s.clone();
                match h.s.add_request(&prompt, width, salt) {
                    Ok(r) => {
                        h.next_key += 1;
                        h.reqs.insert(
                            r,
                            Req {
                                key,
                                out,
                                width,
                                samples: Vec::new(),
                                ended: false,
                            },
                        );
                        h.order.push(r);
                    }
                    Err(_) => {
                        assert!(h.s == before, "a refused add changed the scheduler");
                        h.cov.refused_adds += 1;
                    }
                }
            }
            2 => {
                let pick = b.byte() as usize;
                let target = if tag & 8 != 0 {
                    h.other_req
                } else if h.order.is_empty() {
                    None
                } else {
                    Some(h.order[pick % h.order.len()])
                };
                if let Some(r) = target {
                    let before = h.s.clone();
                    let live = h.reqs.get(&r).is_some_and(|q| !q.ended);
                    match h.s.abort(r) {
                        Ok(()) => {
                            assert!(live, "abort of {r} accepted, which is not live here");
                            h.cov.aborted_by_caller += 1;
                            h.end(r, false);
                        }
                        Err(_) => {
                            assert!(!live, "abort of live {r} refused with no step in flight");
                            assert!(h.s == before);
                            h.cov.refused_aborts += 1;
                            if tag & 8 != 0 {
                                h.cov.foreign_refused += 1;
                            }
                        }
                    }
                }
            }
            3..=6 => {
                let bits = b.byte();
                h.step(bits);
            }
            _ => {
                // The other scheduler: a request, and a step left in flight.
                if h.other_req.is_none() {
                    h.other_req = h.other.add_request(&[1, 2, 3], 1, b"").ok();
                }
                if h.other_step.is_none() {
                    h.other_step = h.other.schedule().ok();
                }
            }
        }
    }
    // Drain: no more arrivals; the work must end.
    let mut steps = 0;
    while h.s.has_work() {
        h.step(0);
        steps += 1;
        assert!(
            steps < DRAIN_STEPS,
            "livelock: {:?} still queued",
            h.s.queue_lengths()
        );
    }
    for (r, q) in &h.reqs {
        assert!(q.ended, "request {r} never ended");
    }
    let st = h.s.blocks().stats();
    assert_eq!(st.sequences, 0);
    assert_eq!(st.free + st.evictable, st.total, "every block came back");
    assert_eq!(st.swap_used, 0);
    h.cov
}
