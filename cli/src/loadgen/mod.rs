//! `pagedattn loadgen`: drives an OpenAI-compatible server over HTTP as
//! its clients would, and measures what `vllm bench serve` reports: time
//! to first token, time per output token, inter-token latency, end-to-end
//! latency (mean, p50, p99), request and output-token throughput, the vLLM
//! paper's normalized latency (latency / output tokens) and goodput under
//! a stated SLO; from a pagedattn server's `/metrics` also the peak batch,
//! KV blocks used and shared, and preemptions.
//!
//! Requests are drawn up front from a seed: prompts as token ids of a
//! controlled length (ShareGPT-like or Alpaca-like lengths, scaled to fit
//! the machine), each with an output length it generates exactly
//! (`ignore_eos`; `expected_output_tokens` tells the oracle reservation).
//! Arrivals are Poisson at a rate, or closed-loop at N concurrent clients.
//!
//! [`sweep`] runs the paper's experiment: the same server, model, pool and
//! load under paging and each reservation baseline, over a list of rates.

mod report;
mod sweep;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use pagedattn::rng::SplitMix64;
use serde::Serialize;

use crate::sim::{Dataset, Sampling};

pub use report::{render, RunReport, Stats};
pub use sweep::{render_sweep, sweep, SweepConfig, SweepReport};

/// Token ids prompts are drawn from: plain word pieces of SmolLM2's
/// vocabulary (no control or byte tokens), so any server's tokenizer takes
/// them as they are.
const PROMPT_IDS: (u64, u64) = (1000, 40_000);

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum Arrivals {
    /// A Poisson process of this many requests per second.
    Poisson(f64),
    /// This many clients, each sending its next request when the last ends.
    Closed(usize),
}

/// What load to offer.
#[derive(Clone, Debug, Serialize)]
pub struct LoadSpec {
    #[serde(skip)]
    pub dataset: Dataset,
    /// Prompt and output means are the dataset's divided by this.
    pub scale: f64,
    /// Prompt + output of a request is at most this (the server's
    /// `--max-model-len`).
    pub max_len: usize,
    pub requests: usize,
    pub arrivals: Arrivals,
    /// Samples, or beams, per request.
    #[serde(skip)]
    pub sampling: Sampling,
    pub seed: u64,
    /// Normalized latency (seconds per output token) a request must stay
    /// under to count as goodput.
    pub slo: f64,
    pub temperature: f32,
}

/// One request to send.
#[derive(Clone, Debug, PartialEq)]
pub struct Planned {
    pub prompt: Vec<u32>,
    /// Tokens each sequence generates.
    pub output: usize,
    /// When to send it (Poisson), seconds after the start.
    pub at: f64,
}

/// The requests of a load, drawn from its seed: the same seed gives the
/// same requests whatever the server.
pub fn plan(spec: &LoadSpec) -> Vec<Planned> {
    let mut rng = SplitMix64::new(spec.seed);
    let scaled = |d: crate::sim::LenDist| match d {
        crate::sim::LenDist::LogNormal { mean, sigma } => crate::sim::LenDist::LogNormal {
            mean: (mean / spec.scale).max(1.0),
            sigma,
        },
        other => other,
    };
    let (input, output) = (scaled(spec.dataset.input()), scaled(spec.dataset.output()));
    let mut at = 0.0;
    (0..spec.requests)
        .map(|_| {
            let p = input.sample(&mut rng, spec.max_len.saturating_sub(1).max(1));
            let o = output.sample(&mut rng, spec.max_len.saturating_sub(p).max(1));
            let prompt = (0..p)
                .map(|_| rng.range(PROMPT_IDS.0, PROMPT_IDS.1) as u32)
                .collect();
            if let Arrivals::Poisson(rate) = spec.arrivals {
                // Exponential gaps; 1 - u is in (0, 1].
                at += -(1.0 - rng.next_f64()).ln() / rate;
            }
            Planned {
                prompt,
                output: o,
                at,
            }
        })
        .collect()
}

/// How one request went.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Outcome {
    /// HTTP status (0: no response).
    pub status: u16,
    pub error: Option<String>,
    pub prompt_tokens: usize,
    /// Tokens generated, all sequences together (the server's `usage`).
    pub output_tokens: usize,
    /// Seconds from sending to the first token, and to the end.
    pub ttft: f64,
    pub e2e: f64,
    /// Seconds between consecutive token chunks.
    pub itl: Vec<f64>,
}

impl Outcome {
    /// Finished with its whole output.
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none() && self.output_tokens > 0
    }
}

/// Where and how to send.
#[derive(Clone, Debug)]
pub struct Target {
    /// `http://host:port` (no `/v1`).
    pub base: String,
    pub model: String,
    pub api_key: Option<String>,
    /// Scrape `/metrics` for pagedattn's pool and queues.
    pub scrape: bool,
}

/// Sends one request, streamed, and times it.
async fn send(http: &reqwest::Client, t: &Target, spec: &LoadSpec, p: &Planned) -> Outcome {
    let (n, beam) = match spec.sampling {
        Sampling::Parallel(n) => (n, false),
        Sampling::Beam(k) => (k, true),
    };
    let mut body = serde_json::json!({
        "model": t.model,
        "prompt": p.prompt,
        "max_tokens": p.output,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
        "n": n,
        "expected_output_tokens": p.output,
    });
    if beam {
        body["use_beam_search"] = true.into();
    } else {
        body["temperature"] = spec.temperature.into();
        // Plain sampling, stated: a server's own defaults for omitted
        // fields (pagedattn's per model, vLLM's from generation_config)
        // would make runs against different servers incomparable.
        body["top_p"] = 1.0.into();
        body["repetition_penalty"] = 1.0.into();
        body["seed"] = (spec.seed ^ p.at.to_bits()).into();
    }
    let mut out = Outcome {
        prompt_tokens: p.prompt.len(),
        ..Outcome::default()
    };
    let start = Instant::now();
    let mut req = http.post(format!("{}/v1/completions", t.base)).json(&body);
    if let Some(k) = &t.api_key {
        req = req.bearer_auth(k);
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(e.to_string());
            return out;
        }
    };
    out.status = resp.status().as_u16();
    if !resp.status().is_success() {
        out.error = Some(resp.text().await.unwrap_or_default());
        return out;
    }
    let mut events = resp.bytes_stream().eventsource();
    let mut last: Option<Instant> = None;
    let mut chunks = 0usize;
    while let Some(ev) = events.next().await {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                out.error = Some(e.to_string());
                break;
            }
        };
        if ev.data == "[DONE]" {
            break;
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&ev.data) else {
            out.error = Some(format!("not JSON: {}", ev.data));
            break;
        };
        if let Some(e) = v.get("error") {
            out.error = Some(e.to_string());
            break;
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            out.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
        }
        let has_text = v["choices"].as_array().is_some_and(|c| {
            c.iter()
                .any(|c| c["text"].as_str().is_some_and(|t| !t.is_empty()))
        });
        if has_text {
            let now = Instant::now();
            chunks += 1;
            match last {
                None => out.ttft = (now - start).as_secs_f64(),
                Some(l) => out.itl.push((now - l).as_secs_f64()),
            }
            last = Some(now);
        }
    }
    out.e2e = start.elapsed().as_secs_f64();
    if out.output_tokens == 0 {
        // A server without usage in streams: a chunk a token.
        out.output_tokens = chunks;
    }
    out
}

/// Peaks of a pagedattn server's `/metrics` during a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Peaks {
    pub running: f64,
    pub waiting: f64,
    pub swapped: f64,
    pub blocks_used: f64,
    pub blocks_shared: f64,
    pub blocks_reserved: f64,
    /// Preemptions during the run.
    pub preemptions: f64,
    /// The most tokens the live sequences held (a shared token once per
    /// sequence), and the slots they took then: sharing saved
    /// `1 - stored / logical`.
    pub logical_tokens: f64,
    pub stored_tokens: f64,
}

/// One `/metrics` scrape, as name -> value.
async fn scrape(
    http: &reqwest::Client,
    base: &str,
) -> Option<std::collections::HashMap<String, f64>> {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    Some(
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect(),
    )
}

/// Offers `spec`'s load to `target` and reports it.
pub async fn run(target: &Target, spec: &LoadSpec) -> RunReport {
    let plans = plan(spec);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .timeout(Duration::from_secs(3600))
        .build()
        .expect("an HTTP client with no TLS builds");
    let metric = |m: &std::collections::HashMap<String, f64>, k: &str| {
        m.get(&format!("pagedattn_{k}")).copied().unwrap_or(0.0)
    };
    let before = if target.scrape {
        scrape(&http, &target.base).await
    } else {
        None
    };
    let peaks = Arc::new(Mutex::new(Peaks::default()));
    let done = Arc::new(AtomicBool::new(false));
    let watcher = target.scrape.then(|| {
        let (http, base, peaks, done) = (
            http.clone(),
            target.base.clone(),
            peaks.clone(),
            done.clone(),
        );
        tokio::spawn(async move {
            while !done.load(Ordering::SeqCst) {
                if let Some(m) = scrape(&http, &base).await {
                    let mut p = peaks.lock().expect("not poisoned");
                    let g = |k: &str| m.get(&format!("pagedattn_{k}")).copied().unwrap_or(0.0);
                    p.running = p.running.max(g("requests_running"));
                    p.waiting = p.waiting.max(g("requests_waiting"));
                    p.swapped = p.swapped.max(g("requests_swapped"));
                    p.blocks_used = p.blocks_used.max(g("kv_blocks_used"));
                    p.blocks_shared = p.blocks_shared.max(g("kv_blocks_shared"));
                    p.blocks_reserved = p.blocks_reserved.max(g("kv_blocks_reserved"));
                    if g("kv_tokens_logical") > p.logical_tokens {
                        p.logical_tokens = g("kv_tokens_logical");
                        p.stored_tokens = g("kv_tokens_stored");
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    });
    let start = Instant::now();
    let outcomes: Vec<Outcome> = match spec.arrivals {
        Arrivals::Poisson(_) => {
            let tasks: Vec<_> = plans
                .iter()
                .cloned()
                .map(|p| {
                    let (http, t, s) = (http.clone(), target.clone(), spec.clone());
                    tokio::spawn(async move {
                        tokio::time::sleep_until((start + Duration::from_secs_f64(p.at)).into())
                            .await;
                        send(&http, &t, &s, &p).await
                    })
                })
                .collect();
            let mut out = Vec::with_capacity(tasks.len());
            for t in tasks {
                out.push(t.await.unwrap_or_default());
            }
            out
        }
        Arrivals::Closed(clients) => {
            let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let plans = Arc::new(plans.clone());
            let workers: Vec<_> = (0..clients.max(1))
                .map(|_| {
                    let (http, t, s, next, plans) = (
                        http.clone(),
                        target.clone(),
                        spec.clone(),
                        next.clone(),
                        plans.clone(),
                    );
                    tokio::spawn(async move {
                        let mut out = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::SeqCst);
                            let Some(p) = plans.get(i) else { break };
                            out.push((i, send(&http, &t, &s, p).await));
                        }
                        out
                    })
                })
                .collect();
            let mut all = Vec::new();
            for w in workers {
                all.extend(w.await.unwrap_or_default());
            }
            all.sort_by_key(|(i, _)| *i);
            all.into_iter().map(|(_, o)| o).collect()
        }
    };
    let duration = start.elapsed().as_secs_f64();
    done.store(true, Ordering::SeqCst);
    if let Some(w) = watcher {
        let _ = w.await;
    }
    let mut peaks = *peaks.lock().expect("not poisoned");
    if let (Some(b), Some(a)) = (
        before,
        if target.scrape {
            scrape(&http, &target.base).await
        } else {
            None
        },
    ) {
        peaks.preemptions = metric(&a, "preemptions_total") - metric(&b, "preemptions_total");
    }
    report::summarize(spec, &outcomes, duration, target.scrape.then_some(peaks))
}
