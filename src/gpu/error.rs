//! Errors of the GPU layer.

/// Everything the GPU layer reports instead of panicking.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// No adapter matched.
    #[error("no GPU adapter found{}: {hint}", backend.as_ref().map(|b| format!(" for backend {b}")).unwrap_or_default())]
    NoAdapter {
        /// The backends asked for, when fewer than all.
        backend: Option<String>,
        /// How to get one.
        hint: &'static str,
    },
    /// A backend name ([`parse_backends`](super::parse_backends)) that names no backend.
    #[error("unknown backend {0:?}: use vulkan, gl, metal, dx12 or webgpu")]
    UnknownBackend(String),
    /// The adapter refused a device.
    #[error("could not open a device on {adapter}: {reason}")]
    RequestDevice {
        /// Adapter name.
        adapter: String,
        /// What wgpu said.
        reason: String,
    },
    /// A layer's K (or V) buffer would exceed what one binding may address.
    #[error("KV cache of {num_blocks} blocks needs {bytes} bytes per layer buffer, over the adapter's limit of {limit}; at most {max_blocks} blocks fit")]
    CacheTooLarge {
        /// Blocks asked for.
        num_blocks: u32,
        /// Bytes one layer's K buffer would take.
        bytes: u64,
        /// min(max_storage_buffer_binding_size, max_buffer_size).
        limit: u64,
        /// Largest `num_blocks` that fits.
        max_blocks: u32,
    },
    /// A shape the kernels cannot be built for (see [`ShapeError`]).
    #[error("{0}")]
    Shape(ShapeError),
    /// A batch's tables, queries or plan that the kernels cannot run (see
    /// [`BatchError`]); nothing was planned or recorded.
    #[error("{0}")]
    Batch(BatchError),
    /// An option set ([`AttnOptions`](super::AttnOptions)) refused (see
    /// [`OptionError`]).
    #[error("{0}")]
    Options(OptionError),
    /// A pass longer than an adapter that ends long loops early (llvmpipe:
    /// 65535 loop iterations per invocation) can finish: refused rather
    /// than answered wrong.
    #[error("{what} walks {tokens} tokens in one pass, but {adapter} ends loops after 65535 iterations per invocation (at most {cap} tokens per pass for the {kernel} kernel at head_dim {head_dim}): use Split::Auto or Split::Tokens({cap}) or less")]
    PassTooLong {
        /// `decode` or `prefill`.
        what: &'static str,
        /// Tokens the pass would walk.
        tokens: u32,
        /// The most it can walk here.
        cap: u32,
        /// The adapter's name.
        adapter: String,
        /// The kernel running the pass.
        kernel: super::kernel::Kernel,
        /// The head width.
        head_dim: u32,
    },
    /// A read of more bytes than the buffer holds.
    #[error("read of {bytes} bytes from a buffer of {buffer}")]
    ReadPastEnd {
        /// Bytes asked for.
        bytes: u64,
        /// The buffer's size.
        buffer: u64,
    },
    /// An engine's buffer binding the kernels cannot use (see
    /// [`BindingError`]); nothing was recorded.
    #[error("{which}: {problem}")]
    Binding {
        /// The binding (`q`, `out`, `k`, `v`, or `bindings` for a whole
        /// bind group).
        which: &'static str,
        /// What is wrong with it.
        problem: BindingError,
    },
    /// A pool call refused its arguments (see [`PoolError`]).
    #[error("{0}")]
    Pool(PoolError),
    /// A plan handed to a call it was not made for (see [`PlanMismatch`]).
    #[error("{0}")]
    Plan(PlanMismatch),
    /// An export or import refused its arguments (see [`TransferError`]);
    /// nothing was written.
    #[error("{0}")]
    Transfer(TransferError),
    /// A multi-head latent attention call refused its arguments (see
    /// [`MlaError`]); nothing was written or recorded.
    #[error("{0}")]
    Mla(MlaError),
    /// The device's limits cannot hold what was asked for: `limit` names
    /// the `wgpu::Limits` field.
    #[error("the device's {limit} is {available}; this needs {needed}")]
    DeviceLimit {
        /// The `wgpu::Limits` field.
        limit: &'static str,
        /// What the configuration needs.
        needed: u64,
        /// What the device has.
        available: u64,
    },
    /// wgpu reported a validation error.
    #[error("wgpu validation error: {0}")]
    Validation(String),
    /// wgpu could not allocate.
    #[error("GPU out of memory: {0}")]
    OutOfMemory(String),
    /// The device was lost or a readback failed.
    #[error("GPU device error: {0}")]
    Device(String),
}

impl From<wgpu::Error> for GpuError {
    fn from(e: wgpu::Error) -> Self {
        match e {
            wgpu::Error::OutOfMemory { .. } => GpuError::OutOfMemory(e.to_string()),
            wgpu::Error::Validation { description, .. } => GpuError::Validation(description),
            other => GpuError::Device(other.to_string()),
        }
    }
}

/// Why a plan was refused: it belongs to another object, or to another
/// step. Nothing was recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanMismatch {
    /// An attention plan made by another `PagedAttention` (another kernel,
    /// shape or pool).
    #[error("this plan was made by another PagedAttention")]
    OtherAttention,
    /// A write plan made by another `KvCache`.
    #[error("this plan was made by another KvCache")]
    OtherCache,
    /// An attention plan that already ran on another `KvCache` in this
    /// step: its tables index that cache's pool.
    #[error("this plan ran on another KvCache in this step: its tables index that pool; plan the step for this cache")]
    BoundToOtherCache,
    /// No step was planned into it (or its planning failed).
    #[error("the plan holds no step: plan it first")]
    NotPlanned,
    /// An attention plan from an earlier step: the cache's writes were
    /// planned again since it first ran (`KvCache::plan_write` starts a
    /// step), so its tables and row count describe a step that is over.
    #[error("stale plan: it ran in write step {planned} of its cache, which is now at step {current}; plan this step's attention first")]
    Stale {
        /// The cache's write step when the plan first ran.
        planned: u64,
        /// The cache's write step now.
        current: u64,
    },
}

/// Why a pool call ([`KvCache`](super::KvCache) and its configuration:
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
    /// More layers than [`MAX_LAYERS`](super::MAX_LAYERS).
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
    /// Descriptor bytes that are not a [`KvLayout`](super::KvLayout).
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

/// Why a multi-head latent attention call ([`MlaCache`](super::MlaCache),
/// [`MlaAttention`](super::MlaAttention)) was refused, with the numbers.
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
    Dtype(super::dtype::KvDtype),
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

impl From<MlaError> for GpuError {
    fn from(e: MlaError) -> Self {
        GpuError::Mla(e)
    }
}

impl From<TransferError> for GpuError {
    fn from(e: TransferError) -> Self {
        GpuError::Transfer(e)
    }
}

impl From<PoolError> for GpuError {
    fn from(e: PoolError) -> Self {
        GpuError::Pool(e)
    }
}

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
        kernel: super::kernel::Kernel,
        /// Query heads.
        heads: u32,
        /// KV heads.
        kv_heads: u32,
        /// Head width.
        head_dim: u32,
        /// The adapter's name.
        adapter: String,
        /// The kernels that can.
        eligible: Vec<super::kernel::Kernel>,
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
    /// A sequence over [`MAX_SEQ_LEN`](super::MAX_SEQ_LEN).
    #[error("sequence {seq} holds {tokens} tokens, over the limit of {limit}")]
    TooLong {
        /// The sequence.
        seq: u32,
        /// Its length.
        tokens: u32,
        /// The limit.
        limit: u32,
    },
    /// More sequences than [`MAX_BATCH`](super::MAX_BATCH).
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

/// Why an option set ([`AttnOptions`](super::AttnOptions)) was refused.
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

impl From<ShapeError> for GpuError {
    fn from(e: ShapeError) -> Self {
        GpuError::Shape(e)
    }
}

impl From<BatchError> for GpuError {
    fn from(e: BatchError) -> Self {
        GpuError::Batch(e)
    }
}

impl From<OptionError> for GpuError {
    fn from(e: OptionError) -> Self {
        GpuError::Options(e)
    }
}
