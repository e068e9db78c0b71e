//! The memory policies the scheduler runs against: the interface, and the
//! contiguous per-sequence reservations (max length, or the oracle's exact
//! final length). The paged pool is in `paged`.
//!
//! The scheduler in `engine` is the same for every policy; only these
//! operations differ, so any gap between policies in the report comes from
//! memory alone.

use super::live::{Live, Seq};
use super::workload::{Request, Sampling};
use super::SimError;

/// Memory state at the end of a step, in token slots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Mem {
    /// Slots held (blocks in use times block size, or reservations).
    pub held: usize,
    /// Distinct slots holding a token (a shared token counts once).
    pub stored: usize,
    /// Sum of sequence lengths (a shared token counts once per sequence).
    pub logical: usize,
    /// Held but empty slots that a live sequence will still fill.
    pub reserved: usize,
}

/// Counters kept by a policy over a whole run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Counters {
    /// Copy-on-write block copies handed out.
    pub cow_copies: u64,
    /// Batches whose copy list used one block both as a source and a
    /// destination (or as two destinations): a parallel copy kernel would race.
    pub copy_conflicts: u64,
    /// Prompt tokens served from the prefix cache.
    pub prefix_hit_tokens: u64,
    /// Paged only: K/V tokens decode attention reads over the run, plain
    /// paged decode (every sequence's whole context) and cascade decode
    /// (shared full-block prefixes once: `gpu::find_segments`).
    pub attn_tokens_plain: u64,
    pub attn_tokens_cascade: u64,
}

/// What is left once every request has finished.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct EndState {
    /// Slots still held (must be 0).
    pub leaked: usize,
    /// Paged only: (free blocks, total blocks) after dropping cached blocks.
    pub blocks: Option<(usize, usize)>,
}

/// Memory operations of one policy. Each error is a bug in the simulator or
/// the block manager, never a normal outcome: "does not fit" is `Ok(false)`.
pub(super) trait Memory {
    /// Allocates a waiting request's sequences (prompt, then any tokens it
    /// generated before a preemption). `Ok(false)`, with nothing changed,
    /// if it does not fit now. `busy`: other requests are running, so the
    /// policy may keep headroom for their decoding.
    fn admit(&mut self, req: &Request, live: &mut Live, busy: bool) -> Result<bool, SimError>;
    /// A new sequence sharing everything `live.seqs[parent]` holds.
    fn fork(&mut self, req: &Request, live: &mut Live, parent: usize) -> Result<Seq, SimError>;
    /// Frees one sequence. A pruned beam's contiguous reservation stays with
    /// the request for the beam that will replace it.
    fn free_seq(
        &mut self,
        req: &Request,
        live: &mut Live,
        seq: Seq,
        pruned: bool,
    ) -> Result<(), SimError>;
    /// Frees everything the request holds (finish or preemption); its
    /// sequences keep their tokens so that it can be recomputed.
    fn release(&mut self, req: &Request, live: &mut Live) -> Result<(), SimError>;
    /// Whether every sequence of `live` can append one token now.
    fn fits_step(&self, req: &Request, live: &Live) -> Result<bool, SimError>;
    /// Appends one token to `live.seqs[idx]`; `fits_step` said it fits.
    fn append(
        &mut self,
        req: &Request,
        live: &mut Live,
        idx: usize,
        token: u32,
    ) -> Result<(), SimError>;
    /// Hands the step's new tokens to the "GPU" (paged: one batch view).
    fn end_step(&mut self, running: &[Live]) -> Result<(), SimError>;
    /// Memory now.
    fn snapshot(&self, reqs: &[Request], running: &[Live]) -> Result<Mem, SimError>;
    /// Run-long counters.
    fn counters(&self) -> Counters;
    /// Called once the workload is done.
    fn finish(&mut self) -> EndState;
}

/// Contiguous reservation per sequence, as in systems before vLLM: each
/// sequence gets one slab sized up front, and no memory is ever shared.
/// External fragmentation between slabs is not modelled, which flatters
/// these policies.
pub(super) struct Contiguous {
    exact: bool,
    sampling: Sampling,
    budget: usize,
    held: usize,
    stored: usize,
}

impl Contiguous {
    /// `exact`: reserve each sequence's true final length (the oracle);
    /// otherwise `prompt + max_output` (max-length reservation).
    pub fn new(budget: usize, exact: bool, sampling: Sampling) -> Self {
        Self {
            exact,
            sampling,
            budget,
            held: 0,
            stored: 0,
        }
    }

    fn slab(&self, req: &Request, target: usize) -> usize {
        if self.exact {
            req.prompt.len() + target
        } else {
            req.reserve_max
        }
    }
}

fn seq_len(req: &Request, s: &Seq) -> usize {
    req.prompt.len() + s.tail.len()
}

impl Memory for Contiguous {
    fn admit(&mut self, req: &Request, live: &mut Live, _busy: bool) -> Result<bool, SimError> {
        let (need, parked) = match self.sampling {
            Sampling::Parallel(_) => (live.seqs.iter().map(|s| self.slab(req, s.target)).sum(), 0),
            // Every beam slab is reserved at admission: the beams appear
            // at the first decode step and are copied into each other's slabs.
            Sampling::Beam(k) => {
                let slab = self.slab(req, live.seqs[0].target);
                (k * slab, (k - live.seqs.len()) * slab)
            }
        };
        if self.held + need > self.budget {
            return Ok(false);
        }
        for s in &mut live.seqs {
            s.reserved = self.slab(req, s.target);
            self.stored += seq_len(req, s);
        }
        live.parked = parked;
        self.held += need;
        Ok(true)
    }

    fn fork(&mut self, req: &Request, live: &mut Live, parent: usize) -> Result<Seq, SimError> {
        let p = &live.seqs[parent];
        let slab = p.reserved;
        if live.parked < slab {
            return Err(SimError::Internal("beam fork without a free slab".into()));
        }
        live.parked -= slab;
        self.stored += seq_len(req, p);
        Ok(Seq {
            tail: p.tail.clone(),
            target: p.target,
            reserved: slab,
        })
    }

    fn free_seq(
        &mut self,
        req: &Request,
        live: &mut Live,
        seq: Seq,
        pruned: bool,
    ) -> Result<(), SimError> {
        self.stored -= seq_len(req, &seq);
        if pruned {
            live.parked += seq.reserved;
        } else {
            self.held -= seq.reserved;
        }
        Ok(())
    }

    fn release(&mut self, req: &Request, live: &mut Live) -> Result<(), SimError> {
        for s in &mut live.seqs {
            self.stored -= req.prompt.len() + s.tail.len();
            self.held -= s.reserved;
            s.reserved = 0;
        }
        self.held -= live.parked;
        live.parked = 0;
        Ok(())
    }

    fn fits_step(&self, _req: &Request, _live: &Live) -> Result<bool, SimError> {
        Ok(true)
    }

    fn append(&mut self, _: &Request, _: &mut Live, _: usize, _: u32) -> Result<(), SimError> {
        self.stored += 1;
        Ok(())
    }

    fn end_step(&mut self, _running: &[Live]) -> Result<(), SimError> {
        Ok(())
    }

    fn snapshot(&self, _reqs: &[Request], running: &[Live]) -> Result<Mem, SimError> {
        let reserved = running
            .iter()
            .map(|l| {
                l.parked
                    + l.seqs
                        .iter()
                        .map(|s| s.target - s.tail.len())
                        .sum::<usize>()
            })
            .sum();
        Ok(Mem {
            held: self.held,
            stored: self.stored,
            logical: self.stored,
            reserved,
        })
    }

    fn counters(&self) -> Counters {
        Counters::default()
    }

    fn finish(&mut self) -> EndState {
        EndState {
            leaked: self.held,
            blocks: None,
        }
    }
}
