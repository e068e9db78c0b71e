//! A deterministic multi-tenant memory simulator: the same seeded workload
//! runs under several KV-cache memory policies with the same memory budget,
//! and the report says how much of the memory each one held actually stored
//! tokens, how many sequences it ran at once, and how long it took.
//!
//! Policies:
//! - `paged`: blocks of `block_size` tokens driven through the crate's own
//!   [`BlockManager`](pagedattn::blocks::BlockManager) (add, append, fork with
//!   copy-on-write, free, a batch view per step). When a step cannot get a
//!   block, the most recently admitted request is preempted and later
//!   recomputed.
//! - `max`, `pow2`, `oracle`: the vLLM paper's baselines, a contiguous slab
//!   per sequence reserved at admission, as systems before vLLM did: the
//!   longest sequence (`--max-len`), the next power of two of `prompt +
//!   max_output`, or exactly the sequence's final length, as if it were
//!   known in advance. They are the library `Scheduler`'s
//!   [`Reservation`](pagedattn::blocks::Reservation)s (the policies
//!   `pagedattn serve --reservation` runs), over blocks of one token so
//!   that a slab is exact; each sequence writes its own prompt.
//!
//! Time is counted in scheduler steps (one decoded token per running
//! sequence per step), a stand-in for throughput. Same seed, same bytes out.
//! Entry points: [`simulate`] for a [`SimConfig`], [`run_cli`] for
//! `pagedattn simulate`.

mod live;
mod report;
mod runlog;
mod scheduled;
mod svg;
pub mod workload;

use std::path::PathBuf;

use clap::Parser;
use pagedattn::blocks::Reservation;
use serde::Serialize;

pub use report::{PolicyReport, ScenarioReport, WorkloadSummary};
pub use runlog::Sample;
pub use workload::{Arrival, Dataset, LenDist, Request, Sampling, WorkloadSpec};

/// Everything that stops a simulation.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The options do not describe a runnable simulation.
    #[error("invalid simulation options: {0}")]
    Config(String),
    /// A request cannot fit even with the memory to itself.
    #[error("request {request} ({tokens} tokens per sequence) does not fit in the memory budget even alone; raise --budget or lower --max-len")]
    TooSmall {
        /// Index of the request.
        request: usize,
        /// Its prompt plus longest output.
        tokens: usize,
    },
    /// A broken invariant in the simulator or the block manager (a bug).
    #[error("simulator invariant broken: {0}")]
    Internal(String),
    /// Writing an output file failed.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// A memory policy to compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyKind {
    /// Paged KV cache (one run per block size).
    Paged,
    /// A slab of the longest sequence (`--max-len`) per sequence.
    Max,
    /// A slab of the next power of two of `prompt + max_output` per sequence.
    Pow2,
    /// A slab of each request's exact final length per sequence.
    Oracle,
}

/// A hybrid model's layer pattern (`--layer-groups`): its window layers
/// in a pool of their own that keeps only their windows' blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HybridPreset {
    /// Gemma 3 (4B and up): five layers of a 1024-token window per
    /// full-attention layer.
    Gemma3,
    /// Gemma 3 270M and 1B: the same pattern with a window of 512.
    Gemma3W512,
    /// gpt-oss: windows of 128 and full attention, alternating (its sinks
    /// are a learned logit per head, not tokens: they hold no block).
    GptOss,
    /// Mistral-7B v0.1: a window of 4096 on every layer.
    Mistral,
}

impl HybridPreset {
    /// Its name as `--layer-groups` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gemma3 => "gemma3",
            Self::Gemma3W512 => "gemma3-w512",
            Self::GptOss => "gpt-oss",
            Self::Mistral => "mistral",
        }
    }

    /// The groups of a stack of `layers` layers.
    pub fn layout(
        self,
        layers: u32,
    ) -> Result<pagedattn::blocks::LayerGroups, pagedattn::blocks::GroupError> {
        use pagedattn::blocks::{GroupKind, LayerGroups};
        match self {
            Self::Gemma3 => LayerGroups::interleaved(layers, 6, GroupKind::Window(1024)),
            Self::Gemma3W512 => LayerGroups::interleaved(layers, 6, GroupKind::Window(512)),
            Self::GptOss => LayerGroups::interleaved(layers, 2, GroupKind::Window(128)),
            Self::Mistral => LayerGroups::uniform(layers, GroupKind::Window(4096)),
        }
    }
}

/// How the paged policy's scheduler preempts (the library's
/// `blocks::Preemption`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PreemptKind {
    /// Free the group's blocks and recompute it later.
    Recompute,
    /// Swap its blocks to host memory and back (recompute if the swap
    /// space is full).
    Swap,
    /// vLLM's rule: recompute a single sequence, swap a group.
    Auto,
}

impl PreemptKind {
    fn library(self) -> pagedattn::blocks::Preemption {
        use pagedattn::blocks::Preemption as P;
        match self {
            Self::Recompute => P::Recompute,
            Self::Swap => P::Swap,
            Self::Auto => P::Auto,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Recompute => "recompute",
            Self::Swap => "swap",
            Self::Auto => "auto",
        }
    }
}

/// The cost model of preemption (see `--swap-gbps`): a swapped block moves
/// out and back in, each way `bytes / swap_gbps` plus `copy_overhead_us`
/// per copy (one per block, layer and K or V); a recomputed token costs
/// `1 / recompute_tps` seconds of prefill.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CostModel {
    /// Host link bandwidth, GB/s.
    pub swap_gbps: f64,
    /// Fixed cost of one copy command, microseconds.
    pub copy_overhead_us: f64,
    /// Prefill throughput of a recompute, tokens per second.
    pub recompute_tps: f64,
    /// Transformer layers and KV heads of the modelled model (with
    /// `--head-dim` and the dtype: bytes per token).
    pub layers: usize,
    pub kv_heads: usize,
}

/// Options of `pagedattn simulate`.
#[derive(clap::Args, Debug, Clone)]
pub struct SimulateArgs {
    /// Length preset after the vLLM paper's datasets (means: sharegpt 161 in /
    /// 338 out, alpaca 19 in / 58 out; log-normal shapes).
    #[arg(long, value_enum, default_value_t = Dataset::ShareGpt)]
    pub dataset: Dataset,
    /// Prompt lengths, overriding the preset: fixed:N, uniform:A:B,
    /// lognormal:MEAN:SIGMA or geometric:MEAN (counts and means at most
    /// 1048576, sigma at most 10).
    #[arg(long, value_name = "DIST")]
    pub input_len: Option<LenDist>,
    /// Output lengths, overriding the preset (same forms as --input-len).
    #[arg(long, value_name = "DIST")]
    pub output_len: Option<LenDist>,
    /// Number of requests (1 to 1000000, and requests x max-len at most
    /// 268435456).
    #[arg(long, default_value_t = 500)]
    pub requests: usize,
    /// Arrivals: all, poisson:RATE or fixed:RATE (requests per step, a
    /// rate from 0.000001 to 1000000).
    #[arg(long, default_value = "poisson:1")]
    pub arrival: Arrival,
    /// KV memory budget in tokens (slots), the same for every policy (at
    /// most 16777216).
    #[arg(long, default_value_t = 32768)]
    pub budget: usize,
    /// Longest sequence (prompt + output, at most 1048576); draws are
    /// clipped to it.
    #[arg(long, default_value_t = 2048)]
    pub max_len: usize,
    /// Longest output a request may ask for [default: --max-len]; the `max`
    /// policy reserves min(prompt + this, max-len) per sequence.
    #[arg(long)]
    pub max_output: Option<usize>,
    /// Block sizes of the paged policy (comma-separated: one paged run each).
    #[arg(long, value_delimiter = ',', default_value = "16")]
    pub block_size: Vec<u32>,
    /// Policies to compare (comma-separated).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "paged,max,oracle"
    )]
    pub policies: Vec<PolicyKind>,
    /// Scenarios (comma-separated), each run on the same requests: single,
    /// parallel:N (N samples share the prompt) or beam:K (beam search, width K).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "single,parallel:4,beam:4"
    )]
    pub sampling: Vec<Sampling>,
    /// Tokens of a system prompt shared by every request; turns on the paged
    /// policy's prefix cache.
    #[arg(long, default_value_t = 0)]
    pub shared_prefix: usize,
    /// Most sequences running at once (vLLM's max_num_seqs).
    #[arg(long, default_value_t = 256)]
    pub max_seqs: usize,
    /// Seed of every random draw.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// KV element types to compare (comma-separated: f32, f16, bf16, int8,
    /// fp8).
    /// `--budget` is the memory of that many f16 tokens; each dtype gets as
    /// many tokens as the same bytes hold (int8 stores a 4-byte scale per
    /// token and KV head, fp8 one per layer and KV head).
    #[arg(long, value_delimiter = ',', default_value = "f16")]
    pub kv_dtype: Vec<String>,
    /// Elements per KV head, for the bytes per token of `--kv-dtype`.
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Also run each `--kv-dtype` (f32, f16 or bf16) with multi-head latent
    /// attention's layout: one row of RANK + ROPE values per token and
    /// layer instead of K and V per KV head (DeepSeek-V2/V3: 512:64), in
    /// the same bytes.
    #[arg(long, value_name = "RANK:ROPE")]
    pub mla: Option<String>,
    /// How the paged policy preempts (comma-separated: one paged run each):
    /// recompute, swap, or auto (recompute a single sequence, swap a group).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "auto")]
    pub preemption: Vec<PreemptKind>,
    /// Host swap space of the paged policy, in tokens [default: --budget].
    #[arg(long)]
    pub swap_tokens: Option<usize>,
    /// Cost model: host link bandwidth for swapping, GB/s (PCIe 4.0 x16
    /// moves about 25; `pagedattn bench` measures the adapter's own).
    #[arg(long, default_value_t = 25.0)]
    pub swap_gbps: f64,
    /// Cost model: fixed cost of one block copy (per block, layer and K or
    /// V), microseconds.
    #[arg(long, default_value_t = 5.0)]
    pub copy_overhead_us: f64,
    /// Cost model: prefill throughput of a recompute, tokens per second
    /// (about a 7-8B model on one datacenter GPU).
    #[arg(long, default_value_t = 10000.0)]
    pub recompute_tps: f64,
    /// Cost model: layers and KV heads of the model (bytes per token, with
    /// --head-dim and the dtype).
    #[arg(long, default_value_t = 32)]
    pub model_layers: usize,
    #[arg(long, default_value_t = 8)]
    pub model_kv_heads: usize,
    /// Hybrid layer patterns (comma-separated: gemma3, gemma3-w512,
    /// gpt-oss, mistral): each adds a paged run of `--model-layers` layers
    /// in layer groups, a pool per group in the same bytes as the budget,
    /// the window groups keeping only their windows' blocks.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub layer_groups: Vec<HybridPreset>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also write an SVG plot of memory held and tokens stored over time.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

#[derive(Parser)]
struct DefaultsOnly {
    #[command(flatten)]
    args: SimulateArgs,
}

impl Default for SimulateArgs {
    /// The command line's defaults (one source of truth: clap's).
    fn default() -> Self {
        DefaultsOnly::parse_from(["simulate"]).args
    }
}

/// A validated simulation.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Dataset the length distributions came from (for the report).
    pub dataset: Dataset,
    /// Workload shape (lengths, arrivals, seed).
    pub workload: WorkloadSpec,
    /// Memory budget in tokens.
    pub budget: usize,
    /// Paged block sizes.
    pub block_sizes: Vec<u32>,
    /// Policies, in report order.
    pub policies: Vec<PolicyKind>,
    /// Scenarios.
    pub sampling: Vec<Sampling>,
    /// Sequence limit of the scheduler.
    pub max_seqs: usize,
    /// KV element types, one run of every policy each.
    pub kv_dtypes: Vec<pagedattn::gpu::KvDtype>,
    /// Elements per KV head (bytes per token of each dtype).
    pub head_dim: usize,
    /// An MLA latent row (kv_lora_rank, rope_dim): each dtype also runs
    /// with it, in the same bytes.
    pub mla: Option<(u32, u32)>,
    /// Preemption policies of the paged runs.
    pub preemption: Vec<PreemptKind>,
    /// Host swap space, tokens.
    pub swap_tokens: usize,
    /// The preemption cost model.
    pub cost: CostModel,
    /// Hybrid layer patterns, one more paged run each.
    pub layer_groups: Vec<HybridPreset>,
}

/// Bytes one token takes per KV head, K and V together, for `head_dim`:
/// what `KvCacheConfig::block_bytes` charges per token (blocks of 16: int8
/// V scales are two per word from 2 tokens per block on).
pub fn kv_bytes_per_token(dtype: pagedattn::gpu::KvDtype, head_dim: usize) -> usize {
    let cfg =
        pagedattn::gpu::KvCacheConfig::new(1, 16, 1, head_dim.min(256) as u32).with_dtype(dtype);
    (cfg.block_bytes() / 16) as usize
}

/// Most requests a simulation may have (`--requests`).
pub const MAX_REQUESTS: usize = 1_000_000;
/// Largest memory budget, in tokens (`--budget`): 16,777,216.
pub const MAX_BUDGET: usize = 1 << 24;
/// Most token slots the prompts may need, `--requests` times `--max-len`
/// (268,435,456: a gibibyte of token ids at worst).
pub const MAX_WORKLOAD_TOKENS: usize = 1 << 28;
/// Most sequences a scenario may start, `--requests` times the widest
/// sampling (4,194,304).
pub const MAX_SEQUENCES: usize = 1 << 22;
/// Most entries in each comma-separated list (`--block-size`,
/// `--policies`, `--sampling`).
pub const MAX_LIST: usize = 16;
/// Widest sampling (`parallel:N`, `beam:K`).
pub const MAX_WIDTH: usize = 64;

/// `RANK:ROPE` of `--mla`.
fn parse_mla(s: &str) -> Result<(u32, u32), SimError> {
    let bad = || SimError::Config(format!("--mla {s:?} is not RANK:ROPE (DeepSeek: 512:64)"));
    let (r, p) = s.split_once(':').ok_or_else(bad)?;
    Ok((r.parse().map_err(|_| bad())?, p.parse().map_err(|_| bad())?))
}

/// The latent pool of an MLA row at `dtype` (one layer, blocks of 16).
fn mla_config(
    dtype: pagedattn::gpu::KvDtype,
    (rank, rope): (u32, u32),
) -> pagedattn::gpu::MlaCacheConfig {
    pagedattn::gpu::MlaCacheConfig {
        num_layers: 1,
        num_blocks: 1,
        block_size: 16,
        kv_lora_rank: rank,
        rope_dim: rope,
        dtype,
    }
}

impl SimConfig {
    /// Bytes one token takes in one layer: K and V of every KV head, or
    /// the MLA latent row (`mla`).
    pub fn layer_token_bytes(
        &self,
        dtype: pagedattn::gpu::KvDtype,
        mla: Option<(u32, u32)>,
    ) -> usize {
        match mla {
            Some(row) => (mla_config(dtype, row).block_bytes() / 16) as usize,
            None => self.cost.kv_heads * kv_bytes_per_token(dtype, self.head_dim),
        }
    }

    /// Checks and converts command-line options (see [`SimConfig::check`]).
    pub fn from_args(a: &SimulateArgs) -> Result<Self, SimError> {
        let cfg = Self {
            dataset: a.dataset,
            workload: WorkloadSpec {
                input: a.input_len.unwrap_or(a.dataset.input()),
                output: a.output_len.unwrap_or(a.dataset.output()),
                requests: a.requests,
                arrival: a.arrival,
                max_len: a.max_len,
                max_output: a.max_output.unwrap_or(a.max_len),
                shared_prefix: a.shared_prefix,
                seed: a.seed,
            },
            budget: a.budget,
            block_sizes: a.block_size.clone(),
            policies: a.policies.clone(),
            sampling: a.sampling.clone(),
            max_seqs: a.max_seqs,
            kv_dtypes: a
                .kv_dtype
                .iter()
                .map(|d| crate::demo::parse_kv_dtype(d))
                .collect::<Result<_, _>>()
                .map_err(SimError::Config)?,
            head_dim: a.head_dim,
            mla: a.mla.as_deref().map(parse_mla).transpose()?,
            preemption: a.preemption.clone(),
            swap_tokens: a.swap_tokens.unwrap_or(a.budget),
            cost: CostModel {
                swap_gbps: a.swap_gbps,
                copy_overhead_us: a.copy_overhead_us,
                recompute_tps: a.recompute_tps,
                layers: a.model_layers,
                kv_heads: a.model_kv_heads,
            },
            layer_groups: a.layer_groups.clone(),
        };
        cfg.check()?;
        Ok(cfg)
    }

    /// Whether this is a runnable simulation of bounded size: the
    /// workload passes [`WorkloadSpec::check`], the budget is at most
    /// [`MAX_BUDGET`] and holds a block of each block size (powers of two
    /// in 1..=256), lists are non-empty and at most [`MAX_LIST`] long,
    /// sampling widths are in 1..=[`MAX_WIDTH`], `--max-seqs` admits the
    /// widest and `requests * width` is at most [`MAX_SEQUENCES`].
    /// [`simulate`] checks first.
    pub fn check(&self) -> Result<(), SimError> {
        let bad = |m: String| Err(SimError::Config(m));
        if let Err(m) = self.workload.check() {
            return bad(m);
        }
        if self.policies.is_empty() || self.sampling.is_empty() || self.kv_dtypes.is_empty() {
            return bad("give at least one policy, one sampling mode and one KV dtype".into());
        }
        if self.kv_dtypes.len() > 4 {
            return bad(format!(
                "--kv-dtype lists {} entries (at most 4)",
                self.kv_dtypes.len()
            ));
        }
        if let Some(row) = self.mla {
            for &d in &self.kv_dtypes {
                mla_config(d, row)
                    .validate()
                    .map_err(|e| SimError::Config(format!("--mla: {e}")))?;
            }
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(4) || self.head_dim > 256 {
            return bad(format!(
                "--head-dim {} is not a multiple of 4 in 4..=256",
                self.head_dim
            ));
        }
        for (name, n) in [
            ("--block-size", self.block_sizes.len()),
            ("--policies", self.policies.len()),
            ("--sampling", self.sampling.len()),
        ] {
            if n > MAX_LIST {
                return bad(format!(
                    "{name} lists {n} entries, over the limit of {MAX_LIST}"
                ));
            }
        }
        if self.budget > MAX_BUDGET {
            return bad(format!(
                "--budget {} is over the limit of {MAX_BUDGET} tokens",
                self.budget
            ));
        }
        for &bs in &self.block_sizes {
            if !(1..=256).contains(&bs) || !bs.is_power_of_two() {
                return bad(format!("block size {bs} is not a power of two in 1..=256"));
            }
            if self.budget < bs as usize {
                return bad(format!(
                    "--budget {} is smaller than one block of {bs}",
                    self.budget
                ));
            }
        }
        if self.policies.contains(&PolicyKind::Paged) && self.block_sizes.is_empty() {
            return bad("the paged policy needs a --block-size".into());
        }
        for s in &self.sampling {
            if !(1..=MAX_WIDTH).contains(&s.width()) {
                return bad(format!("sampling {s} is not of a width in 1..={MAX_WIDTH}"));
            }
        }
        let widest = self.sampling.iter().map(|s| s.width()).max().unwrap_or(1);
        if self.max_seqs < widest {
            return bad(format!(
                "--max-seqs {} is below the widest sampling ({widest} sequences)",
                self.max_seqs
            ));
        }
        // Both factors are bounded by now.
        let seqs = self.workload.requests as u64 * widest as u64;
        if seqs > MAX_SEQUENCES as u64 {
            return bad(format!(
                "--requests {} x {widest} sequences each = {seqs} sequences is over the limit of {MAX_SEQUENCES}",
                self.workload.requests
            ));
        }
        if self.preemption.is_empty() || self.preemption.len() > 3 {
            return bad("--preemption takes 1 to 3 policies".into());
        }
        if self.swap_tokens > MAX_BUDGET {
            return bad(format!(
                "--swap-tokens {} is over the limit of {MAX_BUDGET}",
                self.swap_tokens
            ));
        }
        let c = &self.cost;
        for (name, v) in [
            ("--swap-gbps", c.swap_gbps),
            ("--recompute-tps", c.recompute_tps),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= 1e12) {
                return bad(format!("{name} {v} is not a positive rate of at most 1e12"));
            }
        }
        if !(c.copy_overhead_us.is_finite() && (0.0..=1e6).contains(&c.copy_overhead_us)) {
            return bad(format!(
                "--copy-overhead-us {} is not in 0..=1000000",
                c.copy_overhead_us
            ));
        }
        if !(1..=1024).contains(&c.layers) || !(1..=1024).contains(&c.kv_heads) {
            return bad("--model-layers and --model-kv-heads take 1 to 1024".into());
        }
        Ok(())
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self::from_args(&SimulateArgs::default()).expect("defaults are valid")
    }
}

/// The options a report was made with, as text.
#[derive(Clone, Debug, Serialize)]
pub struct ConfigSummary {
    /// Dataset preset.
    pub dataset: String,
    /// Prompt-length distribution.
    pub input_len: String,
    /// Output-length distribution.
    pub output_len: String,
    /// Requests per scenario.
    pub requests: usize,
    /// Arrival process.
    pub arrival: String,
    /// Memory budget in tokens.
    pub budget_tokens: usize,
    /// Longest sequence.
    pub max_len: usize,
    /// Longest output.
    pub max_output: usize,
    /// Shared system prompt length (prefix caching on when positive).
    pub shared_prefix: usize,
    /// Sequence limit.
    pub max_seqs: usize,
    /// Seed.
    pub seed: u64,
}

/// The full result: options, then one comparison per scenario.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Options used.
    pub config: ConfigSummary,
    /// One entry per sampling mode.
    pub scenarios: Vec<ScenarioReport>,
}

impl Report {
    /// Pretty-printed JSON (the series are left out).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plain data serialises") + "\n"
    }

    fn header(&self) -> String {
        let c = &self.config;
        format!(
            "{} (input {}, output {}), budget {} tokens, max len {}, arrival {}, seed {}{}",
            c.dataset,
            c.input_len,
            c.output_len,
            c.budget_tokens,
            c.max_len,
            c.arrival,
            c.seed,
            if c.shared_prefix > 0 {
                format!(", shared prefix {} (prefix cache on)", c.shared_prefix)
            } else {
                String::new()
            }
        )
    }

    /// The comparison tables, one per scenario, and a legend.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let header = self.header();
        for sc in &self.scenarios {
            report::render_scenario(&mut out, sc, &header);
        }
        out.push_str(report::LEGEND);
        out
    }

    /// A standalone SVG of memory held and tokens stored over time.
    pub fn svg(&self) -> String {
        svg::render(&self.header(), &self.scenarios)
    }
}

/// Runs every scenario under every policy, once the configuration passes
/// [`SimConfig::check`].
pub fn simulate(cfg: &SimConfig) -> Result<Report, SimError> {
    cfg.check()?;
    let w = &cfg.workload;
    let mut scenarios = Vec::new();
    let f16_bytes = cfg.layer_token_bytes(pagedattn::gpu::KvDtype::F16, None);
    let layouts: Vec<_> = cfg
        .kv_dtypes
        .iter()
        .map(|&d| (d, None))
        .chain(
            cfg.mla
                .iter()
                .flat_map(|&row| cfg.kv_dtypes.iter().map(move |&d| (d, Some(row)))),
        )
        .collect();
    for &sampling in &cfg.sampling {
        let reqs = workload::generate(w, sampling);
        let mut policies = Vec::new();
        for &(dtype, mla) in &layouts {
            // The same bytes as `budget` f16 tokens of the GQA layout.
            let budget = cfg.budget * f16_bytes / cfg.layer_token_bytes(dtype, mla);
            let cfg = &SimConfig {
                budget,
                ..cfg.clone()
            };
            let first = policies.len();
            // One paged run through the library scheduler, with the cost
            // model per K/V byte of this dtype.
            let paged = |bs: u32,
                         pk: PreemptKind,
                         groups: Option<(HybridPreset, u32)>,
                         label: String|
             -> Result<PolicyReport, SimError> {
                let run = scheduled::PagedRun {
                    budget: cfg.budget,
                    block_size: bs,
                    prefix_caching: w.shared_prefix > 0,
                    max_len: w.max_len,
                    max_seqs: cfg.max_seqs,
                    preemption: pk.library(),
                    swap_blocks: u32::try_from(cfg.swap_tokens / bs as usize).unwrap_or(u32::MAX),
                    reservation: Reservation::Paged,
                    max_output: w.max_output,
                    groups,
                };
                let cap = run.num_blocks()? as usize * bs as usize;
                let (log, st) = scheduled::run(&reqs, sampling, w.seed, run)?;
                let mut p = PolicyReport::from_log("paged", label, Some(bs), cap, log);
                let c = &cfg.cost;
                let token_bytes = c.layers * cfg.layer_token_bytes(dtype, mla);
                let moved = st.blocks_swapped_out + st.blocks_swapped_in;
                let bytes = moved as f64 * (bs as usize * token_bytes) as f64;
                let copies = moved as f64 * (2 * c.layers) as f64;
                p.preemption = Some(pk.name().into());
                p.swapped_groups = st.swapped_groups;
                p.recomputed_groups = st.recomputed_groups;
                p.swap_fallbacks = st.swap_fallbacks;
                p.swapped_bytes = bytes as u64;
                p.swap_ms = bytes / (c.swap_gbps * 1e9) * 1e3 + copies * c.copy_overhead_us / 1e3;
                p.recompute_ms = p.recomputed_tokens as f64 / c.recompute_tps * 1e3;
                Ok(p)
            };
            for &kind in &cfg.policies {
                match kind {
                    PolicyKind::Paged => {
                        for &bs in &cfg.block_sizes {
                            for &pk in &cfg.preemption {
                                let label = if cfg.preemption.len() > 1 {
                                    format!("paged/{bs} {}", pk.name())
                                } else {
                                    format!("paged/{bs}")
                                };
                                policies.push(paged(bs, pk, None, label)?);
                            }
                        }
                    }
                    kind => {
                        let (reservation, name) = match kind {
                            PolicyKind::Max => (Reservation::Max, "max"),
                            PolicyKind::Pow2 => (Reservation::Pow2, "pow2"),
                            _ => (Reservation::Oracle, "oracle"),
                        };
                        let run = scheduled::PagedRun {
                            budget: cfg.budget,
                            block_size: 1,
                            prefix_caching: false,
                            max_len: w.max_len,
                            max_seqs: cfg.max_seqs,
                            preemption: pagedattn::blocks::Preemption::Recompute,
                            swap_blocks: 0,
                            reservation,
                            max_output: w.max_output,
                            groups: None,
                        };
                        let (log, _) = scheduled::run(&reqs, sampling, w.seed, run)?;
                        policies.push(PolicyReport::from_log(
                            name,
                            format!("contig-{name}"),
                            None,
                            cfg.budget,
                            log,
                        ));
                    }
                }
            }
            // Hybrid patterns: the first block size and preemption.
            for &preset in &cfg.layer_groups {
                let bs = cfg.block_sizes[0];
                let groups = Some((preset, cfg.cost.layers as u32));
                let label = format!("paged/{bs} {}", preset.name());
                policies.push(paged(bs, cfg.preemption[0], groups, label)?);
            }
            for p in &mut policies[first..] {
                p.kv_dtype = match mla {
                    Some((r, q)) => format!("mla-{r}+{q}-{}", dtype.name()),
                    None => dtype.name().into(),
                };
                if cfg.kv_dtypes.len() > 1 || dtype != pagedattn::gpu::KvDtype::F16 || mla.is_some()
                {
                    p.label = format!("{} {}", p.label, p.kv_dtype);
                }
            }
        }
        scenarios.push(ScenarioReport {
            sampling: sampling.to_string(),
            workload: WorkloadSummary::of(&reqs),
            policies,
        });
    }
    Ok(Report {
        config: ConfigSummary {
            dataset: cfg.dataset.name().into(),
            input_len: w.input.to_string(),
            output_len: w.output.to_string(),
            requests: w.requests,
            arrival: w.arrival.to_string(),
            budget_tokens: cfg.budget,
            max_len: w.max_len,
            max_output: w.max_output,
            shared_prefix: w.shared_prefix,
            max_seqs: cfg.max_seqs,
            seed: w.seed,
        },
        scenarios,
    })
}

/// `pagedattn simulate`: runs, prints the table (or JSON) on stdout,
/// writes the plot. See [`run_cli_to`].
pub fn run_cli(a: &SimulateArgs) -> Result<(), Box<dyn std::error::Error>> {
    let cfg = SimConfig::from_args(a)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    run_cli_to(&cfg, a, &mut out)
}

/// `pagedattn simulate` for a configuration checked from `a`
/// ([`SimConfig::from_args`]), with its output on `out`; `a` gives the
/// format and the plot file. A failure to write `out` comes back as the
/// [`std::io::Error`] itself (boxed), so that a caller can tell a closed
/// pipe (`ErrorKind::BrokenPipe`) from a real error.
pub fn run_cli_to(
    cfg: &SimConfig,
    a: &SimulateArgs,
    out: &mut dyn std::io::Write,
) -> Result<(), Box<dyn std::error::Error>> {
    let report = simulate(cfg)?;
    if a.json {
        out.write_all(report.to_json().as_bytes())?;
    } else {
        out.write_all(report.table().as_bytes())?;
    }
    if let Some(path) = &a.plot {
        std::fs::write(path, report.svg()).map_err(|source| SimError::Io {
            path: path.clone(),
            source,
        })?;
        if !a.json {
            writeln!(out, "plot written to {}", path.display())?;
        }
    }
    out.flush()?;
    Ok(())
}
