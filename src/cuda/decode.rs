//! Paged decode on CUDA: the twin of [`PagedAttention`](crate::gpu::PagedAttention)
//! over a [`CudaKvCache`], one pass per (sequence, kv head, head tile[,
//! partition]), with the algorithm of the WGSL lanes kernel
//! ([`Kernel::Lanes`](crate::gpu::Kernel)) and its split-K: partials merged
//! by log-sum-exp in a second launch (`merge`).

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::{guarded, Cuda, CudaError, CudaKvCache, DriverResultExt, Shape};
use crate::gpu::{AttnOptions, Split};

/// Threads per block of `decode` in kernels.cu.
const NT: u32 = 64;
/// Static shared memory a block may use without opting in.
const MAX_SHARED: u32 = 48 * 1024;

/// Shared memory `decode` declares for a shape (keep in sync with kernels.cu).
fn shared_bytes(shape: &Shape) -> u32 {
    let slots = NT / shape.lanes_per_token();
    16 * slots * (shape.head_dim / 4) + 8 * slots
}

/// A batch's tables, query and output on the device.
pub(crate) struct DecodeBuffers {
    pub q: CudaSlice<f32>,
    pub kv_indptr: CudaSlice<u32>,
    pub kv_indices: CudaSlice<u32>,
    pub seq_lens: CudaSlice<u32>,
    pub slopes: CudaSlice<f32>,
    pub out: CudaSlice<f32>,
    /// Split-K partials (at least one element when unsplit).
    pub part_out: CudaSlice<f32>,
    /// (max, sum) per partial, two floats each.
    pub part_ml: CudaSlice<f32>,
    pub num_seqs: u32,
    pub indices_len: u32,
    /// Tokens per partition (0: one pass per sequence).
    pub partition_tokens: u32,
    pub num_partitions: u32,
}

/// Blocks of `decode` (64 threads) one SM is assumed to hold at once under
/// `Split::Auto`, as the WGSL side assumes for `lanes`.
const RESIDENT_PER_SM: u64 = 8;

/// Shortest partition `Split::Auto` makes (as the WGSL side's
/// `DEVICE_MIN_PARTITION`).
const MIN_PARTITION: u32 = 512;

/// Tokens per partition of `split` for `passes` (sequence x kv head x head
/// tile) units over `max_len` tokens on `sms` SMs: `Auto` fills the device
/// once, as `Split::Auto` does on a WGSL device whose SMs are known.
pub(crate) fn partition_tokens(split: Split, passes: u64, max_len: u32, sms: u32) -> u32 {
    match split {
        Split::Never => 0,
        Split::Tokens(t) => t,
        Split::Auto => {
            let parts = ((sms as u64 * RESIDENT_PER_SM + passes.max(1) / 2) / passes.max(1))
                .min((max_len / MIN_PARTITION) as u64);
            if parts >= 2 {
                max_len.div_ceil(parts as u32).div_ceil(64) * 64
            } else {
                0
            }
        }
    }
}

/// The decode kernel for one cache shape and head count.
pub struct CudaAttention {
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    num_blocks: u32,
    head_tiles: u32,
    decode: CudaFunction,
    merge: CudaFunction,
}

impl CudaAttention {
    /// Compiles decode for `num_heads` query heads over `cache`.
    pub fn new(cuda: &Cuda, cache: &CudaKvCache, num_heads: u32) -> Result<Self, CudaError> {
        let c = *cache.config();
        if num_heads == 0 || !num_heads.is_multiple_of(c.num_kv_heads) {
            return Err(CudaError::InvalidArgument(format!(
                "num_heads {num_heads} is not a positive multiple of num_kv_heads {}",
                c.num_kv_heads
            )));
        }
        let group = num_heads / c.num_kv_heads;
        let shape = Shape {
            head_dim: c.head_dim,
            group,
            block_size: c.block_size,
            dtype: c.dtype,
        };
        let need = shared_bytes(&shape);
        if need > MAX_SHARED {
            return Err(CudaError::Unsupported(format!(
                "head_dim {} needs {need} bytes of shared memory (at most {MAX_SHARED})",
                c.head_dim
            )));
        }
        if c.num_kv_heads as u64 * shape.head_tiles() as u64 > 65535 {
            return Err(CudaError::Unsupported(format!(
                "{} kv heads x {} head tiles in one grid dimension (at most 65535)",
                c.num_kv_heads,
                shape.head_tiles()
            )));
        }
        let module = cuda.module(shape)?;
        let (decode, merge) = guarded("loading decode", || {
            Ok((
                module.load_function("decode").during("decode")?,
                module.load_function("merge").during("merge")?,
            ))
        })?;
        Ok(Self {
            num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: c.block_size,
            num_blocks: c.num_blocks,
            head_tiles: shape.head_tiles(),
            decode,
            merge,
        })
    }

    /// Query heads.
    pub fn num_heads(&self) -> u32 {
        self.num_heads
    }

    /// The same checks as `PagedAttention::check_tables`.
    pub fn check_tables(
        &self,
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
    ) -> Result<(), CudaError> {
        crate::gpu::check_csr_tables(
            self.num_blocks,
            self.block_size,
            kv_indptr,
            kv_indices,
            seq_lens,
        )
        .map_err(|e| CudaError::InvalidArgument(e.to_string()))
    }

    fn check_options(&self, o: &AttnOptions) -> Result<(), CudaError> {
        o.validate(self.num_heads)
            .map_err(|e| CudaError::InvalidArgument(e.to_string()))?;
        if o.sinks.is_some() {
            return Err(CudaError::Unsupported(
                "the CUDA twin has no attention sinks".into(),
            ));
        }
        if o.sink_tokens.is_some() {
            return Err(CudaError::Unsupported(
                "the CUDA twin has no sink tokens".into(),
            ));
        }
        Ok(())
    }

    /// Decode from host slices: validates everything, runs, returns
    /// `[num_seqs][num_heads][head_dim]`, split as `opts.split` says.
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        cuda: &Cuda,
        cache: &CudaKvCache,
        layer: u32,
        q: &[f32],
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        opts: &AttnOptions,
    ) -> Result<Vec<f32>, CudaError> {
        cache.layer(layer)?;
        self.check_options(opts)?;
        self.check_tables(kv_indptr, kv_indices, seq_lens)?;
        let n = seq_lens.len();
        let row = (self.num_heads * self.head_dim) as usize;
        if q.len() != n * row {
            return Err(CudaError::InvalidArgument(format!(
                "q has {} floats; {n} sequences x {} heads x {} need {}",
                q.len(),
                self.num_heads,
                self.head_dim,
                n * row
            )));
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut b = self.upload(cuda, q, kv_indptr, kv_indices, seq_lens, opts)?;
        self.launch(cuda, cache, layer, &mut b, opts)?;
        guarded("reading the output", || {
            cuda.stream().clone_dtoh(&b.out).during("download out")
        })
    }

    /// Uploads a batch; the output is poisoned with NaN so a kernel that
    /// skips a write cannot pass.
    pub(crate) fn upload(
        &self,
        cuda: &Cuda,
        q: &[f32],
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        opts: &AttnOptions,
    ) -> Result<DecodeBuffers, CudaError> {
        // Zero-length allocations are refused: pad empty inputs to one element.
        let at_least_one = |v: &[u32]| if v.is_empty() { vec![0] } else { v.to_vec() };
        let slopes = opts.alibi_slopes.clone().unwrap_or_else(|| vec![0.0]);
        let n = seq_lens.len() as u64;
        let max_len = seq_lens.iter().copied().max().unwrap_or(0);
        let passes = n * self.num_kv_heads as u64 * self.head_tiles as u64;
        let pt = partition_tokens(opts.split, passes, max_len, cuda.sm_count());
        let np = if pt == 0 {
            1
        } else {
            max_len.div_ceil(pt).max(1)
        };
        if pt != 0 && np > 65535 {
            return Err(CudaError::InvalidArgument(format!(
                "{np} partitions of {pt} tokens in one grid dimension (at most 65535)"
            )));
        }
        let partials = if pt == 0 {
            1
        } else {
            (n * self.num_heads as u64 * np as u64) as usize
        };
        guarded("uploading the batch", || {
            let s = cuda.stream();
            Ok(DecodeBuffers {
                q: s.clone_htod(q).during("upload q")?,
                kv_indptr: s.clone_htod(kv_indptr).during("upload kv_indptr")?,
                kv_indices: s
                    .clone_htod(&at_least_one(kv_indices))
                    .during("upload kv_indices")?,
                seq_lens: s.clone_htod(seq_lens).during("upload seq_lens")?,
                slopes: s.clone_htod(&slopes).during("upload slopes")?,
                out: s
                    .clone_htod(&vec![f32::NAN; q.len()])
                    .during("allocate out")?,
                part_out: s
                    .alloc_zeros::<f32>(partials * self.head_dim as usize)
                    .during("allocate partials")?,
                part_ml: s
                    .alloc_zeros::<f32>(partials * 2)
                    .during("allocate partial (max, sum)")?,
                num_seqs: seq_lens.len() as u32,
                indices_len: kv_indices.len() as u32,
                partition_tokens: pt,
                num_partitions: np,
            })
        })
    }

    /// Queues one decode over uploaded buffers (no checks, no sync).
    pub(crate) fn launch(
        &self,
        cuda: &Cuda,
        cache: &CudaKvCache,
        layer: u32,
        b: &mut DecodeBuffers,
        opts: &AttnOptions,
    ) -> Result<(), CudaError> {
        let [k, v] = cache.layer(layer)?;
        if b.num_seqs > i32::MAX as u32 {
            return Err(CudaError::InvalidArgument(format!(
                "{} sequences in one decode",
                b.num_seqs
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (
                b.num_seqs,
                self.num_kv_heads * self.head_tiles,
                b.num_partitions,
            ),
            block_dim: (NT, 1, 1),
            shared_mem_bytes: 0,
        };
        let scale = opts.scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt());
        let soft_cap = opts.soft_cap.unwrap_or(0.0);
        let window = opts.sliding_window.unwrap_or(0);
        let alibi = opts.alibi_slopes.is_some() as u32;
        guarded("decode", || {
            let s = cuda.stream();
            let mut launch = s.launch_builder(&self.decode);
            launch
                .arg(&b.q)
                .arg(k)
                .arg(v)
                .arg(&b.kv_indptr)
                .arg(&b.kv_indices)
                .arg(&b.seq_lens)
                .arg(&b.slopes)
                .arg(&mut b.out)
                .arg(&mut b.part_out)
                .arg(&mut b.part_ml)
                .arg(&self.num_heads)
                .arg(&self.num_kv_heads)
                .arg(&self.num_blocks)
                .arg(&b.indices_len)
                .arg(&scale)
                .arg(&soft_cap)
                .arg(&window)
                .arg(&alibi)
                .arg(&b.partition_tokens)
                .arg(&b.num_partitions);
            // SAFETY: the argument list matches decode in kernels.cu; the
            // kernel reads only table entries inside the CSR range and
            // blocks inside the pool, and writes partials only when split,
            // into buffers sized for num_partitions.
            unsafe { launch.launch(cfg) }.during("launch decode")?;
            if b.partition_tokens != 0 {
                let rows = b.num_seqs * self.num_heads;
                let mcfg = LaunchConfig {
                    grid_dim: (rows, 1, 1),
                    block_dim: (NT, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut m = s.launch_builder(&self.merge);
                m.arg(&b.part_out)
                    .arg(&b.part_ml)
                    .arg(&mut b.out)
                    .arg(&rows)
                    .arg(&b.num_partitions);
                // SAFETY: the argument list matches merge in kernels.cu;
                // it reads rows x num_partitions partials and writes rows
                // output rows, the sizes upload allocated.
                unsafe { m.launch(mcfg) }.during("launch merge")?;
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(head_dim: u32, group: u32) -> Shape {
        Shape {
            head_dim,
            group,
            block_size: 16,
            dtype: crate::gpu::KvDtype::F16,
        }
    }

    /// Auto fills 132 SMs once (8 blocks each): 32 sequences x 8 kv heads
    /// split 8192 tokens in 4; a full device is not split.
    #[test]
    fn auto_split_fills_the_device_once() {
        assert_eq!(partition_tokens(Split::Auto, 256, 8192, 132), 2048);
        assert_eq!(partition_tokens(Split::Auto, 2048, 8192, 132), 0);
        assert_eq!(partition_tokens(Split::Auto, 8, 1000, 132), 0);
        assert_eq!(partition_tokens(Split::Never, 1, 8192, 132), 0);
        assert_eq!(partition_tokens(Split::Tokens(256), 1, 8192, 132), 256);
    }

    #[test]
    fn shared_memory_of_common_shapes_fits() {
        // Every head_dim the WGSL side takes with lanes of 2 or more, any group.
        for (hd, g) in [
            (64, 8),
            (128, 8),
            (256, 8),
            (80, 4),
            (256, 16),
            (128, 71),
            (96, 7),
        ] {
            assert!(shared_bytes(&shape(hd, g)) <= MAX_SHARED, "{hd} {g}");
            assert!(shape(hd, g).head_tile() <= 8);
        }
        // head_dim 4 x odd: one lane per token, 64 slots of the whole row.
        assert!(shared_bytes(&shape(252, 1)) > MAX_SHARED);
    }
}
