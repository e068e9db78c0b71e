//! What every kernel's host side does the same way: its pipeline from the
//! device's cache (compiled from its composed source on first use, shader
//! errors reported as ours), bind groups, one compute pass, the 1D grid
//! folded past 65535 workgroups, and the ids that tie plans to the objects
//! that made them. Below the cache, the attention and MLA objects, which
//! all record through it.

use std::sync::atomic::{AtomicU64, Ordering};

use super::compose::{PipelineKey, Shader, ShaderShape};
use super::context::Gpu;
use super::error::{GpuError, ShapeError};
use super::kernels;

/// A fresh id for a kernel object or plan owner.
pub(crate) fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Creates the pipeline of `kernel` for `shape`, reporting shader errors as ours.
pub fn pipeline(
    gpu: &Gpu,
    kernel: Shader,
    shape: &ShaderShape,
) -> Result<wgpu::ComputePipeline, GpuError> {
    let key = kernels::compiled_shape(kernel, shape);
    cached_pipeline(gpu, kernel.name(), PipelineKey::Attention(key), || {
        kernels::source(kernel, &key)
    })
}

/// The pipeline of a kernel outside the library (the bench's streaming
/// read), `label` at `shape` composed from `file` by
/// [`compose_file`](super::compose::compose_file) with `generated`, from
/// the device's cache.
pub fn pipeline_from_file(
    gpu: &Gpu,
    label: &'static str,
    file: &'static str,
    shape: &ShaderShape,
    generated: &str,
) -> Result<wgpu::ComputePipeline, GpuError> {
    cached_pipeline(gpu, label, PipelineKey::Attention(*shape), || {
        super::compose::compose_file(file, shape, 1, generated)
    })
}

/// The pipeline of `kernel` at `key` from the device's cache, compiled from
/// `source` (`None`: no such kernel) on first use, shader errors as ours.
pub(crate) fn cached_pipeline(
    gpu: &Gpu,
    kernel: &'static str,
    key: PipelineKey,
    source: impl FnOnce() -> Option<String>,
) -> Result<wgpu::ComputePipeline, GpuError> {
    let _serial = gpu.serial();
    gpu.alive()?;
    let trusted = matches!(key, PipelineKey::Attention(s) if s.trusted);
    gpu.cached_pipeline(kernel, key, || {
        let src = source().ok_or(ShapeError::NoShader(kernel))?;
        #[cfg(not(target_arch = "wasm32"))]
        {
            gpu.scoped_blocking(|| make_pipeline(gpu, kernel, &src, trusted))
        }
        #[cfg(target_arch = "wasm32")]
        {
            Ok(make_pipeline(gpu, kernel, &src, trusted))
        }
    })
}

fn make_pipeline(gpu: &Gpu, kernel: &str, src: &str, trusted: bool) -> wgpu::ComputePipeline {
    let desc = wgpu::ShaderModuleDescriptor {
        label: Some(kernel),
        source: wgpu::ShaderSource::Wgsl(src.into()),
    };
    // Trusted modules are native-only: the browser keeps wgpu's checks.
    let module = if trusted && cfg!(not(target_arch = "wasm32")) {
        // SAFETY: the attention kernels index only what the host validated
        // before recording (tables within the pool, lengths within the
        // tables, every offset inside its buffer; `check_csr_tables` and the
        // plan's checks), their loops are bounded by those lengths, and
        // they test each table entry against the pool themselves (INVALID).
        // Nothing else is built trusted.
        unsafe {
            gpu.device
                .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
        }
    } else {
        gpu.device.create_shader_module(desc)
    };
    gpu.device
        .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(kernel),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        })
}

/// Workgroup counts for `threads` threads of a 64-wide kernel, folded into two
/// dimensions past the 65535-per-dimension limit.
pub(crate) fn grid_1d(threads: u64) -> (u32, u32) {
    let wgs = threads.div_ceil(64).max(1);
    if wgs <= 65535 {
        (wgs as u32, 1)
    } else {
        (65535, wgs.div_ceil(65535) as u32)
    }
}

/// A bind group of whole buffers, binding i = `buffers[i]`.
pub fn bind(
    gpu: &Gpu,
    pipeline: &wgpu::ComputePipeline,
    buffers: &[&wgpu::Buffer],
) -> wgpu::BindGroup {
    let bindings: Vec<wgpu::BufferBinding> = buffers
        .iter()
        .map(|b| b.as_entire_buffer_binding())
        .collect();
    bind_ranges(gpu, pipeline, &bindings)
}

/// A bind group of buffer ranges, binding i = `bindings[i]`.
pub(crate) fn bind_ranges(
    gpu: &Gpu,
    pipeline: &wgpu::ComputePipeline,
    bindings: &[wgpu::BufferBinding],
) -> wgpu::BindGroup {
    let layout = pipeline.get_bind_group_layout(0);
    let entries: Vec<wgpu::BindGroupEntry> = bindings
        .iter()
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupEntry {
            binding: i as u32,
            resource: wgpu::BindingResource::Buffer(b.clone()),
        })
        .collect();
    gpu.count_bind_group();
    gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &layout,
        entries: &entries,
    })
}

/// Dispatches every kernel of the library recorded, in this process: see
/// [`dispatches_recorded`].
static DISPATCHES: AtomicU64 = AtomicU64::new(0);

/// How many dispatches the library's kernels have recorded in this
/// process so far (every thread's): the difference across a step is that
/// step's count where one thread records. A launch-bound GPU step costs
/// about this count times the launch cost.
pub fn dispatches_recorded() -> u64 {
    DISPATCHES.load(Ordering::Relaxed)
}

/// Records one compute pass: `pipeline` with bind group 0 `bg` over `grid`.
pub fn dispatch(
    enc: &mut wgpu::CommandEncoder,
    label: &str,
    pipeline: &wgpu::ComputePipeline,
    bg: &wgpu::BindGroup,
    grid: (u32, u32, u32),
) {
    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
        label: Some(label),
        timestamp_writes: None,
    });
    pass.set_pipeline(pipeline);
    pass.set_bind_group(0, bg, &[]);
    pass.dispatch_workgroups(grid.0, grid.1, grid.2);
    DISPATCHES.fetch_add(1, Ordering::Relaxed);
}
