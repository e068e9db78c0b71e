//! Errors of the GPU layer.

/// Everything the GPU layer reports instead of panicking.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// No adapter matched.
    #[error("no GPU adapter found{}: {hint}", backend.as_ref().map(|b| format!(" for backend {b}")).unwrap_or_default())]
    NoAdapter {
        /// Backend asked for through `PAGEDATTN_BACKEND`, if any.
        backend: Option<String>,
        /// How to get one.
        hint: &'static str,
    },
    /// `PAGEDATTN_BACKEND` names no backend.
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
    /// A shape the kernels do not support.
    #[error("unsupported configuration: {0}")]
    Unsupported(String),
    /// An argument of the wrong size or value.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
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
