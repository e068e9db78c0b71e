//! The `pagedattn` command line: the clap definitions and every check that
//! turns arguments into a validated configuration, before any GPU work or
//! simulation starts.
//!
//! Self-contained (clap and the library only), so that the binary
//! (`src/main.rs`, `mod cli;`) and the argument fuzz target
//! (`fuzz/fuzz_targets/cli_args.rs`, through `cli/tests/fuzz_corpus_cli/cli_args.rs`)
//! parse and check with the very same code.
//!
//! Errors are one line each: [`error_line`] flattens any message, and
//! [`parse`]'s clap errors come back as [`Parsed::Exit`] with that line
//! (help and version go to stdout with exit code 0).

use std::ffi::OsString;

use crate::bench::BenchConfig;
use crate::demo::{DemoConfig, MAX_REQUESTS as DEMO_MAX_REQUESTS, MAX_SAMPLES};
use crate::sim::{SimConfig, SimulateArgs};
use clap::{Parser, Subcommand};

/// Exit code of a usage error: a bad flag or value, or options that fail a check.
pub const EXIT_USAGE: i32 = 2;
/// Exit code of a failure while running (no adapter, a stalled demo, ...).
pub const EXIT_FAILURE: i32 = 1;

#[derive(Parser, Debug)]
#[command(name = "pagedattn", version, about = "PagedAttention on any GPU")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// The end-to-end demo (the default): a seeded multi-tenant decode loop
    /// with parallel sampling, every step checked against the f64 reference.
    Demo(DemoArgs),
    /// Multi-tenant paged-KV memory simulator: paged vs contiguous policies.
    Simulate(SimulateArgs),
    /// Decode, bandwidth, split, bookkeeping and copy benchmarks on the adapter.
    Bench(BenchArgs),
    /// One sweep of the decode questions a real GPU answers (read and copy
    /// ceilings, lanes vs stream and its steps, checked vs trusted shader
    /// modules, splits, KV dtypes, paging), printed as one table.
    Sweep(SweepArgs),
    /// Registers, spills and code size of each decode kernel's pipeline as
    /// the Vulkan driver reports them, checked and trusted.
    PipelineStats(PipelineStatsArgs),
    /// Text from a real model (SmolLM2-135M-Instruct, fetched by
    /// `bash scripts/fetch-model.sh`) through the paged KV cache.
    #[command(after_help = crate::model::defaults::help())]
    Generate(GenerateArgs),
    /// An OpenAI-compatible server (completions, chat, SSE streams,
    /// /metrics) over the real model and the paged KV cache.
    #[command(after_help = crate::model::defaults::help())]
    Serve(ServeArgs),
    /// Load a server as its clients would, and measure it (TTFT, TPOT,
    /// ITL, latency, throughput, normalized latency, goodput); --sweep runs
    /// paging against the reservation baselines over rising request rates.
    Loadgen(LoadgenArgs),
}

#[derive(clap::Args, Debug, Clone)]
pub struct LoadgenArgs {
    /// The server to load (`http://host:port`); default: one started here.
    #[arg(long)]
    pub base: Option<String>,
    /// Its API key, if it asks for one.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests per second, Poisson arrivals (default: closed loop, see
    /// --concurrency).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Closed loop: this many clients, each sending its next request when
    /// its last ends.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Requests to send (in a sweep: at least this many a point).
    #[arg(long, default_value_t = 64)]
    pub requests: usize,
    /// Prompt and output lengths after this dataset's (the vLLM paper's).
    #[arg(long, value_enum, default_value = "sharegpt")]
    pub dataset: crate::sim::Dataset,
    /// Divide the dataset's mean lengths by this, to fit the machine.
    #[arg(long, default_value_t = 4.0)]
    pub scale: f64,
    /// single, parallel:N (n samples) or beam:N.
    #[arg(long, default_value = "single")]
    pub sampling: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sampling temperature of the requests.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// The goodput SLO: normalized latency (latency / output tokens), ms a token.
    #[arg(long, default_value_t = 400.0)]
    pub slo_ms: f64,
    /// The paper's experiment: one server here per --policies, and any
    /// --llama-cpp, offered each --rates in turn.
    #[arg(long)]
    pub sweep: bool,
    /// Memory policies of the sweep's servers.
    #[arg(long, value_delimiter = ',', default_value = "paged,max,pow2,oracle")]
    pub policies: Vec<String>,
    /// Request rates of the sweep, requests per second, rising.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.1,0.15,0.2,0.3,0.45,0.6,0.8,1,1.3"
    )]
    pub rates: Vec<f64>,
    /// The rate each server's search starts at (one of --rates).
    #[arg(long, default_value_t = 0.3)]
    pub start_rate: f64,
    /// Seconds of arrivals at each sweep point (its requests: rate times
    /// this, at least --requests).
    #[arg(long, default_value_t = 60.0)]
    pub point_seconds: f64,
    /// An outside server in the sweep, as llama.cpp's (`http://host:port`).
    #[arg(long)]
    pub llama_cpp: Option<String>,
    /// Every rate for every server, instead of searching.
    #[arg(long)]
    pub full: bool,
    /// The servers started here: GGUF file.
    #[arg(long, conflicts_with = "synthetic")]
    pub model: Option<std::path::PathBuf>,
    /// The servers started here: a synthetic model (see --layers).
    #[command(flatten)]
    pub synthetic: SyntheticArgs,
    /// The servers started here: KV blocks of 16 tokens.
    #[arg(long, default_value_t = 128)]
    pub num_blocks: u32,
    /// The servers started here: sequences a step.
    #[arg(long, default_value_t = 32)]
    pub max_seqs: usize,
    /// The servers started here, and the load: the longest sequence.
    #[arg(long, default_value_t = 512)]
    pub max_model_len: usize,
    /// The servers started here: KV pool element type.
    #[arg(long, default_value = "f16")]
    pub kv_dtype: String,
    /// A few requests through every policy's server, proving the policies
    /// and the metrics work (CI); times nothing.
    #[arg(long)]
    pub quick: bool,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// The GGUF file (default: $PAGEDATTN_MODEL or models/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long, conflicts_with = "synthetic")]
    pub model: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub synthetic: SyntheticArgs,
    /// The name clients pass as `model` (default: the file's stem, or
    /// synthetic-ARCH).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Address to listen on (loopback unless --api-keys or --allow-unauthenticated).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Port (0: any free one).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// KV pool element type: f16, f32, bf16, int8 or fp8.
    #[arg(long, default_value = "f16")]
    pub kv_dtype: String,
    /// Blocks of 16 tokens in the KV pool.
    #[arg(long, default_value_t = 1024)]
    pub num_blocks: u32,
    /// Sequences in one step (1 to 256).
    #[arg(long, default_value_t = 32)]
    pub max_seqs: usize,
    /// Tokens in one step, the prefill chunk (at least --max-seqs, at most 8192).
    #[arg(long, default_value_t = 256)]
    pub max_batch_tokens: usize,
    /// Requests held beyond --max-seqs before new ones get 429.
    #[arg(long, default_value_t = 1024)]
    pub max_queue: usize,
    /// The longest sequence served, prompt and output (default: the
    /// model's context); what --reservation max reserves.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// The largest request body, in bytes (413 past it).
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// A file of `KEY TENANT` lines: bearer keys, each tenant with its own
    /// prefix-cache namespace. Without it: one tenant, no key.
    #[arg(long)]
    pub api_keys: Option<std::path::PathBuf>,
    /// Listen on a non-loopback address without --api-keys.
    #[arg(long)]
    pub allow_unauthenticated: bool,
    /// What a request holds of the pool: paged, or the paper's baselines
    /// max, pow2, oracle (a slab reserved at admission).
    #[arg(long, default_value = "paged")]
    pub reservation: String,
    /// Preemption: recompute, swap or auto.
    #[arg(long, default_value = "auto")]
    pub preemption: String,
    /// Host swap blocks (0: preemption recomputes).
    #[arg(long, default_value_t = 1024)]
    pub swap_blocks: u32,
    /// Turn the prefix cache off.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Seconds requests in flight may take to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// Seconds between SSE keep-alive comments while a stream waits.
    #[arg(long, default_value_t = 5)]
    pub keep_alive: u64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// The `max_tokens` of requests that omit it, on both routes
    /// (default: 256 for chat, bounded by the context; OpenAI's 16 for
    /// completions).
    #[arg(long)]
    pub max_tokens: Option<usize>,
}

#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    /// The user message (wrapped in the model's chat template).
    #[arg(long, default_value = "Tell me a story")]
    pub prompt: String,
    /// Serve every line of this file as a prompt, all at once (continuous batching).
    #[arg(long)]
    pub prompts: Option<std::path::PathBuf>,
    /// Tokens to generate per sequence (1 to 8192; default: the model's,
    /// see below).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Parallel samples sharing the prompt (1 to 32).
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    /// Beam search of this width (1 to 32) instead of sampling.
    #[arg(long)]
    pub beams: Option<usize>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Logit biases, `TOKEN:BIAS` pairs separated by commas (BIAS in
    /// -100..=100; -100 bans the token, +100 leaves only such tokens).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
    pub logit_bias: Vec<String>,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The GGUF file (default: $PAGEDATTN_MODEL or models/SmolLM2-135M-Instruct.Q4_1.gguf).
    #[arg(long, conflicts_with = "synthetic")]
    pub model: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub synthetic: SyntheticArgs,
    /// KV pool element type: f16, f32, int8 or fp8.
    #[arg(long, default_value = "f16")]
    pub kv_dtype: String,
    /// Blocks of 16 tokens in the pool (16 to 65536).
    #[arg(long, default_value_t = 512)]
    pub num_blocks: u32,
    /// Send the prompt as it is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// The chat template's system prompt (default: the model's own).
    #[arg(long)]
    pub system: Option<String>,
}

/// The sampling flags `generate` and `serve` share: for `generate`, its
/// request's values; for `serve`, the defaults of requests that omit them.
/// Left out, each takes the model's default (listed in `--help`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SamplingArgs {
    /// Sampling temperature (0 = greedy, up to 100).
    #[arg(long, allow_hyphen_values = true)]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep this share of the probability mass (0 < p <= 1).
    #[arg(long, allow_hyphen_values = true)]
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens (0 = all).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Keep the tokens at least this share as likely as the most likely (0 = all, up to 1).
    #[arg(long, allow_hyphen_values = true)]
    pub min_p: Option<f32>,
    /// Divide a seen token's positive logit by this, multiply a negative one (1 = none, up to 100).
    #[arg(long, allow_hyphen_values = true)]
    pub repetition_penalty: Option<f32>,
}

impl SamplingArgs {
    fn overrides(&self, max_tokens: Option<usize>) -> crate::model::defaults::GenerationOverrides {
        crate::model::defaults::GenerationOverrides {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            max_tokens,
        }
    }
}

/// `--logit-bias` pairs `TOKEN:BIAS`.
fn parse_logit_bias(pairs: &[String]) -> Result<Vec<(u32, f32)>, String> {
    pairs
        .iter()
        .map(|p| {
            let (t, b) = p
                .split_once(':')
                .ok_or_else(|| format!("--logit-bias {p:?}: expected TOKEN:BIAS"))?;
            let t: u32 = t
                .trim()
                .parse()
                .map_err(|_| format!("--logit-bias {p:?}: {t:?} is not a token id"))?;
            let b: f32 = b
                .trim()
                .parse()
                .map_err(|_| format!("--logit-bias {p:?}: {b:?} is not a number"))?;
            Ok((t, b))
        })
        .collect()
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// The small grid (about a minute on lavapipe).
    #[arg(long)]
    pub quick: bool,
    /// Print the report as JSON on stdout (fields documented in README.md).
    #[arg(long)]
    pub json: bool,
    /// Time with the wall clock even where GPU timestamps exist.
    #[arg(long)]
    pub wall_clock: bool,
    /// Stop measuring new grid cells after this many seconds (they are
    /// listed as skipped); finite and not negative. Default: 150, or 60
    /// with --quick.
    #[arg(long, allow_hyphen_values = true)]
    pub max_seconds: Option<f64>,
    /// Run only these sections (comma-separated): decode, dtypes, cascade,
    /// split, host, copy, swap, transfer, mla, model.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// The model section's model (with --only model).
    #[command(flatten)]
    pub synthetic: SyntheticArgs,
}

/// A synthetic model instead of the GGUF file, for the commands that run
/// one (`bench --only model`, `serve`, `loadgen`, `generate`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SyntheticArgs {
    /// A synthetic model of this shape instead of a GGUF file: the real
    /// file's tensors and formats, weights from a seed, built in memory
    /// (smollm2-135m, gemma3-270m, llama3-8b, qwen3-8b).
    #[arg(long, value_name = "ARCH")]
    pub synthetic: Option<crate::model::synthetic::SyntheticArch>,
    /// With --synthetic: only the model's first N layers (1 to its layer
    /// count), to fit a small machine.
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
}

impl SyntheticArgs {
    /// The synthetic model asked for, its --layers checked.
    pub fn resolve(&self) -> Result<Option<crate::model::synthetic::Synthetic>, String> {
        use crate::model::synthetic::Synthetic;
        let Some(arch) = self.synthetic else {
            return match self.layers {
                Some(n) => Err(format!(
                    "--layers {n} cuts a synthetic model: give --synthetic ARCH too"
                )),
                None => Ok(None),
            };
        };
        let s = Synthetic::new(arch);
        match self.layers {
            Some(n) => s.with_layers(n).map(Some),
            None => Ok(Some(s)),
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct SweepArgs {
    /// Small cells and a few variants (minutes on a software adapter).
    #[arg(long)]
    pub small: bool,
    /// Also write the rows as CSV to this file.
    #[arg(long)]
    pub csv: Option<std::path::PathBuf>,
    /// Print the report as JSON on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct PipelineStatsArgs {
    /// Print the report as JSON on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Seed.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Requests (1 to 10000).
    #[arg(long, default_value_t = 8)]
    pub requests: u32,
    /// Parallel samples per request (1 to 64).
    #[arg(long, default_value_t = 3)]
    pub samples: u32,
    /// Tokens per block (a power of two up to 256).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Blocks in the pool (enough to admit the longest prompt, 120 tokens,
    /// plus 2 per sample; at most 524288 token slots in all).
    #[arg(long, default_value_t = 256)]
    pub num_blocks: u32,
    /// Store K/V as f32 instead of packed f16 (the same as --kv-dtype f32).
    #[arg(long)]
    pub f32: bool,
    /// Element type of the KV pool: f32, f16 (packed), int8 or fp8 (E4M3).
    #[arg(long, default_value = "f16")]
    pub kv_dtype: String,
    /// Print every step (default: every 10th).
    #[arg(long)]
    pub verbose: bool,
}

impl Default for DemoArgs {
    /// The command line's defaults (clap's are the one source of truth).
    fn default() -> Self {
        #[derive(Parser)]
        struct DefaultsOnly {
            #[command(flatten)]
            args: DemoArgs,
        }
        DefaultsOnly::parse_from(["demo"]).args
    }
}

/// What the command line asked for, checked and ready to run.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per run
pub enum Checked {
    /// The demo (also when no subcommand is given).
    Demo {
        /// Validated settings.
        cfg: DemoConfig,
        /// Print every step.
        verbose: bool,
    },
    /// The simulator.
    Simulate {
        /// Validated configuration.
        cfg: SimConfig,
        /// The options as given (output format, plot file).
        args: SimulateArgs,
    },
    /// The benchmark.
    Bench {
        /// Validated settings.
        cfg: BenchConfig,
        /// The model section's model: the file, or a synthetic one.
        model: crate::model::load::ModelSource,
        /// Print JSON instead of the table.
        json: bool,
    },
    /// The decode sweep.
    Sweep {
        /// What to sweep.
        cfg: crate::bench::sweep::SweepConfig,
        /// Where the CSV goes, if anywhere.
        csv: Option<std::path::PathBuf>,
        /// Print JSON instead of the table.
        json: bool,
    },
    /// Pipeline statistics.
    PipelineStats {
        /// Print JSON instead of the table.
        json: bool,
    },
    /// Text generation.
    Generate {
        /// Validated options (the prompts file read).
        opts: crate::model::generate::GenerateOptions,
    },
    /// The server.
    Serve {
        /// Validated configuration (the key file read).
        cfg: crate::server::ServeConfig,
    },
    /// The load generator.
    Loadgen {
        /// Validated arguments.
        args: LoadgenArgs,
        /// The load.
        spec: crate::loadgen::LoadSpec,
        /// The servers it starts.
        server: crate::server::ServeConfig,
        /// Their policies, for a sweep.
        policies: Vec<pagedattn::blocks::Reservation>,
    },
}

/// The outcome of parsing an argv.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per run
pub enum Parsed {
    /// Arguments to check and run.
    Run(Cli),
    /// Nothing to run: print `text` (on stdout if `stdout`, else it is one
    /// `error: ...` line for stderr) and exit with `code`.
    Exit {
        /// What to print, without a trailing newline.
        text: String,
        /// Whether it goes to stdout (help, version).
        stdout: bool,
        /// Exit code.
        code: i32,
    },
}

/// Parses an argv (program name first). Help and version are not errors:
/// they come back as [`Parsed::Exit`] with code 0 and the text for stdout.
/// Usage errors come back as one `error: ...` line with [`EXIT_USAGE`].
pub fn parse<I, T>(argv: I) -> Parsed
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match Cli::try_parse_from(argv) {
        Ok(c) => Parsed::Run(c),
        Err(e) => {
            use clap::error::ErrorKind;
            match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => Parsed::Exit {
                    text: e.render().to_string().trim_end().to_string(),
                    stdout: true,
                    code: 0,
                },
                // Help in place of an error (no subcommand given to a
                // command that needs one): not one line, so say it briefly.
                ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => Parsed::Exit {
                    text: error_line("missing arguments (see --help)"),
                    stdout: false,
                    code: EXIT_USAGE,
                },
                _ => Parsed::Exit {
                    text: clap_error_line(&e),
                    stdout: false,
                    code: EXIT_USAGE,
                },
            }
        }
    }
}

/// A clap error as one `error: ...` line: clap's first line (which names
/// the flag and the bad value), plus a pointer to `--help`.
fn clap_error_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let first = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("invalid arguments");
    let msg = first.strip_prefix("error:").unwrap_or(first).trim();
    error_line(&format!("{msg} (see --help)"))
}

/// `error: ` and the message on one line: line breaks and control
/// characters become spaces, runs of whitespace one space.
pub fn error_line(msg: &str) -> String {
    let flat: String = msg
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let words: Vec<&str> = flat.split_whitespace().collect();
    format!("error: {}", words.join(" "))
}

/// Checks the parsed options and builds the configuration to run, without
/// touching an adapter. The message names the flag or the value and the
/// limit it breaks.
pub fn check(cli: Cli) -> Result<Checked, String> {
    match cli.command {
        None => demo(&DemoArgs::default()),
        Some(Command::Demo(a)) => demo(&a),
        Some(Command::Simulate(a)) => {
            let cfg = SimConfig::from_args(&a).map_err(|e| e.to_string())?;
            Ok(Checked::Simulate { cfg, args: a })
        }
        Some(Command::Bench(a)) => {
            let cfg = BenchConfig {
                quick: a.quick,
                wall_clock: a.wall_clock,
                progress: true,
                max_seconds: a.max_seconds.unwrap_or(if a.quick { 60.0 } else { 150.0 }),
                only: a.only.clone(),
            };
            if let Some(s) = a.max_seconds {
                if !(s.is_finite() && s >= 0.0) {
                    return Err(format!(
                        "--max-seconds {s} is not a finite number of seconds, at least 0"
                    ));
                }
            }
            cfg.validate().map_err(|e| e.to_string())?;
            let synthetic = a.synthetic.resolve()?;
            if synthetic.is_some() && !cfg.runs("model") {
                return Err("--synthetic is the model section's model: add --only model".into());
            }
            let model = crate::model::load::ModelSource::new(crate::env::model_path(), synthetic);
            Ok(Checked::Bench {
                cfg,
                model,
                json: a.json,
            })
        }
        Some(Command::Sweep(a)) => Ok(Checked::Sweep {
            cfg: crate::bench::sweep::SweepConfig {
                small: a.small,
                progress: true,
            },
            csv: a.csv,
            json: a.json,
        }),
        Some(Command::PipelineStats(a)) => Ok(Checked::PipelineStats { json: a.json }),
        Some(Command::Generate(a)) => generate(&a),
        Some(Command::Serve(a)) => serve(&a),
        Some(Command::Loadgen(a)) => loadgen(a),
    }
}

fn loadgen(a: LoadgenArgs) -> Result<Checked, String> {
    use crate::loadgen::{Arrivals, LoadSpec};
    use crate::server::ServeConfig;
    use pagedattn::blocks::Reservation;
    let sampling: crate::sim::Sampling = a.sampling.parse()?;
    if !(1..=100_000).contains(&a.requests) {
        return Err(format!("--requests {} outside 1..=100000", a.requests));
    }
    if !(1..=10_000).contains(&a.concurrency) {
        return Err(format!("--concurrency {} outside 1..=10000", a.concurrency));
    }
    let rate_ok = |r: f64| r.is_finite() && r > 0.0 && r <= 10_000.0;
    if let Some(r) = a.rate.filter(|&r| !rate_ok(r)) {
        return Err(format!(
            "--rate {r} is not in (0, 10000] requests per second"
        ));
    }
    if let Some(r) = a.rates.iter().find(|&&r| !rate_ok(r)) {
        return Err(format!(
            "--rates: {r} is not in (0, 10000] requests per second"
        ));
    }
    if a.rates.windows(2).any(|w| w[1] <= w[0]) {
        return Err("--rates must rise".into());
    }
    if !a.rates.contains(&a.start_rate) {
        return Err(format!(
            "--start-rate {} is not one of --rates",
            a.start_rate
        ));
    }
    if !(a.point_seconds.is_finite() && (1.0..=3600.0).contains(&a.point_seconds)) {
        return Err(format!(
            "--point-seconds {} outside 1..=3600",
            a.point_seconds
        ));
    }
    if !(a.scale.is_finite() && (0.01..=1000.0).contains(&a.scale)) {
        return Err(format!("--scale {} outside 0.01..=1000", a.scale));
    }
    if !(a.slo_ms.is_finite() && a.slo_ms > 0.0) {
        return Err(format!("--slo-ms {} is not a positive number", a.slo_ms));
    }
    if !(2..=8192).contains(&a.max_model_len) {
        return Err(format!(
            "--max-model-len {} outside 2..=8192",
            a.max_model_len
        ));
    }
    let policies = a
        .policies
        .iter()
        .map(|p| {
            Reservation::from_name(p)
                .ok_or_else(|| format!("--policies: {p:?} is not paged, max, pow2 or oracle"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(b) = a
        .base
        .iter()
        .chain(&a.llama_cpp)
        .find(|b| !b.starts_with("http://"))
    {
        return Err(format!("{b:?} is not an http:// address"));
    }
    let spec = LoadSpec {
        dataset: a.dataset,
        scale: a.scale,
        max_len: a.max_model_len,
        requests: a.requests,
        arrivals: match a.rate {
            Some(r) => Arrivals::Poisson(r),
            None => Arrivals::Closed(a.concurrency),
        },
        sampling,
        seed: a.seed,
        slo: a.slo_ms / 1e3,
        temperature: a.temperature,
    };
    let synthetic = a.synthetic.resolve()?;
    if synthetic.is_some() && a.base.is_some() {
        return Err("--synthetic is the model of the servers started here; --base names one already running".into());
    }
    let server = ServeConfig {
        model: a.model.clone().unwrap_or_else(crate::env::model_path),
        synthetic,
        backends: crate::env::backends().map_err(|e| e.to_string())?,
        port: 0,
        kv_dtype: crate::demo::parse_kv_dtype(&a.kv_dtype)?,
        num_blocks: a.num_blocks,
        max_seqs: a.max_seqs,
        max_batch_tokens: 256.max(a.max_seqs),
        max_model_len: Some(a.max_model_len),
        max_queue: 100_000,
        ..ServeConfig::default()
    };
    server.check().map_err(|e| e.to_string())?;
    Ok(Checked::Loadgen {
        args: a,
        spec,
        server,
        policies,
    })
}

fn serve(a: &ServeArgs) -> Result<Checked, String> {
    use crate::server::{ApiKeys, ServeConfig};
    use pagedattn::blocks::{Preemption, Reservation};
    let reservation = Reservation::from_name(&a.reservation).ok_or_else(|| {
        format!(
            "--reservation {:?}: expected paged, max, pow2 or oracle",
            a.reservation
        )
    })?;
    let preemption = match a.preemption.as_str() {
        "recompute" => Preemption::Recompute,
        "swap" => Preemption::Swap,
        "auto" => Preemption::Auto,
        other => {
            return Err(format!(
                "--preemption {other:?}: expected recompute, swap or auto"
            ))
        }
    };
    if !(1..=3600).contains(&a.shutdown_timeout) || !(1..=3600).contains(&a.keep_alive) {
        return Err(format!(
            "--shutdown-timeout {} and --keep-alive {} must be in 1..=3600 seconds",
            a.shutdown_timeout, a.keep_alive
        ));
    }
    let api_keys = match &a.api_keys {
        Some(p) => Some(ApiKeys::load(p).map_err(|e| e.to_string())?),
        None => None,
    };
    let cfg = ServeConfig {
        model: a.model.clone().unwrap_or_else(crate::env::model_path),
        synthetic: a.synthetic.resolve()?,
        backends: crate::env::backends().map_err(|e| e.to_string())?,
        served_model_name: a.served_model_name.clone(),
        host: a.host,
        port: a.port,
        kv_dtype: crate::demo::parse_kv_dtype(&a.kv_dtype)?,
        num_blocks: a.num_blocks,
        max_seqs: a.max_seqs,
        max_batch_tokens: a.max_batch_tokens,
        max_model_len: a.max_model_len,
        max_queue: a.max_queue,
        max_body_bytes: a.max_body_bytes,
        api_keys,
        allow_unauthenticated: a.allow_unauthenticated,
        reservation,
        preemption,
        swap_blocks: a.swap_blocks,
        prefix_caching: !a.no_prefix_caching,
        shutdown_timeout: std::time::Duration::from_secs(a.shutdown_timeout),
        keep_alive: std::time::Duration::from_secs(a.keep_alive),
        generation: a.sampling.overrides(a.max_tokens),
    };
    cfg.check().map_err(|e| e.to_string())?;
    Ok(Checked::Serve { cfg })
}

/// Most prompts one `--prompts` file may hold.
pub const MAX_PROMPTS: usize = 1024;

fn generate(a: &GenerateArgs) -> Result<Checked, String> {
    use crate::model::generate::GenerateOptions;
    if !(1..=32).contains(&a.samples) {
        return Err(format!("--samples {} is not in 1..=32", a.samples));
    }
    if let Some(b) = a.beams {
        if !(1..=32).contains(&b) {
            return Err(format!("--beams {b} is not in 1..=32"));
        }
        if a.samples > 1 {
            return Err("--beams and --samples: choose one".into());
        }
    }
    if !(16..=65536).contains(&a.num_blocks) {
        return Err(format!(
            "--num-blocks {} is not in 16..=65536",
            a.num_blocks
        ));
    }
    let kv_dtype = crate::demo::parse_kv_dtype(&a.kv_dtype)?;
    if let Some(n) = a.max_tokens.filter(|n| !(1..=8192).contains(n)) {
        return Err(format!("--max-tokens {n} is not in 1..=8192"));
    }
    let sampling = a.sampling.overrides(a.max_tokens);
    let logit_bias = parse_logit_bias(&a.logit_bias)?;
    let prompts = match &a.prompts {
        None => vec![a.prompt.clone()],
        Some(path) => {
            let meta = std::fs::metadata(path)
                .map_err(|e| format!("--prompts {}: {e}", path.display()))?;
            if !meta.is_file() || meta.len() > 1 << 20 {
                return Err(format!(
                    "--prompts {}: not a regular file of at most 1 MiB",
                    path.display()
                ));
            }
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("--prompts {}: {e}", path.display()))?;
            let p: Vec<String> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(String::from)
                .collect();
            if p.is_empty() || p.len() > MAX_PROMPTS {
                return Err(format!(
                    "--prompts {}: {} prompts, expected 1..={MAX_PROMPTS}",
                    path.display(),
                    p.len()
                ));
            }
            p
        }
    };
    if prompts.iter().any(|p| p.is_empty()) {
        return Err("--prompt is empty".into());
    }
    let opts = GenerateOptions {
        prompts,
        chat: !a.raw,
        system: a.system.clone(),
        samples: a.samples,
        beams: a.beams.unwrap_or(0),
        sampling,
        seed: a.seed,
        logit_bias,
        model: a.model.clone().unwrap_or_else(crate::env::model_path),
        synthetic: a.synthetic.resolve()?,
        backends: crate::env::backends().map_err(|e| e.to_string())?,
        kv_dtype,
        num_blocks: a.num_blocks,
        ..GenerateOptions::default()
    };
    crate::model::generate::check(&opts).map_err(|e| e.to_string())?;
    Ok(Checked::Generate { opts })
}

fn demo(a: &DemoArgs) -> Result<Checked, String> {
    // The library takes 0 requests or samples as a degenerate workload; the
    // command line refuses them, since there would be nothing to report.
    if !(1..=DEMO_MAX_REQUESTS).contains(&a.requests) {
        return Err(format!(
            "--requests {} is not in 1..={DEMO_MAX_REQUESTS}",
            a.requests
        ));
    }
    if !(1..=MAX_SAMPLES).contains(&a.samples) {
        return Err(format!(
            "--samples {} is not in 1..={MAX_SAMPLES}",
            a.samples
        ));
    }
    let cfg = DemoConfig {
        seed: a.seed,
        requests: a.requests,
        samples: a.samples,
        block_size: a.block_size,
        num_blocks: a.num_blocks,
        dtype: if a.f32 {
            pagedattn::gpu::KvDtype::F32
        } else {
            crate::demo::parse_kv_dtype(&a.kv_dtype)?
        },
        ..DemoConfig::default()
    };
    cfg.validate().map_err(|e| e.to_string())?;
    Ok(Checked::Demo {
        cfg,
        verbose: a.verbose,
    })
}
