//! The block manager: sequences, block tables, reference counts,
//! copy-on-write and prefix caching over one physical pool.

use std::collections::{BTreeMap, HashMap, HashSet};

use sha2::{Digest as _, Sha256};

use std::sync::atomic::{AtomicU32, Ordering};

use super::{BatchView, BlockError, BlockStats, SeqId, RELEASED, SKIP_WRITE};

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

/// One step's work, planned by [`BlockManager::plan_step`] without changing
/// anything, and applied by [`BlockManager::commit_step`] once the GPU work
/// is encoded. [`view`](Self::view) is what the GPU needs.
///
/// Its contents are read-only: a plan can only come from the manager, and
/// [`commit_step`](BlockManager::commit_step) applies exactly what it
/// planned. An edited plan cannot be written:
///
/// ```compile_fail
/// # use pagedattn::blocks::{BlockManager, BlockManagerConfig};
/// let mut m = BlockManager::new(BlockManagerConfig::new(8, 4)).unwrap();
/// let a = m.add_sequence(&[1, 2, 3]).unwrap();
/// let mut plan = m.plan_step(&[(a, 8)]).unwrap();
/// plan.chunks[0] += 1; // private: does not compile
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    view: BatchView,
    chunks: Vec<usize>,
    completes: Vec<bool>,
    ids: Vec<SeqId>,
    epoch: u64,
    owner: u32,
}

impl StepPlan {
    /// Tables, lengths (up to the end of each chunk), the chunk tokens'
    /// slots and the pending copy-on-write pairs, in the order asked for.
    pub fn view(&self) -> &BatchView {
        &self.view
    }

    /// Tokens of each sequence in this step (its chunk).
    pub fn chunks(&self) -> &[usize] {
        &self.chunks
    }

    /// Whether each sequence's chunk reaches its newest token, so that the
    /// step computes its next-token logits.
    pub fn completes(&self) -> &[bool] {
        &self.completes
    }

    /// The sequences of the step, in the order asked for.
    pub fn seqs(&self) -> &[SeqId] {
        &self.ids
    }

    /// Takes the view out (the plan keeps empty vectors and can no longer
    /// be committed).
    pub fn into_view(self) -> BatchView {
        self.view
    }
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
        self.add_sequence_with_remote(prompt, cache_salt, 0)
            .map(|(id, _)| id)
    }

    /// The chain digests of `prompt`'s full blocks in `cache_salt`'s
    /// namespace, in order: the keys to ask a remote prefix store for (one
    /// tenant's salt never yields another's digests).
    pub fn prompt_hashes(&self, prompt: &[u32], cache_salt: &[u8]) -> Vec<[u8; 32]> {
        let mut h = chain_root(cache_salt);
        prompt
            .chunks_exact(self.cfg.block_size as usize)
            .map(|chunk| {
                h = chain_hash(&h, chunk);
                h
            })
            .collect()
    }

    /// [`add_sequence_salted`](Self::add_sequence_salted), with the
    /// prompt's first `remote` full blocks held by a remote prefix store
    /// (the leading digests of [`prompt_hashes`](Self::prompt_hashes) it
    /// holds; more than the prompt has are cut). Those the local cache
    /// lacks get fresh blocks, returned in order as `(block, digest)`: the
    /// last `len` of the `remote` (the local hits come first):
    /// import their K/V (`KvCache::import_blocks`) before the sequence's
    /// first step; their tokens are not computed again, and the blocks
    /// join the local prefix cache. Should an import fail, [`uncache`](Self::uncache)
    /// the blocks and free the sequence, then add it again without them.
    /// Needs prefix caching on when `remote > 0`.
    pub fn add_sequence_with_remote(
        &mut self,
        prompt: &[u32],
        cache_salt: &[u8],
        remote: usize,
    ) -> Result<(SeqId, Vec<RemoteBlock>), BlockError> {
        if prompt.is_empty() {
            return Err(BlockError::EmptyPrompt);
        }
        self.check_len(prompt.len())?;
        if remote > 0 && !self.cfg.prefix_caching {
            return Err(BlockError::PrefixCachingOff);
        }
        let root = chain_root(cache_salt);
        let (matched, mut hashes) = self.lookup(prompt, &root);
        // The whole chain only when a store holds blocks past the local hits.
        let remote_hashes: Vec<ChainDigest> = if remote > matched.len() {
            let all = self.prompt_hashes(prompt, cache_salt);
            all.get(matched.len()..remote.min(all.len()))
                .unwrap_or_default()
                .to_vec()
        } else {
            Vec::new()
        };
        let needed = self.blocks_for(prompt.len()) - matched.len();
        let revived = self.revived(&matched);
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
        let local_tokens = table.len() * self.cfg.block_size as usize;
        let mut imports = Vec::with_capacity(remote_hashes.len());
        // The imported blocks are not cached yet: they join the cache when
        // the step that imports them commits (`register_full_blocks`), so a
        // failed import leaves no other sequence on an unwritten block.
        for &h in &remote_hashes {
            let b = self.take_block();
            table.push(b);
            hashes.push(h);
            imports.push((b, h));
        }
        let imported = table.len() - imports.len()..table.len();
        let cached_tokens = table.len() * self.cfg.block_size as usize;
        let remote_tokens = cached_tokens - local_tokens;
        self.remote_hit_tokens += remote_tokens as u64;
        // The cache-hit cap: a prompt cached to its last token still
        // computes that token (its logits start the decode). Its K/V is in
        // the shared block already, so the step skips the write
        // (SKIP_WRITE) and the block stays shared.
        let skip_first = cached_tokens == prompt.len();
        let pending = (prompt.len() - cached_tokens).max(1);
        self.prefix_hit_tokens += (prompt.len() - pending).saturating_sub(remote_tokens) as u64;
        for _ in 0..needed - imports.len() {
            let b = self.take_block();
            table.push(b);
        }
        self.epoch += 1;
        let id = self.insert_seq(Sequence {
            table,
            tokens: prompt.to_vec(),
            pending,
            skip_first,
            swapped: false,
            hashes,
            root,
            imported,
        });
        Ok((id, imports))
    }

    /// Drops `blocks` from the prefix cache (a failed import's: their
    /// contents are not what their digests say); whoever holds them keeps
    /// them. Blocks not cached are passed over. Returns how many were
    /// dropped.
    pub fn uncache(&mut self, blocks: &[u32]) -> usize {
        let mut n = 0;
        for b in blocks {
            if let Some(h) = self.block_hash.remove(b) {
                self.cache.remove(&h);
                self.event(KvEvent::Removed { hash: h, block: *b });
                n += 1;
            }
        }
        if n > 0 {
            self.epoch += 1;
        }
        n
    }

    /// Holds a reference to each of `blocks` (held by a sequence, or
    /// cached), so none is reused while an export of it runs, even if its
    /// sequences end; [`unpin_blocks`](Self::unpin_blocks) drops them. A
    /// block that holds nothing (plain free) or is outside the pool is
    /// refused, and nothing changes.
    pub fn pin_blocks(&mut self, blocks: &[u32]) -> Result<(), BlockError> {
        for &b in blocks {
            let held = self.ref_counts.get(b as usize).is_some_and(|&r| r > 0);
            if !held && !self.block_hash.contains_key(&b) {
                return Err(BlockError::NotPinnable { block: b });
            }
        }
        for &b in blocks {
            self.retain(b);
            *self.pins.entry(b).or_insert(0) += 1;
        }
        Ok(())
    }

    /// Drops references [`pin_blocks`](Self::pin_blocks) took (one per
    /// occurrence). A block not pinned that many times is refused, and
    /// nothing changes.
    pub fn unpin_blocks(&mut self, blocks: &[u32]) -> Result<(), BlockError> {
        let mut need: HashMap<u32, u32> = HashMap::new();
        for &b in blocks {
            *need.entry(b).or_insert(0) += 1;
        }
        for (&b, &n) in &need {
            if self.pins.get(&b).copied().unwrap_or(0) < n {
                return Err(BlockError::NotPinned { block: b });
            }
        }
        for &b in blocks {
            let p = self.pins.get_mut(&b).expect("checked");
            *p -= 1;
            if *p == 0 {
                self.pins.remove(&b);
            }
            self.release(b);
        }
        Ok(())
    }

    /// Records [`KvEvent`]s from now on (`on`), or stops and drops them.
    pub fn record_events(&mut self, on: bool) {
        self.events = on.then(Vec::new);
    }

    /// The events since the last call (empty unless recording).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn event(&mut self, e: KvEvent) {
        if let Some(ev) = self.events.as_mut() {
            ev.push(e);
        }
    }

    /// Prompt tokens whose blocks a remote store supplied
    /// ([`add_sequence_with_remote`](Self::add_sequence_with_remote)).
    pub fn remote_hit_tokens(&self) -> u64 {
        self.remote_hit_tokens
    }

    /// Cached blocks matching the leading full blocks of `prompt`, with
    /// their chain digests.
    fn lookup(&self, prompt: &[u32], root: &ChainDigest) -> (Vec<u32>, Vec<ChainDigest>) {
        let mut matched = Vec::new();
        let mut hashes = Vec::new();
        if self.cfg.prefix_caching {
            let mut h = *root;
            for chunk in prompt.chunks_exact(self.cfg.block_size as usize) {
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
        (matched, hashes)
    }

    /// Of `matched` cached blocks, those a new reference takes out of the
    /// evictable pool.
    fn revived(&self, matched: &[u32]) -> usize {
        matched
            .iter()
            .filter(|&&b| self.ref_counts[b as usize] == 0 && !self.awaiting_copy.contains(&b))
            .count()
    }

    /// Blocks [`add_sequence_salted`](Self::add_sequence_salted) would take
    /// from the pool for `prompt` now (prefix-cache hits not counted, cached
    /// blocks it would revive counted), without changing anything: what a
    /// scheduler checks before admitting a request.
    pub fn blocks_to_add(&self, prompt: &[u32], cache_salt: &[u8]) -> usize {
        let (matched, _) = self.lookup(prompt, &chain_root(cache_salt));
        self.blocks_for(prompt.len()) - matched.len() + self.revived(&matched)
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
    /// lie wholly before its window (and before its pending tokens), leaving
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
    /// that lie wholly after its sink tokens and before its window (and its
    /// pending tokens), leaving [`RELEASED`] in their table entries: the
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
        let keep_from = s.tokens.len().saturating_sub(window.max(s.pending));
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

    /// Drops every evictable cached block back to the plain free list.
    /// Returns how many were dropped.
    pub fn evict_all_cached(&mut self) -> usize {
        let n = self.evictable.len();
        if n > 0 {
            self.epoch += 1;
        }
        while let Some((_, b)) = self.evictable.pop_first() {
            if let Some(h) = self.block_hash.remove(&b) {
                self.cache.remove(&h);
                self.event(KvEvent::Removed { hash: h, block: b });
            }
            self.free.push(b);
        }
        n
    }

    /// Plans one step without changing anything: for each `(sequence,
    /// budget)`, a chunk of up to `budget` of its pending tokens (oldest
    /// first), so a long prompt reaches the GPU in chunks (chunked
    /// prefill). The plan's view holds the block tables, each sequence's
    /// length up to the end of its chunk, the chunk tokens' slots and the
    /// pending copy-on-write pairs (to apply before the writes).
    ///
    /// Nothing changes until [`commit_step`](Self::commit_step): encode the
    /// GPU work from `plan.view`, then commit. Errors: an unknown or
    /// swapped-out sequence, or one named twice.
    pub fn plan_step(&self, batch: &[(SeqId, usize)]) -> Result<StepPlan, BlockError> {
        let mut plan = StepPlan::default();
        self.plan_step_into(batch, &mut plan)?;
        Ok(plan)
    }

    /// [`plan_step`](Self::plan_step) into a reused plan (its vectors keep
    /// their capacity).
    pub fn plan_step_into(
        &self,
        batch: &[(SeqId, usize)],
        plan: &mut StepPlan,
    ) -> Result<(), BlockError> {
        for &(id, _) in batch {
            self.resident(id)?;
        }
        if batch.len() > 1 {
            let mut seen = HashSet::with_capacity(batch.len());
            for &(id, _) in batch {
                if !seen.insert(id) {
                    return Err(BlockError::DuplicateInBatch(id));
                }
            }
        }
        let view = &mut plan.view;
        view.clear();
        plan.chunks.clear();
        plan.completes.clear();
        plan.ids.clear();
        plan.epoch = self.epoch;
        plan.owner = self.owner;
        view.kv_indptr.push(0);
        view.new_indptr.push(0);
        for &(id, budget) in batch {
            let s = self.resident(id).expect("checked above");
            let len = s.tokens.len();
            let first = len - s.pending;
            let chunk = s.pending.min(budget);
            let end = first + chunk;
            // Only the blocks the chunk's attention reads.
            let blocks = self.blocks_for(end).min(s.table.len());
            view.kv_indices.extend_from_slice(&s.table[..blocks]);
            view.kv_indptr.push(view.kv_indices.len() as u32);
            view.seq_lens.push(end as u32);
            for p in first..end {
                view.slot_mapping.push(if p == first && s.skip_first {
                    SKIP_WRITE
                } else {
                    self.slot_of(&s.table, p)
                });
            }
            view.new_indptr.push(view.slot_mapping.len() as u32);
            plan.chunks.push(chunk);
            plan.completes.push(chunk == s.pending);
            plan.ids.push(id);
        }
        view.copies.extend_from_slice(&self.copies);
        Ok(())
    }

    /// Commits a planned step once its GPU work is encoded: the chunks'
    /// tokens count as written (with prefix caching on, the full blocks
    /// they complete become reusable by later prompts), and the pending
    /// copy-on-write pairs, which the plan handed on, are dropped (blocks
    /// only they still read go back to the pool). Refused with
    /// `BlockError::StalePlan` if the manager changed after the plan.
    pub fn commit_step(&mut self, plan: &StepPlan) -> Result<(), BlockError> {
        if plan.epoch != self.epoch || plan.owner != self.owner {
            return Err(BlockError::StalePlan);
        }
        // A plan comes only from `plan_step` on this state (its fields are
        // private, and the epoch moved on otherwise), so what follows holds
        // by construction; it is checked anyway, before anything changes,
        // so that no plan can ever wrap a count.
        if plan.ids.len() != plan.chunks.len() {
            return Err(BlockError::StalePlan);
        }
        for (&id, &chunk) in plan.ids.iter().zip(&plan.chunks) {
            match self.resident(id) {
                Ok(s) if chunk <= s.pending => {}
                _ => return Err(BlockError::StalePlan),
            }
        }
        self.epoch += 1;
        let mut sink = Vec::new();
        self.drain_copies(&mut sink);
        for (&id, &chunk) in plan.ids.iter().zip(&plan.chunks) {
            let s = self.seq_mut(id);
            if chunk > 0 {
                s.skip_first = false;
            }
            s.pending -= chunk;
            self.register_full_blocks(id);
        }
        Ok(())
    }

    /// Plans and commits a step that hands every pending token of `seqs`
    /// to the GPU at once: [`plan_step`](Self::plan_step) with no budget,
    /// then [`commit_step`](Self::commit_step). Returns the plan's view.
    pub fn batch_view(&mut self, seqs: &[SeqId]) -> Result<BatchView, BlockError> {
        let mut view = BatchView::default();
        self.batch_view_into(seqs, &mut view)?;
        Ok(view)
    }

    /// [`batch_view`](Self::batch_view) into a reused [`BatchView`] (its
    /// vectors keep their capacity).
    pub fn batch_view_into(
        &mut self,
        seqs: &[SeqId],
        view: &mut BatchView,
    ) -> Result<(), BlockError> {
        let batch: Vec<(SeqId, usize)> = seqs.iter().map(|&id| (id, usize::MAX)).collect();
        let mut plan = StepPlan {
            view: std::mem::take(view),
            ..Default::default()
        };
        let r = self
            .plan_step_into(&batch, &mut plan)
            .and_then(|()| self.commit_step(&plan));
        *view = plan.view;
        r
    }

    fn register_full_blocks(&mut self, id: SeqId) {
        let prefix = self.cfg.prefix_caching;
        let bs = self.cfg.block_size as usize;
        let s = self.seqs[id.index() as usize]
            .seq
            .as_mut()
            .expect("caller checked");
        if !prefix {
            return;
        }
        // Imported blocks first: the step that wrote them committed. A
        // block of the chain may be cached here already (past a gap): the
        // cached one stays.
        for i in std::mem::take(&mut s.imported) {
            let (b, h) = (s.table[i], s.hashes[i]);
            if b != RELEASED && !self.block_hash.contains_key(&b) {
                if let std::collections::hash_map::Entry::Vacant(e) = self.cache.entry(h) {
                    e.insert(b);
                    self.block_hash.insert(b, h);
                    if let Some(ev) = self.events.as_mut() {
                        ev.push(KvEvent::Stored { hash: h, block: b });
                    }
                }
            }
        }
        let full = (s.tokens.len() - s.pending) / bs;
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
                    if let Some(ev) = self.events.as_mut() {
                        ev.push(KvEvent::Stored { hash: h, block: b });
                    }
                }
            }
        }
    }

    /// Swaps a sequence group (all the samples or beams of a request) out
    /// to host swap space: every distinct block the group holds (a block
    /// shared inside the group counted once) gets a host block, and the
    /// group's references to the pool blocks are dropped. Returns the
    /// copies `(pool block, host block)` to run before the pool blocks are
    /// reused (`KvCache::swap_out`). Sharing inside the group survives the
    /// round trip; a sequence's pending tokens stay pending.
    ///
    /// Errors, leaving everything unchanged: an unknown, swapped-out or
    /// repeated sequence; pending copy-on-write copies
    /// (`BlockError::CopiesPending`: take them first); too little swap space.
    pub fn swap_out(&mut self, group: &[SeqId]) -> Result<Vec<[u32; 2]>, BlockError> {
        self.check_group(group, false)?;
        if !self.copies.is_empty() {
            return Err(BlockError::CopiesPending(self.copies.len()));
        }
        let mut distinct: Vec<u32> = Vec::new();
        let mut seen = HashSet::new();
        for &id in group {
            for &b in &self.seq(id)?.table {
                if b != RELEASED && seen.insert(b) {
                    distinct.push(b);
                }
            }
        }
        if distinct.len() > self.swap_free.len() {
            return Err(BlockError::SwapSpaceFull {
                needed: distinct.len(),
                free: self.swap_free.len(),
            });
        }
        self.epoch += 1;
        let mut map = HashMap::with_capacity(distinct.len());
        let mut pairs = Vec::with_capacity(distinct.len());
        for &b in &distinct {
            let h = self.swap_free.pop().expect("checked above");
            map.insert(b, h);
            pairs.push([b, h]);
        }
        for &id in group {
            let table = std::mem::take(&mut self.seq_mut(id).table);
            let mut host = Vec::with_capacity(table.len());
            for &b in &table {
                if b == RELEASED {
                    host.push(RELEASED);
                } else {
                    let h = map[&b];
                    self.swap_refs[h as usize] += 1;
                    host.push(h);
                    self.release(b);
                }
            }
            let s = self.seq_mut(id);
            s.table = host;
            s.swapped = true;
        }
        Ok(pairs)
    }

    /// Swaps a group back in, to newly taken pool blocks: returns the
    /// copies `(host block, pool block)` to run before the group's next
    /// step (`KvCache::swap_in`). Blocks shared inside `group` are shared
    /// again; host blocks still held by sequences swapped out with them but
    /// not named here stay in swap space. Full blocks go back to the prefix
    /// cache where their content is not cached already.
    ///
    /// Errors, leaving everything unchanged: an unknown, resident or
    /// repeated sequence, or too few free pool blocks.
    pub fn swap_in(&mut self, group: &[SeqId]) -> Result<Vec<[u32; 2]>, BlockError> {
        self.check_group(group, true)?;
        let needed = self.swap_in_blocks(group)?;
        let available = self.available_blocks();
        if needed > available {
            return Err(BlockError::OutOfBlocks {
                needed,
                free: available,
            });
        }
        self.epoch += 1;
        let mut map: HashMap<u32, u32> = HashMap::with_capacity(needed);
        let mut pairs = Vec::with_capacity(needed);
        for &id in group {
            let table = std::mem::take(&mut self.seq_mut(id).table);
            let mut pool = Vec::with_capacity(table.len());
            for &h in &table {
                if h == RELEASED {
                    pool.push(RELEASED);
                    continue;
                }
                let b = match map.get(&h) {
                    Some(&b) => {
                        self.ref_counts[b as usize] += 1;
                        b
                    }
                    None => {
                        let b = self.take_block();
                        map.insert(h, b);
                        pairs.push([h, b]);
                        b
                    }
                };
                pool.push(b);
                self.release_swap(h);
            }
            let s = self.seq_mut(id);
            s.table = pool;
            s.swapped = false;
            if self.cfg.prefix_caching {
                let s = self.seqs[id.index() as usize]
                    .seq
                    .as_ref()
                    .expect("checked");
                let back: Vec<(u32, ChainDigest)> = s
                    .hashes
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| s.table[i] != RELEASED)
                    .map(|(i, h)| (s.table[i], *h))
                    .collect();
                for (b, h) in back {
                    if !self.block_hash.contains_key(&b) && !self.cache.contains_key(&h) {
                        self.cache.insert(h, b);
                        self.block_hash.insert(b, h);
                    }
                }
            }
        }
        Ok(pairs)
    }

    /// Pool blocks [`swap_in`](Self::swap_in) of `group` would take.
    pub fn swap_in_blocks(&self, group: &[SeqId]) -> Result<usize, BlockError> {
        let mut seen: HashSet<u32> = HashSet::new();
        for &id in group {
            let s = self.seq(id)?;
            if !s.swapped {
                return Err(BlockError::NotSwapped(id));
            }
            seen.extend(s.table.iter().filter(|&&h| h != RELEASED));
        }
        Ok(seen.len())
    }

    fn release_swap(&mut self, h: u32) {
        let r = &mut self.swap_refs[h as usize];
        *r -= 1;
        if *r == 0 {
            self.swap_free.push(h);
        }
    }

    /// Every id live, distinct, and swapped out (or not) as `swapped` says.
    fn check_group(&self, group: &[SeqId], swapped: bool) -> Result<(), BlockError> {
        let mut seen = HashSet::with_capacity(group.len());
        for &id in group {
            let s = self.seq(id)?;
            if s.swapped != swapped {
                return Err(if swapped {
                    BlockError::NotSwapped(id)
                } else {
                    BlockError::Swapped(id)
                });
            }
            if !seen.insert(id) {
                return Err(BlockError::DuplicateInBatch(id));
            }
        }
        Ok(())
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
