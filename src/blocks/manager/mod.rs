//! The block manager: sequences, block tables, reference counts,
//! copy-on-write and prefix caching over one physical pool.

use std::collections::{BTreeMap, HashMap, HashSet};

use sha2::{Digest as _, Sha256};

use std::sync::atomic::{AtomicU32, Ordering};

use super::{BatchView, BlockError, BlockStats, SeqId, RELEASED, SKIP_WRITE};

mod prefix;
mod step;
mod swap;
pub use step::StepPlan;

/// Tags each manager's handles, so that one manager refuses another's.
static NEXT_OWNER: AtomicU32 = AtomicU32::new(1);

/// Most blocks one manager takes: bounds its host memory (about 24 bytes a
/// block up front) before anything is allocated.
pub const MAX_BLOCKS: u32 = 1 << 24;

/// SHA-256 digest naming a full block's content and everything before it.
type ChainDigest = [u8; 32];

/// How a [`BlockManager`] is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockManagerConfig {
    /// Physical blocks in the pool.
    pub num_blocks: u32,
    /// Tokens per block: a power of two in 1..=256 (16 is the usual choice).
    pub block_size: u32,
    /// Reuse full blocks whose (parent hash, token ids) chain matches a new prompt.
    pub prefix_caching: bool,
    /// Longest sequence the manager accepts.
    pub max_seq_len: usize,
    /// Blocks of host swap space ([`BlockManager::swap_out`]); 0 for none.
    pub swap_blocks: u32,
}

impl BlockManagerConfig {
    /// A pool of `num_blocks` blocks of `block_size` tokens, prefix caching off,
    /// sequences up to 1 << 20 tokens.
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        Self {
            num_blocks,
            block_size,
            prefix_caching: false,
            max_seq_len: 1 << 20,
            swap_blocks: 0,
        }
    }

    /// The same with `blocks` blocks of host swap space.
    pub fn with_swap_space(mut self, blocks: u32) -> Self {
        self.swap_blocks = blocks;
        self
    }

    /// The same with prefix caching switched on or off.
    pub fn with_prefix_caching(mut self, on: bool) -> Self {
        self.prefix_caching = on;
        self
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Sequence {
    /// Logical block i -> physical block id.
    table: Vec<u32>,
    /// Token ids, kept for the prefix-cache hash chain.
    tokens: Vec<u32>,
    /// Tokens at the end of `tokens` whose K/V is not written yet (not
    /// yet committed by a step).
    pending: usize,
    /// The first pending token's K/V is already in the pool: a fully cached
    /// prompt computes its last token again for the logits only.
    skip_first: bool,
    /// Swapped out: `table` holds host swap blocks.
    swapped: bool,
    /// Digest chain of the leading full blocks already offered to the cache.
    hashes: Vec<ChainDigest>,
    /// Root of the chain: the digest of the sequence's cache salt.
    root: ChainDigest,
    /// Blocks (table positions) imported from a remote store at admission:
    /// their digests are in `hashes`, but they join the prefix cache only
    /// when the step that imports them commits, so that nothing shares a
    /// block before its content is there.
    imported: std::ops::Range<usize>,
}

/// Host-side owner of the paged KV cache's bookkeeping.
///
/// It never touches a GPU: it hands out block tables, slot mappings and copy
/// lists as plain integers. Every `Err` leaves the manager unchanged.
///
/// # Examples
///
/// ```
/// use pagedattn::blocks::{BlockManager, BlockManagerConfig};
///
/// let mut m = BlockManager::new(BlockManagerConfig::new(8, 4)).unwrap();
/// let a = m.add_sequence(&[1, 2, 3, 4, 5]).unwrap(); // 2 blocks
/// let view = m.batch_view(&[a]).unwrap();             // hands the prompt to the GPU
/// assert_eq!(view.slot_mapping.len(), 5);
/// let b = m.fork(a).unwrap();                          // shares both blocks
/// let slots = m.append(b, &[6]).unwrap();              // first write: copy-on-write
/// assert_eq!(m.take_copies().len(), 1);
/// assert_eq!(slots.len(), 1);
/// m.free(a).unwrap();
/// m.free(b).unwrap();
/// assert_eq!(m.stats().free, 8);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockManager {
    cfg: BlockManagerConfig,
    ref_counts: Vec<u32>,
    /// Plain free blocks (no cached content), used as a stack.
    free: Vec<u32>,
    /// Digest of the cached full block a physical block holds, if registered.
    block_hash: HashMap<u32, ChainDigest>,
    /// Cached content digest -> physical block.
    cache: HashMap<ChainDigest, u32>,
    /// Cached blocks at ref count 0, oldest release first.
    evictable: BTreeMap<u64, u32>,
    /// Key of each evictable block in `evictable`.
    evict_key: Vec<u64>,
    tick: u64,
    /// Sequence slots (index of a [`SeqId`]) with their generation.
    seqs: Vec<SeqSlot>,
    /// Vacant slots, reused last-in first-out.
    vacant: Vec<u32>,
    live: usize,
    owner: u32,
    /// Bumped by every change: a [`StepPlan`] commits only if unchanged.
    epoch: u64,
    /// Host swap blocks: references per block, and the free ones.
    swap_refs: Vec<u32>,
    swap_free: Vec<u32>,
    copies: Vec<[u32; 2]>,
    /// Blocks released to ref count 0 while a pending copy still reads them:
    /// held back from reuse until the copies are handed out, because one
    /// copy_blocks dispatch runs all pairs at once and a block must not be
    /// a source and a destination in the same list.
    awaiting_copy: Vec<u32>,
    prefix_hit_tokens: u64,
    /// Prompt tokens whose blocks a remote store supplied.
    remote_hit_tokens: u64,
    /// Cache events since the last `take_events` (`None`: not recorded).
    events: Option<Vec<KvEvent>>,
    /// References held by `pin_blocks`, per block.
    pins: HashMap<u32, u32>,
}

/// A block [`BlockManager::add_sequence_with_remote`] took for a remote
/// prefix block: `(pool block, chain digest)`, to import into.
pub type RemoteBlock = (u32, [u8; 32]);

/// What happened to a block of the prefix cache, for a router or a remote
/// prefix store ([`BlockManager::record_events`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// A full block is cached under its chain digest: its contents never
    /// change while it is cached, so it may be exported, once the step
    /// that writes its last tokens has run (or at once, for a block
    /// [`BlockManager::add_sequence_with_remote`] filled).
    Stored {
        /// The chain digest (tenant salt and every token up to the block's end).
        hash: [u8; 32],
        /// The pool block.
        block: u32,
    },
    /// A cached block was evicted: its digest finds nothing here any more.
    Removed {
        /// The digest it was cached under.
        hash: [u8; 32],
        /// The pool block (now reused).
        block: u32,
    },
    /// A sequence was freed: its blocks lost its references (shared and
    /// cached ones stay; [`BlockManager::pin_blocks`] keeps others while
    /// a transfer of them runs).
    SequenceEnded {
        /// The sequence.
        seq: SeqId,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct SeqSlot {
    generation: u32,
    seq: Option<Sequence>,
}

impl BlockManager {
    /// A manager over an empty pool.
    pub fn new(cfg: BlockManagerConfig) -> Result<Self, BlockError> {
        let bs = cfg.block_size;
        if !(1..=256).contains(&bs) || !bs.is_power_of_two() {
            return Err(BlockError::BadBlockSize(bs));
        }
        let max = (u32::MAX / bs).min(MAX_BLOCKS);
        if cfg.num_blocks == 0 || cfg.num_blocks > max || cfg.swap_blocks > MAX_BLOCKS {
            return Err(BlockError::BadPoolSize {
                num_blocks: cfg.num_blocks,
                block_size: bs,
                max,
            });
        }
        let n = cfg.num_blocks as usize;
        Ok(Self {
            cfg,
            ref_counts: vec![0; n],
            // Reversed so that blocks are handed out 0, 1, 2, ... from a fresh pool.
            free: (0..cfg.num_blocks).rev().collect(),
            block_hash: HashMap::new(),
            cache: HashMap::new(),
            evictable: BTreeMap::new(),
            evict_key: vec![0; n],
            tick: 0,
            seqs: Vec::new(),
            vacant: Vec::new(),
            live: 0,
            owner: NEXT_OWNER.fetch_add(1, Ordering::Relaxed),
            epoch: 0,
            swap_refs: vec![0; cfg.swap_blocks as usize],
            swap_free: (0..cfg.swap_blocks).rev().collect(),
            copies: Vec::new(),
            awaiting_copy: Vec::new(),
            prefix_hit_tokens: 0,
            remote_hit_tokens: 0,
            events: None,
            pins: HashMap::new(),
        })
    }

    /// A manager over another pool whose sequence ids are this one's: fed
    /// the same adds, forks and frees in the same order, both hand out the
    /// same ids (a hybrid scheduler's layer groups).
    pub(crate) fn sibling(&self, cfg: BlockManagerConfig) -> Result<Self, BlockError> {
        let mut m = Self::new(cfg)?;
        m.owner = self.owner;
        Ok(m)
    }

    /// The configuration this manager was built with.
    pub fn config(&self) -> &BlockManagerConfig {
        &self.cfg
    }

    /// Id of this manager: what its handles carry.
    pub(crate) fn owner(&self) -> u32 {
        self.owner
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.cfg.block_size
    }

    /// Reorders the plain free list with a seeded shuffle, so that tests see
    /// physical blocks in scrambled order rather than 0, 1, 2, ...
    pub fn scramble_free_list(&mut self, seed: u64) {
        let mut rng = crate::rng::SplitMix64::new(seed);
        rng.shuffle(&mut self.free);
    }

    /// Blocks that can be taken now: plain free plus evictable cached blocks.
    pub fn available_blocks(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Number of live sequences (swapped out ones included).
    pub fn num_sequences(&self) -> usize {
        self.live
    }

    /// Ids of the live sequences, in slot order.
    pub fn sequence_ids(&self) -> Vec<SeqId> {
        self.seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.seq.is_some())
            .map(|(i, s)| SeqId::new(i as u32, s.generation, self.owner))
            .collect()
    }

    /// Whether `id` names a live sequence of this manager.
    pub fn contains(&self, id: SeqId) -> bool {
        self.seq(id).is_ok()
    }

    fn seq(&self, id: SeqId) -> Result<&Sequence, BlockError> {
        match self.seqs.get(id.index() as usize) {
            Some(SeqSlot {
                generation,
                seq: Some(s),
            }) if *generation == id.generation() && id.owner() == self.owner => Ok(s),
            _ => Err(BlockError::UnknownSequence(id)),
        }
    }

    /// A live sequence that is not swapped out.
    fn resident(&self, id: SeqId) -> Result<&Sequence, BlockError> {
        let s = self.seq(id)?;
        if s.swapped {
            return Err(BlockError::Swapped(id));
        }
        Ok(s)
    }

    fn seq_mut(&mut self, id: SeqId) -> &mut Sequence {
        self.seqs[id.index() as usize]
            .seq
            .as_mut()
            .expect("caller checked the id")
    }

    fn insert_seq(&mut self, s: Sequence) -> SeqId {
        self.live += 1;
        if let Some(i) = self.vacant.pop() {
            let slot = &mut self.seqs[i as usize];
            slot.seq = Some(s);
            return SeqId::new(i, slot.generation, self.owner);
        }
        self.seqs.push(SeqSlot {
            generation: 0,
            seq: Some(s),
        });
        SeqId::new(self.seqs.len() as u32 - 1, 0, self.owner)
    }

    fn remove_seq(&mut self, id: SeqId) -> Sequence {
        let slot = &mut self.seqs[id.index() as usize];
        let s = slot.seq.take().expect("caller checked the id");
        self.live -= 1;
        // A slot whose generation would wrap is retired, never reused.
        if slot.generation < u32::MAX {
            slot.generation += 1;
            self.vacant.push(id.index());
        }
        s
    }

    /// The block table of a sequence (logical block -> physical block).
    /// A swapped-out sequence has none (`BlockError::Swapped`).
    pub fn block_table(&self, id: SeqId) -> Result<&[u32], BlockError> {
        Ok(&self.resident(id)?.table)
    }

    /// Whether a sequence is swapped out.
    pub fn is_swapped(&self, id: SeqId) -> Result<bool, BlockError> {
        Ok(self.seq(id)?.swapped)
    }

    /// Free host swap blocks.
    pub fn swap_free_blocks(&self) -> usize {
        self.swap_free.len()
    }

    /// Tokens held by a sequence.
    pub fn seq_len(&self, id: SeqId) -> Result<usize, BlockError> {
        Ok(self.seq(id)?.tokens.len())
    }

    /// Token ids held by a sequence.
    pub fn tokens(&self, id: SeqId) -> Result<&[u32], BlockError> {
        Ok(&self.seq(id)?.tokens)
    }

    /// Tokens of a sequence whose K/V is not written yet: appended (or
    /// added) and not yet committed by a step.
    pub fn pending_tokens(&self, id: SeqId) -> Result<usize, BlockError> {
        Ok(self.seq(id)?.pending)
    }

    /// Reference count of a physical block (0 for free or evictable blocks).
    pub fn ref_count(&self, block: u32) -> Option<u32> {
        self.ref_counts.get(block as usize).copied()
    }

    /// Prompt tokens served from the prefix cache so far.
    pub fn prefix_hit_tokens(&self) -> u64 {
        self.prefix_hit_tokens
    }

    /// Slot of `pos` in a sequence: `block * block_size + pos % block_size`.
    pub fn slot(&self, id: SeqId, pos: usize) -> Result<u32, BlockError> {
        let s = self.resident(id)?;
        if pos >= s.tokens.len() {
            return Err(BlockError::PositionOutOfRange {
                pos,
                len: s.tokens.len(),
            });
        }
        if s.table[pos / self.cfg.block_size as usize] == RELEASED {
            return Err(BlockError::PositionReleased { pos });
        }
        Ok(self.slot_of(&s.table, pos))
    }

    fn slot_of(&self, table: &[u32], pos: usize) -> u32 {
        let bs = self.cfg.block_size as usize;
        table[pos / bs] * self.cfg.block_size + (pos % bs) as u32
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.block_size as usize)
    }

    /// Takes one block: a plain free one first, else the least recently
    /// released cached one (dropping it from the cache). Callers check
    /// availability first.
    fn take_block(&mut self) -> u32 {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self
                    .evictable
                    .pop_first()
                    .expect("caller checked availability");
                if let Some(h) = self.block_hash.remove(&b) {
                    self.cache.remove(&h);
                    self.event(KvEvent::Removed { hash: h, block: b });
                }
                b
            }
        };
        self.ref_counts[b as usize] = 1;
        b
    }

    fn retain(&mut self, b: u32) {
        let rc = &mut self.ref_counts[b as usize];
        if *rc == 0 {
            if let Some(k) = self.awaiting_copy.iter().position(|&x| x == b) {
                // A cached block revived before its pending copy ran: held
                // again, read-only, so it simply stays out of the free pools.
                self.awaiting_copy.swap_remove(k);
            } else {
                self.evictable.remove(&self.evict_key[b as usize]);
            }
        }
        *rc += 1;
    }

    /// Hands out the pending copies and frees the blocks they were the last to read.
    fn drain_copies(&mut self, into: &mut Vec<[u32; 2]>) {
        into.append(&mut self.copies);
        for b in std::mem::take(&mut self.awaiting_copy) {
            self.recycle(b);
        }
    }

    fn release(&mut self, b: u32) {
        let i = b as usize;
        self.ref_counts[i] -= 1;
        if self.ref_counts[i] > 0 {
            return;
        }
        // A copy into a block nobody holds any more is dead work, and the
        // block may be handed out again before the copy runs.
        if !self.copies.is_empty() {
            self.copies.retain(|c| c[1] != b);
            if self.copies.iter().any(|c| c[0] == b) {
                self.awaiting_copy.push(b);
                return;
            }
        }
        self.recycle(b);
    }

    /// Puts a block at ref count 0 back where it can be taken again.
    fn recycle(&mut self, b: u32) {
        let i = b as usize;
        if self.block_hash.contains_key(&b) {
            self.tick += 1;
            self.evict_key[i] = self.tick;
            self.evictable.insert(self.tick, b);
        } else {
            self.free.push(b);
        }
    }

    fn check_len(&self, requested: usize) -> Result<(), BlockError> {
        if requested > self.cfg.max_seq_len {
            return Err(BlockError::TooManyTokens {
                requested,
                limit: self.cfg.max_seq_len,
            });
        }
        Ok(())
    }

    /// Adds a sequence holding `prompt`. With prefix caching on, leading full
    /// blocks whose content and whole chain before them are cached are shared
    /// instead of allocated.
    pub fn add_sequence(&mut self, prompt: &[u32]) -> Result<SeqId, BlockError> {
        self.add_sequence_salted(prompt, &[])
    }

    /// Appends tokens to a sequence and returns each new token's slot.
    ///
    /// Fills the last block first and takes a new block only on overflow. If
    /// the last block is partly filled and shared (after a fork), the first
    /// write copies it to a fresh block (copy-on-write): the `(src, dst)` pair
    /// goes to the pending copy list.
    pub fn append(&mut self, id: SeqId, tokens: &[u32]) -> Result<Vec<u32>, BlockError> {
        let s = self.resident(id)?;
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let len = s.tokens.len();
        let new_len = len + tokens.len();
        self.check_len(new_len)?;
        let (grow, cow) = self.append_cost(s, tokens.len());
        let needed = grow + cow as usize;
        let available = self.available_blocks();
        if needed > available {
            return Err(BlockError::OutOfBlocks {
                needed,
                free: available,
            });
        }
        // Checks done; from here on nothing fails.
        self.epoch += 1;
        let mut s = std::mem::take(self.seq_mut(id));
        if cow {
            let old = *s.table.last().unwrap();
            let new = self.take_block();
            self.copies.push([old, new]);
            self.release(old);
            *s.table.last_mut().unwrap() = new;
        }
        for _ in 0..grow {
            let b = self.take_block();
            s.table.push(b);
        }
        s.tokens.extend_from_slice(tokens);
        s.pending += tokens.len();
        let slots = (len..new_len).map(|p| self.slot_of(&s.table, p)).collect();
        *self.seq_mut(id) = s;
        Ok(slots)
    }

    /// New blocks an append of `n` tokens takes, and whether the first of
    /// them is a copy-on-write of the shared last block.
    fn append_cost(&self, s: &Sequence, n: usize) -> (usize, bool) {
        if n == 0 {
            return (0, false);
        }
        let len = s.tokens.len();
        let bs = self.cfg.block_size as usize;
        let cow = !len.is_multiple_of(bs)
            && self.ref_counts[*s.table.last().expect("sequences hold a block") as usize] > 1;
        // Saturating: a count no sequence could reach gives a huge bound, not a panic.
        (self.blocks_for(len.saturating_add(n)) - s.table.len(), cow)
    }

    /// Blocks that appending `n` tokens to each of `seqs` would take at most,
    /// copy-on-write included (what a scheduler checks against
    /// [`available_blocks`](Self::available_blocks) before a step). Exact
    /// unless two of `seqs` share a partly filled last block: the second
    /// writer then finds it unshared, which this bound does not assume.
    /// Saturates at `usize::MAX` rather than overflowing for a huge `n`.
    pub fn blocks_needed_to_append(&self, seqs: &[SeqId], n: usize) -> Result<usize, BlockError> {
        let mut total = 0usize;
        for &id in seqs {
            let (grow, cow) = self.append_cost(self.resident(id)?, n);
            total = total.saturating_add(grow).saturating_add(cow as usize);
        }
        Ok(total)
    }

    /// Sliding-window attention never reads a position more than `window - 1`
    /// before the newest one: drops this sequence's references to blocks that
    /// lie wholly before the window of its oldest query still to run (its
    /// first pending token: a prompt chunk's first query reads `window - 1`
    /// positions back), leaving
    /// [`RELEASED`] in their table entries, which the kernels skip. Returns
    /// how many entries were released.
    pub fn release_outside_window(
        &mut self,
        id: SeqId,
        window: usize,
    ) -> Result<usize, BlockError> {
        self.release_outside_sinks_and_window(id, 0, window)
    }

    /// StreamingLLM: attention that sees the first `sink_tokens` positions
    /// beside a sliding window (`AttnOptions::sink_tokens`) never reads the
    /// blocks between them. Drops this sequence's references to the blocks
    /// that lie wholly after its sink tokens and before the window of its
    /// first pending token, leaving [`RELEASED`] in their table entries: the
    /// table keeps its length, so every position stays where it was, and
    /// the kernels skip the released middle. Returns how many entries were
    /// released. `sink_tokens` 0 is [`Self::release_outside_window`].
    pub fn release_outside_sinks_and_window(
        &mut self,
        id: SeqId,
        sink_tokens: usize,
        window: usize,
    ) -> Result<usize, BlockError> {
        let s = self.resident(id)?;
        if window == 0 {
            return Err(BlockError::ZeroWindow);
        }
        let bs = self.cfg.block_size as usize;
        // The oldest query still to run is the first pending token (the
        // next one appended when none is pending, which reads one position
        // less far back: kept as well); its window starts `window - 1`
        // before it.
        let keep_from = (s.tokens.len() - s.pending.saturating_sub(1)).saturating_sub(window);
        let dead = keep_from / bs;
        // The blocks holding a sink token stay.
        let first = sink_tokens.div_ceil(bs).min(dead);
        let victims: Vec<(usize, u32)> = s.table[first..dead]
            .iter()
            .enumerate()
            .filter(|(_, &b)| b != RELEASED)
            .map(|(i, &b)| (first + i, b))
            .collect();
        if !victims.is_empty() {
            self.epoch += 1;
        }
        for &(i, b) in &victims {
            self.release(b);
            self.seq_mut(id).table[i] = RELEASED;
        }
        Ok(victims.len())
    }

    /// Forks a sequence: the child shares every block of the parent.
    ///
    /// The parent's newest tokens must have been taken by a batch view first
    /// (their K/V written), otherwise a later copy-on-write could copy a block
    /// before those tokens reach it.
    pub fn fork(&mut self, parent: SeqId) -> Result<SeqId, BlockError> {
        let s = self.resident(parent)?;
        if s.pending > 0 {
            return Err(BlockError::PendingTokens {
                seq: parent,
                pending: s.pending,
            });
        }
        let child = s.clone();
        for &b in child.table.iter().filter(|&&b| b != RELEASED) {
            self.retain(b);
        }
        self.epoch += 1;
        Ok(self.insert_seq(child))
    }

    /// Frees a sequence; each of its blocks loses one reference and returns
    /// to the pool at zero (to the evictable cache if it holds a cached block).
    pub fn free(&mut self, id: SeqId) -> Result<(), BlockError> {
        self.seq(id)?;
        self.epoch += 1;
        self.event(KvEvent::SequenceEnded { seq: id });
        let s = self.remove_seq(id);
        if s.swapped {
            for &h in s.table.iter().filter(|&&b| b != RELEASED) {
                self.release_swap(h);
            }
            return Ok(());
        }
        // Tail blocks first: they become the oldest evictable entries, so a
        // chain's prefix outlives its suffix in the cache.
        for &b in s.table.iter().rev().filter(|&&b| b != RELEASED) {
            self.release(b);
        }
        Ok(())
    }

    /// Takes the pending copy-on-write list `(src, dst)`. Apply it to the
    /// pool before writing the next tokens' K/V.
    pub fn take_copies(&mut self) -> Vec<[u32; 2]> {
        let mut out = Vec::new();
        if !self.copies.is_empty() || !self.awaiting_copy.is_empty() {
            self.epoch += 1;
        }
        self.drain_copies(&mut out);
        out
    }

    /// Pending copies, without taking them.
    pub fn pending_copies(&self) -> &[[u32; 2]] {
        &self.copies
    }

    /// Counts of the pool's state.
    pub fn stats(&self) -> BlockStats {
        let bs = self.cfg.block_size as usize;
        let mut filled = vec![0u32; self.ref_counts.len()];
        let mut logical_tokens = 0usize;
        let mut swapped_sequences = 0;
        for s in self.seqs.iter().filter_map(|s| s.seq.as_ref()) {
            if s.swapped {
                swapped_sequences += 1;
                continue;
            }
            let len = s.tokens.len();
            logical_tokens += len;
            for (i, &b) in s.table.iter().enumerate().filter(|(_, &b)| b != RELEASED) {
                let f = (len - i * bs).min(bs) as u32;
                let slot = &mut filled[b as usize];
                *slot = (*slot).max(f);
            }
        }
        let used = self.ref_counts.iter().filter(|&&r| r > 0).count();
        BlockStats {
            total: self.ref_counts.len(),
            free: self.free.len(),
            evictable: self.evictable.len(),
            used,
            shared: self.ref_counts.iter().filter(|&&r| r > 1).count(),
            sequences: self.live,
            tokens_stored: filled.iter().map(|&f| f as usize).sum(),
            logical_tokens,
            capacity_held: used * bs,
            pending_copies: self.copies.len(),
            awaiting_copy: self.awaiting_copy.len(),
            swapped_sequences,
            swap_used: self.swap_refs.len() - self.swap_free.len(),
            swap_total: self.swap_refs.len(),
        }
    }
}
