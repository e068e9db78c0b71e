//! The engine thread: it owns the device, the model and the scheduler, and
//! steps while there is work. Handlers hand it jobs through a channel; each
//! job streams its events back through its own channel. A job whose
//! receiver is gone (the client left) is aborted before the next step, so
//! its blocks are back within a step and no other stream notices.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use pagedattn::blocks::RequestId;
use pagedattn_model::defaults::GenerationDefaults;
use pagedattn_model::engine::{EngineConfig, Model};
use pagedattn_model::generate::open_device;
use pagedattn_model::load::Loaded;
use pagedattn_model::serve::{Finish, Generated, Request, Server, ServerConfig};
use pagedattn_model::tokenizer::Tokenizer;
use pagedattn_model::ModelError;
use tokio::sync::mpsc;

use crate::metrics::Metrics;
use crate::{ApiError, ServeConfig};

/// What a handler needs of the model once it is loaded.
pub struct ModelInfo {
    pub tokenizer: Tokenizer,
    /// Each token's text as answers show it (control tokens empty).
    pub token_text: Vec<Vec<u8>>,
    /// The longest sequence served (the model's context, or
    /// `--max-model-len`).
    pub context: usize,
    pub vocab: usize,
    /// Tokens that end an answer unless `ignore_eos`.
    pub eos: Vec<u32>,
    pub adapter: String,
    /// What requests get for the sampling fields and `max_tokens` they
    /// omit: the model's defaults with the command line's on top.
    pub defaults: GenerationDefaults,
}

/// State the handlers and the engine thread share.
pub struct Shared {
    pub cfg: ServeConfig,
    pub model_name: String,
    /// Set once the model is loaded and warmed up.
    pub model: OnceLock<ModelInfo>,
    /// Why loading failed, if it did.
    pub failed: Mutex<Option<String>>,
    /// Requests handed to the engine and not yet ended.
    pub in_flight: AtomicUsize,
    /// Shutting down: new requests get 503.
    pub draining: AtomicBool,
    pub metrics: Metrics,
}

impl Shared {
    pub fn new(cfg: ServeConfig) -> Self {
        Self {
            model_name: cfg.model_name(),
            cfg,
            model: OnceLock::new(),
            failed: Mutex::new(None),
            in_flight: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            metrics: Metrics::new(),
        }
    }

    /// The loaded model, or the 503 to answer while there is none.
    pub fn ready(&self) -> Result<&ModelInfo, ApiError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        match self.model.get() {
            Some(m) => Ok(m),
            None => match self.failed.lock().ok().and_then(|f| f.clone()) {
                Some(why) => Err(ApiError::unavailable(format!(
                    "the model failed to load: {why}"
                ))),
                None => Err(ApiError::unavailable("the model is loading")),
            },
        }
    }
}

/// A request for the engine.
pub struct Job {
    pub request: Request,
    /// Send a [`Event::Token`] for every token (streamed samples).
    pub stream: bool,
    pub events: mpsc::UnboundedSender<Event>,
    pub arrived: Instant,
}

/// One token of a streamed sample.
#[derive(Clone, Debug)]
pub struct TokenEvent {
    pub branch: usize,
    pub token: u32,
    pub logprob: f64,
    pub top: Vec<(u32, f64)>,
    pub finish: Option<Finish>,
    /// Where the answer ends, when a stop string cut it.
    pub answer_len: Option<usize>,
}

/// What the engine tells a job's handler.
#[derive(Debug)]
pub enum Event {
    /// Queued (the request passed the engine's checks).
    Accepted,
    /// Refused by the engine's checks: answer it.
    Rejected(ApiError),
    Token(TokenEvent),
    /// Every sequence ended: samples by branch, beams best first.
    Done {
        sequences: Vec<Generated>,
        cached_tokens: usize,
    },
    /// Dropped (shutdown, or a step the device failed).
    Failed(ApiError),
}

/// What the handlers send the engine.
pub enum Command {
    Submit(Job),
    /// Abort everything in flight (the shutdown's deadline passed).
    AbortAll(String),
}

struct Running {
    events: mpsc::UnboundedSender<Event>,
    stream: bool,
    arrived: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    /// The step that last gave it a token (one ITL sample a step).
    last_step: u64,
}

/// Starts the engine thread: it loads the model, then serves `commands`
/// until every sender is gone and no work is left. The result of loading
/// goes to `loaded` (an error ends the thread).
pub fn spawn(
    shared: Arc<Shared>,
    commands: mpsc::UnboundedReceiver<Command>,
    loaded: tokio::sync::oneshot::Sender<Result<(), String>>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("pagedattn-engine".into())
        .spawn(move || match start(&shared) {
            Ok(server) => {
                let _ = loaded.send(Ok(()));
                serve(&shared, server, commands);
            }
            Err(e) => {
                let why = e.to_string();
                if let Ok(mut f) = shared.failed.lock() {
                    *f = Some(why.clone());
                }
                let _ = loaded.send(Err(why));
            }
        })
}

/// Loads the model, opens the device, warms every pipeline up with one
/// short request, and publishes what handlers need.
fn start(shared: &Shared) -> Result<Server, ModelError> {
    let cfg = &shared.cfg;
    let Loaded {
        weights, tokenizer, ..
    } = cfg.source().load()?;
    let defaults = GenerationDefaults::resolve(weights.arch.arch, &cfg.generation)?;
    eprintln!(
        "pagedattn serve: requests that omit them get {} ({})",
        defaults.describe(),
        defaults.source
    );
    let (device, queue, adapter) = open_device(cfg.backends)?;
    let ecfg = EngineConfig {
        num_blocks: cfg.num_blocks,
        block_size: 16,
        kv_dtype: cfg.kv_dtype,
        max_rows: cfg.max_batch_tokens,
        max_logit_rows: cfg.max_seqs,
        ..EngineConfig::default()
    };
    let model = Model::new(&device, &queue, &weights, ecfg)?;
    drop(weights);
    let vocab = model.shape.vocab;
    let scfg = ServerConfig {
        max_seqs: cfg.max_seqs,
        max_batch_tokens: cfg.max_batch_tokens,
        preemption: cfg.preemption,
        swap_blocks: cfg.swap_blocks,
        prefix_caching: cfg.prefix_caching,
        num_blocks: None,
        reservation: cfg.reservation,
        max_model_len: cfg.max_model_len,
    };
    let mut server = Server::new(model, scfg)?;
    let context = server.max_model_len();
    let token_text: Vec<Vec<u8>> = (0..vocab as u32)
        .map(|t| {
            if tokenizer.is_control(t) {
                Vec::new()
            } else {
                tokenizer.token_bytes(t).to_vec()
            }
        })
        .collect();
    server.set_token_text(token_text.clone())?;
    // Compile what a step needs now, not in the first client's request: a
    // prompt of two blocks and a few decode steps, in a namespace no
    // tenant's salt can name.
    let warm = Request {
        salt: b"\xffwarm-up".to_vec(),
        ..Request::greedy((0..40).map(|i| 100 + i).collect(), 3)
    };
    server.add(warm)?;
    server.run(&mut |_, _| {})?;
    let eos = tokenizer.stop_ids();
    let _ = shared.model.set(ModelInfo {
        tokenizer,
        token_text,
        context,
        vocab,
        eos,
        adapter,
        defaults,
    });
    // With layer groups, the full-attention group's pool (every block of
    // every sequence).
    let total = server.primary_blocks().config().num_blocks;
    shared.metrics.blocks_total.set(total as i64);
    Ok(server)
}

fn finish_reason(g: &Generated) -> &'static str {
    match g.finish {
        Some(Finish::Length) | None => "length",
        Some(_) => "stop",
    }
}

/// The engine loop.
fn serve(shared: &Shared, mut server: Server, mut commands: mpsc::UnboundedReceiver<Command>) {
    let m = &shared.metrics;
    let mut jobs: HashMap<RequestId, Running> = HashMap::new();
    let mut step_no: u64 = 0;
    let mut open = true;
    let mut hits_seen = server.sched.blocks().prefix_hit_tokens();
    let end = |shared: &Shared| {
        shared.in_flight.fetch_sub(1, Ordering::SeqCst);
    };
    loop {
        // Idle: wait for a command (none left and no work: done).
        if !server.has_work() && jobs.is_empty() {
            if !open {
                break;
            }
            match commands.blocking_recv() {
                Some(c) => take(shared, &mut server, &mut jobs, c),
                None => break,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(c) => take(shared, &mut server, &mut jobs, c),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        // What came in counts before the step runs (a long step would
        // otherwise hide it).
        gauges(m, &server);
        // Clients that left: their requests go, blocks and all.
        let gone: Vec<RequestId> = jobs
            .iter()
            .filter(|(_, j)| j.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            if server.abort(id).is_ok() {
                m.ended("abort");
            }
            jobs.remove(&id);
            end(shared);
        }
        if server.has_work() {
            step_no += 1;
            let now_step = step_no;
            let copies_before = server.stats.copies;
            let preempted_before = server.stats.preempted;
            let result = server.step(&mut |rid, g| {
                m.generation_tokens.inc();
                let Some(j) = jobs.get_mut(&rid) else { return };
                let now = Instant::now();
                if j.first.is_none() {
                    j.first = Some(now);
                    m.ttft.observe((now - j.arrived).as_secs_f64());
                }
                if j.last_step != now_step {
                    if let Some(last) = j.last {
                        m.itl.observe((now - last).as_secs_f64());
                    }
                    j.last = Some(now);
                    j.last_step = now_step;
                }
                if j.stream {
                    let n = g.tokens.len();
                    let _ = j.events.send(Event::Token(TokenEvent {
                        branch: g.branch,
                        token: g.tokens[n - 1],
                        logprob: g.logprobs[n - 1],
                        top: g.top.last().cloned().unwrap_or_default(),
                        finish: g.finish,
                        answer_len: match g.finish {
                            Some(Finish::Text { at, .. }) => Some(at),
                            _ => None,
                        },
                    }));
                }
            });
            m.steps.inc();
            m.cow_copies
                .inc_by((server.stats.copies - copies_before) as u64);
            m.preemptions
                .inc_by((server.stats.preempted - preempted_before) as u64);
            match result {
                Ok(done) => {
                    for c in done {
                        let Some(j) = jobs.remove(&c.request) else {
                            continue;
                        };
                        end(shared);
                        if c.aborted {
                            m.ended("error");
                            let _ = j.events.send(Event::Failed(ApiError::server(
                                "the request outgrew the KV pool and was dropped",
                            )));
                            continue;
                        }
                        m.e2e.observe(j.arrived.elapsed().as_secs_f64());
                        let reason = c.sequences.first().map_or("length", finish_reason);
                        m.ended(reason);
                        let _ = j.events.send(Event::Done {
                            sequences: c.sequences,
                            cached_tokens: c.cached_tokens,
                        });
                    }
                }
                Err(ModelError::StepFailed { aborted, source }) => {
                    eprintln!("pagedattn serve: a step failed: {source}");
                    for r in aborted {
                        if let Some(j) = jobs.remove(&r) {
                            end(shared);
                            m.ended("error");
                            let _ = j.events.send(Event::Failed(ApiError::server(format!(
                                "the engine failed the step: {source}"
                            ))));
                        }
                    }
                }
                Err(e) => {
                    // A broken invariant: say so to everyone and start over.
                    eprintln!("pagedattn serve: the scheduler failed: {e}");
                    abort_all(
                        shared,
                        &mut server,
                        &mut jobs,
                        &format!("the engine failed: {e}"),
                    );
                }
            }
        }
        // Gauges, after the step.
        gauges(m, &server);
        let hits = server.sched.blocks().prefix_hit_tokens();
        m.prefix_hits.inc_by(hits.saturating_sub(hits_seen));
        hits_seen = hits;
        let q = m.prefix_queries.get();
        if q > 0 {
            m.prefix_hit_rate.set(m.prefix_hits.get() as f64 / q as f64);
        }
    }
}

/// The pool's and the queues' gauges, as the server stands.
fn gauges(m: &Metrics, server: &Server) {
    let st = server.primary_blocks().stats();
    let (w, r, s) = server.sched.queue_lengths();
    m.blocks_used.set(st.used as i64);
    m.blocks_shared.set(st.shared as i64);
    m.blocks_free.set(st.free as i64);
    m.blocks_cached.set(st.evictable as i64);
    m.blocks_reserved.set(server.sched.reserved_blocks() as i64);
    m.kv_usage.set(st.used as f64 / st.total.max(1) as f64);
    m.tokens_stored.set(st.tokens_stored as i64);
    m.tokens_logical.set(st.logical_tokens as i64);
    m.swap_used.set(st.swap_used as i64);
    m.set_scheduler_waiting(w as i64);
    m.running.set(r as i64);
    m.swapped.set(s as i64);
}

/// Takes one command.
fn take(shared: &Shared, server: &mut Server, jobs: &mut HashMap<RequestId, Running>, c: Command) {
    match c {
        Command::Submit(job) => {
            shared.metrics.pending.dec();
            let prompt = job.request.prompt.len();
            match server.add(job.request) {
                Ok(id) => {
                    shared.metrics.prompt_tokens.inc_by(prompt as u64);
                    shared.metrics.prefix_queries.inc_by(prompt as u64);
                    let _ = job.events.send(Event::Accepted);
                    jobs.insert(
                        id,
                        Running {
                            events: job.events,
                            stream: job.stream,
                            arrived: job.arrived,
                            first: None,
                            last: None,
                            last_step: 0,
                        },
                    );
                }
                Err(e) => {
                    shared.in_flight.fetch_sub(1, Ordering::SeqCst);
                    let _ = job
                        .events
                        .send(Event::Rejected(ApiError::invalid(e.to_string())));
                }
            }
        }
        Command::AbortAll(why) => abort_all(shared, server, jobs, &why),
    }
}

fn abort_all(
    shared: &Shared,
    server: &mut Server,
    jobs: &mut HashMap<RequestId, Running>,
    why: &str,
) {
    for (id, j) in jobs.drain() {
        let _ = server.abort(id);
        shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        shared.metrics.ended("abort");
        let _ = j
            .events
            .send(Event::Failed(ApiError::unavailable(why.to_string())));
    }
}
