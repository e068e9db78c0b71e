//! Completions and chat: a checked plan handed to the engine as one job
//! per prompt, then answered whole or streamed as server-sent events
//! (`data: {chunk}` lines, `data: [DONE]`; an error mid-stream is a
//! `data: {"error": ...}` line).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use pagedattn_model::serve::{Finish, Generated};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::{self, Plan, Route};
use crate::app::{admit, App};
use crate::engine::{Command, Event, Job, ModelInfo, TokenEvent};
use crate::text::ChoiceText;
use crate::ApiError;

/// What every response of one request shares.
struct Head {
    id: String,
    created: u64,
    model: String,
    route: Route,
}

impl Head {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.route, chunk) {
            (Route::Completions, _) => "text_completion",
            (Route::Chat, false) => "chat.completion",
            (Route::Chat, true) => "chat.completion.chunk",
        }
    }

    fn wrap(&self, chunk: bool, choices: Value, usage: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }
}

fn request_id(route: Route) -> String {
    use std::sync::atomic::AtomicU64;
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let prefix = match route {
        Route::Completions => "cmpl",
        Route::Chat => "chatcmpl",
    };
    format!("{prefix}-{t:016x}{n:08x}")
}

fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": { "cached_tokens": cached },
    })
}

fn finish_reason(f: Option<Finish>) -> Value {
    match f {
        None => Value::Null,
        Some(Finish::Length) => json!("length"),
        Some(_) => json!("stop"),
    }
}

/// vLLM's `stop_reason`: the stop string, or a stop token the client
/// named (`null` for the model's own end of turn and for length).
fn stop_reason(plan: &Plan, f: Option<Finish>) -> Value {
    match f {
        Some(Finish::Text { index, .. }) => json!(plan.stop_strings.get(index)),
        Some(Finish::Token(t)) if plan.stop_ids.contains(&t) => json!(t),
        _ => Value::Null,
    }
}

fn token_str(info: &ModelInfo, ids: bool, t: u32) -> String {
    if ids {
        return format!("token_id:{t}");
    }
    String::from_utf8_lossy(info.tokenizer.token_bytes(t)).into_owned()
}

/// The logprobs of tokens `toks` (with their logprobs and top-k), in the
/// route's shape. `offset`: the text's length before the first token
/// (completions' `text_offset`).
#[allow(clippy::too_many_arguments)]
fn logprobs(
    info: &ModelInfo,
    plan: &Plan,
    k: usize,
    toks: &[u32],
    lps: &[f64],
    tops: &[Vec<(u32, f64)>],
    mut offset: usize,
) -> Value {
    let top_of = |i: usize| tops.get(i).map_or(&[][..], |t| &t[..t.len().min(k)]);
    let ids = plan.token_ids;
    match plan.route {
        Route::Completions => {
            let mut tokens = Vec::new();
            let mut offsets = Vec::new();
            let mut top = Vec::new();
            for (i, &t) in toks.iter().enumerate() {
                let s = token_str(info, ids, t);
                offsets.push(offset);
                let shown = String::from_utf8_lossy(&info.token_text[t as usize]);
                offset += shown.chars().count();
                // The sampled token's logprob is always there (up to k + 1).
                let mut m = serde_json::Map::new();
                for &(c, lp) in top_of(i) {
                    m.insert(token_str(info, ids, c), json!(lp));
                }
                m.insert(s.clone(), json!(lps[i]));
                top.push(Value::Object(m));
                tokens.push(s);
            }
            json!({
                "tokens": tokens,
                "token_logprobs": lps,
                "top_logprobs": top,
                "text_offset": offsets,
            })
        }
        Route::Chat => {
            let entry = |t: u32, lp: f64| {
                let b = info.tokenizer.token_bytes(t);
                json!({
                    "token": token_str(info, ids, t),
                    "logprob": lp,
                    "bytes": b,
                })
            };
            let content: Vec<Value> = toks
                .iter()
                .enumerate()
                .map(|(i, &t)| {
                    let mut e = entry(t, lps[i]);
                    e["top_logprobs"] = top_of(i).iter().map(|&(c, lp)| entry(c, lp)).collect();
                    e
                })
                .collect();
            json!({ "content": content })
        }
    }
}

/// A sequence's tokens that count for logprobs: all but a final stop token.
fn shown(g: &Generated) -> usize {
    match g.finish {
        Some(Finish::Token(_)) => g.tokens.len() - 1,
        _ => g.tokens.len(),
    }
}

/// One finished choice, whole.
fn choice(info: &ModelInfo, plan: &Plan, index: usize, echo: &str, g: &Generated) -> Value {
    let text = String::from_utf8_lossy(g.answer()).into_owned();
    let lp = plan.logprobs.map_or(Value::Null, |k| {
        let n = shown(g);
        logprobs(info, plan, k, &g.tokens[..n], &g.logprobs[..n], &g.top, 0)
    });
    match plan.route {
        Route::Completions => json!({
            "index": index,
            "text": format!("{echo}{text}"),
            "logprobs": lp,
            "finish_reason": finish_reason(g.finish),
            "stop_reason": stop_reason(plan, g.finish),
        }),
        Route::Chat => json!({
            "index": index,
            "message": { "role": "assistant", "content": text },
            "logprobs": lp,
            "finish_reason": finish_reason(g.finish),
            "stop_reason": stop_reason(plan, g.finish),
        }),
    }
}

/// Checks, submits and answers one request.
pub async fn respond(
    app: Arc<App>,
    route: Route,
    bytes: &[u8],
    tenant: &str,
) -> Result<Response, ApiError> {
    let shared = &app.shared;
    let info = shared.ready()?;
    let mut plan = api::plan(
        route,
        bytes,
        info,
        &shared.model_name,
        shared.cfg.max_seqs,
        tenant,
    )?;
    if !plan.unknown.is_empty() {
        let path = match route {
            Route::Completions => "/v1/completions",
            Route::Chat => "/v1/chat/completions",
        };
        eprintln!(
            "pagedattn serve: warning: {path}: ignored fields this server does not know: {}",
            plan.unknown.join(", ")
        );
    }
    let k = plan.requests.len();
    admit(&app, k)?;
    let arrived = Instant::now();
    let stream_tokens = plan.stream && !plan.beam;
    let mut prompt_tokens = Vec::with_capacity(k);
    let mut rxs = Vec::with_capacity(k);
    for (i, request) in plan.requests.drain(..).enumerate() {
        prompt_tokens.push(request.prompt.len());
        let (tx, rx) = mpsc::unbounded_channel();
        let job = Job {
            request,
            stream: stream_tokens,
            events: tx,
            arrived,
        };
        // Counted as pending before it is sent: the engine takes it off.
        shared.metrics.pending.inc();
        if app.commands.send(Command::Submit(job)).is_err() {
            shared.metrics.pending.dec();
            shared.in_flight.fetch_sub(k - i, Ordering::SeqCst);
            return Err(ApiError::unavailable("the engine has stopped"));
        }
        rxs.push(rx);
    }
    // Every prompt queued, or the first refusal answered (dropping the
    // receivers aborts the others).
    for rx in &mut rxs {
        match rx.recv().await {
            Some(Event::Accepted) => {}
            Some(Event::Rejected(e)) | Some(Event::Failed(e)) => return Err(e),
            _ => {
                return Err(ApiError::server(
                    "the engine stopped before queueing the request",
                ))
            }
        }
    }
    let head = Head {
        id: request_id(route),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: shared.model_name.clone(),
        route,
    };
    if plan.stream {
        let (out_tx, out_rx) = mpsc::channel::<Sse>(64);
        tokio::spawn(stream_events(
            app.clone(),
            plan,
            head,
            prompt_tokens,
            rxs,
            out_tx,
        ));
        let body = stream::unfold(out_rx, |mut rx| async move {
            rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
        });
        let keep = KeepAlive::new().interval(app.shared.cfg.keep_alive);
        return Ok(axum::response::Sse::new(body)
            .keep_alive(keep)
            .into_response());
    }
    // Whole: wait for every prompt.
    let mut choices = Vec::new();
    let (mut completion, mut cached) = (0, 0);
    for (i, rx) in rxs.iter_mut().enumerate() {
        loop {
            match rx.recv().await {
                Some(Event::Done {
                    sequences,
                    cached_tokens,
                }) => {
                    cached += cached_tokens;
                    let echo = plan.echo.get(i).map_or("", String::as_str);
                    for (rank, g) in sequences.iter().enumerate() {
                        let b = if plan.beam { rank } else { g.branch };
                        completion += g.tokens.len();
                        choices.push(choice(info, &plan, i * plan.n + b, echo, g));
                    }
                    break;
                }
                Some(Event::Failed(e)) | Some(Event::Rejected(e)) => return Err(e),
                Some(_) => {}
                None => return Err(ApiError::server("the engine dropped the request")),
            }
        }
    }
    choices.sort_by_key(|c| c["index"].as_u64());
    let total_prompt: usize = prompt_tokens.iter().sum();
    let body = head.wrap(
        false,
        Value::Array(choices),
        Some(usage(total_prompt, completion, cached)),
    );
    Ok(Json(body).into_response())
}

/// A streamed choice.
struct Streamed {
    text: ChoiceText,
    /// Characters sent (completions' `text_offset`).
    chars: usize,
}

/// Turns the engine's events into SSE chunks until every prompt is done,
/// the client leaves (`out` closes: the receivers are dropped and the
/// engine aborts the jobs), or an error.
async fn stream_events(
    app: Arc<App>,
    plan: Plan,
    head: Head,
    prompt_tokens: Vec<usize>,
    rxs: Vec<mpsc::UnboundedReceiver<Event>>,
    out: mpsc::Sender<Sse>,
) {
    let Some(info) = app.shared.model.get() else {
        return;
    };
    let data = |v: &Value| Sse::default().data(v.to_string());
    let k = rxs.len();
    let mut merged = stream::select_all(rxs.into_iter().enumerate().map(|(i, rx)| {
        stream::unfold(rx, move |mut rx| async move {
            rx.recv().await.map(|e| ((i, e), rx))
        })
        .boxed()
    }));
    let hold = plan.longest_stop();
    let mut choices: HashMap<usize, Streamed> = (0..k * plan.n)
        .map(|index| {
            let s = Streamed {
                text: ChoiceText::new(hold),
                chars: 0,
            };
            (index, s)
        })
        .collect();
    let (mut completion, mut cached, mut done) = (0usize, 0usize, 0usize);
    let chunk =
        |index: usize, text: &str, lp: Value, f: Option<Finish>, role: bool| match plan.route {
            Route::Completions => json!({
                "index": index,
                "text": text,
                "logprobs": lp,
                "finish_reason": finish_reason(f),
                "stop_reason": stop_reason(&plan, f),
            }),
            Route::Chat => {
                let mut delta = json!({});
                if role {
                    delta["role"] = json!("assistant");
                }
                if role || !text.is_empty() {
                    delta["content"] = json!(text);
                }
                json!({
                    "index": index,
                    "delta": delta,
                    "logprobs": lp,
                    "finish_reason": finish_reason(f),
                })
            }
        };
    // Opening chunks: chat's role, completions' echoed prompt.
    for i in 0..k {
        for b in 0..plan.n {
            let index = i * plan.n + b;
            let opening = match plan.route {
                Route::Chat => Some(chunk(index, "", Value::Null, None, true)),
                Route::Completions => plan.echo.get(i).map(|e| {
                    if let Some(c) = choices.get_mut(&index) {
                        c.chars += e.chars().count();
                    }
                    chunk(index, e, Value::Null, None, false)
                }),
            };
            if let Some(c) = opening {
                if out
                    .send(data(&head.wrap(true, json!([c]), None)))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
    }
    while done < k {
        let next = tokio::select! {
            e = merged.next() => e,
            _ = out.closed() => return,
        };
        let Some((i, event)) = next else {
            let e = ApiError::server("the engine dropped the request");
            let _ = out.send(data(&e.body())).await;
            return;
        };
        let mut chunks = Vec::new();
        match event {
            Event::Token(t) => {
                let index = i * plan.n + t.branch;
                let Some(c) = choices.get_mut(&index) else {
                    continue;
                };
                let TokenEvent {
                    token,
                    logprob,
                    top,
                    finish,
                    answer_len,
                    ..
                } = t;
                let stop_token = matches!(finish, Some(Finish::Token(_)));
                let bytes = if stop_token {
                    &[][..]
                } else {
                    &info.token_text[token as usize][..]
                };
                let text = match finish {
                    Some(_) => c.text.end(bytes, answer_len),
                    None => c.text.push(bytes),
                };
                let lp = match plan.logprobs {
                    Some(k) if !stop_token => {
                        logprobs(info, &plan, k, &[token], &[logprob], &[top], c.chars)
                    }
                    _ => Value::Null,
                };
                c.chars += text.chars().count();
                if !text.is_empty() || !lp.is_null() || finish.is_some() {
                    chunks.push(chunk(index, &text, lp, finish, false));
                }
            }
            Event::Done {
                sequences,
                cached_tokens,
            } => {
                done += 1;
                cached += cached_tokens;
                for (rank, g) in sequences.iter().enumerate() {
                    completion += g.tokens.len();
                    if plan.beam {
                        // Beams are known only at the end: each is one chunk.
                        let index = i * plan.n + rank;
                        let mut c = choice(info, &plan, index, "", g);
                        if plan.route == Route::Chat {
                            let content = c["message"]["content"].clone();
                            c = chunk(
                                index,
                                content.as_str().unwrap_or(""),
                                c["logprobs"].clone(),
                                g.finish,
                                false,
                            );
                        }
                        chunks.push(c);
                    }
                }
            }
            Event::Failed(e) | Event::Rejected(e) => {
                let _ = out.send(data(&e.body())).await;
                let _ = out.send(Sse::default().data("[DONE]")).await;
                return;
            }
            Event::Accepted => {}
        }
        for c in chunks {
            if out
                .send(data(&head.wrap(true, json!([c]), None)))
                .await
                .is_err()
            {
                return;
            }
        }
    }
    if plan.include_usage {
        let total_prompt: usize = prompt_tokens.iter().sum();
        let u = usage(total_prompt, completion, cached);
        if out
            .send(data(&head.wrap(true, json!([]), Some(u))))
            .await
            .is_err()
        {
            return;
        }
    }
    let _ = out.send(Sse::default().data("[DONE]")).await;
}
