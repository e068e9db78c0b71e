//! Why a pool call (`KvCache`, `MlaCache`, their transfers) refused its arguments.

/// Why a pool call ([`KvCache`](crate::gpu::KvCache) and its configuration:
/// the shape, writes, copies, swaps and quantization parameters) refused
/// its arguments, with the numbers. Nothing was changed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// `block_size` is not a power of two in 1..=256.
    #[error("block_size {0} is not a power of two in 1..=256")]
    BlockSize(u32),
    /// A zero in the shape.
    #[error(
        "num_layers {layers}, num_blocks {blocks} and num_kv_heads {kv_heads} must all be positive"
    )]
    EmptyShape {
        /// Layers asked for.
        layers: u32,
        /// Blocks asked for.
        blocks: u32,
        /// KV heads asked for.
        kv_heads: u32,
    },
    /// More layers than [`MAX_LAYERS`](crate::gpu::MAX_LAYERS).
    #[error("num_layers {layers} is over the limit of {limit}")]
    TooManyLayers {
        /// Layers asked for.
        layers: u32,
        /// The limit.
        limit: u32,
    },
    /// A layer index past the cache's layers.
    #[error("layer {layer} out of range (cache has {layers})")]
    Layer {
        /// The index given.
        layer: u32,
        /// Layers in the cache.
        layers: u32,
    },
    /// K or V rows of the wrong length for the slots given.
    #[error("write_kv: {slots} slots need K and V of {need} floats each, got {k} and {v}")]
    KvLength {
        /// Slots given.
        slots: u64,
        /// Floats each of K and V must hold.
        need: u128,
        /// Floats of K given.
        k: u64,
        /// Floats of V given.
        v: u64,
    },
    /// More work in one call than one dispatch can index.
    #[error("{count} {what} in one call is too many (at most {limit})")]
    TooMany {
        /// What was counted.
        what: &'static str,
        /// How many were given.
        count: u64,
        /// The most one call takes.
        limit: u64,
    },
    /// A slot outside the pool (and not `SKIP_WRITE`).
    #[error("slot {slot} outside the pool of {slots} slots")]
    SlotOutsidePool {
        /// The slot given.
        slot: u32,
        /// Slots in the pool.
        slots: u64,
    },
    /// A slot written twice in one call (the GPU writes tokens in parallel).
    #[error("slot {slot} is written twice in one step (the GPU writes tokens in parallel)")]
    SlotTwice {
        /// The slot.
        slot: u32,
    },
    /// A copy naming a block outside the pool.
    #[error("copy {pair:?} names a block outside the pool of {blocks}")]
    CopyOutsidePool {
        /// The (source, destination) pair.
        pair: [u32; 2],
        /// Blocks in the pool.
        blocks: u32,
    },
    /// A copy list whose copies would race: a block that is the
    /// destination of two copies, or the destination of one and the source
    /// of another (copies run in parallel, so the result would depend on
    /// their order).
    #[error("copy list names block {block} as the destination of one copy and the destination or source of another: the copies run in parallel and would race")]
    CopyRace {
        /// The block named twice.
        block: u32,
    },
    /// A call this pool's KV dtype does not take.
    #[error("{call} on a {dtype} pool ({takes} pools only)")]
    WrongDtype {
        /// The call.
        call: &'static str,
        /// The pool's dtype.
        dtype: &'static str,
        /// The dtypes the call takes.
        takes: &'static str,
    },
    /// A list of the wrong length for the pool's shape.
    #[error("{len} {what} for {shape} = {expected}")]
    Count {
        /// What the list holds.
        what: &'static str,
        /// Entries given.
        len: u64,
        /// Entries the shape needs.
        expected: u64,
        /// The shape, in words ("4 KV heads x head_dim 128").
        shape: String,
    },
    /// A value outside what its list accepts.
    #[error("{what} {index} is {value:e}: {rule}")]
    Value {
        /// What the value is ("K smoothing factor", "K scale of KV head").
        what: &'static str,
        /// Its index in its list.
        index: u32,
        /// The value given.
        value: f32,
        /// What is accepted.
        rule: &'static str,
    },
    /// An outlier channel at or past head_dim.
    #[error("outlier channel {channel} of KV head {head} is not below head_dim {head_dim}")]
    OutlierChannel {
        /// The channel.
        channel: u32,
        /// Its KV head.
        head: u32,
        /// The head's width.
        head_dim: u32,
    },
    /// An outlier channel named twice for one head.
    #[error("outlier channel {channel} of KV head {head} is named twice")]
    OutlierTwice {
        /// The channel.
        channel: u32,
        /// Its KV head.
        head: u32,
    },
    /// A swap space over 16 GiB (`MAX_SWAP_BYTES`) or this
    /// platform's memory.
    #[error("swap space of {blocks} blocks of {block_bytes} bytes is over the {limit}-byte limit")]
    SwapTooLarge {
        /// Blocks asked for.
        blocks: u32,
        /// Bytes per block, K and V of every layer.
        block_bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// A swap space made for a pool of another shape.
    #[error("the swap space was made for a pool of another shape")]
    SwapShape,
    /// A swap pair naming a block outside the pool or the swap space.
    #[error(
        "swap pair {pair:?} names a block outside the pool of {pool} or the swap space of {space}"
    )]
    SwapOutside {
        /// The pair.
        pair: [u32; 2],
        /// Blocks in the pool.
        pool: u32,
        /// Blocks in the swap space.
        space: u32,
    },
    /// Two swap pairs writing one block.
    #[error("swap pair {pair:?} writes a block another pair writes")]
    SwapTwice {
        /// The second pair.
        pair: [u32; 2],
    },
}

/// Why an export or import of blocks was refused, with the numbers.
/// Nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// An empty layer range, or one past the pool's layers.
    #[error("layers {first}..{end}: not a non-empty range within the pool's {layers}")]
    Layers {
        /// First layer asked for.
        first: u32,
        /// One past the last.
        end: u32,
        /// Layers in the pool.
        layers: u32,
    },
    /// A block id past the pool.
    #[error("block {block} is outside the pool of {pool} blocks")]
    Block {
        /// The id given.
        block: u32,
        /// Blocks in the pool.
        pool: u32,
    },
    /// An import writing one block twice.
    #[error("block {block} is written twice by one import")]
    BlockTwice {
        /// The id given twice.
        block: u32,
    },
    /// An imported value no pool write could store: NaN, an infinity, or
    /// a magnitude past `KV_MAX` (an int8 row scale past `KV_MAX / 64`).
    #[error("imported block {index} (of this call), layer {layer}: {what} {:e} is not a value a pool write stores (finite, at most {:e} in magnitude); nothing was written", f32::from_bits(*value_bits), f32::from_bits(*limit_bits))]
    Value {
        /// Position of the block in the call's list.
        index: u64,
        /// The layer.
        layer: u32,
        /// `K value`, `V value`, `K row scale`, `V row scale`.
        what: &'static str,
        /// The value found, as f32 bits (NaN included).
        value_bits: u32,
        /// The largest magnitude accepted, as f32 bits.
        limit_bits: u32,
    },
    /// Bytes of the wrong length (truncated, or for another block count).
    #[error("{got} bytes where this transfer takes {want}")]
    Bytes {
        /// Bytes given.
        got: u64,
        /// Bytes the transfer takes.
        want: u64,
    },
    /// A transfer over 16 GiB (`MAX_SWAP_BYTES`).
    #[error("a transfer of {bytes} bytes is over the limit of {limit}")]
    TooLarge {
        /// Bytes it would take.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// Descriptor bytes that are not a [`KvLayout`](crate::gpu::KvLayout).
    #[error("not a KV layout descriptor: {0}")]
    Descriptor(&'static str),
    /// A descriptor of another layout version.
    #[error("KV layout version {got}; this library reads {want}")]
    Version {
        /// The descriptor's version.
        got: u32,
        /// The version this library writes and reads.
        want: u32,
    },
    /// A descriptor of another shape than the destination pool's.
    #[error("KV layout mismatch: {field} is {got}, the pool's is {want}")]
    Mismatch {
        /// The field that differs.
        field: &'static str,
        /// The descriptor's value.
        got: u64,
        /// The pool's value.
        want: u64,
    },
    /// Blocks of layers whose fp8 scales, int8 K smoothing or outlier
    /// channels differ from the destination's: they would be misread.
    #[error("the layers' per-layer state (fp8 scales, K smoothing, outlier channels) differs from the pool's")]
    LayerState,
}

/// Why a multi-head latent attention call ([`MlaCache`](crate::gpu::MlaCache),
/// [`MlaAttention`](crate::gpu::MlaAttention)) was refused, with the numbers.
/// Nothing was written or recorded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum MlaError {
    /// Latent and RoPE widths the kernels cannot take.
    #[error("MLA row of kv_lora_rank {rank} + rope_dim {rope}: each must be a multiple of 4, the rank positive, the row at most {limit}")]
    Dims {
        /// kv_lora_rank.
        rank: u32,
        /// rope_dim.
        rope: u32,
        /// The most elements a row may have.
        limit: u32,
    },
    /// A latent pool of a dtype the MLA kernels do not read.
    #[error("MLA pools hold f32, f16 or bf16, not {}", .0.name())]
    Dtype(crate::gpu::dtype::KvDtype),
    /// A pool with no layers or blocks, or too many layers.
    #[error("MLA pool of {layers} layers and {blocks} blocks: both must be positive, layers at most {limit}")]
    EmptyPool {
        /// Layers asked for.
        layers: u32,
        /// Blocks asked for.
        blocks: u32,
        /// The most layers.
        limit: u32,
    },
    /// Query heads outside 1..=limit.
    #[error("{heads} query heads: MLA takes 1..={limit}")]
    Heads {
        /// Heads asked for.
        heads: u32,
        /// The most.
        limit: u32,
    },
    /// A softmax scale that is not finite and positive.
    #[error("MLA scale {0:e} is not finite and positive")]
    Scale(f32),
    /// A layer past the pool's.
    #[error("layer {layer} out of range (the latent pool has {layers})")]
    Layer {
        /// The layer asked for.
        layer: u32,
        /// The pool's layers.
        layers: u32,
    },
    /// A buffer or slice of the wrong length.
    #[error("{what}: {got} values where this call takes {want}")]
    Len {
        /// Which input.
        what: &'static str,
        /// Its length.
        got: u64,
        /// What it must be.
        want: u64,
    },
    /// A slot outside the pool.
    #[error("slot {slot} outside the latent pool of {slots} slots")]
    Slot {
        /// The slot.
        slot: u32,
        /// Slots in the pool.
        slots: u64,
    },
    /// A slot named twice in one write (rows are written in parallel).
    #[error("slot {0} is written twice in one call")]
    SlotTwice(u32),
    /// A block id (in a table or a copy) outside the pool.
    #[error("{what} names block {block}, outside the latent pool of {blocks}")]
    Block {
        /// `table` or `copy`.
        what: &'static str,
        /// The block.
        block: u32,
        /// Blocks in the pool.
        blocks: u32,
    },
    /// A copy list whose destinations overlap its sources or each other.
    #[error("copy list writes block {0} twice, or reads a block it writes")]
    CopyOverlap(u32),
    /// A query that sees no token, or more than its table holds.
    #[error(
        "query {query} sees {visible} tokens; its table holds {held} (at least 1 must be seen)"
    )]
    Visible {
        /// The query row.
        query: usize,
        /// Tokens it would see.
        visible: u64,
        /// Tokens its table's blocks hold.
        held: u64,
    },
    /// A batch with no query, or more query rows than a grid can hold.
    #[error("{count} query rows: MLA takes 1..={limit} per call")]
    Queries {
        /// Rows asked for.
        count: u64,
        /// The most.
        limit: u32,
    },
    /// A partition length that is zero or not a multiple of the tile.
    #[error("partitions of {tokens} tokens: use a positive multiple of {tile}")]
    Split {
        /// Tokens asked for.
        tokens: u32,
        /// The kernel's tile of rows.
        tile: u32,
    },
    /// A partition longer than an adapter that ends long loops early can walk.
    #[error("partitions of {tokens} tokens walk more loop iterations than {adapter} runs per invocation (at most {cap} tokens here): use a shorter split")]
    PassTooLong {
        /// Tokens asked for.
        tokens: u32,
        /// The most here.
        cap: u32,
        /// The adapter.
        adapter: String,
    },
    /// An attention object made for another pool shape, or a plan made for
    /// another pool or attention object.
    #[error("{0}")]
    Mismatch(&'static str),
    /// An attention option the MLA kernels do not take.
    #[error("MLA's kernels take no {0}: of the attention options, only scale and split")]
    Option(&'static str),
}
