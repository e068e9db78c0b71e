//! The paged KV pool on the GPU and the two kernels that maintain it:
//! `write_kv` (scatter new tokens into their slots) and `copy_blocks`
//! (apply a copy-on-write list).

use super::compose::ShaderShape;
use super::context::Gpu;
pub use super::dtype::KvDtype;
use super::error::{GpuError, PoolError, ShapeError};
use super::pass::pipeline;

/// The write_kv kernel for a pool of `dtype`.
pub(super) fn write_kv_kernel(dtype: KvDtype) -> &'static str {
    if dtype.quantized() {
        "write_kv_q"
    } else {
        "write_kv"
    }
}

/// One E4M3 byte as f32 (no infinities; 0x7f / 0xff, the format's NaN, is
/// never written and reads as 480).
// Host dequantization serves read_layer, which the browser build lacks.
#[cfg_attr(target_arch = "wasm32", allow(dead_code))]
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = (b >> 3) & 0xf;
    let m = (b & 7) as f32;
    if e == 0 {
        sign * m * 2f32.powi(-9)
    } else {
        sign * (1.0 + m / 8.0) * 2f32.powi(e as i32 - 7)
    }
}

/// A layer buffer's bytes as f32 values in the pool layout (quantized
/// pools dequantized with their scales): `raw` is the K (`is_k`) or V
/// buffer, `k_raw` the K buffer (which holds the layer's tail).
#[cfg_attr(target_arch = "wasm32", allow(dead_code))]
pub(super) fn dequantize(cfg: &KvCacheConfig, raw: &[u8], k_raw: &[u8], is_k: bool) -> Vec<f32> {
    match cfg.dtype {
        KvDtype::F32 => bytemuck::cast_slice(raw).to_vec(),
        KvDtype::F16 => bytemuck::cast_slice::<u8, half::f16>(raw)
            .iter()
            .map(|h| h.to_f32())
            .collect(),
        KvDtype::Bf16 => bytemuck::cast_slice::<u8, half::bf16>(raw)
            .iter()
            .map(|h| h.to_f32())
            .collect(),
        KvDtype::Int8 | KvDtype::Fp8E4M3 => {
            let n = (cfg.data_words() * 4) as usize;
            let d = cfg.head_dim as usize;
            let bs = cfg.block_size as usize;
            let kvh = cfg.num_kv_heads as usize;
            let rows = n / d;
            let word_of = |buf: &[u8], w: usize| {
                u32::from_le_bytes([
                    buf[n + 4 * w],
                    buf[n + 4 * w + 1],
                    buf[n + 4 * w + 2],
                    buf[n + 4 * w + 3],
                ])
            };
            let word = |w: usize| word_of(raw, w);
            // The K buffer's tail, after its side words: int8's smoothing
            // factors, or fp8's K then V head scales; then the outlier channels.
            let k_tail = |w: usize| word_of(k_raw, rows + w);
            let chan_at = if cfg.dtype == KvDtype::Int8 {
                kvh * d
            } else {
                2 * kvh
            };
            // A row's int8 scale: K's side word, or V's paired word.
            let int8_scale = |row: usize| {
                if is_k {
                    bf16_scale(word(row))
                } else if bs >= 2 {
                    bf16_scale(word(row / 2) >> (16 * (row % 2)))
                } else {
                    bf16_scale(word(row))
                }
            };
            let mut out: Vec<f32> = (0..n)
                .map(|i| {
                    let row = i / d;
                    let h = (row / bs) % kvh;
                    let b = raw[i];
                    if cfg.dtype == KvDtype::Int8 {
                        let q = (b as i8).max(-127) as f32 / 127.0;
                        q * int8_scale(row)
                    } else {
                        let scale = f32::from_bits(k_tail(h + if is_k { 0 } else { kvh }));
                        fp8_e4m3_to_f32(b) * scale
                    }
                })
                .collect();
            if is_k {
                for row in 0..rows {
                    let h = (row / bs) % kvh;
                    let side = word(row);
                    for j in 0..K_OUTLIERS as usize {
                        let ch = k_tail(chan_at + h * K_OUTLIERS as usize + j) as usize;
                        if ch >= d {
                            continue;
                        }
                        out[row * d + ch] += if cfg.dtype == KvDtype::Int8 {
                            int8_residual(side, j) * bf16_scale(side)
                        } else {
                            fp8_residual(side, j) * f32::from_bits(k_tail(h))
                        };
                    }
                }
                if cfg.dtype == KvDtype::Int8 {
                    // K was divided by its channel's smoothing factor.
                    for (i, x) in out.iter_mut().enumerate() {
                        let h = (i / d / bs) % kvh;
                        *x *= f32::from_bits(k_tail(h * d + i % d));
                    }
                }
            }
            out
        }
    }
}

/// Most K channels per (layer, KV head) that a quantized pool keeps to
/// higher precision ([`KvCache::set_k_outlier_channels`]).
pub const K_OUTLIERS: u32 = 4;

/// An int8 row's scale: the bf16 in the low half of `side` (the row's
/// largest |x|, rounded up; the step is scale / 127).
#[cfg_attr(target_arch = "wasm32", allow(dead_code))]
pub fn bf16_scale(side: u32) -> f32 {
    f32::from_bits(side << 16)
}

/// The 4-bit two's-complement nibble `j` of the high half of a K side word.
#[cfg_attr(target_arch = "wasm32", allow(dead_code))]
fn nibble(side: u32, j: usize) -> f32 {
    (((side >> (16 + 4 * j)) as i32) << 28 >> 28) as f32
}

/// Int8 outlier channel `j`'s residual in units of the row scale: the
/// nibble counts fifteenths of a step (1 / 127).
#[cfg_attr(target_arch = "wasm32", allow(dead_code))]
fn int8_residual(side: u32, j: usize) -> f32 {
    nibble(side, j) / (127.0 * 15.0)
}

/// Fp8 outlier channel `j`'s residual before the head scale: the nibble in
/// bits 4j.. counts fifteenths of the ulp of the stored byte, whose
/// exponent field is in bits 16 + 4j..
#[cfg_attr(target_arch = "wasm32", allow(dead_code))]
fn fp8_residual(side: u32, j: usize) -> f32 {
    let n = (((side >> (4 * j)) as i32) << 28 >> 28) as f32;
    let e = ((side >> (16 + 4 * j)) & 0xf).max(1) as i32;
    n * 2f32.powi(e - 10) / 15.0
}

/// Per KV head of sample keys `rows` (`[n][num_kv_heads][head_dim]`): each
/// channel's largest finite |value|, and the head's 90th-percentile channel
/// maximum (the top of the ordinary channels when a few are outliers).
fn channel_maxima(cfg: &KvCacheConfig, rows: &[f32]) -> Vec<(Vec<f32>, f32)> {
    let (h, d) = (cfg.num_kv_heads as usize, cfg.head_dim as usize);
    let mut amax = vec![0.0f32; h * d];
    for (i, x) in rows.iter().enumerate() {
        if x.is_finite() {
            let c = i % (h * d);
            amax[c] = amax[c].max(x.abs());
        }
    }
    amax.chunks(d)
        .map(|head| {
            let mut sorted = head.to_vec();
            sorted.sort_by(f32::total_cmp);
            (head.to_vec(), sorted[(d * 9 / 10).min(d - 1)])
        })
        .collect()
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
    /// Checks fp8 scales for [`KvCache::set_fp8_scales`], with no GPU: one
    /// per KV head for K and V, each in [`FP8_SCALE_RANGE`].
    pub fn check_fp8_scales(&self, k_scales: &[f32], v_scales: &[f32]) -> Result<(), GpuError> {
        let h = self.num_kv_heads as usize;
        for (what, s) in [("K scales", k_scales), ("V scales", v_scales)] {
            if s.len() != h {
                return Err(PoolError::Count {
                    what,
                    len: s.len() as u64,
                    expected: h as u64,
                    shape: format!("{h} KV heads"),
                }
                .into());
            }
            let what = if what == "K scales" {
                "K scale of KV head"
            } else {
                "V scale of KV head"
            };
            let [lo, hi] = FP8_SCALE_RANGE;
            if let Some((i, x)) = s
                .iter()
                .enumerate()
                .find(|(_, x)| !(x.is_finite() && **x > 0.0))
            {
                return Err(PoolError::Value {
                    what,
                    index: i as u32,
                    value: *x,
                    rule: "fp8 scales must be finite and positive",
                }
                .into());
            }
            if let Some((i, x)) = s.iter().enumerate().find(|(_, x)| !(lo..=hi).contains(*x)) {
                return Err(PoolError::Value {
                    what,
                    index: i as u32,
                    value: *x,
                    rule: "fp8 scales must lie in 2^-100..=2^91 (FP8_SCALE_RANGE), where every \
                           stored value stays finite",
                }
                .into());
            }
        }
        Ok(())
    }

    /// Checks K smoothing factors for [`KvCache::set_k_smoothing`], with no
    /// GPU: one per (KV head, channel), each in [`K_SMOOTHING_RANGE`].
    pub fn check_k_smoothing(&self, factors: &[f32]) -> Result<(), GpuError> {
        let n = (self.num_kv_heads * self.head_dim) as usize;
        if factors.len() != n {
            return Err(PoolError::Count {
                what: "K smoothing factors",
                len: factors.len() as u64,
                expected: n as u64,
                shape: format!(
                    "{} KV heads x head_dim {}",
                    self.num_kv_heads, self.head_dim
                ),
            }
            .into());
        }
        if let Some((i, x)) = factors
            .iter()
            .enumerate()
            .find(|(_, x)| !(x.is_finite() && **x > 0.0))
        {
            return Err(PoolError::Value {
                what: "K smoothing factor",
                index: i as u32,
                value: *x,
                rule: "factors must be finite and positive",
            }
            .into());
        }
        let [lo, hi] = K_SMOOTHING_RANGE;
        if let Some((i, x)) = factors
            .iter()
            .enumerate()
            .find(|(_, x)| !(lo..=hi).contains(*x))
        {
            return Err(PoolError::Value {
                what: "K smoothing factor",
                index: i as u32,
                value: *x,
                rule: "factors must lie in 2^-32..=2^32 (K_SMOOTHING_RANGE), so that the query \
                       they scale stays finite",
            }
            .into());
        }
        Ok(())
    }

    /// Checks outlier channel lists for [`KvCache::set_k_outlier_channels`],
    /// with no GPU: [`K_OUTLIERS`] per KV head, each below head_dim or
    /// [`K_OUTLIER_UNUSED`], distinct within a head.
    pub fn check_k_outlier_channels(&self, channels: &[u32]) -> Result<(), GpuError> {
        let n = (self.num_kv_heads * K_OUTLIERS) as usize;
        if channels.len() != n {
            return Err(PoolError::Count {
                what: "outlier channels",
                len: channels.len() as u64,
                expected: n as u64,
                shape: format!("{} KV heads x {K_OUTLIERS}", self.num_kv_heads),
            }
            .into());
        }
        for (h, head) in channels.chunks(K_OUTLIERS as usize).enumerate() {
            for (j, &c) in head.iter().enumerate() {
                if c == K_OUTLIER_UNUSED {
                    continue;
                }
                if c >= self.head_dim {
                    return Err(PoolError::OutlierChannel {
                        channel: c,
                        head: h as u32,
                        head_dim: self.head_dim,
                    }
                    .into());
                }
                if head[..j].contains(&c) {
                    return Err(PoolError::OutlierTwice {
                        channel: c,
                        head: h as u32,
                    }
                    .into());
                }
            }
        }
        Ok(())
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
                "copy_blocks"
            } else {
                "copy_blocks_q"
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

    /// Sets the fp8 scales of `layer`, one per KV head for K and for V: a
    /// stored value `x` means `x * scale` (E4M3 spans +-448, so a scale of
    /// `max |value| / 448` uses the whole range; see
    /// [`calibrate_fp8_scales`](Self::calibrate_fp8_scales)). Scales must be
    /// finite and positive. Tokens already written keep their bytes, so set
    /// the scales before writing. Only for [`KvDtype::Fp8E4M3`] pools.
    pub fn set_fp8_scales(
        &self,
        gpu: &Gpu,
        layer: u32,
        k_scales: &[f32],
        v_scales: &[f32],
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        if self.cfg.dtype != KvDtype::Fp8E4M3 {
            return Err(PoolError::WrongDtype {
                call: "set_fp8_scales",
                dtype: self.cfg.dtype.name(),
                takes: "fp8",
            }
            .into());
        }
        let [k, _] = self.layer(layer)?;
        self.cfg.check_fp8_scales(k_scales, v_scales)?;
        // Both in the K buffer's tail: K's scales, then V's.
        let at = self.cfg.tail_offset();
        gpu.queue
            .write_buffer(k, at, bytemuck::cast_slice(k_scales));
        gpu.queue.write_buffer(
            k,
            at + 4 * self.cfg.num_kv_heads as u64,
            bytemuck::cast_slice(v_scales),
        );
        Ok(())
    }

    /// Sets the K smoothing factors of an int8 `layer`, one per (KV head,
    /// channel): K is stored divided by its channel's factor (then quantized
    /// per token), and every query is multiplied by it as the kernels read
    /// it, so q.k is unchanged while a few large channels (the outliers of
    /// real keys) no longer set every token's scale. Factors must be finite
    /// and positive; 1.0 (no smoothing) until set. Set them before writing:
    /// tokens already written keep their bytes. Int8 pools only.
    pub fn set_k_smoothing(&self, gpu: &Gpu, layer: u32, factors: &[f32]) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        if self.cfg.dtype != KvDtype::Int8 {
            return Err(PoolError::WrongDtype {
                call: "set_k_smoothing",
                dtype: self.cfg.dtype.name(),
                takes: "int8",
            }
            .into());
        }
        let [k, _] = self.layer(layer)?;
        self.cfg.check_k_smoothing(factors)?;
        let at = self.cfg.tail_offset();
        gpu.queue.write_buffer(k, at, bytemuck::cast_slice(factors));
        Ok(())
    }

    /// K smoothing factors from sample keys `rows` (`[n][num_kv_heads]
    /// [head_dim]`): per (KV head, channel), the channel's largest |value|
    /// over the head's 90th-percentile channel maximum, at least 1
    /// (channels are only ever scaled down).
    pub fn calibrate_k_smoothing(cfg: &KvCacheConfig, rows: &[f32]) -> Vec<f32> {
        let d = cfg.head_dim as usize;
        let mut out = Vec::with_capacity(cfg.num_kv_heads as usize * d);
        for (head, reference) in channel_maxima(cfg, rows) {
            // Bringing the outliers down to the top of the ordinary
            // channels (not lower) keeps the row scale where the ordinary
            // channels put it, and the factor, which multiplies their
            // rounding error back, as small as that allows.
            out.extend(head.iter().map(|&a| {
                if reference > 0.0 && a > reference {
                    (a / reference).min(K_SMOOTHING_RANGE[1])
                } else {
                    1.0
                }
            }));
        }
        out
    }

    /// Per-KV-head fp8 scales that map the largest |value| of `rows`
    /// (`[n][num_kv_heads][head_dim]`) to E4M3's 448; 1.0 for a head with
    /// no finite nonzero value.
    pub fn calibrate_fp8_scales(cfg: &KvCacheConfig, rows: &[f32]) -> Vec<f32> {
        let (h, d) = (cfg.num_kv_heads as usize, cfg.head_dim as usize);
        let mut amax = vec![0.0f32; h];
        for (i, x) in rows.iter().enumerate() {
            if x.is_finite() {
                let head = (i / d) % h;
                amax[head] = amax[head].max(x.abs());
            }
        }
        amax.iter()
            .map(|&a| {
                if a > 0.0 {
                    (a / 448.0).clamp(FP8_SCALE_RANGE[0], FP8_SCALE_RANGE[1])
                } else {
                    1.0
                }
            })
            .collect()
    }

    /// Sets the K outlier channels of a quantized `layer`: for each KV head,
    /// [`K_OUTLIERS`] channel indices, [`K_OUTLIER_UNUSED`] for an unused
    /// entry (a list of only those sets none). Any other index must be
    /// below `head_dim`. Each
    /// named channel keeps a 4-bit residual in its row's side word, so its
    /// values are stored to about 12 bits (int8: fifteenths of the row's step) or
    /// about 7 mantissa bits (fp8) instead of 8 or 3, and the kernels add its
    /// share of q.k back. Channels that dwarf the others (the outliers of
    /// real keys) otherwise dominate the error of q.k: a score's error
    /// grows with the channel's magnitude. Indices must be below
    /// `head_dim` and distinct within a head; none are set until this is
    /// called. Set them before writing: tokens already written keep their bytes.
    pub fn set_k_outlier_channels(
        &self,
        gpu: &Gpu,
        layer: u32,
        channels: &[u32],
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        if !self.cfg.dtype.quantized() {
            return Err(PoolError::WrongDtype {
                call: "set_k_outlier_channels",
                dtype: self.cfg.dtype.name(),
                takes: "int8 and fp8",
            }
            .into());
        }
        let [k, _] = self.layer(layer)?;
        self.cfg.check_k_outlier_channels(channels)?;
        let n = channels.len();
        // The channel lists end the tail.
        let at = self.cfg.tail_offset() + self.cfg.tail_bytes() - (n as u64) * 4;
        gpu.queue
            .write_buffer(k, at, bytemuck::cast_slice(channels));
        Ok(())
    }

    /// K outlier channels from sample keys `rows` (`[n][num_kv_heads]
    /// [head_dim]`), for [`set_k_outlier_channels`](Self::set_k_outlier_channels):
    /// per KV head, up to [`K_OUTLIERS`] channels whose largest |value| is
    /// over twice the head's 90th-percentile channel maximum, largest first;
    /// `u32::MAX` fills the rest.
    pub fn calibrate_k_outlier_channels(cfg: &KvCacheConfig, rows: &[f32]) -> Vec<u32> {
        let d = cfg.head_dim as usize;
        let mut out = Vec::with_capacity((cfg.num_kv_heads * K_OUTLIERS) as usize);
        for (head, reference) in channel_maxima(cfg, rows) {
            let mut order: Vec<usize> = (0..d).filter(|&c| head[c] > 2.0 * reference).collect();
            order.sort_by(|&a, &b| head[b].total_cmp(&head[a]));
            order.truncate(K_OUTLIERS as usize);
            out.extend(order.iter().map(|&c| c as u32));
            out.extend(std::iter::repeat_n(
                u32::MAX,
                K_OUTLIERS as usize - order.len(),
            ));
        }
        out
    }

    /// Reads one layer's K and V pools back as f32 (f16 pools are widened).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_layer(&self, gpu: &Gpu, layer: u32) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        let [k, v] = self.layer(layer)?;
        let kr = gpu.read(k, self.cfg.layer_bytes())?;
        let vr = gpu.read(v, self.cfg.v_layer_bytes())?;
        Ok((
            dequantize(&self.cfg, &kr, &kr, true),
            dequantize(&self.cfg, &vr, &kr, false),
        ))
    }
}
