//! The real model on the page: SmolLM2-135M (the `pagedattn-model` crate,
//! the same engine code as the native `pagedattn generate`) served on the
//! page's WebGPU device, one scheduler step per call, with a snapshot of
//! the KV pool after every step.
//!
//! Nothing here reimplements the engine: the page draws what the
//! scheduler's block manager holds. What this module adds is the view
//! (which request and sequence holds each block, the copy-on-write copies
//! of the step, the text of every sequence so far) and an independent
//! recount of the shared blocks from the block tables, so that the page and
//! its end-to-end test can compare what is drawn with the engine's counts.

use std::cell::RefCell;
use std::rc::Rc;

use serde::{Deserialize, Serialize};
use wasm_bindgen::prelude::*;

use pagedattn::blocks::{Preemption, RequestId};
use pagedattn::gpu::KvDtype;
use pagedattn_model::engine::{DecodeMatmul, EngineConfig, Model};
use pagedattn_model::gguf::Gguf;
use pagedattn_model::load::from_gguf;
use pagedattn_model::sample::SamplingParams;
use pagedattn_model::serve::{Completion, Decoding, Generated, Request, Server, ServerConfig};
use pagedattn_model::tokenizer::Tokenizer;

use crate::{err, gpu, json, BlockView, Tally};

/// What the page may choose when it loads the model.
#[derive(Clone, Debug, Deserialize)]
struct LoadConfig {
    /// Pool blocks (every layer); more than the device's binding limit
    /// holds is refused, with the largest count that fits.
    num_blocks: u32,
    /// Tokens per block.
    block_size: u32,
    /// Tokens one step may carry (also the prefill chunk).
    max_batch_tokens: usize,
    /// "f32" (default: the reference fixture's pool) or "f16".
    #[serde(default)]
    kv_dtype: Option<String>,
    /// "auto" (default: the engine's pick for the adapter), "tiled" or
    /// "split-k": the matmul of decode steps.
    #[serde(default)]
    decode_matmul: Option<String>,
}

/// One generation request from the page.
#[derive(Clone, Debug, Deserialize)]
struct GenerateConfig {
    prompt: String,
    /// "greedy", "sample" or "beam".
    mode: String,
    /// Samples (mode "sample") or beams (mode "beam").
    #[serde(default = "one")]
    n: usize,
    max_tokens: usize,
    #[serde(default)]
    temperature: f32,
    #[serde(default)]
    top_k: usize,
    #[serde(default = "top_p_default")]
    top_p: f32,
    #[serde(default)]
    seed: u64,
}

fn one() -> usize {
    1
}

fn top_p_default() -> f32 {
    1.0
}

struct ReqInfo {
    id: RequestId,
    mode: String,
    prompt: String,
    prompt_ids: Vec<u32>,
    completion: Option<Completion>,
}

struct Inner {
    /// `None` while a step is in flight (it owns the server across the await).
    server: Option<Server>,
    tokenizer: Tokenizer,
    requests: Vec<ReqInfo>,
    info: ModelInfo,
    steps: u64,
    last_step_ms: f64,
}

#[derive(Clone, Serialize)]
struct ModelInfo {
    adapter: String,
    /// The architecture the file names (`llama`, `gemma3`): the engine's
    /// step and the layer groups follow it.
    arch: String,
    /// Layer groups of the pool (one per window; 1 for llama).
    layer_groups: usize,
    kernel: String,
    /// The matmul decode steps run: "tiled" or "split-k".
    decode_matmul: &'static str,
    kv_dtype: &'static str,
    layers: usize,
    d_model: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    embed_format: String,
    file_mib: f64,
    num_blocks: u32,
    block_size: u32,
    /// Bytes of K and V one block holds over every layer.
    block_bytes: u64,
}

/// The model on the page's device, driven one step at a time.
#[wasm_bindgen]
pub struct WebModel {
    inner: Rc<RefCell<Inner>>,
}

/// Sequences one step may run (beams and samples of every request).
const MAX_SEQS: usize = 8;

#[wasm_bindgen]
impl WebModel {
    /// Parses `bytes` (a GGUF file: SmolLM2-135M-Instruct's, Gemma 3's, or
    /// another model of an architecture the engine knows, picked from the
    /// file as `generate` and the server pick it), uploads the weights, and builds the
    /// pool and kernels from `config` (JSON: num_blocks, block_size,
    /// max_batch_tokens, kv_dtype). A file the engine cannot run is refused
    /// with a message before anything reaches the device.
    pub async fn load(bytes: Vec<u8>, config: String) -> Result<WebModel, JsValue> {
        let lc: LoadConfig = serde_json::from_str(&config).map_err(err)?;
        let file_bytes = bytes.len() as u64;
        let g = gpu().await?;
        let loaded = {
            let gguf =
                Gguf::parse(bytes).map_err(|e| err(format!("not a usable GGUF file: {e}")))?;
            from_gguf(&gguf, file_bytes).map_err(err)?
        };
        let kv_dtype = match lc.kv_dtype.as_deref() {
            Some("f16") => KvDtype::F16,
            _ => KvDtype::F32,
        };
        let s = loaded.weights.shape;
        let decode_matmul = match lc.decode_matmul.as_deref() {
            None | Some("auto") => DecodeMatmul::Auto,
            Some("tiled") => DecodeMatmul::Tiled,
            Some("split-k") => DecodeMatmul::SplitK,
            Some(other) => {
                return Err(err(format!(
                    "decode_matmul {other:?} is not auto, tiled or split-k"
                )))
            }
        };
        let ecfg = EngineConfig {
            num_blocks: lc.num_blocks,
            block_size: lc.block_size,
            kv_dtype,
            max_rows: lc.max_batch_tokens,
            max_logit_rows: MAX_SEQS,
            decode_matmul,
            ..EngineConfig::default()
        };
        let model = Model::new_async(&g.device, &g.queue, &loaded.weights, ecfg)
            .await
            .map_err(err)?;
        // One block over every layer; the pool's size against the device's
        // limits was checked by the library (KvCache::new).
        let block_bytes = model.cache().config().block_bytes() * s.layers as u64;
        let info = ModelInfo {
            adapter: g.describe(),
            arch: format!("{:?}", loaded.config.arch.arch).to_lowercase(),
            layer_groups: model.num_groups(),
            kernel: model.kv[0].attn.kernel().to_string(),
            decode_matmul: match model.matmul_for(1) {
                DecodeMatmul::SplitK => "split-k",
                _ => "tiled",
            },
            kv_dtype: kv_dtype.name(),
            layers: s.layers,
            d_model: s.d_model,
            heads: s.heads,
            kv_heads: s.kv_heads,
            head_dim: s.head_dim,
            vocab: s.vocab,
            embed_format: format!("{:?}", model.embed_format()),
            file_mib: file_bytes as f64 / (1 << 20) as f64,
            num_blocks: lc.num_blocks,
            block_size: lc.block_size,
            block_bytes,
        };
        let scfg = ServerConfig {
            max_seqs: MAX_SEQS,
            max_batch_tokens: lc.max_batch_tokens,
            // No swap space in a browser: preemption recomputes.
            preemption: Preemption::Recompute,
            swap_blocks: 0,
            prefix_caching: true,
            num_blocks: None,
            ..ServerConfig::default()
        };
        let server = Server::new(model, scfg).map_err(err)?;
        Ok(WebModel {
            inner: Rc::new(RefCell::new(Inner {
                server: Some(server),
                tokenizer: loaded.tokenizer,
                requests: Vec::new(),
                info,
                steps: 0,
                last_step_ms: 0.0,
            })),
        })
    }

    /// The model and pool, as JSON.
    pub fn info(&self) -> Result<String, JsValue> {
        json(&self.inner.borrow().info)
    }

    /// Queues a request (JSON: prompt, mode "greedy" | "sample" | "beam",
    /// n, max_tokens, temperature, top_k, top_p, seed). The prompt is
    /// wrapped in the Instruct model's chat template. Resolves to JSON with
    /// the request id and its prompt's token ids; a bad request is refused
    /// with the engine's message and queues nothing.
    pub fn generate(&self, request: String) -> Result<String, JsValue> {
        let gc: GenerateConfig = serde_json::from_str(&request).map_err(err)?;
        let mut s = self.inner.borrow_mut();
        let Inner {
            server,
            tokenizer,
            requests,
            ..
        } = &mut *s;
        let server = server.as_mut().ok_or_else(|| err("a step is running"))?;
        let text = tokenizer.chat_prompt(&gc.prompt, None);
        let ids = tokenizer.encode(&text, true);
        let decoding = match gc.mode.as_str() {
            "greedy" => Decoding::Sample {
                params: SamplingParams::default(),
                n: 1,
            },
            "sample" => Decoding::Sample {
                params: SamplingParams {
                    temperature: gc.temperature,
                    top_k: gc.top_k,
                    min_p: 0.0,
                    top_p: gc.top_p,
                    seed: gc.seed,
                },
                n: gc.n,
            },
            "beam" => Decoding::Beam { width: gc.n },
            other => {
                return Err(err(format!(
                    "unknown mode {other:?}: greedy, sample or beam"
                )))
            }
        };
        let req = Request {
            decoding,
            stop: vec![tokenizer.eos_id()],
            ..Request::greedy(ids.clone(), gc.max_tokens)
        };
        let id = server.add(req).map_err(err)?;
        requests.push(ReqInfo {
            id,
            mode: gc.mode,
            prompt: gc.prompt,
            prompt_ids: ids.clone(),
            completion: None,
        });
        #[derive(Serialize)]
        struct Added {
            request: u64,
            prompt_ids: Vec<u32>,
        }
        json(&Added {
            request: id.number(),
            prompt_ids: ids,
        })
    }

    /// Runs one scheduler step (prefill chunks and decodes batched, on the
    /// GPU); resolves to the snapshot. With no work queued it resolves to
    /// the snapshot at once.
    pub fn step(&self) -> js_sys::Promise {
        let inner = self.inner.clone();
        wasm_bindgen_futures::future_to_promise(async move {
            let mut server = inner
                .borrow_mut()
                .server
                .take()
                .ok_or_else(|| err("a step is already running"))?;
            let t0 = js_sys::Date::now();
            let result = if server.has_work() {
                server.step_async(&mut |_, _| {}).await.map(Some)
            } else {
                Ok(None)
            };
            let mut s = inner.borrow_mut();
            s.server = Some(server);
            match result {
                Ok(Some(done)) => {
                    s.steps += 1;
                    s.last_step_ms = js_sys::Date::now() - t0;
                    for c in done {
                        if let Some(r) = s.requests.iter_mut().find(|r| r.id == c.request) {
                            r.completion = Some(c);
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => return Err(err(e)),
            }
            Ok(JsValue::from_str(&snapshot(&s)?))
        })
    }

    /// The current state as JSON (the same shape `step` resolves to).
    pub fn snapshot(&self) -> Result<String, JsValue> {
        snapshot(&self.inner.borrow())
    }
}

#[derive(Serialize)]
struct SeqView {
    request: u64,
    /// Index among its request's live sequences.
    index: usize,
    len: usize,
    table: Vec<u32>,
}

#[derive(Serialize)]
struct TextView {
    text: String,
    tokens: Vec<u32>,
    score: f64,
    done: bool,
}

#[derive(Serialize)]
struct RequestView {
    request: u64,
    mode: String,
    prompt: String,
    prompt_tokens: usize,
    finished: bool,
    aborted: bool,
    /// Live sequences first (beams as the scheduler holds them), then the
    /// ended ones; once finished, the completion's order (beams best first).
    sequences: Vec<TextView>,
}

#[derive(Serialize)]
struct Numbers {
    total: usize,
    used: usize,
    free: usize,
    /// Blocks the block manager counts as shared (ref count above 1).
    shared: usize,
    /// The same, recounted from the block tables.
    shared_recount: usize,
    evictable: usize,
    sequences: usize,
    prefix_hit_tokens: u64,
    copies_total: usize,
    peak_blocks_used: usize,
    peak_blocks_shared: usize,
    /// Blocks a contiguous reservation (prompt + max_tokens per sequence,
    /// nothing shared) would hold for the requests admitted.
    contiguous_blocks: usize,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
    steps: u64,
    last_step_ms: f64,
}

#[derive(Serialize)]
struct Snapshot<'a> {
    info: &'a ModelInfo,
    done: bool,
    blocks: Vec<BlockView>,
    copies: Vec<[u32; 2]>,
    seqs: Vec<SeqView>,
    requests: Vec<RequestView>,
    numbers: Numbers,
    /// Disagreements between the recount and the manager (empty when sound).
    problems: Vec<String>,
}

fn text_of(t: &Tokenizer, g: &Generated, done: bool) -> TextView {
    TextView {
        text: t.decode_reply(&g.tokens),
        tokens: g.tokens.clone(),
        score: g.score,
        done,
    }
}

fn snapshot(s: &Inner) -> Result<String, JsValue> {
    let server = s.server.as_ref().ok_or_else(|| err("a step is running"))?;
    let m = server.sched.blocks();
    let mut tally = Tally::new(m);
    let mut seqs = Vec::new();
    let mut requests = Vec::new();
    for r in &s.requests {
        let live = server.sched.sequences(r.id).unwrap_or(&[]);
        for (index, &q) in live.iter().enumerate() {
            let (Ok(table), Ok(len)) = (m.block_table(q), m.seq_len(q)) else {
                continue;
            };
            tally.add(q, r.id.number(), index as u32, table, len as u32);
            seqs.push(SeqView {
                request: r.id.number(),
                index,
                len,
                table: table.to_vec(),
            });
        }
        let t = &s.tokenizer;
        let (sequences, finished, aborted) = match (&r.completion, server.progress(r.id)) {
            (Some(c), _) => (
                c.sequences.iter().map(|g| text_of(t, g, true)).collect(),
                true,
                c.aborted,
            ),
            (None, Some(p)) => (
                p.live
                    .iter()
                    .map(|g| text_of(t, g, false))
                    .chain(p.done.iter().map(|g| text_of(t, g, true)))
                    .collect(),
                false,
                false,
            ),
            (None, None) => (Vec::new(), false, false),
        };
        requests.push(RequestView {
            request: r.id.number(),
            mode: r.mode.clone(),
            prompt: r.prompt.clone(),
            prompt_tokens: r.prompt_ids.len(),
            finished,
            aborted,
            sequences,
        });
    }
    tally.copies(&server.last_copies);
    let (_, shared_recount) = tally.held();
    let (blocks, problems) = tally.finish(m);
    let st = m.stats();
    let ss = &server.stats;
    let rate = |n: usize, secs: f64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
    let numbers = Numbers {
        total: st.total,
        used: st.used,
        free: st.free,
        shared: st.shared,
        shared_recount,
        evictable: st.evictable,
        sequences: st.sequences,
        prefix_hit_tokens: m.prefix_hit_tokens(),
        copies_total: ss.copies,
        peak_blocks_used: ss.peak_blocks_used,
        peak_blocks_shared: ss.peak_blocks_shared,
        contiguous_blocks: ss.contiguous_blocks,
        prefill_tokens_per_s: rate(ss.prefill_tokens, ss.prefill_secs),
        decode_tokens_per_s: rate(ss.decode_tokens, ss.decode_secs),
        steps: s.steps,
        last_step_ms: s.last_step_ms,
    };
    json(&Snapshot {
        info: &s.info,
        done: !server.has_work(),
        blocks,
        copies: server.last_copies.clone(),
        seqs,
        requests,
        numbers,
        problems,
    })
}
