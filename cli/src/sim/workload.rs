//! Seeded multi-tenant workloads: when each request arrives, its prompt, and
//! how many tokens each of its sequences will generate.
//!
//! Everything here is drawn up front from the seed, so every policy of a run
//! replays exactly the same requests. Each request draws from its own stream,
//! and draws its output lengths last, so two scenarios that differ only in
//! their sampling (n = 1 vs n = 4) share arrivals, prompts and the first
//! sample's length.

use std::fmt;
use std::str::FromStr;

use pagedattn::rng::SplitMix64;

/// Token ids are drawn below this bound (a LLaMA-sized vocabulary); only the
/// prefix cache looks at them.
const VOCAB: u64 = 32_000;

/// Largest token count a length distribution may name (`fixed:N`,
/// `uniform:A:B`, a mean), and the longest `--max-len`: 1,048,576 tokens.
pub const MAX_TOKENS: usize = 1 << 20;

/// Largest log-space sigma of `lognormal:MEAN:SIGMA`.
pub const MAX_SIGMA: f64 = 10.0;

/// Slowest arrival rate, requests per step (`poisson:RATE`, `fixed:RATE`):
/// with at most a million requests the last one arrives within about 10^13
/// steps, far from overflowing the step counter.
pub const MIN_RATE: f64 = 1e-6;

/// Fastest arrival rate, requests per step.
pub const MAX_RATE: f64 = 1e6;

/// A distribution of token counts. Every draw is clipped to `[1, max]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LenDist {
    /// Always `N` tokens (`fixed:N`).
    Fixed(usize),
    /// Uniform in `[A, B]` (`uniform:A:B`).
    Uniform(usize, usize),
    /// Log-normal with the given mean and log-space sigma (`lognormal:MEAN:SIGMA`).
    LogNormal {
        /// Mean before clipping.
        mean: f64,
        /// Standard deviation of the underlying normal.
        sigma: f64,
    },
    /// Geometric on `1, 2, ...` with the given mean (`geometric:MEAN`).
    Geometric {
        /// Mean before clipping; at least 1.
        mean: f64,
    },
}

impl LenDist {
    /// One draw, clipped to `[1, max]` (`max` at least 1).
    pub fn sample(&self, rng: &mut SplitMix64, max: usize) -> usize {
        let max = max.max(1);
        let raw = match *self {
            LenDist::Fixed(n) => n as f64,
            LenDist::Uniform(a, b) => {
                // Saturating, so that no parameters can overflow (checked
                // ones never get near: see `check`).
                let (lo, hi) = (a.min(b) as u64, a.max(b) as u64);
                lo.saturating_add(rng.below((hi - lo).saturating_add(1))) as f64
            }
            LenDist::LogNormal { mean, sigma } => {
                // Pick mu so that E[exp(mu + sigma * Z)] is the requested mean.
                let mu = mean.ln() - sigma * sigma / 2.0;
                (mu + sigma * rng.normal()).exp().round()
            }
            LenDist::Geometric { mean } => {
                if mean <= 1.0 {
                    1.0
                } else {
                    // Inverse CDF; 1 - u is in (0, 1] so the log is finite.
                    let p = 1.0 / mean;
                    let u = 1.0 - rng.next_f64();
                    (u.ln() / (1.0 - p).ln()).ceil().max(1.0)
                }
            }
        };
        if raw.is_finite() {
            (raw as usize).clamp(1, max)
        } else {
            max
        }
    }
}

impl LenDist {
    /// Whether the parameters are in range: token counts and means at most
    /// [`MAX_TOKENS`], means and sigma finite and positive, sigma at most
    /// [`MAX_SIGMA`], uniform bounds in order. Parsing checks the same.
    pub fn check(&self) -> Result<(), String> {
        let count = |n: usize| {
            if n > MAX_TOKENS {
                Err(format!(
                    "{n} in `{self}` is over the limit of {MAX_TOKENS} tokens"
                ))
            } else {
                Ok(())
            }
        };
        let mean = |m: f64| {
            if !(m.is_finite() && m > 0.0) {
                Err(format!("mean {m} in `{self}` is not a positive number"))
            } else if m > MAX_TOKENS as f64 {
                Err(format!(
                    "mean {m} in `{self}` is over the limit of {MAX_TOKENS} tokens"
                ))
            } else {
                Ok(())
            }
        };
        match *self {
            LenDist::Fixed(n) => count(n),
            LenDist::Uniform(a, b) => {
                count(a)?;
                count(b)?;
                if a > b {
                    return Err(format!("uniform:{a}:{b} has its bounds reversed"));
                }
                Ok(())
            }
            LenDist::LogNormal { mean: m, sigma } => {
                mean(m)?;
                if !(sigma.is_finite() && sigma > 0.0 && sigma <= MAX_SIGMA) {
                    return Err(format!(
                        "sigma {sigma} in `{self}` is not a positive number up to {MAX_SIGMA}"
                    ));
                }
                Ok(())
            }
            LenDist::Geometric { mean: m } => mean(m),
        }
    }
}

impl FromStr for LenDist {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let int = |t: &str| -> Result<usize, String> {
            match t.parse::<u64>() {
                Ok(v) if v <= MAX_TOKENS as u64 => Ok(v as usize),
                Ok(v) => Err(format!(
                    "{v} in `{s}` is over the limit of {MAX_TOKENS} tokens"
                )),
                Err(_) => Err(format!("`{t}` is not a token count in `{s}`")),
            }
        };
        let num = |t: &str| -> Result<f64, String> {
            match t.parse::<f64>() {
                Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
                _ => Err(format!("`{t}` is not a positive number in `{s}`")),
            }
        };
        let d = match parts.as_slice() {
            ["fixed", n] => LenDist::Fixed(int(n)?),
            ["uniform", a, b] => {
                let (a, b) = (int(a)?, int(b)?);
                if a > b {
                    return Err(format!("uniform:{a}:{b} has its bounds reversed"));
                }
                LenDist::Uniform(a, b)
            }
            ["lognormal", m, sg] => LenDist::LogNormal {
                mean: num(m)?,
                sigma: num(sg)?,
            },
            ["geometric", m] => LenDist::Geometric { mean: num(m)? },
            _ => {
                return Err(format!(
                    "unknown length distribution `{s}`: use fixed:N, uniform:A:B, \
                     lognormal:MEAN:SIGMA or geometric:MEAN"
                ))
            }
        };
        d.check()?;
        Ok(d)
    }
}

impl fmt::Display for LenDist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            LenDist::Fixed(n) => write!(f, "fixed:{n}"),
            LenDist::Uniform(a, b) => write!(f, "uniform:{a}:{b}"),
            LenDist::LogNormal { mean, sigma } => write!(f, "lognormal:{mean}:{sigma}"),
            LenDist::Geometric { mean } => write!(f, "geometric:{mean}"),
        }
    }
}

/// Length presets after the two datasets of the vLLM paper (Kwon et al.,
/// SOSP 2023, section 6.1). The means are the paper's; the log-normal shapes
/// are our assumption, chosen for the long right tail of its histograms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Dataset {
    /// ShareGPT conversations: mean input 161, mean output 338 tokens.
    #[value(name = "sharegpt")]
    ShareGpt,
    /// Alpaca instructions: mean input 19, mean output 58 tokens.
    #[value(name = "alpaca")]
    Alpaca,
}

impl Dataset {
    /// Prompt-length distribution.
    pub fn input(self) -> LenDist {
        match self {
            Dataset::ShareGpt => LenDist::LogNormal {
                mean: 161.0,
                sigma: 1.0,
            },
            Dataset::Alpaca => LenDist::LogNormal {
                mean: 19.0,
                sigma: 0.7,
            },
        }
    }

    /// Output-length distribution.
    pub fn output(self) -> LenDist {
        match self {
            Dataset::ShareGpt => LenDist::LogNormal {
                mean: 338.0,
                sigma: 1.0,
            },
            Dataset::Alpaca => LenDist::LogNormal {
                mean: 58.0,
                sigma: 0.9,
            },
        }
    }

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Dataset::ShareGpt => "sharegpt",
            Dataset::Alpaca => "alpaca",
        }
    }
}

/// When requests arrive, in scheduler steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arrival {
    /// Every request is waiting at step 0 (`all`).
    All,
    /// A Poisson process with this many requests per step (`poisson:RATE`).
    Poisson(f64),
    /// Evenly spaced, this many requests per step (`fixed:RATE`).
    Fixed(f64),
}

impl Arrival {
    /// Whether the rate is finite and in [`MIN_RATE`]`..=`[`MAX_RATE`]
    /// requests per step. Parsing checks the same.
    pub fn check(&self) -> Result<(), String> {
        match *self {
            Arrival::All => Ok(()),
            Arrival::Poisson(r) | Arrival::Fixed(r) => {
                if (MIN_RATE..=MAX_RATE).contains(&r) {
                    Ok(())
                } else {
                    Err(format!(
                        "rate {r} in `{self}` is not in {MIN_RATE}..={MAX_RATE} requests per step"
                    ))
                }
            }
        }
    }
}

impl FromStr for Arrival {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let rate = |t: &str| -> Result<f64, String> {
            match t.parse::<f64>() {
                Ok(v) if (MIN_RATE..=MAX_RATE).contains(&v) => Ok(v),
                _ => Err(format!(
                    "`{t}` in `{s}` is not a rate in {MIN_RATE}..={MAX_RATE} requests per step"
                )),
            }
        };
        match s.split(':').collect::<Vec<_>>().as_slice() {
            ["all"] => Ok(Arrival::All),
            ["poisson", r] => Ok(Arrival::Poisson(rate(r)?)),
            ["fixed", r] => Ok(Arrival::Fixed(rate(r)?)),
            _ => Err(format!(
                "unknown arrival `{s}`: use all, poisson:RATE or fixed:RATE (requests per step)"
            )),
        }
    }
}

impl fmt::Display for Arrival {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Arrival::All => write!(f, "all"),
            Arrival::Poisson(r) => write!(f, "poisson:{r}"),
            Arrival::Fixed(r) => write!(f, "fixed:{r}"),
        }
    }
}

/// How many sequences a request decodes after its prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sampling {
    /// `n` independent samples sharing the prompt (`single` is n = 1).
    Parallel(usize),
    /// Beam search of width `k`: every step each beam proposes candidates
    /// and `k` of them survive, so beams fork and are pruned.
    Beam(usize),
}

impl Sampling {
    /// Most sequences a request of this kind runs at once.
    pub fn width(self) -> usize {
        match self {
            Sampling::Parallel(n) | Sampling::Beam(n) => n,
        }
    }
}

impl FromStr for Sampling {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let width = |t: &str| -> Result<usize, String> {
            match t.parse::<usize>() {
                Ok(v) if (1..=64).contains(&v) => Ok(v),
                _ => Err(format!("`{t}` is not a width in 1..=64 in `{s}`")),
            }
        };
        match s.split(':').collect::<Vec<_>>().as_slice() {
            ["single"] => Ok(Sampling::Parallel(1)),
            ["parallel", n] | ["n", n] => Ok(Sampling::Parallel(width(n)?)),
            ["beam", k] => Ok(Sampling::Beam(width(k)?)),
            _ => Err(format!(
                "unknown sampling `{s}`: use single, parallel:N or beam:K"
            )),
        }
    }
}

impl fmt::Display for Sampling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Sampling::Parallel(1) => write!(f, "single"),
            Sampling::Parallel(n) => write!(f, "parallel:{n}"),
            Sampling::Beam(k) => write!(f, "beam:{k}"),
        }
    }
}

/// What to draw: the shape of a workload, independent of sampling.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadSpec {
    /// Prompt lengths (before the shared prefix is prepended).
    pub input: LenDist,
    /// Output lengths, one draw per sample.
    pub output: LenDist,
    /// Number of requests.
    pub requests: usize,
    /// Arrival process.
    pub arrival: Arrival,
    /// Longest sequence (prompt + output) a request may reach.
    pub max_len: usize,
    /// Longest output a request may ask for (what max-length reservation sizes for).
    pub max_output: usize,
    /// Tokens of a system prompt every request starts with.
    pub shared_prefix: usize,
    /// Seed of every draw.
    pub seed: u64,
}

/// One request of the workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Position in arrival order.
    pub id: usize,
    /// Step at which it joins the queue.
    pub arrival: u64,
    /// Prompt token ids (the shared prefix first, if any).
    pub prompt: Vec<u32>,
    /// Tokens each sample generates: `n` entries for parallel sampling, one
    /// (shared by every beam) for beam search.
    pub outputs: Vec<usize>,
    /// Tokens a max-length reservation sets aside per sequence:
    /// `min(prompt + max_output, max_len)`.
    pub reserve_max: usize,
}

/// A stream of its own for each request, so that one request's draws never
/// shift another's.
fn request_rng(seed: u64, id: usize) -> SplitMix64 {
    let mut r = SplitMix64::new(seed ^ (id as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
    r.next_u64();
    r
}

impl WorkloadSpec {
    /// Whether the shape is drawable and its size bounded: distributions
    /// and arrivals in range, `max_len` in `2..=`[`MAX_TOKENS`] with room for
    /// a prompt token and an output token after the shared prefix,
    /// `max_output` at least 1, and `requests` in
    /// `1..=`[`MAX_REQUESTS`](super::MAX_REQUESTS) with `requests * max_len`
    /// at most [`MAX_WORKLOAD_TOKENS`](super::MAX_WORKLOAD_TOKENS) (the
    /// prompts are held in memory).
    pub fn check(&self) -> Result<(), String> {
        use super::{MAX_REQUESTS, MAX_WORKLOAD_TOKENS};
        self.input
            .check()
            .map_err(|e| format!("input length: {e}"))?;
        self.output
            .check()
            .map_err(|e| format!("output length: {e}"))?;
        self.arrival.check()?;
        if self.requests == 0 {
            return Err("--requests must be at least 1".into());
        }
        if self.requests > MAX_REQUESTS {
            return Err(format!(
                "--requests {} is over the limit of {MAX_REQUESTS}",
                self.requests
            ));
        }
        if self.max_len > MAX_TOKENS {
            return Err(format!(
                "--max-len {} is over the limit of {MAX_TOKENS} tokens",
                self.max_len
            ));
        }
        if self.shared_prefix > MAX_TOKENS {
            return Err(format!(
                "--shared-prefix {} is over the limit of {MAX_TOKENS} tokens",
                self.shared_prefix
            ));
        }
        if self.max_len < self.shared_prefix + 2 {
            return Err(format!(
                "--max-len {} leaves no room for a prompt and an output after --shared-prefix {}",
                self.max_len, self.shared_prefix
            ));
        }
        if self.max_output == 0 {
            return Err("--max-output must be at least 1".into());
        }
        // Both factors are bounded above, so this cannot overflow.
        let slots = self.requests as u64 * self.max_len as u64;
        if slots > MAX_WORKLOAD_TOKENS as u64 {
            return Err(format!(
                "--requests {} x --max-len {} = {slots} token slots is over the limit of \
                 {MAX_WORKLOAD_TOKENS} (prompts are held in memory); lower one of them",
                self.requests, self.max_len
            ));
        }
        Ok(())
    }
}

/// Draws the workload for one sampling mode. The spec should pass
/// [`WorkloadSpec::check`]: an unchecked one cannot overflow, but its
/// sizes are not bounded.
pub fn generate(spec: &WorkloadSpec, sampling: Sampling) -> Vec<Request> {
    let mut arrivals = SplitMix64::new(spec.seed ^ 0xA11C_E5A1_7E00_0001);
    let mut prefix_rng = SplitMix64::new(spec.seed ^ 0x5E55_1011_0000_0002);
    let prefix: Vec<u32> = (0..spec.shared_prefix)
        .map(|_| prefix_rng.below(VOCAB) as u32)
        .collect();
    let samples = match sampling {
        Sampling::Parallel(n) => n,
        Sampling::Beam(_) => 1,
    };
    let mut t = 0.0f64;
    (0..spec.requests)
        .map(|id| {
            let arrival = match spec.arrival {
                Arrival::All => 0,
                Arrival::Poisson(rate) => {
                    // Exponential gaps; the first request arrives at step 0.
                    if id > 0 {
                        t += -(1.0 - arrivals.next_f64()).ln() / rate;
                    }
                    t as u64
                }
                Arrival::Fixed(rate) => (id as f64 / rate) as u64,
            };
            let mut rng = request_rng(spec.seed, id);
            // `WorkloadSpec::check` keeps room for a prompt and an output;
            // saturating anyway, so an unchecked spec cannot overflow here.
            let room = spec.max_len.saturating_sub(1 + spec.shared_prefix);
            let input = spec.input.sample(&mut rng, room);
            let mut prompt = prefix.clone();
            prompt.extend((0..input).map(|_| rng.below(VOCAB) as u32));
            let out_cap = spec
                .max_output
                .min(spec.max_len.saturating_sub(prompt.len()));
            let outputs = (0..samples)
                .map(|_| spec.output.sample(&mut rng, out_cap))
                .collect();
            Request {
                id,
                arrival,
                reserve_max: prompt.len() + out_cap,
                prompt,
                outputs,
            }
        })
        .collect()
}
