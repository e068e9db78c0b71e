//! Property test of the block manager against a simple model.
//!
//! Random operation sequences (add with repeated prefixes, append, fork, free,
//! batch views of the whole batch or of subsets, taking copies, evicting the
//! cache, and calls on unknown ids) run on small pools so that `OutOfBlocks`
//! is common. The model keeps each live sequence's token ids and pending
//! count, unshared, and the pool as sets: plain free blocks, cached blocks at
//! ref count 0 in release order, and a prefix cache keyed by the token prefix
//! itself (no hashing). A simulated GPU pool (one token id per slot) is
//! replayed from what the manager hands out: copies applied in order, then
//! each pending token written to its slot from the view's `slot_mapping`.
//!
//! After every step every sequence's handed-over positions must read back its
//! own tokens from that pool, every cached block must hold its prefix's last
//! block, reference counts must equal the number of tables holding each block,
//! and the free and evictable sets must match the model's. Every call must
//! return what the model predicts (the blocks it takes included: plain free
//! ones first, then the oldest evictable one), and every failing call must
//! leave the manager unchanged.
//!
//! Seeds are printed on failure; `BLOCKS_PROP_SEED=<seed>` reruns one run
//! (with `BLOCKS_PROP_CACHE=1` for the prefix-caching variant).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use pagedattn::blocks::{
    BatchView, BlockError, BlockManager, BlockManagerConfig, SeqId, SKIP_WRITE,
};
use pagedattn::rng::SplitMix64;

/// Token ids come from a small alphabet so that full blocks repeat.
const ALPHABET: u64 = 4;
const LOG_TAIL: usize = 24;

#[derive(Clone, Debug)]
struct ModelSeq {
    tokens: Vec<u32>,
    /// Tokens appended since the sequence's last view (their K/V not yet written).
    pending: usize,
    /// Leading full blocks already offered to the prefix cache.
    hashed: usize,
    /// A capped cache hit: the first pending token is in its shared block
    /// already (its write is skipped).
    capped: bool,
}

/// How often each interesting outcome happened, so the test can show that it
/// exercised what it claims to.
#[derive(Default, Debug, Clone, Copy)]
struct Coverage {
    steps: usize,
    added: usize,
    appended: usize,
    cow: usize,
    forked: usize,
    freed: usize,
    views: usize,
    taken_copies: usize,
    evicted: usize,
    prefix_hits: usize,
    revived: usize,
    out_of_blocks: usize,
    unknown: usize,
    pending_fork: usize,
    too_many: usize,
    empty_prompt: usize,
    duplicate: usize,
}

impl Coverage {
    fn add(&mut self, o: &Coverage) {
        self.steps += o.steps;
        self.added += o.added;
        self.appended += o.appended;
        self.cow += o.cow;
        self.forked += o.forked;
        self.freed += o.freed;
        self.views += o.views;
        self.taken_copies += o.taken_copies;
        self.evicted += o.evicted;
        self.prefix_hits += o.prefix_hits;
        self.revived += o.revived;
        self.out_of_blocks += o.out_of_blocks;
        self.unknown += o.unknown;
        self.pending_fork += o.pending_fork;
        self.too_many += o.too_many;
        self.empty_prompt += o.empty_prompt;
        self.duplicate += o.duplicate;
    }
}

struct Harness {
    rng: SplitMix64,
    m: BlockManager,
    bs: usize,
    nb: usize,
    max_len: usize,
    prefix: bool,
    model: BTreeMap<SeqId, ModelSeq>,
    dead: Vec<SeqId>,
    /// A handle of another manager (refused as unknown).
    foreign: SeqId,
    /// Token id held by each slot of the simulated GPU pool.
    pool: Vec<Option<u32>>,
    /// Plain free blocks.
    free: BTreeSet<u32>,
    /// Cached blocks at ref count 0, oldest release first.
    evictable: Vec<u32>,
    /// Blocks at ref count 0 still read by a pending copy, in release order:
    /// not reusable until the copies are handed out.
    awaiting: Vec<u32>,
    /// Prefix cache: token prefix ending at a block boundary -> block.
    cache: HashMap<Vec<u32>, u32>,
    /// The prefix each cached block is registered under.
    block_key: Vec<Option<Vec<u32>>>,
    /// Prompt stems shared by many prompts.
    stems: Vec<Vec<u32>>,
    reused: BatchView,
    log: Vec<String>,
    cov: Coverage,
}

impl Harness {
    fn new(seed: u64, prefix: bool) -> Self {
        let mut rng = SplitMix64::new(seed);
        let bs = 1usize << rng.below(4); // 1, 2, 4, 8
        let nb = rng.range(3, 32) as usize;
        let max_len = bs * rng.range(3, 12) as usize + rng.below(bs as u64) as usize;
        let cfg = BlockManagerConfig {
            max_seq_len: max_len,
            ..BlockManagerConfig::new(nb as u32, bs as u32).with_prefix_caching(prefix)
        };
        let mut m = BlockManager::new(cfg).unwrap();
        m.scramble_free_list(seed ^ 0xA5A5);
        let stems = (0..3)
            .map(|_| (0..3 * bs).map(|_| rng.below(ALPHABET) as u32).collect())
            .collect();
        Harness {
            rng,
            m,
            bs,
            nb,
            max_len,
            prefix,
            model: BTreeMap::new(),
            dead: Vec::new(),
            foreign: BlockManager::new(BlockManagerConfig::new(1, 1))
                .unwrap()
                .add_sequence(&[0])
                .unwrap(),
            pool: vec![None; nb * bs],
            free: (0..nb as u32).collect(),
            evictable: Vec::new(),
            awaiting: Vec::new(),
            cache: HashMap::new(),
            block_key: vec![None; nb],
            stems,
            reused: BatchView::default(),
            log: Vec::new(),
            cov: Coverage::default(),
        }
    }

    fn note(&mut self, s: String) {
        if self.log.len() == LOG_TAIL {
            self.log.remove(0);
        }
        self.log.push(s);
    }

    fn live(&self) -> Vec<SeqId> {
        self.model.keys().copied().collect()
    }

    /// A live id most of the time, else a freed or never-issued one.
    fn pick_id(&mut self) -> SeqId {
        let live = self.live();
        let r = self.rng.below(100);
        if !live.is_empty() && r < 90 {
            live[self.rng.below(live.len() as u64) as usize]
        } else if !self.dead.is_empty() && r < 96 {
            self.dead[self.rng.below(self.dead.len() as u64) as usize]
        } else {
            // Handles cannot be forged: another manager's is the unknown one.
            self.foreign
        }
    }

    fn random_tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.rng.below(ALPHABET) as u32).collect()
    }

    fn prompt(&mut self) -> Vec<u32> {
        let r = self.rng.below(100);
        if r < 3 {
            return Vec::new();
        }
        if r < 6 {
            // Past the length limit (or right at it).
            let n = self.max_len + self.rng.below(2) as usize;
            return self.random_tokens(n);
        }
        let mut p = if r < 45 {
            let stem = self.stems[self.rng.below(self.stems.len() as u64) as usize].clone();
            let k = self.rng.range(1, stem.len() as u64) as usize;
            stem[..k].to_vec()
        } else if r < 75 && !self.model.is_empty() {
            let live = self.live();
            let s = live[self.rng.below(live.len() as u64) as usize];
            let t = &self.model[&s].tokens;
            let k = self.rng.range(1, t.len() as u64) as usize;
            t[..k].to_vec()
        } else {
            Vec::new()
        };
        let extra = self.rng.below(self.bs as u64 + 2) as usize;
        let tail = self.random_tokens(extra);
        p.extend(tail);
        if p.is_empty() {
            p.push(self.rng.below(ALPHABET) as u32);
        }
        p.truncate(self.max_len);
        p
    }

    /// How many tables hold each block (a block twice in one table counts twice).
    fn holders(&self) -> Vec<usize> {
        let mut h = vec![0usize; self.nb];
        for &id in self.model.keys() {
            for &b in self.m.block_table(id).unwrap() {
                h[b as usize] += 1;
            }
        }
        h
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.bs)
    }

    fn apply_copies(&mut self, copies: &[[u32; 2]]) {
        let bs = self.bs;
        for &[src, dst] in copies {
            assert!(
                (src as usize) < self.nb && (dst as usize) < self.nb,
                "copy {src}->{dst} outside the pool"
            );
            for i in 0..bs {
                self.pool[dst as usize * bs + i] = self.pool[src as usize * bs + i];
            }
        }
    }

    /// The manager took block `b`: it must be a plain free block while any
    /// is left, else the oldest evictable one (which leaves the cache).
    #[track_caller]
    fn model_take(&mut self, b: u32) {
        if !self.free.is_empty() {
            assert!(
                self.free.remove(&b),
                "took block {b}, not one of the free blocks {:?}",
                self.free
            );
        } else {
            assert_eq!(
                self.evictable.first(),
                Some(&b),
                "took block {b}, not the oldest evictable"
            );
            self.evictable.remove(0);
            let key = self.block_key[b as usize]
                .take()
                .expect("evictable blocks are cached");
            self.cache.remove(&key);
        }
    }

    /// The copies were handed out: blocks held back for them are released.
    fn model_copies_taken(&mut self) {
        for b in std::mem::take(&mut self.awaiting) {
            self.model_release(b);
        }
    }

    /// Block `b` lost its last holder.
    fn model_release(&mut self, b: u32) {
        if self.block_key[b as usize].is_some() {
            self.evictable.push(b);
        } else {
            self.free.insert(b);
        }
    }

    /// Blocks the model's prefix cache serves for the start of `prompt`.
    fn model_match(&self, prompt: &[u32]) -> Vec<u32> {
        let mut matched = Vec::new();
        if self.prefix {
            for end in (self.bs..=prompt.len()).step_by(self.bs) {
                match self.cache.get(&prompt[..end]) {
                    Some(&b) => matched.push(b),
                    None => break,
                }
            }
        }
        matched
    }

    fn step(&mut self) {
        self.cov.steps += 1;
        // Free more often when the pool is full, so that it does not stay stuck.
        let r = if self.m.available_blocks() == 0 && self.rng.below(3) == 0 {
            55
        } else {
            self.rng.below(100)
        };
        match r {
            0..=17 => self.op_add(),
            18..=45 => self.op_append(),
            46..=53 => self.op_fork(),
            54..=64 => self.op_free(),
            65..=90 => self.op_view(),
            91..=95 => self.op_take_copies(),
            _ => self.op_evict(),
        }
        self.check();
    }

    #[track_caller]
    fn expect_unchanged(&self, pre: &BlockManager, what: &str) {
        assert!(self.m == *pre, "failing {what} changed the manager");
    }

    fn op_add(&mut self) {
        let prompt = self.prompt();
        let pre = self.m.clone();
        let avail = self.m.available_blocks();
        let holders = self.holders();
        let hits = self.m.prefix_hit_tokens();
        let res = self.m.add_sequence(&prompt);
        self.note(format!("add {prompt:?} -> {res:?}"));
        let len = prompt.len();
        if len == 0 {
            assert_eq!(res, Err(BlockError::EmptyPrompt));
            self.expect_unchanged(&pre, "add");
            self.cov.empty_prompt += 1;
            return;
        }
        if len > self.max_len {
            assert_eq!(
                res,
                Err(BlockError::TooManyTokens {
                    requested: len,
                    limit: self.max_len
                })
            );
            self.expect_unchanged(&pre, "add");
            self.cov.too_many += 1;
            return;
        }
        let matched = self.model_match(&prompt);
        let revived = matched
            .iter()
            .filter(|&&b| holders[b as usize] == 0 && !self.awaiting.contains(&b))
            .count();
        let needed = self.blocks_for(len) - matched.len();
        assert_eq!(avail, self.free.len() + self.evictable.len());
        let free = avail - revived;
        if needed > free {
            assert_eq!(res, Err(BlockError::OutOfBlocks { needed, free }));
            self.expect_unchanged(&pre, "add");
            self.cov.out_of_blocks += 1;
            return;
        }
        let id = res.expect("an add that fits must succeed");
        assert!(
            !self.model.contains_key(&id) && !self.dead.contains(&id),
            "id {id} reused"
        );
        // The cache-hit cap: a prompt cached to its end computes its last
        // token again (its K/V write skipped).
        let hit = (self.m.prefix_hit_tokens() - hits) as usize;
        let capped = matched.len() * self.bs == prompt.len();
        assert_eq!(
            hit,
            matched.len() * self.bs - capped as usize,
            "prefix hit tokens"
        );
        let table = self.m.block_table(id).unwrap().to_vec();
        assert_eq!(table.len(), matched.len() + needed);
        assert_eq!(
            &table[..matched.len()],
            &matched[..],
            "blocks served from the prefix cache"
        );
        for &b in &matched {
            if let Some(at) = self.awaiting.iter().position(|&a| a == b) {
                // Revived before its pending copy ran: held again, read-only.
                self.awaiting.remove(at);
            } else if holders[b as usize] == 0 {
                let at = self
                    .evictable
                    .iter()
                    .position(|&e| e == b)
                    .expect("revived block was evictable");
                self.evictable.remove(at);
            }
        }
        for &b in &table[matched.len()..] {
            assert_eq!(holders[b as usize], 0, "block {b} was taken while held");
            assert_eq!(self.m.ref_count(b), Some(1));
            self.model_take(b);
        }
        assert_eq!(self.m.available_blocks(), free - needed);
        self.cov.added += 1;
        self.cov.prefix_hits += !matched.is_empty() as usize;
        self.cov.revived += (revived > 0) as usize;
        self.model.insert(
            id,
            ModelSeq {
                tokens: prompt,
                pending: len - hit,
                hashed: matched.len(),
                capped,
            },
        );
    }

    fn op_append(&mut self) {
        let id = self.pick_id();
        let n = if self.rng.below(20) == 0 {
            0
        } else {
            self.rng.range(1, self.bs as u64 + 2) as usize
        };
        let toks = self.random_tokens(n);
        let pre = self.m.clone();
        let avail = self.m.available_blocks();
        let holders = self.holders();
        let copies_before = self.m.pending_copies().to_vec();
        let res = self.m.append(id, &toks);
        self.note(format!("append {id} {toks:?} -> {res:?}"));
        let Some(seq) = self.model.get(&id) else {
            assert_eq!(res, Err(BlockError::UnknownSequence(id)));
            self.expect_unchanged(&pre, "append");
            self.cov.unknown += 1;
            return;
        };
        if n == 0 {
            assert_eq!(res, Ok(Vec::new()));
            self.expect_unchanged(&pre, "empty append");
            return;
        }
        let len = seq.tokens.len();
        let new_len = len + n;
        if new_len > self.max_len {
            assert_eq!(
                res,
                Err(BlockError::TooManyTokens {
                    requested: new_len,
                    limit: self.max_len
                })
            );
            self.expect_unchanged(&pre, "append");
            self.cov.too_many += 1;
            return;
        }
        let old_table = pre.block_table(id).unwrap().to_vec();
        let last = *old_table.last().unwrap();
        let cow = len % self.bs != 0 && holders[last as usize] > 1;
        let need = self.blocks_for(new_len) - self.blocks_for(len) + cow as usize;
        if need > avail {
            assert_eq!(
                res,
                Err(BlockError::OutOfBlocks {
                    needed: need,
                    free: avail
                })
            );
            self.expect_unchanged(&pre, "append");
            self.cov.out_of_blocks += 1;
            return;
        }
        let slots = res.expect("append within the pool and the limit must succeed");
        let want: Vec<u32> = (len..new_len)
            .map(|p| self.m.slot(id, p).unwrap())
            .collect();
        assert_eq!(slots, want);
        let table = self.m.block_table(id).unwrap().to_vec();
        assert_eq!(table.len(), self.blocks_for(new_len));
        let kept = old_table.len() - cow as usize;
        assert_eq!(
            &table[..kept],
            &old_table[..kept],
            "append moved a block it did not copy"
        );
        for &b in &table[kept..] {
            assert_eq!(holders[b as usize], 0, "block {b} was taken while held");
            self.model_take(b);
        }
        let mut want_copies = copies_before;
        if cow {
            want_copies.push([last, table[kept]]);
            self.cov.cow += 1;
        }
        assert_eq!(self.m.pending_copies(), &want_copies[..]);
        assert_eq!(self.m.available_blocks(), avail - need);
        let seq = self.model.get_mut(&id).unwrap();
        seq.tokens.extend_from_slice(&toks);
        seq.pending += n;
        self.cov.appended += 1;
    }

    fn op_fork(&mut self) {
        let id = self.pick_id();
        let pre = self.m.clone();
        let res = self.m.fork(id);
        self.note(format!("fork {id} -> {res:?}"));
        let Some(seq) = self.model.get(&id).cloned() else {
            assert_eq!(res, Err(BlockError::UnknownSequence(id)));
            self.expect_unchanged(&pre, "fork");
            self.cov.unknown += 1;
            return;
        };
        if seq.pending > 0 {
            assert_eq!(
                res,
                Err(BlockError::PendingTokens {
                    seq: id,
                    pending: seq.pending
                })
            );
            self.expect_unchanged(&pre, "fork");
            self.cov.pending_fork += 1;
            return;
        }
        let child = res.expect("fork of a handed-over sequence must succeed");
        assert!(!self.model.contains_key(&child) && !self.dead.contains(&child));
        assert_eq!(
            self.m.block_table(child).unwrap(),
            self.m.block_table(id).unwrap()
        );
        assert_eq!(self.m.pending_copies(), pre.pending_copies());
        assert_eq!(self.m.available_blocks(), pre.available_blocks());
        self.model.insert(child, seq);
        self.cov.forked += 1;
    }

    fn op_free(&mut self) {
        let id = self.pick_id();
        let pre = self.m.clone();
        let avail = self.m.available_blocks();
        let res = self.m.free(id);
        self.note(format!("free {id} -> {res:?}"));
        if !self.model.contains_key(&id) {
            assert_eq!(res, Err(BlockError::UnknownSequence(id)));
            self.expect_unchanged(&pre, "free");
            self.cov.unknown += 1;
            return;
        }
        res.unwrap();
        self.model.remove(&id);
        self.dead.push(id);
        let holders = self.holders();
        let table = pre.block_table(id).unwrap();
        let released: HashSet<u32> = table
            .iter()
            .copied()
            .filter(|&b| holders[b as usize] == 0)
            .collect();
        let held_back = released
            .iter()
            .filter(|&&b| {
                pre.pending_copies()
                    .iter()
                    .any(|c| c[0] == b && !released.contains(&c[1]))
            })
            .count();
        assert_eq!(
            self.m.available_blocks(),
            avail + released.len() - held_back
        );
        // Tail blocks first, so that a chain's head outlives its tail in the
        // cache. A copy into a released block is dropped; a released block a
        // remaining copy still reads waits for the copies to be handed out.
        let mut copies = pre.pending_copies().to_vec();
        for &b in table.iter().rev() {
            if released.contains(&b) {
                copies.retain(|c| c[1] != b);
                if copies.iter().any(|c| c[0] == b) {
                    self.awaiting.push(b);
                } else {
                    self.model_release(b);
                }
            }
        }
        // A copy into a block nobody holds any more is dropped; the others stay, in order.
        let want: Vec<[u32; 2]> = pre
            .pending_copies()
            .iter()
            .copied()
            .filter(|c| !released.contains(&c[1]))
            .collect();
        assert_eq!(self.m.pending_copies(), &want[..]);
        self.cov.freed += 1;
    }

    fn op_view(&mut self) {
        let mut ids = self.live();
        self.rng.shuffle(&mut ids);
        let r = self.rng.below(100);
        if r < 35 {
            let keep = self.rng.below(ids.len() as u64 + 1) as usize;
            ids.truncate(keep);
        } else if r < 50 {
            // A bad entry: an unknown id or a duplicate, somewhere in the list.
            let bad = if !ids.is_empty() && self.rng.below(2) == 0 {
                ids[self.rng.below(ids.len() as u64) as usize]
            } else {
                self.pick_id()
            };
            let at = self.rng.below(ids.len() as u64 + 1) as usize;
            ids.insert(at, bad);
        }
        let expected_err = {
            let mut seen = HashSet::new();
            let unknown = ids.iter().find(|id| !self.model.contains_key(id)).copied();
            let dup = ids.iter().find(|id| !seen.insert(**id)).copied();
            match (unknown, dup) {
                (Some(u), _) => Some(BlockError::UnknownSequence(u)),
                (None, Some(d)) => Some(BlockError::DuplicateInBatch(d)),
                _ => None,
            }
        };
        let pre = self.m.clone();
        let copies_before = self.m.pending_copies().to_vec();
        let into = self.rng.below(2) == 0;
        let res = if into {
            let before = self.reused.clone();
            let mut view = std::mem::take(&mut self.reused);
            let res = self
                .m
                .batch_view_into(&ids, &mut view)
                .map(|()| view.clone());
            if res.is_err() {
                assert_eq!(view, before, "a failing batch_view_into touched the view");
            }
            self.reused = view;
            res
        } else {
            self.m.batch_view(&ids)
        };
        self.note(format!(
            "view {ids:?} -> {:?}",
            res.as_ref().map(|v| (&v.slot_mapping, &v.copies))
        ));
        if let Some(e) = expected_err {
            self.cov.unknown += matches!(e, BlockError::UnknownSequence(_)) as usize;
            self.cov.duplicate += matches!(e, BlockError::DuplicateInBatch(_)) as usize;
            assert_eq!(res, Err(e));
            self.expect_unchanged(&pre, "batch_view");
            return;
        }
        let view = res.expect("a view of distinct live sequences must succeed");
        self.check_view_shape(&ids, &view);
        assert_eq!(view.copies, copies_before);
        assert!(self.m.pending_copies().is_empty());
        self.model_copies_taken();

        // Replay on the simulated pool: copies first, then the new tokens.
        self.apply_copies(&view.copies);
        for (i, id) in ids.iter().enumerate() {
            let seq = self.model.get_mut(id).unwrap();
            let len = seq.tokens.len();
            let slots =
                &view.slot_mapping[view.new_indptr[i] as usize..view.new_indptr[i + 1] as usize];
            for (p, &slot) in (len - seq.pending..len).zip(slots) {
                if slot == SKIP_WRITE {
                    continue;
                }
                self.pool[slot as usize] = Some(seq.tokens[p]);
            }
            seq.pending = 0;
            seq.capped = false;
        }
        // The tokens are written now: their full blocks join the prefix cache,
        // unless the block or an equal prefix is cached already.
        if self.prefix {
            for (i, id) in ids.iter().enumerate() {
                let table =
                    &view.kv_indices[view.kv_indptr[i] as usize..view.kv_indptr[i + 1] as usize];
                let seq = self.model.get_mut(id).unwrap();
                let full = seq.tokens.len() / self.bs;
                for (blk, &b) in table.iter().enumerate().take(full).skip(seq.hashed) {
                    let key = seq.tokens[..(blk + 1) * self.bs].to_vec();
                    if self.block_key[b as usize].is_none() && !self.cache.contains_key(&key) {
                        self.cache.insert(key.clone(), b);
                        self.block_key[b as usize] = Some(key);
                    }
                }
                seq.hashed = full;
            }
        }
        // Every sequence in the batch now reads back exactly its own tokens.
        for (i, id) in ids.iter().enumerate() {
            let toks = &self.model[id].tokens;
            let table =
                &view.kv_indices[view.kv_indptr[i] as usize..view.kv_indptr[i + 1] as usize];
            for (p, &t) in toks.iter().enumerate() {
                let slot = table[p / self.bs] as usize * self.bs + p % self.bs;
                assert_eq!(
                    self.pool[slot],
                    Some(t),
                    "{id} position {p} (slot {slot}) after the view"
                );
            }
        }
        self.cov.views += 1;
    }

    fn check_view_shape(&self, ids: &[SeqId], v: &BatchView) {
        let n = ids.len();
        assert_eq!(v.num_seqs(), n);
        assert_eq!((v.kv_indptr.len(), v.new_indptr.len()), (n + 1, n + 1));
        assert_eq!((v.kv_indptr[0], v.new_indptr[0]), (0, 0));
        assert_eq!(v.kv_indptr[n] as usize, v.kv_indices.len());
        assert_eq!(v.new_indptr[n] as usize, v.slot_mapping.len());
        for (i, id) in ids.iter().enumerate() {
            let seq = &self.model[id];
            let len = seq.tokens.len();
            assert_eq!(v.seq_lens[i] as usize, len);
            let table = &v.kv_indices[v.kv_indptr[i] as usize..v.kv_indptr[i + 1] as usize];
            assert_eq!(table, self.m.block_table(*id).unwrap());
            let slots = &v.slot_mapping[v.new_indptr[i] as usize..v.new_indptr[i + 1] as usize];
            assert_eq!(slots.len(), seq.pending, "{id}: new tokens in the view");
            let want: Vec<u32> = (len - seq.pending..len)
                .map(|p| self.m.slot(*id, p).unwrap())
                .collect();
            for (k, (&got, &w)) in slots.iter().zip(&want).enumerate() {
                // Only a capped cache hit's one token skips its write.
                if got == SKIP_WRITE {
                    assert!(k == 0 && seq.capped, "{id}: skipped write");
                    assert_eq!(self.pool[w as usize], Some(seq.tokens[len - seq.pending]));
                } else {
                    assert_eq!(got, w);
                }
            }
        }
    }

    fn op_take_copies(&mut self) {
        let before = self.m.pending_copies().to_vec();
        let copies = self.m.take_copies();
        self.note(format!("take_copies -> {copies:?}"));
        assert_eq!(copies, before);
        assert!(self.m.pending_copies().is_empty());
        self.model_copies_taken();
        self.apply_copies(&copies);
        self.cov.taken_copies += !copies.is_empty() as usize;
    }

    fn op_evict(&mut self) {
        let before = self.m.stats();
        let n = self.m.evict_all_cached();
        self.note(format!("evict_all_cached -> {n}"));
        let after = self.m.stats();
        assert_eq!(n, before.evictable);
        assert_eq!((after.evictable, after.free), (0, before.free + n));
        assert_eq!(n, self.evictable.len());
        for b in std::mem::take(&mut self.evictable) {
            let key = self.block_key[b as usize].take().unwrap();
            self.cache.remove(&key);
            self.free.insert(b);
        }
        self.cov.evicted += (n > 0) as usize;
    }

    /// Invariants that hold between any two calls.
    fn check(&self) {
        let (bs, nb) = (self.bs, self.nb);
        assert_eq!(self.m.sequence_ids(), self.live());
        let holders = self.holders();
        for (b, &h) in holders.iter().enumerate() {
            assert_eq!(
                self.m.ref_count(b as u32),
                Some(h as u32),
                "ref count of block {b}"
            );
        }
        let copies = self.m.pending_copies();
        let copy_dsts: HashSet<u32> = copies.iter().map(|c| c[1]).collect();
        assert_eq!(
            copy_dsts.len(),
            copies.len(),
            "two copies into one block: {copies:?}"
        );
        let mut pending_blocks = HashSet::new();
        // Fill of each block (most tokens any holder has in it) and the token
        // id each slot must hold for every holder.
        let mut filled = vec![0usize; nb];
        let mut expect: Vec<Option<u32>> = vec![None; nb * bs];
        let mut logical = 0;
        for (&id, seq) in &self.model {
            let table = self.m.block_table(id).unwrap();
            let len = seq.tokens.len();
            logical += len;
            assert_eq!(self.m.tokens(id).unwrap(), &seq.tokens[..]);
            assert_eq!(self.m.seq_len(id).unwrap(), len);
            assert_eq!(
                self.m.pending_tokens(id).unwrap(),
                seq.pending,
                "{id}: pending tokens"
            );
            assert_eq!(
                table.len(),
                self.blocks_for(len),
                "{id}: blocks for {len} tokens"
            );
            let distinct: HashSet<u32> = table.iter().copied().collect();
            assert_eq!(
                distinct.len(),
                table.len(),
                "{id} holds a block twice: {table:?}"
            );
            for (i, &b) in table.iter().enumerate() {
                assert!((b as usize) < nb);
                filled[b as usize] = filled[b as usize].max((len - i * bs).min(bs));
            }
            for (p, &t) in seq.tokens.iter().enumerate() {
                let b = table[p / bs];
                let slot = b as usize * bs + p % bs;
                if p >= len - seq.pending && !(seq.capped && p == len - seq.pending) {
                    // About to be written: the block must be this sequence's alone.
                    assert_eq!(
                        holders[b as usize], 1,
                        "{id} will write position {p} into shared block {b}"
                    );
                    pending_blocks.insert(b);
                }
                match expect[slot] {
                    Some(other) => {
                        assert_eq!(other, t, "slot {slot} is position {p} of {id} and holds a different token for another sequence");
                        assert!(holders[b as usize] > 1);
                    }
                    None => expect[slot] = Some(t),
                }
                let handed_over = p < len - seq.pending;
                if handed_over && !copy_dsts.contains(&b) {
                    assert_eq!(
                        self.pool[slot],
                        Some(t),
                        "{id} position {p} (slot {slot}) reads back wrong"
                    );
                }
            }
        }
        for &[src, dst] in copies {
            assert!(src != dst && (src as usize) < nb);
            assert_eq!(
                holders[dst as usize], 1,
                "copy destination {dst} is not held exactly once"
            );
            assert!(
                pending_blocks.contains(&dst),
                "copy into block {dst} that nobody is about to write"
            );
        }
        let s = self.m.stats();
        let used = holders.iter().filter(|&&h| h > 0).count();
        assert_eq!(s.total, nb);
        assert_eq!(
            s.free + s.evictable + s.used + s.awaiting_copy,
            s.total,
            "{s:?}"
        );
        assert_eq!(s.used, used);
        assert_eq!(s.shared, holders.iter().filter(|&&h| h > 1).count());
        assert_eq!(s.sequences, self.model.len());
        assert_eq!(s.logical_tokens, logical);
        assert_eq!(s.tokens_stored, filled.iter().sum::<usize>());
        assert_eq!(s.capacity_held, used * bs);
        assert_eq!(s.pending_copies, copies.len());
        assert_eq!(
            s.awaiting_copy,
            self.awaiting.len(),
            "blocks awaiting a copy"
        );
        for &b in &self.awaiting {
            assert_eq!(holders[b as usize], 0, "awaiting block {b} is held");
        }
        assert_eq!(self.m.available_blocks(), s.free + s.evictable);
        assert_eq!(s.free, self.free.len(), "plain free blocks");
        assert_eq!(s.evictable, self.evictable.len(), "evictable blocks");
        for &b in self.free.iter().chain(&self.evictable) {
            assert_eq!(
                holders[b as usize], 0,
                "block {b} is free or evictable and held"
            );
        }
        assert_eq!(
            self.free.len() + self.evictable.len() + self.awaiting.len() + used,
            nb
        );
        // The cache never serves a block whose content is not its prefix.
        for (key, &b) in &self.cache {
            assert_eq!(self.block_key[b as usize].as_ref(), Some(key));
            let last = &key[key.len() - bs..];
            let held = &self.pool[b as usize * bs..(b as usize + 1) * bs];
            assert!(
                held.iter().zip(last).all(|(h, t)| *h == Some(*t)),
                "cached block {b} holds {held:?}, not {last:?}"
            );
        }
        if !self.prefix {
            assert!(self.cache.is_empty() && s.evictable == 0);
        }
    }
}

fn run_one(seed: u64, prefix: bool, steps: usize) -> Coverage {
    let mut h = Harness::new(seed, prefix);
    let res = catch_unwind(AssertUnwindSafe(|| {
        for _ in 0..steps {
            h.step();
        }
    }));
    if let Err(panic) = res {
        eprintln!(
            "block manager property failed: seed {seed:#x}, prefix caching {prefix}, step {}, \
             block size {}, {} blocks, max_seq_len {}\nlast operations:\n  {}\n\
             rerun: BLOCKS_PROP_SEED={seed:#x} BLOCKS_PROP_CACHE={} cargo test --test blocks_props",
            h.cov.steps,
            h.bs,
            h.nb,
            h.max_len,
            h.log.join("\n  "),
            prefix as u8,
        );
        resume_unwind(panic);
    }
    h.cov
}

fn env_seed() -> Option<u64> {
    let s = std::env::var("BLOCKS_PROP_SEED").ok()?;
    let s = s.trim();
    Some(match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).expect("BLOCKS_PROP_SEED"),
        None => s.parse().expect("BLOCKS_PROP_SEED"),
    })
}

const RUNS: u64 = 250;
const STEPS: usize = 800;

fn run_many(prefix: bool, base: u64) -> Coverage {
    if let Some(seed) = env_seed() {
        if std::env::var("BLOCKS_PROP_CACHE")
            .map(|v| v == "1")
            .unwrap_or(false)
            == prefix
        {
            return run_one(seed, prefix, STEPS);
        }
        return Coverage::default();
    }
    let mut total = Coverage::default();
    for run in 0..RUNS {
        let seed = SplitMix64::new(base + run).next_u64();
        total.add(&run_one(seed, prefix, STEPS));
    }
    println!("prefix caching {prefix}: {total:?}");
    total
}

fn assert_exercised(c: &Coverage, prefix: bool) {
    if env_seed().is_some() {
        return;
    }
    assert_eq!(c.steps, RUNS as usize * STEPS);
    let must = [
        ("added", c.added),
        ("appended", c.appended),
        ("copy-on-write", c.cow),
        ("forked", c.forked),
        ("freed", c.freed),
        ("views", c.views),
        ("taken copies", c.taken_copies),
        ("out of blocks", c.out_of_blocks),
        ("unknown ids", c.unknown),
        ("pending forks", c.pending_fork),
        ("too many tokens", c.too_many),
        ("empty prompts", c.empty_prompt),
        ("duplicates", c.duplicate),
    ];
    for (what, n) in must {
        assert!(n >= 50, "only {n} {what} in {c:?}");
    }
    if prefix {
        for (what, n) in [
            ("prefix hits", c.prefix_hits),
            ("revivals", c.revived),
            ("evictions", c.evicted),
        ] {
            assert!(n >= 50, "only {n} {what} in {c:?}");
        }
    } else {
        assert_eq!(c.prefix_hits + c.revived + c.evicted, 0);
    }
}

#[test]
fn random_operations_match_the_model_without_prefix_caching() {
    let c = run_many(false, 0x0B10_C500);
    assert_exercised(&c, false);
}

#[test]
fn random_operations_match_the_model_with_prefix_caching() {
    let c = run_many(true, 0x0CAC_4E00);
    assert_exercised(&c, true);
}
