//! The contiguous baselines' scheduler. The paged policy runs through the
//! library's own `blocks::Scheduler` (`scheduled`); this loop models the
//! reservation systems it is compared with (per-sequence contiguous slabs,
//! which a block scheduler cannot express), with the same FCFS admission,
//! newest-first preemption by recompute, and the same seeded decode.
//!
//! Each step: arrivals join the queue; every running request decodes one
//! token per sequence, oldest first (beam requests first fork and prune
//! their beams); if the pool cannot take a step, the most recently admitted
//! request is preempted (freed, requeued at the front, later recomputed);
//! then, unless something was preempted this step, waiting requests are
//! admitted first come first served while memory and the sequence limit
//! allow, their prompt written in the same step; the step's tokens go to
//! the "GPU"; memory is sampled; finished sequences are freed.
//!
//! A request's decoding choices (beam survivors, token ids) come from its own
//! seeded stream and are drawn once per logical step, so every policy
//! replays the same decode, however it schedules it.

use std::collections::VecDeque;

use super::live::Live;
use super::memory::{Counters, EndState, Memory};
use super::workload::{Request, Sampling};
use super::SimError;
use pagedattn::rng::SplitMix64;

pub(super) const VOCAB: u64 = 32_000;

/// One end-of-step sample of the run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    /// Step number.
    pub step: u64,
    /// Slots held.
    pub held: u32,
    /// Distinct slots holding a token.
    pub stored: u32,
    /// Sum of sequence lengths.
    pub logical: u32,
    /// Held slots that live sequences will still fill.
    pub reserved: u32,
    /// Running sequences.
    pub seqs: u32,
    /// Running requests.
    pub requests: u32,
    /// Requests waiting (arrived, not running).
    pub queue: u32,
}

/// Raw outcome of one policy's run, before it is summarised.
#[derive(Clone, Debug, Default)]
pub(super) struct RunLog {
    pub steps: u64,
    pub samples: Vec<Sample>,
    pub generated: u64,
    pub preemptions: u64,
    pub recomputed: u64,
    pub waits: Vec<u64>,
    pub finished: usize,
    pub counters: Counters,
    pub end: EndState,
}

struct Engine<'a> {
    reqs: &'a [Request],
    sampling: Sampling,
    max_seqs: usize,
    mem: &'a mut dyn Memory,
    running: Vec<Live>,
    waiting: VecDeque<Live>,
    log: RunLog,
}

/// Runs the whole workload under one policy.
pub(super) fn run(
    reqs: &[Request],
    sampling: Sampling,
    seed: u64,
    max_seqs: usize,
    mem: &mut dyn Memory,
) -> Result<RunLog, SimError> {
    let mut e = Engine {
        reqs,
        sampling,
        max_seqs,
        mem,
        running: Vec::new(),
        waiting: VecDeque::new(),
        log: RunLog::default(),
    };
    let mut next = 0;
    let mut now = 0u64;
    while e.log.finished < reqs.len() {
        if e.running.is_empty() && e.waiting.is_empty() {
            // Idle: jump to the next arrival instead of stepping through the gap.
            now = now.max(reqs[next].arrival);
        }
        while next < reqs.len() && reqs[next].arrival <= now {
            e.waiting.push_back(Live::new(&reqs[next], sampling, seed));
            next += 1;
        }
        let preempted = e.decode()?;
        if !preempted {
            e.admit(now)?;
        }
        e.mem.end_step(&e.running)?;
        e.record(now)?;
        e.retire()?;
        now += 1;
    }
    e.log.steps = now;
    e.log.counters = e.mem.counters();
    e.log.end = e.mem.finish();
    Ok(e.log)
}

/// Beam search: each of `beams` beams proposes at least two candidates (and
/// enough that there are at least `2k` in all); `k` survive, drawn
/// uniformly. Returns how many survivors each beam has (0 = pruned, 2+ =
/// it forks).
pub(super) fn select_beams(rng: &mut SplitMix64, beams: usize, k: usize) -> Vec<usize> {
    let per = (2 * k).div_ceil(beams).max(2);
    let total = beams * per;
    let keep = k.min(total);
    let mut cand: Vec<usize> = (0..total).collect();
    let mut counts = vec![0; beams];
    for j in 0..keep {
        let r = j + rng.below((total - j) as u64) as usize;
        cand.swap(j, r);
        counts[cand[j] / per] += 1;
    }
    counts
}

impl Engine<'_> {
    fn width(&self, l: &Live) -> usize {
        match self.sampling {
            Sampling::Beam(k) => k,
            Sampling::Parallel(_) => l.seqs.len(),
        }
    }

    fn too_small(&self, l: &Live) -> SimError {
        SimError::TooSmall {
            request: l.req,
            tokens: self.reqs[l.req].prompt.len()
                + l.seqs.iter().map(|s| s.target).max().unwrap_or(0),
        }
    }

    /// Draws the request's next step (beam survivors, then one token per
    /// sequence) and applies the forks and prunes, unless a preemption left
    /// one drawn already.
    fn plan(&mut self, i: usize) -> Result<(), SimError> {
        let live = &mut self.running[i];
        if live.pending.is_some() {
            return Ok(());
        }
        let req = &self.reqs[live.req];
        if let Sampling::Beam(k) = self.sampling {
            let counts = select_beams(&mut live.rng, live.seqs.len(), k);
            let old = std::mem::take(&mut live.seqs);
            let mut kept = Vec::with_capacity(old.len());
            // Prune first: freed memory (and contiguous slabs) serve the forks.
            for (s, c) in old.into_iter().zip(counts) {
                if c == 0 {
                    self.mem.free_seq(req, live, s, true)?;
                } else {
                    kept.push((s, c));
                }
            }
            for (s, c) in kept {
                live.seqs.push(s);
                let parent = live.seqs.len() - 1;
                for _ in 1..c {
                    let child = self.mem.fork(req, live, parent)?;
                    live.seqs.push(child);
                }
            }
        }
        let tokens = (0..live.seqs.len())
            .map(|_| live.rng.below(VOCAB) as u32)
            .collect();
        live.pending = Some(tokens);
        Ok(())
    }

    /// Decodes one token for every running sequence. Returns whether a
    /// request was preempted.
    fn decode(&mut self) -> Result<bool, SimError> {
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() {
            self.plan(i)?;
            let mut evicted_self = false;
            while !self
                .mem
                .fits_step(&self.reqs[self.running[i].req], &self.running[i])?
            {
                if self.running.len() == 1 {
                    return Err(self.too_small(&self.running[0]));
                }
                // Newest first: it has the least sunk work, and FCFS order
                // guarantees the oldest request always makes progress.
                let mut victim = self.running.pop().expect("non-empty");
                evicted_self = self.running.len() == i;
                self.mem.release(&self.reqs[victim.req], &mut victim)?;
                self.log.preemptions += 1;
                self.waiting.push_front(victim);
                preempted = true;
                if evicted_self {
                    break;
                }
            }
            if evicted_self {
                break;
            }
            let live = &mut self.running[i];
            let req = &self.reqs[live.req];
            let tokens = live.pending.take().expect("planned");
            for (j, tok) in tokens.into_iter().enumerate() {
                self.mem.append(req, live, j, tok)?;
                live.seqs[j].tail.push(tok);
                self.log.generated += 1;
            }
            i += 1;
        }
        Ok(preempted)
    }

    /// FCFS admission: stops at the first waiting request that does not fit.
    fn admit(&mut self, now: u64) -> Result<(), SimError> {
        let mut width: usize = self.running.iter().map(|l| self.width(l)).sum();
        while let Some(front) = self.waiting.front_mut() {
            let w = match self.sampling {
                Sampling::Beam(k) => k,
                Sampling::Parallel(_) => front.seqs.len(),
            };
            if width + w > self.max_seqs {
                break;
            }
            let req = &self.reqs[front.req];
            let busy = !self.running.is_empty();
            if !self.mem.admit(req, front, busy)? {
                if self.running.is_empty() {
                    return Err(self.too_small(self.waiting.front().expect("front")));
                }
                break;
            }
            let mut live = self.waiting.pop_front().expect("front");
            if live.admitted {
                self.log.recomputed += (req.prompt.len()
                    + live.seqs.iter().map(|s| s.tail.len()).sum::<usize>())
                    as u64;
            } else {
                self.log.waits.push(now - req.arrival);
                live.admitted = true;
            }
            width += w;
            self.running.push(live);
        }
        Ok(())
    }

    fn record(&mut self, now: u64) -> Result<(), SimError> {
        let m = self.mem.snapshot(self.reqs, &self.running)?;
        let c = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        self.log.samples.push(Sample {
            step: now,
            held: c(m.held),
            stored: c(m.stored),
            logical: c(m.logical),
            reserved: c(m.reserved),
            seqs: c(self.running.iter().map(|l| l.seqs.len()).sum()),
            requests: c(self.running.len()),
            queue: c(self.waiting.len()),
        });
        Ok(())
    }

    /// Frees sequences that reached their length; a request with none left
    /// is done.
    fn retire(&mut self) -> Result<(), SimError> {
        let mut i = 0;
        while i < self.running.len() {
            let live = &mut self.running[i];
            let req = &self.reqs[live.req];
            let old = std::mem::take(&mut live.seqs);
            for s in old {
                if s.tail.len() >= s.target {
                    self.mem.free_seq(req, live, s, false)?;
                } else {
                    live.seqs.push(s);
                }
            }
            if live.seqs.is_empty() {
                self.mem.release(req, live)?;
                self.running.remove(i);
                self.log.finished += 1;
            } else {
                i += 1;
            }
        }
        Ok(())
    }
}
