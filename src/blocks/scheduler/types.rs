//! What the scheduler takes and hands back: requests, reservations, its configuration and errors, and a step's rows.

use super::*;

/// Handle of a request in a [`Scheduler`]; never reused. Like [`SeqId`]
/// it carries the scheduler that issued it, so a handle from another
/// scheduler is refused (`SchedulerError::UnknownRequest`) rather than
/// naming that scheduler's request of the same number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId {
    pub(super) number: u64,
    pub(super) owner: u32,
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
    /// A layer-group declaration the scheduler cannot keep.
    #[error(transparent)]
    Groups(#[from] crate::blocks::GroupError),
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
    pub(super) rows: Vec<Row>,
    pub(super) tokens: Vec<u32>,
    pub(super) plan: StepPlan,
    pub(super) swap_out: Vec<[u32; 2]>,
    pub(super) swap_in: Vec<[u32; 2]>,
    pub(super) preempted: Vec<(RequestId, Preemption)>,
    pub(super) sample: Vec<RequestId>,
    pub(super) aborted: Vec<RequestId>,
    pub(super) imports: Vec<(RequestId, Vec<crate::blocks::RemoteBlock>)>,
    /// The other layer groups' plans, swaps and imports (group 1 first).
    pub(super) more: Vec<GroupWork>,
    pub(super) number: u64,
    pub(super) owner: u32,
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
    pub fn view(&self) -> &crate::blocks::BatchView {
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
    pub fn imports(&self) -> &[(RequestId, Vec<crate::blocks::RemoteBlock>)] {
        &self.imports
    }

    /// Number of the step in its scheduler (1 for the first).
    pub fn number(&self) -> u64 {
        self.number
    }

    /// Layer groups the step plans for (1 unless the scheduler was made
    /// with [`Scheduler::with_groups`]).
    pub fn num_groups(&self) -> usize {
        1 + self.more.len()
    }

    /// Layer group `g`'s part of the step: its tables and slots (in that
    /// group's pool), swaps and imports. Group 0's is [`view`](Self::view),
    /// [`swap_out`](Self::swap_out), [`swap_in`](Self::swap_in) and
    /// [`imports`](Self::imports). `None` past the groups.
    pub fn group(&self, g: usize) -> Option<GroupStep<'_>> {
        if g == 0 {
            return Some(GroupStep {
                view: self.plan.view(),
                swap_out: &self.swap_out,
                swap_in: &self.swap_in,
                imports: &self.imports,
            });
        }
        self.more.get(g - 1).map(|w| GroupStep {
            view: w.plan.view(),
            swap_out: &w.swap_out,
            swap_in: &w.swap_in,
            imports: &w.imports,
        })
    }
}

impl Step {
    /// Each group's swap copies (group 0's first), out or in.
    pub(super) fn add_swaps(&mut self, pairs: Vec<Vec<[u32; 2]>>, out: bool) {
        if self.more.len() + 1 < pairs.len() {
            self.more.resize_with(pairs.len() - 1, Default::default);
        }
        for (g, p) in pairs.into_iter().enumerate() {
            let dst = match (g, out) {
                (0, true) => &mut self.swap_out,
                (0, false) => &mut self.swap_in,
                (g, true) => &mut self.more[g - 1].swap_out,
                (g, false) => &mut self.more[g - 1].swap_in,
            };
            dst.extend(p);
        }
    }

    /// Each group's remote blocks for `request` (group 0's first).
    pub(super) fn add_imports(
        &mut self,
        request: RequestId,
        imports: Vec<Vec<crate::blocks::RemoteBlock>>,
    ) {
        if self.more.len() + 1 < imports.len() {
            self.more.resize_with(imports.len() - 1, Default::default);
        }
        for (g, i) in imports.into_iter().enumerate() {
            if i.is_empty() {
                continue;
            }
            let dst = if g == 0 {
                &mut self.imports
            } else {
                &mut self.more[g - 1].imports
            };
            dst.push((request, i));
        }
    }
}

/// A layer group's plan, swaps and imports in a step (group 1 and on).
#[derive(Clone, Debug, Default)]
pub(super) struct GroupWork {
    pub(super) plan: StepPlan,
    pub(super) swap_out: Vec<[u32; 2]>,
    pub(super) swap_in: Vec<[u32; 2]>,
    pub(super) imports: Vec<(RequestId, Vec<crate::blocks::RemoteBlock>)>,
}

/// One layer group's part of a [`Step`], in that group's pool: run its
/// swaps and copies on its `KvCache`, and its layers with its view.
#[derive(Clone, Copy, Debug)]
pub struct GroupStep<'a> {
    /// Tables, lengths, slots and copy-on-write pairs.
    pub view: &'a crate::blocks::BatchView,
    /// `(pool block, host block)` copies of groups swapped out.
    pub swap_out: &'a [[u32; 2]],
    /// `(host block, pool block)` copies of groups swapped in.
    pub swap_in: &'a [[u32; 2]],
    /// Remote prefix blocks to import, per request.
    pub imports: &'a [(RequestId, Vec<crate::blocks::RemoteBlock>)],
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
