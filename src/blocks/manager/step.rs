//! A step planned and committed: its slots, copies and tables (`StepPlan`, the batch view).

use super::*;

impl BlockManager {
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
        self.check_plan(plan)?;
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

    /// Whether [`commit_step`](Self::commit_step) would take `plan`.
    pub(crate) fn check_plan(&self, plan: &StepPlan) -> Result<(), BlockError> {
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
