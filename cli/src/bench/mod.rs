//! `pagedattn bench`: decode time over a grid of shapes, paged vs an identity
//! table vs a contiguous kernel of the same design, effective bandwidth
//! against a streaming-read kernel and `copy_buffer_to_buffer` measured in the
//! same run, split vs non-split, host bookkeeping, write_kv and copy_blocks
//! throughput. Everything in one process on one adapter, so the ratios hold.

pub mod clock;
#[cfg(all(
    not(target_arch = "wasm32"),
    any(target_os = "linux", target_os = "windows")
))]
pub mod stats;
pub mod sweep;
pub mod timer;

pub use timer::{Timer, TimingSource};

use pagedattn::blocks::{
    BatchView, BlockManager, BlockManagerConfig, Child, GroupOutput, Scheduler, SchedulerConfig,
    SeqId,
};
use pagedattn::gpu::{
    AttentionPlan, AttnOptions, DecodeTables, Gpu, GpuError, KvCache, KvCacheConfig, KvDtype,
    PagedAttention, Split,
};
use pagedattn::rng::SplitMix64;

/// Why the bench stopped: a GPU call, the block manager, or a setting.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A GPU call failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// The block manager refused a call.
    #[error(transparent)]
    Blocks(#[from] pagedattn::blocks::BlockError),
    /// A setting the bench cannot run.
    #[error("{0}")]
    Config(String),
}

/// Host block tables of one batch: (kv_indptr, kv_indices, seq_lens).
pub type HostTables = (Vec<u32>, Vec<u32>, Vec<u32>);

/// The decode tables of `t`.
pub fn decode_tables(t: &HostTables) -> DecodeTables<'_> {
    DecodeTables {
        kv_indptr: &t.0,
        kv_indices: &t.1,
        seq_lens: &t.2,
    }
}

/// A decode plan of `t` under `split`, made once and run many times.
pub fn decode_plan(
    gpu: &Gpu,
    attn: &PagedAttention,
    t: &HostTables,
    split: Split,
) -> Result<AttentionPlan, GpuError> {
    let mut plan = attn.plan();
    let opts = AttnOptions {
        split,
        ..Default::default()
    };
    attn.plan_decode(gpu, &mut plan, &decode_tables(t), &[opts])?;
    Ok(plan)
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// The small grid (about a minute on lavapipe).
    pub quick: bool,
    /// Force wall-clock timing even where timestamps exist.
    pub wall_clock: bool,
    /// Print progress on stderr.
    pub progress: bool,
    /// Time budget in seconds: once spent, the remaining grid cells are
    /// listed as skipped instead of measured (software adapters are slow).
    pub max_seconds: f64,
    /// Sections to run (of [`SECTIONS`]); empty: all. The others are listed
    /// as skipped and their figures left at 0.
    pub only: Vec<String>,
}

/// The bench's sections, as `--only` names them.
pub const SECTIONS: &[&str] = &[
    "decode", "dtypes", "cascade", "split", "host", "copy", "swap", "transfer", "mla", "model",
];

impl BenchConfig {
    /// Checks the settings: `max_seconds` finite and not negative.
    pub fn validate(&self) -> Result<(), BenchError> {
        if !(self.max_seconds.is_finite() && self.max_seconds >= 0.0) {
            return Err(BenchError::Config(format!(
                "max_seconds {} is not a finite number of seconds, at least 0",
                self.max_seconds
            )));
        }
        if let Some(bad) = self.only.iter().find(|o| !SECTIONS.contains(&o.as_str())) {
            return Err(BenchError::Config(format!(
                "no bench section {bad:?} (sections: {})",
                SECTIONS.join(", ")
            )));
        }
        Ok(())
    }

    /// Whether `section` runs.
    pub fn runs(&self, section: &str) -> bool {
        // The real model needs its file: only when named.
        (self.only.is_empty() && section != "model") || self.only.iter().any(|o| o == section)
    }

    /// Whether any of the library's own sections (all but "model") runs.
    pub fn runs_library(&self) -> bool {
        SECTIONS.iter().any(|s| *s != "model" && self.runs(s))
    }
}

/// Shape of the decode grid's attention: 32 query heads over 8 KV heads, head_dim 128.
pub const HEADS: u32 = 32;
/// KV heads.
pub const KV_HEADS: u32 = 8;
/// Elements per head.
pub const HEAD_DIM: u32 = 128;
/// Tokens per block.
pub const BLOCK: u32 = 16;

/// A pool of the grid's shape: `num_blocks` blocks of `layers` layers.
pub fn grid_config(num_layers: u32, num_blocks: u32, dtype: KvDtype) -> KvCacheConfig {
    KvCacheConfig::new(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        .with_layers(num_layers)
        .with_dtype(dtype)
}

/// One decode cell of the grid.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DecodeRow {
    /// Sequences.
    pub batch: u32,
    /// Tokens per sequence.
    pub context: u32,
    /// "f32" or "f16".
    pub dtype: &'static str,
    /// Paged kernel, shuffled physical blocks (ms per call).
    pub paged_ms: f64,
    /// Paged kernel, identity table (ms).
    pub identity_ms: f64,
    /// Contiguous kernel of the same design (ms).
    pub contiguous_ms: f64,
    /// paged / contiguous.
    pub paged_over_contiguous: f64,
    /// K and V bytes read / paged time (GB/s).
    pub effective_gbs: f64,
    /// Streaming-read kernel over the same bytes (GB/s).
    pub stream_gbs: f64,
    /// effective / stream.
    pub bandwidth_ratio: f64,
    /// effective / the adapter's rated bandwidth, where known.
    pub of_rated: Option<f64>,
    /// Median SM clock (MHz) over the cell, where nvidia-smi reads it.
    pub sm_mhz: Option<u32>,
    /// The decode kernel the tuner picked (paged and contiguous run it).
    pub kernel: &'static str,
    /// Every eligible kernel on the same cell, timed interleaved with the
    /// rest of the row.
    pub variants: Vec<VariantCell>,
}

/// One decode kernel variant on one cell.
#[derive(Clone, Debug, serde::Serialize)]
pub struct VariantCell {
    /// Kernel name (`PAGEDATTN_KERNEL` value).
    pub kernel: &'static str,
    /// Paged, shuffled blocks, Split::Auto (ms per call).
    pub ms: f64,
    /// K and V bytes read / time (GB/s).
    pub effective_gbs: f64,
    /// effective / stream.
    pub bandwidth_ratio: f64,
}

/// Decode over one KV dtype (`dtypes[]`): every dtype on the same cell,
/// timed interleaved.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DtypeRow {
    /// "f32", "f16", "int8" or "fp8"; "int8+outliers" and "fp8+outliers"
    /// with K_OUTLIERS outlier channels set per KV head (the residuals read
    /// and added per token).
    pub dtype: &'static str,
    /// Sequences.
    pub batch: u32,
    /// Tokens per sequence.
    pub context: u32,
    /// The decode kernel (the tuner's pick where tuned, else the default).
    pub kernel: &'static str,
    /// ms per decode (Split::Auto, shuffled blocks).
    pub ms: f64,
    /// Bytes of K and V (scales included) one decode reads.
    pub kv_bytes: u64,
    /// Bytes of one block of this dtype / of an f16 block.
    pub block_bytes_over_f16: f64,
    /// Time over f16's time on the same cell.
    pub time_over_f16: f64,
}

/// `n` sequences sharing a prompt of `prompt` tokens, each with 0-256
/// private tokens: plain paged decode vs the cascade (forced on), timed
/// interleaved, and what `Cascade::Auto` would pick here.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CascadeRow {
    /// Sequences.
    pub n: u32,
    /// Shared prompt tokens.
    pub prompt: u32,
    /// Private tokens per sequence (mean).
    pub private_mean: f64,
    /// Plain decode (Cascade::Off), ms.
    pub plain_ms: f64,
    /// Cascade::On, ms.
    pub cascade_ms: f64,
    /// plain / cascade.
    pub speedup: f64,
    /// K/V bytes each reads per layer.
    pub plain_bytes: u64,
    pub cascade_bytes: u64,
    /// Whether the cascade ran (forced on; a batch sharing nothing runs
    /// plain decode).
    pub used: bool,
    /// Whether `Cascade::Auto` picks it on this adapter.
    pub auto_uses: bool,
    /// The decode kernel of the suffixes (and of plain decode).
    pub kernel: &'static str,
}

/// What the tuner measured for the grid's shape, per KV dtype.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TunerRow {
    /// "f32" or "f16".
    pub dtype: &'static str,
    /// The kernel it picked.
    pub chosen: &'static str,
    /// Median microseconds per kernel on its synthetic batch.
    pub micros: Vec<(&'static str, f64)>,
    /// (sequences, tokens each) of that batch.
    pub batch: (u32, u32),
}

/// Split vs non-split decode, on the kernel the tuner picked.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SplitRow {
    /// Sequences.
    pub batch: u32,
    /// Tokens per sequence.
    pub context: u32,
    /// The decode kernel.
    pub kernel: &'static str,
    /// One pass per (sequence, kv head), ms; `None` where the adapter's
    /// loop cap refuses a pass this long for this kernel.
    pub whole_ms: Option<f64>,
    /// Split::Auto (partitions + reduce), ms.
    pub split_ms: f64,
    /// whole / split.
    pub speedup: Option<f64>,
    /// What Split::Auto picks for this shape (0: no split).
    pub auto_partition: u32,
}

/// The whole report (`--json` prints it).
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchReport {
    /// Adapter name and backend.
    pub adapter: String,
    /// Timing source.
    pub timing: TimingSource,
    /// Heads / KV heads / head_dim / block size of the grid.
    pub shape: [u32; 4],
    /// `copy_buffer_to_buffer` bandwidth over 1 GiB (256 MiB on software
    /// adapters), GB/s of bytes read plus bytes written.
    pub memcpy_gbs: f64,
    /// The adapter's rated memory bandwidth (GB/s), where known.
    pub rated_gbs: Option<f64>,
    /// Decode grid.
    pub decode: Vec<DecodeRow>,
    /// Cells skipped, with the reason.
    pub skipped: Vec<String>,
    /// Split vs non-split.
    pub split: Vec<SplitRow>,
    /// The autotuner's measurements and picks.
    pub tuner: Vec<TunerRow>,
    /// Decode per KV dtype on one cell, interleaved in one run.
    pub dtypes: Vec<DtypeRow>,
    /// Plain vs cascade decode of sequences sharing a prompt.
    pub cascade: Vec<CascadeRow>,
    /// Host bookkeeping per decode step at batch 256, microseconds per sequence.
    pub host_us_per_seq: f64,
    /// The same with prefix caching on (a SHA-256 digest per filled block).
    pub host_us_per_seq_prefix_cache: f64,
    /// Plan and record one decode step of 32 layers at batch 64 (host side).
    pub host_step: HostStep,
    /// write_kv: tokens per second (one layer, 32 x 8 x 128 f32).
    pub write_kv_tokens_per_s: f64,
    /// write_kv: GB/s of K and V written.
    pub write_kv_gbs: f64,
    /// copy_blocks: block copies per second (one layer).
    pub copy_blocks_per_s: f64,
    /// copy_blocks: GB/s (bytes copied, K and V).
    pub copy_blocks_gbs: f64,
    /// Swap-out (pool to host memory, `KvCache::swap_out`, wall clock with
    /// the readback and host copies): GB/s of K and V moved.
    pub swap_out_gbs: f64,
    /// Swap-in (host memory to pool): GB/s.
    pub swap_in_gbs: f64,
    /// Export of blocks to caller-owned bytes (`KvCache::export_blocks`,
    /// wall clock with the readback and the reordering): GB/s.
    pub export_gbs: f64,
    /// Import of exported blocks into other ids (`import_blocks`, with its
    /// descriptor check): GB/s.
    pub import_gbs: f64,
    /// Time to first token of the attention path (K/V written and prefill
    /// attention, every layer) of a prompt computed in full, ms.
    pub ttft_cold_ms: f64,
    /// The same prompt with its shared prefix's blocks imported instead
    /// (a remote prefix hit: import, then only the suffix), ms.
    pub ttft_remote_hit_ms: f64,
    /// Prompt tokens and shared-prefix tokens of those two.
    pub ttft_tokens: (usize, usize),
    /// The library `Scheduler` (schedule + commit) per decode step at batch
    /// 256, microseconds per sequence.
    pub scheduler_us_per_seq: f64,
    /// MLA decode against GQA decode reading the same bytes (`None` when
    /// the section did not run).
    pub mla: Option<MlaRow>,
}

/// MLA decode (DeepSeek-V2-Lite: 16 heads over a bf16 latent row of
/// 512 + 64) against the grid's GQA decode (bf16 K/V) over the same bytes
/// of cache: the GQA context is shorter by the ratio of bytes per token.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MlaRow {
    /// Sequences.
    pub batch: u32,
    /// Tokens per sequence, MLA.
    pub mla_context: u32,
    /// Tokens per sequence, GQA.
    pub gqa_context: u32,
    /// Cache bytes each reads per step (one layer).
    pub bytes: u64,
    /// Median ms, MLA.
    pub mla_ms: f64,
    /// Median ms, GQA.
    pub gqa_ms: f64,
    /// Split-K partitions of the MLA plan.
    pub mla_partitions: u32,
}

/// The MLA row: both decodes measured interleaved.
fn mla_row(
    gpu: &Gpu,
    picks: &pagedattn::gpu::Tuner,
    timer: &Timer,
    rng: &mut SplitMix64,
    quick: bool,
) -> Result<MlaRow, BenchError> {
    use pagedattn::gpu::{MlaAttention, MlaCache, MlaCacheConfig};
    let (batch, gqa_context) = if quick { (4, 512) } else { (16, 2048) };
    let gqa_token = (KV_HEADS * HEAD_DIM * 2 * 2) as u64;
    let mcfg = MlaCacheConfig::deepseek(1, 1);
    let mla_token = mcfg.block_bytes() / mcfg.block_size as u64;
    let mla_context = (gqa_context as u64 * gqa_token / mla_token) as u32;
    let mcfg = MlaCacheConfig {
        num_blocks: batch * mla_context.div_ceil(mcfg.block_size),
        ..mcfg
    };
    let mla_cache = MlaCache::new(gpu, mcfg)?;
    let per_seq = mla_context.div_ceil(mcfg.block_size);
    let mut ids: Vec<u32> = (0..mcfg.num_blocks).collect();
    rng.shuffle(&mut ids);
    let mut mla_tables: Vec<Vec<u32>> = ids.chunks(per_seq as usize).map(|c| c.to_vec()).collect();
    mla_tables.truncate(batch as usize);
    for t in &mla_tables {
        let slots: Vec<u32> = (0..mla_context)
            .map(|p| t[(p / mcfg.block_size) as usize] * mcfg.block_size + p % mcfg.block_size)
            .collect();
        mla_cache.write(
            gpu,
            0,
            &slots,
            &rng.signed_vec(slots.len() * mcfg.row_elems() as usize),
        )?;
    }
    let heads = 16;
    let mla = MlaAttention::new(gpu, &mla_cache, heads, 1.0 / 192f32.sqrt())?;
    let refs: Vec<&[u32]> = mla_tables.iter().map(|t| t.as_slice()).collect();
    let mut plan = mla.plan();
    mla.plan_decode_slices(
        gpu,
        &mut plan,
        &refs,
        &vec![mla_context; batch as usize],
        Split::Auto,
    )?;
    let mq = gpu.storage_init(
        "mla q",
        &rng.signed_vec((batch as u64 * mla.q_row_elems()) as usize),
    )?;
    let mout = gpu.storage("mla out", batch as u64 * mla.out_row_elems() * 4)?;

    let Some(cache) = filled_cache(gpu, batch * gqa_context, KvDtype::Bf16, 1, rng)? else {
        return Err(BenchError::Config(
            "the GQA pool does not fit this adapter".into(),
        ));
    };
    let attn = attention(gpu, picks, &cache)?;
    let t = tables(batch, gqa_context, true, rng);
    let mut gplan = decode_plan(gpu, &attn, &t, Split::Auto)?;
    let gq = gpu.storage_init(
        "gqa q",
        &rng.signed_vec((batch * HEADS * HEAD_DIM) as usize),
    )?;
    let gout = gpu.storage("gqa out", (batch * HEADS * HEAD_DIM * 4) as u64)?;
    let ms = interleaved_medians(timer, 2, &mut |i, _run, enc| {
        if i == 0 {
            mla.run(
                gpu,
                enc,
                &mut plan,
                &mla_cache,
                0,
                0,
                &mq.as_entire_buffer_binding(),
                &mout.as_entire_buffer_binding(),
            )
        } else {
            attn.run(
                gpu,
                enc,
                &mut gplan,
                &cache,
                0,
                0,
                &gq.as_entire_buffer_binding(),
                &gout.as_entire_buffer_binding(),
            )
        }
    })?;
    Ok(MlaRow {
        batch,
        mla_context,
        gqa_context,
        bytes: batch as u64 * mla_context as u64 * mla_token,
        mla_ms: ms[0],
        gqa_ms: ms[1],
        mla_partitions: plan.partitions(0),
    })
}

fn progress(cfg: &BenchConfig, msg: &str) {
    if cfg.progress {
        // Not eprint!: that panics when stderr is a closed pipe.
        use std::io::Write as _;
        let _ = write!(std::io::stderr(), "\r\x1b[2K[bench] {msg}");
    }
}

/// A cache of `layers` layers holding `tokens` tokens of the grid's shape,
/// filled with a repeating random pattern; `None` if a layer would not fit.
pub fn filled_cache(
    gpu: &Gpu,
    tokens: u32,
    dtype: KvDtype,
    layers: u32,
    rng: &mut SplitMix64,
) -> Result<Option<KvCache>, GpuError> {
    let cfg = grid_config(layers, tokens.div_ceil(BLOCK), dtype);
    if cfg.layer_bytes() > gpu.max_binding_bytes() {
        return Ok(None);
    }
    let cache = KvCache::new(gpu, cfg)?;
    let pattern: Vec<u8> = match dtype {
        KvDtype::F32 => bytemuck::cast_slice(&rng.signed_vec(1 << 16)).to_vec(),
        KvDtype::F16 => {
            let h: Vec<half::f16> = rng
                .signed_vec(1 << 17)
                .iter()
                .map(|&x| half::f16::from_f32(x))
                .collect();
            bytemuck::cast_slice(&h).to_vec()
        }
        KvDtype::Bf16 => {
            let h: Vec<half::bf16> = rng
                .signed_vec(1 << 17)
                .iter()
                .map(|&x| half::bf16::from_f32(x))
                .collect();
            bytemuck::cast_slice(&h).to_vec()
        }
        // Random bytes (E4M3's NaN pattern avoided); scales written below.
        KvDtype::Int8 | KvDtype::Fp8E4M3 => (0..1 << 18)
            .map(|_| (rng.next_u64() as u8) & 0x77)
            .collect(),
    };
    for l in 0..layers {
        for (kv, buf) in cache.layer(l)?.iter().enumerate() {
            let size = buf.size();
            let mut off = 0;
            while off < size {
                let n = (pattern.len() as u64).min(size - off);
                gpu.queue.write_buffer(buf, off, &pattern[..n as usize]);
                off += n;
            }
            if dtype.quantized() {
                let at = cfg.data_words() * 4;
                let init = cfg.side_and_tail_init(kv == 0);
                gpu.queue.write_buffer(buf, at, bytemuck::cast_slice(&init));
            }
        }
    }
    gpu.wait()?;
    Ok(Some(cache))
}

/// CSR tables for `batch` sequences of `context` tokens over `batch *
/// blocks_per_seq` blocks: identity order, or a seeded shuffle.
pub fn tables(
    batch: u32,
    context: u32,
    shuffled: bool,
    rng: &mut SplitMix64,
) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let per = context.div_ceil(BLOCK);
    let mut ids: Vec<u32> = (0..batch * per).collect();
    if shuffled {
        rng.shuffle(&mut ids);
    }
    let indptr = (0..=batch).map(|s| s * per).collect();
    (indptr, ids, vec![context; batch as usize])
}

struct DecodeRig<'a> {
    gpu: &'a Gpu,
    cache: KvCache,
    layers: u32,
    q: wgpu::Buffer,
    out: wgpu::Buffer,
}

impl DecodeRig<'_> {
    /// Median ms of each of several decode variants, measured interleaved
    /// (variant 0, 1, 2, 0, 1, 2, ...) so that a slow drift of the machine
    /// lands on all of them alike; layers rotate so no run finds the
    /// previous run's data in a cache.
    fn time_interleaved(
        &self,
        timer: &Timer,
        variants: &[(&PagedAttention, &HostTables, Split)],
    ) -> Result<Vec<f64>, GpuError> {
        // Each variant planned once; a run only records.
        let mut plans = variants
            .iter()
            .map(|(a, t, split)| decode_plan(self.gpu, a, t, *split))
            .collect::<Result<Vec<_>, _>>()?;
        let mut err = None;
        let mut one = |run: usize, i: usize, n: usize| {
            let attn = variants[i].0;
            let plan = &mut plans[i];
            timer.batch(run, n, &mut |run, enc| {
                let layer = run as u32 % self.layers;
                if let Err(e) = attn.run(
                    self.gpu,
                    enc,
                    plan,
                    &self.cache,
                    layer,
                    0,
                    &self.q.as_entire_buffer_binding(),
                    &self.out.as_entire_buffer_binding(),
                ) {
                    err = Some(e);
                }
            })
        };
        // Warm-up of every variant; its time decides how many runs follow.
        let mut slowest: f64 = 0.0;
        for i in 0..variants.len() {
            slowest = slowest.max(one(0, i, 1)?);
        }
        let runs = if slowest > timer::SLOW_RUN_MS {
            3
        } else {
            timer.runs
        };
        let n = timer::per_submit(slowest);
        let mut times = vec![Vec::with_capacity(runs); variants.len()];
        for run in 1..=runs {
            for (i, t) in times.iter_mut().enumerate() {
                t.push(one(run, i, n)?);
            }
        }
        if let Some(e) = err {
            return Err(e);
        }
        Ok(times
            .into_iter()
            .map(|mut t| {
                t.sort_by(|a, b| a.total_cmp(b));
                t[t.len() / 2]
            })
            .collect())
    }
}

fn rig<'a>(
    gpu: &'a Gpu,
    batch: u32,
    context: u32,
    dtype: KvDtype,
    rng: &mut SplitMix64,
) -> Result<Option<DecodeRig<'a>>, GpuError> {
    let tokens = batch * context;
    let Some(cache) = filled_cache(gpu, tokens, dtype, 2, rng)? else {
        return Ok(None);
    };
    let q = gpu.storage_init("q", &rng.signed_vec((batch * HEADS * HEAD_DIM) as usize))?;
    let out = gpu.storage("out", (batch * HEADS * HEAD_DIM * 4) as u64)?;
    Ok(Some(DecodeRig {
        gpu,
        cache,
        layers: 2,
        q,
        out,
    }))
}

/// The streaming-read reference kernel bound to a cache's first two layers
/// (K and V of each): reads exactly the bytes one decode over the whole pool reads.
pub struct StreamRead {
    pipe: wgpu::ComputePipeline,
    groups: Vec<wgpu::BindGroup>,
    workgroups: u32,
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

fn stream_gbs(gpu: &Gpu, timer: &Timer, cache: &KvCache) -> Result<f64, GpuError> {
    let s = StreamRead::new(gpu, cache)?;
    let ms = timer.median(|run, enc| s.record(enc, run))?;
    Ok(s.bytes as f64 / ms / 1e6)
}

/// `copy_buffer_to_buffer` over 1 GiB (past any GPU's L2; 256 MiB on a
/// software adapter, whose memory is the host's), bytes read and written
/// counted.
fn memcpy_gbs(gpu: &Gpu, timer: &Timer) -> Result<f64, GpuError> {
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

/// Host bookkeeping of one decode step at batch 256 (append one token to
/// each sequence, build the CSR view into a reused BatchView), µs per sequence.
pub fn host_bookkeeping_us_per_seq(steps: usize) -> f64 {
    bookkeeping(steps, false)
}

/// [`host_bookkeeping_us_per_seq`] with prefix caching on: each block a
/// sequence fills is digested (SHA-256 chain) and registered.
pub fn host_bookkeeping_us_per_seq_prefix_cache(steps: usize) -> f64 {
    bookkeeping(steps, true)
}

/// The library [`Scheduler`]'s host cost of a decode step at batch 256
/// (`schedule` + `commit`, one token a sequence), microseconds per sequence.
pub fn scheduler_us_per_seq(steps: usize) -> f64 {
    let batch = 256usize;
    let mut s = Scheduler::new(
        BlockManagerConfig::new((batch * 64) as u32, BLOCK),
        SchedulerConfig::new(4096, batch),
    )
    .expect("valid scheduler");
    for i in 0..batch {
        s.add_request(&vec![i as u32; 500], 1, b"")
            .expect("pool sized for the batch");
    }
    let run = |s: &mut Scheduler| -> usize {
        let step = s.schedule().expect("pool sized for the run");
        let outs: Vec<GroupOutput> = step
            .sample()
            .iter()
            .map(|&request| GroupOutput {
                request,
                children: vec![Child {
                    parent: 0,
                    token: 1,
                    finished: false,
                }],
            })
            .collect();
        s.commit(&step, &outs).expect("outputs match the step");
        step.rows().len()
    };
    // Prefill in chunks until every sequence decodes.
    while run(&mut s) < batch || s.queue_lengths().0 > 0 {}
    let t0 = std::time::Instant::now();
    for _ in 0..steps {
        run(&mut s);
    }
    t0.elapsed().as_secs_f64() * 1e6 / (steps * batch) as f64
}

/// The pool the swap and transfer rates move blocks of: 4 layers, 256
/// blocks of the grid's shape, f16.
fn transfer_pool(gpu: &Gpu) -> Result<KvCache, GpuError> {
    KvCache::new(
        gpu,
        KvCacheConfig::new(256, BLOCK, KV_HEADS, HEAD_DIM)
            .with_layers(4)
            .with_dtype(KvDtype::F16),
    )
}

/// The median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Swap-out and swap-in throughput (GB/s, wall clock, median of 5) of 128
/// scattered blocks of a 4-layer f16 pool of the grid's shape.
fn swap_rates(gpu: &Gpu) -> Result<(f64, f64), GpuError> {
    let cache = transfer_pool(gpu)?;
    let mut space = cache.swap_space(128)?;
    // Every other block: no runs to coalesce (the worst case).
    let out: Vec<[u32; 2]> = (0..128).map(|i| [i * 2, i]).collect();
    let back: Vec<[u32; 2]> = (0..128).map(|i| [i, i * 2 + 1]).collect();
    let bytes = 128.0 * space.block_bytes() as f64;
    let (mut to, mut ti) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = std::time::Instant::now();
        cache.swap_out(gpu, &out, &mut space)?;
        to.push(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        cache.swap_in(gpu, &back, &space)?;
        gpu.wait()?;
        ti.push(t.elapsed().as_secs_f64());
    }
    Ok((bytes / median(&mut to) / 1e9, bytes / median(&mut ti) / 1e9))
}

/// Export and import throughput (GB/s, wall clock, median of 5) of 128
/// scattered blocks of every layer of the swap bench's pool, into other
/// block ids.
fn transfer_rates(gpu: &Gpu) -> Result<(f64, f64), GpuError> {
    let cache = transfer_pool(gpu)?;
    let from: Vec<u32> = (0..128).map(|i| i * 2).collect();
    let to: Vec<u32> = (0..128).map(|i| i * 2 + 1).collect();
    let mut bytes = vec![0u8; cache.export_bytes(from.len(), 0..4)? as usize];
    let (mut te, mut ti) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = std::time::Instant::now();
        let layout = cache.export_blocks(gpu, &from, 0..4, &mut bytes)?;
        te.push(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        cache.import_blocks(gpu, &layout, &bytes, &to)?;
        gpu.wait()?;
        ti.push(t.elapsed().as_secs_f64());
    }
    let n = bytes.len() as f64;
    Ok((n / median(&mut te) / 1e9, n / median(&mut ti) / 1e9))
}

/// Time to first token of the attention path, 4 layers of the grid's
/// shape: a prompt of `total` tokens whose first `shared` tokens are a
/// prefix another engine computed. Cold: every token's K/V written and
/// the whole prompt's prefill attention, per layer. Remote hit: the
/// prefix's blocks imported (bytes exported from a pool that computed
/// them), then only the suffix written and attended. Best of 3, wall
/// clock, the output read back each layer.
fn remote_ttft(
    gpu: &Gpu,
    total: usize,
    shared: usize,
    rng: &mut SplitMix64,
) -> Result<(f64, f64), GpuError> {
    let layers = 4u32;
    let nb = total.div_ceil(BLOCK as usize) as u32;
    let cfg = KvCacheConfig::new(nb, BLOCK, KV_HEADS, HEAD_DIM)
        .with_layers(layers)
        .with_dtype(KvDtype::F16);
    let (a, b) = (KvCache::new(gpu, cfg)?, KvCache::new(gpu, cfg)?);
    let attn = PagedAttention::new(gpu, &a, HEADS, &Default::default())?;
    let row = (KV_HEADS * HEAD_DIM) as usize;
    let (k, v) = (rng.signed_vec(total * row), rng.signed_vec(total * row));
    let q = rng.signed_vec(total * (HEADS * HEAD_DIM) as usize);
    let table: Vec<u32> = (0..nb).collect();
    let slots: Vec<u32> = (0..total as u32).collect();
    let opts = AttnOptions::default();
    let shared_blocks = shared / BLOCK as usize;
    let prefix = shared_blocks * BLOCK as usize;
    // The exporter computed the prefix.
    for l in 0..layers {
        a.write_kv(
            gpu,
            l,
            &k[..prefix * row],
            &v[..prefix * row],
            &slots[..prefix],
        )?;
    }
    let blocks: Vec<u32> = (0..shared_blocks as u32).collect();
    let mut bytes = vec![0u8; a.export_bytes(blocks.len(), 0..layers)? as usize];
    let layout = a.export_blocks(gpu, &blocks, 0..layers, &mut bytes)?;
    let run = |from: usize| -> Result<f64, GpuError> {
        let t = std::time::Instant::now();
        if from > 0 {
            b.import_blocks(gpu, &layout, &bytes, &blocks)?;
        }
        let n = total - from;
        for l in 0..layers {
            b.write_kv(gpu, l, &k[from * row..], &v[from * row..], &slots[from..])?;
            attn.prefill(
                gpu,
                &b,
                l,
                &q[from * (HEADS * HEAD_DIM) as usize..],
                &[0, n as u32],
                &[0, nb],
                &table,
                &[total as u32],
                &opts,
            )?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    let (mut cold, mut hit) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..3 {
        cold = cold.min(run(0)?);
        hit = hit.min(run(prefix)?);
    }
    Ok((cold, hit))
}

fn bookkeeping(steps: usize, prefix: bool) -> f64 {
    let batch = 256;
    let mut m =
        BlockManager::new(BlockManagerConfig::new(batch * 64, BLOCK).with_prefix_caching(prefix))
            .expect("valid pool");
    let ids: Vec<SeqId> = (0..batch)
        .map(|i| {
            m.add_sequence(&vec![i; 500])
                .expect("pool sized for the batch")
        })
        .collect();
    let mut view = BatchView::default();
    m.batch_view_into(&ids, &mut view).expect("live ids");
    let t0 = std::time::Instant::now();
    for step in 0..steps {
        for &id in &ids {
            m.append(id, &[step as u32])
                .expect("pool sized for the run");
        }
        m.batch_view_into(&ids, &mut view).expect("live ids");
    }
    t0.elapsed().as_secs_f64() * 1e6 / (steps * batch as usize) as f64
}

/// The host side of one planned decode step (`pagedattn::gpu` plan/run):
/// bookkeeping (`batch_view_into`), `plan_write` + `plan_decode`, and
/// recording `run_copy_blocks` and, per layer, `run_write_kv` + `run` into
/// one encoder (finished, not submitted).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct HostStep {
    /// Layers recorded.
    pub layers: u32,
    /// Sequences in the batch.
    pub batch: u32,
    /// Context per sequence, tokens.
    pub context: u32,
    /// Median microseconds per step.
    pub us_per_step: f64,
    /// Buffers the library created over the timed steps (target 0).
    pub buffers_created: u64,
    /// Bind groups the library created over the timed steps (target 0).
    pub bind_groups_created: u64,
}

/// Measures [`HostStep`] at 32 layers, batch 64, context 2048 (tiny heads:
/// the host work depends on the tables, not on the head shape).
pub fn host_step(gpu: &Gpu, steps: usize) -> Result<HostStep, BenchError> {
    use pagedattn::gpu::{DecodeTables, KvCacheConfig, PagedAttention};
    let (layers, batch, context) = (32u32, 64u32, 2048u32);
    let (kvh, hd) = (1u32, 16u32);
    let blocks_per_seq = context / BLOCK + 2;
    let num_blocks = batch * blocks_per_seq;
    let cache = KvCache::new(
        gpu,
        KvCacheConfig::new(num_blocks, BLOCK, kvh, hd)
            .with_layers(layers)
            .with_dtype(KvDtype::F16),
    )?;
    let attn = PagedAttention::new(gpu, &cache, 2 * kvh, &Default::default())?;
    let mut m = BlockManager::new(BlockManagerConfig::new(num_blocks, BLOCK))?;
    let ids: Vec<SeqId> = (0..batch)
        .map(|i| m.add_sequence(&vec![i; context as usize - 1 - steps]))
        .collect::<Result<_, _>>()?;
    let mut view = BatchView::default();
    m.batch_view_into(&ids, &mut view)?;
    let q = gpu.storage("host step q", (batch * 2 * kvh * hd * 4) as u64)?;
    let out = gpu.storage("host step out", (batch * 2 * kvh * hd * 4) as u64)?;
    let kv = gpu.storage("host step k/v", (batch * kvh * hd * 4) as u64)?;
    let (mut wplan, mut aplan) = (cache.plan(), attn.plan());
    let opts = [pagedattn::gpu::AttnOptions::default()];
    let mut times = Vec::with_capacity(steps);
    let mut before = None;
    for step in 0..steps + 2 {
        if step == 2 {
            before = Some(gpu.counters());
        }
        let t0 = std::time::Instant::now();
        for &id in &ids {
            m.append(id, &[step as u32])?;
        }
        m.batch_view_into(&ids, &mut view)?;
        cache.plan_write(gpu, &mut wplan, &view.slot_mapping, &view.copies)?;
        attn.plan_decode(gpu, &mut aplan, &DecodeTables::from_view(&view), &opts)?;
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        cache.run_copy_blocks(gpu, &mut enc, &mut wplan)?;
        let kvb = kv.as_entire_buffer_binding();
        for l in 0..layers {
            cache.run_write_kv(gpu, &mut enc, &mut wplan, l, &kvb, &kvb)?;
            attn.run(
                gpu,
                &mut enc,
                &mut aplan,
                &cache,
                l,
                0,
                &q.as_entire_buffer_binding(),
                &out.as_entire_buffer_binding(),
            )?;
        }
        let cmd = enc.finish();
        if step >= 2 {
            times.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        drop(cmd);
    }
    let after = gpu.counters();
    let before = before.unwrap_or(after);
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(HostStep {
        layers,
        batch,
        context,
        us_per_step: times.get(times.len() / 2).copied().unwrap_or(0.0),
        buffers_created: after.buffers - before.buffers,
        bind_groups_created: after.bind_groups - before.bind_groups,
    })
}

/// Runs the benchmark.
pub fn run(gpu: &Gpu, cfg: &BenchConfig) -> Result<BenchReport, BenchError> {
    cfg.validate()?;
    let mut s = Sections {
        gpu,
        cfg,
        timer: Timer::new(gpu, cfg.wall_clock),
        rng: SplitMix64::new(0x5eed),
        // The bench's own tuner: the sections after the grid run its picks.
        picks: pagedattn::gpu::Tuner::new(),
        start: std::time::Instant::now(),
        skipped: Vec::new(),
    };
    // Clocks up before anything is timed; the SM clock logged where
    // nvidia-smi reads it.
    progress(cfg, "warm-up (1 s of copies)");
    s.timer.warm(1.0)?;
    let clock = clock::ClockLog::start();
    let rated = clock::rated_gbs(&gpu.info.name);
    progress(cfg, "memcpy bandwidth");
    let memcpy = memcpy_gbs(gpu, &s.timer)?;
    for section in SECTIONS {
        if !cfg.runs(section) {
            s.skipped.push(match *section {
                "model" => {
                    "model: not selected (--only model; needs scripts/fetch-model.sh)".into()
                }
                _ => format!("{section}: not selected (--only)"),
            });
        }
    }
    let (decode, tuner) = s.decode_grid(rated, clock.as_ref())?;
    let dtypes = s.dtypes()?;
    let cascade = s.cascade()?;
    let split = s.split()?;
    let (host, host_prefix, sched_us, host_step) = if cfg.runs("host") {
        progress(cfg, "host bookkeeping");
        let seqs = if cfg.quick { 50 } else { 400 };
        let host = host_bookkeeping_us_per_seq(seqs);
        let prefix = host_bookkeeping_us_per_seq_prefix_cache(seqs);
        let sched = scheduler_us_per_seq(seqs);
        progress(cfg, "host side of a planned 32-layer step");
        (
            host,
            prefix,
            sched,
            host_step(gpu, if cfg.quick { 20 } else { 100 })?,
        )
    } else {
        (0.0, 0.0, 0.0, HostStep::default())
    };
    let (wk_tps, wk_gbs, cb_ps, cb_gbs) = if cfg.runs("copy") {
        progress(cfg, "write_kv / copy_blocks");
        write_and_copy(gpu, &s.timer, &mut s.rng)?
    } else {
        (0.0, 0.0, 0.0, 0.0)
    };
    let (swap_out_gbs, swap_in_gbs) = if cfg.runs("swap") {
        progress(cfg, "swap out / in");
        swap_rates(gpu)?
    } else {
        (0.0, 0.0)
    };
    let ttft_tokens = if cfg.quick { (256, 192) } else { (1024, 768) };
    let (export_gbs, import_gbs, ttft_cold_ms, ttft_remote_hit_ms) = if cfg.runs("transfer") {
        progress(
            cfg,
            "export / import, time to first token with a remote prefix hit",
        );
        let (e, i) = transfer_rates(gpu)?;
        let (c, h) = remote_ttft(gpu, ttft_tokens.0, ttft_tokens.1, &mut s.rng)?;
        (e, i, c, h)
    } else {
        (0.0, 0.0, 0.0, 0.0)
    };
    let mla = if cfg.runs("mla") {
        progress(cfg, "MLA decode against GQA decode at the same bytes");
        Some(mla_row(gpu, &s.picks, &s.timer, &mut s.rng, cfg.quick)?)
    } else {
        None
    };
    if cfg.progress {
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "\r\x1b[2K[bench] done");
    }
    Ok(BenchReport {
        adapter: gpu.describe(),
        timing: s.timer.source(),
        shape: [HEADS, KV_HEADS, HEAD_DIM, BLOCK],
        memcpy_gbs: memcpy,
        rated_gbs: rated,
        decode,
        skipped: s.skipped,
        split,
        tuner,
        dtypes,
        cascade,
        host_us_per_seq: host,
        host_us_per_seq_prefix_cache: host_prefix,
        host_step,
        write_kv_tokens_per_s: wk_tps,
        write_kv_gbs: wk_gbs,
        copy_blocks_per_s: cb_ps,
        copy_blocks_gbs: cb_gbs,
        swap_out_gbs,
        swap_in_gbs,
        export_gbs,
        import_gbs,
        ttft_cold_ms,
        ttft_remote_hit_ms,
        ttft_tokens,
        scheduler_us_per_seq: sched_us,
        mla,
    })
}

/// What the timed sections of one bench run share: the adapter, the timer,
/// the seeded inputs, the tuner's picks, the time budget and the list of
/// cells left out (with why).
struct Sections<'a> {
    gpu: &'a Gpu,
    cfg: &'a BenchConfig,
    timer: Timer<'a>,
    rng: SplitMix64,
    picks: pagedattn::gpu::Tuner,
    start: std::time::Instant,
    skipped: Vec<String>,
}

impl Sections<'_> {
    /// Leaves `cell` out when the run has used `share` of its time budget
    /// (the decode grid gets three quarters of it, the later sections the
    /// rest), and says so.
    fn out_of_time(&mut self, share: f64, cell: &str) -> bool {
        let over = self.start.elapsed().as_secs_f64() > self.cfg.max_seconds * share;
        if over {
            let budget = self.cfg.max_seconds;
            self.skipped
                .push(format!("{cell}: over the {budget} s time budget"));
        }
        over
    }

    /// The decode grid: per KV dtype the tuner's pick, then each batch and
    /// context with the paged, identity-table and contiguous layouts and
    /// every other eligible kernel, timed in turn.
    fn decode_grid(
        &mut self,
        rated: Option<f64>,
        clock: Option<&clock::ClockLog>,
    ) -> Result<(Vec<DecodeRow>, Vec<TunerRow>), BenchError> {
        let (batches, contexts): (&[u32], &[u32]) = if self.cfg.quick {
            (&[1, 8], &[2048])
        } else {
            (&[1, 8, 32, 64], &[512, 2048, 8192])
        };
        let dtypes: &[KvDtype] = if self.cfg.runs("decode") {
            &[KvDtype::F32, KvDtype::F16]
        } else {
            &[]
        };
        let (mut decode, mut tuner) = (Vec::new(), Vec::new());
        for &dtype in dtypes {
            let dname = dtype.name();
            progress(self.cfg, &format!("tuning the decode kernel ({dname})"));
            let probe = KvCache::new(self.gpu, grid_config(1, 1, dtype))?;
            let report = self.picks.tune(
                self.gpu,
                &probe,
                HEADS,
                std::time::Duration::from_millis(1500),
                true,
            )?;
            let chosen = report.chosen;
            tuner.push(TunerRow {
                dtype: dname,
                chosen: chosen.name(),
                micros: report.micros.iter().map(|(k, t)| (k.name(), *t)).collect(),
                batch: report.batch,
            });
            for &batch in batches {
                for &context in contexts {
                    let cell = format!("decode {dname} batch {batch} context {context}");
                    progress(self.cfg, &cell);
                    if self.out_of_time(0.75, &cell) {
                        continue;
                    }
                    let Some(row) =
                        self.decode_cell(batch, context, dtype, chosen, rated, clock)?
                    else {
                        let mib = self.gpu.max_binding_bytes() >> 20;
                        self.skipped.push(format!(
                            "{cell}: a layer exceeds the adapter's {mib} MiB binding limit"
                        ));
                        continue;
                    };
                    decode.push(row);
                }
            }
        }
        Ok((decode, tuner))
    }

    /// One decode cell, or `None` where a layer exceeds the binding limit;
    /// its share of the `rated` bandwidth and the SM clock `clock` logged
    /// while it ran.
    fn decode_cell(
        &mut self,
        batch: u32,
        context: u32,
        dtype: KvDtype,
        chosen: pagedattn::gpu::Kernel,
        rated: Option<f64>,
        clock: Option<&clock::ClockLog>,
    ) -> Result<Option<DecodeRow>, BenchError> {
        let cell_start = std::time::Instant::now();
        let gpu = self.gpu;
        let Some(r) = rig(gpu, batch, context, dtype, &mut self.rng)? else {
            return Ok(None);
        };
        let paged = PagedAttention::new(
            gpu,
            &r.cache,
            HEADS,
            &pagedattn::gpu::AttentionConfig::new().kernel(chosen),
        )?;
        let contiguous = PagedAttention::new(
            gpu,
            &r.cache,
            HEADS,
            &(pagedattn::gpu::AttentionConfig::new().kernel(chosen)).contiguous(),
        )?;
        let others: Vec<PagedAttention> = PagedAttention::eligible_kernels(gpu, &r.cache, HEADS)
            .into_iter()
            .map(|k| {
                PagedAttention::new(
                    gpu,
                    &r.cache,
                    HEADS,
                    &pagedattn::gpu::AttentionConfig::new().kernel(k),
                )
            })
            .collect::<Result<_, _>>()?;
        let shuffled = tables(batch, context, true, &mut self.rng);
        let identity = tables(batch, context, false, &mut self.rng);
        let split = Split::Auto;
        let mut cells = vec![
            (&paged, &shuffled, split),
            (&paged, &identity, split),
            (&contiguous, &identity, split),
        ];
        cells.extend(others.iter().map(|a| (a, &shuffled, split)));
        let t = r.time_interleaved(&self.timer, &cells)?;
        let (paged_ms, identity_ms, contiguous_ms) = (t[0], t[1], t[2]);
        let bytes = 2.0
            * batch as f64
            * context as f64
            * (KV_HEADS * HEAD_DIM) as f64
            * dtype.bytes() as f64;
        let stream = stream_gbs(gpu, &self.timer, &r.cache)?;
        let eff = bytes / paged_ms / 1e6;
        let variants = others
            .iter()
            .zip(&t[3..])
            .map(|(a, &ms)| VariantCell {
                kernel: a.kernel().name(),
                ms,
                effective_gbs: bytes / ms / 1e6,
                bandwidth_ratio: bytes / ms / 1e6 / stream,
            })
            .collect();
        Ok(Some(DecodeRow {
            batch,
            context,
            dtype: dtype.name(),
            paged_ms,
            identity_ms,
            contiguous_ms,
            paged_over_contiguous: paged_ms / contiguous_ms,
            effective_gbs: eff,
            stream_gbs: stream,
            bandwidth_ratio: eff / stream,
            of_rated: rated.map(|g| eff / g),
            sm_mhz: clock.and_then(|c| c.median_since(cell_start)).map(|c| c.0),
            kernel: chosen.name(),
            variants,
        }))
    }

    /// Decode per KV dtype (every codec, f32 to fp8), at batch 8.
    fn dtypes(&mut self) -> Result<Vec<DtypeRow>, BenchError> {
        progress(self.cfg, "decode per KV dtype");
        if !self.cfg.runs("dtypes") || self.out_of_time(0.8, "decode per dtype") {
            return Ok(Vec::new());
        }
        let context = if self.cfg.quick { 1024 } else { 2048 };
        let mut rows = dtype_rows(
            self.gpu,
            &self.picks,
            &self.timer,
            &mut self.rng,
            8,
            context,
        )?;
        if !self.cfg.quick {
            // The real-GPU target's cell (dtypes whose layer exceeds the
            // binding limit are left out: all of them on lavapipe).
            rows.extend(dtype_rows(
                self.gpu,
                &self.picks,
                &self.timer,
                &mut self.rng,
                32,
                8192,
            )?);
        }
        Ok(rows)
    }

    /// Cascade against plain decode: `n` sequences sharing a prompt.
    fn cascade(&mut self) -> Result<Vec<CascadeRow>, BenchError> {
        progress(self.cfg, "cascade: sequences sharing a prompt");
        let cells: Vec<(u32, u32)> = if !self.cfg.runs("cascade") {
            Vec::new()
        } else if self.cfg.quick {
            vec![(1, 4096), (8, 512), (8, 4096)]
        } else {
            let grid = [1, 4, 8, 32].into_iter();
            grid.flat_map(|n| [512, 4096, 16384].map(|p| (n, p)))
                .collect()
        };
        let mut cascade = Vec::new();
        for (n, prompt) in cells {
            if self.out_of_time(0.9, &format!("cascade n {n} prompt {prompt}")) {
                continue;
            }
            match cascade_row(self.gpu, &self.picks, &self.timer, &mut self.rng, n, prompt)? {
                Some(r) => cascade.push(r),
                None => self.skipped.push(format!(
                    "cascade n {n} prompt {prompt}: the pool exceeds the binding limit"
                )),
            }
        }
        Ok(cascade)
    }

    /// Split-KV against one pass per sequence, where the adapter can finish
    /// one pass.
    fn split(&mut self) -> Result<Vec<SplitRow>, BenchError> {
        let grid: Vec<(u32, u32)> = if !self.cfg.runs("split") {
            Vec::new()
        } else if self.cfg.quick {
            vec![(1, 4096)]
        } else {
            let grid = [1, 4].into_iter();
            grid.flat_map(|b| [2048, 8192, 32768].map(|c| (b, c)))
                .collect()
        };
        let gpu = self.gpu;
        let mut split = Vec::new();
        for (batch, context) in grid {
            let cell = format!("split batch {batch} context {context}");
            progress(self.cfg, &cell);
            if self.out_of_time(1.0, &cell) {
                continue;
            }
            let Some(r) = rig(gpu, batch, context, KvDtype::F16, &mut self.rng)? else {
                self.skipped
                    .push(format!("{cell}: a layer exceeds the binding limit"));
                continue;
            };
            let attn = attention(gpu, &self.picks, &r.cache)?;
            let t = tables(batch, context, true, &mut self.rng);
            let auto_partition = attn.partition_tokens(gpu, Split::Auto, batch, context);
            // One pass per sequence only where the adapter can finish it.
            let whole = context.div_ceil(64) * 64;
            let whole_ok = attn.partition_tokens(gpu, Split::Tokens(whole), batch, context)
                == whole
                && (auto_partition == 0 || !gpu.caps_loops() || auto_partition >= context);
            let mut cells = vec![(&attn, &t, Split::Auto)];
            if whole_ok {
                cells.push((&attn, &t, Split::Never));
            }
            let tt = r.time_interleaved(&self.timer, &cells)?;
            let whole_ms = tt.get(1).copied();
            split.push(SplitRow {
                batch,
                context,
                kernel: attn.kernel().name(),
                whole_ms,
                split_ms: tt[0],
                speedup: whole_ms.map(|w| w / tt[0]),
                auto_partition,
            });
        }
        Ok(split)
    }
}

/// Median ms of each of `n` variants, one run of each in turn (variant 0,
/// 1, ..., 0, 1, ...) after a warm-up round, so a drift of the machine lands
/// on all alike. `record(variant, run, encoder)` records one run.
fn interleaved_medians(
    timer: &Timer,
    n: usize,
    record: &mut dyn FnMut(usize, usize, &mut wgpu::CommandEncoder) -> Result<(), GpuError>,
) -> Result<Vec<f64>, GpuError> {
    let mut err = None;
    let mut times = vec![Vec::new(); n];
    let runs = timer.runs.clamp(3, 7);
    // The warm-up round decides the runs per submit.
    let mut per = 1;
    for run in 0..=runs {
        let mut slowest: f64 = 0.0;
        for (i, t) in times.iter_mut().enumerate() {
            let ms = timer.batch(run, per, &mut |run, enc| {
                if let Err(e) = record(i, run, enc) {
                    err = Some(e);
                }
            })?;
            slowest = slowest.max(ms);
            if run > 0 {
                t.push(ms);
            }
        }
        if run == 0 {
            per = timer::per_submit(slowest);
        }
    }
    if let Some(e) = err {
        return Err(e);
    }
    Ok(times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect())
}

/// One cascade cell (f16 KV, the grid's head shape): `n` sequences sharing
/// a `prompt`-token prompt, each with 0-256 private tokens.
/// The grid's attention over `cache`: `PAGEDATTN_KERNEL` when set, else
/// the bench tuner's pick for the shape, else the adapter's default.
fn attention(
    gpu: &Gpu,
    picks: &pagedattn::gpu::Tuner,
    cache: &KvCache,
) -> Result<PagedAttention, BenchError> {
    let cfg =
        crate::env::attention_config(picks.kept(gpu, cache, HEADS)).map_err(BenchError::Config)?;
    Ok(PagedAttention::new(gpu, cache, HEADS, &cfg)?)
}

fn cascade_row(
    gpu: &Gpu,
    picks: &pagedattn::gpu::Tuner,
    timer: &Timer,
    rng: &mut SplitMix64,
    n: u32,
    prompt: u32,
) -> Result<Option<CascadeRow>, BenchError> {
    use pagedattn::gpu::{Cascade, DecodeTables};
    let private: Vec<u32> = (0..n).map(|_| rng.below(257) as u32).collect();
    let pblocks = prompt / BLOCK;
    let mut indptr = vec![0u32];
    let mut indices = Vec::new();
    let mut next = pblocks;
    let mut lens = Vec::new();
    for &p in &private {
        indices.extend(0..pblocks);
        let own = p.div_ceil(BLOCK).max(1);
        indices.extend(next..next + own);
        next += own;
        indptr.push(indices.len() as u32);
        lens.push(prompt + p.max(1));
    }
    let Some(cache) = filled_cache(gpu, next * BLOCK, KvDtype::F16, 1, rng)? else {
        return Ok(None);
    };
    let attn = attention(gpu, picks, &cache)?;
    let t = DecodeTables {
        kv_indptr: &indptr,
        kv_indices: &indices,
        seq_lens: &lens,
    };
    let mut plain = attn.plan();
    let off = AttnOptions {
        cascade: Cascade::Off,
        ..Default::default()
    };
    attn.plan_decode(gpu, &mut plain, &t, &[off])?;
    let mut cas = attn.plan();
    let on = AttnOptions {
        cascade: Cascade::On,
        ..Default::default()
    };
    attn.plan_decode(gpu, &mut cas, &t, &[on])?;
    let mut auto = attn.plan();
    attn.plan_decode(gpu, &mut auto, &t, &[AttnOptions::default()])?;
    let q = gpu.storage_init("q", &rng.signed_vec((n * HEADS * HEAD_DIM) as usize))?;
    let out = gpu.storage("out", (n * HEADS * HEAD_DIM * 4) as u64)?;
    let mut plans = [&mut plain, &mut cas];
    let t = interleaved_medians(timer, 2, &mut |i, _, enc| {
        attn.run(
            gpu,
            enc,
            plans[i],
            &cache,
            0,
            0,
            &q.as_entire_buffer_binding(),
            &out.as_entire_buffer_binding(),
        )
    })?;
    let (pm, cm) = (t[0], t[1]);
    Ok(Some(CascadeRow {
        n,
        prompt,
        private_mean: private.iter().map(|&p| p as f64).sum::<f64>() / n as f64,
        plain_ms: pm,
        cascade_ms: cm,
        speedup: pm / cm,
        plain_bytes: plain.kv_bytes_per_layer(),
        cascade_bytes: cas.kv_bytes_per_layer(),
        used: cas.cascade().is_some(),
        auto_uses: auto.cascade().is_some(),
        kernel: attn.kernel().name(),
    }))
}

/// Decode of `batch` x `context` over f32, f16, int8 and fp8 pools, one
/// run of each in turn (interleaved), median of the runs.
fn dtype_rows(
    gpu: &Gpu,
    picks: &pagedattn::gpu::Tuner,
    timer: &Timer,
    rng: &mut SplitMix64,
    batch: u32,
    context: u32,
) -> Result<Vec<DtypeRow>, BenchError> {
    let all = [
        (KvDtype::F32, false),
        (KvDtype::F16, false),
        (KvDtype::Bf16, false),
        (KvDtype::Int8, false),
        (KvDtype::Fp8E4M3, false),
        (KvDtype::Int8, true),
        (KvDtype::Fp8E4M3, true),
    ];
    let mut rigs = Vec::new();
    for (dtype, outliers) in all {
        let Some(r) = rig(gpu, batch, context, dtype, rng)? else {
            continue;
        };
        if outliers {
            let chans: Vec<u32> = (0..KV_HEADS).flat_map(|_| [5, 42, 79, 116]).collect();
            for l in 0..r.layers {
                r.cache.set_k_outlier_channels(gpu, l, &chans)?;
            }
        }
        let name = match (dtype, outliers) {
            (KvDtype::Int8, true) => "int8+outliers",
            (KvDtype::Fp8E4M3, true) => "fp8+outliers",
            _ => dtype.name(),
        };
        let attn = attention(gpu, picks, &r.cache)?;
        let t = tables(batch, context, true, rng);
        let plan = decode_plan(gpu, &attn, &t, Split::Auto)?;
        rigs.push((name, r, attn, plan));
    }
    let ms = interleaved_medians(timer, rigs.len(), &mut |i, run, enc| {
        let (_, r, attn, plan) = &mut rigs[i];
        let layer = run as u32 % r.layers;
        attn.run(
            gpu,
            enc,
            plan,
            &r.cache,
            layer,
            0,
            &r.q.as_entire_buffer_binding(),
            &r.out.as_entire_buffer_binding(),
        )
    })?;
    let f16_block = KvCacheConfig::new(1, BLOCK, KV_HEADS, HEAD_DIM)
        .with_dtype(KvDtype::F16)
        .block_bytes() as f64;
    let mut rows: Vec<DtypeRow> = rigs
        .iter()
        .zip(&ms)
        .map(|((dtype, r, attn, _), &ms)| {
            let c = r.cache.config();
            DtypeRow {
                dtype,
                batch,
                context,
                kernel: attn.kernel().name(),
                ms,
                kv_bytes: (batch * context / BLOCK) as u64 * c.block_bytes(),
                block_bytes_over_f16: c.block_bytes() as f64 / f16_block,
                time_over_f16: 0.0,
            }
        })
        .collect();
    let f16_ms = rows
        .iter()
        .find(|r| r.dtype == "f16")
        .map_or(f64::NAN, |r| r.ms);
    for r in &mut rows {
        r.time_over_f16 = r.ms / f16_ms;
    }
    Ok(rows)
}

fn write_and_copy(
    gpu: &Gpu,
    timer: &Timer,
    rng: &mut SplitMix64,
) -> Result<(f64, f64, f64, f64), BenchError> {
    let blocks = 1024u32;
    let cache = filled_cache(gpu, blocks * BLOCK, KvDtype::F32, 1, rng)?
        .ok_or_else(|| BenchError::Config("bench pool does not fit".into()))?;
    let ntok = 256u32;
    let row = (KV_HEADS * HEAD_DIM) as usize;
    let k = gpu.storage_init("k", &rng.signed_vec(ntok as usize * row))?;
    let v = gpu.storage_init("v", &rng.signed_vec(ntok as usize * row))?;
    let mut slots: Vec<u32> = (0..blocks * BLOCK).collect();
    rng.shuffle(&mut slots);
    slots.truncate(ntok as usize);
    let mut plan = cache.plan();
    cache.plan_write(gpu, &mut plan, &slots, &[])?;
    let mut err = None;
    let ms = timer.median(|_, enc| {
        let (k, v) = (k.as_entire_buffer_binding(), v.as_entire_buffer_binding());
        if let Err(e) = cache.run_write_kv(gpu, enc, &mut plan, 0, &k, &v) {
            err = Some(e);
        }
    })?;
    let wk_tps = ntok as f64 / ms * 1e3;
    let wk_gbs = 2.0 * (ntok as usize * row * 4) as f64 / ms / 1e6;
    let ncopies = 256u32;
    let mut ids: Vec<u32> = (0..blocks).collect();
    rng.shuffle(&mut ids);
    let copies: Vec<[u32; 2]> = (0..ncopies as usize)
        .map(|i| [ids[2 * i], ids[2 * i + 1]])
        .collect();
    cache.plan_write(gpu, &mut plan, &[], &copies)?;
    let ms_c = timer.median(|_, enc| {
        if let Err(e) = cache.run_copy_blocks(gpu, enc, &mut plan) {
            err = Some(e);
        }
    })?;
    if let Some(e) = err {
        return Err(e.into());
    }
    // K and V of every layer.
    let block_bytes = cache.config().block_bytes() as f64 * cache.config().num_layers as f64;
    Ok((
        wk_tps,
        wk_gbs,
        ncopies as f64 / ms_c * 1e3,
        ncopies as f64 * block_bytes / ms_c / 1e6,
    ))
}

/// The report as the table the CLI prints.
pub fn render(r: &BenchReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "adapter: {}   timing: {:?}", r.adapter, r.timing);
    let _ = writeln!(
        s,
        "decode shape: {} q heads / {} kv heads, head_dim {}, block {}; copy_buffer_to_buffer {:.2} GB/s (read + written); rated {}",
        r.shape[0], r.shape[1], r.shape[2], r.shape[3], r.memcpy_gbs,
        r.rated_gbs.map_or("unknown".into(), |g| format!("{g:.0} GB/s"))
    );
    render_decode(&mut s, r);
    render_dtypes_cascade(&mut s, r);
    for k in &r.skipped {
        let _ = writeln!(s, " skipped: {k}");
    }
    render_split(&mut s, r);
    render_host(&mut s, r);
    s
}

/// The decode grid, its kernels side by side, and the tuner's picks.
fn render_decode(s: &mut String, r: &BenchReport) {
    use std::fmt::Write;
    let _ = writeln!(s, "\n dtype  batch  context   paged ms  identity ms  contig ms  paged/contig  eff GB/s  stream GB/s  eff/stream  eff/rated  SM MHz");
    for d in &r.decode {
        let _ = writeln!(
            s,
            " {:<5}  {:>5}  {:>7}  {:>9.3}  {:>11.3}  {:>9.3}  {:>12.3}  {:>8.2}  {:>11.2}  {:>10.2}  {:>9}  {:>6}",
            d.dtype, d.batch, d.context, d.paged_ms, d.identity_ms, d.contiguous_ms, d.paged_over_contiguous, d.effective_gbs, d.stream_gbs, d.bandwidth_ratio,
            d.of_rated.map_or("-".into(), |x| format!("{x:.2}")),
            d.sm_mhz.map_or("-".into(), |m| m.to_string())
        );
    }
    let _ = writeln!(
        s,
        "\n decode kernels, same cells, interleaved (Split::Auto, shuffled blocks); * = tuner's pick"
    );
    for d in &r.decode {
        let cells: Vec<String> = d
            .variants
            .iter()
            .map(|v| {
                format!(
                    "{}{} {:.3} ms ({:.2} GB/s, {:.0}% of stream)",
                    if v.kernel == d.kernel { "*" } else { " " },
                    v.kernel,
                    v.ms,
                    v.effective_gbs,
                    100.0 * v.bandwidth_ratio
                )
            })
            .collect();
        let _ = writeln!(
            s,
            " {:<5}  {:>5}  {:>7}  {}",
            d.dtype,
            d.batch,
            d.context,
            cells.join("  ")
        );
    }
    for t in &r.tuner {
        let m: Vec<String> = t
            .micros
            .iter()
            .map(|(k, us)| format!("{k} {:.0} us", us))
            .collect();
        let _ = writeln!(
            s,
            " tuner ({}, {} x {} tokens): picked {}; {}",
            t.dtype,
            t.batch.0,
            t.batch.1,
            t.chosen,
            m.join(", ")
        );
    }
}

/// A table: its header line, then one line per row; nothing when there
/// are no rows.
fn table<T>(s: &mut String, header: &str, rows: &[T], line: impl Fn(&T) -> String) {
    if rows.is_empty() {
        return;
    }
    s.push_str(header);
    s.push('\n');
    for r in rows {
        s.push_str(&line(r));
        s.push('\n');
    }
}

/// Decode per KV dtype, and the cascade against plain decode.
fn render_dtypes_cascade(s: &mut String, r: &BenchReport) {
    table(
        s,
        "\n KV dtype  batch  context  kernel      ms    K+V MB  block/f16  time/f16",
        &r.dtypes,
        |d| {
            format!(
                " {:<8}  {:>5}  {:>7}  {:<8}  {:>8.3}  {:>7.1}  {:>9.3}  {:>8.2}",
                d.dtype,
                d.batch,
                d.context,
                d.kernel,
                d.ms,
                d.kv_bytes as f64 / 1e6,
                d.block_bytes_over_f16,
                d.time_over_f16
            )
        },
    );
    table(
        s,
        "\n cascade (f16): n  prompt  private  kernel    plain ms  cascade ms  plain/cascade  K/V bytes cascade/plain  Auto picks",
        &r.cascade,
        |c| {
            format!(
                "  {:>13}  {:>6}  {:>7.0}  {:<8}  {:>8.3}  {:>10.3}  {:>13.2}  {:>24.3}  {}",
                c.n,
                c.prompt,
                c.private_mean,
                c.kernel,
                c.plain_ms,
                c.cascade_ms,
                c.speedup,
                c.cascade_bytes as f64 / c.plain_bytes.max(1) as f64,
                if c.auto_uses { "cascade" } else { "plain" }
            )
        },
    );
}

/// Split-KV against one pass per sequence.
fn render_split(s: &mut String, r: &BenchReport) {
    use std::fmt::Write;
    let _ = writeln!(
        s,
        "\n split (f16)  kernel  batch  context   whole ms   auto ms  whole/auto  auto picks"
    );
    for d in &r.split {
        let _ = writeln!(
            s,
            "              {:<6}  {:>5}  {:>7}  {:>9}  {:>8.3}  {:>10}  {}",
            d.kernel,
            d.batch,
            d.context,
            d.whole_ms
                .map_or("(capped)".to_string(), |w| format!("{w:.3}")),
            d.split_ms,
            d.speedup.map_or("-".to_string(), |x| format!("{x:.2}")),
            if d.auto_partition == 0 {
                "whole".to_string()
            } else {
                format!("split {}", d.auto_partition)
            }
        );
    }
}

/// The host side, the copies, swap, transfers, MLA and the scheduler.
fn render_host(s: &mut String, r: &BenchReport) {
    use std::fmt::Write;
    // Sections left out by --only have figures of 0: not printed.
    if r.host_us_per_seq > 0.0 {
        let _ = writeln!(
            s,
            "\nhost bookkeeping at batch 256: {:.3} us per sequence per step ({:.3} with prefix caching)",
            r.host_us_per_seq, r.host_us_per_seq_prefix_cache
        );
        let h = &r.host_step;
        let _ = writeln!(
            s,
            "plan + record a {}-layer decode step at batch {} (context {}): {:.0} us; {} buffers and {} bind groups created per steady step",
            h.layers, h.batch, h.context, h.us_per_step, h.buffers_created, h.bind_groups_created
        );
    }
    if r.write_kv_tokens_per_s > 0.0 {
        let _ = writeln!(
            s,
            "write_kv: {:.0} tokens/s ({:.2} GB/s)",
            r.write_kv_tokens_per_s, r.write_kv_gbs
        );
        let _ = writeln!(
            s,
            "copy_blocks: {:.0} blocks/s ({:.2} GB/s)",
            r.copy_blocks_per_s, r.copy_blocks_gbs
        );
    }
    if r.swap_out_gbs > 0.0 {
        let _ = writeln!(
            s,
            "swap (128 scattered blocks, 4 layers, wall clock): out {:.2} GB/s, in {:.2} GB/s (copy_buffer_to_buffer {:.2} GB/s)",
            r.swap_out_gbs, r.swap_in_gbs, r.memcpy_gbs
        );
    }
    if r.export_gbs > 0.0 {
        let _ = writeln!(
            s,
            "export / import (128 scattered blocks, 4 layers, wall clock): export {:.2} GB/s, import {:.2} GB/s",
            r.export_gbs, r.import_gbs
        );
        let _ = writeln!(
            s,
            "time to first token, attention path (4 layers, {} prompt tokens, {} from a remote prefix): cold {:.1} ms, remote hit {:.1} ms ({:.2}x)",
            r.ttft_tokens.0,
            r.ttft_tokens.1,
            r.ttft_cold_ms,
            r.ttft_remote_hit_ms,
            r.ttft_cold_ms / r.ttft_remote_hit_ms
        );
    }
    if let Some(m) = &r.mla {
        let _ = writeln!(
            s,
            "MLA decode (16 heads, bf16 latent 512+64, batch {}, {} tokens, {} partition(s)) {:.3} ms vs GQA ({HEADS}/{KV_HEADS} heads x {HEAD_DIM}, bf16, {} tokens) {:.3} ms over the same {:.1} MB: MLA/GQA {:.2}x ({:.2} vs {:.2} GB/s)",
            m.batch,
            m.mla_context,
            m.mla_partitions,
            m.mla_ms,
            m.gqa_context,
            m.gqa_ms,
            m.bytes as f64 / 1e6,
            m.mla_ms / m.gqa_ms,
            m.bytes as f64 / m.mla_ms / 1e6,
            m.bytes as f64 / m.gqa_ms / 1e6,
        );
    }
    if r.scheduler_us_per_seq > 0.0 {
        let _ = writeln!(
            s,
            "scheduler (schedule + commit) at batch 256: {:.2} us per sequence per step",
            r.scheduler_us_per_seq
        );
    }
}
