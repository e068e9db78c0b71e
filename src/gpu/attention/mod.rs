//! Paged attention kernels on the GPU: decode (one query per sequence), with
//! an optional split-K path (partitions merged by `reduce`).

use super::cascade::{Cascade, CASCADE_CHUNK_TOKENS};
use super::compose::{Shader, ShaderShape};
use super::context::Gpu;
use super::error::{BatchError, GpuError, OptionError, ShapeError};
use super::kernel::{Kernel, PORTABLE_WORKGROUP_BYTES};
use super::kernels::{self, serial};
use super::kv_cache::{KvCache, KvCacheConfig};
use super::params;
use super::pass::{next_id, pipeline};

mod options;
mod split;
mod tables;
pub use options::*;
pub use tables::*;

/// Longest sequence (tokens of context) the kernels take: positions and
/// tile counters are `u32`, and a length this far below `u32::MAX` can
/// never wrap them.
pub const MAX_SEQ_LEN: u32 = 1 << 31;

/// Most sequences in one decode, and most query tiles in one prefill (one
/// dispatch dimension).
pub const MAX_BATCH: u32 = 65535;

/// Decode kernels specialised for one cache shape and head count.
pub struct PagedAttention {
    /// The cache shape the kernels were built for.
    pub(super) cache_cfg: KvCacheConfig,
    pub(super) num_heads: u32,
    pub(super) num_kv_heads: u32,
    pub(super) head_dim: u32,
    pub(super) block_size: u32,
    pub(super) num_blocks: u32,
    /// The decode kernel variant, and its shape (f32 activations).
    pub(super) kernel: Kernel,
    pub(super) decode_shape: ShaderShape,
    /// Built on first use, like prefill's: prefill-only callers never pay
    /// for the decode kernel's compile.
    pub(super) decode: std::sync::OnceLock<wgpu::ComputePipeline>,
    pub(super) reduce: wgpu::ComputePipeline,
    /// Built on first use: decode-only callers never pay for its compile
    /// (seconds per shape on software GL).
    pub(super) prefill: std::sync::OnceLock<wgpu::ComputePipeline>,
    pub(super) prefill_shape: ShaderShape,
    /// Bound in place of the split-K (max, sum) output when there is none,
    /// made once rather than per call.
    pub(super) unused_ml: wgpu::Buffer,
    /// Longest shared segment of a cascade pass on the rows kernel.
    pub(super) cascade_chunk: u32,
    /// Identifies this instance to the plans it makes.
    pub(super) id: u64,
}

impl PagedAttention {
    /// Builds the kernels for `num_heads` query heads over `cache` as
    /// `config` says: its decode kernel, or the adapter's default (see
    /// [`Kernel`]: `serial` on software adapters, `lanes` elsewhere, `tiled`
    /// where neither fits); its cascade segment length; its shader checks.
    /// Nothing read from the environment changes it: an engine passes its
    /// choice, or builds through a [`Tuner`](super::Tuner).
    /// `GpuError::Shape` when the kernel asked for cannot run this shape here.
    pub fn new(
        gpu: &Gpu,
        cache: &KvCache,
        num_heads: u32,
        config: &AttentionConfig,
    ) -> Result<Self, GpuError> {
        Self::with_layout(gpu, cache, num_heads, config.paged, config)
    }

    /// The decode kernel variant in use.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// The decode kernel's WGSL file and the shape it was built at (for
    /// tools that compile the same source elsewhere: `pagedattn
    /// pipeline-stats`).
    #[doc(hidden)]
    pub fn decode_shader(&self) -> (Shader, ShaderShape) {
        (kernels::decode(self.kernel).shader(), self.decode_shape)
    }

    /// Workgroup memory (bytes) of the decode and the prefill kernels as
    /// built: both within [`PORTABLE_WORKGROUP_BYTES`](super::PORTABLE_WORKGROUP_BYTES)
    /// (WebGPU's default) on every shape.
    pub fn workgroup_bytes(&self) -> (u32, u32) {
        let decode = kernels::decode(self.kernel).workgroup_bytes(&self.decode_shape);
        (decode, kernels::tiled::workgroup_bytes(&self.prefill_shape))
    }

    /// Query heads per pass of the decode kernel (a GQA group larger than
    /// this runs as several head tiles).
    pub fn decode_head_tile(&self) -> u32 {
        self.decode_shape.head_tile()
    }

    /// The variants that can run this shape on `gpu`.
    pub fn eligible_kernels(gpu: &Gpu, cache: &KvCache, num_heads: u32) -> Vec<Kernel> {
        let c = cache.config();
        if num_heads == 0 || c.num_kv_heads == 0 || !num_heads.is_multiple_of(c.num_kv_heads) {
            return Vec::new();
        }
        let base = Self::base_shape(c, num_heads, true);
        Kernel::ALL
            .into_iter()
            .filter(|&k| kernels::decode_shape(gpu, k, base).is_some())
            .collect()
    }

    pub(super) fn base_shape(c: &KvCacheConfig, num_heads: u32, paged: bool) -> ShaderShape {
        ShaderShape {
            head_dim: c.head_dim,
            group: num_heads / c.num_kv_heads,
            block_size: c.block_size,
            dtype: c.dtype,
            paged,
            ..ShaderShape::default()
        }
    }

    /// `base_shape` as `config` builds it: its checks and stream step.
    pub(super) fn config_shape(
        gpu: &Gpu,
        c: &KvCacheConfig,
        num_heads: u32,
        paged: bool,
        config: &AttentionConfig,
    ) -> ShaderShape {
        ShaderShape {
            trusted: config.shader_checks.trusted_on(gpu),
            unroll: config.stream_unroll,
            workgroup: config.stream_workgroup,
            ..Self::base_shape(c, num_heads, paged)
        }
    }

    fn with_layout(
        gpu: &Gpu,
        cache: &KvCache,
        num_heads: u32,
        paged: bool,
        config: &AttentionConfig,
    ) -> Result<Self, GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        // The attention kernels bind six storage buffers (q, K, V, tables,
        // out, split-K partials).
        gpu.require_limits(6)?;
        let c = cache.config();
        if num_heads == 0 || !num_heads.is_multiple_of(c.num_kv_heads) {
            return Err(ShapeError::HeadRatio {
                heads: num_heads,
                kv_heads: c.num_kv_heads,
            }
            .into());
        }
        // Reduce runs a workgroup per query head.
        let max_dim = gpu.limits.max_compute_workgroups_per_dimension;
        if num_heads > max_dim {
            return Err(ShapeError::Dispatch {
                what: "query heads",
                count: num_heads as u64,
                limit: max_dim,
            }
            .into());
        }
        let base = Self::config_shape(gpu, c, num_heads, paged, config);
        let tiled =
            kernels::decode_shape(gpu, Kernel::Tiled, base).ok_or(GpuError::DeviceLimit {
                limit: "max_compute_workgroup_storage_size",
                needed: kernels::min_workgroup_bytes(&base) as u64,
                available: gpu.limits.max_compute_workgroup_storage_size as u64,
            })?;
        if c.num_kv_heads as u64 * tiled.head_tiles() as u64 > max_dim as u64 {
            return Err(ShapeError::Dispatch {
                what: "kv heads x head tiles",
                count: c.num_kv_heads as u64 * tiled.head_tiles() as u64,
                limit: max_dim,
            }
            .into());
        }
        let chunk = config.cascade_chunk_tokens;
        if !(16..=4096).contains(&chunk) || !chunk.is_multiple_of(16) {
            return Err(ShapeError::CascadeChunk(chunk).into());
        }
        let (kernel, strict) = match config.kernel {
            Some(k) => (k, true),
            None => (kernels::default_kernel(gpu), false),
        };
        let (kernel, decode_shape) = match kernels::decode_shape(gpu, kernel, base) {
            Some(s) => (kernel, s),
            None if !strict => (Kernel::Tiled, tiled),
            None => {
                return Err(ShapeError::Kernel {
                    kernel,
                    heads: num_heads,
                    kv_heads: c.num_kv_heads,
                    head_dim: c.head_dim,
                    adapter: gpu.info.name.clone(),
                    eligible: Self::eligible_kernels(gpu, cache, num_heads),
                }
                .into())
            }
        };
        // Prefill tiles stay within WebGPU's default workgroup memory too.
        let have = gpu
            .limits
            .max_compute_workgroup_storage_size
            .min(PORTABLE_WORKGROUP_BYTES);
        let qtile = kernels::tiled::prefill_qtile(&tiled, have);
        Ok(Self {
            cache_cfg: *c,
            num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: c.block_size,
            num_blocks: c.num_blocks,
            kernel,
            decode_shape,
            decode: std::sync::OnceLock::new(),
            reduce: pipeline(gpu, Shader::Reduce, &tiled)?,
            prefill: std::sync::OnceLock::new(),
            prefill_shape: ShaderShape { qtile, ..tiled },
            unused_ml: gpu.storage("unused split (max, sum)", 16)?,
            cascade_chunk: chunk,
            id: next_id(),
        })
    }

    /// The decode grid of `n` sequences in `parts` partitions.
    pub(super) fn decode_grid(&self, n: u32, parts: u32) -> Result<(u32, u32, u32), GpuError> {
        self.serial_grid(n, parts, serial::workgroup_size(self.decode_shape.qtile))
    }

    /// `decode_grid` with `per_wg` invocations per workgroup of the
    /// flattened (serial) kernel.
    pub(super) fn serial_grid(
        &self,
        n: u32,
        parts: u32,
        per_wg: u32,
    ) -> Result<(u32, u32, u32), GpuError> {
        let units = self.num_kv_heads * self.decode_shape.head_tiles();
        match kernels::decode(self.kernel).flat_grid() {
            false => Ok((n, units, parts)),
            true => {
                let total = n as u64 * units as u64 * parts as u64;
                if total > u32::MAX as u64 / 2 {
                    return Err(BatchError::Dispatch {
                        what: "decode passes",
                        count: total,
                        limit: u32::MAX as u64 / 2,
                    }
                    .into());
                }
                let wgs = total.div_ceil(per_wg.max(1) as u64) as u32;
                let x = wgs.clamp(1, 65535);
                Ok((x, wgs.div_ceil(x).max(1), 1))
            }
        }
    }

    /// Queries per prefill workgroup (chosen from the adapter's workgroup memory).
    pub fn prefill_qtile(&self) -> u32 {
        self.prefill_shape.qtile
    }

    pub(super) fn decode_pipeline(&self, gpu: &Gpu) -> Result<&wgpu::ComputePipeline, GpuError> {
        let _serial = gpu.serial();
        if let Some(p) = self.decode.get() {
            return Ok(p);
        }
        let p = pipeline(
            gpu,
            kernels::decode(self.kernel).shader(),
            &self.decode_shape,
        )?;
        Ok(self.decode.get_or_init(|| p))
    }

    pub(super) fn prefill_pipeline(&self, gpu: &Gpu) -> Result<&wgpu::ComputePipeline, GpuError> {
        let _serial = gpu.serial();
        if let Some(p) = self.prefill.get() {
            return Ok(p);
        }
        let p = pipeline(gpu, Shader::Attention, &self.prefill_shape)?;
        Ok(self.prefill.get_or_init(|| p))
    }

    /// Query heads.
    pub fn num_heads(&self) -> u32 {
        self.num_heads
    }

    /// The uniform of one option set over packed tables described by
    /// `meta` (offsets already checked), for the host, encoder and plan paths.
    pub(super) fn params_for(
        &self,
        o: &AttnOptions,
        meta: &PackedMeta,
        partition_tokens: u32,
        num_partitions: u32,
        slopes_off: u32,
        q_stride4: u32,
    ) -> params::AttnParams {
        let n = meta.num_seqs;
        // A sliding window at least as long as every sequence masks
        // nothing: passed as "no window", so the kernels never add it to a
        // position (any u32 window is exact).
        let window = o
            .sliding_window
            .filter(|&w| w < meta.max_len.max(1))
            .unwrap_or(0);
        params::AttnParams {
            num_seqs: n,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            num_blocks: self.num_blocks,
            scale: o.scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt()),
            soft_cap: o.soft_cap.unwrap_or(0.0),
            sliding_window: window,
            alibi: o.alibi_slopes.is_some() as u32,
            partition_tokens,
            num_partitions,
            lens_off: n + 1,
            indices_off: 2 * n + 1,
            indices_len: meta.indices_len,
            slopes_off,
            qo_off: meta.qo_off,
            q_stride: q_stride4,
            // Only with a window: without one every position is visible.
            sink_tokens: if window != 0 {
                o.sink_tokens.unwrap_or(0)
            } else {
                0
            },
            ..Default::default()
        }
    }

    /// Checks what every run checks: the device is alive and `cache` is
    /// the shape these kernels were built for.
    pub(super) fn check_cache(&self, gpu: &Gpu, cache: &KvCache) -> Result<(), GpuError> {
        gpu.alive()?;
        if cache.config() != &self.cache_cfg {
            return Err(ShapeError::OtherCache {
                built: format!("{:?}", self.cache_cfg),
                given: format!("{:?}", cache.config()),
            }
            .into());
        }
        Ok(())
    }

    /// On an adapter that ends long loops early (llvmpipe: 65535 loop
    /// iterations per invocation), refuses a pass over more tokens than it
    /// can finish (`cap`), instead of returning a silently wrong answer.
    pub(super) fn check_pass_tokens(
        &self,
        gpu: &Gpu,
        tokens: u32,
        what: &'static str,
        cap: Option<u32>,
    ) -> Result<(), GpuError> {
        match cap {
            Some(cap) if tokens > cap => Err(GpuError::PassTooLong {
                what,
                tokens,
                cap,
                adapter: gpu.info.name.clone(),
                kernel: if what == "decode" {
                    self.kernel
                } else {
                    Kernel::Tiled
                },
                head_dim: self.head_dim,
            }),
            _ => Ok(()),
        }
    }

    pub(super) fn check_options(&self, o: &AttnOptions) -> Result<(), GpuError> {
        o.validate(self.num_heads).map_err(GpuError::from)
    }
}
