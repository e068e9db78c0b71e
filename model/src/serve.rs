//! Serving requests through the library [`Scheduler`]: continuous batching
//! with chunked prefill, parallel sampling and beam search whose sequences
//! share their prompt (fork and copy-on-write), prefix caching, preemption
//! by recompute or swap.
//!
//! Each [`Server::step`] is one scheduler step: swap-out, swap-in, then the
//! model over the step's rows (copy-on-write and the K/V writes inside its
//! one encoder), then the sampled tokens back to the scheduler's commit.

use crate::clock::Instant;
use std::collections::HashMap;

use pagedattn::blocks::{
    Admission, BlockManagerConfig, Child, GroupKind, GroupOutput, Preemption, RequestId,
    Reservation, Scheduler, SchedulerConfig, Step, MAX_SCHEDULER_GROUPS,
};
use pagedattn::gpu::{KvLayout, SwapSpace};

use crate::engine::{Model, StepInput};
use crate::sample::{
    beam_step, log_softmax, top_k, LogitBias, Penalties, Sampler, SamplingParams, Shaping,
};
use crate::ModelError;

/// How a request chooses its tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decoding {
    /// `n` independent samples (greedy at temperature 0), sharing the prompt.
    Sample { params: SamplingParams, n: usize },
    /// Beam search of `width` beams.
    Beam { width: usize },
}

/// A request: its prompt, how long it may grow, how it decodes.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub decoding: Decoding,
    /// A sequence that emits one of these tokens ends there (empty: only
    /// `max_tokens` and `stop_strings` end it).
    pub stop: Vec<u32>,
    /// A sequence whose text (the [`Server::set_token_text`] bytes of its
    /// tokens) comes to contain one of these ends there; the text from the
    /// match on is not part of the answer ([`Finish::Text`]).
    pub stop_strings: Vec<Vec<u8>>,
    /// Penalties on seen tokens (sampling only).
    pub penalties: Penalties,
    /// Added to the logits before the penalties (sampling only; checked
    /// by [`LogitBias::new`]).
    pub logit_bias: LogitBias,
    /// Record the top-N logprobs of every step (0: none). The chosen
    /// token's logprob is always recorded.
    pub record_top: usize,
    /// Prefix-cache salt (requests share cached blocks only with equal salts).
    pub salt: Vec<u8>,
    /// The output length the request will have, where the caller knows it
    /// (a benchmark): what [`Reservation::Oracle`](pagedattn::blocks::Reservation)
    /// reserves. `None`: `max_tokens`.
    pub expected_tokens: Option<usize>,
}

impl Request {
    /// Greedy decoding of up to `max_tokens` tokens.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            max_tokens,
            decoding: Decoding::Sample {
                params: SamplingParams::default(),
                n: 1,
            },
            stop: Vec::new(),
            stop_strings: Vec::new(),
            penalties: Penalties::default(),
            logit_bias: LogitBias::default(),
            record_top: 0,
            salt: Vec::new(),
            expected_tokens: None,
        }
    }

    /// Sequences the request runs at once.
    pub fn width(&self) -> usize {
        match self.decoding {
            Decoding::Sample { n, .. } => n,
            Decoding::Beam { width } => width,
        }
    }
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// It reached `max_tokens`.
    Length,
    /// It emitted this stop token (the last of its tokens).
    Token(u32),
    /// Its text came to contain `stop_strings[index]`, starting at byte
    /// `at` of the text: the answer is `text[..at]`.
    Text { index: usize, at: usize },
}

/// One generated sequence.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Generated {
    /// Its tokens after the prompt.
    pub tokens: Vec<u32>,
    /// Sum of the tokens' logprobs.
    pub score: f64,
    /// Sample branch (0 for greedy and beams).
    pub branch: usize,
    /// Top-N `(token, logprob)` of every step, when asked for.
    pub top: Vec<Vec<(u32, f64)>>,
    /// The logprob of each token, as the model gave it (before penalties).
    pub logprobs: Vec<f64>,
    /// Its text so far: the [`Server::set_token_text`] bytes of its tokens
    /// (empty when the server has none).
    pub text: Vec<u8>,
    /// Why it ended (`None` while it runs).
    pub finish: Option<Finish>,
}

impl Generated {
    /// The answer's bytes: the text, cut where a stop string matched.
    pub fn answer(&self) -> &[u8] {
        match self.finish {
            Some(Finish::Text { at, .. }) => &self.text[..at.min(self.text.len())],
            _ => &self.text,
        }
    }
}

/// A finished request: samples in branch order, beams best first.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub request: RequestId,
    pub sequences: Vec<Generated>,
    /// Dropped by the scheduler: it could not fit even with the pool to itself.
    pub aborted: bool,
    /// Prompt tokens whose K/V came from the prefix cache at admission.
    pub cached_tokens: usize,
}

/// Counters of a server's run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ServeStats {
    pub steps: usize,
    /// Tokens run in steps with prompt work, and those steps' seconds.
    pub prefill_tokens: usize,
    pub prefill_secs: f64,
    /// Steps with prompt work (prompt chunks, maybe with decodes).
    pub prefill_steps: usize,
    /// Tokens of pure decode steps, and their seconds.
    pub decode_tokens: usize,
    pub decode_secs: f64,
    /// Largest number of sequences in one step.
    pub peak_batch: usize,
    pub peak_blocks_used: usize,
    pub peak_blocks_shared: usize,
    /// Blocks a contiguous reservation (prompt + max_tokens per sequence,
    /// nothing shared) would hold for the requests admitted.
    pub contiguous_blocks: usize,
    pub copies: usize,
    pub preempted: usize,
    pub swapped_out_blocks: usize,
    pub aborted: usize,
    /// Share of a decode step's time spent in attention (write_kv and the
    /// attention kernels), measured once when [`Server::profile`] is set:
    /// the step timed again as it is and without its attention kernels.
    pub attention_share: Option<f64>,
    /// Rows of the step that share was measured on.
    pub profiled_rows: usize,
    /// Per layer group (a model whose layers attend alike has one): the
    /// most blocks its pool held at once.
    pub peak_group_blocks: [usize; MAX_SCHEDULER_GROUPS],
    /// The most layer-blocks (a group's blocks times its layers, summed)
    /// the pools held at once, and what one pool of every layer would have
    /// held at that step (the full-attention group's blocks times every
    /// layer; 0 without a full group).
    pub peak_layer_blocks: usize,
    pub full_retention_layer_blocks: usize,
    /// The same at the last step run (for a run that ends decoding: the
    /// steady state at the final lengths, past each prompt's prefill,
    /// which takes the prompt's blocks in every group).
    pub last_group_blocks: [usize; MAX_SCHEDULER_GROUPS],
    pub last_layer_blocks: usize,
    pub last_full_retention_layer_blocks: usize,
    /// The most layer-blocks the window groups had given back at one step
    /// (full retention's less those held).
    pub most_layer_blocks_saved: usize,
}

/// How a [`Server`] schedules.
#[derive(Clone, Copy, Debug)]
pub struct ServerConfig {
    /// Sequences in one step (at most the engine's `max_logit_rows`).
    pub max_seqs: usize,
    /// Tokens in one step, which is also the prefill chunk (at most the
    /// engine's `max_rows`).
    pub max_batch_tokens: usize,
    pub preemption: Preemption,
    /// Host swap blocks (0: none; swap falls back to recompute).
    pub swap_blocks: u32,
    pub prefix_caching: bool,
    /// Pool blocks the scheduler may use (`None`: all of the model's).
    pub num_blocks: Option<u32>,
    /// Paging, or one of the reservations it is compared against.
    pub reservation: Reservation,
    /// The longest sequence served, prompt and output (`None`: the
    /// model's context). What `Reservation::Max` reserves.
    pub max_model_len: Option<usize>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            max_seqs: 32,
            max_batch_tokens: 256,
            preemption: Preemption::Auto,
            swap_blocks: 0,
            prefix_caching: true,
            num_blocks: None,
            reservation: Reservation::Paged,
            max_model_len: None,
        }
    }
}

struct Live {
    gen: Generated,
    sampler: Option<Sampler>,
}

struct State {
    req: Request,
    started: bool,
    live: Vec<Live>,
    done: Vec<Generated>,
    /// Prompt tokens the prefix cache held at admission (set at the
    /// request's first row).
    cached_tokens: Option<usize>,
}

/// One logit row: the raw logits and their log-softmax.
type RowOf<'l> = dyn Fn(usize) -> Result<(&'l [f32], &'l [f64]), ModelError> + 'l;

/// Where the first of `stops` occurs in `text` at or after `from`:
/// `(index of the stop string, byte offset)`, the earliest match first.
fn find_stop(text: &[u8], from: usize, stops: &[Vec<u8>]) -> Option<(usize, usize)> {
    let mut best: Option<(usize, usize)> = None;
    for (i, s) in stops.iter().enumerate() {
        if s.is_empty() || from + s.len() > text.len() {
            continue;
        }
        if let Some(p) = text[from..].windows(s.len()).position(|w| w == &s[..]) {
            let at = from + p;
            if best.is_none_or(|(_, b)| at < b) {
                best = Some((i, at));
            }
        }
    }
    best
}

impl State {
    /// One step of the request's sequences: the picks from each sequence's
    /// logits (`rows_of(i)`; samples draw, beams keep the best), each a
    /// child of the sequence it extends; `on_token` hears each new
    /// sequence state. `text_of(token)` is a token's text, for stop strings.
    /// Returns the children for the scheduler.
    fn advance<'l>(
        &mut self,
        rows_of: &RowOf<'l>,
        text_of: &dyn Fn(u32) -> &'l [u8],
        on_token: &mut dyn FnMut(&Generated),
    ) -> Result<Vec<Child>, ModelError> {
        let rec = self.req.record_top;
        let pen = Shaping {
            bias: &self.req.logit_bias,
            penalties: self.req.penalties,
        };
        // (parent, token, logprob, the sample's sampler)
        let mut picks: Vec<(usize, u32, f64, Option<Sampler>)> = Vec::new();
        if !self.started {
            let (logits, lp) = rows_of(0)?;
            match self.req.decoding {
                Decoding::Sample { params, n } => {
                    let shaped = (!pen.is_none()).then(|| pen.apply(logits, &self.req.prompt, &[]));
                    for b in 0..n {
                        let mut s = Sampler::new(params, b as u64);
                        let t = s.sample(shaped.as_deref().unwrap_or(lp));
                        picks.push((0, t, lp[t as usize], Some(s)));
                    }
                }
                Decoding::Beam { width } => {
                    for (t, l) in top_k(lp, width) {
                        picks.push((0, t, l, None));
                    }
                }
            }
            self.live = vec![Live {
                gen: Generated::default(),
                sampler: None,
            }];
            self.started = true;
        } else {
            match self.req.decoding {
                Decoding::Sample { .. } => {
                    // Everything that can fail first: the state stays as
                    // it was on an error.
                    let rows: Vec<(&[f32], &[f64])> = (0..self.live.len())
                        .map(rows_of)
                        .collect::<Result<_, _>>()?;
                    let samplers = self
                        .live
                        .iter()
                        .enumerate()
                        .map(|(i, l)| {
                            l.sampler.clone().ok_or_else(|| {
                                ModelError::Step(format!("sample {i} has no sampler"))
                            })
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    for (i, (mut s, (logits, lp))) in samplers.into_iter().zip(rows).enumerate() {
                        let t = if pen.is_none() {
                            s.sample(lp)
                        } else {
                            let out = &self.live[i].gen.tokens;
                            s.sample(&pen.apply(logits, &self.req.prompt, out))
                        };
                        picks.push((i, t, lp[t as usize], Some(s)));
                    }
                }
                Decoding::Beam { .. } => {
                    let keep = self.req.width() - self.done.len();
                    let rows: Vec<&[f64]> = (0..self.live.len())
                        .map(|i| rows_of(i).map(|r| r.1))
                        .collect::<Result<_, _>>()?;
                    let scores: Vec<f64> = self.live.iter().map(|l| l.gen.score).collect();
                    for (b, t, s) in beam_step(&scores, &rows, keep) {
                        picks.push((b, t, s - scores[b], None));
                    }
                }
            }
        }
        let longest_stop = self
            .req
            .stop_strings
            .iter()
            .map(Vec::len)
            .max()
            .unwrap_or(0);
        let mut children = Vec::with_capacity(picks.len());
        let mut next = Vec::with_capacity(picks.len());
        for (k, (parent, token, lp, sampler)) in picks.into_iter().enumerate() {
            let mut gen = self.live[parent].gen.clone();
            if gen.tokens.is_empty() {
                gen.branch = k; // a first token: the request's k-th branch
            }
            gen.tokens.push(token);
            gen.score += lp;
            gen.logprobs.push(lp);
            if rec > 0 {
                gen.top.push(top_k(rows_of(parent)?.1, rec));
            }
            let before = gen.text.len();
            let is_stop = self.req.stop.contains(&token);
            if !is_stop {
                gen.text.extend_from_slice(text_of(token));
            }
            // A match may start in the bytes before this token's.
            let from = before.saturating_sub(longest_stop.saturating_sub(1));
            gen.finish = if is_stop {
                Some(Finish::Token(token))
            } else if let Some((index, at)) = find_stop(&gen.text, from, &self.req.stop_strings) {
                Some(Finish::Text { index, at })
            } else if gen.tokens.len() >= self.req.max_tokens {
                Some(Finish::Length)
            } else {
                None
            };
            let finished = gen.finish.is_some();
            on_token(&gen);
            children.push(Child {
                parent,
                token,
                finished,
            });
            if finished {
                self.done.push(gen);
            } else {
                next.push(Live { gen, sampler });
            }
        }
        self.live = next;
        Ok(children)
    }
}

/// A model and the scheduler that feeds it.
pub struct Server {
    pub model: Model,
    pub sched: Scheduler,
    cfg: ServerConfig,
    /// Each layer group's host swap space (empty: none).
    swap: Vec<SwapSpace>,
    reqs: HashMap<RequestId, State>,
    pub stats: ServeStats,
    /// Measure the attention share on the first decode step of at least
    /// this many rows (then cleared).
    pub profile: Option<usize>,
    /// The copy-on-write copies (source, destination block) of the last step.
    pub last_copies: Vec<[u32; 2]>,
    /// Remote prefix blocks of requests not yet admitted
    /// ([`add_with_remote`](Self::add_with_remote)): descriptor and bytes,
    /// in prompt order.
    remote: HashMap<RequestId, Vec<(KvLayout, Vec<u8>)>>,
    /// Blocks imported from remote prefixes.
    pub imported_blocks: usize,
    /// Each token's text, for stop strings ([`set_token_text`](Self::set_token_text)).
    token_text: Vec<Vec<u8>>,
}

/// A running request as it stands: its live sequences (beams in the order
/// the scheduler holds them, samples by branch) and those already ended.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Progress {
    pub live: Vec<Generated>,
    pub done: Vec<Generated>,
}

/// The best of three runs of a step, with or without its attention.
/// Rerunning the step rewrites the same K/V into the same slots.
async fn time_step(m: &mut Model, input: &StepInput<'_>, skip: bool) -> Result<f64, ModelError> {
    m.skip_attention = skip;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        let r = m.forward_async(input).await;
        best = best.min(t.elapsed().as_secs_f64());
        if let Err(e) = r {
            m.skip_attention = false;
            return Err(e);
        }
    }
    m.skip_attention = false;
    Ok(best)
}

fn blocks_for(tokens: usize, bs: usize) -> usize {
    tokens.div_ceil(bs)
}

impl Server {
    /// A server over `model`'s pool.
    pub fn new(model: Model, cfg: ServerConfig) -> Result<Self, ModelError> {
        let ec = model.cfg;
        if cfg.max_seqs == 0 || cfg.max_seqs > ec.max_logit_rows {
            return Err(ModelError::Request(format!(
                "max_seqs {} outside 1..={} (the engine's max_logit_rows)",
                cfg.max_seqs, ec.max_logit_rows
            )));
        }
        if cfg.max_batch_tokens == 0 || cfg.max_batch_tokens > ec.max_rows {
            return Err(ModelError::Request(format!(
                "max_batch_tokens {} outside 1..={} (the engine's max_rows)",
                cfg.max_batch_tokens, ec.max_rows
            )));
        }
        let blocks = cfg.num_blocks.unwrap_or(ec.num_blocks);
        if blocks == 0 || blocks > ec.num_blocks {
            return Err(ModelError::Request(format!(
                "num_blocks {blocks} outside 1..={} (the model's pool)",
                ec.num_blocks
            )));
        }
        let context = model.shape.context;
        if let Some(m) = cfg.max_model_len.filter(|&m| m < 2 || m > context) {
            return Err(ModelError::Request(format!(
                "max_model_len {m} outside 2..={context} (the model's context)"
            )));
        }
        // Each layer group's pool (one for a model whose layers attend
        // alike): `num_blocks` caps every one.
        let pools: Vec<BlockManagerConfig> = model
            .kv
            .iter()
            .map(|kg| {
                let mut bc = BlockManagerConfig::new(
                    blocks.min(kg.cache.config().num_blocks),
                    ec.block_size,
                )
                .with_prefix_caching(cfg.prefix_caching)
                .with_swap_space(cfg.swap_blocks);
                bc.max_seq_len = cfg.max_model_len.unwrap_or(context);
                bc
            })
            .collect();
        let mut sc = SchedulerConfig::new(cfg.max_batch_tokens, cfg.max_seqs);
        sc.preemption = cfg.preemption;
        sc.reservation = cfg.reservation;
        let sched = if pools.len() == 1 {
            Scheduler::new(pools[0], sc)?
        } else {
            Scheduler::with_groups(model.kv_layout(), &pools, sc)?
        };
        let swap = match cfg.swap_blocks {
            0 => Vec::new(),
            n => model
                .kv
                .iter()
                .map(|kg| kg.cache.swap_space(n))
                .collect::<Result<_, _>>()?,
        };
        Ok(Self {
            model,
            sched,
            cfg,
            swap,
            reqs: HashMap::new(),
            stats: ServeStats::default(),
            profile: None,
            last_copies: Vec::new(),
            remote: HashMap::new(),
            imported_blocks: 0,
            token_text: Vec::new(),
        })
    }

    /// Gives the model back (its pool is then free to reconfigure).
    pub fn into_model(self) -> Model {
        self.model
    }

    /// The scheduling configuration.
    pub fn config(&self) -> &ServerConfig {
        &self.cfg
    }

    /// The text of every token, by id, as answers show it (a tokenizer's
    /// bytes; control tokens usually empty): what stop strings are matched
    /// against and what [`Generated::text`] holds. Needs one entry per
    /// vocabulary token.
    pub fn set_token_text(&mut self, text: Vec<Vec<u8>>) -> Result<(), ModelError> {
        if text.len() != self.model.shape.vocab {
            return Err(ModelError::Request(format!(
                "{} token texts for a vocabulary of {}",
                text.len(),
                self.model.shape.vocab
            )));
        }
        self.token_text = text;
        Ok(())
    }

    /// Drops a request wherever it is (queued, running, swapped out),
    /// returning its blocks to the pool at once. Between steps only; an
    /// unknown or ended request is an error.
    pub fn abort(&mut self, request: RequestId) -> Result<(), ModelError> {
        self.sched.abort(request)?;
        self.reqs.remove(&request);
        self.remote.remove(&request);
        Ok(())
    }

    /// The longest sequence served, prompt and output.
    pub fn max_model_len(&self) -> usize {
        self.sched.blocks().config().max_seq_len
    }

    /// Requests queued, running or swapped out.
    pub fn requests(&self) -> usize {
        self.reqs.len()
    }

    /// Queues a request, after checking it against the model and the pool.
    pub fn add(&mut self, req: Request) -> Result<RequestId, ModelError> {
        self.add_with_remote(req, Vec::new())
    }

    /// [`add`](Self::add) for a request whose prompt's leading full blocks
    /// another engine computed: `remote` holds them in prompt order (the
    /// blocks of the first digests of `sched.blocks().prompt_hashes`, each
    /// with its descriptor, as `KvCache::export_blocks` wrote them). At
    /// admission the ones the local cache lacks are imported and their
    /// tokens are not computed; an import refused fails that step.
    pub fn add_with_remote(
        &mut self,
        req: Request,
        remote: Vec<(KvLayout, Vec<u8>)>,
    ) -> Result<RequestId, ModelError> {
        let shape = self.model.shape;
        let bad = |m: String| Err(ModelError::Request(m));
        let (p, n) = (req.prompt.len(), req.max_tokens);
        if p == 0 {
            return bad("an empty prompt".into());
        }
        if n == 0 {
            return bad("max_tokens 0: nothing to generate".into());
        }
        if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= shape.vocab) {
            return bad(format!(
                "prompt token {t} outside the vocabulary of {}",
                shape.vocab
            ));
        }
        let limit = self.max_model_len();
        if p + n > limit {
            return bad(format!(
                "prompt of {p} tokens + max_tokens {n} = {} is past the longest sequence served, {limit} tokens",
                p + n,
            ));
        }
        let w = req.width();
        match req.decoding {
            Decoding::Sample { params, n } => {
                params.validate(shape.vocab)?;
                if n == 0 || n > self.cfg.max_seqs {
                    return bad(format!(
                        "{n} samples outside 1..={} (max_seqs)",
                        self.cfg.max_seqs
                    ));
                }
            }
            Decoding::Beam { width } => {
                if width == 0 || width > self.cfg.max_seqs {
                    return bad(format!(
                        "beam width {width} outside 1..={} (max_seqs)",
                        self.cfg.max_seqs
                    ));
                }
                if !req.penalties.is_none() {
                    return bad("penalties apply to sampling, not to beam search".into());
                }
                if !req.logit_bias.is_empty() {
                    return bad("logit_bias applies to sampling, not to beam search".into());
                }
            }
        }
        req.penalties.validate()?;
        // Checked again against this model's vocabulary (a caller may
        // have built it for another).
        LogitBias::new(req.logit_bias.entries().to_vec(), shape.vocab)?;
        if !req.stop_strings.is_empty() && self.token_text.is_empty() {
            return bad("stop strings need the tokens' text (Server::set_token_text)".into());
        }
        if let Some(e) = req.expected_tokens.filter(|&e| e == 0 || e > n) {
            return bad(format!("expected_tokens {e} outside 1..=max_tokens {n}"));
        }
        let bs = self.model.cfg.block_size as usize;
        // The whole request alone: its prompt, then each sequence's growth
        // (in a window group, no more than its window's blocks besides
        // the prompt, which its prefill takes whole).
        let full = blocks_for(p + n, bs) + (w - 1) * (blocks_for(n, bs) + 1);
        for g in 0..self.sched.num_groups() {
            let pool = self
                .sched
                .group_blocks(g)
                .map_or(0, |m| m.config().num_blocks as usize);
            let need = match self.sched.group_kinds()[g] {
                GroupKind::Full => full,
                GroupKind::Window(win) | GroupKind::SinksAndWindow { window: win, .. } => {
                    full.min(blocks_for(p, bs) + w * (blocks_for(win as usize + 2 * bs, bs) + 1))
                }
            };
            if need > pool {
                return bad(format!(
                    "prompt of {p} tokens, {w} sequences of up to {n} more need up to {need} blocks of {bs}; the pool{} holds {pool}",
                    if self.sched.num_groups() > 1 { format!(" of layer group {g}") } else { String::new() }
                ));
            }
        }
        // With layer groups, each block comes once per group, in group
        // order, each naming its group.
        let groups = self.sched.num_groups();
        if !remote.len().is_multiple_of(groups) {
            return bad(format!(
                "{} remote entries for {groups} layer groups: each block needs one per group",
                remote.len()
            ));
        }
        if let Some((i, (l, _))) = remote
            .iter()
            .enumerate()
            .find(|(i, (l, _))| l.layer_group as usize != i % groups)
        {
            return bad(format!(
                "remote entry {i} holds layer group {}'s blocks; block {} of group {} belongs there",
                l.layer_group,
                i / groups,
                i % groups
            ));
        }
        let admission = Admission {
            remote_blocks: remote.len() / groups,
            max_tokens: Some(n),
            expected_tokens: req.expected_tokens,
        };
        let id = self
            .sched
            .add_request_with(&req.prompt, w, &req.salt, admission)?;
        if !remote.is_empty() {
            self.remote.insert(id, remote);
        }
        self.stats.contiguous_blocks += w * blocks_for(p + n, bs);
        self.reqs.insert(
            id,
            State {
                req,
                started: false,
                live: Vec::new(),
                done: Vec::new(),
                cached_tokens: None,
            },
        );
        Ok(id)
    }

    /// What `request` has generated so far; `None` once it ended (its
    /// [`Completion`] came out of a step) or for an unknown id.
    pub fn progress(&self, request: RequestId) -> Option<Progress> {
        let st = self.reqs.get(&request)?;
        Some(Progress {
            live: st.live.iter().map(|l| l.gen.clone()).collect(),
            done: st.done.clone(),
        })
    }

    /// Whether any request is still queued, running or swapped.
    pub fn has_work(&self) -> bool {
        self.sched.has_work()
    }

    /// Runs every request to its end; `on_token(request, sequence)` sees
    /// each sequence as a token is chosen for it (the token is its last).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn run(
        &mut self,
        on_token: &mut dyn FnMut(RequestId, &Generated),
    ) -> Result<Vec<Completion>, ModelError> {
        let mut out = Vec::new();
        while self.has_work() {
            out.extend(self.step(on_token)?);
        }
        Ok(out)
    }

    /// One scheduler step; returns the requests that ended in it.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn step(
        &mut self,
        on_token: &mut dyn FnMut(RequestId, &Generated),
    ) -> Result<Vec<Completion>, ModelError> {
        pollster::block_on(self.step_async(on_token))
    }

    /// [`step`](Self::step) without blocking the thread (the browser's
    /// path). Swapping blocks natively only: a browser's server has no
    /// swap space.
    pub async fn step_async(
        &mut self,
        on_token: &mut dyn FnMut(RequestId, &Generated),
    ) -> Result<Vec<Completion>, ModelError> {
        let t0 = Instant::now();
        let step = self.sched.schedule()?;
        match self.run_step(&step, t0, on_token).await {
            Ok(ended) => Ok(ended),
            Err(source) => {
                // The step did not run: the K/V of every request it could
                // have touched is in doubt. Drop those (waiting requests
                // stay queued) so that the scheduler serves on.
                let aborted = self.sched.abandon(&step)?;
                for r in &aborted {
                    self.reqs.remove(r);
                    self.remote.remove(r);
                }
                self.stats.aborted += aborted.len();
                Err(ModelError::StepFailed {
                    aborted,
                    source: Box::new(source),
                })
            }
        }
    }

    /// Runs a scheduled step and commits it.
    async fn run_step(
        &mut self,
        step: &Step,
        t0: Instant,
        on_token: &mut dyn FnMut(RequestId, &Generated),
    ) -> Result<Vec<Completion>, ModelError> {
        self.last_copies.clear();
        self.last_copies.extend_from_slice(&step.view().copies);
        let mut ended = Vec::new();
        for &r in step.aborted() {
            let cached_tokens = self.reqs.remove(&r).and_then(|s| s.cached_tokens);
            self.remote.remove(&r);
            self.stats.aborted += 1;
            ended.push(Completion {
                request: r,
                sequences: Vec::new(),
                aborted: true,
                cached_tokens: cached_tokens.unwrap_or(0),
            });
        }
        self.stats.preempted += step.preempted().len();
        self.import_remote(step).await?;
        self.run_swaps(step).await?;
        if step.rows().is_empty() {
            for f in self.sched.commit(step, &[])? {
                ended.push(self.finish(f.request));
            }
            return Ok(ended);
        }
        let mut positions = Vec::with_capacity(step.tokens().len());
        let mut logit_rows = Vec::new();
        let mut row_of = HashMap::new();
        let mut prompt_work = false;
        for row in step.rows() {
            positions.extend(row.positions.clone().map(|p| p as u32));
            if row.logits {
                row_of.insert((row.request, row.index), logit_rows.len());
                logit_rows.push(positions.len() as u32 - 1);
            }
            let st = self.reqs.get_mut(&row.request);
            let started = st.as_ref().is_some_and(|s| s.started);
            if let Some(st) = st {
                // A request's first row starts after its cached prefix.
                st.cached_tokens.get_or_insert(row.positions.start);
            }
            prompt_work |= row.positions.len() > 1 || !started;
        }
        let more: Vec<&pagedattn::blocks::BatchView> = (1..step.num_groups())
            .filter_map(|g| step.group(g).map(|gs| gs.view))
            .collect();
        let input = StepInput {
            view: step.view(),
            more: &more,
            tokens: step.tokens(),
            positions: &positions,
            logit_rows: &logit_rows,
        };
        let logits = self.model.forward_async(&input).await?;
        let mut profile_secs = 0.0;
        if !prompt_work && self.profile.is_some_and(|r| step.rows().len() >= r) {
            self.profile = None;
            let tp = Instant::now();
            let full = time_step(&mut self.model, &input, false).await?;
            let without = time_step(&mut self.model, &input, true).await?;
            self.stats.attention_share = Some((1.0 - without / full).clamp(0.0, 1.0));
            self.stats.profiled_rows = step.rows().len();
            profile_secs = tp.elapsed().as_secs_f64();
        }
        // Each logit row's log-probabilities, once: sampling, beam scores
        // and the recorded top-N all read them.
        let vocab = self.model.shape.vocab;
        let rows: Vec<&[f32]> = logits.chunks_exact(vocab).collect();
        let lps: Vec<Vec<f64>> = rows.iter().map(|r| log_softmax(r)).collect();
        let empty: &[u8] = &[];
        let texts = &self.token_text;
        let text_of = |t: u32| texts.get(t as usize).map_or(empty, |b| &b[..]);
        let mut outputs = Vec::with_capacity(step.sample().len());
        let (row_of, rows, lps) = (&row_of, &rows, &lps);
        for &request in step.sample() {
            let st = self
                .reqs
                .get_mut(&request)
                .ok_or(ModelError::Request(format!("unknown request {request}")))?;
            let rows_of = move |i: usize| {
                let row = row_of.get(&(request, i)).map(|&r| (rows[r], &lps[r][..]));
                row.ok_or_else(|| ModelError::Step(format!("no logits for {request} sequence {i}")))
            };
            let children = st.advance(&rows_of, &text_of, &mut |g| on_token(request, g))?;
            outputs.push(GroupOutput { request, children });
        }
        let st = self.note_group_blocks();
        let finished = self.sched.commit(step, &outputs)?;
        for f in finished {
            ended.push(self.finish(f.request));
        }
        let secs = t0.elapsed().as_secs_f64() - profile_secs;
        let s = &mut self.stats;
        s.steps += 1;
        s.copies += step.view().copies.len();
        s.peak_batch = s.peak_batch.max(step.rows().len());
        s.peak_blocks_used = s.peak_blocks_used.max(st.used);
        s.peak_blocks_shared = s.peak_blocks_shared.max(st.shared);
        if prompt_work {
            s.prefill_tokens += step.tokens().len();
            s.prefill_secs += secs;
            s.prefill_steps += 1;
        } else {
            s.decode_tokens += step.tokens().len();
            s.decode_secs += secs;
        }
        Ok(ended)
    }

    /// The pool that holds every block of every sequence: the first
    /// full-attention layer group's (group 0's when every group attends
    /// through a window, or the model's layers share one pool). What the
    /// counters and the server's gauges report.
    pub fn primary_blocks(&self) -> &pagedattn::blocks::BlockManager {
        let full = (0..self.sched.num_groups())
            .find(|&g| self.sched.group_kinds()[g] == GroupKind::Full)
            .unwrap_or(0);
        self.sched
            .group_blocks(full)
            .unwrap_or_else(|| self.sched.blocks())
    }

    /// Each layer group's blocks held now, into the peaks; returns the
    /// stats of the [`primary_blocks`](Self::primary_blocks) pool (each
    /// group's counted once a step).
    fn note_group_blocks(&mut self) -> pagedattn::blocks::BlockStats {
        let layout = self.model.kv_layout();
        let (mut held, mut full) = (0, 0);
        let mut primary = None;
        for (g, group) in layout.groups().iter().enumerate() {
            let st = self
                .sched
                .group_blocks(g)
                .expect("a pool per group")
                .stats();
            let used = st.used;
            let k = g.min(MAX_SCHEDULER_GROUPS - 1);
            let peak = &mut self.stats.peak_group_blocks[k];
            *peak = (*peak).max(used);
            self.stats.last_group_blocks[k] = used;
            held += used * group.layers.len();
            if group.kind == GroupKind::Full && full == 0 {
                full = used * layout.num_layers() as usize;
                primary = Some(st);
            } else if g == 0 {
                primary.get_or_insert(st);
            }
        }
        self.stats.most_layer_blocks_saved = self
            .stats
            .most_layer_blocks_saved
            .max(full.saturating_sub(held));
        self.stats.last_layer_blocks = held;
        self.stats.last_full_retention_layer_blocks = full;
        if held > self.stats.peak_layer_blocks {
            self.stats.peak_layer_blocks = held;
            self.stats.full_retention_layer_blocks = full;
        }
        primary.expect("one group at least")
    }

    /// The step's imports: each request's remote prefix blocks uploaded
    /// into the blocks the scheduler gave them.
    /// With layer groups, each group's blocks into its own pool.
    async fn import_remote(&mut self, step: &Step) -> Result<(), ModelError> {
        let gpu = &self.model.gpu;
        let groups = step.num_groups();
        let mut done = Vec::new();
        for g in 0..groups {
            for (r, blocks) in step.group(g).expect("g < groups").imports {
                done.push(*r);
                let all = self.remote.get(r).map_or(&[][..], |v| &v[..]);
                let found: Vec<&(KvLayout, Vec<u8>)> = all.iter().skip(g).step_by(groups).collect();
                // The local cache's hits come first: the imports are the last.
                let skip = found.len().checked_sub(blocks.len()).ok_or_else(|| {
                    ModelError::Request(format!("{r:?}: more imports than remote blocks"))
                })?;
                let found = &found[skip..];
                let Some((layout, _)) = found.first() else {
                    continue;
                };
                // One import (one descriptor check, one upload) for the
                // request's blocks; blocks of mixed layouts go one by one.
                let ids: Vec<u32> = blocks.iter().map(|b| b.0).collect();
                let cache = &mut self.model.kv[g].cache;
                if found.iter().all(|(l, _)| l == layout) {
                    let bytes: Vec<u8> =
                        found.iter().flat_map(|(_, b)| b.iter().copied()).collect();
                    cache.import_blocks_async(gpu, layout, &bytes, &ids).await?;
                } else {
                    for (id, (layout, bytes)) in ids.iter().zip(found) {
                        cache
                            .import_blocks_async(gpu, layout, bytes, &[*id])
                            .await?;
                    }
                }
                if g == 0 {
                    self.imported_blocks += ids.len();
                }
            }
        }
        for r in done {
            self.remote.remove(&r);
        }
        Ok(())
    }

    /// The leading full blocks of `prompt` (in `salt`'s namespace) that
    /// every layer group's prefix cache holds, exported: for each block,
    /// one entry per group in group order, each with a layout naming its
    /// group. What [`add_with_remote`](Self::add_with_remote) takes on
    /// another server of this model.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn export_prefix(
        &self,
        prompt: &[u32],
        salt: &[u8],
    ) -> Result<Vec<(KvLayout, Vec<u8>)>, ModelError> {
        let groups = self.sched.num_groups();
        let per_group: Vec<Vec<u32>> = (0..groups)
            .map(|g| {
                self.sched
                    .group_blocks(g)
                    .map_or_else(Vec::new, |m| m.cached_blocks(prompt, salt))
            })
            .collect();
        let n = per_group.iter().map(Vec::len).min().unwrap_or(0);
        let mut out = Vec::with_capacity(n * groups);
        for i in 0..n {
            for (g, blocks) in per_group.iter().enumerate() {
                let cache = &self.model.kv[g].cache;
                let layers = 0..cache.config().num_layers;
                let mut bytes = vec![0u8; cache.export_bytes(1, layers.clone())? as usize];
                let layout =
                    cache.export_blocks(&self.model.gpu, &[blocks[i]], layers, &mut bytes)?;
                out.push((layout, bytes));
            }
        }
        Ok(out)
    }

    /// The step's swaps: out to the swap space first, then back in.
    /// Each layer group's in its own pool and swap space.
    async fn run_swaps(&mut self, step: &Step) -> Result<(), ModelError> {
        for g in 0..step.num_groups() {
            let gs = step.group(g).expect("g < groups");
            if gs.swap_out.is_empty() && gs.swap_in.is_empty() {
                continue;
            }
            let gpu = &self.model.gpu;
            let space = self.swap.get_mut(g).ok_or_else(|| {
                ModelError::Request("the scheduler swapped without swap space".into())
            })?;
            let cache = &self.model.kv[g].cache;
            if !gs.swap_out.is_empty() {
                cache.swap_out_async(gpu, gs.swap_out, space).await?;
                if g == 0 {
                    self.stats.swapped_out_blocks += gs.swap_out.len();
                }
            }
            if !gs.swap_in.is_empty() {
                cache.swap_in(gpu, gs.swap_in, space)?;
            }
        }
        Ok(())
    }

    fn finish(&mut self, request: RequestId) -> Completion {
        let (mut sequences, beams, cached_tokens) = match self.reqs.remove(&request) {
            Some(s) => (
                s.done,
                matches!(s.req.decoding, Decoding::Beam { .. }),
                s.cached_tokens.unwrap_or(0),
            ),
            None => (Vec::new(), false, 0),
        };
        if beams {
            sequences.sort_by(|a, b| b.score.total_cmp(&a.score));
        } else {
            sequences.sort_by_key(|g| g.branch);
        }
        Completion {
            request,
            sequences,
            aborted: false,
            cached_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_match_the_earliest_place_from_where_they_can_start() {
        let stops = vec![b"END".to_vec(), b"\n\n".to_vec(), Vec::new()];
        assert_eq!(find_stop(b"abc\n\nxEND", 0, &stops), Some((1, 3)));
        assert_eq!(find_stop(b"abcEND\n\n", 0, &stops), Some((0, 3)));
        // Not before `from`, and not past the text.
        assert_eq!(find_stop(b"abcEND", 4, &stops), None);
        assert_eq!(find_stop(b"EN", 0, &stops), None);
        assert_eq!(find_stop(b"xEND", 1, &stops), Some((0, 1)));
        let g = Generated {
            text: b"hello END".to_vec(),
            finish: Some(Finish::Text { index: 0, at: 6 }),
            ..Generated::default()
        };
        assert_eq!(g.answer(), b"hello ");
        let g = Generated {
            finish: Some(Finish::Length),
            ..g
        };
        assert_eq!(g.answer(), b"hello END");
    }
}
