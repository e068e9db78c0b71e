//! Every policy, run by the library's own [`Scheduler`] over the crate's
//! real [`BlockManager`](pagedattn::blocks::BlockManager): paging, and the
//! reservations it is compared with ([`Reservation`]: a slab per sequence
//! reserved at admission, in blocks of one token so that a slab is exact).
//! The simulator's numbers are those of the scheduling and bookkeeping an
//! engine embeds, preemption (recompute or swap) included; a reservation
//! never preempts.
//!
//! Each step: arrivals join the scheduler's queue; it decides the step
//! (the previous step's forks and prunes, preemptions, swap-ins,
//! admissions); the "GPU" runs it; the groups whose logits are ready
//! sample: one token per parallel sample, or beam survivors drawn by
//! [`select_beams`](super::engine::select_beams), from the request's own
//! seeded stream (as in `engine`, so every policy replays the same
//! decode); memory is sampled; the scheduler commits.

use std::collections::BTreeMap;

use super::live::Live;
use super::runlog::{select_beams, Counters, EndState, RunLog, Sample, VOCAB};
use super::workload::{Request, Sampling};
use super::SimError;
use pagedattn::blocks::{
    Admission, BlockManagerConfig, Child, GroupOutput, Preemption, RequestId, Reservation,
    Scheduler, SchedulerConfig, SchedulerError, SchedulerStats,
};

fn internal(what: &str, e: SchedulerError) -> SimError {
    SimError::Internal(format!("{what}: {e}"))
}

/// Settings of one paged run.
#[derive(Clone, Copy, Debug)]
pub(super) struct PagedRun {
    pub budget: usize,
    pub block_size: u32,
    pub prefix_caching: bool,
    pub max_len: usize,
    pub max_seqs: usize,
    pub preemption: Preemption,
    /// Host swap space, in blocks.
    pub swap_blocks: u32,
    /// Paging, or a reservation (run with blocks of one token).
    pub reservation: Reservation,
    /// The most tokens a sequence generates (what `Pow2` reserves for).
    pub max_output: usize,
    /// A hybrid model's layer pattern and layer count: a pool per layer
    /// group in the budget's bytes ([`group_pools`]).
    pub groups: Option<(super::HybridPreset, u32)>,
}

/// A hybrid run's pools in the budget's bytes (`budget / block_size`
/// blocks of every layer, that many times the layers in layer-blocks):
/// split in proportion to what a sequence of the workload's mean length
/// keeps in each group (`LayerGroups::blocks_kept`), each window pool
/// with room for the longest sequence besides (a prompt takes its blocks
/// in every group while its prefill runs), paid for by the full pools.
/// Also each group's share of the layers.
pub(super) fn group_pools(
    layout: &pagedattn::blocks::LayerGroups,
    num_blocks: u32,
    block_size: u32,
    mean_len: u64,
    max_len: usize,
) -> (Vec<u32>, Vec<f64>) {
    use pagedattn::blocks::GroupKind;
    let layers = layout.num_layers() as u64;
    let total = num_blocks as u64 * layers;
    let kept = layout.blocks_kept(mean_len.max(1), block_size);
    let groups = layout.groups();
    let per_seq: u64 = kept
        .iter()
        .zip(groups)
        .map(|(&b, g)| b.max(1) * g.layers.len() as u64)
        .sum();
    let floor = (max_len as u64).div_ceil(block_size as u64);
    let mut pools: Vec<u64> = kept.iter().map(|&b| total * b.max(1) / per_seq).collect();
    let full: Vec<usize> = (0..groups.len())
        .filter(|&g| groups[g].kind == GroupKind::Full)
        .collect();
    if !full.is_empty() {
        // Window pools up to their floor, paid for by the full pools.
        let mut windows = 0;
        for (g, p) in pools.iter_mut().enumerate() {
            if groups[g].kind != GroupKind::Full {
                *p = (*p + floor).min(num_blocks as u64);
                windows += *p * groups[g].layers.len() as u64;
            }
        }
        let full_layers: u64 = full.iter().map(|&g| groups[g].layers.len() as u64).sum();
        let left = total.saturating_sub(windows) / full_layers.max(1);
        for &g in &full {
            pools[g] = left;
        }
    }
    let shares = groups
        .iter()
        .map(|g| g.layers.len() as f64 / layers as f64)
        .collect();
    (
        pools
            .iter()
            .map(|&p| p.clamp(1, u32::MAX as u64) as u32)
            .collect(),
        shares,
    )
}

impl PagedRun {
    /// Blocks in the pool: `budget / block_size`.
    pub fn num_blocks(&self) -> Result<u32, SimError> {
        u32::try_from(self.budget / self.block_size as usize)
            .map_err(|_| SimError::Config(format!("budget {} is too large", self.budget)))
    }
}

/// What a paged run adds to the [`RunLog`]: the scheduler's counters.
pub(super) type PagedLog = (RunLog, SchedulerStats);

fn count_copies(copies: &[[u32; 2]], c: &mut Counters) {
    c.cow_copies += copies.len() as u64;
    if copies.len() > 1 {
        let mut srcs: Vec<u32> = copies.iter().map(|c| c[0]).collect();
        let mut dsts: Vec<u32> = copies.iter().map(|c| c[1]).collect();
        srcs.sort_unstable();
        dsts.sort_unstable();
        let dup_dst = dsts.windows(2).any(|w| w[0] == w[1]);
        let overlap = dsts.iter().any(|d| srcs.binary_search(d).is_ok());
        if dup_dst || overlap {
            c.copy_conflicts += 1;
        }
    }
}

/// The memory sample at the end of a step's writes: blocks held, tokens
/// stored and logical, the slots reserved in partly filled tail blocks
/// (at most what a sequence has left to write), and the queues.
fn memory_sample(
    sched: &Scheduler,
    live: &BTreeMap<RequestId, Live>,
    bs: usize,
    now: u64,
    shares: &[f64],
) -> Result<Sample, SimError> {
    let st = sched.blocks().stats();
    if sched.num_groups() > 1 {
        // Layer groups: what each pool holds, weighted by its layers (in
        // tokens of every layer, the budget's unit).
        let (mut held, mut stored) = (0.0, 0.0);
        for (g, &w) in shares.iter().enumerate() {
            let s = sched.group_blocks(g).expect("a group per share").stats();
            held += s.capacity_held as f64 * w;
            stored += s.tokens_stored as f64 * w;
        }
        let (waiting, running, swapped) = sched.queue_lengths();
        let c = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        let seqs = live
            .keys()
            .filter_map(|&r| sched.sequences(r).ok())
            .map(<[_]>::len)
            .sum();
        return Ok(Sample {
            step: now,
            held: c(held.round() as usize),
            stored: c(stored.round() as usize),
            logical: c(st.logical_tokens),
            reserved: 0,
            seqs: c(seqs),
            requests: c(running),
            queue: c(waiting + swapped),
        });
    }
    let mut reserved = 0usize;
    let mut seqs = 0usize;
    for (&rid, l) in live {
        let ids = sched.sequences(rid).map_err(|e| internal("sequences", e))?;
        let left = l
            .seqs
            .iter()
            .map(|s| s.target - s.tail.len())
            .max()
            .unwrap_or(0);
        let mut tails = std::collections::BTreeSet::new();
        for &id in ids {
            let b = sched.blocks();
            if b.is_swapped(id).unwrap_or(true) {
                continue;
            }
            seqs += 1;
            let len = b.seq_len(id).unwrap_or(0);
            let fill = len % bs;
            if fill == 0 {
                continue;
            }
            if let Some(&last) = b.block_table(id).ok().and_then(|t| t.last()) {
                if tails.insert(last) {
                    reserved += (bs - fill).min(left);
                }
            }
        }
    }
    let (waiting, running, swapped) = sched.queue_lengths();
    let c = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    // A reservation holds its slabs, and each sequence writes its own copy
    // of its prompt there (nothing is shared); what it will still fill is
    // each admitted sequence's remaining output.
    let (held, stored, reserved) = if sched.config().reservation == Reservation::Paged {
        (st.capacity_held, st.tokens_stored, reserved)
    } else {
        let held = sched.reserved_blocks() * bs;
        let remaining: usize = live
            .iter()
            .filter(|(&rid, _)| sched.sequences(rid).is_ok_and(|s| !s.is_empty()))
            .flat_map(|(_, l)| l.seqs.iter().map(|s| s.target - s.tail.len()))
            .sum();
        let stored = st.logical_tokens;
        (held, stored, remaining.min(held.saturating_sub(stored)))
    };
    Ok(Sample {
        step: now,
        held: c(held),
        stored: c(stored),
        logical: c(st.logical_tokens),
        reserved: c(reserved),
        seqs: c(seqs),
        requests: c(running),
        queue: c(waiting + swapped),
    })
}

/// One step's tokens for a group: one per parallel sample, or the beam
/// survivors drawn by [`select_beams`], from the request's own stream.
/// `forks`: the first token of a one-sequence group, whose samples all
/// fork from sequence 0. Returns the children; the unfinished ones become
/// the group's sequences.
fn advance(l: &mut Live, forks: bool, sampling: Sampling) -> Vec<Child> {
    let mut children = Vec::new();
    let mut next_seqs = Vec::new();
    match sampling {
        Sampling::Parallel(_) => {
            for (j, s) in l.seqs.iter().enumerate() {
                let token = l.rng.below(VOCAB) as u32;
                let parent = if forks { 0 } else { j };
                let mut s = s.clone();
                s.tail.push(token);
                let finished = s.tail.len() >= s.target;
                children.push(Child {
                    parent,
                    token,
                    finished,
                });
                if !finished {
                    next_seqs.push(s);
                }
            }
        }
        Sampling::Beam(k) => {
            let counts = select_beams(&mut l.rng, l.seqs.len(), k);
            for (b, (s, &n)) in l.seqs.iter().zip(&counts).enumerate() {
                for _ in 0..n {
                    let token = l.rng.below(VOCAB) as u32;
                    let mut s = s.clone();
                    s.tail.push(token);
                    let finished = s.tail.len() >= s.target;
                    children.push(Child {
                        parent: b,
                        token,
                        finished,
                    });
                    if !finished {
                        next_seqs.push(s);
                    }
                }
            }
        }
    }
    l.seqs = next_seqs;
    children
}

/// Runs the whole workload through the library scheduler.
pub(super) fn run(
    reqs: &[Request],
    sampling: Sampling,
    seed: u64,
    r: PagedRun,
) -> Result<PagedLog, SimError> {
    let num_blocks = r.num_blocks()?;
    let mut bcfg = BlockManagerConfig::new(num_blocks, r.block_size)
        .with_prefix_caching(r.prefix_caching)
        .with_swap_space(r.swap_blocks);
    bcfg.max_seq_len = r.max_len;
    let mut scfg = SchedulerConfig::new(usize::MAX, r.max_seqs);
    scfg.preemption = r.preemption;
    scfg.reservation = r.reservation;
    // Paging: admission leaves 1% of the pool free while others run (a
    // reservation needs none: its slab holds the whole sequence).
    if r.reservation == Reservation::Paged {
        scfg.watermark_blocks = (num_blocks as usize / 100).max(1);
    }
    let (mut sched, shares) = match r.groups {
        None => (
            Scheduler::new(bcfg, scfg).map_err(|e| SimError::Config(e.to_string()))?,
            vec![1.0],
        ),
        Some((preset, layers)) => {
            let layout = preset
                .layout(layers)
                .map_err(|e| SimError::Config(format!("--layer-groups {}: {e}", preset.name())))?;
            let n = reqs.len().max(1) as u64;
            let mean = reqs
                .iter()
                .map(|q| (q.prompt.len() + q.outputs.iter().max().copied().unwrap_or(0)) as u64)
                .sum::<u64>()
                / n;
            let (pools, shares) = group_pools(&layout, num_blocks, r.block_size, mean, r.max_len);
            let cfgs: Vec<BlockManagerConfig> = pools
                .iter()
                .map(|&n| BlockManagerConfig {
                    num_blocks: n,
                    ..bcfg
                })
                .collect();
            let s = Scheduler::with_groups(&layout, &cfgs, scfg)
                .map_err(|e| SimError::Config(e.to_string()))?;
            (s, shares)
        }
    };
    let bs = r.block_size as usize;
    let mut log = RunLog::default();
    let mut counters = Counters::default();
    // Per request: its decode state (sequences in the group's order).
    let mut live: BTreeMap<RequestId, Live> = BTreeMap::new();
    let mut next = 0;
    let mut now = 0u64;
    while log.finished < reqs.len() {
        if !sched.has_work() {
            // Idle: jump to the next arrival instead of stepping through the gap.
            now = now.max(reqs[next].arrival);
        }
        while next < reqs.len() && reqs[next].arrival <= now {
            let req = &reqs[next];
            let width = match sampling {
                Sampling::Parallel(_) => req.outputs.len(),
                Sampling::Beam(k) => k,
            };
            let admission = Admission {
                max_tokens: Some(r.max_output),
                expected_tokens: req.outputs.iter().max().copied(),
                ..Admission::default()
            };
            let id = sched
                .add_request_with(&req.prompt, width, b"", admission)
                .map_err(|_| SimError::TooSmall {
                    request: req.id,
                    tokens: req.prompt.len() + req.outputs.iter().max().copied().unwrap_or(0),
                })?;
            live.insert(id, Live::new(req, sampling, seed));
            next += 1;
        }
        let step = sched.schedule().map_err(|e| internal("schedule", e))?;
        if let Some(rid) = step.aborted().first() {
            let req = &reqs[live[rid].req];
            return Err(SimError::TooSmall {
                request: req.id,
                tokens: req.prompt.len() + req.outputs.iter().max().copied().unwrap_or(0),
            });
        }
        let view = step.view();
        count_copies(&view.copies, &mut counters);
        if !view.seq_lens.is_empty() {
            let t = pagedattn::gpu::find_segments(
                num_blocks,
                r.block_size,
                &view.kv_indptr,
                &view.kv_indices,
                &view.seq_lens,
                pagedattn::gpu::CASCADE_CHUNK_TOKENS / r.block_size,
            );
            counters.attn_tokens_plain += t.plain_tokens;
            counters.attn_tokens_cascade += t.cascade_tokens;
        }
        for row in step.rows() {
            let l = live.get_mut(&row.request).expect("tracked");
            if !l.admitted {
                l.admitted = true;
                log.waits.push(now - reqs[l.req].arrival);
            }
        }
        // Memory at the end of the step's writes.
        log.samples
            .push(memory_sample(&sched, &live, bs, now, &shares)?);
        // Sampling: the groups whose every sequence has its logits.
        let mut outputs = Vec::with_capacity(step.sample().len());
        for &rid in step.sample() {
            let l = live.get_mut(&rid).expect("tracked");
            let first = l.seqs.iter().all(|s| s.tail.is_empty());
            let group = sched
                .sequences(rid)
                .map_err(|e| internal("sequences", e))?
                .len();
            let children = advance(l, first && group == 1, sampling);
            log.generated += children.len() as u64;
            outputs.push(GroupOutput {
                request: rid,
                children,
            });
        }
        for f in sched
            .commit(&step, &outputs)
            .map_err(|e| internal("commit", e))?
        {
            live.remove(&f.request);
            log.finished += 1;
        }
        now += 1;
    }
    let stats = sched.stats();
    log.steps = now;
    log.preemptions = stats.recomputed_groups + stats.swapped_groups;
    log.recomputed = stats.tokens_recomputed;
    counters.prefix_hit_tokens = sched.blocks().prefix_hit_tokens();
    log.counters = counters;
    let st = sched.blocks().stats();
    log.end = EndState {
        leaked: st.capacity_held,
        blocks: Some((st.free + st.evictable, st.total)),
    };
    Ok((log, stats))
}
