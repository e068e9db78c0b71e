//! `/metrics`: the KV pool, the queues and the latencies in Prometheus
//! text, with vLLM's histogram buckets for time to first token and
//! inter-token latency. The engine thread sets them after every step.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Time to first token, seconds (vLLM's buckets).
const TTFT_BUCKETS: [f64; 17] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0,
];
/// Inter-token latency, seconds (vLLM's buckets).
const ITL_BUCKETS: [f64; 16] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];
/// Request latency, seconds.
const E2E_BUCKETS: [f64; 14] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
];

/// How a request ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Ended {
    /// `stop`, `length`, `abort` (the client left or shutdown), `error`.
    pub reason: String,
}

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    pub blocks_total: Gauge,
    pub blocks_used: Gauge,
    pub blocks_shared: Gauge,
    pub blocks_free: Gauge,
    pub blocks_cached: Gauge,
    pub blocks_reserved: Gauge,
    pub kv_usage: Gauge<f64, AtomicU64>,
    pub tokens_stored: Gauge,
    pub tokens_logical: Gauge,
    pub swap_used: Gauge,
    pub running: Gauge,
    /// Set at each render: the scheduler's waiting requests and the
    /// pending ones ([`Metrics::set_scheduler_waiting`]).
    waiting: Gauge,
    /// The scheduler's waiting requests, as the engine last saw them.
    scheduler_waiting: AtomicI64,
    /// Requests a handler accepted and sent the engine thread, not yet
    /// taken into the scheduler.
    pub pending: Gauge,
    pub swapped: Gauge,
    pub preemptions: Counter,
    pub cow_copies: Counter,
    pub prefix_queries: Counter,
    pub prefix_hits: Counter,
    pub prefix_hit_rate: Gauge<f64, AtomicU64>,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub steps: Counter,
    pub requests: Family<Ended, Counter>,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// The metrics, registered, at zero.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("pagedattn");
        let m = Self {
            blocks_total: Gauge::default(),
            blocks_used: Gauge::default(),
            blocks_shared: Gauge::default(),
            blocks_free: Gauge::default(),
            blocks_cached: Gauge::default(),
            blocks_reserved: Gauge::default(),
            kv_usage: Gauge::default(),
            tokens_stored: Gauge::default(),
            tokens_logical: Gauge::default(),
            swap_used: Gauge::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            scheduler_waiting: AtomicI64::new(0),
            pending: Gauge::default(),
            swapped: Gauge::default(),
            preemptions: Counter::default(),
            cow_copies: Counter::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            prefix_hit_rate: Gauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            steps: Counter::default(),
            requests: Family::default(),
            ttft: Histogram::new(TTFT_BUCKETS.iter().copied()),
            itl: Histogram::new(ITL_BUCKETS.iter().copied()),
            e2e: Histogram::new(E2E_BUCKETS.iter().copied()),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register(
            "kv_blocks_total",
            "KV blocks in the pool",
            m.blocks_total.clone(),
        );
        r.register(
            "kv_blocks_used",
            "KV blocks held by at least one sequence",
            m.blocks_used.clone(),
        );
        r.register(
            "kv_blocks_shared",
            "KV blocks held by more than one sequence (prefix sharing, copy-on-write)",
            m.blocks_shared.clone(),
        );
        r.register(
            "kv_blocks_free",
            "KV blocks free (plain)",
            m.blocks_free.clone(),
        );
        r.register(
            "kv_blocks_cached",
            "KV blocks free but still holding a cached prefix (evictable)",
            m.blocks_cached.clone(),
        );
        r.register(
            "kv_blocks_reserved",
            "KV blocks reserved by the running requests (reservation policies only)",
            m.blocks_reserved.clone(),
        );
        r.register(
            "kv_usage_ratio",
            "Share of the pool held by sequences",
            m.kv_usage.clone(),
        );
        r.register(
            "kv_tokens_stored",
            "Token slots holding K/V (a token shared by several sequences counts once)",
            m.tokens_stored.clone(),
        );
        r.register(
            "kv_tokens_logical",
            "Tokens of the live sequences (a shared token once per sequence): what they would store without sharing",
            m.tokens_logical.clone(),
        );
        r.register(
            "swap_blocks_used",
            "Host swap blocks holding swapped-out KV",
            m.swap_used.clone(),
        );
        r.register("requests_running", "Requests running", m.running.clone());
        r.register(
            "requests_waiting",
            "Requests queued, not yet running: in the scheduler's queue or on their way to it (requests_pending)",
            m.waiting.clone(),
        );
        r.register(
            "requests_pending",
            "Requests accepted by a handler and not yet taken by the engine thread (counted in requests_waiting too)",
            m.pending.clone(),
        );
        r.register(
            "requests_swapped",
            "Requests preempted to host swap",
            m.swapped.clone(),
        );
        r.register(
            "preemptions",
            "Requests preempted (recompute or swap)",
            m.preemptions.clone(),
        );
        r.register(
            "cow_copies",
            "Copy-on-write block copies",
            m.cow_copies.clone(),
        );
        r.register(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            m.prefix_queries.clone(),
        );
        r.register(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            m.prefix_hits.clone(),
        );
        r.register(
            "prefix_cache_hit_rate",
            "prefix_cache_hits / prefix_cache_queries",
            m.prefix_hit_rate.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of admitted requests",
            m.prompt_tokens.clone(),
        );
        r.register(
            "generation_tokens",
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        r.register("engine_steps", "Engine steps run", m.steps.clone());
        r.register(
            "requests_finished",
            "Requests ended, by reason",
            m.requests.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Time from arrival to a request's first token",
            m.ttft.clone(),
        );
        r.register(
            "inter_token_latency_seconds",
            "Time between a request's tokens",
            m.itl.clone(),
        );
        r.register(
            "request_latency_seconds",
            "Time from arrival to the last token",
            m.e2e.clone(),
        );
        Self { registry, ..m }
    }

    /// The scheduler's waiting requests, after the engine's last look.
    pub fn set_scheduler_waiting(&self, n: i64) {
        self.scheduler_waiting.store(n, Ordering::Relaxed);
    }

    /// What `requests_waiting` reports: the scheduler's queue and the
    /// requests on their way to it.
    pub fn waiting(&self) -> i64 {
        self.scheduler_waiting.load(Ordering::Relaxed) + self.pending.get()
    }

    /// One request ended.
    pub fn ended(&self, reason: &str) {
        self.requests
            .get_or_create(&Ended {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        self.waiting.set(self.waiting());
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_exported() {
        let m = Metrics::new();
        m.ended("stop");
        m.ttft.observe(0.3);
        // One in the scheduler's queue, two on their way to it.
        m.set_scheduler_waiting(1);
        m.pending.inc_by(2);
        let text = m.render();
        for name in [
            "kv_blocks_total",
            "kv_blocks_used",
            "kv_blocks_shared",
            "kv_blocks_free",
            "kv_blocks_cached",
            "kv_blocks_reserved",
            "kv_usage_ratio",
            "kv_tokens_stored",
            "kv_tokens_logical",
            "swap_blocks_used",
            "requests_running",
            "requests_waiting",
            "requests_pending",
            "requests_swapped",
            "preemptions_total",
            "cow_copies_total",
            "prefix_cache_queries_total",
            "prefix_cache_hits_total",
            "prefix_cache_hit_rate",
            "prompt_tokens_total",
            "generation_tokens_total",
            "engine_steps_total",
            "requests_finished_total{reason=\"stop\"} 1",
            "time_to_first_token_seconds_bucket{le=\"0.5\"} 1",
            "inter_token_latency_seconds_count",
            "request_latency_seconds_count",
            "requests_waiting 3",
            "requests_pending 2",
        ] {
            assert!(
                text.contains(&format!("pagedattn_{name}")),
                "{name} missing:\n{text}"
            );
        }
    }
}
