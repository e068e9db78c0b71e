//! Swap: moving blocks of every layer between the pool and host memory,
//! for the block manager's `swap_out` / `swap_in` copy lists.
//!
//! Each direction is one submit of `copy_buffer_to_buffer` commands through
//! staging buffers (runs of consecutive pool blocks go as one copy per
//! layer), never a submit per block. A block moves with its side words
//! (int8 scales, K outlier residuals); per-layer data (fp8 scales, K
//! smoothing, outlier channels) stays in the pool.

use super::context::Gpu;
use super::error::{GpuError, PoolError};
use super::kv_cache::{KvCache, KvCacheConfig};

/// Most host memory one [`SwapSpace`] takes: 16 GiB.
pub const MAX_SWAP_BYTES: u64 = 16 << 30;

/// Host swap space for a [`KvCache`]: `blocks` blocks, each holding one
/// pool block of every layer (K and V, with int8's row scales).
#[derive(Clone, Debug, PartialEq)]
pub struct SwapSpace {
    cfg: KvCacheConfig,
    blocks: u32,
    /// `u32` words of one block in one layer's K buffer (V's, never more,
    /// take the start of their slot).
    words: usize,
    /// `[host block][layer][K, V][words]`.
    data: Vec<u32>,
}

impl SwapSpace {
    /// Host blocks.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Bytes one host block holds (all layers, K and V).
    pub fn block_bytes(&self) -> u64 {
        self.words as u64 * 4 * 2 * self.cfg.num_layers as u64
    }

    /// The words of host block `h`, layer `layer`, K (`kv = 0`) or V (1).
    fn range(&self, h: u32, layer: u32, kv: usize) -> std::ops::Range<usize> {
        let at =
            ((h as usize * self.cfg.num_layers as usize + layer as usize) * 2 + kv) * self.words;
        at..at + self.words
    }

    /// The raw words of host block `h` (tests compare round trips).
    pub fn block_words(&self, h: u32) -> Option<&[u32]> {
        let per = self.words * 2 * self.cfg.num_layers as usize;
        let at = (h as usize).checked_mul(per)?;
        self.data.get(at..at + per)
    }
}

/// Runs of consecutive pool blocks in `blocks` (in order): `(first index,
/// blocks in the run)`; swap's copies and transfer's coalesce them.
pub(super) fn runs(blocks: &[u32]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (i, &b) in blocks.iter().enumerate() {
        match out.last_mut() {
            Some(r) if blocks[i - 1].checked_add(1) == Some(b) => r.1 += 1,
            _ => out.push((i, 1)),
        }
    }
    out
}

/// A block's byte ranges in the K (`is_k`) or V buffer of a layer: its
/// data, and (quantized pools) its side words after all blocks' data.
/// Offsets and lengths are multiples of 4.
pub(super) fn block_ranges(cfg: &KvCacheConfig, b: u32, is_k: bool) -> [(u64, u64); 2] {
    let rows = cfg.num_kv_heads as u64 * cfg.block_size as u64;
    let data = rows * cfg.head_dim as u64 * cfg.dtype.bytes();
    let first = (b as u64 * data, data);
    let side = cfg.side_words_per_block(is_k) * 4;
    let second = (cfg.data_words() * 4 + b as u64 * side, side);
    [first, second]
}

impl KvCache {
    /// Host swap space of `blocks` blocks for this pool (refused past
    /// [`MAX_SWAP_BYTES`]).
    pub fn swap_space(&self, blocks: u32) -> Result<SwapSpace, GpuError> {
        let cfg = *self.config();
        let words = (cfg.buffer_block_bytes(true) / 4) as usize;
        let bytes = cfg
            .buffer_block_bytes(true)
            .checked_mul(2 * cfg.num_layers as u64)
            .and_then(|b| b.checked_mul(blocks as u64))
            .filter(|&b| b <= MAX_SWAP_BYTES)
            .ok_or(GpuError::Pool(PoolError::SwapTooLarge {
                blocks,
                block_bytes: cfg.buffer_block_bytes(true) * 2 * cfg.num_layers as u64,
                limit: MAX_SWAP_BYTES,
            }))?;
        let len = usize::try_from(bytes / 4).map_err(|_| PoolError::SwapTooLarge {
            blocks,
            block_bytes: cfg.buffer_block_bytes(true) * 2 * cfg.num_layers as u64,
            limit: (usize::MAX as u64).saturating_mul(4),
        })?;
        Ok(SwapSpace {
            cfg,
            blocks,
            words,
            data: vec![0; len],
        })
    }

    fn check_swap(
        &self,
        space: &SwapSpace,
        pairs: &[[u32; 2]],
        pool_at: usize,
    ) -> Result<(), GpuError> {
        if space.cfg != *self.config() {
            return Err(PoolError::SwapShape.into());
        }
        let nb = self.config().num_blocks;
        let mut seen_pool = std::collections::HashSet::new();
        let mut seen_host = std::collections::HashSet::new();
        for p in pairs {
            let (b, h) = (p[pool_at], p[1 - pool_at]);
            if b >= nb || h >= space.blocks {
                return Err(PoolError::SwapOutside {
                    pair: *p,
                    pool: nb,
                    space: space.blocks,
                }
                .into());
            }
            // A block may be read twice (a block two groups share goes to
            // two host blocks), never written twice.
            let fresh = if pool_at == 0 {
                seen_host.insert(h)
            } else {
                seen_pool.insert(b)
            };
            if !fresh {
                return Err(PoolError::SwapTwice { pair: *p }.into());
            }
        }
        Ok(())
    }

    /// Copies pool blocks to host swap space: `pairs` are `(pool block,
    /// host block)`, as `BlockManager::swap_out` returns them. One submit
    /// for all layers, then one readback. Run it before anything writes the
    /// pool blocks again. Native only (the browser: [`swap_out_async`](Self::swap_out_async)).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn swap_out(
        &self,
        gpu: &Gpu,
        pairs: &[[u32; 2]],
        space: &mut SwapSpace,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        pollster::block_on(self.swap_out_async(gpu, pairs, space))
    }

    /// [`swap_out`](Self::swap_out) without blocking the thread.
    pub async fn swap_out_async(
        &self,
        gpu: &Gpu,
        pairs: &[[u32; 2]],
        space: &mut SwapSpace,
    ) -> Result<(), GpuError> {
        gpu.alive()?;
        self.check_swap(space, pairs, 0)?;
        if pairs.is_empty() {
            return Ok(());
        }
        let cfg = *self.config();
        let bytes = pairs.len() as u64 * space.block_bytes();
        let staging = gpu.staging("swap-out staging", bytes)?;
        let runs = runs(&pairs.iter().map(|p| p[0]).collect::<Vec<_>>());
        // Staging layout: [layer][K, V][pair][block words].
        let plane = pairs.len() as u64 * space.words as u64 * 4;
        gpu.scoped_try(|| {
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            for (l, bufs) in (0..cfg.num_layers).map(|l| (l, self.layer(l))) {
                let bufs = bufs?;
                for (kv, buf) in bufs.iter().enumerate() {
                    let base = (l as u64 * 2 + kv as u64) * plane;
                    for &(i, n) in &runs {
                        let mut at = base + i as u64 * space.words as u64 * 4;
                        for (off, len) in block_ranges(&cfg, pairs[i][0], kv == 0) {
                            if len > 0 {
                                enc.copy_buffer_to_buffer(buf, off, &staging, at, len * n as u64);
                                at += len * n as u64;
                            }
                        }
                    }
                }
            }
            gpu.queue.submit([enc.finish()]);
            Ok(())
        })?;
        let words: Vec<u32> = gpu.map_read(&staging, bytes).await?;
        // Scatter to [host block][layer][K, V][words]: within a run, each
        // range holds its blocks one after another.
        let w = space.words;
        for l in 0..cfg.num_layers {
            for kv in 0..2 {
                let base = ((l as usize * 2 + kv) * pairs.len()) * w;
                for &(i, n) in &runs {
                    let run = &words[base + i * w..base + (i + n) * w];
                    let [(_, dl), (_, sl)] = block_ranges(&cfg, pairs[i][0], kv == 0);
                    let (dw, sw) = ((dl / 4) as usize, (sl / 4) as usize);
                    for j in 0..n {
                        let dst = space.range(pairs[i + j][1], l, kv);
                        let out = &mut space.data[dst];
                        out[..dw].copy_from_slice(&run[j * dw..(j + 1) * dw]);
                        out[dw..dw + sw]
                            .copy_from_slice(&run[n * dw + j * sw..n * dw + (j + 1) * sw]);
                    }
                }
            }
        }
        Ok(())
    }

    /// Copies host blocks back into the pool: `pairs` are `(host block,
    /// pool block)`, as `BlockManager::swap_in` returns them. One submit for
    /// all layers (after one staging upload).
    pub fn swap_in(
        &self,
        gpu: &Gpu,
        pairs: &[[u32; 2]],
        space: &SwapSpace,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        self.check_swap(space, pairs, 1)?;
        if pairs.is_empty() {
            return Ok(());
        }
        let cfg = *self.config();
        let w = space.words;
        let runs = runs(&pairs.iter().map(|p| p[1]).collect::<Vec<_>>());
        // Gather to the staging layout of swap_out, [layer][K, V][pair][words]
        // with each run's data ranges before its scale ranges.
        let mut words = vec![0u32; pairs.len() * w * 2 * cfg.num_layers as usize];
        for l in 0..cfg.num_layers {
            for kv in 0..2 {
                let base = ((l as usize * 2 + kv) * pairs.len()) * w;
                for &(i, n) in &runs {
                    let [(_, dl), (_, sl)] = block_ranges(&cfg, pairs[i][1], kv == 0);
                    let (dw, sw) = ((dl / 4) as usize, (sl / 4) as usize);
                    let run = &mut words[base + i * w..base + (i + n) * w];
                    for j in 0..n {
                        let src = &space.data[space.range(pairs[i + j][0], l, kv)];
                        run[j * dw..(j + 1) * dw].copy_from_slice(&src[..dw]);
                        run[n * dw + j * sw..n * dw + (j + 1) * sw]
                            .copy_from_slice(&src[dw..dw + sw]);
                    }
                }
            }
        }
        let plane = pairs.len() as u64 * w as u64 * 4;
        gpu.scoped_try(|| {
            let staging = gpu.storage_init("swap-in staging", &words)?;
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            for l in 0..cfg.num_layers {
                let bufs = self.layer(l)?;
                for (kv, buf) in bufs.iter().enumerate() {
                    let base = (l as u64 * 2 + kv as u64) * plane;
                    for &(i, n) in &runs {
                        let mut at = base + i as u64 * w as u64 * 4;
                        for (off, len) in block_ranges(&cfg, pairs[i][1], kv == 0) {
                            if len > 0 {
                                enc.copy_buffer_to_buffer(&staging, at, buf, off, len * n as u64);
                                at += len * n as u64;
                            }
                        }
                    }
                }
            }
            gpu.queue.submit([enc.finish()]);
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_consecutive_blocks() {
        assert_eq!(runs(&[3, 4, 5, 9, 10, 2]), vec![(0, 3), (3, 2), (5, 1)]);
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(runs(&[u32::MAX, 0]), vec![(0, 1), (1, 1)]);
        assert_eq!(runs(&[7, 7]), vec![(0, 1), (1, 1)]);
    }
}
