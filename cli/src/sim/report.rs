//! What a run reports: per-policy summaries (serialised as JSON) and the
//! plain-text comparison table.

use std::fmt::Write as _;

use serde::Serialize;

use super::runlog::{RunLog, Sample};
use super::workload::Request;

/// Summary of one policy on one scenario. Fractions are in `[0, 1]`; token
/// counts are KV slots (one token of one sequence, all layers).
#[derive(Clone, Debug, Serialize)]
pub struct PolicyReport {
    /// `paged`, `max` or `oracle`.
    pub policy: String,
    /// KV element type of the run ("f16" unless `--kv-dtype` says).
    pub kv_dtype: String,
    /// Display name, e.g. `paged/16`.
    pub label: String,
    /// Block size of the paged policy (`null` for contiguous ones).
    pub block_size: Option<u32>,
    /// Slots the policy could hold (the budget, rounded down to whole blocks).
    pub capacity_tokens: usize,
    /// Steps until the last request finished (throughput proxy: fewer is better).
    pub steps: u64,
    /// Tokens decoded, all sequences together.
    pub generated_tokens: u64,
    /// `generated_tokens / steps`.
    pub tokens_per_step: f64,
    /// Time-averaged KV utilisation: sum over steps of stored / sum of held.
    pub utilisation: f64,
    /// Stored / held at the step where tokens stored peaked (heaviest load).
    pub utilisation_at_peak: f64,
    /// Most slots held at once.
    pub peak_held_tokens: usize,
    /// Mean slots held over busy steps.
    pub mean_held_tokens: f64,
    /// Most distinct slots holding a token at once.
    pub peak_stored_tokens: usize,
    /// Held slots that a live sequence would still fill, time-averaged share of held.
    pub reserved_frac: f64,
    /// Held slots that will never hold a token (internal fragmentation),
    /// time-averaged share of held.
    pub internal_frag_frac: f64,
    /// Mean over busy steps of (held - stored) per running sequence.
    pub waste_per_seq_mean: f64,
    /// Largest (held - stored) per running sequence at any step.
    pub waste_per_seq_max: f64,
    /// Most sequences running at once.
    pub peak_seqs: usize,
    /// Mean running sequences over busy steps.
    pub mean_seqs: f64,
    /// Most requests running at once.
    pub peak_requests: usize,
    /// Mean running requests over busy steps.
    pub mean_requests: f64,
    /// Longest queue of arrived, not running requests.
    pub max_queue: usize,
    /// Mean steps from arrival to first admission.
    pub mean_queue_wait: f64,
    /// Longest wait from arrival to first admission.
    pub max_queue_wait: u64,
    /// Requests preempted (freed and requeued), counting repeats.
    pub preemptions: u64,
    /// Tokens prefilled again after preemptions.
    pub recomputed_tokens: u64,
    /// Mean over busy steps of logical - stored tokens (what sharing saved).
    pub sharing_saved_mean: f64,
    /// Most tokens saved by sharing at one step.
    pub sharing_saved_peak: usize,
    /// Sum over steps of (logical - stored) / sum of logical.
    pub sharing_saved_frac: f64,
    /// Copy-on-write block copies.
    pub cow_copies: u64,
    /// Paged only: K/V tokens decode attention reads per generated token,
    /// plain paged decode and cascade decode (shared prefixes once); bytes
    /// are these times 2 x head_dim x bytes per element, per KV head and
    /// layer.
    pub attn_read_per_token_plain: f64,
    pub attn_read_per_token_cascade: f64,
    /// Batches whose copy list reused a block as both source and destination.
    pub copy_conflicts: u64,
    /// Prompt tokens served from the prefix cache.
    pub prefix_hit_tokens: u64,
    /// Requests that finished (all of them, or the run would have failed).
    pub requests_finished: usize,
    /// Slots still held after the run (0 unless something leaked).
    pub leaked_tokens: usize,
    /// Paged: free blocks after the run, once cached blocks are dropped.
    pub blocks_free_at_end: Option<usize>,
    /// Paged: blocks in the pool.
    pub blocks_total: Option<usize>,
    /// Paged: how the scheduler preempted (recompute, swap, auto).
    pub preemption: Option<String>,
    /// Paged: groups preempted by recompute and by swapping, and swap
    /// preemptions that fell back to recompute (swap space full).
    pub recomputed_groups: u64,
    pub swapped_groups: u64,
    pub swap_fallbacks: u64,
    /// Paged: K/V bytes moved by swapping (out and back in), for the cost
    /// model's bytes per token.
    pub swapped_bytes: u64,
    /// Paged, modelled: time spent swapping, and recomputing, in ms
    /// (`CostModel`).
    pub swap_ms: f64,
    pub recompute_ms: f64,
    /// Per-step samples, for the plot (not serialised).
    #[serde(skip)]
    pub series: Vec<Sample>,
}

/// The drawn workload of a scenario, as realised.
#[derive(Clone, Debug, Serialize)]
pub struct WorkloadSummary {
    /// Requests.
    pub requests: usize,
    /// Mean prompt length (with the shared prefix).
    pub mean_input: f64,
    /// Mean output length over every sample (per request for beam search).
    pub mean_output: f64,
    /// Longest prompt + output.
    pub max_seq_len: usize,
    /// Step of the last arrival.
    pub last_arrival: u64,
}

impl WorkloadSummary {
    pub(super) fn of(reqs: &[Request]) -> Self {
        let n = reqs.len().max(1) as f64;
        let outs: Vec<usize> = reqs
            .iter()
            .flat_map(|r| r.outputs.iter().copied())
            .collect();
        Self {
            requests: reqs.len(),
            mean_input: round(reqs.iter().map(|r| r.prompt.len()).sum::<usize>() as f64 / n),
            mean_output: round(outs.iter().sum::<usize>() as f64 / outs.len().max(1) as f64),
            max_seq_len: reqs
                .iter()
                .map(|r| r.prompt.len() + r.outputs.iter().max().copied().unwrap_or(0))
                .max()
                .unwrap_or(0),
            last_arrival: reqs.iter().map(|r| r.arrival).max().unwrap_or(0),
        }
    }
}

/// Every policy on one sampling mode.
#[derive(Clone, Debug, Serialize)]
pub struct ScenarioReport {
    /// `single`, `parallel:N` or `beam:K`.
    pub sampling: String,
    /// The workload all policies ran.
    pub workload: WorkloadSummary,
    /// One entry per policy, in the order asked for.
    pub policies: Vec<PolicyReport>,
}

/// Rounds to 4 decimals, so JSON and tables stay readable.
pub(super) fn round(v: f64) -> f64 {
    if v.is_finite() {
        (v * 1e4).round() / 1e4
    } else {
        0.0
    }
}

fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        round(num / den)
    } else {
        0.0
    }
}

impl PolicyReport {
    pub(super) fn from_log(
        policy: &str,
        label: String,
        block_size: Option<u32>,
        capacity_tokens: usize,
        log: RunLog,
    ) -> Self {
        let s = &log.samples;
        let busy = s.len().max(1) as f64;
        let sum = |f: &dyn Fn(&Sample) -> u64| s.iter().map(f).sum::<u64>() as f64;
        let held = sum(&|x| x.held as u64);
        let stored = sum(&|x| x.stored as u64);
        let logical = sum(&|x| x.logical as u64);
        let reserved = sum(&|x| x.reserved as u64);
        let seqs = sum(&|x| x.seqs as u64);
        // Peak load: the first step with the most tokens stored. (The first
        // step of peak *held* would be a burst of fresh admissions for a
        // reserving policy, whose slabs are still empty.)
        let peak = s
            .iter()
            .fold(None::<&Sample>, |b, x| match b {
                Some(b) if b.stored >= x.stored => Some(b),
                _ => Some(x),
            })
            .copied()
            .unwrap_or_default();
        let waste = |x: &Sample| (x.held - x.stored.min(x.held)) as f64;
        let frag = held - stored - reserved;
        Self {
            policy: policy.to_string(),
            kv_dtype: "f16".into(),
            label,
            block_size,
            capacity_tokens,
            steps: log.steps,
            generated_tokens: log.generated,
            tokens_per_step: ratio(log.generated as f64, log.steps as f64),
            utilisation: ratio(stored, held),
            utilisation_at_peak: ratio(peak.stored as f64, peak.held as f64),
            peak_held_tokens: s.iter().map(|x| x.held as usize).max().unwrap_or(0),
            mean_held_tokens: round(held / busy),
            peak_stored_tokens: s.iter().map(|x| x.stored as usize).max().unwrap_or(0),
            reserved_frac: ratio(reserved, held),
            internal_frag_frac: ratio(frag.max(0.0), held),
            waste_per_seq_mean: ratio(held - stored, seqs),
            waste_per_seq_max: round(
                s.iter()
                    .filter(|x| x.seqs > 0)
                    .map(|x| waste(x) / x.seqs as f64)
                    .fold(0.0, f64::max),
            ),
            peak_seqs: s.iter().map(|x| x.seqs as usize).max().unwrap_or(0),
            mean_seqs: round(seqs / busy),
            peak_requests: s.iter().map(|x| x.requests as usize).max().unwrap_or(0),
            mean_requests: round(sum(&|x| x.requests as u64) / busy),
            max_queue: s.iter().map(|x| x.queue as usize).max().unwrap_or(0),
            mean_queue_wait: ratio(log.waits.iter().sum::<u64>() as f64, log.waits.len() as f64),
            max_queue_wait: log.waits.iter().copied().max().unwrap_or(0),
            preemptions: log.preemptions,
            recomputed_tokens: log.recomputed,
            sharing_saved_mean: round((logical - stored) / busy),
            sharing_saved_peak: s
                .iter()
                .map(|x| x.logical.saturating_sub(x.stored) as usize)
                .max()
                .unwrap_or(0),
            sharing_saved_frac: ratio(logical - stored, logical),
            cow_copies: log.counters.cow_copies,
            attn_read_per_token_plain: ratio(
                log.counters.attn_tokens_plain as f64,
                log.generated as f64,
            ),
            attn_read_per_token_cascade: ratio(
                log.counters.attn_tokens_cascade as f64,
                log.generated as f64,
            ),
            copy_conflicts: log.counters.copy_conflicts,
            prefix_hit_tokens: log.counters.prefix_hit_tokens,
            requests_finished: log.finished,
            leaked_tokens: log.end.leaked,
            blocks_free_at_end: log.end.blocks.map(|b| b.0),
            blocks_total: log.end.blocks.map(|b| b.1),
            preemption: None,
            recomputed_groups: 0,
            swapped_groups: 0,
            swap_fallbacks: 0,
            swapped_bytes: 0,
            swap_ms: 0.0,
            recompute_ms: 0.0,
            series: log.samples,
        }
    }
}

fn pct(v: f64) -> String {
    format!("{:.1}%", v * 100.0)
}

/// The comparison table of one scenario, with a one-line verdict under it.
pub(super) fn render_scenario(out: &mut String, sc: &ScenarioReport, header: &str) {
    let w = &sc.workload;
    let _ = writeln!(
        out,
        "== {header}, sampling {}: {} requests, mean input {:.1}, mean output {:.1} tokens ==",
        sc.sampling, w.requests, w.mean_input, w.mean_output
    );
    let cols = [
        "policy",
        "util",
        "util@pk",
        "reserv",
        "frag",
        "waste/seq",
        "seqs pk",
        "seqs avg",
        "queue",
        "preempt",
        "shared",
        "saved",
        "steps",
        "tok/step",
    ];
    let rows: Vec<[String; 14]> = sc
        .policies
        .iter()
        .map(|p| {
            [
                p.label.clone(),
                pct(p.utilisation),
                pct(p.utilisation_at_peak),
                pct(p.reserved_frac),
                pct(p.internal_frag_frac),
                format!("{:.1}", p.waste_per_seq_mean),
                p.peak_seqs.to_string(),
                format!("{:.1}", p.mean_seqs),
                p.max_queue.to_string(),
                p.preemptions.to_string(),
                format!("{:.0}", p.sharing_saved_mean),
                pct(p.sharing_saved_frac),
                p.steps.to_string(),
                format!("{:.2}", p.tokens_per_step),
            ]
        })
        .collect();
    let mut widths: Vec<usize> = cols.iter().map(|c| c.len()).collect();
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: Vec<&str>| -> String {
        let mut l = String::new();
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            if i == 0 {
                let _ = write!(l, "{c:<w$}");
            } else {
                let _ = write!(l, "  {c:>w$}");
            }
        }
        l
    };
    let _ = writeln!(out, "{}", line(cols.to_vec()));
    for r in &rows {
        let _ = writeln!(out, "{}", line(r.iter().map(String::as_str).collect()));
    }
    // Compare the usual block size of 16 when it ran, else the first paged run.
    let paged = sc
        .policies
        .iter()
        .find(|p| p.block_size == Some(16))
        .or_else(|| sc.policies.iter().find(|p| p.policy == "paged"));
    let max = sc.policies.iter().find(|p| p.policy == "max");
    if let Some(p) = paged {
        if p.attn_read_per_token_plain > 0.0 {
            let _ = writeln!(
                out,
                "-> {} attention reads {:.0} K/V tokens per generated token; {:.0} with the cascade (shared prefixes once, {:.2}x)",
                p.label,
                p.attn_read_per_token_plain,
                p.attn_read_per_token_cascade,
                p.attn_read_per_token_cascade / p.attn_read_per_token_plain,
            );
        }
    }
    // Preemption: what each paged run paid, under the cost model.
    for p in sc.policies.iter().filter(|p| p.preemption.is_some()) {
        if p.preemptions == 0 {
            continue;
        }
        let _ = writeln!(
            out,
            "-> {} preempted {} times ({} swapped, {} recomputed, {} swap fallbacks): {:.1} MB swapped out and in ({:.1} ms modelled), {} tokens recomputed ({:.1} ms modelled); {:.1} ms in all",
            p.label,
            p.preemptions,
            p.swapped_groups,
            p.recomputed_groups,
            p.swap_fallbacks,
            p.swapped_bytes as f64 / 1e6,
            p.swap_ms,
            p.recomputed_tokens,
            p.recompute_ms,
            p.swap_ms + p.recompute_ms,
        );
    }
    if let (Some(p), Some(m)) = (paged, max) {
        let _ = writeln!(
            out,
            "-> {} keeps {} of held memory as tokens vs {} for {}; {:.1}x the mean concurrent sequences; {:.2}x the throughput (steps {} vs {})",
            p.label,
            pct(p.utilisation),
            pct(m.utilisation),
            m.label,
            p.mean_seqs / m.mean_seqs.max(1e-9),
            m.steps as f64 / p.steps.max(1) as f64,
            p.steps,
            m.steps,
        );
    }
    out.push('\n');
}

/// Column legend printed once under the tables.
pub(super) const LEGEND: &str = "\
util: tokens stored / memory held, time-averaged (util@pk: at the step with the most tokens stored).
reserv: held slots a running sequence will still fill; frag: held slots that never get a token
(internal fragmentation); waste/seq: (held - stored) per running sequence, in tokens.
seqs: concurrent sequences (peak, mean); queue: longest queue; preempt: preemptions (paged: by
the library scheduler, --preemption; contiguous: recompute). Modelled preemption time: swapped bytes /
--swap-gbps + --copy-overhead-us per block, layer and K or V copy; recomputed tokens / --recompute-tps.
shared/saved: tokens not stored twice thanks to copy-on-write forks and prefix caching (mean, share of
logical tokens). steps: steps to finish the workload; tok/step: decoded tokens per step.
Contiguous policies ignore external fragmentation between slabs, which flatters them.
K/V tokens read per generated token: times 2 x head_dim x bytes per element for bytes, per KV head and layer.
Layer groups (--layer-groups): memory in tokens of every layer (each pool weighted by its share of the
layers), the pools splitting the budget's bytes; shared/saved then counts what the windows gave back too.
";
