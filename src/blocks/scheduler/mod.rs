//! Continuous batching over a [`BlockManager`]: the library's one scheduler.
//!
//! Requests are sequence groups (one sequence, parallel samples or beams).
//! Each [`Scheduler::schedule`] call decides one step: it applies the
//! previous step's sampled tokens (forking and pruning sequences), preempts
//! the most recently arrived running groups when the pool cannot hold the
//! step (by recompute or by swapping to host memory, per
//! [`Preemption`]), swaps preempted groups back in when there is room, and
//! fills a token budget with decodes first, then prompt chunks (chunked
//! prefill), admitting waiting requests first come first served. It
//! returns a [`Step`]: the batch (rows, token ids, the block manager's
//! [`StepPlan`] with tables, lengths and slots) and the copy lists to run
//! before it (swap-out, swap-in, copy-on-write, in that order). The caller
//! runs the model and hands the sampled tokens to [`Scheduler::commit`].

use std::collections::VecDeque;
use std::ops::Range;

use super::{BlockError, BlockManager, BlockManagerConfig, SeqId, StepPlan};

mod pools;
mod step;
mod types;
pub use pools::MAX_SCHEDULER_GROUPS;
use pools::{Need, Pools};
pub use types::*;

#[derive(Clone, Debug, PartialEq, Eq)]
struct Group {
    id: RequestId,
    salt: Vec<u8>,
    /// Leading full prompt blocks a remote store holds (first admission).
    remote: usize,
    /// Blocks the group reserves while it holds memory (running or
    /// swapped out; 0 under paging).
    reserve: usize,
    width: usize,
    /// Live sequences (running or swapped).
    seqs: Vec<SeqId>,
    /// Waiting: the token lists to add as sequences at admission. While
    /// the group regrows after a recompute, the sequences it regrows into.
    sources: Vec<Vec<u32>>,
    /// Regrowing after a recompute (empty otherwise), aligned with `seqs`:
    /// the sources each sequence still stands for. A sequence standing for
    /// several is their shared prefix; once written, it forks where they
    /// part, so the group's blocks are shared as they were before.
    targets: Vec<Vec<usize>>,
    /// Children to apply at the next schedule.
    children: Vec<Child>,
    /// Sequences finished so far.
    done: Vec<Vec<u32>>,
}

/// Longest prefix the sources `members` share, short of the shortest one's
/// last token: where they stop sharing one sequence while a recomputed
/// group regrows (each sequence computes its own last token, for its
/// logits).
fn shared_len(sources: &[Vec<u32>], members: &[usize]) -> usize {
    let first = &sources[members[0]];
    let mut n = first.len();
    for &j in &members[1..] {
        let s = &sources[j];
        n = n.min(first.iter().zip(s).take_while(|(a, b)| a == b).count());
    }
    let shortest = members.iter().map(|&j| sources[j].len()).min().unwrap_or(0);
    n.min(shortest.saturating_sub(1))
}

/// How one written sequence of `len` tokens, standing for `members`,
/// splits: per new sequence, the sources it stands for and the length it
/// is appended to. Sources part at their first differing token; a part of
/// several continues as their shared prefix.
fn splits(sources: &[Vec<u32>], members: &[usize], len: usize) -> Vec<(Vec<usize>, usize)> {
    let mut parts: Vec<(u32, Vec<usize>)> = Vec::new();
    for &j in members {
        let t = sources[j][len];
        match parts.iter_mut().find(|(k, _)| *k == t) {
            Some((_, p)) => p.push(j),
            None => parts.push((t, vec![j])),
        }
    }
    let mut out = Vec::with_capacity(members.len());
    for (_, part) in parts {
        if part.len() > 1 {
            let end = shared_len(sources, &part);
            if end > len {
                out.push((part, end));
                continue;
            }
        }
        // Alone, or equal up to the last token: each its own sequence.
        out.extend(part.into_iter().map(|j| (vec![j], sources[j].len())));
    }
    out
}

/// Blocks a group takes once regrown into `sources`: each source's
/// blocks, less the full blocks it shares with an earlier one (the layout
/// the regrowth builds: sources share the full blocks before the token
/// where they part, and no more).
fn regrown_blocks(sources: &[Vec<u32>], block_size: usize) -> usize {
    let mut total = 0;
    for (i, s) in sources.iter().enumerate() {
        let shared = (0..i)
            .map(|k| shared_len(sources, &[k, i]))
            .max()
            .unwrap_or(0);
        total += s.len().div_ceil(block_size) - shared / block_size;
    }
    total
}

/// Continuous batching over a [`BlockManager`] it owns. See the module docs.
///
/// # Examples
///
/// ```
/// use pagedattn::blocks::{BlockManagerConfig, Child, GroupOutput, Scheduler, SchedulerConfig};
///
/// let mut s = Scheduler::new(BlockManagerConfig::new(64, 16), SchedulerConfig::new(32, 8)).unwrap();
/// let r = s.add_request(&[7; 40], 2, b"").unwrap(); // two parallel samples
/// let mut out = Vec::new();
/// while s.has_work() {
///     let step = s.schedule().unwrap();
///     // ... run swaps, copies and the model over step.view() ...
///     let outputs: Vec<GroupOutput> = step.sample().iter().map(|&request| GroupOutput {
///         request,
///         children: (0..2).map(|i| Child { parent: i.min(step.rows().len() - 1), token: 1, finished: true }).collect(),
///     }).collect();
///     out.extend(s.commit(&step, &outputs).unwrap());
/// }
/// assert_eq!(out[0].request, r);
/// assert_eq!(out[0].sequences.len(), 2);
/// assert_eq!(out[0].sequences[0].len(), 41);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scheduler {
    blocks: Pools,
    cfg: SchedulerConfig,
    waiting: VecDeque<Group>,
    running: Vec<Group>,
    swapped: VecDeque<Group>,
    next_request: u64,
    in_flight: Option<u64>,
    steps: u64,
    stats: SchedulerStats,
}

/// What the token-budget steps of [`Scheduler::schedule`] build: the
/// chosen rows, who owns each, and what they use.
struct Batching {
    /// Tokens left in the step's budget.
    budget: usize,
    /// (sequence, tokens) of each chosen row.
    rows: Vec<(SeqId, usize)>,
    /// (running index, sequence index) of each row.
    owners: Vec<(usize, usize)>,
    /// Sequences with a row.
    in_batch: usize,
    /// The running groups' width (what they may grow to).
    width: usize,
}

impl Scheduler {
    /// A scheduler over a new block manager.
    pub fn new(blocks: BlockManagerConfig, cfg: SchedulerConfig) -> Result<Self, SchedulerError> {
        if cfg.max_batch_tokens == 0 || cfg.max_seqs == 0 {
            return Err(SchedulerError::Invalid(
                "a step needs a token budget and a sequence limit of at least 1".into(),
            ));
        }
        Self::over(Pools::single(blocks)?, cfg)
    }

    /// A scheduler over the layer groups of a hybrid model (Gemma 2 and
    /// 3, gpt-oss, an all-window stack): one pool per group, group `g`
    /// configured by `pools[g]` (one block size, sequence limit and
    /// prefix-caching switch for all). A sequence has one id in every
    /// group; each step plans every group ([`Step::group`]); a step, an
    /// admission or a swap-in fits only when it fits in every group; and
    /// at each commit the window groups release the blocks their windows
    /// no longer read, so a long sequence holds in a window group only its
    /// window's blocks. A prompt takes its blocks in every group at
    /// admission (its prefill writes every position); the window groups
    /// give back what lies behind their window as its chunks commit.
    ///
    /// Prefix hits: a new prompt shares the leading cached blocks that
    /// every group still holds (one hit for all, since every layer
    /// computes the same tokens); where a window group's blocks were
    /// evicted, the hit stops there and the prompt recomputes from that
    /// block. Reservations other than paging are refused: they are the
    /// single-pool baselines.
    pub fn with_groups(
        groups: &super::LayerGroups,
        pools: &[BlockManagerConfig],
        cfg: SchedulerConfig,
    ) -> Result<Self, SchedulerError> {
        if pools.len() > 1 && cfg.reservation != Reservation::Paged {
            return Err(SchedulerError::Invalid(format!(
                "the {} reservation is a single-pool baseline; layer groups page",
                cfg.reservation.name()
            )));
        }
        Self::over(Pools::grouped(groups, pools)?, cfg)
    }

    fn over(blocks: Pools, cfg: SchedulerConfig) -> Result<Self, SchedulerError> {
        if cfg.max_batch_tokens == 0 || cfg.max_seqs == 0 {
            return Err(SchedulerError::Invalid(
                "a step needs a token budget and a sequence limit of at least 1".into(),
            ));
        }
        Ok(Self {
            blocks,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            swapped: VecDeque::new(),
            next_request: 0,
            in_flight: None,
            steps: 0,
            stats: SchedulerStats::default(),
        })
    }

    /// The block manager (tables, counts); with layer groups, group 0's.
    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    /// Layer groups (1 unless made [`with_groups`](Self::with_groups)).
    pub fn num_groups(&self) -> usize {
        self.blocks.len()
    }

    /// How each layer group attends.
    pub fn group_kinds(&self) -> &[super::GroupKind] {
        self.blocks.kinds()
    }

    /// Layer group `g`'s block manager (its tables in its pool, its
    /// counts and prefix cache).
    pub fn group_blocks(&self, g: usize) -> Option<&BlockManager> {
        self.blocks.get(g)
    }

    /// Records the block manager's [`KvEvent`](super::KvEvent)s (blocks
    /// stored and evicted, sequences ended), or stops; with layer groups,
    /// group 0's.
    pub fn record_events(&mut self, on: bool) {
        self.blocks.record_events(on);
    }

    /// The block manager's events since the last call.
    pub fn take_events(&mut self) -> Vec<super::KvEvent> {
        self.blocks.take_events()
    }

    /// Reorders the block manager's free list with a seeded shuffle
    /// (tests and demos see scrambled physical blocks).
    pub fn scramble_free_list(&mut self, seed: u64) {
        self.blocks.scramble_free_list(seed);
    }

    /// The limits.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    /// Requests waiting, running and swapped out.
    pub fn queue_lengths(&self) -> (usize, usize, usize) {
        (self.waiting.len(), self.running.len(), self.swapped.len())
    }

    /// Whether any request is queued, running or swapped.
    pub fn has_work(&self) -> bool {
        !(self.waiting.is_empty() && self.running.is_empty() && self.swapped.is_empty())
    }

    /// Sequences a request holds now (0 while it waits).
    pub fn sequences(&self, request: RequestId) -> Result<&[SeqId], SchedulerError> {
        self.find(request).map(|g| g.seqs.as_slice())
    }

    fn find(&self, request: RequestId) -> Result<&Group, SchedulerError> {
        self.waiting
            .iter()
            .chain(&self.running)
            .chain(&self.swapped)
            .find(|g| g.id == request)
            .ok_or(SchedulerError::UnknownRequest(request))
    }

    /// Queues a request: `prompt`, decoded by up to `width` sequences at
    /// once (1; n parallel samples; a beam width), in the prefix-cache
    /// namespace `cache_salt`. Refused if it could never be scheduled.
    pub fn add_request(
        &mut self,
        prompt: &[u32],
        width: usize,
        cache_salt: &[u8],
    ) -> Result<RequestId, SchedulerError> {
        self.add_request_with_remote(prompt, width, cache_salt, 0)
    }

    /// [`add_request`](Self::add_request) for a prompt whose first
    /// `remote_blocks` full blocks a remote prefix store holds (the
    /// leading digests of [`BlockManager::prompt_hashes`] it has): at
    /// admission, those the local cache lacks get fresh blocks, listed in
    /// the step's [`imports`](Step::imports), to import before the step
    /// runs; their tokens are not computed.
    pub fn add_request_with_remote(
        &mut self,
        prompt: &[u32],
        width: usize,
        cache_salt: &[u8],
        remote_blocks: usize,
    ) -> Result<RequestId, SchedulerError> {
        let admission = Admission {
            remote_blocks,
            ..Admission::default()
        };
        self.add_request_with(prompt, width, cache_salt, admission)
    }

    /// [`add_request`](Self::add_request) with what else the scheduler
    /// may know of the request: remote prefix blocks, and the output
    /// lengths a [`Reservation`] reserves for. Refused if its
    /// reservation alone is more than the pool.
    pub fn add_request_with(
        &mut self,
        prompt: &[u32],
        width: usize,
        cache_salt: &[u8],
        admission: Admission,
    ) -> Result<RequestId, SchedulerError> {
        let remote_blocks = admission.remote_blocks;
        if remote_blocks > 0 && !self.blocks.config().prefix_caching {
            return Err(BlockError::PrefixCachingOff.into());
        }
        if prompt.is_empty() {
            return Err(BlockError::EmptyPrompt.into());
        }
        if width == 0 || width > self.cfg.max_seqs || width > self.cfg.max_batch_tokens {
            return Err(SchedulerError::Invalid(format!(
                "a group of {width} sequences cannot run in steps of {} sequences and {} tokens",
                self.cfg.max_seqs, self.cfg.max_batch_tokens
            )));
        }
        let bc = self.blocks.config();
        let limit = bc.max_seq_len;
        if prompt.len() >= limit {
            return Err(BlockError::TooManyTokens {
                requested: prompt.len() + 1,
                limit,
            }
            .into());
        }
        let need = prompt.len().div_ceil(bc.block_size as usize) + width;
        let pool = self.blocks.min_blocks();
        if need > pool {
            return Err(SchedulerError::Invalid(format!(
                "a prompt of {} tokens decoded by {width} sequences needs {need} blocks; the pool has {pool}",
                prompt.len(),
            )));
        }
        let max_tokens = admission
            .max_tokens
            .unwrap_or(limit - prompt.len())
            .min(limit - prompt.len());
        let expected = admission
            .expected_tokens
            .unwrap_or(max_tokens)
            .min(max_tokens);
        let r = self.cfg.reservation;
        let reserve = width
            * r.tokens(prompt.len(), max_tokens, expected, limit)
                .div_ceil(bc.block_size as usize);
        if reserve > bc.num_blocks as usize {
            return Err(SchedulerError::Invalid(format!(
                "under the {} reservation a prompt of {} tokens decoded by {width} sequences reserves {reserve} blocks; the pool has {}",
                r.name(),
                prompt.len(),
                bc.num_blocks
            )));
        }
        let id = RequestId {
            number: self.next_request,
            owner: self.blocks.owner(),
        };
        self.next_request += 1;
        self.waiting.push_back(Group {
            id,
            salt: cache_salt.to_vec(),
            remote: remote_blocks,
            reserve,
            width,
            seqs: Vec::new(),
            sources: vec![prompt.to_vec()],
            targets: Vec::new(),
            children: Vec::new(),
            done: Vec::new(),
        });
        Ok(id)
    }

    /// Blocks reserved by the groups that hold memory (0 under paging).
    pub fn reserved_blocks(&self) -> usize {
        self.running
            .iter()
            .chain(&self.swapped)
            .map(|g| g.reserve)
            .sum()
    }

    /// Gives up the step in flight when it could not run (the device
    /// failed it): every running and swapped-out request is dropped, since
    /// the step may have left their K/V half written; waiting requests
    /// stay queued (they hold no blocks). Blocks the step imported leave
    /// the prefix cache. Returns the dropped requests; the scheduler then
    /// schedules again.
    pub fn abandon(&mut self, step: &Step) -> Result<Vec<RequestId>, SchedulerError> {
        if self.in_flight != Some(step.number) || step.owner != self.blocks.owner() {
            return Err(SchedulerError::StepOrder(
                "abandon of a step that is not in flight",
            ));
        }
        self.in_flight = None;
        for g in 0..step.num_groups() {
            for (_, imported) in step.group(g).expect("g < groups").imports {
                let blocks: Vec<u32> = imported.iter().map(|b| b.0).collect();
                self.blocks.uncache(g, &blocks);
            }
        }
        let groups: Vec<Group> = self
            .running
            .drain(..)
            .chain(self.swapped.drain(..))
            .collect();
        let mut dropped = Vec::with_capacity(groups.len());
        for g in groups {
            for id in g.seqs {
                self.blocks.free(id)?;
            }
            dropped.push(g.id);
        }
        // Copies into blocks the dropped groups held are dead work.
        self.blocks.take_copies();
        self.stats.aborted += dropped.len() as u64;
        Ok(dropped)
    }

    /// Drops a request wherever it is, freeing its blocks. Not while a step
    /// is in flight.
    pub fn abort(&mut self, request: RequestId) -> Result<(), SchedulerError> {
        if self.in_flight.is_some() {
            return Err(SchedulerError::StepOrder(
                "abort while a step awaits its commit",
            ));
        }
        self.find(request)?;
        let g = if let Some(i) = self.waiting.iter().position(|g| g.id == request) {
            self.waiting.remove(i)
        } else if let Some(i) = self.running.iter().position(|g| g.id == request) {
            Some(self.running.remove(i))
        } else {
            let i = self.swapped.iter().position(|g| g.id == request);
            i.and_then(|i| self.swapped.remove(i))
        };
        for id in g.expect("found above").seqs {
            self.blocks.free(id)?;
        }
        Ok(())
    }

    /// Pool blocks applying a group's children takes at most, per layer
    /// group.
    fn children_cost(&self, g: &Group) -> Result<Need, BlockError> {
        let mut per_parent = vec![0usize; g.seqs.len()];
        for c in g.children.iter().filter(|c| !c.finished) {
            per_parent[c.parent] += 1;
        }
        let mut total = Need::zero(self.blocks.len());
        for (p, &n) in per_parent.iter().enumerate() {
            total += match n {
                0 => Need::zero(self.blocks.len()),
                1 => self.blocks.blocks_needed_to_append(&[g.seqs[p]], 1)?,
                n => Need::zero(self.blocks.len()) + n,
            };
        }
        Ok(total)
    }

    /// Forks and prunes a resident group's sequences to its children and
    /// appends their tokens (the caller checked the blocks).
    fn apply_children(blocks: &mut Pools, g: &mut Group) -> Result<(), BlockError> {
        if g.children.is_empty() {
            return Ok(());
        }
        let live: Vec<Child> = g.children.drain(..).filter(|c| !c.finished).collect();
        let mut used = vec![false; g.seqs.len()];
        for c in &live {
            used[c.parent] = true;
        }
        for (i, &id) in g.seqs.iter().enumerate() {
            if !used[i] {
                blocks.free(id)?;
            }
        }
        let mut taken = vec![false; g.seqs.len()];
        let mut next = Vec::with_capacity(live.len());
        for c in &live {
            let parent = g.seqs[c.parent];
            let id = if taken[c.parent] {
                blocks.fork(parent)?
            } else {
                taken[c.parent] = true;
                parent
            };
            next.push(id);
        }
        // Forks first (they need the parent's written state), then appends.
        for (c, &id) in live.iter().zip(&next) {
            blocks.append(id, &[c.token])?;
        }
        g.seqs = next;
        Ok(())
    }
}
