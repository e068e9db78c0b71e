//! `pagedattn sweep`: one pass over the questions a real GPU answers about
//! decode, printed as one table (and CSV): the device's read and copy
//! ceilings, `lanes` against `stream` over its step parameters with checked
//! and trusted shader modules, split-K partitions, KV dtypes (does time
//! scale with bytes?), and paged against contiguous. Each figure is the
//! median of several submits of back-to-back runs after a warm-up of at
//! least a second, with the median SM clock over its span where
//! `nvidia-smi` exists, as a share of the measured read ceiling and of the
//! adapter's rated bandwidth where known. `scripts/gpu-sweep.sh` runs it.

use super::clock::{rated_gbs, ClockLog};
use super::timer::{self, Timer};
use super::{rig, tables, BenchError, HostTables, BLOCK, HEADS, HEAD_DIM, KV_HEADS};
use pagedattn::gpu::shader::ShaderShape;
use pagedattn::gpu::{
    AttentionConfig, Gpu, GpuError, Kernel, KvCache, KvDtype, PagedAttention, ShaderChecks, Split,
};
use pagedattn::rng::SplitMix64;
use std::time::Instant;

/// What to sweep.
#[derive(Clone, Debug)]
pub struct SweepConfig {
    /// Small cells and a few variants (a software adapter finishes in
    /// minutes); else the design note's cells.
    pub small: bool,
    /// Print progress on stderr.
    pub progress: bool,
}

/// One line of the table.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SweepRow {
    /// The sweep step: "ceiling", "decode", "split", "dtype", "paging".
    pub step: &'static str,
    /// What was measured.
    pub what: String,
    /// Milliseconds per run.
    pub ms: f64,
    /// Bytes moved per millisecond / 1e6 (GB/s): read (decode: K and V),
    /// or read + written (copy).
    pub gbs: f64,
    /// gbs over the best read ceiling of the same run.
    pub of_ceiling: Option<f64>,
    /// gbs over the adapter's rated bandwidth, where known.
    pub of_rated: Option<f64>,
    /// Median SM clock (MHz) over the measurement, where nvidia-smi reads it.
    pub sm_mhz: Option<u32>,
    /// Anything else (a ratio, the split).
    pub note: String,
}

/// The whole sweep.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SweepReport {
    /// Adapter and backend.
    pub adapter: String,
    /// Compute units and where they came from, if known.
    pub compute_units: Option<String>,
    /// Rated bandwidth (GB/s), if known.
    pub rated_gbs: Option<f64>,
    /// Best stream-read figure (GB/s).
    pub read_ceiling_gbs: f64,
    /// Rows, in the order measured.
    pub rows: Vec<SweepRow>,
}

struct Sweep<'a> {
    gpu: &'a Gpu,
    cfg: &'a SweepConfig,
    timer: Timer<'a>,
    clock: Option<ClockLog>,
    rated: Option<f64>,
    ceiling: f64,
    rows: Vec<SweepRow>,
}

impl Sweep<'_> {
    fn say(&self, msg: &str) {
        if self.cfg.progress {
            eprintln!("sweep: {msg}");
        }
    }

    fn push(
        &mut self,
        step: &'static str,
        what: String,
        ms: f64,
        bytes: f64,
        since: Instant,
        note: String,
    ) {
        let gbs = bytes / ms / 1e6;
        let row = SweepRow {
            step,
            what,
            ms,
            gbs,
            of_ceiling: (self.ceiling > 0.0).then(|| gbs / self.ceiling),
            of_rated: self.rated.map(|r| gbs / r),
            sm_mhz: self
                .clock
                .as_ref()
                .and_then(|c| c.median_since(since))
                .map(|c| c.0),
            note,
        };
        self.say(&format!(
            "{} {}: {:.4} ms, {:.1} GB/s",
            row.step, row.what, row.ms, row.gbs
        ));
        self.rows.push(row);
    }

    /// Copy ceiling: `bytes` copied one way and back per run, read +
    /// written counted (4 x bytes per run).
    fn copy(&mut self, bytes: u64) -> Result<(), BenchError> {
        let a = self.gpu.storage("ceiling copy a", bytes)?;
        let b = self.gpu.storage("ceiling copy b", bytes)?;
        let t0 = Instant::now();
        let ms = self.timer.median(|_, enc| {
            enc.copy_buffer_to_buffer(&a, 0, &b, 0, bytes);
            enc.copy_buffer_to_buffer(&b, 0, &a, 0, bytes);
        })?;
        self.push(
            "ceiling",
            format!("copy_buffer_to_buffer {} MiB each way", bytes >> 20),
            ms,
            4.0 * bytes as f64,
            t0,
            "read + written".into(),
        );
        Ok(())
    }

    /// Read ceilings: the stream kernel over `total` bytes (in chunks one
    /// binding holds) at each grid and loads per thread, checked and
    /// trusted; the best becomes the ceiling.
    fn reads(&mut self, total: u64) -> Result<(), BenchError> {
        let chunk = (256u64 << 20).min(self.gpu.max_binding_bytes() / 16 * 16);
        let pairs = total.div_ceil(2 * chunk).max(1);
        let mut bufs = Vec::new();
        for i in 0..2 * pairs {
            bufs.push(self.gpu.storage(&format!("ceiling read {i}"), chunk)?);
        }
        let sink = self.gpu.storage("ceiling sink", 16)?;
        let units = self.gpu.compute_units().map_or(16, |u| u.count);
        let grids: Vec<u32> = if self.cfg.small {
            vec![units * 4, units * 16]
        } else {
            vec![units, units * 4, units * 16, units * 64]
        };
        let loads: &[u32] = if self.cfg.small { &[1, 4] } else { &[1, 4, 8] };
        let bytes = (2 * pairs * chunk) as f64;
        for trusted in [false, true] {
            for &l in loads {
                let shape = ShaderShape {
                    head_dim: 4,
                    unroll: l,
                    trusted,
                    ..ShaderShape::default()
                };
                let pipe = super::stream_read_pipeline(self.gpu, &shape)?;
                let groups: Vec<wgpu::BindGroup> = (0..pairs as usize)
                    .map(|p| {
                        pagedattn::gpu::bind_buffers(
                            self.gpu,
                            &pipe,
                            &[&bufs[2 * p], &bufs[2 * p + 1], &sink],
                        )
                    })
                    .collect();
                for &wgs in &grids {
                    let wgs = wgs.clamp(1, 65535);
                    let t0 = Instant::now();
                    let ms = self.timer.median(|_, enc| {
                        for bg in &groups {
                            pagedattn::gpu::dispatch_pass(
                                enc,
                                "stream_read",
                                &pipe,
                                bg,
                                (wgs, 1, 1),
                            );
                        }
                    })?;
                    let gbs = bytes / ms / 1e6;
                    self.ceiling = self.ceiling.max(gbs);
                    let checks = if trusted { "trusted" } else { "checked" };
                    self.push(
                        "ceiling",
                        format!(
                            "stream read {} MiB, {wgs} WGs x 64, {l} loads, {checks}",
                            (bytes as u64) >> 20
                        ),
                        ms,
                        bytes,
                        t0,
                        String::new(),
                    );
                }
            }
        }
        Ok(())
    }

    /// Times `variants` (label, attention, tables, split) on one rig,
    /// interleaved, and pushes a row each; returns their times.
    fn decode_rows(
        &mut self,
        step: &'static str,
        r: &super::DecodeRig,
        bytes: f64,
        variants: &[(String, &PagedAttention, &HostTables, Split, String)],
    ) -> Result<Vec<f64>, BenchError> {
        let t0 = Instant::now();
        let v: Vec<(&PagedAttention, &HostTables, Split)> = variants
            .iter()
            .map(|(_, a, t, s, _)| (*a, *t, *s))
            .collect();
        let times = r.time_interleaved(&self.timer, &v)?;
        for ((what, _, _, _, note), &ms) in variants.iter().zip(&times) {
            self.push(step, what.clone(), ms, bytes, t0, note.clone());
        }
        Ok(times)
    }
}

/// A decode configuration of the sweep: kernel, stream step, checks.
#[derive(Clone, Copy, Debug)]
struct Variant {
    kernel: Kernel,
    unroll: u32,
    workgroup: u32,
    checks: ShaderChecks,
}

impl Variant {
    /// `lanes` built with `checks`.
    fn lanes(checks: ShaderChecks) -> Self {
        Variant {
            kernel: Kernel::Lanes,
            unroll: 0,
            workgroup: 0,
            checks,
        }
    }

    fn config(&self) -> AttentionConfig {
        AttentionConfig::new()
            .kernel(self.kernel)
            .stream_step(self.unroll, self.workgroup)
            .shader_checks(self.checks)
    }

    fn label(&self) -> String {
        let checks = if self.checks == ShaderChecks::Checked {
            "checked"
        } else {
            "trusted"
        };
        match self.kernel {
            Kernel::Stream => format!("stream u{} wg{} {checks}", self.unroll, self.workgroup),
            k => format!("{k} {checks}"),
        }
    }
}

/// K and V bytes one decode of `batch` x `context` reads at `dtype` (data
/// only; the quantized pools' scales add 1/32 to 1/64).
fn kv_bytes(batch: u32, context: u32, dtype: KvDtype) -> f64 {
    2.0 * batch as f64 * context as f64 * (KV_HEADS * HEAD_DIM) as f64 * dtype.bytes() as f64
}

/// The decode variants the sweep times, checked and trusted: the other
/// kernels, then `stream` at each (unroll, workgroup) step. The small
/// sweep (a software adapter) also runs the kernels besides `lanes`, so
/// their checked / trusted ratio is measured where they are the default.
fn variants(small: bool) -> Vec<Variant> {
    let steps: &[(u32, u32)] = if small {
        &[(4, 128), (2, 64)]
    } else {
        &[
            (1, 64),
            (1, 128),
            (2, 64),
            (2, 128),
            (2, 256),
            (4, 64),
            (4, 128),
            (4, 256),
        ]
    };
    let others: &[Kernel] = if small {
        &[Kernel::Lanes, Kernel::Serial, Kernel::Tiled]
    } else {
        &[Kernel::Lanes]
    };
    let mut variants = Vec::new();
    for checks in [ShaderChecks::Checked, ShaderChecks::Trusted] {
        for &kernel in others {
            variants.push(Variant {
                kernel,
                unroll: 0,
                workgroup: 0,
                checks,
            });
        }
        for &(unroll, workgroup) in steps {
            variants.push(Variant {
                kernel: Kernel::Stream,
                unroll,
                workgroup,
                checks,
            });
        }
    }
    variants
}

/// A filled f16 decode cell the sweep keeps for its later steps.
struct KeptCell<'a> {
    batch: u32,
    context: u32,
    rig: super::DecodeRig<'a>,
    /// Shuffled block tables over the rig's pool.
    tables: HostTables,
}

/// Runs the sweep on `gpu`.
pub fn run(gpu: &Gpu, cfg: &SweepConfig) -> Result<SweepReport, BenchError> {
    let timer = Timer::new(gpu, false);
    let mut s = Sweep {
        gpu,
        cfg,
        timer,
        clock: ClockLog::start(),
        rated: rated_gbs(&gpu.info.name),
        ceiling: 0.0,
        rows: Vec::new(),
    };
    s.say("warming up (at least 1 s of copies)");
    s.timer.warm(if cfg.small { 1.0 } else { 2.0 })?;

    // A: ceilings.
    let total = if cfg.small { 256u64 << 20 } else { 1u64 << 30 };
    s.copy(total.min(gpu.limits.max_buffer_size))?;
    s.reads(total)?;

    let mut rng = SplitMix64::new(0x5eed_5eed);
    // B: decode variants per cell (f16).
    let (kept, win) = s.decode_cells(&variants(cfg.small), &mut rng)?;
    let (Some(win), Some(first)) = (win, kept.first()) else {
        return Err(BenchError::Config(
            "no decode cell fits this adapter".into(),
        ));
    };
    let pair = [Variant::lanes(win.checks), win];
    // C: splits, on lanes and the winner.
    s.splits(first, pair)?;
    // D: dtypes on lanes and the winner: does time scale with bytes?
    s.dtypes(first, pair, &mut rng)?;
    // E: paged (shuffled) against contiguous, on the winner, every cell.
    s.paging(&kept, win, &mut rng)?;

    Ok(SweepReport {
        adapter: gpu.describe(),
        compute_units: gpu
            .compute_units()
            .map(|u| format!("{} ({:?})", u.count, u.source)),
        rated_gbs: s.rated,
        read_ceiling_gbs: s.ceiling,
        rows: s.rows,
    })
}

/// The sweep's steps after the ceilings.
impl<'a> Sweep<'a> {
    /// `variants` built on `cache`; the ones the shape refuses are said
    /// and left out.
    fn build(
        &self,
        cache: &KvCache,
        variants: &[Variant],
    ) -> Result<Vec<(Variant, PagedAttention)>, BenchError> {
        let mut built = Vec::new();
        for v in variants {
            match PagedAttention::new(self.gpu, cache, HEADS, &v.config()) {
                Ok(a) => built.push((*v, a)),
                Err(GpuError::Shape(e)) => self.say(&format!("  {}: {e}", v.label())),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(built)
    }

    /// Every variant on each f16 cell that fits, timed interleaved. Returns
    /// the filled cells (kept for the later steps) and the winner of the
    /// first one.
    fn decode_cells(
        &mut self,
        variants: &[Variant],
        rng: &mut SplitMix64,
    ) -> Result<(Vec<KeptCell<'a>>, Option<Variant>), BenchError> {
        let cells: &[(u32, u32)] = if self.cfg.small {
            &[(8, 1024), (2, 4096)]
        } else {
            &[(32, 8192), (8, 2048), (1, 32768)]
        };
        // Each f16 cell's pool is filled once (a GiB at 32 x 8192) and kept
        // for the split and paging steps.
        let mut kept = Vec::new();
        let mut win = None;
        for &(batch, context) in cells {
            self.say(&format!("decode f16 batch {batch} context {context}"));
            let Some(r) = rig(self.gpu, batch, context, KvDtype::F16, rng)? else {
                self.say("  skipped: a layer exceeds the binding limit");
                continue;
            };
            let t = tables(batch, context, true, rng);
            let built = self.build(&r.cache, variants)?;
            let rows: Vec<_> = built
                .iter()
                .map(|(v, a)| {
                    let what = format!("f16 {batch}x{context} {}", v.label());
                    (what, a, &t, Split::Auto, String::new())
                })
                .collect();
            let bytes = kv_bytes(batch, context, KvDtype::F16);
            let times = self.decode_rows("decode", &r, bytes, &rows)?;
            // The winner of the first cell that fits runs the steps below.
            if win.is_none() {
                win = times
                    .iter()
                    .zip(&built)
                    .min_by(|a, b| a.0.total_cmp(b.0))
                    .map(|(_, (v, _))| *v);
            }
            kept.push(KeptCell {
                batch,
                context,
                rig: r,
                tables: t,
            });
        }
        Ok((kept, win))
    }

    /// Split-K on `pair` at one cell: Auto, one partition, and 2 to 16
    /// partitions, where the adapter accepts them.
    fn splits(&mut self, cell: &KeptCell, pair: [Variant; 2]) -> Result<(), BenchError> {
        let gpu = self.gpu;
        let (batch, context, first, t) = (cell.batch, cell.context, &cell.rig, &cell.tables);
        self.say(&format!(
            "split-K at batch {batch} context {context}: {}",
            pair[1].label()
        ));
        let mut attns = Vec::new();
        for v in pair {
            let a = PagedAttention::new(gpu, &first.cache, HEADS, &v.config())?;
            attns.push((v, a));
        }
        let mut rows = Vec::new();
        for (v, a) in &attns {
            let auto = a.partition_tokens(gpu, Split::Auto, batch, context);
            let parts = if auto == 0 { 1 } else { context.div_ceil(auto) };
            let what = format!("{batch}x{context} {} auto", v.label());
            rows.push((what, a, t, Split::Auto, format!("auto: {parts} partitions")));
            // Splits the adapter refuses (a pass past a loop cap) are left out.
            let fits = |split| super::decode_plan(gpu, a, t, split).is_ok();
            if fits(Split::Never) {
                let what = format!("{batch}x{context} {} 1 partition", v.label());
                rows.push((what, a, t, Split::Never, String::new()));
            }
            for parts in [2u32, 4, 8, 16] {
                let pt = context.div_ceil(parts).div_ceil(64) * 64;
                if fits(Split::Tokens(pt)) {
                    let what = format!("{batch}x{context} {} {parts} partitions", v.label());
                    rows.push((what, a, t, Split::Tokens(pt), format!("{pt} tokens each")));
                }
            }
        }
        let bytes = kv_bytes(batch, context, KvDtype::F16);
        self.decode_rows("split", first, bytes, &rows)?;
        Ok(())
    }

    /// `pair` at f16, int8 and fp8 on one cell, timed interleaved per
    /// dtype; each quantized row notes its time over f16's.
    fn dtypes(
        &mut self,
        cell: &KeptCell,
        pair: [Variant; 2],
        rng: &mut SplitMix64,
    ) -> Result<(), BenchError> {
        let (batch, context, first, t) = (cell.batch, cell.context, &cell.rig, &cell.tables);
        let mut f16_ms: Option<Vec<f64>> = None;
        for dtype in [KvDtype::F16, KvDtype::Int8, KvDtype::Fp8E4M3] {
            self.say(&format!("dtype {}", dtype.name()));
            let filled;
            let (r, t) = if dtype == KvDtype::F16 {
                (first, t)
            } else {
                let Some(r) = rig(self.gpu, batch, context, dtype, rng)? else {
                    continue;
                };
                filled = (r, tables(batch, context, true, rng));
                (&filled.0, &filled.1)
            };
            let built = self.build(&r.cache, &pair)?;
            if built.len() != 2 {
                continue;
            }
            let rows: Vec<_> = built
                .iter()
                .map(|(v, a)| {
                    let what = format!("{batch}x{context} {} {}", v.label(), dtype.name());
                    (what, a, t, Split::Auto, String::new())
                })
                .collect();
            let times = self.decode_rows("dtype", r, kv_bytes(batch, context, dtype), &rows)?;
            match &f16_ms {
                None if dtype == KvDtype::F16 => f16_ms = Some(times),
                Some(f) => {
                    let n = self.rows.len();
                    for (i, (ms, f)) in times.iter().zip(f).enumerate() {
                        self.rows[n - 2 + i].note = format!("time / f16 {:.2}", ms / f);
                    }
                }
                None => {}
            }
        }
        Ok(())
    }

    /// Paged (shuffled tables) against contiguous, on the winner, every
    /// kept cell.
    fn paging(
        &mut self,
        kept: &[KeptCell],
        win: Variant,
        rng: &mut SplitMix64,
    ) -> Result<(), BenchError> {
        let gpu = self.gpu;
        for cell in kept {
            let (batch, context, r, shuffled) = (cell.batch, cell.context, &cell.rig, &cell.tables);
            self.say(&format!("paging at batch {batch} context {context}"));
            let identity = tables(batch, context, false, rng);
            let paged = PagedAttention::new(gpu, &r.cache, HEADS, &win.config())?;
            let contiguous =
                PagedAttention::new(gpu, &r.cache, HEADS, &(win.config()).contiguous())?;
            let what = |k: &str| format!("{} {batch}x{context} {k}", win.label());
            let rows = [
                (
                    what("paged, shuffled"),
                    &paged,
                    shuffled,
                    Split::Auto,
                    String::new(),
                ),
                (
                    what("contiguous"),
                    &contiguous,
                    &identity,
                    Split::Auto,
                    String::new(),
                ),
            ];
            let bytes = kv_bytes(batch, context, KvDtype::F16);
            let times = self.decode_rows("paging", r, bytes, &rows)?;
            let n = self.rows.len();
            self.rows[n - 2].note = format!("paged / contiguous {:.3}", times[0] / times[1]);
        }
        Ok(())
    }
}

/// The table.
pub fn render(r: &SweepReport) -> String {
    let mut out = format!(
        "sweep on {}\ncompute units: {}; rated bandwidth: {}; read ceiling measured: {:.1} GB/s\n\
         (ms per run: median of submits of {} runs back to back where a run takes 5 ms or less; block {BLOCK}, {HEADS} q / {KV_HEADS} kv heads, head_dim {HEAD_DIM})\n",
        r.adapter,
        r.compute_units.as_deref().unwrap_or("unknown"),
        r.rated_gbs.map_or("unknown".into(), |g| format!("{g:.0} GB/s")),
        r.read_ceiling_gbs,
        timer::per_submit(0.0),
    );
    out += &format!(
        "{:<8} {:<64} {:>10} {:>9} {:>7} {:>7} {:>6}  {}\n",
        "step", "what", "ms", "GB/s", "%ceil", "%rated", "SM MHz", "note"
    );
    let pct = |x: Option<f64>| x.map_or("-".into(), |v| format!("{:.1}", 100.0 * v));
    for row in &r.rows {
        out += &format!(
            "{:<8} {:<64} {:>10.4} {:>9.1} {:>7} {:>7} {:>6}  {}\n",
            row.step,
            row.what,
            row.ms,
            row.gbs,
            pct(row.of_ceiling),
            pct(row.of_rated),
            row.sm_mhz.map_or("-".into(), |m| m.to_string()),
            row.note
        );
    }
    out
}

/// The rows as CSV (header first).
pub fn csv(r: &SweepReport) -> String {
    let mut out = String::from("step,what,ms,gbs,of_ceiling,of_rated,sm_mhz,note\n");
    let opt = |x: Option<f64>| x.map_or(String::new(), |v| format!("{v:.4}"));
    for row in &r.rows {
        out += &format!(
            "{},\"{}\",{:.6},{:.2},{},{},{},\"{}\"\n",
            row.step,
            row.what,
            row.ms,
            row.gbs,
            opt(row.of_ceiling),
            opt(row.of_rated),
            row.sm_mhz.map_or(String::new(), |m| m.to_string()),
            row.note
        );
    }
    out
}
