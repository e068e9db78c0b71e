//! The block manager: sequences, block tables, reference counts,
//! copy-on-write and prefix caching over one physical pool.

use std::collections::{BTreeMap, HashMap, HashSet};

use sha2::{Digest as _, Sha256};

use super::{BatchView, BlockError, BlockStats, SeqId, RELEASED};

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
        }
    }

    /// The same with prefix caching switched on or off.
    pub fn with_prefix_caching(mut self, on: bool) -> Self {
        self.prefix_caching = on;
        self
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Sequence {
    /// Logical block i -> physical block id.
    table: Vec<u32>,
    /// Token ids, kept for the prefix-cache hash chain.
    tokens: Vec<u32>,
    /// Tokens at the end of `tokens` not yet taken by a batch view.
    pending: usize,
    /// Digest chain of the leading full blocks already offered to the cache.
    hashes: Vec<ChainDigest>,
    /// Root of the chain: the digest of the sequence's cache salt.
    root: ChainDigest,
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
    seqs: HashMap<u64, Sequence>,
    next_seq: u64,
    copies: Vec<[u32; 2]>,
    /// Blocks released to ref count 0 while a pending copy still reads them:
    /// held back from reuse until the copies are handed out, because one
    /// copy_blocks dispatch runs all pairs at once and a block must not be
    /// a source and a destination in the same list.
    awaiting_copy: Vec<u32>,
    prefix_hit_tokens: u64,
}

/// Root of a digest chain: the cache salt (namespace), domain-separated.
/// The empty salt is the default namespace.
fn chain_root(salt: &[u8]) -> ChainDigest {
    let mut h = Sha256::new();
    h.update(b"pagedattn prefix cache v1 root");
    h.update((salt.len() as u64).to_le_bytes());
    h.update(salt);
    h.finalize().into()
}

/// Digest of a full block given its parent's digest: SHA-256 over the
/// parent's digest and the block's token ids (little-endian). A cache hit
/// therefore means equal tokens, an equal chain before them and an equal
/// salt, short of a SHA-256 collision; unlike a fast 64-bit mix, nobody can
/// search for two prompts that share a key.
fn chain_hash(parent: &ChainDigest, tokens: &[u32]) -> ChainDigest {
    let mut h = Sha256::new();
    h.update(parent);
    let mut buf = [0u8; 256];
    for chunk in tokens.chunks(64) {
        for (i, t) in chunk.iter().enumerate() {
            buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    h.finalize().into()
}

impl BlockManager {
    /// A manager over an empty pool.
    pub fn new(cfg: BlockManagerConfig) -> Result<Self, BlockError> {
        let bs = cfg.block_size;
        if !(1..=256).contains(&bs) || !bs.is_power_of_two() {
            return Err(BlockError::BadBlockSize(bs));
        }
        let max = (u32::MAX / bs).min(MAX_BLOCKS);
        if cfg.num_blocks == 0 || cfg.num_blocks > max {
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
            seqs: HashMap::new(),
            next_seq: 0,
            copies: Vec::new(),
            awaiting_copy: Vec::new(),
            prefix_hit_tokens: 0,
        })
    }

    /// The configuration this manager was built with.
    pub fn config(&self) -> &BlockManagerConfig {
        &self.cfg
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

    /// Number of live sequences.
    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Ids of the live sequences, in ascending order.
    pub fn sequence_ids(&self) -> Vec<SeqId> {
        let mut ids: Vec<SeqId> = self.seqs.keys().map(|&k| SeqId(k)).collect();
        ids.sort();
        ids
    }

    fn seq(&self, id: SeqId) -> Result<&Sequence, BlockError> {
        self.seqs.get(&id.0).ok_or(BlockError::UnknownSequence(id))
    }

    /// The block table of a sequence (logical block -> physical block).
    pub fn block_table(&self, id: SeqId) -> Result<&[u32], BlockError> {
        Ok(&self.seq(id)?.table)
    }

    /// Tokens held by a sequence.
    pub fn seq_len(&self, id: SeqId) -> Result<usize, BlockError> {
        Ok(self.seq(id)?.tokens.len())
    }

    /// Token ids held by a sequence.
    pub fn tokens(&self, id: SeqId) -> Result<&[u32], BlockError> {
        Ok(&self.seq(id)?.tokens)
    }

    /// Tokens appended to a sequence since its last batch view.
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
        let s = self.seq(id)?;
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

    /// [`add_sequence`](Self::add_sequence) in a prefix-cache namespace:
    /// blocks are shared only between prompts with the same `cache_salt`
    /// (and equal tokens). An engine gives each tenant, or each LoRA
    /// adapter, its own salt so that equal prompts of different tenants
    /// never share KV. The empty salt is the namespace of `add_sequence`.
    /// Forks inherit their parent's namespace.
    pub fn add_sequence_salted(
        &mut self,
        prompt: &[u32],
        cache_salt: &[u8],
    ) -> Result<SeqId, BlockError> {
        if prompt.is_empty() {
            return Err(BlockError::EmptyPrompt);
        }
        self.check_len(prompt.len())?;
        let bs = self.cfg.block_size as usize;
        let root = chain_root(cache_salt);
        let mut matched = Vec::new();
        let mut hashes = Vec::new();
        if self.cfg.prefix_caching {
            let mut h = root;
            for chunk in prompt.chunks_exact(bs) {
                h = chain_hash(&h, chunk);
                match self.cache.get(&h) {
                    Some(&b) => {
                        matched.push(b);
                        hashes.push(h);
                    }
                    None => break,
                }
            }
        }
        let n_blocks = self.blocks_for(prompt.len());
        let needed = n_blocks - matched.len();
        let revived = matched
            .iter()
            .filter(|&&b| self.ref_counts[b as usize] == 0 && !self.awaiting_copy.contains(&b))
            .count();
        let available = self.available_blocks() - revived;
        if needed > available {
            return Err(BlockError::OutOfBlocks {
                needed,
                free: available,
            });
        }
        for &b in &matched {
            self.retain(b);
        }
        let mut table = matched;
        let cached_tokens = table.len() * bs;
        self.prefix_hit_tokens += cached_tokens as u64;
        for _ in 0..needed {
            let b = self.take_block();
            table.push(b);
        }
        let id = self.next_seq;
        self.next_seq += 1;
        self.seqs.insert(
            id,
            Sequence {
                table,
                tokens: prompt.to_vec(),
                pending: prompt.len() - cached_tokens,
                hashes,
                root,
            },
        );
        Ok(SeqId(id))
    }

    /// Appends tokens to a sequence and returns each new token's slot.
    ///
    /// Fills the last block first and takes a new block only on overflow. If
    /// the last block is partly filled and shared (after a fork), the first
    /// write copies it to a fresh block (copy-on-write): the `(src, dst)` pair
    /// goes to the pending copy list.
    pub fn append(&mut self, id: SeqId, tokens: &[u32]) -> Result<Vec<u32>, BlockError> {
        let s = self.seq(id)?;
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
        let mut s = self.seqs.remove(&id.0).expect("checked above");
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
        self.seqs.insert(id.0, s);
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
            let (grow, cow) = self.append_cost(self.seq(id)?, n);
            total = total.saturating_add(grow).saturating_add(cow as usize);
        }
        Ok(total)
    }

    /// Sliding-window attention never reads a position more than `window - 1`
    /// before the newest one: drops this sequence's references to blocks that
    /// lie wholly before its window (and before its pending tokens), leaving
    /// [`RELEASED`] in their table entries, which the kernels skip. Returns
    /// how many entries were released.
    pub fn release_outside_window(
        &mut self,
        id: SeqId,
        window: usize,
    ) -> Result<usize, BlockError> {
        let s = self.seq(id)?;
        if window == 0 {
            return Err(BlockError::ZeroWindow);
        }
        let bs = self.cfg.block_size as usize;
        let keep_from = s.tokens.len().saturating_sub(window.max(s.pending));
        let dead = keep_from / bs;
        let victims: Vec<(usize, u32)> = s.table[..dead]
            .iter()
            .enumerate()
            .filter(|(_, &b)| b != RELEASED)
            .map(|(i, &b)| (i, b))
            .collect();
        for &(i, b) in &victims {
            self.release(b);
            self.seqs.get_mut(&id.0).expect("checked above").table[i] = RELEASED;
        }
        Ok(victims.len())
    }

    /// Forks a sequence: the child shares every block of the parent.
    ///
    /// The parent's newest tokens must have been taken by a batch view first
    /// (their K/V written), otherwise a later copy-on-write could copy a block
    /// before those tokens reach it.
    pub fn fork(&mut self, parent: SeqId) -> Result<SeqId, BlockError> {
        let s = self.seq(parent)?;
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
        let id = self.next_seq;
        self.next_seq += 1;
        self.seqs.insert(id, child);
        Ok(SeqId(id))
    }

    /// Frees a sequence; each of its blocks loses one reference and returns
    /// to the pool at zero (to the evictable cache if it holds a cached block).
    pub fn free(&mut self, id: SeqId) -> Result<(), BlockError> {
        let s = self
            .seqs
            .remove(&id.0)
            .ok_or(BlockError::UnknownSequence(id))?;
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
        self.drain_copies(&mut out);
        out
    }

    /// Pending copies, without taking them.
    pub fn pending_copies(&self) -> &[[u32; 2]] {
        &self.copies
    }

    /// Drops every evictable cached block back to the plain free list.
    /// Returns how many were dropped.
    pub fn evict_all_cached(&mut self) -> usize {
        let n = self.evictable.len();
        while let Some((_, b)) = self.evictable.pop_first() {
            if let Some(h) = self.block_hash.remove(&b) {
                self.cache.remove(&h);
            }
            self.free.push(b);
        }
        n
    }

    /// Builds the GPU view of a batch: block tables in CSR form, the slot
    /// mapping of every token appended since each sequence's last view, and
    /// all pending copies (which must run before the writes).
    ///
    /// Taking the view marks those tokens as handed to the GPU: with prefix
    /// caching on, blocks they fill become reusable by later prompts.
    pub fn batch_view(&mut self, seqs: &[SeqId]) -> Result<BatchView, BlockError> {
        let mut view = BatchView::default();
        self.batch_view_into(seqs, &mut view)?;
        Ok(view)
    }

    /// [`batch_view`](Self::batch_view) into a reused [`BatchView`] (its
    /// vectors keep their capacity; only the duplicate check allocates).
    pub fn batch_view_into(
        &mut self,
        seqs: &[SeqId],
        view: &mut BatchView,
    ) -> Result<(), BlockError> {
        for &id in seqs {
            self.seq(id)?;
        }
        if seqs.len() > 1 {
            let mut seen = HashSet::with_capacity(seqs.len());
            for &id in seqs {
                if !seen.insert(id.0) {
                    return Err(BlockError::DuplicateInBatch(id));
                }
            }
        }
        view.clear();
        view.kv_indptr.push(0);
        view.new_indptr.push(0);
        for &id in seqs {
            let s = self.seqs.get(&id.0).expect("checked above");
            view.kv_indices.extend_from_slice(&s.table);
            view.kv_indptr.push(view.kv_indices.len() as u32);
            view.seq_lens.push(s.tokens.len() as u32);
            let len = s.tokens.len();
            for p in len - s.pending..len {
                view.slot_mapping.push(self.slot_of(&s.table, p));
            }
            view.new_indptr.push(view.slot_mapping.len() as u32);
        }
        self.drain_copies(&mut view.copies);
        for &id in seqs {
            self.register_full_blocks(id);
        }
        Ok(())
    }

    fn register_full_blocks(&mut self, id: SeqId) {
        let prefix = self.cfg.prefix_caching;
        let bs = self.cfg.block_size as usize;
        let s = self.seqs.get_mut(&id.0).expect("caller checked");
        s.pending = 0;
        if !prefix {
            return;
        }
        let full = s.tokens.len() / bs;
        while s.hashes.len() < full {
            let i = s.hashes.len();
            let parent = s.hashes.last().unwrap_or(&s.root);
            let h = chain_hash(parent, &s.tokens[i * bs..(i + 1) * bs]);
            s.hashes.push(h);
            let b = s.table[i];
            if b != RELEASED && !self.block_hash.contains_key(&b) {
                if let std::collections::hash_map::Entry::Vacant(e) = self.cache.entry(h) {
                    e.insert(b);
                    self.block_hash.insert(b, h);
                }
            }
        }
    }

    /// Counts of the pool's state.
    pub fn stats(&self) -> BlockStats {
        let bs = self.cfg.block_size as usize;
        let mut filled = vec![0u32; self.ref_counts.len()];
        let mut logical_tokens = 0usize;
        for s in self.seqs.values() {
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
            sequences: self.seqs.len(),
            tokens_stored: filled.iter().map(|&f| f as usize).sum(),
            logical_tokens,
            capacity_held: used * bs,
            pending_copies: self.copies.len(),
            awaiting_copy: self.awaiting_copy.len(),
        }
    }
}
