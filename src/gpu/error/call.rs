//! Why a call's bindings, shape, batch or options were refused.

/// What is wrong with an engine's buffer binding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BindingError {
    /// The buffer was made without `STORAGE` usage.
    #[error("buffer has usage {usage}, without STORAGE")]
    NotStorage {
        /// Its usages, as wgpu prints them.
        usage: String,
    },
    /// The offset is not a multiple of the device's alignment.
    #[error("offset {offset} is not a multiple of the device's min_storage_buffer_offset_alignment ({align})")]
    Misaligned {
        /// The offset given.
        offset: u64,
        /// `min_storage_buffer_offset_alignment`.
        align: u64,
    },
    /// The range runs past the buffer's end.
    #[error("range at offset {offset} of {size} bytes runs past the buffer's {buffer} bytes")]
    PastEnd {
        /// The offset given.
        offset: u64,
        /// The bytes bound.
        size: u64,
        /// The buffer's size.
        buffer: u64,
    },
    /// Fewer bytes bound than the batch reads or writes.
    #[error("{bound} bytes bound, the batch needs {needed}")]
    TooSmall {
        /// The bytes bound.
        bound: u64,
        /// The bytes needed.
        needed: u64,
    },
    /// More bytes bound than one storage binding may address.
    #[error("{bound} bytes bound, over the device's storage binding limit of {limit}")]
    OverLimit {
        /// The bytes bound.
        bound: u64,
        /// The device's limit.
        limit: u64,
    },
    /// `q` and `out` are ranges of one buffer: a dispatch may not read and
    /// write the same buffer (WebGPU's usage rule).
    #[error("q and out are ranges of one buffer: a dispatch may not read and write the same buffer (WebGPU's usage rule), so out must live in another buffer")]
    SameBuffer,
    /// wgpu refused the bind group (a buffer from another device?).
    #[error("wgpu refused the bindings (a buffer from another device?): {0}")]
    Refused(String),
    /// wgpu could not resolve a buffer (one from another instance or device).
    #[error("wgpu could not resolve a buffer: one from another instance or device")]
    Unresolved,
}

/// Why a shape (heads, head_dim, kernel, configuration) was refused when
/// kernels were built for it, or a cache of another shape was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShapeError {
    /// Query heads that are not a positive multiple of the KV heads.
    #[error("num_heads {heads} is not a positive multiple of num_kv_heads {kv_heads}")]
    HeadRatio {
        /// Query heads.
        heads: u32,
        /// KV heads.
        kv_heads: u32,
    },
    /// More workgroups in one dispatch dimension than the device allows.
    #[error("{count} {what}: one dispatch dimension holds at most {limit} workgroups")]
    Dispatch {
        /// What is counted ("query heads", "kv heads x head tiles").
        what: &'static str,
        /// How many.
        count: u64,
        /// `max_compute_workgroups_per_dimension`.
        limit: u32,
    },
    /// A cascade segment length outside 16..=4096 or not a multiple of 16.
    #[error("cascade_chunk_tokens {0}: a multiple of 16 from 16 to 4096")]
    CascadeChunk(u32),
    /// The kernel asked for cannot run the shape on this adapter.
    #[error("the {kernel} kernel cannot run {heads} query heads over {kv_heads} kv heads at head_dim {head_dim} on {adapter} (workgroup memory); eligible: {eligible:?}")]
    Kernel {
        /// The kernel asked for.
        kernel: crate::gpu::kernel::Kernel,
        /// Query heads.
        heads: u32,
        /// KV heads.
        kv_heads: u32,
        /// Head width.
        head_dim: u32,
        /// The adapter's name.
        adapter: String,
        /// The kernels that can.
        eligible: Vec<crate::gpu::kernel::Kernel>,
    },
    /// No kernel at all runs the shape (the tuner's refusal).
    #[error("no kernel runs {heads} query heads over {kv_heads} kv heads at head_dim {head_dim}")]
    NoKernel {
        /// Query heads.
        heads: u32,
        /// KV heads.
        kv_heads: u32,
        /// Head width.
        head_dim: u32,
    },
    /// A head width the kernels do not take.
    #[error("head_dim {0} (must be a multiple of 4 between 4 and 256)")]
    HeadDim(u32),
    /// More KV heads than one dispatch dimension indexes.
    #[error("num_kv_heads {kv_heads} is over the limit of {limit} (one dispatch dimension)")]
    KvHeads {
        /// KV heads asked for.
        kv_heads: u32,
        /// The limit.
        limit: u32,
    },
    /// A shader the library does not have (a kernel name with no source).
    #[error("no shader for kernel {0}")]
    NoShader(&'static str),
    /// Kernels built for one cache shape given a cache of another.
    #[error("this PagedAttention was built for a cache of {built}, but was given one of {given}")]
    OtherCache {
        /// The shape it was built for (`Debug` of the config).
        built: String,
        /// The shape given.
        given: String,
    },
}

/// Why a batch was refused: its block tables, its queries, its plan, or a
/// dispatch it would need, with the numbers. Nothing was planned or
/// recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    /// `kv_indptr` of the wrong length.
    #[error("kv_indptr has {entries} entries for {seqs} sequences (need {})", seqs + 1)]
    IndptrLength {
        /// Entries given.
        entries: u64,
        /// Sequences.
        seqs: u64,
    },
    /// `kv_indptr` not a CSR offset list over `kv_indices`.
    #[error("kv_indptr must start at 0, never decrease and end at kv_indices.len() ({indices})")]
    IndptrOrder {
        /// `kv_indices.len()`.
        indices: u64,
    },
    /// A sequence longer than its table covers.
    #[error("sequence {seq} holds {tokens} tokens but its table has only {blocks} blocks")]
    ShortTable {
        /// The sequence.
        seq: u32,
        /// Its length.
        tokens: u32,
        /// Blocks in its table.
        blocks: u64,
    },
    /// A sequence over [`MAX_SEQ_LEN`](crate::gpu::MAX_SEQ_LEN).
    #[error("sequence {seq} holds {tokens} tokens, over the limit of {limit}")]
    TooLong {
        /// The sequence.
        seq: u32,
        /// Its length.
        tokens: u32,
        /// The limit.
        limit: u32,
    },
    /// More sequences than [`MAX_BATCH`](crate::gpu::MAX_BATCH).
    #[error("{seqs} sequences in one batch (at most {limit})")]
    TooManySeqs {
        /// Sequences given.
        seqs: u64,
        /// The limit.
        limit: u32,
    },
    /// A block id outside the pool (and not `RELEASED`).
    #[error("block id {block} outside the pool of {blocks} blocks")]
    BlockOutsidePool {
        /// The id.
        block: u32,
        /// Blocks in the pool.
        blocks: u32,
    },
    /// `qo_indptr` not `num_seqs + 1` non-decreasing offsets from 0.
    #[error("qo_indptr must hold {need} non-decreasing offsets from 0")]
    QoIndptr {
        /// Offsets it must hold.
        need: u64,
    },
    /// A sequence with more queries than tokens.
    #[error("sequence {seq} has {queries} queries but holds only {tokens} tokens")]
    MoreQueries {
        /// The sequence.
        seq: u32,
        /// Its queries.
        queries: u32,
        /// Its length.
        tokens: u32,
    },
    /// More query tiles than one dispatch dimension.
    #[error("{tiles} query tiles of {qtile} in one prefill (at most {limit}; split the batch)")]
    TooManyTiles {
        /// Tiles the batch makes.
        tiles: u64,
        /// Queries per tile.
        qtile: u32,
        /// The limit.
        limit: u32,
    },
    /// Tables too large for the kernels' `u32` offsets.
    #[error("tables of {indices} block ids and {slopes} slopes do not fit u32 offsets")]
    Offsets {
        /// Block ids.
        indices: u64,
        /// Slopes.
        slopes: u64,
    },
    /// Queries of the wrong length for the batch.
    #[error("q has {floats} floats; {queries} queries x {heads} heads x {head_dim} need {}", *queries as u128 * *heads as u128 * *head_dim as u128)]
    QLength {
        /// Floats given.
        floats: u64,
        /// Query rows of the batch.
        queries: u64,
        /// Query heads.
        heads: u32,
        /// Head width.
        head_dim: u32,
    },
    /// A row stride (Q, or new K/V) that is not a multiple of 4 or shorter
    /// than a row.
    #[error("{what} stride of {stride} floats: must be a multiple of 4 and at least {row}")]
    Stride {
        /// `q` or `K/V`.
        what: &'static str,
        /// The stride given.
        stride: u32,
        /// One row's floats.
        row: u32,
    },
    /// A plan asked for with no option set.
    #[error("a plan needs at least one variant (AttnOptions)")]
    NoVariant,
    /// A run of a variant the plan does not have.
    #[error("variant {variant} of a plan with {variants}")]
    Variant {
        /// The index given.
        variant: usize,
        /// Variants planned.
        variants: usize,
    },
    /// More of something in one dispatch than it can index.
    #[error("{count} {what} in one dispatch (at most {limit})")]
    Dispatch {
        /// What is counted ("partitions", "decode passes", "cascade query
        /// tiles", "partial slots").
        what: &'static str,
        /// How many.
        count: u64,
        /// The limit.
        limit: u64,
    },
    /// Split-K partials over the storage binding limit.
    #[error("split partials of {bytes} bytes, over the device's storage binding limit of {limit}: use longer partitions or a smaller batch")]
    Partials {
        /// Bytes the partials need.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
}

/// Why an option set ([`AttnOptions`](crate::gpu::AttnOptions)) was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum OptionError {
    /// A split-K partition that is not a positive multiple of 64.
    #[error("partition of {0} tokens: must be a positive multiple of 64")]
    Partition(u32),
    /// ALiBi slopes of the wrong count.
    #[error("{slopes} ALiBi slopes for {heads} heads")]
    SlopeCount {
        /// Slopes given.
        slopes: u64,
        /// Query heads.
        heads: u32,
    },
    /// A slope that is not finite.
    #[error("ALiBi slope of head {head} is {value}: slopes must be finite")]
    Slope {
        /// Its head.
        head: u32,
        /// The value.
        value: f32,
    },
    /// Attention sinks of the wrong count.
    #[error("{sinks} attention sinks for {heads} heads")]
    SinkCount {
        /// Sinks given.
        sinks: u64,
        /// Query heads.
        heads: u32,
    },
    /// A sink logit that is not finite.
    #[error("attention sink of head {head} is {value}: sinks must be finite")]
    Sink {
        /// Its head.
        head: u32,
        /// The value.
        value: f32,
    },
    /// A scale that is not finite.
    #[error("scale {0}: must be finite")]
    Scale(f32),
    /// A soft cap that is not finite and positive.
    #[error("soft_cap {0}: must be finite and positive")]
    SoftCap(f32),
    /// A window of no positions.
    #[error("sliding_window of 0 positions: must be at least 1")]
    ZeroWindow,
    /// Sink tokens of 0 positions, or without a sliding window (every
    /// position is visible then).
    #[error("sink_tokens {0:?}: must be at least 1 and come with a sliding_window")]
    SinkTokens(u32),
    /// The cascade asked for (`Cascade::On`) with sink tokens: a segment's
    /// positions are relative to it, so it cannot tell the sinks apart.
    #[error("the cascade does not take sink_tokens; use Cascade::Auto or Cascade::Off")]
    CascadeWithSinkTokens,
}
