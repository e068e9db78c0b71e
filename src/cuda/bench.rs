//! Decode timing on CUDA, for `pagedattn bench`: the same kernel over a
//! shuffled (paged) block table and over an identity (contiguous) one, and
//! the device's own copy bandwidth on the same run, timed with CUDA events.

use cudarc::driver::sys::CUevent_flags;

use super::{guarded, Cuda, CudaAttention, CudaError, CudaKvCache, DriverResultExt};
use crate::gpu::{AttnOptions, KvCacheConfig, KvDtype};
use crate::rng::SplitMix64;

/// What to time.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DecodeBench {
    /// Sequences in the batch.
    pub num_seqs: u32,
    /// Tokens of every sequence.
    pub seq_len: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Query heads per KV head.
    pub group: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Pool element type ("f32" or "f16" in JSON).
    #[serde(serialize_with = "dtype_name")]
    pub dtype: KvDtype,
    /// Untimed launches first.
    pub warmup: u32,
    /// Timed launches.
    pub iters: u32,
    /// Seed of the data and the block shuffle.
    pub seed: u64,
}

impl Default for DecodeBench {
    /// 32 sequences of 8192 tokens (the GPU-decode design note's cell:
    /// 1.07 GB of K/V, far past an H200's 60 MB of L2), 8 KV heads x 4
    /// query heads each, head_dim 128, blocks of 16, f16 KV.
    fn default() -> Self {
        Self {
            num_seqs: 32,
            seq_len: 8192,
            num_kv_heads: 8,
            group: 4,
            head_dim: 128,
            block_size: 16,
            dtype: KvDtype::F16,
            warmup: 10,
            iters: 50,
            seed: 7,
        }
    }
}

impl DecodeBench {
    /// A smaller run for smoke checks (`bench --quick`).
    pub fn quick() -> Self {
        Self {
            num_seqs: 16,
            seq_len: 1024,
            warmup: 3,
            iters: 20,
            ..Self::default()
        }
    }

    /// K and V bytes one decode reads.
    pub fn kv_bytes(&self) -> u64 {
        2 * self.num_seqs as u64
            * self.seq_len as u64
            * self.num_kv_heads as u64
            * self.head_dim as u64
            * self.dtype.bytes()
    }
}

fn dtype_name<S: serde::Serializer>(d: &KvDtype, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

/// Timings of one [`bench_decode`] run (milliseconds per decode), for the
/// bench report (text through [`summary`](Self::summary), or JSON).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DecodeTiming {
    /// `Cuda::describe` of the device.
    pub device: String,
    /// What was timed.
    pub bench: DecodeBench,
    /// Median over `iters` launches, shuffled block table, `Split::Auto`
    /// (partitions from the SM count).
    pub paged_ms: f64,
    /// Partitions `Split::Auto` made (1: unsplit).
    pub partitions: u32,
    /// The same unsplit (`Split::Never`).
    pub unsplit_ms: f64,
    /// Fastest launch, shuffled block table.
    pub paged_min_ms: f64,
    /// Median, identity (contiguous) block table.
    pub contiguous_ms: f64,
    /// K and V bytes read per decode.
    pub kv_bytes: u64,
    /// `kv_bytes` / `paged_ms`, GB/s.
    pub paged_gbps: f64,
    /// Device-to-device copy of 1 GiB (or one K pool, if larger), bytes
    /// read + written / time, GB/s.
    pub copy_gbps: f64,
}

impl DecodeTiming {
    /// One line for reports.
    pub fn summary(&self) -> String {
        let b = &self.bench;
        format!(
            "cuda decode {} seqs x {} tokens, {} kv heads x {} group, head_dim {}, block {}, {:?}: paged {:.3} ms (min {:.3}; {} partitions; unsplit {:.3} ms), contiguous {:.3} ms, paged/contiguous {:.3}, {:.0} GB/s of KV vs copy {:.0} GB/s ({:.0}%) on {}",
            b.num_seqs,
            b.seq_len,
            b.num_kv_heads,
            b.group,
            b.head_dim,
            b.block_size,
            b.dtype,
            self.paged_ms,
            self.paged_min_ms,
            self.partitions,
            self.unsplit_ms,
            self.contiguous_ms,
            self.paged_ms / self.contiguous_ms,
            self.paged_gbps,
            self.copy_gbps,
            100.0 * self.paged_gbps / self.copy_gbps,
            self.device
        )
    }
}

/// Seconds of launches before the first timed one.
const WARM_S: f64 = 1.0;

/// Bytes of the copy yardstick: 1 GiB each way, past any L2.
const COPY_BYTES: usize = 1 << 30;

/// Times `f` with events around each launch: sorted milliseconds.
fn time(
    cuda: &Cuda,
    warmup: u32,
    iters: u32,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<Vec<f64>, CudaError> {
    // The warm-up launches, then more until a second has passed, so the
    // clocks are up before anything is timed.
    let t0 = std::time::Instant::now();
    let mut n = 0;
    while n < warmup || t0.elapsed().as_secs_f64() < WARM_S {
        f()?;
        n += 1;
        if n % 16 == 0 {
            cuda.synchronize()?;
        }
    }
    cuda.synchronize()?;
    let record = || {
        guarded("record event", || {
            cuda.stream()
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .during("cuEventRecord")
        })
    };
    let mut events = Vec::with_capacity(iters as usize);
    for _ in 0..iters.max(1) {
        let start = record()?;
        f()?;
        events.push((start, record()?));
    }
    cuda.synchronize()?;
    let mut ms = guarded("event timing", || {
        events
            .iter()
            .map(|(s, e)| {
                s.elapsed_ms(e)
                    .map(|t| t as f64)
                    .during("cuEventElapsedTime")
            })
            .collect::<Result<Vec<f64>, CudaError>>()
    })?;
    ms.sort_by(f64::total_cmp);
    Ok(ms)
}

/// Builds a pool full of random K/V, then times decode over a shuffled and
/// over an identity block table, and a device copy of one K pool.
pub fn bench_decode(cuda: &Cuda, b: &DecodeBench) -> Result<DecodeTiming, CudaError> {
    if b.num_seqs == 0 || b.seq_len == 0 {
        return Err(CudaError::InvalidArgument(
            "bench needs at least one sequence of one token".into(),
        ));
    }
    let per_seq = b.seq_len.div_ceil(b.block_size);
    let num_blocks = b.num_seqs.checked_mul(per_seq).ok_or_else(|| {
        CudaError::InvalidArgument(format!("{} x {per_seq} blocks overflow", b.num_seqs))
    })?;
    let cfg = KvCacheConfig::new(num_blocks, b.block_size, b.num_kv_heads, b.head_dim)
        .with_dtype(b.dtype);
    let mut cache = CudaKvCache::new(cuda, cfg)?;
    let mut rng = SplitMix64::new(b.seed);

    // Fill every slot, a few million elements at a time to bound host memory.
    let row = (b.num_kv_heads * b.head_dim) as usize;
    let slots = num_blocks as u64 * b.block_size as u64;
    let chunk = ((1 << 22) / row).max(1) as u64;
    let mut start = 0u64;
    while start < slots {
        let end = (start + chunk).min(slots);
        let ids: Vec<u32> = (start as u32..end as u32).collect();
        let k = rng.signed_vec(ids.len() * row);
        let v = rng.signed_vec(ids.len() * row);
        cache.write_kv(cuda, 0, &k, &v, &ids)?;
        start = end;
    }

    let kv_indptr: Vec<u32> = (0..=b.num_seqs).map(|s| s * per_seq).collect();
    let contiguous: Vec<u32> = (0..num_blocks).collect();
    let mut shuffled = contiguous.clone();
    rng.shuffle(&mut shuffled);
    let seq_lens = vec![b.seq_len; b.num_seqs as usize];
    let num_heads = b.num_kv_heads * b.group;
    let q = rng.signed_vec((b.num_seqs * num_heads * b.head_dim) as usize);
    let attn = CudaAttention::new(cuda, &cache, num_heads)?;
    let opts = AttnOptions::default();
    attn.check_tables(&kv_indptr, &shuffled, &seq_lens)?;

    let mut paged = attn.upload(cuda, &q, &kv_indptr, &shuffled, &seq_lens, &opts)?;
    let mut ident = attn.upload(cuda, &q, &kv_indptr, &contiguous, &seq_lens, &opts)?;
    let never = AttnOptions {
        split: crate::gpu::Split::Never,
        ..AttnOptions::default()
    };
    let mut unsplit = attn.upload(cuda, &q, &kv_indptr, &shuffled, &seq_lens, &never)?;
    let paged_ms = time(cuda, b.warmup, b.iters, || {
        attn.launch(cuda, &cache, 0, &mut paged, &opts)
    })?;
    let unsplit_ms = time(cuda, b.warmup, b.iters, || {
        attn.launch(cuda, &cache, 0, &mut unsplit, &never)
    })?;
    let contiguous_ms = time(cuda, b.warmup, b.iters, || {
        attn.launch(cuda, &cache, 0, &mut ident, &opts)
    })?;

    // The copy yardstick: 1 GiB (or the pool, if larger) one way, bytes
    // read and written counted.
    let [k_pool, _] = cache.layer(0)?;
    let copy_len = k_pool.len().max(COPY_BYTES);
    let (src, mut dst) = guarded("allocate copy buffers", || {
        let s = cuda.stream();
        Ok((
            s.alloc_zeros::<u8>(copy_len).during("cuMemAlloc")?,
            s.alloc_zeros::<u8>(copy_len).during("cuMemAlloc")?,
        ))
    })?;
    let copy_ms = time(cuda, b.warmup, b.iters, || {
        guarded("copy", || {
            cuda.stream()
                .memcpy_dtod(&src, &mut dst)
                .during("cuMemcpyDtoD")
        })
    })?;

    let median = |v: &[f64]| v[v.len() / 2];
    let kv_bytes = b.kv_bytes();
    let gbps = |bytes: u64, ms: f64| bytes as f64 / (ms * 1e6);
    Ok(DecodeTiming {
        device: cuda.describe(),
        bench: b.clone(),
        paged_ms: median(&paged_ms),
        partitions: paged.num_partitions,
        unsplit_ms: median(&unsplit_ms),
        paged_min_ms: paged_ms[0],
        contiguous_ms: median(&contiguous_ms),
        kv_bytes,
        paged_gbps: gbps(kv_bytes, median(&paged_ms)),
        copy_gbps: gbps(2 * copy_len as u64, median(&copy_ms)),
    })
}
