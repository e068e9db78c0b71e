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

mod dtypes;
mod host;
mod mla;
mod render;
mod rig;
mod stream;
mod transfer;
use dtypes::*;
pub use host::*;
pub use mla::*;
pub use render::*;
pub use rig::*;
pub use stream::*;
use transfer::*;

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
    /// Gemma 3's layer groups (a window group releasing past 512 tokens,
    /// and the full group) against one full group: host bookkeeping per
    /// decode step at batch 256, microseconds per sequence.
    pub hybrid_us_per_seq: (f64, f64),
    /// MLA decode against GQA decode reading the same bytes (`None` when
    /// the section did not run).
    pub mla: Option<MlaRow>,
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
                    "model: not selected (--only model; needs scripts/fetch-model.sh, or --synthetic ARCH)".into()
                }
                _ => format!("{section}: not selected (--only)"),
            });
        }
    }
    let (decode, tuner) = s.decode_grid(rated, clock.as_ref())?;
    let dtypes = s.dtypes()?;
    let cascade = s.cascade()?;
    let split = s.split()?;
    let (host, host_prefix, sched_us, hybrid_us, host_step) = if cfg.runs("host") {
        progress(cfg, "host bookkeeping");
        let seqs = if cfg.quick { 50 } else { 400 };
        let host = host_bookkeeping_us_per_seq(seqs);
        let prefix = host_bookkeeping_us_per_seq_prefix_cache(seqs);
        let sched = scheduler_us_per_seq(seqs);
        let hybrid = hybrid_us_per_seq(seqs.min(100));
        progress(cfg, "host side of a planned 32-layer step");
        (
            host,
            prefix,
            sched,
            hybrid,
            host_step(gpu, if cfg.quick { 20 } else { 100 })?,
        )
    } else {
        (0.0, 0.0, 0.0, (0.0, 0.0), HostStep::default())
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
        hybrid_us_per_seq: hybrid_us,
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
