//! The `pagedattn` command line: the demo (default), the simulator and the benchmark.
//!
//! Arguments are parsed and checked in `cli` (shared with the fuzz target)
//! before any adapter is opened. Every error is one `error: ...` line on
//! stderr: exit code 2 for bad arguments, 1 for a failure while running.
//! A closed stdout (`pagedattn demo | head -2`) ends the run quietly with
//! exit code 0.

use std::error::Error;
use std::io::{self, Write};

use pagedattn_cli::args::{self as cli, Checked, Parsed};
use pagedattn_cli::demo::{self, Demo, DemoConfig};

/// The demo stops with an error after this many steps (every step makes
/// progress or the demo reports that it is stuck, so this is a backstop).
const DEMO_MAX_STEPS: u64 = 1_000_000;

type Res = Result<(), Box<dyn Error>>;

fn run_bench(
    out: &mut dyn Write,
    cfg: &pagedattn_cli::bench::BenchConfig,
    source: &pagedattn_cli::model::load::ModelSource,
    json: bool,
) -> Res {
    let model = if cfg.runs("model") {
        let backends = pagedattn_cli::env::backends()?;
        let b = pagedattn_cli::model::bench::run(source, cfg.quick, backends)?;
        if !json {
            write!(out, "{}", pagedattn_cli::model::bench::render(&b))?;
        }
        Some(b)
    } else {
        None
    };
    if !cfg.runs_library() {
        if json {
            writeln!(
                out,
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({ "model": model }))?
            )?;
        }
        return Ok(());
    }
    let gpu = pagedattn_cli::env::gpu()?;
    let report = pagedattn_cli::bench::run(&gpu, cfg)?;
    #[cfg(feature = "cuda")]
    let cuda = cuda_bench(cfg.quick)?;
    #[cfg(not(feature = "cuda"))]
    let cuda: Option<serde_json::Value> = None;
    if json {
        let mut v = serde_json::to_value(&report)?;
        v["cuda"] = serde_json::to_value(&cuda)?;
        v["model"] = serde_json::to_value(&model)?;
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        write!(out, "{}", pagedattn_cli::bench::render(&report))?;
        #[cfg(feature = "cuda")]
        if let Some(c) = &cuda {
            writeln!(out, "{}", c.summary())?;
        }
    }
    Ok(())
}

/// `pagedattn loadgen`: one load against a server (given, or started
/// here), a sweep of policies and rates, or the quick proof CI runs.
async fn run_loadgen(
    out: &mut dyn Write,
    a: cli::LoadgenArgs,
    spec: pagedattn_cli::loadgen::LoadSpec,
    server: pagedattn_cli::server::ServeConfig,
    policies: Vec<pagedattn::blocks::Reservation>,
) -> Res {
    use pagedattn_cli::loadgen::{self, Arrivals, SweepConfig, Target};
    let mut progress = |l: &str| eprintln!("loadgen: {l}");
    if a.sweep || a.quick {
        let (load, rates) = if a.quick {
            // Each policy's server serves a few short requests: the
            // policies and the metrics work; nothing is timed.
            let load = pagedattn_cli::loadgen::LoadSpec {
                requests: 6,
                scale: 8.0,
                ..spec
            };
            (load, vec![a.start_rate])
        } else {
            (spec, a.rates.clone())
        };
        let external = a
            .llama_cpp
            .iter()
            .map(|b| {
                let t = Target {
                    base: b.trim_end_matches('/').to_string(),
                    model: server.model_name(),
                    api_key: a.api_key.clone(),
                    scrape: false,
                };
                ("llama.cpp".to_string(), t)
            })
            .collect();
        let start = rates.iter().position(|&r| r == a.start_rate).unwrap_or(0);
        let cfg = SweepConfig {
            server,
            policies,
            external,
            start,
            min_requests: load.requests,
            rates,
            load,
            point_seconds: a.point_seconds,
            full: a.full,
        };
        let r = loadgen::sweep(&cfg, &mut progress).await?;
        if a.quick {
            for c in &r.curves {
                let p = &c.points[0].1;
                if p.completed != p.requests || p.peaks.is_none_or(|k| k.blocks_used == 0.0) {
                    return Err(format!("loadgen --quick: the {} server: {p:?}", c.server).into());
                }
            }
        }
        if a.json {
            writeln!(out, "{}", serde_json::to_string_pretty(&r)?)?;
        } else {
            write!(out, "{}", loadgen::render_sweep(&r))?;
        }
        return Ok(());
    }
    // One load, against the given server or one started here.
    let mut handle = None;
    let target = match &a.base {
        Some(b) => Target {
            base: b.trim_end_matches('/').to_string(),
            model: String::new(),
            api_key: a.api_key.clone(),
            scrape: true,
        },
        None => {
            let name = server.model_name();
            let h =
                tokio::task::spawn_blocking(move || pagedattn_cli::server::Handle::start(server))
                    .await??;
            let t = Target {
                base: format!("http://{}", h.addr),
                model: name,
                api_key: None,
                scrape: true,
            };
            handle = Some(h);
            t
        }
    };
    let mut target = target;
    if target.model.is_empty() {
        target.model = models(&target).await.unwrap_or_default();
    }
    progress(&format!(
        "{} requests, {} to {}",
        spec.requests,
        match spec.arrivals {
            Arrivals::Poisson(r) => format!("Poisson at {r} req/s"),
            Arrivals::Closed(n) => format!("{n} clients in a closed loop"),
        },
        target.base
    ));
    let r = loadgen::run(&target, &spec).await;
    if let Some(h) = handle {
        let _ = tokio::task::spawn_blocking(move || h.stop()).await;
    }
    if a.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&r)?)?;
    } else {
        write!(out, "{}", loadgen::render(&r))?;
    }
    if r.completed == 0 {
        return Err("no request completed".into());
    }
    Ok(())
}

/// The first model a server lists.
async fn models(t: &pagedattn_cli::loadgen::Target) -> Option<String> {
    let v: serde_json::Value = reqwest::get(format!("{}/v1/models", t.base))
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    v["data"][0]["id"].as_str().map(String::from)
}

/// `pagedattn pipeline-stats`: the decode kernels the default adapter
/// builds for the bench's grid shape (f16, 32 q / 8 kv heads, head_dim 128),
/// with the stream kernel at each step, compiled on a Vulkan device of
/// their own with the statistics extension.
#[cfg(any(target_os = "linux", target_os = "windows"))]
fn run_stats(out: &mut dyn Write, json: bool) -> Res {
    use pagedattn::gpu::{AttentionConfig, KvCache, KvDtype, PagedAttention};
    use pagedattn_cli::bench::{grid_config, stats, HEADS};
    let gpu = pagedattn_cli::env::gpu()?;
    let cache = KvCache::new(&gpu, grid_config(1, 1, KvDtype::F16))?;
    let mut configs: Vec<AttentionConfig> = PagedAttention::eligible_kernels(&gpu, &cache, HEADS)
        .into_iter()
        .map(|k| AttentionConfig::new().kernel(k))
        .collect();
    for (u, wg) in [(1, 128), (2, 128), (4, 64), (4, 256)] {
        configs.push(
            AttentionConfig::new()
                .kernel(pagedattn::gpu::Kernel::Stream)
                .stream_step(u, wg),
        );
    }
    let mut kernels = Vec::new();
    for c in &configs {
        if let Ok(a) = PagedAttention::new(&gpu, &cache, HEADS, c) {
            kernels.push(a.decode_shader());
        }
    }
    let report = stats::run(&kernels)?;
    if json {
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        write!(out, "{}", stats::render(&report))?;
    }
    Ok(())
}

#[cfg(not(any(target_os = "linux", target_os = "windows")))]
fn run_stats(_out: &mut dyn Write, _json: bool) -> Res {
    Err("pipeline-stats needs Vulkan through ash (Linux or Windows)".into())
}

/// The CUDA twin of the decode bench, when the feature is on and a driver is there.
#[cfg(feature = "cuda")]
fn cuda_bench(quick: bool) -> Result<Option<pagedattn::cuda::DecodeTiming>, Box<dyn Error>> {
    use pagedattn::cuda::{bench_decode, Cuda, DecodeBench};
    match Cuda::new(0) {
        Ok(c) => {
            let b = if quick {
                DecodeBench::quick()
            } else {
                DecodeBench::default()
            };
            Ok(Some(bench_decode(&c, &b)?))
        }
        Err(e) if e.is_unavailable() => {
            let _ = writeln!(io::stderr(), "cuda: {e} (skipped)");
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

fn run_demo(out: &mut dyn Write, cfg: DemoConfig, verbose: bool) -> Res {
    let gpu = pagedattn_cli::env::gpu()?;
    write_demo_header(out, &gpu, &cfg)?;
    let mut d = tuned_demo(out, &gpu, &cfg)?;
    writeln!(out, "step  seqs  +req  fork  done  written  copied  used  shared  free  stored/logical  max_rel_err  gpu_ms  kv_read/plain  (decode ms, layer 0: cascade/plain)")?;
    let mut t = DemoTotals::default();
    while !d.done() {
        if t.steps >= DEMO_MAX_STEPS {
            return Err(format!("the demo did not finish within {DEMO_MAX_STEPS} steps").into());
        }
        let r = pollster::block_on(d.step(&gpu))?;
        t.add(&r);
        if verbose || r.step % 10 == 0 || r.copied > 0 && r.step < 40 {
            writeln!(
                out,
                "{:>4}  {:>4}  {:>4}  {:>4}  {:>4}  {:>7}  {:>6}  {:>4}  {:>6}  {:>4}  {:>6}/{:<7}  {:>11.2e}  {:>6.2}  {:>6.0}/{:<6.0} KB{}",
                r.step, r.decoded, r.admitted, r.forked, r.finished, r.written, r.copied, r.used, r.shared, r.free,
                r.tokens_stored, r.logical_tokens, r.max_rel_err, r.gpu_ms,
                r.kv_bytes as f64 / 1e3, r.kv_bytes_plain as f64 / 1e3,
                if r.cascade_segments > 0 {
                    format!(" (cascade, {} segments; {:.2}/{:.2} ms)", r.cascade_segments, r.decode_ms, r.decode_ms_plain)
                } else {
                    String::new()
                }
            )?;
        }
    }
    t.times.sort_by(|a, b| a.total_cmp(b));
    let median = t.times.get(t.times.len() / 2).copied().unwrap_or(0.0);
    let tol = demo::tolerance(cfg.dtype);
    t.write_cascade(out)?;
    let (steps, peak_saved) = (t.steps, t.peak_saved);
    writeln!(
        out,
        "done: {steps} steps, {} copy-on-write block copies, peak tokens saved by sharing {peak_saved}, median {median:.2} ms/step",
        d.total_copies,
    )?;
    writeln!(
        out,
        "worst relative L2 error vs f64 reference: {:.3e} (tolerance {tol:.0e})",
        d.worst_err
    )?;
    let st = d.manager().stats();
    writeln!(
        out,
        "pool after: {} free of {} (no leak: {})",
        st.free + st.evictable,
        st.total,
        st.free + st.evictable == st.total
    )?;
    if d.worst_err >= tol || !d.worst_err.is_finite() {
        return Err(format!("error {:.3e} over tolerance {tol:.0e}", d.worst_err).into());
    }
    Ok(())
}

/// The demo's adapter, its limits and the workload.
fn write_demo_header(out: &mut dyn Write, gpu: &pagedattn::gpu::Gpu, cfg: &DemoConfig) -> Res {
    let l = &gpu.limits;
    writeln!(out, "adapter: {}", gpu.describe())?;
    writeln!(
        out,
        "limits: max storage binding {} MiB, max buffer {} MiB, workgroup memory {} KiB",
        l.max_storage_buffer_binding_size >> 20,
        l.max_buffer_size >> 20,
        l.max_compute_workgroup_storage_size >> 10
    )?;
    writeln!(
        out,
        "workload: {} requests x {} samples, {} layers, {} q heads / {} kv heads, head_dim {}, {} KV, pool {} blocks of {} tokens, seed {}",
        cfg.requests,
        cfg.samples,
        cfg.layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        match cfg.dtype {
            pagedattn::gpu::KvDtype::F16 => "packed f16",
            d => d.name(),
        },
        cfg.num_blocks,
        cfg.block_size,
        cfg.seed
    )?;
    Ok(())
}

/// The demo on the tuner's pick: the autotuner times every decode kernel
/// variant for this shape once (about 2 s on lavapipe), and says what it
/// picked.
fn tuned_demo(
    out: &mut dyn Write,
    gpu: &pagedattn::gpu::Gpu,
    cfg: &DemoConfig,
) -> Result<Demo, Box<dyn Error>> {
    let probe = pagedattn::gpu::KvCache::new(
        gpu,
        pagedattn::gpu::KvCacheConfig::new(1, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
            .with_dtype(cfg.dtype),
    )?;
    let tuner = pagedattn_cli::env::tuner();
    let tune = tuner.tune(
        gpu,
        &probe,
        cfg.num_heads,
        std::time::Duration::from_millis(1500),
        false,
    )?;
    drop(probe);
    let attn_cfg = pagedattn_cli::env::attention_config(Some(tune.chosen))?;
    let d = Demo::with_attention(gpu, cfg.clone(), &attn_cfg)?;
    let timed: Vec<String> = tune
        .micros
        .iter()
        .map(|(k, us)| format!("{k} {:.0} us", us))
        .collect();
    writeln!(
        out,
        "decode kernel: {} (tuner picked {}{}{})",
        d.kernel(),
        tune.chosen,
        if tune.cached { ", cached" } else { ": " },
        timed.join(", ")
    )?;
    Ok(d)
}

/// What the demo's steps add up to.
#[derive(Default)]
struct DemoTotals {
    steps: u64,
    /// Each step's GPU time.
    times: Vec<f64>,
    /// K/V bytes decode read per layer, with the cascade where it ran, and
    /// what plain decode would have read; steps that ran the cascade.
    read: u64,
    plain: u64,
    cascade_steps: u64,
    /// Layer 0's decode time in cascade steps: with the cascade, and plain.
    ms_cascade: f64,
    ms_plain: f64,
    /// Steps where `Cascade::Auto` would take it, and layer 0's times there.
    auto_steps: u64,
    auto_cascade: f64,
    auto_plain: f64,
    peak_saved: u32,
}

impl DemoTotals {
    fn add(&mut self, r: &demo::StepReport) {
        self.steps += 1;
        self.times.push(r.gpu_ms);
        self.read += r.kv_bytes;
        self.plain += r.kv_bytes_plain;
        if r.cascade_segments > 0 {
            self.cascade_steps += 1;
            self.ms_cascade += r.decode_ms;
            self.ms_plain += r.decode_ms_plain;
        }
        if r.auto_cascade {
            self.auto_steps += 1;
            self.auto_cascade += r.decode_ms;
            self.auto_plain += r.decode_ms_plain;
        }
        let saved = r.logical_tokens.saturating_sub(r.tokens_stored);
        self.peak_saved = self.peak_saved.max(saved);
    }

    /// The cascade's lines: the bytes it saved, and plain and cascade side
    /// by side, with what `Cascade::Auto` chose.
    fn write_cascade(&self, out: &mut dyn Write) -> Res {
        let DemoTotals {
            steps,
            read,
            plain,
            cascade_steps,
            ms_cascade,
            ms_plain,
            auto_steps,
            auto_cascade,
            auto_plain,
            ..
        } = *self;
        writeln!(
            out,
            "cascade (shared prompts read once), forced on to show it: ran in {cascade_steps} of {steps} steps; decode read {:.2} MB of K/V per layer where plain decode reads {:.2} MB ({:.2}x)",
            read as f64 / 1e6,
            plain as f64 / 1e6,
            read as f64 / plain.max(1) as f64
        )?;
        if cascade_steps == 0 {
            return Ok(());
        }
        writeln!(
            out,
            "  layer 0's decode in those steps, side by side: cascade {ms_cascade:.1} ms, plain {ms_plain:.1} ms (wall clock, submit to readback): {} is faster on this adapter",
            if ms_cascade < ms_plain { "the cascade" } else { "plain decode" }
        )?;
        writeln!(
            out,
            "  Cascade::Auto (the default) takes the cascade in {auto_steps} of those {cascade_steps} steps{}",
            if auto_steps == 0 {
                ": an engine on the defaults runs plain decode here".to_string()
            } else {
                format!(
                    " (there: cascade {auto_cascade:.1} ms, plain {auto_plain:.1} ms{})",
                    if auto_cascade > auto_plain {
                        "; slower in this run, so Auto's cost model misjudged this adapter"
                    } else {
                        ""
                    }
                )
            }
        )?;
        Ok(())
    }
}

/// Whether `e` is a write to a closed pipe (the reader went away).
fn is_broken_pipe(e: &(dyn Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<io::Error>() {
            if io.kind() == io::ErrorKind::BrokenPipe {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

fn run(checked: Checked) -> Res {
    let stdout = io::stdout();
    let mut out = stdout.lock();
    match checked {
        Checked::Demo { cfg, verbose } => run_demo(&mut out, cfg, verbose)?,
        Checked::Simulate { cfg, args } => pagedattn_cli::sim::run_cli_to(&cfg, &args, &mut out)?,
        Checked::Bench { cfg, model, json } => run_bench(&mut out, &cfg, &model, json)?,
        Checked::Sweep { cfg, csv, json } => {
            use pagedattn_cli::bench::sweep;
            let gpu = pagedattn_cli::env::gpu()?;
            let report = sweep::run(&gpu, &cfg)?;
            if let Some(path) = csv {
                std::fs::write(&path, sweep::csv(&report))
                    .map_err(|e| format!("--csv {}: {e}", path.display()))?;
            }
            if json {
                writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
            } else {
                write!(out, "{}", sweep::render(&report))?;
            }
        }
        Checked::PipelineStats { json } => run_stats(&mut out, json)?,
        Checked::Generate { opts } => {
            pagedattn_cli::model::generate::run(&opts, &mut out)?;
        }
        Checked::Serve { cfg } => {
            pagedattn_cli::server::run(cfg)?;
        }
        Checked::Loadgen {
            args,
            spec,
            server,
            policies,
        } => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            rt.block_on(run_loadgen(&mut out, args, spec, server, policies))?;
        }
    }
    out.flush()?;
    Ok(())
}

/// On a machine without a display session, Mesa's Vulkan device-select
/// layer tries to reach a Wayland compositor and prints
/// `error: XDG_RUNTIME_DIR is invalid or not set` twice, which is no
/// error. With no session to choose a device for, the layer is skipped
/// (`NODEVICE_SELECT=1`, Mesa's own switch); a desktop keeps it. Set
/// before any thread exists, so the environment is changed safely.
fn quiet_headless_vulkan() {
    let headless = ["XDG_RUNTIME_DIR", "WAYLAND_DISPLAY", "DISPLAY"]
        .iter()
        .all(|v| std::env::var_os(v).is_none());
    if headless && std::env::var_os("NODEVICE_SELECT").is_none() {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
}

fn main() {
    quiet_headless_vulkan();
    let code = match cli::parse(std::env::args_os()) {
        Parsed::Exit { text, stdout, code } => {
            // Nothing useful to do if printing help fails (a closed pipe).
            if stdout {
                let _ = writeln!(io::stdout(), "{text}");
            } else {
                let _ = writeln!(io::stderr(), "{text}");
            }
            code
        }
        Parsed::Run(c) => match cli::check(c) {
            Err(msg) => {
                let _ = writeln!(io::stderr(), "{}", cli::error_line(&msg));
                cli::EXIT_USAGE
            }
            Ok(checked) => match run(checked) {
                Ok(()) => 0,
                Err(e) if is_broken_pipe(&*e) => 0,
                Err(e) => {
                    let _ = writeln!(io::stderr(), "{}", cli::error_line(&e.to_string()));
                    cli::EXIT_FAILURE
                }
            },
        },
    };
    std::process::exit(code);
}
