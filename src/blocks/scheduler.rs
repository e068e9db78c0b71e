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

/// Handle of a request in a [`Scheduler`]; never reused. Like [`SeqId`]
/// it carries the scheduler that issued it, so a handle from another
/// scheduler is refused (`SchedulerError::UnknownRequest`) rather than
/// naming that scheduler's request of the same number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId {
    number: u64,
    owner: u32,
}

impl RequestId {
    /// Arrival number in its scheduler (0 for the first request).
    pub fn number(self) -> u64 {
        self.number
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "r{}", self.number)
    }
}

/// How a running group is preempted when the pool cannot hold a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Preemption {
    /// Free its blocks; it is recomputed from its tokens when readmitted.
    Recompute,
    /// Swap its blocks to host swap space and back in later; recompute
    /// when the swap space is full.
    Swap,
    /// vLLM's rule: recompute a single sequence, swap a group of several
    /// (samples or beams, which share blocks a recompute would duplicate).
    #[default]
    Auto,
}

/// What a request holds of the pool while it runs: its blocks as it
/// fills them (paging), or, as the systems before paging did, a slab
/// reserved whole at admission. The reservations are the vLLM paper's
/// baselines (Orca-Max, -Pow2, -Oracle), run in the same scheduler over
/// the same pool so that a comparison measures the policy alone: a
/// request is admitted only while the reservations of the requests
/// holding memory (running or swapped out) and its own fit in the pool.
/// Each sequence of a group reserves its own slab; nothing is shared.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reservation {
    /// No reservation: blocks are taken as tokens arrive.
    #[default]
    Paged,
    /// The longest sequence the pool allows (`max_seq_len`) per sequence.
    Max,
    /// The next power of two of prompt + `max_tokens` per sequence.
    Pow2,
    /// Prompt + the output length the request will have
    /// ([`Admission::expected_tokens`], else `max_tokens`) per sequence.
    Oracle,
}

impl Reservation {
    /// Every policy, paging first.
    pub const ALL: [Reservation; 4] = [Self::Paged, Self::Max, Self::Pow2, Self::Oracle];

    /// Its name: `paged`, `max`, `pow2`, `oracle`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Paged => "paged",
            Self::Max => "max",
            Self::Pow2 => "pow2",
            Self::Oracle => "oracle",
        }
    }

    /// The policy of that name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.name() == name)
    }

    /// Tokens one sequence reserves: a prompt of `prompt` tokens that may
    /// generate `max_tokens` and will generate `expected`, in a pool whose
    /// sequences hold at most `max_seq_len` tokens (0 for paging).
    pub fn tokens(
        self,
        prompt: usize,
        max_tokens: usize,
        expected: usize,
        max_seq_len: usize,
    ) -> usize {
        match self {
            Self::Paged => 0,
            Self::Max => max_seq_len,
            Self::Pow2 => (prompt + max_tokens).next_power_of_two().min(max_seq_len),
            Self::Oracle => (prompt + expected).min(max_seq_len),
        }
    }
}

/// What the scheduler learns of a request besides its prompt, width and
/// salt (all optional).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    /// Leading full prompt blocks a remote prefix store holds
    /// ([`Scheduler::add_request_with_remote`]).
    pub remote_blocks: usize,
    /// The most tokens it may generate (`None`: up to `max_seq_len`).
    pub max_tokens: Option<usize>,
    /// The tokens it will generate, where the caller knows it: what
    /// [`Reservation::Oracle`] reserves (`None`: `max_tokens`).
    pub expected_tokens: Option<usize>,
}

/// Limits of one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens computed in one step (decodes and prompt chunks together).
    pub max_batch_tokens: usize,
    /// Sequences in one step.
    pub max_seqs: usize,
    /// How running groups are preempted.
    pub preemption: Preemption,
    /// Free blocks kept back at admission, so that running groups can grow
    /// without preempting at once.
    pub watermark_blocks: usize,
    /// What a request holds while it runs (paging, or a reservation).
    pub reservation: Reservation,
}

impl SchedulerConfig {
    /// A budget of `max_batch_tokens` tokens and `max_seqs` sequences a
    /// step, [`Preemption::Auto`], no watermark.
    pub fn new(max_batch_tokens: usize, max_seqs: usize) -> Self {
        Self {
            max_batch_tokens,
            max_seqs,
            preemption: Preemption::Auto,
            watermark_blocks: 0,
            reservation: Reservation::Paged,
        }
    }
}

/// Errors of the [`Scheduler`]; every one leaves it as it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SchedulerError {
    /// From the block manager.
    #[error(transparent)]
    Blocks(#[from] BlockError),
    /// A configuration or request the scheduler cannot serve.
    #[error("{0}")]
    Invalid(String),
    /// The request is not queued, running or swapped.
    #[error("unknown request {0}")]
    UnknownRequest(RequestId),
    /// `schedule` while a step awaits its commit, or `commit` of a step that
    /// is not the one in flight.
    #[error("{0}")]
    StepOrder(&'static str),
    /// Sampled tokens that do not match the step.
    #[error("bad step output: {0}")]
    BadOutput(String),
}

/// One sequence a group continues with after a step: its parent (index
/// into the group's sequences, as in [`Row::index`]) and the sampled token.
/// A `finished` child ends there (its token is the last); the others are
/// appended and decoded on. Parallel samples give one child per sequence;
/// beam search gives the surviving beams, several of them on one parent
/// where the beams fork.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Child {
    /// Index of the parent sequence in the group.
    pub parent: usize,
    /// The sampled token.
    pub token: u32,
    /// The sequence ends with this token.
    pub finished: bool,
}

/// The children of one group that sampled in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupOutput {
    /// The request.
    pub request: RequestId,
    /// Its next sequences; none ends the request.
    pub children: Vec<Child>,
}

/// A request that ended, with every sequence it finished (prompt and
/// generated tokens), in the order they finished.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    /// The request.
    pub request: RequestId,
    /// Its finished sequences.
    pub sequences: Vec<Vec<u32>>,
}

/// One sequence of a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    /// Its request.
    pub request: RequestId,
    /// Its index in the request's group (the `parent` of its children).
    pub index: usize,
    /// The sequence.
    pub seq: SeqId,
    /// Positions computed this step (a prompt chunk, or the one new token).
    pub positions: Range<usize>,
    /// Whether the step yields this sequence's next-token logits.
    pub logits: bool,
}

/// One scheduled step. Run, in order: [`swap_out`](Self::swap_out) (pool
/// block to host block), [`swap_in`](Self::swap_in) (host block to pool
/// block), the view's `copies` (copy-on-write), then the model over
/// [`tokens`](Self::tokens) with the [`view`](Self::view)'s tables and
/// slots, and hand the sampled tokens of the groups in
/// [`sample`](Self::sample) to [`Scheduler::commit`].
///
/// A step is read-only: only [`Scheduler::schedule`] makes one, and
/// [`Scheduler::commit`] takes only the step in flight of its own
/// scheduler, so no edited or foreign step can be committed:
///
/// ```compile_fail
/// # use pagedattn::blocks::{BlockManagerConfig, Scheduler, SchedulerConfig};
/// let mut s = Scheduler::new(BlockManagerConfig::new(8, 4), SchedulerConfig::new(8, 2)).unwrap();
/// s.add_request(&[1, 2, 3], 1, b"").unwrap();
/// let mut step = s.schedule().unwrap();
/// step.sample.clear(); // private: does not compile
/// ```
#[derive(Clone, Debug, Default)]
pub struct Step {
    rows: Vec<Row>,
    tokens: Vec<u32>,
    plan: StepPlan,
    swap_out: Vec<[u32; 2]>,
    swap_in: Vec<[u32; 2]>,
    preempted: Vec<(RequestId, Preemption)>,
    sample: Vec<RequestId>,
    aborted: Vec<RequestId>,
    imports: Vec<(RequestId, Vec<super::RemoteBlock>)>,
    number: u64,
    owner: u32,
}

impl Step {
    /// The batch, row by row (the order of the view).
    pub fn rows(&self) -> &[Row] {
        &self.rows
    }

    /// Token ids of every row's positions, row after row (aligned with the
    /// view's `slot_mapping`).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The block manager's plan: tables, lengths, slots, copies.
    pub fn plan(&self) -> &StepPlan {
        &self.plan
    }

    /// The plan's view: what the GPU needs (tables, lengths, slots,
    /// copy-on-write pairs).
    pub fn view(&self) -> &super::BatchView {
        self.plan.view()
    }

    /// Copies `(pool block, host block)` of groups swapped out this step.
    pub fn swap_out(&self) -> &[[u32; 2]] {
        &self.swap_out
    }

    /// Copies `(host block, pool block)` of groups swapped in this step.
    pub fn swap_in(&self) -> &[[u32; 2]] {
        &self.swap_in
    }

    /// Groups preempted this step, and how.
    pub fn preempted(&self) -> &[(RequestId, Preemption)] {
        &self.preempted
    }

    /// Groups whose every sequence yields logits: each needs a
    /// [`GroupOutput`] in the commit.
    pub fn sample(&self) -> &[RequestId] {
        &self.sample
    }

    /// Requests dropped because they cannot fit even with the whole pool to
    /// themselves (their blocks are freed; they will never finish). Every
    /// preemption policy drops the same requests on the same pool.
    pub fn aborted(&self) -> &[RequestId] {
        &self.aborted
    }

    /// Remote prefix blocks admitted this step, per request
    /// ([`Scheduler::add_request_with_remote`]): `(pool block, digest)` to
    /// import (`KvCache::import_blocks`) before the step runs.
    pub fn imports(&self) -> &[(RequestId, Vec<super::RemoteBlock>)] {
        &self.imports
    }

    /// Number of the step in its scheduler (1 for the first).
    pub fn number(&self) -> u64 {
        self.number
    }
}

/// Counters since the scheduler was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Steps scheduled.
    pub steps: u64,
    /// Groups preempted by recompute.
    pub recomputed_groups: u64,
    /// Groups preempted by swapping.
    pub swapped_groups: u64,
    /// Swap preemptions that fell back to recompute (swap space full).
    pub swap_fallbacks: u64,
    /// Tokens whose K/V a recompute preemption threw away.
    pub tokens_recomputed: u64,
    /// Blocks copied out to host swap space.
    pub blocks_swapped_out: u64,
    /// Blocks copied back in.
    pub blocks_swapped_in: u64,
    /// Requests finished.
    pub finished: u64,
    /// Requests dropped because they outgrew the whole pool.
    pub aborted: u64,
}

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
    blocks: BlockManager,
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
        Ok(Self {
            blocks: BlockManager::new(blocks)?,
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

    /// The block manager (tables, counts).
    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    /// Records the block manager's [`KvEvent`](super::KvEvent)s (blocks
    /// stored and evicted, sequences ended), or stops.
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
        if need > bc.num_blocks as usize {
            return Err(SchedulerError::Invalid(format!(
                "a prompt of {} tokens decoded by {width} sequences needs {need} blocks; the pool has {}",
                prompt.len(),
                bc.num_blocks
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
        for (_, imported) in &step.imports {
            let blocks: Vec<u32> = imported.iter().map(|b| b.0).collect();
            self.blocks.uncache(&blocks);
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

    /// Pool blocks applying a group's children takes at most.
    fn children_cost(&self, g: &Group) -> Result<usize, BlockError> {
        let mut per_parent = vec![0usize; g.seqs.len()];
        for c in g.children.iter().filter(|c| !c.finished) {
            per_parent[c.parent] += 1;
        }
        let mut total = 0;
        for (p, &n) in per_parent.iter().enumerate() {
            total += match n {
                0 => 0,
                1 => self.blocks.blocks_needed_to_append(&[g.seqs[p]], 1)?,
                n => n,
            };
        }
        Ok(total)
    }

    /// Forks and prunes a resident group's sequences to its children and
    /// appends their tokens (the caller checked the blocks).
    fn apply_children(blocks: &mut BlockManager, g: &mut Group) -> Result<(), BlockError> {
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

    fn preempt(&mut self, mut g: Group, step: &mut Step) -> Result<(), SchedulerError> {
        let single = g.seqs.len() == 1 && g.children.iter().filter(|c| !c.finished).count() <= 1;
        let mut mode = match self.cfg.preemption {
            Preemption::Auto if single => Preemption::Recompute,
            Preemption::Auto => Preemption::Swap,
            p => p,
        };
        if mode == Preemption::Swap {
            match self.blocks.swap_out(&g.seqs) {
                Ok(pairs) => {
                    self.stats.swapped_groups += 1;
                    self.stats.blocks_swapped_out += pairs.len() as u64;
                    step.swap_out.extend(pairs);
                    step.preempted.push((g.id, Preemption::Swap));
                    let at = self.swapped.partition_point(|x| x.id < g.id);
                    self.swapped.insert(at, g);
                    return Ok(());
                }
                Err(BlockError::SwapSpaceFull { .. }) => {
                    self.stats.swap_fallbacks += 1;
                    mode = Preemption::Recompute;
                }
                Err(e) => return Err(e.into()),
            }
        }
        debug_assert_eq!(mode, Preemption::Recompute);
        let mut sources = Vec::new();
        let live: Vec<Child> = g.children.iter().filter(|c| !c.finished).copied().collect();
        if !g.targets.is_empty() {
            // Still regrowing from an earlier recompute: the same sources.
            sources = std::mem::take(&mut g.sources);
        } else if live.is_empty() {
            for &id in &g.seqs {
                sources.push(self.blocks.tokens(id)?.to_vec());
            }
        } else {
            for c in &live {
                let mut t = self.blocks.tokens(g.seqs[c.parent])?.to_vec();
                t.push(c.token);
                sources.push(t);
            }
        }
        for &id in &g.seqs {
            let written = self.blocks.seq_len(id)? - self.blocks.pending_tokens(id)?;
            self.stats.tokens_recomputed += written as u64;
            self.blocks.free(id)?;
        }
        g.seqs.clear();
        g.children.clear();
        g.targets.clear();
        g.sources = sources;
        self.stats.recomputed_groups += 1;
        step.preempted.push((g.id, Preemption::Recompute));
        let at = self.waiting.partition_point(|x| x.id < g.id);
        self.waiting.insert(at, g);
        Ok(())
    }

    /// Chunks of a group's sequences within `budget` tokens: everything
    /// when it fits (every sequence then yields logits), else chunks that
    /// hold back each sequence's last pending token, so that a group's
    /// sequences reach their logits in the same step.
    fn chunks(&self, g: &Group, budget: usize) -> Result<Vec<usize>, BlockError> {
        let pending: Vec<usize> = g
            .seqs
            .iter()
            .map(|&id| self.blocks.pending_tokens(id))
            .collect::<Result<_, _>>()?;
        let total: usize = pending.iter().sum();
        if total <= budget && g.targets.is_empty() {
            return Ok(pending);
        }
        // While regrowing, a shared prefix is written whole (it then
        // splits), and a sequence standing for one source keeps its last
        // token back until the group has regrown, so that every sequence
        // reaches its logits in the same step.
        let mut left = budget;
        Ok(pending
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                let whole = g.targets.get(i).is_some_and(|t| t.len() > 1);
                let c = if whole { p } else { p.saturating_sub(1) }.min(left);
                left -= c;
                c
            })
            .collect())
    }

    /// Pool blocks the next split of a regrowing group takes: per
    /// sequence written up to its shared prefix, the blocks its parts'
    /// appends take (copying the partly filled last block for all but one).
    fn regrow_cost(&self, g: &Group) -> Result<usize, BlockError> {
        let bs = self.blocks.block_size() as usize;
        let mut total = 0;
        for (i, &id) in g.seqs.iter().enumerate() {
            let Some(members) = g.targets.get(i).filter(|t| t.len() > 1) else {
                continue;
            };
            if self.blocks.pending_tokens(id)? > 0 {
                continue;
            }
            let len = self.blocks.seq_len(id)?;
            let parts = splits(&g.sources, members, len);
            total += parts
                .iter()
                .map(|(_, end)| end.div_ceil(bs) - len / bs)
                .sum::<usize>();
            if len % bs != 0 {
                total -= 1; // the last to append keeps the original block
            }
        }
        Ok(total)
    }

    /// Splits every written shared prefix of a regrowing group (forks
    /// first, then the appends); once each sequence stands for one source,
    /// puts them back in the group's order and ends the regrowth. The
    /// caller checked the blocks ([`regrow_cost`](Self::regrow_cost)).
    fn regrow(blocks: &mut BlockManager, g: &mut Group) -> Result<(), BlockError> {
        if g.targets.is_empty() {
            return Ok(());
        }
        let mut seqs = Vec::with_capacity(g.width);
        let mut targets = Vec::with_capacity(g.width);
        let mut appends = Vec::new();
        for (i, &id) in g.seqs.iter().enumerate() {
            let members = std::mem::take(&mut g.targets[i]);
            if members.len() == 1 || blocks.pending_tokens(id)? > 0 {
                seqs.push(id);
                targets.push(members);
                continue;
            }
            let len = blocks.seq_len(id)?;
            for (k, (part, end)) in splits(&g.sources, &members, len).into_iter().enumerate() {
                let sid = if k == 0 { id } else { blocks.fork(id)? };
                appends.push((sid, part[0], len, end));
                seqs.push(sid);
                targets.push(part);
            }
        }
        for (sid, j, len, end) in appends {
            blocks.append(sid, &g.sources[j][len..end])?;
        }
        if targets.iter().all(|t| t.len() == 1) {
            let mut order: Vec<(usize, SeqId)> = targets.iter().map(|t| t[0]).zip(seqs).collect();
            order.sort_unstable_by_key(|&(j, _)| j);
            g.seqs = order.into_iter().map(|(_, id)| id).collect();
            g.targets.clear();
            g.sources.clear();
        } else {
            g.seqs = seqs;
            g.targets = targets;
        }
        Ok(())
    }

    /// Blocks admitting a waiting group takes in the end (prefix-cache hits
    /// not counted), and the length of the shared prefix it regrows from
    /// (0: its sources are added as they are).
    fn admission_blocks(&self, g: &Group) -> (usize, usize) {
        let bs = self.blocks.block_size() as usize;
        let all: Vec<usize> = (0..g.sources.len()).collect();
        let shared = if g.sources.len() > 1 {
            shared_len(&g.sources, &all)
        } else {
            0
        };
        if shared == 0 {
            let n = g
                .sources
                .iter()
                .map(|s| self.blocks.blocks_to_add(s, &g.salt))
                .sum();
            return (n, 0);
        }
        let prefix = &g.sources[0][..shared];
        let n = self.blocks.blocks_to_add(prefix, &g.salt) + regrown_blocks(&g.sources, bs)
            - shared.div_ceil(bs);
        (n, shared)
    }

    /// Decides the next step. See [`Step`] for what to run.
    pub fn schedule(&mut self) -> Result<Step, SchedulerError> {
        if self.in_flight.is_some() {
            return Err(SchedulerError::StepOrder(
                "schedule while the previous step awaits its commit",
            ));
        }
        // Every input was checked when it arrived (add_request, commit), so
        // an error below is a broken invariant, reported instead of a panic.
        self.schedule_inner()
    }

    fn schedule_inner(&mut self) -> Result<Step, SchedulerError> {
        let mut step = Step::default();
        self.make_room(&mut step)?;
        let preempted = !step.preempted.is_empty();
        let width = self.swap_back(preempted, &mut step)?;
        let mut b = Batching {
            budget: self.cfg.max_batch_tokens,
            rows: Vec::new(),
            owners: Vec::new(),
            in_batch: 0,
            width,
        };
        self.batch_running(&mut b)?;
        if !preempted {
            self.admit(&mut b, &mut step)?;
        }
        self.emit_rows(&b, &mut step)?;
        self.steps += 1;
        self.stats.steps += 1;
        step.number = self.steps;
        step.owner = self.blocks.owner();
        self.in_flight = Some(self.steps);
        Ok(step)
    }

    /// Step 1 of [`schedule`](Self::schedule): room for the running groups'
    /// children, preempting the newest arrivals until there is.
    fn make_room(&mut self, step: &mut Step) -> Result<(), SchedulerError> {
        loop {
            let mut need = 0usize;
            for g in &self.running {
                need += self.children_cost(g)? + self.regrow_cost(g)?;
            }
            if need <= self.blocks.available_blocks() {
                break;
            }
            let victim = self.running.pop().expect("need > 0 means a running group");
            if self.running.is_empty() {
                // Alone, with every other block free or evictable, it still
                // does not fit: preempting it would only bring it back.
                for &id in &victim.seqs {
                    self.blocks.free(id)?;
                }
                self.stats.aborted += 1;
                step.aborted.push(victim.id);
                continue;
            }
            self.preempt(victim, step)?;
        }
        for g in &mut self.running {
            Self::apply_children(&mut self.blocks, g)?;
            Self::regrow(&mut self.blocks, g)?;
        }
        Ok(())
    }

    /// Step 2: swapped groups back in, oldest first, when nothing was
    /// preempted this step. Returns the running groups' width.
    fn swap_back(&mut self, preempted: bool, step: &mut Step) -> Result<usize, SchedulerError> {
        // Running groups are counted at their width (what they may grow
        // to), so the sequences held never pass `max_seqs`.
        let mut width: usize = self.running.iter().map(|g| g.width).sum();
        // Their children are applied once every swap-in is chosen: a parent
        // pruned then frees a block that no later swap-in of this step may
        // take (one step never writes a pool block twice by swapping).
        let mut back: Vec<RequestId> = Vec::new();
        let mut reserved = 0usize;
        while let (false, Some(g)) = (preempted, self.swapped.front()) {
            let grow = g.children.iter().filter(|c| !c.finished).count();
            let need = self.blocks.swap_in_blocks(&g.seqs)? + grow + self.regrow_cost(g)?;
            let idle = self.running.is_empty();
            let wm = if idle { 0 } else { self.cfg.watermark_blocks };
            if need + reserved + wm > self.blocks.available_blocks()
                || width + g.width > self.cfg.max_seqs
            {
                if idle && need > self.blocks.available_blocks() {
                    // With the pool to itself it still cannot come back
                    // and grow: it never will. Drop it.
                    let g = self.swapped.pop_front().expect("front exists");
                    for &id in &g.seqs {
                        self.blocks.free(id)?;
                    }
                    self.stats.aborted += 1;
                    step.aborted.push(g.id);
                    continue;
                }
                break;
            }
            let g = self.swapped.pop_front().expect("front exists");
            let pairs = self.blocks.swap_in(&g.seqs)?;
            self.stats.blocks_swapped_in += pairs.len() as u64;
            step.swap_in.extend(pairs);
            reserved += grow;
            width += g.width;
            back.push(g.id);
            let at = self.running.partition_point(|x| x.id < g.id);
            self.running.insert(at, g);
        }
        for g in self.running.iter_mut().filter(|g| back.contains(&g.id)) {
            Self::apply_children(&mut self.blocks, g)?;
            Self::regrow(&mut self.blocks, g)?;
        }
        Ok(width)
    }

    /// Step 3: the token budget for the running groups, in arrival order
    /// (decodes take one token a sequence).
    fn batch_running(&mut self, b: &mut Batching) -> Result<(), SchedulerError> {
        for gi in 0..self.running.len() {
            let g = &self.running[gi];
            if b.in_batch + g.seqs.len() > self.cfg.max_seqs || b.budget == 0 {
                continue;
            }
            let chunks = self.chunks(g, b.budget)?;
            let sum: usize = chunks.iter().sum();
            if sum == 0 {
                continue;
            }
            b.budget -= sum;
            b.in_batch += g.seqs.len();
            for (si, (&id, &c)) in g.seqs.iter().zip(&chunks).enumerate() {
                if c > 0 {
                    b.rows.push((id, c));
                    b.owners.push((gi, si));
                }
            }
        }
        Ok(())
    }

    /// Step 4: admissions from the waiting queue, first come first served
    /// (not called in a step that preempted).
    fn admit(&mut self, b: &mut Batching, step: &mut Step) -> Result<(), SchedulerError> {
        while b.budget > 0 && self.swapped.is_empty() {
            let Some(g) = self.waiting.front() else { break };
            if b.in_batch + g.sources.len() > self.cfg.max_seqs
                || b.width + g.width > self.cfg.max_seqs
            {
                break;
            }
            // The watermark keeps room for running groups to grow; with
            // none, it would only keep the pool idle.
            // Headroom of one block per sequence to grow; an idle pool
            // admits without it (it would only wait for itself).
            let idle = self.running.is_empty();
            if g.reserve > 0
                && self.reserved_blocks() + g.reserve > self.blocks.config().num_blocks as usize
            {
                // Its slab does not fit beside the others': it waits.
                break;
            }
            let (blocks, shared) = self.admission_blocks(g);
            let need = blocks + g.width + if idle { 0 } else { self.cfg.watermark_blocks };
            let available = self.blocks.available_blocks();
            if need > available {
                if idle && blocks > available {
                    // Nothing runs or is swapped out: every block is free or
                    // evictable, and it still does not fit (a recompute of a
                    // group grown past the pool). It never will: drop it.
                    let g = self.waiting.pop_front().expect("front exists");
                    self.stats.aborted += 1;
                    step.aborted.push(g.id);
                    continue;
                }
                if !idle {
                    break;
                }
            }
            let mut g = self.waiting.pop_front().expect("front exists");
            b.width += g.width;
            if shared > 0 {
                // A recomputed group of several sequences: its shared
                // prefix once; it forks where they part (`regrow`).
                let id = self
                    .blocks
                    .add_sequence_salted(&g.sources[0][..shared], &g.salt)?;
                g.seqs.push(id);
                g.targets.push((0..g.sources.len()).collect());
            } else {
                let remote = std::mem::take(&mut g.remote);
                for s in std::mem::take(&mut g.sources) {
                    let (id, imports) =
                        self.blocks.add_sequence_with_remote(&s, &g.salt, remote)?;
                    if !imports.is_empty() {
                        step.imports.push((g.id, imports));
                    }
                    g.seqs.push(id);
                }
            }
            let chunks = self.chunks(&g, b.budget)?;
            let sum: usize = chunks.iter().sum();
            b.budget -= sum;
            let at = self.running.partition_point(|x| x.id < g.id);
            // Owners index the running list: shift those at or after `at`.
            for o in b.owners.iter_mut() {
                if o.0 >= at {
                    o.0 += 1;
                }
            }
            if sum > 0 {
                b.in_batch += g.seqs.len();
                for (si, (&id, &c)) in g.seqs.iter().zip(&chunks).enumerate() {
                    if c > 0 {
                        b.rows.push((id, c));
                        b.owners.push((at, si));
                    }
                }
            }
            self.running.insert(at, g);
        }
        Ok(())
    }

    /// Step 5: the plan of the chosen rows, the rows and their token ids,
    /// and the groups that sample.
    fn emit_rows(&mut self, b: &Batching, step: &mut Step) -> Result<(), SchedulerError> {
        self.blocks.plan_step_into(&b.rows, &mut step.plan)?;
        let mut last_group = usize::MAX;
        for (i, &(gi, si)) in b.owners.iter().enumerate() {
            let g = &self.running[gi];
            let id = g.seqs[si];
            let tokens = self.blocks.tokens(id)?;
            let end = step.plan.view().seq_lens[i] as usize;
            let start = end - step.plan.chunks()[i];
            step.tokens.extend_from_slice(&tokens[start..end]);
            step.rows.push(Row {
                request: g.id,
                index: si,
                seq: id,
                positions: start..end,
                logits: step.plan.completes()[i]
                    && step.plan.chunks()[i] > 0
                    && g.targets.is_empty(),
            });
            // A group's rows are adjacent: it samples when every one of its
            // sequences is in the batch and reaches its logits.
            if gi != last_group {
                last_group = gi;
                let n = g.seqs.len();
                let all = b
                    .owners
                    .get(i..i + n)
                    .is_some_and(|o| o.iter().all(|&(a, _)| a == gi))
                    && step.plan.completes()[i..i + n].iter().all(|&c| c);
                if all && g.targets.is_empty() {
                    step.sample.push(g.id);
                }
            }
        }
        Ok(())
    }

    /// Commits a step once the model ran it: the rows' tokens count as
    /// written, and each group in `step.sample` continues with the children
    /// in `outputs` (applied at the next [`schedule`](Self::schedule)).
    /// Returns the requests that ended. Refused, changing nothing, if
    /// `outputs` does not name exactly the groups in `step.sample` or names
    /// a parent the group does not have, or more live children than its
    /// width.
    pub fn commit(
        &mut self,
        step: &Step,
        outputs: &[GroupOutput],
    ) -> Result<Vec<Finished>, SchedulerError> {
        if self.in_flight != Some(step.number) || step.owner != self.blocks.owner() {
            return Err(SchedulerError::StepOrder(
                "commit of a step that is not in flight",
            ));
        }
        if outputs.len() != step.sample.len() {
            return Err(SchedulerError::BadOutput(format!(
                "{} groups sampled in this step, {} outputs given",
                step.sample.len(),
                outputs.len()
            )));
        }
        for o in outputs {
            if !step.sample.contains(&o.request) {
                return Err(SchedulerError::BadOutput(format!(
                    "request {} did not sample in this step",
                    o.request
                )));
            }
            if outputs.iter().filter(|x| x.request == o.request).count() > 1 {
                return Err(SchedulerError::BadOutput(format!(
                    "request {} named twice",
                    o.request
                )));
            }
            let g = self
                .running
                .iter()
                .find(|g| g.id == o.request)
                .ok_or(SchedulerError::UnknownRequest(o.request))?;
            if let Some(c) = o.children.iter().find(|c| c.parent >= g.seqs.len()) {
                return Err(SchedulerError::BadOutput(format!(
                    "request {} has {} sequences; a child names parent {}",
                    o.request,
                    g.seqs.len(),
                    c.parent
                )));
            }
            let live = o.children.iter().filter(|c| !c.finished).count();
            if live > g.width {
                return Err(SchedulerError::BadOutput(format!(
                    "request {} continues with {live} sequences, more than its width {}",
                    o.request, g.width
                )));
            }
            let longest = o
                .children
                .iter()
                .filter(|c| !c.finished)
                .map(|c| self.blocks.seq_len(g.seqs[c.parent]).unwrap_or(0) + 1)
                .max()
                .unwrap_or(0);
            let limit = self.blocks.config().max_seq_len;
            if longest > limit {
                return Err(SchedulerError::BadOutput(format!(
                    "request {} would grow to {longest} tokens, past the limit of {limit}",
                    o.request
                )));
            }
        }
        self.blocks.commit_step(&step.plan)?;
        self.in_flight = None;
        let mut ended = Vec::new();
        for o in outputs {
            let gi = self
                .running
                .iter()
                .position(|g| g.id == o.request)
                .expect("checked above");
            let g = &mut self.running[gi];
            for c in o.children.iter().filter(|c| c.finished) {
                let mut t = self.blocks.tokens(g.seqs[c.parent])?.to_vec();
                t.push(c.token);
                g.done.push(t);
            }
            g.children = o.children.clone();
            if o.children.iter().all(|c| c.finished) {
                let g = self.running.remove(gi);
                for &id in &g.seqs {
                    self.blocks.free(id)?;
                }
                self.stats.finished += 1;
                ended.push(Finished {
                    request: g.id,
                    sequences: g.done,
                });
            }
        }
        Ok(ended)
    }
}
