//! Host-side bookkeeping of the paged KV cache: the physical block pool,
//! per-sequence block tables, reference counts, copy-on-write and prefix
//! caching. Pure Rust: nothing here knows about a GPU. What it hands on is
//! plain integers (block tables in CSR form, slot mappings, copy lists).

mod error;
mod hybrid;
mod manager;
mod scheduler;

pub use error::BlockError;
pub use hybrid::{
    GroupError, GroupKind, HybridError, HybridManager, HybridSeq, LayerGroup, LayerGroups,
};
pub use manager::{BlockManager, BlockManagerConfig, KvEvent, RemoteBlock, StepPlan, MAX_BLOCKS};
pub use scheduler::{
    Admission, Child, Finished, GroupOutput, GroupStep, Preemption, RequestId, Reservation, Row,
    Scheduler, SchedulerConfig, SchedulerError, SchedulerStats, Step, MAX_SCHEDULER_GROUPS,
};

/// Table entry of a block dropped by
/// [`BlockManager::release_outside_window`]: outside every pool, so the
/// kernels skip it (those positions are outside the window anyway).
pub const RELEASED: u32 = u32::MAX;

/// Slot of a token whose K/V is already in the pool: `write_kv` skips it.
/// [`BlockManager::plan_step`] hands it out for the one token of a fully
/// cached prompt that is computed again for its logits (the cache-hit cap),
/// so that the prompt's last block stays shared.
pub const SKIP_WRITE: u32 = u32::MAX;

/// Opaque handle of a sequence in a [`BlockManager`], as slotmap's keys:
/// a slot index, the slot's generation and the manager that issued it.
/// It cannot be built outside this crate, a freed sequence's handle never
/// names the slot's next occupant (the generation moved on), and a handle
/// from another manager is refused (`BlockError::UnknownSequence`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId {
    index: u32,
    generation: u32,
    owner: u32,
}

impl SeqId {
    pub(crate) fn new(index: u32, generation: u32, owner: u32) -> Self {
        Self {
            index,
            generation,
            owner,
        }
    }

    pub(crate) fn index(self) -> u32 {
        self.index
    }

    pub(crate) fn generation(self) -> u32 {
        self.generation
    }

    pub(crate) fn owner(self) -> u32 {
        self.owner
    }
}

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}v{}", self.index, self.generation)
    }
}

/// What the GPU needs for one batch, in the order of the sequences asked for.
///
/// Block tables in CSR form (as FlashInfer): sequence `i` owns
/// `kv_indices[kv_indptr[i]..kv_indptr[i + 1]]` and holds `seq_lens[i]`
/// tokens. The tokens appended since the sequence's last view are its last
/// `new_indptr[i + 1] - new_indptr[i]` positions; their slots are
/// `slot_mapping[new_indptr[i]..new_indptr[i + 1]]`. `copies` are the
/// copy-on-write pairs `(src, dst)` recorded since the last view: apply them
/// before writing the new tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchView {
    /// `num_seqs + 1` offsets into `kv_indices`.
    pub kv_indptr: Vec<u32>,
    /// Physical block ids, sequence after sequence ([`RELEASED`] for blocks
    /// a sliding window dropped).
    pub kv_indices: Vec<u32>,
    /// Tokens held by each sequence.
    pub seq_lens: Vec<u32>,
    /// `num_seqs + 1` offsets into `slot_mapping`.
    pub new_indptr: Vec<u32>,
    /// Slot (`block * block_size + offset`) of each newly appended token.
    pub slot_mapping: Vec<u32>,
    /// Copy-on-write pairs `(src, dst)`, to apply before the writes.
    pub copies: Vec<[u32; 2]>,
}

impl BatchView {
    /// Number of sequences in the batch.
    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// Empties every vector, keeping their capacity.
    pub fn clear(&mut self) {
        self.kv_indptr.clear();
        self.kv_indices.clear();
        self.seq_lens.clear();
        self.new_indptr.clear();
        self.slot_mapping.clear();
        self.copies.clear();
    }
}

/// Counts of a pool's state, from [`BlockManager::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockStats {
    /// Blocks in the pool.
    pub total: usize,
    /// Plain free blocks.
    pub free: usize,
    /// Blocks at ref count 0 that still hold a cached prefix block.
    pub evictable: usize,
    /// Blocks held by at least one sequence.
    pub used: usize,
    /// Blocks held by more than one sequence.
    pub shared: usize,
    /// Live sequences.
    pub sequences: usize,
    /// Distinct token slots filled in held blocks (shared ones counted once).
    pub tokens_stored: usize,
    /// Sum of the sequences' lengths (shared tokens counted per sequence).
    pub logical_tokens: usize,
    /// Token slots in held blocks: `used * block_size`.
    pub capacity_held: usize,
    /// Copy-on-write pairs not yet taken.
    pub pending_copies: usize,
    /// Blocks at ref count 0 held back until the pending copies that read
    /// them are taken. `free + evictable + used + awaiting_copy == total`.
    pub awaiting_copy: usize,
    /// Sequences swapped out to host memory.
    pub swapped_sequences: usize,
    /// Host swap blocks in use (shared ones counted once).
    pub swap_used: usize,
    /// Host swap blocks in all.
    pub swap_total: usize,
}
