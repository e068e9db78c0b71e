//! The streaming-read ceiling the decode grid is measured against.

use super::*;

/// The streaming-read reference kernel bound to a cache's first two layers
/// (K and V of each): reads exactly the bytes one decode over the whole pool reads.
pub struct StreamRead {
    pub(crate) pipe: wgpu::ComputePipeline,
    pub(crate) groups: Vec<wgpu::BindGroup>,
    pub(crate) workgroups: u32,
    /// Bytes one run reads (K and V of one layer).
    pub bytes: u64,
}

impl StreamRead {
    /// Binds the kernel to every layer of `cache`.
    pub fn new(gpu: &Gpu, cache: &KvCache) -> Result<Self, GpuError> {
        use pagedattn::gpu::shader::ShaderShape;
        let shape = ShaderShape {
            head_dim: 4,
            block_size: 1,
            ..ShaderShape::default()
        };
        let pipe = pagedattn::gpu::kv_cache_pipeline(gpu, "stream_read", &shape)?;
        let sink = gpu.storage("sink", 16)?;
        let mut groups = Vec::new();
        for l in 0..cache.config().num_layers {
            let [k, v] = cache.layer(l)?;
            groups.push(pagedattn::gpu::bind_buffers(gpu, &pipe, &[k, v, &sink]));
        }
        let bytes = cache.config().layer_bytes() + cache.config().v_layer_bytes();
        // Enough threads that each does at most ~256 iterations.
        let workgroups = (bytes / 16 / 64 / 256).clamp(1, 65535) as u32;
        Ok(Self {
            pipe,
            groups,
            workgroups,
            bytes,
        })
    }

    /// Records one read of layer `layer % num_layers`.
    pub fn record(&self, enc: &mut wgpu::CommandEncoder, layer: usize) {
        let bg = &self.groups[layer % self.groups.len()];
        pagedattn::gpu::dispatch_pass(enc, "stream_read", &self.pipe, bg, (self.workgroups, 1, 1));
    }
}

pub(crate) fn stream_gbs(gpu: &Gpu, timer: &Timer, cache: &KvCache) -> Result<f64, GpuError> {
    let s = StreamRead::new(gpu, cache)?;
    let ms = timer.median(|run, enc| s.record(enc, run))?;
    Ok(s.bytes as f64 / ms / 1e6)
}

/// `copy_buffer_to_buffer` over 1 GiB (past any GPU's L2; 256 MiB on a
/// software adapter, whose memory is the host's), bytes read and written
/// counted.
pub(crate) fn memcpy_gbs(gpu: &Gpu, timer: &Timer) -> Result<f64, GpuError> {
    let most = if gpu.is_software() {
        256u64 << 20
    } else {
        1u64 << 30
    };
    let bytes = most.min(gpu.limits.max_buffer_size) / 4 * 4;
    let a = gpu.storage("memcpy a", bytes)?;
    let b = gpu.storage("memcpy b", bytes)?;
    let ms = timer.median(|run, enc| {
        if run % 2 == 0 {
            enc.copy_buffer_to_buffer(&a, 0, &b, 0, bytes);
        } else {
            enc.copy_buffer_to_buffer(&b, 0, &a, 0, bytes);
        }
    })?;
    Ok(2.0 * bytes as f64 / ms / 1e6)
}
