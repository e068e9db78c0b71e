//! The block manager's whole API driven by a byte string and checked against
//! a simple model after every call.
//!
//! Shared by the fuzz target (`fuzz/fuzz_targets/block_manager.rs`, which
//! includes this file by path) and `tests/fuzz_corpus.rs` (which replays the
//! committed corpus on stable Rust), so a corpus entry means the same thing
//! to both. Not declared in `common/mod.rs`: only those two use it.
//!
//! An input is four configuration bytes (block size, pool size, length
//! limit, prefix caching, host swap space of 0 to 15 blocks and free-list
//! scrambling; some values ask for an invalid configuration, which must be
//! refused) and then operations, one
//! tag byte each followed by its arguments: add a sequence (fresh tokens, a
//! prefix of a live or freed sequence, a shared stem, an empty or over-long
//! prompt), append, fork, free, release outside a sliding window, a batch view (of a subset, with unknown or
//! repeated ids mixed in, into a fresh or a reused view), take the copies,
//! evict the cache, queries (`slot`, `blocks_needed_to_append`, whose
//! bound is also tried out on a copy of the manager), and (tags 15, 31, 47,
//! 63) swap-out of a group, swap-in of a group or freeing a swapped-out
//! sequence, a chunked step (`plan_step` with token budgets, a stale plan
//! refused on a changed copy, `commit_step`), and every pool call on a
//! swapped-out sequence (refused). A simulated host swap space holds what
//! swapped blocks held. Missing bytes read as
//! zero; decoding never fails, so every byte string is a valid input.
//!
//! The model keeps each sequence's tokens, block table and pending count,
//! the pool as sets (plain free blocks, cached blocks at ref count 0 in
//! release order, blocks held back for a pending copy) and a prefix cache
//! keyed by the token prefix itself (no hashing). A simulated GPU pool (one
//! token id per slot) replays what the manager hands out: copies in order,
//! then each new token written to its slot.
//!
//! Checked after every call: each call returns what the model predicts
//! (errors with their numbers, the blocks taken: plain free ones first, then
//! the oldest evictable one, the slots, the copies); a failing call leaves the
//! manager equal to a copy taken before it; every sequence's handed-over
//! positions read back its own tokens from the simulated pool; every cached
//! block holds its prefix's last block; reference counts equal the number of
//! tables holding each block; a block about to be written is held once;
//! `stats()` adds up; the free and evictable sets match.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use pagedattn::blocks::{
    BatchView, BlockError, BlockManager, BlockManagerConfig, SeqId, RELEASED, SKIP_WRITE,
};

/// Token ids come from a small alphabet so that full blocks repeat.
const ALPHABET: u8 = 4;
/// Operations run per input at most (keeps each fuzz execution short).
pub const MAX_OPS: usize = 2000;
/// Freed sequences' tokens kept as prompt material (prefix-cache revivals).
const HISTORY: usize = 16;
/// Block sizes that must be refused.
const BAD_BLOCK_SIZES: [u32; 8] = [0, 3, 6, 12, 100, 257, 512, u32::MAX];

pub use crate::harness;

tally! {
    /// How often each interesting outcome happened.
    pub struct Coverage: usize {
        inputs: "inputs",
        bad_configs: "bad configs",
        ops: "ops",
        added: "added",
        appended: "appended",
        cow: "copy-on-write",
        forked: "forked",
        freed: "freed",
        views: "views",
        views_into: "views into a reused view",
        taken_copies: "taken copies",
        evicted: "evictions",
        prefix_hits: "prefix hits",
        revived: "revivals",
        revived_awaiting: "revivals of blocks awaiting a copy",
        held_back: "blocks held back for a copy",
        out_of_blocks: "out of blocks",
        unknown: "unknown ids",
        pending_fork: "pending forks",
        too_many: "too many tokens",
        empty_prompt: "empty prompts",
        duplicate: "duplicates",
        position_out_of_range: "positions out of range",
        bound_tried: "append bounds tried",
        window_released: "blocks released outside a window",
        position_released: "released positions asked for",
        zero_window: "zero windows",
        swapped_out: "groups swapped out",
        swapped_in: "groups swapped in",
        swap_full: "swap space full",
        copies_pending: "swap-outs with copies pending",
        not_swapped: "swap-ins of resident sequences",
        swapped_refused: "calls refused on swapped sequences",
        freed_swapped: "swapped sequences freed",
        chunked: "chunked steps",
        stale_plans: "stale plans refused",
    }
}

/// The input, read a byte at a time.
type Bytes<'a> = harness::Input<'a>;

impl Bytes<'_> {
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.byte() % ALPHABET) as u32).collect()
    }
}

#[derive(Clone, Debug)]
struct ModelSeq {
    tokens: Vec<u32>,
    table: Vec<u32>,
    /// Tokens appended since the sequence's last view (K/V not yet written).
    pending: usize,
    /// Leading full blocks already offered to the prefix cache.
    hashed: usize,
    /// A capped cache hit: the first pending token is in its (shared)
    /// block already, and its write is skipped.
    capped: bool,
}

/// Offers full blocks `blocks` of `seq` to the model's prefix cache: each
/// joins unless it is released, cached already, or its prefix is cached.
fn offer_to_cache(
    cache: &mut HashMap<Vec<u32>, u32>,
    block_key: &mut [Option<Vec<u32>>],
    bs: usize,
    seq: &ModelSeq,
    blocks: std::ops::Range<usize>,
) {
    for blk in blocks {
        let b = seq.table[blk];
        let key = seq.tokens[..(blk + 1) * bs].to_vec();
        if b != RELEASED && block_key[b as usize].is_none() && !cache.contains_key(&key) {
            cache.insert(key.clone(), b);
            block_key[b as usize] = Some(key);
        }
    }
}

/// The manager under test, the model, and the simulated GPU pool.
pub struct Harness {
    m: BlockManager,
    bs: usize,
    nb: usize,
    max_len: usize,
    prefix: bool,
    model: BTreeMap<SeqId, ModelSeq>,
    dead: Vec<SeqId>,
    last_id: Option<SeqId>,
    /// A handle of another manager (refused as unknown).
    foreign: SeqId,
    /// Swapped-out sequences (tables of host blocks); never in `model`.
    swapped: BTreeMap<SeqId, ModelSeq>,
    /// Simulated host swap space (token per slot) and references per host block.
    host: Vec<Option<u32>>,
    host_refs: Vec<usize>,
    history: Vec<Vec<u32>>,
    /// Token id held by each slot of the simulated GPU pool.
    pool: Vec<Option<u32>>,
    free: BTreeSet<u32>,
    /// Cached blocks at ref count 0, oldest release first.
    evictable: Vec<u32>,
    /// Blocks at ref count 0 still read by a pending copy, in release order.
    awaiting: Vec<u32>,
    /// Prefix cache: token prefix ending at a block boundary -> block.
    cache: HashMap<Vec<u32>, u32>,
    block_key: Vec<Option<Vec<u32>>>,
    reused: BatchView,
    /// Last operations, for the failure message.
    pub log: Vec<String>,
    pub cov: Coverage,
}

/// Runs one input; panics (with the last operations) on any broken invariant.
pub fn run(data: &[u8]) -> Coverage {
    let mut input = Bytes::new(data);
    let mut cov = Coverage {
        inputs: 1,
        ..Default::default()
    };
    let Some(mut h) = Harness::from_config(&mut input, &mut cov) else {
        return cov;
    };
    h.cov = cov;
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        while !input.done() && h.cov.ops < MAX_OPS {
            h.step(&mut input);
            h.check();
        }
    }));
    if let Err(p) = res {
        eprintln!(
            "block manager invariant broken at op {} (block size {}, {} blocks, max_seq_len {}, prefix caching {})\nlast operations:\n  {}",
            h.cov.ops,
            h.bs,
            h.nb,
            h.max_len,
            h.prefix,
            h.log.join("\n  ")
        );
        std::panic::resume_unwind(p);
    }
    h.cov
}

impl Harness {
    /// Decodes the configuration; an invalid one must be refused (checked
    /// here) and ends the input.
    fn from_config(input: &mut Bytes, cov: &mut Coverage) -> Option<Self> {
        let (c0, c1, c2, c3) = (input.byte(), input.byte(), input.byte(), input.byte());
        let bs = if c0 >= 0xF8 {
            BAD_BLOCK_SIZES[(c0 - 0xF8) as usize]
        } else {
            1u32 << (c0 % 5)
        };
        let num_blocks = match c1 {
            0 => 0,
            // One past the largest addressable pool: refused. (The largest
            // itself is valid but takes ~32 bytes of host memory per block.)
            // (With one-token blocks every u32 is addressable: zero instead.)
            0xFF if bs >= 2 => u32::MAX / bs + 1,
            0xFF => 0,
            _ => 1 + (c1 % 40) as u32,
        };
        let max_seq_len = if bs <= 256 {
            bs as usize * (1 + (c2 % 12) as usize) + (c2 / 12) as usize % bs.max(1) as usize
        } else {
            64
        };
        let prefix = c3 & 1 == 1;
        let swap_blocks = ((c3 >> 1) % 16) as u32;
        let cfg = BlockManagerConfig {
            max_seq_len,
            ..BlockManagerConfig::new(num_blocks, bs)
                .with_prefix_caching(prefix)
                .with_swap_space(swap_blocks)
        };
        let res = BlockManager::new(cfg);
        let bs_ok = (1..=256).contains(&bs) && bs.is_power_of_two();
        if !bs_ok {
            assert_eq!(res, Err(BlockError::BadBlockSize(bs)));
            cov.bad_configs += 1;
            return None;
        }
        let max = (u32::MAX / bs).min(pagedattn::blocks::MAX_BLOCKS);
        if num_blocks == 0 || num_blocks > max {
            assert_eq!(
                res,
                Err(BlockError::BadPoolSize {
                    num_blocks,
                    block_size: bs,
                    max
                })
            );
            cov.bad_configs += 1;
            return None;
        }
        let mut m = res.expect("a valid configuration");
        assert_eq!(m.config(), &cfg);
        assert_eq!(m.block_size(), bs);
        if c3 & 2 != 0 {
            m.scramble_free_list(c3 as u64);
        }
        let (bs, nb) = (bs as usize, num_blocks as usize);
        Some(Harness {
            m,
            bs,
            nb,
            max_len: max_seq_len,
            prefix,
            model: BTreeMap::new(),
            dead: Vec::new(),
            last_id: None,
            history: Vec::new(),
            pool: vec![None; nb * bs],
            swapped: BTreeMap::new(),
            host: vec![None; swap_blocks as usize * bs],
            host_refs: vec![0; swap_blocks as usize],
            foreign: BlockManager::new(BlockManagerConfig::new(1, 1))
                .unwrap()
                .add_sequence(&[0])
                .unwrap(),
            free: (0..nb as u32).collect(),
            evictable: Vec::new(),
            awaiting: Vec::new(),
            cache: HashMap::new(),
            block_key: vec![None; nb],
            reused: BatchView::default(),
            log: Vec::new(),
            cov: Coverage::default(),
        })
    }

    fn note(&mut self, s: String) {
        if self.log.len() == 24 {
            self.log.remove(0);
        }
        self.log.push(s);
    }

    fn live(&self) -> Vec<SeqId> {
        self.model.keys().copied().collect()
    }

    /// A live id for most selector values, else a freed or never-issued one.
    fn pick_id(&self, sel: u8) -> SeqId {
        let live = self.live();
        if sel < 200 && !live.is_empty() {
            live[sel as usize % live.len()]
        } else if sel < 230 && !self.dead.is_empty() {
            self.dead[sel as usize % self.dead.len()]
        } else {
            // Handles cannot be forged: another manager's is the unknown one.
            self.foreign
        }
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.bs)
    }

    /// Number of model tables holding each block.
    fn holders(&self) -> Vec<usize> {
        let mut h = vec![0; self.nb];
        for s in self.model.values() {
            for &b in s.table.iter().filter(|&&b| b != RELEASED) {
                h[b as usize] += 1;
            }
        }
        h
    }

    fn step(&mut self, input: &mut Bytes) {
        self.cov.ops += 1;
        let tag = input.byte();
        match tag % 16 {
            0..=2 => self.op_add(input),
            3..=6 => self.op_append(input),
            7 => self.op_fork(input),
            8..=9 => self.op_free(input),
            10..=12 => self.op_view(input),
            13 => self.op_take_copies(),
            14 => self.op_evict(),
            _ if tag >= 128 => self.op_window(input),
            _ => match tag {
                15 => self.op_swap_out(input),
                31 => self.op_swap_in(input),
                47 => self.op_chunk(input),
                63 => self.op_swapped_calls(input),
                _ => self.op_query(input),
            },
        }
    }

    #[track_caller]
    fn expect_unchanged(&self, pre: &BlockManager, what: &str) {
        assert!(self.m == *pre, "failing {what} changed the manager");
    }

    /// A prompt: fresh tokens, a prefix of a live or freed sequence plus a
    /// tail, a shared stem plus a tail, or an empty or over-long one.
    fn prompt(&mut self, input: &mut Bytes) -> Vec<u32> {
        let (mode, len) = (input.byte(), input.byte() as usize);
        match mode % 8 {
            0..=1 => {
                let n = len % (self.max_len + 1) + 1;
                input.tokens(n.min(self.max_len))
            }
            2..=4 => {
                let mut sources: Vec<&Vec<u32>> = self.model.values().map(|s| &s.tokens).collect();
                sources.extend(self.history.iter());
                if sources.is_empty() {
                    return input.tokens(1 + len % self.max_len);
                }
                let src = sources[input.byte() as usize % sources.len()];
                // Whole blocks of the source most of the time (prefix hits).
                let k = if mode & 0x80 == 0 {
                    (len % (src.len() / self.bs + 1)) * self.bs
                } else {
                    len % (src.len() + 1)
                };
                let mut p = src[..k].to_vec();
                let tail = input.byte() as usize % (2 * self.bs + 1);
                p.extend(input.tokens(tail));
                p.truncate(self.max_len);
                if p.is_empty() {
                    p.push(0);
                }
                p
            }
            5..=6 => {
                // One of four stems (constant patterns), cut and extended.
                let stem = (mode / 8 % 4) as u32;
                let k = len % (self.max_len + 1);
                let mut p: Vec<u32> = (0..k as u32)
                    .map(|j| (stem + j * (stem + 1)) % ALPHABET as u32)
                    .collect();
                let tail = input.byte() as usize % (self.bs + 1);
                p.extend(input.tokens(tail));
                p.truncate(self.max_len);
                p
            }
            _ => {
                if len % 2 == 0 {
                    Vec::new()
                } else {
                    vec![1; self.max_len + 1 + len % 3]
                }
            }
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

    /// The manager took block `b`: a plain free block while any is left,
    /// else the oldest evictable one (which leaves the cache).
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
                "took block {b}, not the oldest evictable of {:?}",
                self.evictable
            );
            self.evictable.remove(0);
            let key = self.block_key[b as usize]
                .take()
                .expect("evictable blocks are cached");
            self.cache.remove(&key);
        }
    }

    /// Block `b` lost its last holder and may be reused.
    fn model_release(&mut self, b: u32) {
        if self.block_key[b as usize].is_some() {
            self.evictable.push(b);
        } else {
            self.free.insert(b);
        }
    }

    fn model_copies_taken(&mut self) {
        for b in std::mem::take(&mut self.awaiting) {
            self.model_release(b);
        }
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

    fn op_add(&mut self, input: &mut Bytes) {
        let prompt = self.prompt(input);
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
            let e = BlockError::TooManyTokens {
                requested: len,
                limit: self.max_len,
            };
            assert_eq!(res, Err(e));
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
            "handle {id} names another sequence"
        );
        self.last_id = Some(id);
        // The cache-hit cap: a prompt cached to its end computes its last
        // token again (its K/V write skipped).
        let hit = (self.m.prefix_hit_tokens() - hits) as usize;
        let capped = matched.len() * self.bs == len;
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
            "blocks served from the cache"
        );
        for &b in &matched {
            if let Some(at) = self.awaiting.iter().position(|&a| a == b) {
                // Revived before its pending copy ran: held again, read-only.
                self.awaiting.remove(at);
                self.cov.revived_awaiting += 1;
            } else if holders[b as usize] == 0 {
                let at = self
                    .evictable
                    .iter()
                    .position(|&e| e == b)
                    .expect("a revived block was evictable");
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
                table,
                pending: len - hit,
                hashed: matched.len(),
                capped,
            },
        );
    }

    fn op_append(&mut self, input: &mut Bytes) {
        let id = self.pick_id(input.byte());
        let nb = input.byte();
        let n = match nb {
            0..=7 => 0,
            250..=255 => self.max_len + (nb - 250) as usize,
            _ => nb as usize % (2 * self.bs + 2),
        };
        // Over-long appends are zeros, so they do not eat the input.
        let toks = if n > 2 * self.bs + 1 {
            vec![0; n]
        } else {
            input.tokens(n)
        };
        let pre = self.m.clone();
        let avail = self.m.available_blocks();
        let holders = self.holders();
        let bound = pre.blocks_needed_to_append(&[id], n);
        let res = self.m.append(id, &toks);
        self.note(format!("append {id} {toks:?} -> {res:?}"));
        let Some(seq) = self.model.get(&id).cloned() else {
            assert_eq!(res, Err(BlockError::UnknownSequence(id)));
            assert_eq!(bound, Err(BlockError::UnknownSequence(id)));
            self.expect_unchanged(&pre, "append");
            self.cov.unknown += 1;
            return;
        };
        if n == 0 {
            assert_eq!(res, Ok(Vec::new()));
            assert_eq!(bound, Ok(0));
            self.expect_unchanged(&pre, "empty append");
            return;
        }
        let len = seq.tokens.len();
        let new_len = len + n;
        let last = *seq.table.last().expect("a sequence holds a block");
        assert_ne!(last, RELEASED, "{id}: its last block was released");
        let cow = len % self.bs != 0 && holders[last as usize] > 1;
        let need = self.blocks_for(new_len) - self.blocks_for(len) + cow as usize;
        assert_eq!(bound, Ok(need), "blocks_needed_to_append of one sequence");
        if new_len > self.max_len {
            let e = BlockError::TooManyTokens {
                requested: new_len,
                limit: self.max_len,
            };
            assert_eq!(res, Err(e));
            self.expect_unchanged(&pre, "append");
            self.cov.too_many += 1;
            return;
        }
        if need > avail {
            let e = BlockError::OutOfBlocks {
                needed: need,
                free: avail,
            };
            assert_eq!(res, Err(e));
            self.expect_unchanged(&pre, "append");
            self.cov.out_of_blocks += 1;
            return;
        }
        let slots = res.expect("an append within the pool and the limit must succeed");
        let table = self.m.block_table(id).unwrap().to_vec();
        assert_eq!(table.len(), self.blocks_for(new_len));
        let kept = seq.table.len() - cow as usize;
        assert_eq!(
            &table[..kept],
            &seq.table[..kept],
            "append moved a block it did not copy"
        );
        let want: Vec<u32> = (len..new_len)
            .map(|p| table[p / self.bs] * self.bs as u32 + (p % self.bs) as u32)
            .collect();
        assert_eq!(slots, want, "slots of the appended tokens");
        for &b in &table[kept..] {
            assert_eq!(holders[b as usize], 0, "block {b} was taken while held");
            self.model_take(b);
        }
        let mut want_copies = pre.pending_copies().to_vec();
        if cow {
            want_copies.push([last, table[kept]]);
            self.cov.cow += 1;
        }
        assert_eq!(self.m.pending_copies(), &want_copies[..]);
        assert_eq!(self.m.available_blocks(), avail - need);
        let s = self.model.get_mut(&id).unwrap();
        s.tokens.extend_from_slice(&toks);
        s.table = table;
        s.pending += n;
        self.cov.appended += 1;
    }

    fn op_fork(&mut self, input: &mut Bytes) {
        let id = self.pick_id(input.byte());
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
            let e = BlockError::PendingTokens {
                seq: id,
                pending: seq.pending,
            };
            assert_eq!(res, Err(e));
            self.expect_unchanged(&pre, "fork");
            self.cov.pending_fork += 1;
            return;
        }
        let child = res.expect("a fork of a handed-over sequence must succeed");
        assert!(
            !self.model.contains_key(&child) && !self.dead.contains(&child),
            "handle {child} names another sequence"
        );
        self.last_id = Some(child);
        assert_eq!(self.m.pending_copies(), pre.pending_copies());
        assert_eq!(self.m.available_blocks(), pre.available_blocks());
        self.model.insert(child, seq);
        self.cov.forked += 1;
    }

    fn op_free(&mut self, input: &mut Bytes) {
        let id = self.pick_id(input.byte());
        let pre = self.m.clone();
        let avail = self.m.available_blocks();
        let res = self.m.free(id);
        self.note(format!("free {id} -> {res:?}"));
        let Some(seq) = self.model.remove(&id) else {
            assert_eq!(res, Err(BlockError::UnknownSequence(id)));
            self.expect_unchanged(&pre, "free");
            self.cov.unknown += 1;
            return;
        };
        res.expect("freeing a live sequence must succeed");
        self.dead.push(id);
        if self.history.len() == HISTORY {
            self.history.remove(0);
        }
        self.history.push(seq.tokens.clone());
        let holders = self.holders();
        // Tail blocks first, so that a chain's head outlives its tail in the
        // cache. A copy into a released block is dropped; a released block a
        // remaining copy still reads waits until the copies are handed out.
        let mut copies = pre.pending_copies().to_vec();
        let mut returned = 0;
        for &b in seq.table.iter().rev().filter(|&&b| b != RELEASED) {
            if holders[b as usize] == 0 {
                copies.retain(|c| c[1] != b);
                if copies.iter().any(|c| c[0] == b) {
                    self.awaiting.push(b);
                    self.cov.held_back += 1;
                } else {
                    self.model_release(b);
                    returned += 1;
                }
            }
        }
        assert_eq!(self.m.pending_copies(), &copies[..]);
        assert_eq!(self.m.available_blocks(), avail + returned);
        self.cov.freed += 1;
    }

    fn op_view(&mut self, input: &mut Bytes) {
        let (mask, flags) = (input.byte(), input.byte());
        let mut ids: Vec<SeqId> = self
            .live()
            .into_iter()
            .enumerate()
            .filter(|&(i, _)| mask == 0xFF || mask & (1 << (i % 8)) != 0)
            .map(|(_, id)| id)
            .collect();
        if flags & 1 != 0 {
            ids.reverse();
        }
        if flags & 6 != 0 {
            // A bad entry somewhere: an unknown id or a repeated live one.
            let sel = input.byte();
            let bad = if flags & 2 != 0 && !ids.is_empty() {
                ids[sel as usize % ids.len()]
            } else {
                self.pick_id(sel | 0xC8)
            };
            let at = input.byte() as usize % (ids.len() + 1);
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
        let into = flags & 8 != 0;
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
        assert_eq!(view.copies, pre.pending_copies());
        assert!(self.m.pending_copies().is_empty());
        self.model_copies_taken();
        // Replay on the simulated pool: the copies first, then the new tokens.
        self.apply_copies(&view.copies);
        for (i, id) in ids.iter().enumerate() {
            let seq = self.model.get_mut(id).unwrap();
            let len = seq.tokens.len();
            let slots =
                &view.slot_mapping[view.new_indptr[i] as usize..view.new_indptr[i + 1] as usize];
            for (p, &slot) in (len - seq.pending..len).zip(slots) {
                if slot == SKIP_WRITE {
                    // Only a capped cache hit's token, whose block holds it.
                    assert!(seq.capped && p == len - seq.pending);
                    assert_eq!(
                        self.pool[self.m.slot(*id, p).unwrap() as usize],
                        Some(seq.tokens[p])
                    );
                    continue;
                }
                self.pool[slot as usize] = Some(seq.tokens[p]);
            }
            seq.pending = 0;
            seq.capped = false;
        }
        // Written now: full blocks join the prefix cache unless the block or
        // an equal prefix is cached already.
        if self.prefix {
            for id in &ids {
                let seq = self.model.get_mut(id).unwrap();
                let full = seq.tokens.len() / self.bs;
                offer_to_cache(
                    &mut self.cache,
                    &mut self.block_key,
                    self.bs,
                    seq,
                    seq.hashed..full,
                );
                seq.hashed = full;
            }
        }
        // Every sequence in the batch reads back exactly its own tokens.
        for (i, id) in ids.iter().enumerate() {
            let toks = &self.model[id].tokens;
            let table =
                &view.kv_indices[view.kv_indptr[i] as usize..view.kv_indptr[i + 1] as usize];
            for (p, &t) in toks.iter().enumerate() {
                if table[p / self.bs] == RELEASED {
                    continue;
                }
                let slot = table[p / self.bs] as usize * self.bs + p % self.bs;
                assert_eq!(
                    self.pool[slot],
                    Some(t),
                    "{id} position {p} (slot {slot}) after the view"
                );
            }
        }
        self.cov.views += 1;
        self.cov.views_into += into as usize;
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
            assert_eq!(table, &seq.table[..], "{id}: table in the view");
            let slots = &v.slot_mapping[v.new_indptr[i] as usize..v.new_indptr[i + 1] as usize];
            let want: Vec<u32> = (len - seq.pending..len)
                .map(|p| {
                    if seq.capped && p == len - seq.pending {
                        SKIP_WRITE
                    } else {
                        seq.table[p / self.bs] * self.bs as u32 + (p % self.bs) as u32
                    }
                })
                .collect();
            assert_eq!(slots, &want[..], "{id}: slots of its new tokens");
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

    /// `release_outside_window`: drops the references to blocks wholly
    /// before the window of the oldest pending token, front to back.
    fn op_window(&mut self, input: &mut Bytes) {
        let (sel, wb) = (input.byte(), input.byte());
        let id = self.pick_id(sel);
        let window = match wb {
            0xFF => usize::MAX,
            _ => wb as usize % (self.max_len + 2),
        };
        let pre = self.m.clone();
        let avail = self.m.available_blocks();
        let res = self.m.release_outside_window(id, window);
        self.note(format!("release_outside_window {id} {window} -> {res:?}"));
        let Some(seq) = self.model.get(&id).cloned() else {
            assert_eq!(res, Err(BlockError::UnknownSequence(id)));
            self.expect_unchanged(&pre, "release_outside_window");
            self.cov.unknown += 1;
            return;
        };
        if window == 0 {
            assert_eq!(res, Err(BlockError::ZeroWindow));
            self.expect_unchanged(&pre, "release_outside_window");
            self.cov.zero_window += 1;
            return;
        }
        // The window of the oldest query still to run (the first pending
        // token, else the next one appended).
        let keep_from = (seq.tokens.len() - seq.pending.saturating_sub(1)).saturating_sub(window);
        let dead = keep_from / self.bs;
        let victims: Vec<usize> = (0..dead).filter(|&i| seq.table[i] != RELEASED).collect();
        assert_eq!(res, Ok(victims.len()), "blocks released");
        if victims.is_empty() {
            self.expect_unchanged(&pre, "a release of nothing");
            return;
        }
        let mut copies = pre.pending_copies().to_vec();
        let mut returned = 0;
        for i in victims {
            let b = {
                let s = self.model.get_mut(&id).unwrap();
                std::mem::replace(&mut s.table[i], RELEASED)
            };
            if self.holders()[b as usize] == 0 {
                copies.retain(|c| c[1] != b);
                if copies.iter().any(|c| c[0] == b) {
                    self.awaiting.push(b);
                    self.cov.held_back += 1;
                } else {
                    self.model_release(b);
                    returned += 1;
                }
            }
            self.cov.window_released += 1;
        }
        assert_eq!(self.m.pending_copies(), &copies[..]);
        assert_eq!(self.m.available_blocks(), avail + returned);
    }

    /// Read-only calls: `slot` (in and out of range) and
    /// `blocks_needed_to_append` over a subset, whose bound is then tried on
    /// a copy of the manager: when it fits the free blocks, every append
    /// succeeds and together they take at most that many blocks.
    fn op_query(&mut self, input: &mut Bytes) {
        let (sel, pos, mask, nb) = (input.byte(), input.byte(), input.byte(), input.byte());
        let id = self.pick_id(sel);
        let pos = if pos == 0xFF {
            usize::MAX
        } else {
            pos as usize
        };
        let r = self.m.slot(id, pos);
        match self.model.get(&id) {
            None => {
                assert_eq!(r, Err(BlockError::UnknownSequence(id)));
                self.cov.unknown += 1;
            }
            Some(s) if pos >= s.tokens.len() => {
                let e = BlockError::PositionOutOfRange {
                    pos,
                    len: s.tokens.len(),
                };
                assert_eq!(r, Err(e));
                self.cov.position_out_of_range += 1;
            }
            Some(s) if s.table[pos / self.bs] == RELEASED => {
                assert_eq!(r, Err(BlockError::PositionReleased { pos }));
                self.cov.position_released += 1;
            }
            Some(s) => {
                let want = s.table[pos / self.bs] * self.bs as u32 + (pos % self.bs) as u32;
                assert_eq!(r, Ok(want));
            }
        }
        let ids: Vec<SeqId> = self
            .live()
            .into_iter()
            .enumerate()
            .filter(|&(i, _)| mask & (1 << (i % 8)) != 0)
            .map(|(_, id)| id)
            .collect();
        let n = if nb == 0xFF {
            usize::MAX
        } else {
            nb as usize % (2 * self.bs + 1)
        };
        let bound = self.m.blocks_needed_to_append(&ids, n);
        self.note(format!(
            "query slot({id}, {pos}) -> {r:?}; bound {ids:?} +{n} -> {bound:?}"
        ));
        let bound = bound.expect("a bound over live sequences");
        let fits = |s: &ModelSeq| s.tokens.len().saturating_add(n) <= self.max_len;
        if n == usize::MAX
            || bound > self.m.available_blocks()
            || !ids.iter().all(|id| fits(&self.model[id]))
        {
            return;
        }
        let mut trial = self.m.clone();
        let before = trial.available_blocks();
        for &id in &ids {
            let toks = vec![0; n];
            trial.append(id, &toks).unwrap_or_else(|e| {
                panic!("append of {n} to {id} within the bound {bound} failed: {e}")
            });
        }
        let taken = before - trial.available_blocks();
        assert!(
            taken <= bound,
            "appends took {taken} blocks, over the bound {bound}"
        );
        self.cov.bound_tried += 1;
    }

    fn host_free(&self) -> usize {
        self.host_refs.iter().filter(|&&r| r == 0).count()
    }

    /// A group for a swap: `n` picks, each a live, swapped, freed or
    /// foreign handle.
    fn pick_group(&self, input: &mut Bytes, prefer_swapped: bool) -> Vec<SeqId> {
        let n = 1 + input.byte() as usize % 3;
        let swapped: Vec<SeqId> = self.swapped.keys().copied().collect();
        (0..n)
            .map(|_| {
                let b = input.byte();
                if prefer_swapped && b < 200 && !swapped.is_empty() {
                    swapped[b as usize % swapped.len()]
                } else {
                    self.pick_id(b)
                }
            })
            .collect()
    }

    /// The error a group call predicts: the first unknown id, or one
    /// swapped (or not) against `want_swapped`, then the first repeat.
    fn group_error(&self, group: &[SeqId], want_swapped: bool) -> Option<BlockError> {
        let mut seen = HashSet::new();
        for &id in group {
            let resident = self.model.contains_key(&id);
            let swapped = self.swapped.contains_key(&id);
            if !resident && !swapped {
                return Some(BlockError::UnknownSequence(id));
            }
            if swapped != want_swapped {
                return Some(if want_swapped {
                    BlockError::NotSwapped(id)
                } else {
                    BlockError::Swapped(id)
                });
            }
            if !seen.insert(id) {
                return Some(BlockError::DuplicateInBatch(id));
            }
        }
        None
    }

    /// A swap the model says fails with `err`: the manager returned that
    /// error and changed nothing. Whether it was refused.
    fn swap_refused(
        &mut self,
        res: &Result<Vec<[u32; 2]>, BlockError>,
        err: Option<BlockError>,
        pre: &BlockManager,
        what: &str,
    ) -> bool {
        let Some(e) = err else { return false };
        self.cov.unknown += matches!(e, BlockError::UnknownSequence(_)) as usize;
        self.cov.duplicate += matches!(e, BlockError::DuplicateInBatch(_)) as usize;
        assert_eq!(*res, Err(e));
        self.expect_unchanged(pre, what);
        true
    }

    fn op_swap_out(&mut self, input: &mut Bytes) {
        let group = self.pick_group(input, false);
        let pre = self.m.clone();
        let res = self.m.swap_out(&group);
        self.note(format!("swap_out {group:?} -> {res:?}"));
        let mut err = self.group_error(&group, false);
        if err.is_none() && !pre.pending_copies().is_empty() {
            err = Some(BlockError::CopiesPending(pre.pending_copies().len()));
            self.cov.copies_pending += 1;
        }
        let mut distinct = Vec::new();
        if err.is_none() {
            for id in &group {
                for &b in &self.model[id].table {
                    if b != RELEASED && !distinct.contains(&b) {
                        distinct.push(b);
                    }
                }
            }
            if distinct.len() > self.host_free() {
                err = Some(BlockError::SwapSpaceFull {
                    needed: distinct.len(),
                    free: self.host_free(),
                });
                self.cov.swap_full += 1;
            }
        }
        if self.swap_refused(&res, err, &pre, "swap_out") {
            return;
        }
        let pairs = res.expect("a swap-out that fits must succeed");
        assert_eq!(pairs.iter().map(|p| p[0]).collect::<Vec<_>>(), distinct);
        let bs = self.bs;
        let mut map = HashMap::new();
        for &[b, h] in &pairs {
            assert!((h as usize) < self.host_refs.len() && self.host_refs[h as usize] == 0);
            assert!(!map.values().any(|&x| x == h), "host block {h} given twice");
            map.insert(b, h);
            for i in 0..bs {
                self.host[h as usize * bs + i] = self.pool[b as usize * bs + i];
            }
        }
        // References drop in the manager's order: group, then table order.
        let mut holders = self.holders();
        for &id in &group {
            let mut seq = self.model.remove(&id).expect("checked");
            for b in seq.table.iter_mut().filter(|b| **b != RELEASED) {
                let h = map[b];
                self.host_refs[h as usize] += 1;
                holders[*b as usize] -= 1;
                if holders[*b as usize] == 0 {
                    self.model_release(*b);
                }
                *b = h;
            }
            self.swapped.insert(id, seq);
        }
        self.cov.swapped_out += 1;
    }

    fn op_swap_in(&mut self, input: &mut Bytes) {
        let flag = input.byte();
        if flag & 7 == 0 && !self.swapped.is_empty() {
            // Free a swapped-out sequence: its host blocks go back.
            let id = *self
                .swapped
                .keys()
                .nth(flag as usize / 8 % self.swapped.len())
                .expect("non-empty");
            let pre_avail = self.m.available_blocks();
            self.m.free(id).expect("a swapped sequence can be freed");
            self.note(format!("free swapped {id}"));
            let seq = self.swapped.remove(&id).expect("picked");
            for &h in seq.table.iter().filter(|&&h| h != RELEASED) {
                self.host_refs[h as usize] -= 1;
            }
            assert_eq!(self.m.available_blocks(), pre_avail);
            self.dead.push(id);
            self.cov.freed_swapped += 1;
            return;
        }
        let group = self.pick_group(input, true);
        let pre = self.m.clone();
        let res = self.m.swap_in(&group);
        self.note(format!("swap_in {group:?} -> {res:?}"));
        let mut err = self.group_error(&group, true);
        self.cov.not_swapped += matches!(err, Some(BlockError::NotSwapped(_))) as usize;
        let mut distinct = Vec::new();
        if err.is_none() {
            for id in &group {
                for &h in &self.swapped[id].table {
                    if h != RELEASED && !distinct.contains(&h) {
                        distinct.push(h);
                    }
                }
            }
            let free = self.free.len() + self.evictable.len();
            if distinct.len() > free {
                err = Some(BlockError::OutOfBlocks {
                    needed: distinct.len(),
                    free,
                });
                self.cov.out_of_blocks += 1;
            }
        }
        if self.swap_refused(&res, err, &pre, "swap_in") {
            return;
        }
        let pairs = res.expect("a swap-in that fits must succeed");
        assert_eq!(pairs.iter().map(|p| p[0]).collect::<Vec<_>>(), distinct);
        let bs = self.bs;
        let map: HashMap<u32, u32> = pairs.iter().map(|p| (p[0], p[1])).collect();
        let mut taken = 0;
        for &id in &group {
            let mut seq = self.swapped.remove(&id).expect("checked");
            for h in seq.table.iter_mut().filter(|h| **h != RELEASED) {
                let b = map[h];
                if pairs[taken..].first().is_some_and(|p| p[1] == b) {
                    // First use of this host block: a block taken now.
                    self.model_take(b);
                    for i in 0..bs {
                        self.pool[b as usize * bs + i] = self.host[*h as usize * bs + i];
                    }
                    taken += 1;
                }
                self.host_refs[*h as usize] -= 1;
                *h = b;
            }
            // Full blocks go back to the cache where their prefix is not cached.
            if self.prefix {
                offer_to_cache(
                    &mut self.cache,
                    &mut self.block_key,
                    bs,
                    &seq,
                    0..seq.hashed,
                );
            }
            self.model.insert(id, seq);
        }
        assert_eq!(taken, pairs.len());
        self.cov.swapped_in += 1;
    }

    /// Every pool call on a swapped-out sequence is refused, changing nothing.
    fn op_swapped_calls(&mut self, input: &mut Bytes) {
        let sel = input.byte() as usize;
        let Some(&id) = self.swapped.keys().nth(sel % self.swapped.len().max(1)) else {
            return self.op_query(input);
        };
        let pre = self.m.clone();
        let want = BlockError::Swapped(id);
        assert_eq!(self.m.append(id, &[1]), Err(want.clone()));
        assert_eq!(self.m.fork(id), Err(want.clone()));
        assert_eq!(self.m.plan_step(&[(id, 1)]), Err(want.clone()));
        assert_eq!(self.m.block_table(id), Err(want.clone()));
        assert_eq!(self.m.slot(id, 0), Err(want.clone()));
        assert_eq!(self.m.release_outside_window(id, 1), Err(want.clone()));
        assert_eq!(self.m.blocks_needed_to_append(&[id], 1), Err(want.clone()));
        assert_eq!(self.m.batch_view(&[id]), Err(want));
        assert_eq!(self.m.is_swapped(id), Ok(true));
        self.expect_unchanged(&pre, "calls on a swapped sequence");
        self.cov.swapped_refused += 1;
    }

    /// A chunked step: `plan_step` with a token budget per sequence (it
    /// changes nothing), sometimes a stale commit on a changed copy
    /// (refused), then `commit_step`.
    fn op_chunk(&mut self, input: &mut Bytes) {
        let mask = input.byte();
        let ids: Vec<SeqId> = self
            .live()
            .into_iter()
            .enumerate()
            .filter(|&(i, _)| mask & (1 << (i % 8)) != 0)
            .map(|(_, id)| id)
            .collect();
        let bs = self.bs;
        let batch: Vec<(SeqId, usize)> = ids
            .iter()
            .map(|&id| (id, input.byte() as usize % (2 * bs + 2)))
            .collect();
        let pre = self.m.clone();
        let plan = self
            .m
            .plan_step(&batch)
            .expect("distinct resident sequences");
        self.note(format!("plan_step {batch:?} -> chunks {:?}", plan.chunks()));
        self.expect_unchanged(&pre, "plan_step");
        let v = &plan.view();
        assert_eq!(v.copies, pre.pending_copies());
        for (i, &(id, budget)) in batch.iter().enumerate() {
            let seq = &self.model[&id];
            let len = seq.tokens.len();
            let first = len - seq.pending;
            let chunk = seq.pending.min(budget);
            let end = first + chunk;
            assert_eq!(plan.chunks()[i], chunk);
            assert_eq!(plan.completes()[i], chunk == seq.pending);
            assert_eq!(v.seq_lens[i] as usize, end);
            let table = &v.kv_indices[v.kv_indptr[i] as usize..v.kv_indptr[i + 1] as usize];
            assert_eq!(table, &seq.table[..self.blocks_for(end)]);
            let slots = &v.slot_mapping[v.new_indptr[i] as usize..v.new_indptr[i + 1] as usize];
            let want: Vec<u32> = (first..end)
                .map(|p| {
                    if seq.capped && p == first {
                        SKIP_WRITE
                    } else {
                        seq.table[p / bs] * bs as u32 + (p % bs) as u32
                    }
                })
                .collect();
            assert_eq!(slots, &want[..], "{id}: chunk slots");
        }
        if input.byte() & 1 == 1 {
            let mut other = self.m.clone();
            if other.add_sequence(&[0]).is_ok() {
                let before = other.clone();
                assert_eq!(other.commit_step(&plan), Err(BlockError::StalePlan));
                assert!(other == before, "a stale commit changed the manager");
                self.cov.stale_plans += 1;
            }
        }
        self.m.commit_step(&plan).expect("a fresh plan commits");
        assert!(self.m.pending_copies().is_empty());
        self.model_copies_taken();
        self.apply_copies(&plan.view().copies);
        for (i, &(id, _)) in batch.iter().enumerate() {
            let seq = self.model.get_mut(&id).expect("live");
            let len = seq.tokens.len();
            let first = len - seq.pending;
            let slots = &plan.view().slot_mapping
                [plan.view().new_indptr[i] as usize..plan.view().new_indptr[i + 1] as usize];
            for (p, &slot) in (first..).zip(slots) {
                if slot != SKIP_WRITE {
                    self.pool[slot as usize] = Some(seq.tokens[p]);
                }
            }
            let chunk = plan.chunks()[i];
            seq.pending -= chunk;
            if chunk > 0 {
                seq.capped = false;
            }
            if self.prefix {
                let full = (len - seq.pending) / bs;
                offer_to_cache(
                    &mut self.cache,
                    &mut self.block_key,
                    bs,
                    seq,
                    seq.hashed..full,
                );
                seq.hashed = seq.hashed.max(full);
            }
        }
        self.cov.chunked += 1;
    }

    /// Swapped-out sequences: their host blocks hold what their handed-over
    /// positions held, and host references add up.
    fn check_swapped(&self) {
        let bs = self.bs;
        let mut refs = vec![0usize; self.host_refs.len()];
        for (id, seq) in &self.swapped {
            assert_eq!(self.m.is_swapped(*id), Ok(true));
            assert_eq!(self.m.tokens(*id).unwrap(), &seq.tokens[..]);
            assert_eq!(self.m.pending_tokens(*id).unwrap(), seq.pending);
            let len = seq.tokens.len();
            for (i, &h) in seq.table.iter().enumerate() {
                if h == RELEASED {
                    continue;
                }
                refs[h as usize] += 1;
                for p in i * bs..((i + 1) * bs).min(len - seq.pending) {
                    assert_eq!(
                        self.host[h as usize * bs + p % bs],
                        Some(seq.tokens[p]),
                        "{id} position {p} in host block {h}"
                    );
                }
            }
        }
        assert_eq!(refs, self.host_refs, "host block references");
        let s = self.m.stats();
        assert_eq!(s.swapped_sequences, self.swapped.len());
        assert_eq!(s.swap_used, refs.iter().filter(|&&r| r > 0).count());
        assert_eq!(self.m.swap_free_blocks(), self.host_free());
    }

    /// Invariants that hold between any two calls.
    fn check(&self) {
        let (bs, nb) = (self.bs, self.nb);
        let mut all: Vec<SeqId> = self.live();
        all.extend(self.swapped.keys().copied());
        all.sort();
        assert_eq!(self.m.sequence_ids(), all);
        assert_eq!(
            self.m.num_sequences(),
            self.model.len() + self.swapped.len()
        );
        self.check_swapped();
        let holders = self.holders();
        for (b, &h) in holders.iter().enumerate() {
            assert_eq!(
                self.m.ref_count(b as u32),
                Some(h as u32),
                "ref count of block {b}"
            );
        }
        assert_eq!(self.m.ref_count(nb as u32), None);
        let copies = self.m.pending_copies();
        let copy_dsts: HashSet<u32> = copies.iter().map(|c| c[1]).collect();
        assert_eq!(
            copy_dsts.len(),
            copies.len(),
            "two copies into one block: {copies:?}"
        );
        let mut pending_blocks = HashSet::new();
        let mut filled = vec![0usize; nb];
        let mut expect: Vec<Option<u32>> = vec![None; nb * bs];
        let mut logical = 0;
        for (&id, seq) in &self.model {
            let len = seq.tokens.len();
            logical += len;
            assert_eq!(
                self.m.block_table(id).unwrap(),
                &seq.table[..],
                "{id}: block table"
            );
            assert_eq!(self.m.tokens(id).unwrap(), &seq.tokens[..]);
            assert_eq!(self.m.seq_len(id).unwrap(), len);
            assert_eq!(
                self.m.pending_tokens(id).unwrap(),
                seq.pending,
                "{id}: pending tokens"
            );
            assert!(len >= 1 && len <= self.max_len);
            assert_eq!(
                seq.table.len(),
                self.blocks_for(len),
                "{id}: blocks for {len} tokens"
            );
            // Released entries (a sliding window's) form a prefix of the table.
            let released = seq.table.iter().take_while(|&&b| b == RELEASED).count();
            let held = &seq.table[released..];
            assert!(!held.is_empty(), "{id}: every block released");
            let distinct: HashSet<u32> = held.iter().copied().collect();
            assert_eq!(
                distinct.len(),
                held.len(),
                "{id} holds a block twice, or a released entry after a held one: {:?}",
                seq.table
            );
            for (i, &b) in seq.table.iter().enumerate().skip(released) {
                assert!((b as usize) < nb);
                filled[b as usize] = filled[b as usize].max((len - i * bs).min(bs));
            }
            for (p, &t) in seq.tokens.iter().enumerate() {
                let b = seq.table[p / bs];
                if b == RELEASED {
                    assert!(p < len - seq.pending, "{id}: pending position {p} released");
                    continue;
                }
                let slot = b as usize * bs + p % bs;
                if p >= len - seq.pending && !(seq.capped && p == len - seq.pending) {
                    assert_eq!(
                        holders[b as usize], 1,
                        "{id} will write position {p} into shared block {b}"
                    );
                    pending_blocks.insert(b);
                }
                match expect[slot] {
                    Some(other) => {
                        assert_eq!(other, t, "slot {slot} is position {p} of {id} and another sequence's different token");
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
            assert!(
                !copy_dsts.contains(&src),
                "block {src} is a copy source and destination: {copies:?}"
            );
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
        assert_eq!(s.sequences, self.model.len() + self.swapped.len());
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
            assert_eq!(self.m.prefix_hit_tokens(), 0);
        }
    }
}
