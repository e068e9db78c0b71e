//! What a request gets for the sampling fields it leaves out: one set per
//! architecture, in one place that `pagedattn generate` and `pagedattn
//! serve` share, with the command line's overrides on top (as vLLM's
//! `--override-generation-config` and llama.cpp's server flags).
//!
//! The rules, for both commands and both HTTP routes:
//! - each field a request gives is used as given;
//! - each field it leaves out takes the default below (or its override);
//! - a request that sets `temperature: 0` asks for the model's argmax: the
//!   default repetition penalty does not apply to it (a penalty it gives
//!   itself does);
//! - beam search takes no sampling defaults at all.

use crate::arch::Arch;
use crate::sample::{Penalties, SamplingParams, MAX_TEMPERATURE};
use crate::ModelError;

/// The longest default `max_tokens` an override may set.
pub const MAX_DEFAULT_TOKENS: usize = 1 << 20;

/// The defaults for the sampling fields a request omits.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: f32,
    pub top_p: f32,
    /// 0: off.
    pub top_k: usize,
    /// 0: off.
    pub min_p: f32,
    /// 1: none.
    pub repetition_penalty: f32,
    /// A chat request's, and `generate`'s, `max_tokens` (bounded by the
    /// context).
    pub max_tokens: usize,
    /// A completions request's: OpenAI's 16, unless overridden.
    pub completion_tokens: usize,
    /// Where these values come from, for the log and the help.
    pub source: String,
}

/// Values given on the command line, each replacing its default.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GenerationOverrides {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub max_tokens: Option<usize>,
}

impl GenerationOverrides {
    /// Whether none is given.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Checks each given value against its range; the message names the
    /// flag.
    pub fn check(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Request(m));
        if let Some(t) = self.temperature {
            if !(t.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&t)) {
                return bad(format!(
                    "--temperature {t} outside 0..={MAX_TEMPERATURE} (0 is greedy)"
                ));
            }
        }
        if let Some(p) = self.top_p {
            if !(p.is_finite() && p > 0.0 && p <= 1.0) {
                return bad(format!("--top-p {p} outside (0, 1]"));
            }
        }
        if let Some(m) = self.min_p {
            if !(m.is_finite() && (0.0..=1.0).contains(&m)) {
                return bad(format!("--min-p {m} outside 0..=1"));
            }
        }
        if let Some(r) = self.repetition_penalty {
            let p = Penalties {
                repetition: r,
                ..Penalties::default()
            };
            if p.validate().is_err() {
                return bad(format!("--repetition-penalty {r} outside (0, 100]"));
            }
        }
        if let Some(n) = self.max_tokens {
            if !(1..=MAX_DEFAULT_TOKENS).contains(&n) {
                return bad(format!("--max-tokens {n} outside 1..={MAX_DEFAULT_TOKENS}"));
            }
        }
        Ok(())
    }
}

/// OpenAI's `max_tokens` of a completion that gives none.
pub const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// A chat request's `max_tokens` when neither it nor the command line
/// gives one: a bound, so that an answer that never reaches its end of
/// turn still ends.
pub const DEFAULT_CHAT_TOKENS: usize = 256;

impl GenerationDefaults {
    /// The architecture's own set.
    ///
    /// - Llama (SmolLM2-135M-Instruct): its model card's temperature 0.2
    ///   and top_p 0.9, and a repetition penalty of 1.1: without it the
    ///   135M model loops within a few hundred tokens (a story at 0.7 / 0.9
    ///   / top-k 40 repeated one sentence from token 250 on, 2026-12-07).
    /// - Gemma 3: its published generation config's top_k 64 and top_p
    ///   0.95; temperature 0.8, min_p 0.1 and a repetition penalty of 1.1,
    ///   ours: the 270M file served here is the base model (no chat
    ///   template), which at the config's temperature 1.0 drifts off the
    ///   question within a sentence ("Tell me a story" answered with
    ///   "Pregnancy $1,000 <h2>...", 2026-12-07); min_p 0.1 keeps it on
    ///   topic.
    pub fn for_arch(arch: Arch) -> Self {
        match arch {
            Arch::Llama => Self {
                temperature: 0.2,
                top_p: 0.9,
                top_k: 0,
                min_p: 0.0,
                repetition_penalty: 1.1,
                max_tokens: DEFAULT_CHAT_TOKENS,
                completion_tokens: DEFAULT_COMPLETION_TOKENS,
                source: "llama (SmolLM2): its model card's temperature and top_p, repetition penalty 1.1".into(),
            },
            Arch::Gemma3 => Self {
                temperature: 0.8,
                top_p: 0.95,
                top_k: 64,
                min_p: 0.1,
                repetition_penalty: 1.1,
                max_tokens: DEFAULT_CHAT_TOKENS,
                completion_tokens: DEFAULT_COMPLETION_TOKENS,
                source: "gemma3: its generation config's top_k and top_p; temperature 0.8, min_p 0.1, repetition penalty 1.1 for the base 270M".into(),
            },
        }
    }

    /// The architecture's set with `o`'s values on top (checked first).
    pub fn resolve(arch: Arch, o: &GenerationOverrides) -> Result<Self, ModelError> {
        o.check()?;
        let mut d = Self::for_arch(arch);
        if !o.is_empty() {
            d.source.push_str("; overridden on the command line");
        }
        d.temperature = o.temperature.unwrap_or(d.temperature);
        d.top_p = o.top_p.unwrap_or(d.top_p);
        d.top_k = o.top_k.unwrap_or(d.top_k);
        d.min_p = o.min_p.unwrap_or(d.min_p);
        d.repetition_penalty = o.repetition_penalty.unwrap_or(d.repetition_penalty);
        d.max_tokens = o.max_tokens.unwrap_or(d.max_tokens);
        d.completion_tokens = o.max_tokens.unwrap_or(d.completion_tokens);
        Ok(d)
    }

    /// The sampling parameters of a request that gives the `Some` fields
    /// (seed apart).
    pub fn params(
        &self,
        temperature: Option<f32>,
        top_p: Option<f32>,
        top_k: Option<usize>,
        min_p: Option<f32>,
        seed: u64,
    ) -> SamplingParams {
        SamplingParams {
            temperature: temperature.unwrap_or(self.temperature),
            top_k: top_k.unwrap_or(self.top_k),
            min_p: min_p.unwrap_or(self.min_p),
            top_p: top_p.unwrap_or(self.top_p),
            seed,
        }
    }

    /// The repetition penalty of a request that gives `given` and
    /// `temperature` (see the module's rules: none by default for a
    /// request that asks for greedy decoding itself).
    pub fn repetition(&self, given: Option<f32>, temperature: Option<f32>) -> f32 {
        match (given, temperature) {
            (Some(r), _) => r,
            (None, Some(t)) if t == 0.0 => 1.0,
            (None, _) => self.repetition_penalty,
        }
    }

    /// One line: `temperature 0.2, top_p 0.9, top_k off, ...`.
    pub fn describe(&self) -> String {
        let off = |x: String, is_off: bool| if is_off { "off".to_string() } else { x };
        format!(
            "temperature {}, top_p {}, top_k {}, min_p {}, repetition_penalty {}, max_tokens {} (chat; completions {})",
            self.temperature,
            self.top_p,
            off(self.top_k.to_string(), self.top_k == 0),
            off(self.min_p.to_string(), self.min_p == 0.0),
            off(self.repetition_penalty.to_string(), self.repetition_penalty == 1.0),
            self.max_tokens,
            self.completion_tokens,
        )
    }
}

/// The help text: every architecture's defaults and the rules.
pub fn help() -> String {
    let mut s = String::from(
        "Request defaults (a field the request gives is used as given; one it omits takes these; --temperature, --top-p, --top-k, --min-p, --repetition-penalty and --max-tokens replace them):\n",
    );
    for arch in [Arch::Llama, Arch::Gemma3] {
        let d = GenerationDefaults::for_arch(arch);
        s += &format!("  {:?}: {}\n", arch, d.describe());
    }
    s += "  A request with temperature 0 (greedy) gets no default repetition penalty; beam search takes no defaults. --max-tokens sets both routes' default.\n";
    s
}
