//! The OpenAI request bodies of `/v1/completions` and
//! `/v1/chat/completions`, checked field by field into the engine's
//! requests. Every refusal is a 400 naming the field, the value and the
//! limit; fields it does not serve are refused or accepted by name
//! (`fields`), and unknown ones listed for a warning and ignored (clients
//! send vLLM's and guidellm's extras). The fields a request omits take
//! the model's defaults ([`pagedattn_model::defaults`]).

use pagedattn_model::sample::{LogitBias, Penalties, MAX_BIAS, MAX_LOGIT_BIAS, MAX_TEMPERATURE};
use pagedattn_model::serve::{Decoding, Request};
use serde::Deserialize;
use serde_json::Value;

use crate::chat::{self, Message};
use crate::engine::ModelInfo;
use crate::ApiError;

/// Most `logprobs` / `top_logprobs` (OpenAI's limit).
pub const MAX_LOGPROBS: usize = 20;
/// Most stop strings, and their longest.
pub const MAX_STOPS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;
/// Most stop token ids.
pub const MAX_STOP_IDS: usize = 64;
/// Most prompts in one completions request.
pub const MAX_PROMPTS: usize = 256;

/// Which route a body came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Completions,
    Chat,
}

/// The fields both routes read (the body may hold more).
#[derive(Deserialize, Default, Debug)]
#[serde(default)]
struct Body {
    model: Option<String>,
    prompt: Option<Value>,
    messages: Option<Vec<Message>>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    n: Option<u64>,
    use_beam_search: Option<bool>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    logit_bias: Option<serde_json::Map<String, Value>>,
    seed: Option<i64>,
    frequency_penalty: Option<f64>,
    presence_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    stop: Option<Value>,
    stop_token_ids: Option<Vec<u64>>,
    ignore_eos: Option<bool>,
    /// Completions: an integer (top N); chat: a boolean.
    logprobs: Option<Value>,
    top_logprobs: Option<u64>,
    echo: Option<bool>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    cache_salt: Option<String>,
    /// vLLM's: logprobs name tokens as `token_id:N`.
    return_tokens_as_token_ids: Option<bool>,
    /// This server's extension: the output length the request will have
    /// (a benchmark's), what the oracle reservation reserves.
    expected_output_tokens: Option<u64>,
}

#[derive(Deserialize, Default, Debug)]
#[serde(default)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// A checked request: the engine requests (one per prompt) and how to
/// answer.
#[derive(Debug)]
pub struct Plan {
    pub route: Route,
    pub requests: Vec<Request>,
    /// Choices per prompt.
    pub n: usize,
    pub beam: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// Some(k): each token's logprob and its top k.
    pub logprobs: Option<usize>,
    /// The prompt's text before the answer (completions' `echo`).
    pub echo: Vec<String>,
    pub stop_strings: Vec<String>,
    /// Stop token ids the client gave (reported as `stop_reason`).
    pub stop_ids: Vec<u32>,
    /// Logprobs name tokens `token_id:N` (vLLM's `return_tokens_as_token_ids`).
    pub token_ids: bool,
    /// Fields the server does not know, ignored (for the caller's warning).
    pub unknown: Vec<String>,
}

impl Plan {
    /// The longest stop string, in bytes.
    pub fn longest_stop(&self) -> usize {
        self.stop_strings.iter().map(String::len).max().unwrap_or(0)
    }
}

/// A fresh seed for a request that gives none.
fn random_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = t ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    x ^= x >> 31;
    x.wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

/// Parses a body for `route`: malformed JSON and wrong types are 400s
/// naming the field (`max_tokens: invalid type: string "x", expected
/// u64`), and so is a field the server refuses. Returns the body and its
/// unknown fields.
fn parse_body(route: Route, bytes: &[u8]) -> Result<(Body, Vec<String>), ApiError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}")))?;
    let Some(obj) = v.as_object() else {
        return Err(ApiError::invalid("the body must be a JSON object"));
    };
    let unknown = crate::fields::check(route, obj)?;
    let body = serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        ApiError::param(&path, format!("{path}: {}", e.inner()))
    })?;
    Ok((body, unknown))
}

/// OpenAI's `logit_bias`: token ids (as strings) to biases in -100..=100.
fn logit_bias(
    m: &Option<serde_json::Map<String, Value>>,
    vocab: usize,
) -> Result<LogitBias, ApiError> {
    let bad = |msg: String| ApiError::param("logit_bias", msg);
    let Some(m) = m else {
        return Ok(LogitBias::default());
    };
    if m.len() > MAX_LOGIT_BIAS {
        return Err(bad(format!(
            "logit_bias has {} entries; at most {MAX_LOGIT_BIAS}",
            m.len()
        )));
    }
    let mut entries = Vec::with_capacity(m.len());
    for (k, v) in m {
        let t: u32 = k
            .parse()
            .map_err(|_| bad(format!("logit_bias key {k:?} is not a token id")))?;
        let b = v
            .as_f64()
            .ok_or_else(|| bad(format!("logit_bias[{k:?}] = {v} is not a number")))?;
        if !(-MAX_BIAS as f64..=MAX_BIAS as f64).contains(&b) {
            return Err(bad(format!(
                "logit_bias[{k:?}] = {b} outside -{MAX_BIAS}..={MAX_BIAS}"
            )));
        }
        entries.push((t, b as f32));
    }
    LogitBias::new(entries, vocab).map_err(|e| bad(e.to_string()))
}

/// The `model` field against the served name: 404 for another.
fn check_model(body: &Body, served: &str) -> Result<(), ApiError> {
    match &body.model {
        Some(m) if m != served => Err(ApiError::not_found(format!(
            "the model {m:?} does not exist here; this server serves {served:?} (GET /v1/models)"
        ))),
        _ => Ok(()),
    }
}

/// The tenant's prefix-cache namespace: the tenant, then any `cache_salt`.
pub fn salt(tenant: &str, cache_salt: Option<&str>) -> Vec<u8> {
    let mut s = b"t:".to_vec();
    s.extend_from_slice(tenant.as_bytes());
    if let Some(c) = cache_salt {
        s.push(0);
        s.extend_from_slice(c.as_bytes());
    }
    s
}

fn range_f32(name: &str, v: Option<f64>, default: f32, lo: f64, hi: f64) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(x as f32),
        Some(x) => Err(ApiError::param(
            name,
            format!("{name} {x} outside {lo}..={hi}"),
        )),
    }
}

/// The prompts of a completions body: a string, strings, token ids, or
/// lists of token ids.
fn prompts(v: &Value, info: &ModelInfo) -> Result<Vec<Vec<u32>>, ApiError> {
    let bad = |m: String| ApiError::param("prompt", m);
    let ids = |a: &[Value], at: &str| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .enumerate()
            .map(|(i, t)| match t.as_u64() {
                Some(t) if (t as usize) < info.vocab => Ok(t as u32),
                Some(t) => Err(bad(format!(
                    "prompt{at}[{i}]: token {t} outside the vocabulary of {}",
                    info.vocab
                ))),
                None => Err(bad(format!("prompt{at}[{i}]: {t} is not a token id"))),
            })
            .collect()
    };
    let text = |s: &str, at: &str| -> Result<Vec<u32>, ApiError> {
        info.tokenizer
            .encode_prompt(s)
            .map_err(|e| bad(format!("prompt{at}: {e}")))
    };
    let out = match v {
        Value::String(s) => vec![text(s, "")?],
        Value::Array(a) if a.is_empty() => return Err(bad("prompt is an empty list".into())),
        Value::Array(a) if a.iter().all(Value::is_number) => vec![ids(a, "")?],
        Value::Array(a) if a.len() > MAX_PROMPTS => {
            return Err(bad(format!(
                "{} prompts in one request; at most {MAX_PROMPTS}",
                a.len()
            )))
        }
        Value::Array(a) => a
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                Value::String(s) => text(s, &format!("[{i}]")),
                Value::Array(t) => ids(t, &format!("[{i}]")),
                _ => Err(bad(format!(
                    "prompt[{i}] must be a string or a list of token ids"
                ))),
            })
            .collect::<Result<_, _>>()?,
        _ => {
            return Err(bad(
                "prompt must be a string, a list of strings, token ids, or lists of token ids"
                    .into(),
            ))
        }
    };
    if let Some(i) = out.iter().position(Vec::is_empty) {
        return Err(bad(format!("prompt {i} is empty")));
    }
    Ok(out)
}

/// `stop`: a string or a list of them.
fn stop_strings(v: &Option<Value>) -> Result<Vec<String>, ApiError> {
    let bad = |m: String| Err(ApiError::param("stop", m));
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let mut out = Vec::with_capacity(a.len());
            for (i, s) in a.iter().enumerate() {
                match s.as_str() {
                    Some(s) => out.push(s.to_string()),
                    None => return bad(format!("stop[{i}] is not a string")),
                }
            }
            out
        }
        Some(_) => return bad("stop must be a string or a list of strings".into()),
    };
    if list.len() > MAX_STOPS {
        return bad(format!("{} stop strings; at most {MAX_STOPS}", list.len()));
    }
    if let Some(s) = list
        .iter()
        .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return bad(format!(
            "stop string {s:?} has {} bytes; each needs 1..={MAX_STOP_BYTES}",
            s.len()
        ));
    }
    Ok(list)
}

/// Checks a body for `route` and builds its plan. `tenant` names the
/// caller's prefix-cache namespace.
pub fn plan(
    route: Route,
    bytes: &[u8],
    info: &ModelInfo,
    served: &str,
    max_seqs: usize,
    tenant: &str,
) -> Result<Plan, ApiError> {
    let (b, unknown) = parse_body(route, bytes)?;
    check_model(&b, served)?;
    let (prompts, echo_text, logprobs) = match route {
        Route::Completions => {
            let p = b
                .prompt
                .as_ref()
                .ok_or_else(|| ApiError::param("prompt", "prompt is required"))?;
            let prompts = prompts(p, info)?;
            let logprobs = match &b.logprobs {
                None | Some(Value::Null) => None,
                Some(v) => match v.as_u64() {
                    Some(k) if k as usize <= MAX_LOGPROBS => Some(k as usize),
                    _ => {
                        return Err(ApiError::param(
                            "logprobs",
                            format!("logprobs {v} is not an integer in 0..={MAX_LOGPROBS}"),
                        ))
                    }
                },
            };
            let echo = b.echo.unwrap_or(false);
            if echo && logprobs.is_some() {
                return Err(ApiError::param(
                    "echo",
                    "echo together with logprobs needs the prompt's logprobs, which this server does not compute",
                ));
            }
            let echo_text = if echo {
                prompts.iter().map(|p| info.tokenizer.decode(p)).collect()
            } else {
                Vec::new()
            };
            (prompts, echo_text, logprobs)
        }
        Route::Chat => {
            let msgs = b
                .messages
                .as_deref()
                .ok_or_else(|| ApiError::param("messages", "messages is required"))?;
            let text = chat::render(&info.tokenizer, msgs)?;
            let ids = info
                .tokenizer
                .encode_prompt(&text)
                .map_err(|e| ApiError::param("messages", format!("messages: {e}")))?;
            let want = match &b.logprobs {
                None | Some(Value::Null) => false,
                Some(Value::Bool(x)) => *x,
                Some(v) => {
                    return Err(ApiError::param(
                        "logprobs",
                        format!("logprobs {v} is not a boolean"),
                    ))
                }
            };
            let top = b.top_logprobs.unwrap_or(0) as usize;
            if top > MAX_LOGPROBS {
                return Err(ApiError::param(
                    "top_logprobs",
                    format!("top_logprobs {top} outside 0..={MAX_LOGPROBS}"),
                ));
            }
            if top > 0 && !want {
                return Err(ApiError::param(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                ));
            }
            (vec![ids], Vec::new(), want.then_some(top))
        }
    };

    let n = b.n.unwrap_or(1);
    if n == 0 || n as usize > max_seqs {
        return Err(ApiError::param(
            "n",
            format!("n {n} outside 1..={max_seqs} (--max-seqs)"),
        ));
    }
    let n = n as usize;
    let beam = b.use_beam_search.unwrap_or(false);
    let d = &info.defaults;
    // Each value given checked against its range; each one left out is
    // the default's (beams take none).
    let given = |name: &str, v: Option<f64>, lo: f64, hi: f64| -> Result<Option<f32>, ApiError> {
        v.map(|x| range_f32(name, Some(x), 0.0, lo, hi)).transpose()
    };
    let temperature = given("temperature", b.temperature, 0.0, MAX_TEMPERATURE as f64)?;
    let top_p = given("top_p", b.top_p, 0.0, 1.0)?;
    if top_p == Some(0.0) {
        return Err(ApiError::param("top_p", "top_p 0 outside (0, 1]"));
    }
    let min_p = given("min_p", b.min_p, 0.0, 1.0)?;
    let top_k = match b.top_k {
        None => None,
        Some(-1) | Some(0) => Some(0),
        Some(k) if k > 0 && (k as usize) <= info.vocab => Some(k as usize),
        Some(k) => {
            return Err(ApiError::param(
                "top_k",
                format!("top_k {k} outside 1..={} (or -1 or 0: all)", info.vocab),
            ))
        }
    };
    let repetition = given("repetition_penalty", b.repetition_penalty, 0.0, 100.0)?;
    if repetition == Some(0.0) {
        return Err(ApiError::param(
            "repetition_penalty",
            "repetition_penalty 0 outside (0, 100]",
        ));
    }
    let bias = logit_bias(&b.logit_bias, info.vocab)?;
    let explicit = Penalties {
        frequency: range_f32("frequency_penalty", b.frequency_penalty, 0.0, -2.0, 2.0)?,
        presence: range_f32("presence_penalty", b.presence_penalty, 0.0, -2.0, 2.0)?,
        repetition: repetition.unwrap_or(1.0),
    };
    let seed = b.seed.map_or_else(random_seed, |s| s as u64);
    let (decoding, penalties) = if beam {
        let sampled = temperature.is_some_and(|t| t != 0.0)
            || top_p.is_some_and(|p| p != 1.0)
            || top_k.is_some_and(|k| k != 0)
            || min_p.is_some_and(|m| m != 0.0);
        if sampled || !explicit.is_none() || !bias.is_empty() {
            return Err(ApiError::param(
                "use_beam_search",
                "beam search is deterministic: it takes no temperature, top_p, top_k, min_p, penalties or logit_bias",
            ));
        }
        (Decoding::Beam { width: n }, Penalties::default())
    } else {
        let params = d.params(temperature, top_p, top_k, min_p, seed);
        let penalties = Penalties {
            repetition: d.repetition(repetition, temperature),
            ..explicit
        };
        (Decoding::Sample { params, n }, penalties)
    };
    let stop_strings = stop_strings(&b.stop)?;
    let user_ids: Vec<u64> = b.stop_token_ids.clone().unwrap_or_default();
    if user_ids.len() > MAX_STOP_IDS {
        return Err(ApiError::param(
            "stop_token_ids",
            format!("{} stop token ids; at most {MAX_STOP_IDS}", user_ids.len()),
        ));
    }
    if let Some(t) = user_ids.iter().find(|&&t| t as usize >= info.vocab) {
        return Err(ApiError::param(
            "stop_token_ids",
            format!("stop token {t} outside the vocabulary of {}", info.vocab),
        ));
    }
    let stop_ids: Vec<u32> = user_ids.iter().map(|&t| t as u32).collect();
    let mut stop = if b.ignore_eos.unwrap_or(false) {
        Vec::new()
    } else {
        info.eos.clone()
    };
    stop.extend(stop_ids.iter().copied().filter(|t| !info.eos.contains(t)));
    let cache_salt = b.cache_salt.as_deref();
    if cache_salt == Some("") {
        // As vLLM: an empty salt is a mistake, not a namespace of its own.
        return Err(ApiError::param(
            "cache_salt",
            "cache_salt must be a non-empty string when given (leave it out for the tenant's own namespace)",
        ));
    }
    if cache_salt.is_some_and(|s| s.len() > 256) {
        return Err(ApiError::param(
            "cache_salt",
            "cache_salt has more than 256 bytes",
        ));
    }
    let asked = match route {
        Route::Chat => b.max_completion_tokens.or(b.max_tokens),
        Route::Completions => b.max_tokens,
    };
    let field = if route == Route::Chat && b.max_completion_tokens.is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let ctx = info.context;
    let many = prompts.len() > 1;
    let mut requests = Vec::with_capacity(prompts.len());
    for (i, prompt) in prompts.into_iter().enumerate() {
        let p = prompt.len();
        let which = if many {
            format!("prompt {i}")
        } else {
            "the prompt".to_string()
        };
        if p >= ctx {
            return Err(ApiError::param(
                if route == Route::Chat { "messages" } else { "prompt" },
                format!("{which} has {p} tokens; past the context of {ctx} tokens this server serves (a prompt has at most {})", ctx - 1),
            ));
        }
        let max_tokens = match asked {
            Some(0) => {
                return Err(ApiError::param(
                    field,
                    format!("{field} 0: nothing to generate"),
                ))
            }
            Some(m) if m as usize + p > ctx => {
                return Err(ApiError::param(
                    field,
                    format!(
                    "{field} {m} + {p} tokens of {which} = {} is past the model's context of {ctx}",
                    m as usize + p
                ),
                ))
            }
            Some(m) => m as usize,
            None if route == Route::Completions => d.completion_tokens.min(ctx - p),
            None => d.max_tokens.min(ctx - p),
        };
        let expected_tokens = match b.expected_output_tokens {
            None => None,
            Some(e) if e >= 1 && e as usize <= max_tokens => Some(e as usize),
            Some(e) => {
                return Err(ApiError::param(
                    "expected_output_tokens",
                    format!("expected_output_tokens {e} outside 1..={max_tokens} ({field})"),
                ))
            }
        };
        requests.push(Request {
            prompt,
            max_tokens,
            decoding,
            stop: stop.clone(),
            stop_strings: stop_strings.iter().map(|s| s.as_bytes().to_vec()).collect(),
            penalties,
            logit_bias: bias.clone(),
            record_top: logprobs.unwrap_or(0),
            salt: salt(tenant, cache_salt),
            expected_tokens,
        });
    }
    let stream = b.stream.unwrap_or(false);
    let include_usage = b
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    Ok(Plan {
        route,
        requests,
        n,
        beam,
        stream,
        include_usage,
        logprobs,
        echo: echo_text,
        stop_strings,
        stop_ids,
        token_ids: b.return_tokens_as_token_ids.unwrap_or(false),
        unknown,
    })
}
