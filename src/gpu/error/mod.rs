//! Errors of the GPU layer.

mod call;
mod pool;
pub use call::*;
pub use pool::*;

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
