//! Quantized pools (int8, fp8 E4M3): the host codecs, per-token scales, K smoothing and outlier channels, checked, set and calibrated.

use super::*;

impl KvCacheConfig {
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
}

impl KvCache {
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
