//! Choosing tokens from logits: greedy, temperature / top-k / top-p with a
//! seed, and the step of beam search. Everything is computed in f64 from
//! the f32 logits, with ties broken by the lower token id, so a run is
//! reproducible from its seed. `scripts/make-fixture.py` implements the
//! same rules over the reference runtime's logprobs.

use pagedattn::rng::SplitMix64;

use crate::ModelError;

/// Temperature / top-k / top-p sampling with a seed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// Divides the logits; 0 means greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all of them).
    pub top_k: usize,
    /// Then keep the tokens at least `min_p` times as likely as the most
    /// likely one (0: all of them; vLLM's and llama.cpp's `min_p`).
    pub min_p: f32,
    /// Then keep the smallest prefix holding `top_p` of their mass.
    pub top_p: f32,
    /// Branch `b` of a request draws from `SplitMix64(seed + b)`.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            min_p: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// Highest temperature accepted (above it the distribution is uniform to
/// within f32 anyway).
pub const MAX_TEMPERATURE: f32 = 100.0;

impl SamplingParams {
    /// Checks the ranges: temperature in 0..=100, top_p in (0, 1], min_p
    /// in 0..=1, top_k at most the vocabulary.
    pub fn validate(&self, vocab: usize) -> Result<(), ModelError> {
        let t = self.temperature;
        if !(t.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&t)) {
            return Err(ModelError::Request(format!(
                "temperature {t} outside 0..={MAX_TEMPERATURE} (0 is greedy)"
            )));
        }
        let p = self.top_p;
        if !(p.is_finite() && p > 0.0 && p <= 1.0) {
            return Err(ModelError::Request(format!("top-p {p} outside (0, 1]")));
        }
        let m = self.min_p;
        if !(m.is_finite() && (0.0..=1.0).contains(&m)) {
            return Err(ModelError::Request(format!("min-p {m} outside 0..=1")));
        }
        if self.top_k > vocab {
            return Err(ModelError::Request(format!(
                "top-k {} over the vocabulary of {vocab}",
                self.top_k
            )));
        }
        Ok(())
    }

    /// Whether this is greedy decoding.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// vLLM's penalties on tokens a sequence has seen, applied to its logits
/// before sampling (the reported logprobs stay the model's own).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Penalties {
    /// Subtracted once per earlier occurrence of the token in the output.
    pub frequency: f32,
    /// Subtracted once if the token occurs in the output at all.
    pub presence: f32,
    /// A token of the prompt or the output: a positive logit is divided by
    /// it, a negative one multiplied (1: none).
    pub repetition: f32,
}

impl Default for Penalties {
    fn default() -> Self {
        Self {
            frequency: 0.0,
            presence: 0.0,
            repetition: 1.0,
        }
    }
}

/// The largest repetition penalty accepted.
pub const MAX_REPETITION_PENALTY: f32 = 100.0;

impl Penalties {
    /// Checks the ranges: frequency and presence in -2..=2 (OpenAI's),
    /// repetition in (0, 100].
    pub fn validate(&self) -> Result<(), ModelError> {
        for (name, v) in [
            ("frequency_penalty", self.frequency),
            ("presence_penalty", self.presence),
        ] {
            if !(v.is_finite() && (-2.0..=2.0).contains(&v)) {
                return Err(ModelError::Request(format!("{name} {v} outside -2..=2")));
            }
        }
        let r = self.repetition;
        if !(r.is_finite() && r > 0.0 && r <= MAX_REPETITION_PENALTY) {
            return Err(ModelError::Request(format!(
                "repetition_penalty {r} outside (0, {MAX_REPETITION_PENALTY}]"
            )));
        }
        Ok(())
    }

    /// Whether these change nothing.
    pub fn is_none(&self) -> bool {
        self.frequency == 0.0 && self.presence == 0.0 && self.repetition == 1.0
    }

    /// The log-probabilities to sample from: `logits` with the penalties
    /// of a sequence whose prompt is `prompt` and whose output so far is
    /// `output`, through [`log_softmax`]. Token ids past the row are passed
    /// over.
    pub fn apply(&self, logits: &[f32], prompt: &[u32], output: &[u32]) -> Vec<f64> {
        let mut l = logits.to_vec();
        if self.repetition != 1.0 {
            let mut seen = vec![false; l.len()];
            for &t in prompt.iter().chain(output) {
                if let Some(s) = seen.get_mut(t as usize) {
                    *s = true;
                }
            }
            let r = self.repetition;
            for (x, _) in l.iter_mut().zip(&seen).filter(|(_, &s)| s) {
                *x = if *x > 0.0 { *x / r } else { *x * r };
            }
        }
        if self.frequency != 0.0 || self.presence != 0.0 {
            let mut count = std::collections::HashMap::<u32, u32>::new();
            for &t in output {
                *count.entry(t).or_default() += 1;
            }
            for (t, n) in count {
                if let Some(x) = l.get_mut(t as usize) {
                    *x -= self.frequency * n as f32 + self.presence;
                }
            }
        }
        log_softmax(&l)
    }
}

/// The most likely token (the lowest id among equals). NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] || logits[best].is_nan() && !x.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// log-softmax in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// The `k` largest `(token, value)` pairs, largest first, ties by lower id.
pub fn top_k(values: &[f64], k: usize) -> Vec<(u32, f64)> {
    let k = k.min(values.len());
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    let cmp = |a: &u32, b: &u32| {
        values[*b as usize]
            .total_cmp(&values[*a as usize])
            .then(a.cmp(b))
    };
    if k < idx.len() && k > 0 {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx.into_iter()
        .take(k)
        .map(|i| (i, values[i as usize]))
        .collect()
}

/// One branch's sampler: its parameters and its own random stream.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl Sampler {
    /// The sampler of branch `branch` (`SplitMix64(seed + branch)`).
    pub fn new(params: SamplingParams, branch: u64) -> Self {
        Self {
            params,
            rng: SplitMix64::new(params.seed.wrapping_add(branch)),
        }
    }

    /// The next token from a row of log-probabilities ([`log_softmax`] of
    /// the logits, computed once per row by the caller). Greedy draws nothing.
    pub fn sample(&mut self, lp: &[f64]) -> u32 {
        if self.params.is_greedy() {
            return top_k(lp, 1)[0].0;
        }
        let (cand, w) = self.candidates(lp);
        let kept_total: f64 = w.iter().sum();
        let u = self.rng.next_f64() * kept_total;
        let mut cum = 0.0;
        for (c, wi) in cand.iter().zip(&w) {
            cum += wi;
            if cum > u {
                return c.0;
            }
        }
        cand[cand.len() - 1].0
    }

    /// The distribution [`Sampler::sample`] draws from on `lp`: each token
    /// it can pick with its probability, most likely first (greedy: the
    /// argmax with 1). Draws nothing.
    pub fn distribution(&self, lp: &[f64]) -> Vec<(u32, f64)> {
        if self.params.is_greedy() {
            return vec![(top_k(lp, 1)[0].0, 1.0)];
        }
        let (cand, w) = self.candidates(lp);
        let total: f64 = w.iter().sum();
        cand.iter()
            .zip(&w)
            .map(|(c, wi)| (c.0, wi / total))
            .collect()
    }

    /// The tokens a draw can pick and their weights (relative to the most
    /// likely, which weighs 1): the `top_k` most likely, at `temperature`;
    /// of those, the ones weighing at least `min_p`; of those, the smallest
    /// prefix holding `top_p` of their weight.
    fn candidates(&self, lp: &[f64]) -> (Vec<(u32, f64)>, Vec<f64>) {
        let k = match self.params.top_k {
            0 => lp.len(),
            k => k,
        };
        let mut cand = top_k(lp, k);
        let t = self.params.temperature as f64;
        let zmax = cand[0].1 / t;
        let mut w: Vec<f64> = cand.iter().map(|c| (c.1 / t - zmax).exp()).collect();
        let min_p = self.params.min_p as f64;
        if min_p > 0.0 {
            // Sorted by weight, so the survivors are a prefix; the first
            // (weight 1) always survives.
            let keep = w.iter().take_while(|&&x| x >= min_p).count().max(1);
            w.truncate(keep);
            cand.truncate(keep);
        }
        let total: f64 = w.iter().sum();
        let cut = self.params.top_p as f64 * total;
        let mut kept = 0;
        let mut acc = 0.0;
        while kept < w.len() {
            acc += w[kept];
            kept += 1;
            if acc >= cut {
                break;
            }
        }
        w.truncate(kept);
        cand.truncate(kept);
        (cand, w)
    }
}

/// Most `logit_bias` entries a request may give (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;
/// The largest bias, either way. A bias of exactly -100 bans its token, and
/// tokens biased by exactly +100 are the only ones left to choose from (at
/// any temperature); any other bias is added to the logit.
pub const MAX_BIAS: f32 = 100.0;

/// OpenAI's `logit_bias`: values added to chosen tokens' logits before
/// the penalties and sampling (the reported logprobs stay the model's own).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogitBias {
    /// `(token, bias)`, by token, each token once.
    entries: Vec<(u32, f32)>,
}

impl LogitBias {
    /// Checks and sorts `entries` for a vocabulary of `vocab`: at most
    /// [`MAX_LOGIT_BIAS`] of them, each token inside the vocabulary and
    /// given once, each bias finite in -100..=100, and not every token
    /// banned.
    pub fn new(mut entries: Vec<(u32, f32)>, vocab: usize) -> Result<Self, ModelError> {
        let bad = |m: String| Err(ModelError::Request(m));
        if entries.len() > MAX_LOGIT_BIAS {
            return bad(format!(
                "logit_bias has {} entries; at most {MAX_LOGIT_BIAS}",
                entries.len()
            ));
        }
        for &(t, b) in &entries {
            if t as usize >= vocab {
                return bad(format!(
                    "logit_bias: token {t} outside the vocabulary of {vocab}"
                ));
            }
            if !(b.is_finite() && (-MAX_BIAS..=MAX_BIAS).contains(&b)) {
                return bad(format!(
                    "logit_bias: token {t}'s bias {b} outside -{MAX_BIAS}..={MAX_BIAS}"
                ));
            }
        }
        entries.sort_by_key(|e| e.0);
        if let Some(w) = entries.windows(2).find(|w| w[0].0 == w[1].0) {
            return bad(format!("logit_bias: token {} given twice", w[0].0));
        }
        if entries.iter().filter(|e| e.1 == -MAX_BIAS).count() >= vocab {
            return bad(format!(
                "logit_bias bans every token of the vocabulary of {vocab}"
            ));
        }
        Ok(Self { entries })
    }

    /// Whether it changes nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries, by token.
    pub fn entries(&self) -> &[(u32, f32)] {
        &self.entries
    }

    /// Adds the biases to `logits` (token ids past the row are passed
    /// over): -100 bans, +100 leaves only the tokens biased so.
    pub fn apply(&self, logits: &mut [f32]) {
        if self.entries.iter().any(|e| e.1 == MAX_BIAS) {
            let mut keep = vec![false; logits.len()];
            for &(t, b) in &self.entries {
                if b == MAX_BIAS {
                    if let Some(k) = keep.get_mut(t as usize) {
                        *k = true;
                    }
                }
            }
            for (x, k) in logits.iter_mut().zip(keep) {
                if !k {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        for &(t, b) in &self.entries {
            if let Some(x) = logits.get_mut(t as usize) {
                *x = if b == -MAX_BIAS {
                    f32::NEG_INFINITY
                } else if b == MAX_BIAS {
                    *x
                } else {
                    *x + b
                };
            }
        }
    }
}

/// What a request does to its logits before sampling: the logit bias,
/// then the penalties.
#[derive(Clone, Copy, Debug)]
pub struct Shaping<'a> {
    pub bias: &'a LogitBias,
    pub penalties: Penalties,
}

impl Shaping<'_> {
    /// Whether it changes nothing.
    pub fn is_none(&self) -> bool {
        self.bias.is_empty() && self.penalties.is_none()
    }

    /// The log-probabilities to sample from (see [`Penalties::apply`]).
    pub fn apply(&self, logits: &[f32], prompt: &[u32], output: &[u32]) -> Vec<f64> {
        if self.bias.is_empty() {
            return self.penalties.apply(logits, prompt, output);
        }
        let mut l = logits.to_vec();
        self.bias.apply(&mut l);
        self.penalties.apply(&l, prompt, output)
    }
}

/// One beam of a beam search: its tokens so far and their summed logprob.
#[derive(Clone, Debug, PartialEq)]
pub struct Beam {
    pub tokens: Vec<u32>,
    pub score: f64,
}

/// One step of beam search over `width` beams: `rows[i]` are beam `i`'s
/// log-probabilities. Each beam proposes its `2 * width` best tokens; the `width`
/// best candidates by total score survive (ties: lower beam, then lower
/// token). Returns `(parent, token, score)` in rank order.
pub fn beam_step(scores: &[f64], rows: &[&[f64]], width: usize) -> Vec<(usize, u32, f64)> {
    let mut cand = Vec::with_capacity(rows.len() * 2 * width);
    for (b, lp) in rows.iter().enumerate() {
        for (t, l) in top_k(lp, 2 * width) {
            cand.push((b, t, scores[b] + l));
        }
    }
    cand.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(&b.0)).then(a.1.cmp(&b.1)));
    cand.truncate(width);
    cand
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_lowest_id_among_equals_and_never_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 2.0]), 2);
    }

    #[test]
    fn top_k_orders_by_value_then_id() {
        let v = [0.5, 2.0, 2.0, -1.0, 1.0];
        assert_eq!(top_k(&v, 3), vec![(1, 2.0), (2, 2.0), (4, 1.0)]);
        assert_eq!(top_k(&v, 9).len(), 5);
    }

    #[test]
    fn log_softmax_sums_to_one() {
        let lp = log_softmax(&[1.0, 2.0, 3.0, 1000.0]);
        let s: f64 = lp.iter().map(|x| x.exp()).sum();
        assert!((s - 1.0).abs() < 1e-12 && lp[3] > -1e-12);
    }

    #[test]
    fn sampling_follows_the_distribution_and_the_seed() {
        // Two tokens at 3:1 odds; top_p 1 keeps both.
        let logits = log_softmax(&[(3.0f32).ln(), 0.0, -1e30]);
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            min_p: 0.0,
            top_p: 1.0,
            seed: 7,
        };
        let mut s = Sampler::new(p, 0);
        let n = 20000;
        let zeros = (0..n).filter(|_| s.sample(&logits) == 0).count();
        let frac = zeros as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.02, "{frac}");
        let a: Vec<u32> = (0..50)
            .map(|_| Sampler::new(p, 3).sample(&logits))
            .collect();
        assert!(
            a.iter().all(|&t| t == a[0]),
            "same seed and branch, same draw"
        );
        // top_p 0.5 keeps only the likelier token; top_k 1 likewise.
        let mut s = Sampler::new(SamplingParams { top_p: 0.5, ..p }, 1);
        assert!((0..200).all(|_| s.sample(&logits) == 0));
        let mut s = Sampler::new(SamplingParams { top_k: 1, ..p }, 1);
        assert!((0..200).all(|_| s.sample(&logits) == 0));
    }

    #[test]
    fn parameters_out_of_range_are_refused() {
        let ok = SamplingParams::default();
        assert!(ok.validate(10).is_ok());
        for bad in [
            SamplingParams {
                temperature: -0.1,
                ..ok
            },
            SamplingParams {
                temperature: f32::NAN,
                ..ok
            },
            SamplingParams {
                temperature: 1e9,
                ..ok
            },
            SamplingParams { top_p: 0.0, ..ok },
            SamplingParams { top_p: 1.5, ..ok },
            SamplingParams { top_k: 11, ..ok },
        ] {
            let e = bad.validate(10).unwrap_err().to_string();
            assert!(e.contains("outside") || e.contains("over"), "{e}");
        }
    }

    #[test]
    fn penalties_follow_vllms_rules() {
        let logits = [2.0f32, -1.0, 0.5, 0.0];
        // None: the plain log-softmax.
        assert_eq!(
            Penalties::default().apply(&logits, &[1], &[0]),
            log_softmax(&logits)
        );
        // Repetition 2 over prompt token 1 and output token 0: 2 -> 1, -1 -> -2.
        let r = Penalties {
            repetition: 2.0,
            ..Default::default()
        };
        assert_eq!(
            r.apply(&logits, &[1], &[0]),
            log_softmax(&[1.0, -2.0, 0.5, 0.0])
        );
        // Frequency 0.5 and presence 0.25 over the output [2, 2, 3]; the
        // prompt is not counted.
        let f = Penalties {
            frequency: 0.5,
            presence: 0.25,
            ..Default::default()
        };
        assert_eq!(
            f.apply(&logits, &[0, 0], &[2, 2, 3]),
            log_softmax(&[2.0, -1.0, 0.5 - 1.0 - 0.25, -0.5 - 0.25])
        );
        // Ids past the row are passed over.
        assert_eq!(f.apply(&logits, &[9], &[9]), log_softmax(&logits));
    }

    #[test]
    fn penalties_out_of_range_are_refused() {
        let ok = Penalties::default();
        assert!(ok.validate().is_ok() && ok.is_none());
        for (bad, name) in [
            (
                Penalties {
                    frequency: 2.5,
                    ..ok
                },
                "frequency_penalty",
            ),
            (
                Penalties {
                    presence: -2.01,
                    ..ok
                },
                "presence_penalty",
            ),
            (
                Penalties {
                    presence: f32::NAN,
                    ..ok
                },
                "presence_penalty",
            ),
            (
                Penalties {
                    repetition: 0.0,
                    ..ok
                },
                "repetition_penalty",
            ),
            (
                Penalties {
                    repetition: f32::INFINITY,
                    ..ok
                },
                "repetition_penalty",
            ),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(name) && e.contains("outside"), "{e}");
        }
    }

    #[test]
    fn beam_step_keeps_the_best_candidates_across_beams() {
        let a = log_softmax(&[0.0, 1.0, 2.0]);
        let b = log_softmax(&[5.0, 0.0, 0.0]);
        let out = beam_step(&[0.0, -10.0], &[&a, &b], 2);
        assert_eq!(out.len(), 2);
        assert_eq!((out[0].0, out[0].1), (0, 2));
        assert_eq!((out[1].0, out[1].1), (0, 1));
        assert!(out[0].2 > out[1].2);
    }
}
