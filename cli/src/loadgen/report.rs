//! A load run's figures, as `vllm bench serve` names them, and their table.

use serde::Serialize;

use super::{LoadSpec, Outcome, Peaks};

/// Mean, median and 99th percentile of a sample (0 when empty).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Stats {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
}

impl Stats {
    /// Of `v` (NaN-free by construction: times and ratios of them).
    pub fn of(v: &[f64]) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        let q = |p: f64| s[((s.len() - 1) as f64 * p).round() as usize];
        Self {
            mean: s.iter().sum::<f64>() / s.len() as f64,
            p50: q(0.5),
            p99: q(0.99),
        }
    }
}

/// What a run measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunReport {
    pub spec: Option<LoadSpec>,
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    /// The first failures' messages (at most 3).
    pub errors: Vec<String>,
    pub duration_s: f64,
    pub request_throughput: f64,
    pub output_throughput: f64,
    /// Seconds.
    pub ttft: Stats,
    /// Seconds per output token after the first, per request.
    pub tpot: Stats,
    pub itl: Stats,
    pub e2e: Stats,
    /// Latency / output tokens per sequence, seconds per token.
    pub normalized_latency: Stats,
    /// Requests per second whose normalized latency met the SLO.
    pub goodput: f64,
    pub peaks: Option<Peaks>,
}

/// The figures of a run's outcomes.
pub fn summarize(
    spec: &LoadSpec,
    outcomes: &[Outcome],
    duration: f64,
    peaks: Option<Peaks>,
) -> RunReport {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok()).collect();
    let width = spec.sampling.width().max(1) as f64;
    let per_seq = |o: &Outcome| (o.output_tokens as f64 / width).max(1.0);
    let norm: Vec<f64> = ok.iter().map(|o| o.e2e / per_seq(o)).collect();
    let tpot: Vec<f64> = ok
        .iter()
        .filter(|o| per_seq(o) > 1.0)
        .map(|o| (o.e2e - o.ttft) / (per_seq(o) - 1.0))
        .collect();
    let itl: Vec<f64> = ok.iter().flat_map(|o| o.itl.iter().copied()).collect();
    let good = norm.iter().filter(|&&n| n <= spec.slo).count();
    let d = duration.max(1e-9);
    RunReport {
        spec: Some(spec.clone()),
        requests: outcomes.len(),
        completed: ok.len(),
        failed: outcomes.len() - ok.len(),
        errors: outcomes
            .iter()
            .filter(|o| !o.ok())
            .take(3)
            .map(|o| format!("{}: {}", o.status, o.error.clone().unwrap_or_default()))
            .collect(),
        duration_s: duration,
        request_throughput: ok.len() as f64 / d,
        output_throughput: ok.iter().map(|o| o.output_tokens).sum::<usize>() as f64 / d,
        ttft: Stats::of(&ok.iter().map(|o| o.ttft).collect::<Vec<_>>()),
        tpot: Stats::of(&tpot),
        itl: Stats::of(&itl),
        e2e: Stats::of(&ok.iter().map(|o| o.e2e).collect::<Vec<_>>()),
        normalized_latency: Stats::of(&norm),
        goodput: good as f64 / d,
        peaks,
    }
}

fn ms(s: &Stats) -> String {
    format!(
        "{:.0} / {:.0} / {:.0}",
        s.mean * 1e3,
        s.p50 * 1e3,
        s.p99 * 1e3
    )
}

/// The run as text.
pub fn render(r: &RunReport) -> String {
    let mut s = format!(
        "requests: {} sent, {} completed, {} failed in {:.1} s\n",
        r.requests, r.completed, r.failed, r.duration_s
    );
    for e in &r.errors {
        s += &format!("  failed: {}\n", e.chars().take(200).collect::<String>());
    }
    s += &format!(
        "throughput: {:.3} requests/s, {:.1} output tokens/s; goodput {:.3} requests/s (SLO {:.0} ms/token)\n",
        r.request_throughput,
        r.output_throughput,
        r.goodput,
        r.spec.as_ref().map_or(0.0, |sp| sp.slo * 1e3)
    );
    s += "latency, ms (mean / p50 / p99):\n";
    s += &format!(
        "  TTFT {}\n  TPOT {}\n  ITL  {}\n  E2E  {}\n",
        ms(&r.ttft),
        ms(&r.tpot),
        ms(&r.itl),
        ms(&r.e2e)
    );
    s += &format!(
        "  normalized latency (E2E / output tokens) {}\n",
        ms(&r.normalized_latency)
    );
    if let Some(p) = &r.peaks {
        s += &format!(
            "server: peak batch {:.0} running, {:.0} waiting, {:.0} swapped; peak KV blocks {:.0} used, {:.0} shared, {:.0} reserved; {:.0} preemptions\n",
            p.running, p.waiting, p.swapped, p.blocks_used, p.blocks_shared, p.blocks_reserved, p.preemptions
        );
        if p.logical_tokens > 0.0 {
            s += &format!(
                "sharing: at the peak, {:.0} tokens of live sequences in {:.0} slots ({:.1} % saved)\n",
                p.logical_tokens,
                p.stored_tokens,
                100.0 * (1.0 - p.stored_tokens / p.logical_tokens)
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_summaries() {
        let s = Stats::of(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!((s.mean, s.p50, s.p99), (2.5, 3.0, 4.0));
        assert_eq!(Stats::of(&[]), Stats::default());
    }
}
