//! The scheduler's pools: one block manager per layer group (one for a
//! model whose layers all attend alike), fed the same sequences in the
//! same order, so that a sequence has one id in every group.
//!
//! Reads that every group answers alike (tokens, lengths, the block size)
//! go to the first group through `Deref`. Block counts are per group
//! ([`Need`]): a step fits when it fits in every group. Every change goes
//! to every group, after the caller checked each group's room.

use std::ops::{Add, AddAssign, Deref, Sub};

use super::super::hybrid::{GroupKind, LayerGroups};
use super::super::RemoteBlock;
use super::*;

/// Layer groups a scheduler keeps at most (Gemma 2 and 3, gpt-oss and
/// their kind need two).
pub const MAX_SCHEDULER_GROUPS: usize = 4;

/// Blocks per group: what a step takes, or what each pool has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Need {
    n: [usize; MAX_SCHEDULER_GROUPS],
    len: usize,
}

impl Need {
    pub(super) fn zero(len: usize) -> Self {
        Self {
            n: [0; MAX_SCHEDULER_GROUPS],
            len,
        }
    }

    fn from_fn(len: usize, mut f: impl FnMut(usize) -> usize) -> Self {
        let mut n = [0; MAX_SCHEDULER_GROUPS];
        for (k, v) in n.iter_mut().enumerate().take(len) {
            *v = f(k);
        }
        Self { n, len }
    }

    fn try_from_fn(
        len: usize,
        mut f: impl FnMut(usize) -> Result<usize, BlockError>,
    ) -> Result<Self, BlockError> {
        let mut n = [0; MAX_SCHEDULER_GROUPS];
        for (k, v) in n.iter_mut().enumerate().take(len) {
            *v = f(k)?;
        }
        Ok(Self { n, len })
    }

    /// Whether some group needs more than `have` holds.
    pub(super) fn exceeds(&self, have: &Need) -> bool {
        self.n[..self.len]
            .iter()
            .zip(&have.n[..have.len])
            .any(|(a, b)| a > b)
    }

    /// The group that needs most past what `have` holds, with its counts.
    pub(super) fn worst(&self, have: &Need) -> (usize, usize, usize) {
        (0..self.len)
            .max_by_key(|&k| self.n[k] as i128 - have.n[k] as i128)
            .map_or((0, 0, 0), |k| (k, self.n[k], have.n[k]))
    }
}

impl Add for Need {
    type Output = Need;
    fn add(mut self, o: Need) -> Need {
        self += o;
        self
    }
}

impl AddAssign for Need {
    fn add_assign(&mut self, o: Need) {
        for k in 0..self.len {
            self.n[k] = self.n[k].saturating_add(o.n[k]);
        }
    }
}

impl Add<usize> for Need {
    type Output = Need;
    fn add(mut self, o: usize) -> Need {
        for k in 0..self.len {
            self.n[k] = self.n[k].saturating_add(o);
        }
        self
    }
}

impl Sub<usize> for Need {
    type Output = Need;
    fn sub(mut self, o: usize) -> Need {
        for k in 0..self.len {
            self.n[k] -= o;
        }
        self
    }
}

/// One block manager per layer group. See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Pools {
    kinds: Vec<GroupKind>,
    m: Vec<BlockManager>,
}

impl Deref for Pools {
    type Target = BlockManager;
    fn deref(&self) -> &BlockManager {
        &self.m[0]
    }
}

impl Pools {
    pub(super) fn single(cfg: BlockManagerConfig) -> Result<Self, BlockError> {
        Ok(Self {
            kinds: vec![GroupKind::Full],
            m: vec![BlockManager::new(cfg)?],
        })
    }

    /// A pool per group of `groups`, group `g` configured by `cfgs[g]`:
    /// one block size, sequence limit and prefix-caching switch for all.
    pub(super) fn grouped(
        groups: &LayerGroups,
        cfgs: &[BlockManagerConfig],
    ) -> Result<Self, SchedulerError> {
        let kinds: Vec<GroupKind> = groups.groups().iter().map(|g| g.kind).collect();
        if cfgs.len() != kinds.len() {
            return Err(SchedulerError::Groups(
                super::super::hybrid::GroupError::PoolCount {
                    given: cfgs.len(),
                    groups: kinds.len(),
                },
            ));
        }
        if kinds.len() > MAX_SCHEDULER_GROUPS {
            return Err(SchedulerError::Invalid(format!(
                "{} layer groups: a scheduler keeps at most {MAX_SCHEDULER_GROUPS}",
                kinds.len()
            )));
        }
        let c0 = cfgs[0];
        if let Some((g, c)) = cfgs.iter().enumerate().find(|(_, c)| {
            c.block_size != c0.block_size
                || c.max_seq_len != c0.max_seq_len
                || c.prefix_caching != c0.prefix_caching
        }) {
            return Err(SchedulerError::Invalid(format!(
                "layer group {g}'s pool has block size {}, sequence limit {} and prefix caching {}; \
                 group 0's has {}, {} and {}: the groups must agree",
                c.block_size, c.max_seq_len, c.prefix_caching, c0.block_size, c0.max_seq_len, c0.prefix_caching
            )));
        }
        let first = BlockManager::new(c0)?;
        let mut m = Vec::with_capacity(cfgs.len());
        for c in &cfgs[1..] {
            m.push(first.sibling(*c)?);
        }
        m.insert(0, first);
        Ok(Self { kinds, m })
    }

    pub(super) fn len(&self) -> usize {
        self.m.len()
    }

    pub(super) fn kinds(&self) -> &[GroupKind] {
        &self.kinds
    }

    pub(super) fn get(&self, g: usize) -> Option<&BlockManager> {
        self.m.get(g)
    }

    pub(super) fn need(&self, f: impl FnMut(usize) -> usize) -> Need {
        Need::from_fn(self.m.len(), f)
    }

    pub(super) fn available(&self) -> Need {
        self.need(|k| self.m[k].available_blocks())
    }

    /// The smallest pool.
    pub(super) fn min_blocks(&self) -> usize {
        self.m
            .iter()
            .map(|m| m.config().num_blocks as usize)
            .min()
            .unwrap_or(0)
    }

    pub(super) fn blocks_needed_to_append(
        &self,
        seqs: &[SeqId],
        n: usize,
    ) -> Result<Need, BlockError> {
        Need::try_from_fn(self.m.len(), |k| self.m[k].blocks_needed_to_append(seqs, n))
    }

    pub(super) fn swap_in_blocks(&self, seqs: &[SeqId]) -> Result<Need, BlockError> {
        Need::try_from_fn(self.m.len(), |k| self.m[k].swap_in_blocks(seqs))
    }

    /// Leading cached blocks every group shares for `prompt` (one hit for
    /// all, since every layer computes the same tokens): the shortest of
    /// the groups' hits.
    fn hit_cap(&self, prompt: &[u32], salt: &[u8]) -> usize {
        if self.m.len() == 1 {
            return usize::MAX;
        }
        self.m
            .iter()
            .map(|m| m.cached_prefix_blocks(prompt, salt))
            .min()
            .unwrap_or(0)
    }

    pub(super) fn blocks_to_add(&self, prompt: &[u32], salt: &[u8]) -> Need {
        self.blocks_to_add_capped(prompt, salt, self.hit_cap(prompt, salt))
    }

    fn blocks_to_add_capped(&self, prompt: &[u32], salt: &[u8], cap: usize) -> Need {
        self.need(|k| self.m[k].blocks_to_add_capped(prompt, salt, cap))
    }

    /// Adds `prompt` in every group; each group's remote blocks to import.
    pub(super) fn add_sequence_with_remote(
        &mut self,
        prompt: &[u32],
        salt: &[u8],
        remote: usize,
    ) -> Result<(SeqId, Vec<Vec<RemoteBlock>>), BlockError> {
        let cap = self.hit_cap(prompt, salt);
        // One group checks its own room; several must all have it before
        // any takes a block.
        if self.m.len() > 1 {
            let have = self.available();
            let need = self.blocks_to_add_capped(prompt, salt, cap);
            if need.exceeds(&have) {
                let (_, needed, free) = need.worst(&have);
                return Err(BlockError::OutOfBlocks { needed, free });
            }
        }
        let mut id = None;
        let mut imports = Vec::with_capacity(self.m.len());
        for m in &mut self.m {
            let (sid, imp) = m.add_sequence_capped(prompt, salt, remote, cap)?;
            debug_assert!(id.is_none_or(|i| i == sid), "groups hand out one id");
            id = Some(sid);
            imports.push(imp);
        }
        Ok((id.expect("one group at least"), imports))
    }

    pub(super) fn add_sequence_salted(
        &mut self,
        prompt: &[u32],
        salt: &[u8],
    ) -> Result<SeqId, BlockError> {
        self.add_sequence_with_remote(prompt, salt, 0)
            .map(|(id, _)| id)
    }

    pub(super) fn free(&mut self, id: SeqId) -> Result<(), BlockError> {
        self.m[0].seq_len(id)?;
        for m in &mut self.m {
            m.free(id)?;
        }
        Ok(())
    }

    pub(super) fn fork(&mut self, id: SeqId) -> Result<SeqId, BlockError> {
        let mut child = None;
        for m in &mut self.m {
            let c = m.fork(id)?;
            debug_assert!(child.is_none_or(|i| i == c), "groups hand out one id");
            child = Some(c);
        }
        Ok(child.expect("one group at least"))
    }

    /// Appends in every group (the caller checked each group's room).
    pub(super) fn append(&mut self, id: SeqId, tokens: &[u32]) -> Result<(), BlockError> {
        for m in &mut self.m {
            m.append(id, tokens)?;
        }
        Ok(())
    }

    /// Swaps `seqs` out of every group, or of none (`SwapSpaceFull` when a
    /// group's swap space is short).
    pub(super) fn swap_out(&mut self, seqs: &[SeqId]) -> Result<Vec<Vec<[u32; 2]>>, BlockError> {
        for m in &self.m {
            let needed = m.swap_out_blocks(seqs)?;
            if needed > m.swap_free_blocks() {
                return Err(BlockError::SwapSpaceFull {
                    needed,
                    free: m.swap_free_blocks(),
                });
            }
        }
        self.m.iter_mut().map(|m| m.swap_out(seqs)).collect()
    }

    /// Swaps `seqs` back into every group (the caller checked the room).
    pub(super) fn swap_in(&mut self, seqs: &[SeqId]) -> Result<Vec<Vec<[u32; 2]>>, BlockError> {
        self.m.iter_mut().map(|m| m.swap_in(seqs)).collect()
    }

    pub(super) fn uncache(&mut self, g: usize, blocks: &[u32]) {
        if let Some(m) = self.m.get_mut(g) {
            m.uncache(blocks);
        }
    }

    pub(super) fn take_copies(&mut self) {
        for m in &mut self.m {
            m.take_copies();
        }
    }

    pub(super) fn record_events(&mut self, on: bool) {
        self.m[0].record_events(on);
    }

    pub(super) fn take_events(&mut self) -> Vec<super::super::KvEvent> {
        self.m[0].take_events()
    }

    pub(super) fn scramble_free_list(&mut self, seed: u64) {
        for (k, m) in self.m.iter_mut().enumerate() {
            m.scramble_free_list(seed.wrapping_add(k as u64));
        }
    }

    /// Each group's plan of the step into `plans` (the first group's
    /// first).
    pub(super) fn plan_step_into<'a>(
        &self,
        batch: &[(SeqId, usize)],
        plans: impl Iterator<Item = &'a mut StepPlan>,
    ) -> Result<(), BlockError> {
        for (m, p) in self.m.iter().zip(plans) {
            m.plan_step_into(batch, p)?;
        }
        Ok(())
    }

    /// Commits each group's plan, then each window group releases, for
    /// the step's sequences, the blocks its window no longer reads.
    pub(super) fn commit_step<'a>(
        &mut self,
        plans: impl Iterator<Item = &'a StepPlan> + Clone,
    ) -> Result<(), BlockError> {
        for (m, p) in self.m.iter().zip(plans.clone()) {
            m.check_plan(p)?;
        }
        for (m, p) in self.m.iter_mut().zip(plans.clone()) {
            m.commit_step(p)?;
        }
        for ((m, kind), p) in self.m.iter_mut().zip(&self.kinds).zip(plans) {
            for &id in p.seqs() {
                match *kind {
                    GroupKind::Full => {}
                    GroupKind::Window(w) => {
                        m.release_outside_window(id, w as usize)?;
                    }
                    GroupKind::SinksAndWindow { sinks, window } => {
                        m.release_outside_sinks_and_window(id, sinks as usize, window as usize)?;
                    }
                }
            }
        }
        Ok(())
    }
}
