//! What one policy's run records (a memory sample per step, counters, the
//! end state), and the seeded beam choice every policy replays. Every
//! policy, paging and the reservations alike, runs through the library's
//! `Scheduler` (`scheduled`).

use pagedattn::rng::SplitMix64;

/// Token ids are drawn below this bound (a LLaMA-sized vocabulary).
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

/// Counters kept by a policy over a whole run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Counters {
    /// Copy-on-write block copies handed out.
    pub cow_copies: u64,
    /// Batches whose copy list used one block both as a source and a
    /// destination (or as two destinations): a parallel copy kernel would race.
    pub copy_conflicts: u64,
    /// Prompt tokens served from the prefix cache.
    pub prefix_hit_tokens: u64,
    /// Paged only: K/V tokens decode attention reads over the run, plain
    /// paged decode (every sequence's whole context) and cascade decode
    /// (shared full-block prefixes once: `gpu::find_segments`).
    pub attn_tokens_plain: u64,
    pub attn_tokens_cascade: u64,
}

/// What is left once every request has finished.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct EndState {
    /// Slots still held (must be 0).
    pub leaked: usize,
    /// Paged only: (free blocks, total blocks) after dropping cached blocks.
    pub blocks: Option<(usize, usize)>,
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
