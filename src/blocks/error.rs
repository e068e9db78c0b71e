//! Errors of the host-side block manager.

use super::SeqId;

/// Everything that can go wrong in [`BlockManager`](super::BlockManager).
///
/// Every failing call leaves the manager exactly as it was before the call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BlockError {
    /// The pool has fewer reusable blocks than the call needs.
    #[error("out of KV blocks: need {needed}, only {free} free or evictable")]
    OutOfBlocks {
        /// Blocks the call would have taken.
        needed: usize,
        /// Blocks that could have been taken (plain free + evictable cached).
        free: usize,
    },
    /// The sequence id is not live (never added, or already freed).
    #[error("unknown sequence {0}")]
    UnknownSequence(SeqId),
    /// The block size is not a power of two in 1..=256.
    #[error("block size {0} is not a power of two between 1 and 256")]
    BadBlockSize(u32),
    /// A pool must hold at least one block, at most `u32::MAX / block_size`
    /// blocks (so every slot fits a `u32`) and at most
    /// [`MAX_BLOCKS`](super::MAX_BLOCKS) (the manager's host memory bound).
    #[error("pool of {num_blocks} blocks of {block_size} tokens is not supported (need 1..={max} blocks: slots must fit a u32, and a manager holds at most 2^24 blocks)")]
    BadPoolSize {
        /// Requested number of blocks.
        num_blocks: u32,
        /// Requested block size.
        block_size: u32,
        /// Largest number of blocks allowed at this block size.
        max: u32,
    },
    /// A sequence would grow past the longest length the manager allows.
    #[error("sequence would hold {requested} tokens, more than the limit of {limit}")]
    TooManyTokens {
        /// Length the call would have produced.
        requested: usize,
        /// The manager's `max_seq_len`.
        limit: usize,
    },
    /// A position past the end of a sequence.
    #[error("position {pos} is past the end of a sequence of {len} tokens")]
    PositionOutOfRange {
        /// Position asked for.
        pos: usize,
        /// Tokens the sequence holds.
        len: usize,
    },
    /// A position whose block a sliding window released.
    #[error("position {pos} was released (outside the sliding window)")]
    PositionReleased {
        /// Position asked for.
        pos: usize,
    },
    /// A sliding window must cover at least one position.
    #[error("sliding window of 0 positions")]
    ZeroWindow,
    /// A block that holds nothing (or is outside the pool) cannot be pinned.
    #[error("block {block} holds nothing to pin (free, or outside the pool)")]
    NotPinnable {
        /// The block.
        block: u32,
    },
    /// An unpin of a block not pinned (that many times).
    #[error("block {block} is not pinned")]
    NotPinned {
        /// The block.
        block: u32,
    },
    /// Remote prefix blocks asked of a manager without prefix caching
    /// (they join the prefix cache).
    #[error("remote prefix blocks need prefix caching on")]
    PrefixCachingOff,
    /// A prompt must hold at least one token.
    #[error("empty prompt")]
    EmptyPrompt,
    /// `fork` of a sequence whose newest tokens have not been handed to the GPU yet.
    #[error(
        "sequence {seq} has {pending} token(s) not yet taken by a batch view; fork after the view"
    )]
    PendingTokens {
        /// The sequence.
        seq: SeqId,
        /// Tokens appended since its last batch view.
        pending: usize,
    },
    /// The same sequence appears twice in one batch.
    #[error("sequence {0} appears twice in one batch")]
    DuplicateInBatch(SeqId),
    /// The sequence is swapped out: swap it in first.
    #[error("sequence {0} is swapped out to host memory")]
    Swapped(SeqId),
    /// `swap_in` of a sequence that is not swapped out.
    #[error("sequence {0} is not swapped out")]
    NotSwapped(SeqId),
    /// The host swap space has fewer free blocks than the swap-out needs.
    #[error("swap space full: need {needed} blocks, {free} free")]
    SwapSpaceFull {
        /// Host blocks the swap-out would have taken.
        needed: usize,
        /// Host blocks free.
        free: usize,
    },
    /// A swap-out while copy-on-write copies are pending: take them first
    /// (their destinations are not written yet).
    #[error("{0} copy-on-write copies are pending: take them before swapping out")]
    CopiesPending(usize),
    /// A step plan made before the manager last changed.
    #[error("the step plan is stale: the manager changed after it was planned")]
    StalePlan,
}
