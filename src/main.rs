//! The `pagedattn` command line: the demo (default), the simulator and the benchmark.

use clap::{Parser, Subcommand};
use pagedattn::demo::{self, Demo, DemoConfig};
use pagedattn::gpu::Gpu;

#[derive(Parser)]
#[command(name = "pagedattn", version, about = "PagedAttention on any GPU")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// The end-to-end demo (the default): a seeded multi-tenant decode loop
    /// with parallel sampling, every step checked against the f64 reference.
    Demo(DemoArgs),
    /// Multi-tenant paged-KV memory simulator: paged vs contiguous policies.
    Simulate(pagedattn::sim::SimulateArgs),
    /// Decode, bandwidth, split, bookkeeping and copy benchmarks on the adapter.
    Bench(BenchArgs),
}

#[derive(clap::Args, Debug)]
struct BenchArgs {
    /// The small grid (under 30 s on lavapipe).
    #[arg(long)]
    quick: bool,
    /// Print the report as JSON on stdout (fields documented in README.md).
    #[arg(long)]
    json: bool,
    /// Time with the wall clock even where GPU timestamps exist.
    #[arg(long)]
    wall_clock: bool,
    /// Stop measuring new grid cells after this many seconds (they are
    /// listed as skipped). Default: 150, or 25 with --quick.
    #[arg(long)]
    max_seconds: Option<f64>,
}

fn run_bench(a: &BenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    let gpu = Gpu::new()?;
    let cfg = pagedattn::bench::BenchConfig {
        quick: a.quick,
        wall_clock: a.wall_clock,
        progress: true,
        max_seconds: a.max_seconds.unwrap_or(if a.quick { 25.0 } else { 150.0 }),
    };
    let report = pagedattn::bench::run(&gpu, &cfg)?;
    #[cfg(feature = "cuda")]
    let cuda = cuda_bench(a.quick)?;
    #[cfg(not(feature = "cuda"))]
    let cuda: Option<serde_json::Value> = None;
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["cuda"] = serde_json::to_value(&cuda)?;
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", pagedattn::bench::render(&report));
        #[cfg(feature = "cuda")]
        if let Some(c) = &cuda {
            println!("{}", c.summary());
        }
    }
    Ok(())
}

/// The CUDA twin of the decode bench, when the feature is on and a driver is there.
#[cfg(feature = "cuda")]
fn cuda_bench(
    quick: bool,
) -> Result<Option<pagedattn::cuda::DecodeTiming>, Box<dyn std::error::Error>> {
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
            eprintln!("cuda: {e} (skipped)");
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

#[derive(clap::Args, Debug, Default)]
struct DemoArgs {
    /// Seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Requests.
    #[arg(long, default_value_t = 8)]
    requests: u32,
    /// Parallel samples per request.
    #[arg(long, default_value_t = 3)]
    samples: u32,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Blocks in the pool.
    #[arg(long, default_value_t = 256)]
    num_blocks: u32,
    /// Store K/V as f32 instead of packed f16.
    #[arg(long)]
    f32: bool,
    /// Print every step (default: every 10th).
    #[arg(long)]
    verbose: bool,
}

fn run_demo(a: &DemoArgs) -> Result<(), Box<dyn std::error::Error>> {
    let gpu = Gpu::new()?;
    let l = &gpu.limits;
    println!("adapter: {}", gpu.describe());
    println!(
        "limits: max storage binding {} MiB, max buffer {} MiB, workgroup memory {} KiB",
        l.max_storage_buffer_binding_size >> 20,
        l.max_buffer_size >> 20,
        l.max_compute_workgroup_storage_size >> 10
    );
    let cfg = DemoConfig {
        seed: a.seed,
        requests: a.requests,
        samples: a.samples,
        block_size: a.block_size,
        num_blocks: a.num_blocks,
        f16: !a.f32,
        ..DemoConfig::default()
    };
    println!(
        "workload: {} requests x {} samples, {} layers, {} q heads / {} kv heads, head_dim {}, {} KV, pool {} blocks of {} tokens, seed {}",
        cfg.requests,
        cfg.samples,
        cfg.layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        if cfg.f16 { "packed f16" } else { "f32" },
        cfg.num_blocks,
        cfg.block_size,
        cfg.seed
    );
    let mut d = Demo::new(&gpu, cfg.clone())?;
    println!("step  seqs  +req  fork  done  written  copied  used  shared  free  stored/logical  max_rel_err  gpu_ms");
    let mut times = Vec::new();
    let mut peak_saved = 0u32;
    let mut steps = 0;
    while !d.done() {
        let r = pollster::block_on(d.step(&gpu))?;
        times.push(r.gpu_ms);
        peak_saved = peak_saved.max(r.logical_tokens.saturating_sub(r.tokens_stored));
        if a.verbose || r.step % 10 == 0 || r.copied > 0 && r.step < 40 {
            println!(
                "{:>4}  {:>4}  {:>4}  {:>4}  {:>4}  {:>7}  {:>6}  {:>4}  {:>6}  {:>4}  {:>6}/{:<7}  {:>11.2e}  {:>6.2}",
                r.step, r.decoded, r.admitted, r.forked, r.finished, r.written, r.copied, r.used, r.shared, r.free,
                r.tokens_stored, r.logical_tokens, r.max_rel_err, r.gpu_ms
            );
        }
        steps += 1;
        if steps > 100_000 {
            return Err("demo did not finish".into());
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let tol = demo::tolerance(cfg.f16);
    println!(
        "done: {steps} steps, {} copy-on-write block copies, peak tokens saved by sharing {peak_saved}, median {:.2} ms/step",
        d.total_copies,
        times[times.len() / 2]
    );
    println!(
        "worst relative L2 error vs f64 reference: {:.3e} (tolerance {tol:.0e})",
        d.worst_err
    );
    let st = d.manager().stats();
    println!(
        "pool after: {} free of {} (no leak: {})",
        st.free + st.evictable,
        st.total,
        st.free + st.evictable == st.total
    );
    if d.worst_err >= tol || !d.worst_err.is_finite() {
        return Err(format!("error {:.3e} over tolerance {tol:.0e}", d.worst_err).into());
    }
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Simulate(args)) => pagedattn::sim::run_cli(&args),
        Some(Command::Demo(args)) => run_demo(&args),
        Some(Command::Bench(args)) => run_bench(&args),
        None => run_demo(&DemoArgs {
            seed: 7,
            requests: 8,
            samples: 3,
            block_size: 16,
            num_blocks: 256,
            ..Default::default()
        }),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
