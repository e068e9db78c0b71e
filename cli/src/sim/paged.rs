//! The paged policy: a pool of fixed-size blocks driven through the crate's
//! real [`BlockManager`], so the simulator's numbers are those of the same
//! bookkeeping the GPU path uses.

use std::collections::BTreeMap;

use super::engine::{Live, Seq};
use super::memory::{Counters, EndState, Mem, Memory};
use super::workload::Request;
use super::SimError;
use pagedattn::blocks::{BatchView, BlockError, BlockManager, BlockManagerConfig, SeqId};

fn internal(what: &str, e: BlockError) -> SimError {
    SimError::Internal(format!("{what}: {e}"))
}

/// The paged policy: every operation goes through a real [`BlockManager`],
/// so the numbers are those of the crate's own bookkeeping.
pub(super) struct Paged {
    m: BlockManager,
    bs: usize,
    view: BatchView,
    ids: Vec<SeqId>,
    counters: Counters,
    /// Blocks admission leaves free while others run.
    watermark: usize,
}

impl Paged {
    /// A pool of `budget / block_size` blocks.
    pub fn new(
        budget: usize,
        block_size: u32,
        prefix_caching: bool,
        max_len: usize,
    ) -> Result<Self, SimError> {
        let num_blocks = u32::try_from(budget / block_size as usize)
            .map_err(|_| SimError::Config(format!("budget {budget} is too large")))?;
        let mut cfg =
            BlockManagerConfig::new(num_blocks, block_size).with_prefix_caching(prefix_caching);
        cfg.max_seq_len = max_len;
        let m = BlockManager::new(cfg).map_err(|e| SimError::Config(e.to_string()))?;
        Ok(Self {
            m,
            bs: block_size as usize,
            view: BatchView::default(),
            ids: Vec::new(),
            counters: Counters::default(),
            watermark: (num_blocks as usize / 100).max(1),
        })
    }

    /// Slots in the pool.
    pub fn capacity(&self) -> usize {
        self.m.config().num_blocks as usize * self.bs
    }

    fn take_view(&mut self, ids: &[SeqId]) -> Result<(), BlockError> {
        self.m.batch_view_into(ids, &mut self.view)?;
        self.count_copies();
        Ok(())
    }

    fn count_copies(&mut self) {
        let copies = &self.view.copies;
        self.counters.cow_copies += copies.len() as u64;
        if copies.len() > 1 {
            let mut srcs: Vec<u32> = copies.iter().map(|c| c[0]).collect();
            let mut dsts: Vec<u32> = copies.iter().map(|c| c[1]).collect();
            srcs.sort_unstable();
            dsts.sort_unstable();
            let dup_dst = dsts.windows(2).any(|w| w[0] == w[1]);
            let overlap = dsts.iter().any(|d| srcs.binary_search(d).is_ok());
            if dup_dst || overlap {
                self.counters.copy_conflicts += 1;
            }
        }
    }

    /// Prefill: the prompt once, a fork per further sequence (so they share
    /// it), then each sequence's own generated tail, each followed by a view.
    /// A recomputed beam request thus shares only its prompt, not the history
    /// its beams had in common before the preemption: a little pessimistic.
    fn try_admit(
        &mut self,
        req: &Request,
        live: &Live,
        made: &mut Vec<SeqId>,
    ) -> Result<(), BlockError> {
        let first = self.m.add_sequence(&req.prompt)?;
        made.push(first);
        self.take_view(&[first])?;
        for _ in 1..live.seqs.len() {
            made.push(self.m.fork(first)?);
        }
        let mut any_tail = false;
        for (s, &id) in live.seqs.iter().zip(made.iter()) {
            if !s.tail.is_empty() {
                self.m.append(id, &s.tail)?;
                any_tail = true;
            }
        }
        if any_tail {
            let ids = made.clone();
            self.take_view(&ids)?;
        }
        Ok(())
    }

    fn handle(s: &Seq) -> Result<SeqId, SimError> {
        s.handle
            .ok_or_else(|| SimError::Internal("running sequence without a block table".into()))
    }
}

impl Memory for Paged {
    fn admit(&mut self, req: &Request, live: &mut Live, busy: bool) -> Result<bool, SimError> {
        let mut made = Vec::with_capacity(live.seqs.len());
        let mut result = self.try_admit(req, live, &mut made);
        if result.is_ok() && busy && self.m.available_blocks() < self.watermark {
            // Leave the running requests room to decode (vLLM's 1 % watermark),
            // or every admission would be followed by a preemption.
            result = Err(BlockError::OutOfBlocks {
                needed: self.watermark,
                free: self.m.available_blocks(),
            });
        }
        match result {
            Ok(()) => {
                for (s, id) in live.seqs.iter_mut().zip(made) {
                    s.handle = Some(id);
                }
                Ok(true)
            }
            Err(BlockError::OutOfBlocks { .. }) => {
                // Roll back: `free` always succeeds on a live sequence.
                for id in made {
                    self.m.free(id).map_err(|e| internal("rollback", e))?;
                }
                Ok(false)
            }
            Err(e) => Err(internal("admit", e)),
        }
    }

    fn fork(&mut self, _req: &Request, live: &mut Live, parent: usize) -> Result<Seq, SimError> {
        let p = &live.seqs[parent];
        let id = self
            .m
            .fork(Self::handle(p)?)
            .map_err(|e| internal("fork", e))?;
        Ok(Seq {
            handle: Some(id),
            tail: p.tail.clone(),
            target: p.target,
            reserved: 0,
        })
    }

    fn free_seq(&mut self, _: &Request, _: &mut Live, seq: Seq, _: bool) -> Result<(), SimError> {
        self.m
            .free(Self::handle(&seq)?)
            .map_err(|e| internal("free", e))
    }

    fn release(&mut self, _req: &Request, live: &mut Live) -> Result<(), SimError> {
        for s in &mut live.seqs {
            if let Some(id) = s.handle.take() {
                self.m.free(id).map_err(|e| internal("release", e))?;
            }
        }
        Ok(())
    }

    /// Exact block demand of one decode step. Sequences whose last block is
    /// full each need a new block. Sequences sharing a partly filled last
    /// block (just forked) copy it on write, except the last writer, which
    /// finds itself sole owner, unless someone outside the group also holds it.
    fn fits_step(&self, _req: &Request, live: &Live) -> Result<bool, SimError> {
        let mut need = 0usize;
        let mut groups: BTreeMap<u32, usize> = BTreeMap::new();
        for s in &live.seqs {
            let id = Self::handle(s)?;
            let len = self.m.seq_len(id).map_err(|e| internal("seq_len", e))?;
            if len % self.bs == 0 {
                need += 1;
            } else {
                let table = self.m.block_table(id).map_err(|e| internal("table", e))?;
                *groups.entry(*table.last().expect("non-empty")).or_default() += 1;
            }
        }
        for (b, writers) in groups {
            let rc = self.m.ref_count(b).unwrap_or(0) as usize;
            need += if rc > writers { writers } else { writers - 1 };
        }
        Ok(need <= self.m.available_blocks())
    }

    fn append(
        &mut self,
        _: &Request,
        live: &mut Live,
        idx: usize,
        tok: u32,
    ) -> Result<(), SimError> {
        let id = Self::handle(&live.seqs[idx])?;
        self.m
            .append(id, &[tok])
            .map_err(|e| internal("append", e))?;
        Ok(())
    }

    fn end_step(&mut self, running: &[Live]) -> Result<(), SimError> {
        let mut ids = std::mem::take(&mut self.ids);
        ids.clear();
        for l in running {
            for s in &l.seqs {
                ids.push(Self::handle(s)?);
            }
        }
        self.take_view(&ids)
            .map_err(|e| internal("batch_view", e))?;
        self.ids = ids;
        // What attention reads this step, plain and with the cascade.
        let v = &self.view;
        if !v.seq_lens.is_empty() {
            let t = pagedattn::gpu::find_segments(
                self.m.config().num_blocks,
                self.bs as u32,
                &v.kv_indptr,
                &v.kv_indices,
                &v.seq_lens,
                pagedattn::gpu::CASCADE_CHUNK_TOKENS / self.bs as u32,
            );
            self.counters.attn_tokens_plain += t.plain_tokens;
            self.counters.attn_tokens_cascade += t.cascade_tokens;
        }
        // The view already took every pending copy; anything left is a bug.
        let stray = self.m.take_copies();
        if !stray.is_empty() {
            return Err(SimError::Internal(format!(
                "{} copies left after a batch view",
                stray.len()
            )));
        }
        Ok(())
    }

    fn snapshot(&self, reqs: &[Request], running: &[Live]) -> Result<Mem, SimError> {
        let st = self.m.stats();
        // Empty slots of partly filled last blocks that their sequences will
        // still write count as reserved; the rest is internal fragmentation.
        let mut tails: BTreeMap<u32, (usize, usize)> = BTreeMap::new();
        for l in running {
            let plen = reqs[l.req].prompt.len();
            for s in &l.seqs {
                let fill = (plen + s.tail.len()) % self.bs;
                if fill == 0 {
                    continue;
                }
                let id = Self::handle(s)?;
                let table = self.m.block_table(id).map_err(|e| internal("table", e))?;
                let e = tails.entry(*table.last().expect("non-empty")).or_default();
                e.0 = self.bs - fill;
                e.1 = e.1.max(s.target - s.tail.len());
            }
        }
        let reserved = tails.values().map(|&(empty, left)| empty.min(left)).sum();
        Ok(Mem {
            held: st.capacity_held,
            stored: st.tokens_stored,
            logical: st.logical_tokens,
            reserved,
        })
    }

    fn counters(&self) -> Counters {
        Counters {
            prefix_hit_tokens: self.m.prefix_hit_tokens(),
            ..self.counters
        }
    }

    fn finish(&mut self) -> EndState {
        self.m.evict_all_cached();
        let st = self.m.stats();
        EndState {
            leaked: st.capacity_held,
            blocks: Some((st.free, st.total)),
        }
    }
}
