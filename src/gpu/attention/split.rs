//! Split-K: how many partitions a batch takes, per kernel and adapter.

use super::*;

impl PagedAttention {
    /// Partition tokens for a decode of `n` sequences whose longest holds
    /// `max_len` tokens under `split`, for this kernel and adapter: `0` for
    /// one pass per sequence.
    pub(in crate::gpu) fn decode_partition(
        &self,
        gpu: &Gpu,
        split: Split,
        n: u32,
        max_len: u32,
    ) -> u32 {
        match split {
            Split::Never => 0,
            Split::Tokens(t) => t,
            Split::Auto => {
                let passes =
                    n as u64 * self.num_kv_heads as u64 * self.decode_shape.head_tiles() as u64;
                kernels::auto_partition(
                    self.kernel,
                    &self.decode_shape,
                    passes,
                    max_len,
                    kernels::pass_cap(gpu, self.kernel, &self.decode_shape),
                    gpu.compute_units().map(|u| u.count),
                )
            }
        }
    }

    /// Partition tokens for a prefill of `tiles` query tiles (0: unsplit).
    /// Split only under `Split::Auto`, and only when the output rows fit one
    /// dispatch dimension of the merge.
    pub(in crate::gpu) fn prefill_partition(
        &self,
        gpu: &Gpu,
        split: Split,
        tiles: u32,
        num_queries: u32,
        max_len: u32,
    ) -> u32 {
        if split != Split::Auto || num_queries > MAX_BATCH {
            return 0;
        }
        let passes =
            tiles as u64 * self.num_kv_heads as u64 * self.prefill_shape.head_tiles() as u64;
        // Prefill keeps the fixed target: its query tiles are the work.
        kernels::auto_partition(
            Kernel::Tiled,
            &self.prefill_shape,
            passes,
            max_len,
            kernels::pass_cap(gpu, Kernel::Tiled, &self.prefill_shape),
            None,
        )
    }

    /// The most tokens one decode pass may walk here (`None`: no limit).
    pub(in crate::gpu) fn decode_pass_cap(&self, gpu: &Gpu) -> Option<u32> {
        kernels::pass_cap(gpu, self.kernel, &self.decode_shape)
    }

    /// Tokens per split-K partition that a decode of `n` sequences, the
    /// longest `max_len` tokens, uses under `split` with this kernel on
    /// `gpu` (0: one pass per sequence).
    pub fn partition_tokens(&self, gpu: &Gpu, split: Split, n: u32, max_len: u32) -> u32 {
        self.decode_partition(gpu, split, n, max_len)
    }

    /// Checks a prefill's pass and chooses its split: (partition tokens,
    /// partitions).
    pub(in crate::gpu) fn prefill_split(
        &self,
        gpu: &Gpu,
        split: Split,
        tiles: u32,
        num_queries: u32,
        max_len: u32,
    ) -> Result<(u32, u32), GpuError> {
        let pt = self.prefill_partition(gpu, split, tiles, num_queries, max_len);
        let cap = kernels::pass_cap(gpu, Kernel::Tiled, &self.prefill_shape);
        self.checked_split(gpu, pt, max_len, "prefill", cap)
    }

    /// Checks a decode's pass and chooses its split: (partition tokens,
    /// partitions).
    pub(in crate::gpu) fn decode_split(
        &self,
        gpu: &Gpu,
        split: Split,
        n: u32,
        max_len: u32,
    ) -> Result<(u32, u32), GpuError> {
        let pt = self.decode_partition(gpu, split, n, max_len);
        self.checked_split(gpu, pt, max_len, "decode", self.decode_pass_cap(gpu))
    }

    /// (partition tokens, partitions) for `pt` over `max_len` tokens, once
    /// each pass is known to fit the adapter's loop cap and the partitions
    /// one dispatch dimension.
    pub(in crate::gpu) fn checked_split(
        &self,
        gpu: &Gpu,
        pt: u32,
        max_len: u32,
        what: &'static str,
        cap: Option<u32>,
    ) -> Result<(u32, u32), GpuError> {
        self.check_pass_tokens(
            gpu,
            if pt == 0 { max_len } else { pt.min(max_len) },
            what,
            cap,
        )?;
        if pt == 0 {
            return Ok((0, 1));
        }
        let parts = max_len.div_ceil(pt).max(1);
        if parts > 65535 {
            return Err(BatchError::Dispatch {
                what: "partitions",
                count: parts as u64,
                limit: 65535,
            }
            .into());
        }
        Ok((pt, parts))
    }
}
