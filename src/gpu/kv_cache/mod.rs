//! The paged KV pool on the GPU and the two kernels that maintain it:
//! `write_kv` (scatter new tokens into their slots) and `copy_blocks`
//! (apply a copy-on-write list).

use super::compose::{Shader, ShaderShape};
use super::context::Gpu;
pub use super::dtype::KvDtype;
use super::error::{GpuError, PoolError, ShapeError};
use super::pass::pipeline;

mod quant;
pub use quant::*;

/// The write_kv kernel for a pool of `dtype`.
pub(super) fn write_kv_kernel(dtype: KvDtype) -> Shader {
    if dtype.quantized() {
        Shader::WriteKvQ
    } else {
        Shader::WriteKv
    }
}

/// Most layers one [`KvCache`] holds.
pub const MAX_LAYERS: u32 = 4096;

/// Largest magnitude a pool stores: 2^100. Writes saturate there (f16 pools
/// at 65504, fp8 at 448 times the head's scale), infinities included, so
/// every stored value, int8 row scale and dequantized value is finite, and
/// decode sums of them stay finite for any realistic query and context
/// (scores overflow only past 2^27 in a query row's channel sum).
pub const KV_MAX: f32 = f32::from_bits(0x7180_0000);

/// The fp8 scales [`KvCache::set_fp8_scales`] accepts: 2^-100 to 2^91.
/// Below, the reciprocal the write divides by is not finite; above, 448
/// times the scale passes [`KV_MAX`].
pub const FP8_SCALE_RANGE: [f32; 2] = [f32::from_bits(0x0d80_0000), f32::from_bits(0x6d00_0000)];

/// The K smoothing factors [`KvCache::set_k_smoothing`] accepts: 2^-32 to
/// 2^32. The kernels multiply the query by the factor: wider, a finite
/// query could overflow.
pub const K_SMOOTHING_RANGE: [f32; 2] = [f32::from_bits(0x2f80_0000), f32::from_bits(0x4f80_0000)];

/// An unused entry of [`KvCache::set_k_outlier_channels`]' list.
pub const K_OUTLIER_UNUSED: u32 = u32::MAX;

/// Most KV heads a cache may have (the kernels put KV heads on one
/// dispatch dimension).
pub const MAX_KV_HEADS: u32 = 65535;

/// Shape of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheConfig {
    /// Transformer layers (one K and one V buffer each).
    pub num_layers: u32,
    /// Physical blocks per layer.
    pub num_blocks: u32,
    /// Tokens per block (power of two, 1..=256).
    pub block_size: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Elements per head: a multiple of 4 up to 256.
    pub head_dim: u32,
    /// Element type.
    pub dtype: KvDtype,
    /// The layer group of a hybrid model this pool holds (0 for a model
    /// whose layers share one pool): exported blocks name it
    /// ([`KvLayout::layer_group`](super::KvLayout::layer_group)), and an
    /// import of another group's blocks is refused.
    pub layer_group: u16,
}

impl KvCacheConfig {
    /// One layer of `num_blocks` blocks of `block_size` tokens, each token
    /// `num_kv_heads` rows of `head_dim` f32s; [`with_layers`](Self::with_layers)
    /// and [`with_dtype`](Self::with_dtype) set the rest. Checked when a
    /// cache is made ([`validate`](Self::validate)).
    pub const fn new(num_blocks: u32, block_size: u32, num_kv_heads: u32, head_dim: u32) -> Self {
        KvCacheConfig {
            num_layers: 1,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype: KvDtype::F32,
            layer_group: 0,
        }
    }

    /// The same shape holding layer group `g` of a hybrid model.
    pub const fn with_layer_group(self, layer_group: u16) -> Self {
        KvCacheConfig {
            layer_group,
            ..self
        }
    }

    /// The same shape with `num_layers` layers.
    pub const fn with_layers(self, num_layers: u32) -> Self {
        KvCacheConfig { num_layers, ..self }
    }

    /// The same shape stored as `dtype`.
    pub const fn with_dtype(self, dtype: KvDtype) -> Self {
        KvCacheConfig { dtype, ..self }
    }

    /// Bytes one block takes in one layer, K and V buffers together
    /// (saturating at `u64::MAX` for shapes [`validate`](Self::validate)
    /// refuses). Quantized pools include the rows' side words.
    pub fn block_bytes(&self) -> u64 {
        self.buffer_block_bytes(true)
            .saturating_add(self.buffer_block_bytes(false))
    }

    /// Bytes one block takes in one layer's K (`is_k`) or V buffer.
    pub fn buffer_block_bytes(&self, is_k: bool) -> u64 {
        let rows = self.num_kv_heads as u64 * self.block_size as u64;
        let data = rows
            .saturating_mul(self.head_dim as u64)
            .saturating_mul(self.dtype.bytes());
        data.saturating_add(self.side_words_per_block(is_k) * 4)
    }

    /// `u32` side words of one block after all blocks' data, in the K
    /// (`is_k`) or V buffer of a quantized pool (0 otherwise). K: one per
    /// (token, KV head) row (int8: the row's bf16 scale in the low half and
    /// the outlier residual nibbles in the high half; fp8: the residual
    /// nibbles and their bytes' exponent fields). V, int8: the rows' bf16
    /// scales two per word (rows `2i`, `2i + 1` of a block, low half
    /// first), one per word when `block_size` is 1; V, fp8: none. A block's
    /// side words are consecutive (block `b`'s start at `b` times this).
    pub fn side_words_per_block(&self, is_k: bool) -> u64 {
        let rows = self.num_kv_heads as u64 * self.block_size as u64;
        match (self.dtype, is_k) {
            (KvDtype::F32 | KvDtype::F16 | KvDtype::Bf16, _) => 0,
            (_, true) => rows,
            (KvDtype::Int8, false) if self.block_size >= 2 => rows / 2,
            (KvDtype::Int8, false) => rows,
            (KvDtype::Fp8E4M3, false) => 0,
        }
    }

    /// The initial words of the K (`is_k`) or V layer buffer from
    /// [`data_words`](Self::data_words) on (quantized pools; empty
    /// otherwise): side words of an int8 scale of 1 with no residuals (fp8:
    /// 0), then (K) the tail: smoothing factors of 1 (int8) or K and V head
    /// scales of 1 (fp8), and no outlier channels.
    pub fn side_and_tail_init(&self, is_k: bool) -> Vec<u32> {
        if !self.dtype.quantized() {
            return Vec::new();
        }
        let side = self.side_words_per_block(is_k) as usize * self.num_blocks as usize;
        let one = 1.0f32.to_bits() >> 16;
        let word = match (self.dtype, is_k) {
            (KvDtype::Int8, true) => one,
            (KvDtype::Int8, false) if self.block_size >= 2 => one | one << 16,
            (KvDtype::Int8, false) => one,
            _ => 0,
        };
        let mut w = vec![word; side];
        if is_k {
            let chans = (self.num_kv_heads * K_OUTLIERS) as usize;
            let ones = (self.tail_bytes() / 4) as usize - chans;
            w.extend(std::iter::repeat_n(1.0f32.to_bits(), ones));
            w.extend(std::iter::repeat_n(u32::MAX, chans));
        }
        w
    }

    /// Bytes of one layer's K buffer (saturating), the larger of the two:
    /// the blocks, their side words, and the layer's tail; quantized pools
    /// round up to 16 bytes, so a kernel may read them as `vec4<u32>`.
    pub fn layer_bytes(&self) -> u64 {
        pad16(
            self.tail_offset().saturating_add(self.tail_bytes()),
            self.dtype,
        )
    }

    /// Bytes of one layer's V buffer (saturating): the blocks and their
    /// side words, rounded up to 16 bytes like the K buffer's.
    pub fn v_layer_bytes(&self) -> u64 {
        pad16(
            self.buffer_block_bytes(false)
                .saturating_mul(self.num_blocks as u64),
            self.dtype,
        )
    }

    /// Byte offset of the tail in the K layer buffer: after every block's
    /// data and side words.
    pub fn tail_offset(&self) -> u64 {
        self.buffer_block_bytes(true)
            .saturating_mul(self.num_blocks as u64)
    }

    /// Bytes of the K layer buffer after its blocks and their side words:
    /// fp8's K then V scale per KV head, or int8's K smoothing factor per
    /// (KV head, channel); then [`K_OUTLIERS`] outlier channel indices per
    /// KV head (`u32::MAX`: none). The V buffer has no tail.
    pub fn tail_bytes(&self) -> u64 {
        let h = self.num_kv_heads as u64;
        let chans = h * K_OUTLIERS as u64 * 4;
        match self.dtype {
            KvDtype::Fp8E4M3 => 2 * h * 4 + chans,
            KvDtype::Int8 => h * self.head_dim as u64 * 4 + chans,
            _ => 0,
        }
    }

    /// `u32` words of one layer's packed data before the scales (quantized
    /// pools; 4 values per word).
    pub fn data_words(&self) -> u64 {
        (self.num_blocks as u64 * self.num_kv_heads as u64 * self.block_size as u64)
            .saturating_mul(self.head_dim as u64)
            / 4
    }

    /// KV4 elements (4 cache elements) per block (saturating: a shape whose
    /// count does not fit a `u32` is refused by [`validate`](Self::validate)).
    pub fn block_elems4(&self) -> u32 {
        let e = (self.num_kv_heads as u64 * self.block_size as u64)
            .saturating_mul(self.head_dim as u64)
            / 4;
        e.min(u32::MAX as u64) as u32
    }

    /// Threads of write_kv per token: one per vec4 (fp8's first vec4 of a
    /// row also writes the row's side word), or for int8 one per (token,
    /// head) row (it finds the row's scale first).
    pub(super) fn write_threads_per_token(&self) -> u64 {
        let heads = self.num_kv_heads as u64;
        if self.dtype == KvDtype::Int8 {
            heads
        } else {
            heads * self.head_dim as u64 / 4
        }
    }

    /// Threads of copy_blocks per copied block: its KV4 elements, plus its
    /// K side words (the V side words, never more, ride along).
    pub(super) fn copy_threads_per_block(&self) -> u64 {
        self.block_elems4() as u64 + self.side_words_per_block(true)
    }
    /// Checks the shape on its own (no adapter limits).
    pub fn validate(&self) -> Result<(), GpuError> {
        if !(1..=256).contains(&self.block_size) || !self.block_size.is_power_of_two() {
            return Err(PoolError::BlockSize(self.block_size).into());
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(4) || self.head_dim > 256 {
            return Err(ShapeError::HeadDim(self.head_dim).into());
        }
        if self.num_kv_heads == 0 || self.num_layers == 0 || self.num_blocks == 0 {
            return Err(PoolError::EmptyShape {
                layers: self.num_layers,
                blocks: self.num_blocks,
                kv_heads: self.num_kv_heads,
            }
            .into());
        }
        if self.num_layers > MAX_LAYERS {
            return Err(PoolError::TooManyLayers {
                layers: self.num_layers,
                limit: MAX_LAYERS,
            }
            .into());
        }
        if self.num_kv_heads > MAX_KV_HEADS {
            return Err(ShapeError::KvHeads {
                kv_heads: self.num_kv_heads,
                limit: MAX_KV_HEADS,
            }
            .into());
        }
        Ok(())
    }

    /// Largest `num_blocks` whose layer buffer fits `limit` bytes (and whose
    /// element offsets fit the kernels' `u32` indices); 0 for a shape whose
    /// one block is already too big.
    pub fn max_blocks_for(&self, limit: u64) -> u32 {
        // The K buffer is the larger.
        let block = self.buffer_block_bytes(true).max(1);
        let elems4 = (self.num_kv_heads as u64 * self.block_size as u64)
            .saturating_mul(self.head_dim as u64)
            / 4;
        let tail = self.tail_bytes();
        // Quantized layers end on a 16-byte boundary (`layer_bytes`).
        let room = if self.dtype.quantized() {
            limit & !15
        } else {
            limit
        };
        let by_bytes = room.saturating_sub(tail) / block;
        // Quantized pools address data and scales as u32 words.
        let words = elems4 + self.side_words_per_block(true);
        let by_index = (u32::MAX as u64 - tail / 4) / words.max(1);
        by_bytes.min(by_index).min(u32::MAX as u64) as u32
    }
}

/// `bytes` rounded up to a multiple of 16 for quantized pools (saturating).
fn pad16(bytes: u64, dtype: KvDtype) -> u64 {
    if dtype.quantized() {
        bytes.saturating_add(15) & !15
    } else {
        bytes
    }
}

/// Per-layer K and V storage buffers in the layout
/// `[num_blocks][num_kv_heads][block_size][head_dim]`, with the kernels that
/// write and copy blocks.
pub struct KvCache {
    pub(super) cfg: KvCacheConfig,
    pub(super) layers: Vec<[wgpu::Buffer; 2]>,
    pub(super) write_kv: wgpu::ComputePipeline,
    pub(super) copy_blocks: wgpu::ComputePipeline,
    /// Identifies this cache to the plans it makes.
    pub(super) id: u64,
    /// Write steps planned (`plan_write` calls that succeeded): attention
    /// plans are bound to one.
    pub(super) write_epoch: std::sync::atomic::AtomicU64,
}

impl KvCache {
    /// Allocates the pool. Errors name the largest `num_blocks` that would
    /// fit when the adapter's binding limit is too small.
    pub fn new(gpu: &Gpu, cfg: KvCacheConfig) -> Result<Self, GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        cfg.validate()?;
        // write_kv binds five storage buffers (new K, new V, slots, pools).
        gpu.require_limits(5)?;
        let limit = gpu.max_binding_bytes();
        let max_blocks = cfg.max_blocks_for(limit);
        if cfg.num_blocks > max_blocks {
            return Err(GpuError::CacheTooLarge {
                num_blocks: cfg.num_blocks,
                bytes: cfg.layer_bytes(),
                limit,
                max_blocks,
            });
        }
        let shape = ShaderShape {
            head_dim: cfg.head_dim,
            block_size: cfg.block_size,
            dtype: cfg.dtype,
            ..ShaderShape::default()
        };
        let q = if cfg.dtype.quantized() { "_q" } else { "" };
        let write_kv = pipeline(gpu, write_kv_kernel(cfg.dtype), &shape)?;
        let copy_blocks = pipeline(
            gpu,
            if q.is_empty() {
                Shader::CopyBlocks
            } else {
                Shader::CopyBlocksQ
            },
            &shape,
        )?;
        let mut layers = Vec::with_capacity(cfg.num_layers as usize);
        let alloc = || -> Result<(), GpuError> {
            for l in 0..cfg.num_layers {
                let k = gpu.storage(&format!("k_pool[{l}]"), cfg.layer_bytes())?;
                let v = gpu.storage(&format!("v_pool[{l}]"), cfg.v_layer_bytes())?;
                layers.push([k, v]);
            }
            Ok(())
        };
        #[cfg(not(target_arch = "wasm32"))]
        gpu.scoped_blocking(alloc)??;
        // The web cannot block on the error scope; errors surface on first use.
        #[cfg(target_arch = "wasm32")]
        {
            let mut alloc = alloc;
            alloc()?;
        }
        if cfg.dtype.quantized() {
            // fp8 scales and int8 K smoothing factors of 1.0, and no
            // outlier channels, until the engine sets its own.
            let (ki, vi) = (cfg.side_and_tail_init(true), cfg.side_and_tail_init(false));
            let at = cfg.data_words() * 4;
            for [k, v] in &layers {
                gpu.queue.write_buffer(k, at, bytemuck::cast_slice(&ki));
                if !vi.is_empty() {
                    gpu.queue.write_buffer(v, at, bytemuck::cast_slice(&vi));
                }
            }
        }
        Ok(Self {
            cfg,
            layers,
            write_kv,
            copy_blocks,
            id: super::pass::next_id(),
            write_epoch: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Write steps planned on this cache so far: each successful
    /// `plan_write` starts one. An attention plan that ran in one step is
    /// refused in the next (`PlanMismatch::Stale`).
    pub fn write_epoch(&self) -> u64 {
        self.write_epoch.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The shape.
    pub fn config(&self) -> &KvCacheConfig {
        &self.cfg
    }

    /// K and V buffers of `layer`.
    pub fn layer(&self, layer: u32) -> Result<&[wgpu::Buffer; 2], GpuError> {
        self.layers
            .get(layer as usize)
            .ok_or(GpuError::Pool(PoolError::Layer {
                layer,
                layers: self.cfg.num_layers,
            }))
    }
}
