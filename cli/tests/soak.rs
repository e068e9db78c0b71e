//! Soak: a long seeded multi-tenant run through the real kernels, checked
//! as it goes, that must end with every block back in the pool and the
//! process's memory where it was after warm-up.
//!
//! Requests come from the simulator's workload generator (Alpaca-like
//! lengths, a shared system prompt so the prefix cache hits, Poisson
//! arrivals, parallel samples that fork off the prompt and copy-on-write
//! its last block). The library's [`Scheduler`] drives the real block
//! manager: chunked prefill mixed with decodes, admission while blocks and
//! batch slots allow, preemption of the newest request when a step does not
//! fit, by recompute or by swapping to host memory (one run each), frees
//! when a sample ends. Every step runs swap-out, swap-in, `copy_blocks`,
//! `write_kv` and `decode` on the adapter for every layer and compares each
//! decode to the f64 reference over a host mirror of the pool (and of the
//! swap space).
//!
//! K and V of a token are a function of (layer, token id, position), so
//! every `check_every` steps a full check reads the whole pool back and
//! verifies, for every position of every live sequence, that the slot its
//! table points to holds exactly that token's K and V (a wrong prefix-cache
//! hit, a missed copy or a reused block shows up here), that the pool
//! equals the mirror, and that the block accounting adds up (reference
//! counts = tables holding each block, `free + evictable + used + awaiting
//! = total`). At the end every block is free again, and the resident set
//! has not grown past a bound since the first check after warm-up.
//!
//! `soak_small` (100 requests) runs in the normal test run; the full
//! size (2000 requests, `PAGEDATTN_SOAK_REQUESTS` to change) is
//! `cargo test --test soak -- --ignored`.

use pagedattn_test_support::common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use common::gpu;
use pagedattn::blocks::{
    BlockManagerConfig, Child, GroupOutput, Preemption, RequestId, Scheduler, SchedulerConfig,
    SeqId, Step,
};
use pagedattn::gpu::{
    AttnOptions, Gpu, KvCache, KvCacheConfig, KvDtype, PagedAttention, SwapSpace,
};
use pagedattn::reference::{self, rel_l2, AttnParams, HostPool, Stored};
use pagedattn::rng::SplitMix64;
use pagedattn_cli::demo::tolerance;
use pagedattn_cli::sim::workload::{self, Arrival, LenDist, Request, Sampling, WorkloadSpec};

#[derive(Clone, Debug)]
struct SoakConfig {
    seed: u64,
    requests: usize,
    samples: usize,
    /// Poisson arrivals per step.
    rate: f64,
    max_len: usize,
    shared_prefix: usize,
    block_size: u32,
    num_blocks: u32,
    layers: u32,
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    dtype: KvDtype,
    /// Most sequences decoding at once.
    max_batch: usize,
    /// Steps between full checks.
    check_every: u64,
    /// How the scheduler preempts.
    preemption: Preemption,
}

#[derive(Debug, Default)]
struct SoakReport {
    steps: u64,
    requests_done: usize,
    tokens_decoded: u64,
    prompt_tokens: u64,
    prefix_hit_tokens: u64,
    copies: u64,
    preemptions: u64,
    swapped_groups: u64,
    blocks_swapped: u64,
    full_checks: u64,
    peak_sequences: usize,
    peak_used_blocks: usize,
    max_rel_err: f64,
    rss_start_mib: f64,
    rss_warm_mib: f64,
    rss_end_mib: f64,
    rss_peak_mib: f64,
    seconds: f64,
}

/// K and V of one token in one layer: `[num_kv_heads][head_dim]` each, a
/// function of (layer, token id, position) only.
fn kv_of(layer: u32, token: u32, pos: usize, row: usize) -> (Vec<f32>, Vec<f32>) {
    let key = ((layer as u64) << 56) ^ ((token as u64) << 24) ^ pos as u64;
    let mut r = SplitMix64::new(key.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    (r.signed_vec(row), r.signed_vec(row))
}

fn round(x: f32, d: KvDtype) -> f32 {
    Stored::from(d).round(x)
}

/// Resident set of this process, MiB.
fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0 / (1 << 20) as f64
}

struct Soak<'a> {
    cfg: SoakConfig,
    gpu: &'a Gpu,
    reqs: Vec<Request>,
    sched: Scheduler,
    kv: KvCache,
    attn: PagedAttention,
    swap: SwapSpace,
    /// Host mirror of each layer's pool (K, V), values as stored, and of
    /// the swap space.
    mirror: Vec<HostPool>,
    mirror_swap: Vec<HostPool>,
    /// Per running request: its workload index and each sample's tokens
    /// still to generate, in its group's order (empty before its first).
    live: BTreeMap<RequestId, (usize, Vec<usize>)>,
    next_arrival: usize,
    rng: SplitMix64,
    rep: SoakReport,
}

impl<'a> Soak<'a> {
    fn new(gpu: &'a Gpu, cfg: SoakConfig) -> Self {
        let spec = WorkloadSpec {
            input: LenDist::LogNormal {
                mean: 19.0,
                sigma: 0.7,
            },
            output: LenDist::LogNormal {
                mean: 58.0,
                sigma: 0.9,
            },
            requests: cfg.requests,
            arrival: Arrival::Poisson(cfg.rate),
            max_len: cfg.max_len,
            max_output: cfg.max_len / 2,
            shared_prefix: cfg.shared_prefix,
            seed: cfg.seed,
        };
        let reqs = workload::generate(&spec, Sampling::Parallel(cfg.samples));
        let mcfg = BlockManagerConfig {
            max_seq_len: cfg.max_len,
            ..BlockManagerConfig::new(cfg.num_blocks, cfg.block_size)
                .with_prefix_caching(true)
                .with_swap_space(cfg.num_blocks)
        };
        let mut scfg = SchedulerConfig::new(256, cfg.max_batch);
        scfg.preemption = cfg.preemption;
        // No watermark: admission runs the pool short, so preemption happens.
        scfg.watermark_blocks = 0;
        let mut sched = Scheduler::new(mcfg, scfg).unwrap();
        sched.scramble_free_list(cfg.seed);
        let kv = KvCache::new(
            gpu,
            KvCacheConfig::new(
                cfg.num_blocks,
                cfg.block_size,
                cfg.num_kv_heads,
                cfg.head_dim,
            )
            .with_layers(cfg.layers)
            .with_dtype(cfg.dtype),
        )
        .unwrap();
        let attn = PagedAttention::new(gpu, &kv, cfg.num_heads, &Default::default()).unwrap();
        let swap = kv.swap_space(cfg.num_blocks).unwrap();
        let pool = || {
            HostPool::new(
                cfg.num_blocks as usize,
                cfg.num_kv_heads as usize,
                cfg.block_size as usize,
                cfg.head_dim as usize,
            )
        };
        let mirror = (0..cfg.layers).map(|_| pool()).collect();
        let mirror_swap = (0..cfg.layers).map(|_| pool()).collect();
        Soak {
            rng: SplitMix64::new(cfg.seed ^ 0x50A4),
            cfg,
            gpu,
            reqs,
            sched,
            kv,
            attn,
            swap,
            mirror,
            mirror_swap,
            live: BTreeMap::new(),
            next_arrival: 0,
            rep: SoakReport::default(),
        }
    }

    fn done(&self) -> bool {
        self.next_arrival == self.reqs.len() && !self.sched.has_work()
    }

    fn step(&mut self) {
        let now = self.rep.steps;
        while self.next_arrival < self.reqs.len() && self.reqs[self.next_arrival].arrival <= now {
            let r = &self.reqs[self.next_arrival];
            let id = self
                .sched
                .add_request(&r.prompt, r.outputs.len(), b"")
                .unwrap();
            self.rep.prompt_tokens += r.prompt.len() as u64;
            self.live.insert(id, (self.next_arrival, Vec::new()));
            self.next_arrival += 1;
        }
        let step = self
            .sched
            .schedule()
            .unwrap_or_else(|e| panic!("step {now}: {e}"));
        self.run_gpu(&step);
        // Sampling: the prompt's first token starts every sample; then one
        // token per sample until its output length.
        let mut outputs = Vec::new();
        for &rid in step.sample() {
            let (req, left) = self.live.get_mut(&rid).unwrap();
            let mut children = Vec::new();
            let mut next = Vec::new();
            let firsts: Vec<(usize, usize)> = if left.is_empty() {
                self.reqs[*req].outputs.iter().map(|&o| (0, o)).collect()
            } else {
                left.iter().enumerate().map(|(i, &l)| (i, l)).collect()
            };
            for (parent, remaining) in firsts {
                let token = self.rng.below(32000) as u32;
                let finished = remaining <= 1;
                children.push(Child {
                    parent,
                    token,
                    finished,
                });
                if !finished {
                    next.push(remaining - 1);
                }
                self.rep.tokens_decoded += 1;
            }
            *left = next;
            outputs.push(GroupOutput {
                request: rid,
                children,
            });
        }
        for f in self.sched.commit(&step, &outputs).unwrap() {
            self.live.remove(&f.request);
            self.rep.requests_done += 1;
        }
        let st = self.sched.blocks().stats();
        self.rep.peak_sequences = self.rep.peak_sequences.max(st.sequences);
        self.rep.peak_used_blocks = self.rep.peak_used_blocks.max(st.used);
        self.rep.steps += 1;
    }

    /// copy_blocks, then write_kv and decode for every layer, each decode
    /// compared to the reference over the mirror.
    fn run_gpu(&mut self, step: &Step) {
        let view = step.view();
        let (kvh, d) = (self.cfg.num_kv_heads as usize, self.cfg.head_dim as usize);
        let row = kvh * d;
        // Swap out (before the blocks are reused), swap in, copy-on-write.
        let moves = |src: &[HostPool], dst: &mut [HostPool], pairs: &[[u32; 2]]| {
            for (s, d) in src.iter().zip(dst.iter_mut()) {
                d.take_blocks(s, pairs);
            }
        };
        if !step.swap_out().is_empty() {
            self.kv
                .swap_out(self.gpu, step.swap_out(), &mut self.swap)
                .unwrap();
            moves(&self.mirror, &mut self.mirror_swap, step.swap_out());
            self.rep.swapped_groups += step
                .preempted()
                .iter()
                .filter(|p| p.1 == Preemption::Swap)
                .count() as u64;
            self.rep.blocks_swapped += step.swap_out().len() as u64;
        }
        if !step.swap_in().is_empty() {
            self.kv
                .swap_in(self.gpu, step.swap_in(), &self.swap)
                .unwrap();
            moves(&self.mirror_swap, &mut self.mirror, step.swap_in());
        }
        self.rep.copies += view.copies.len() as u64;
        self.kv.copy_blocks(self.gpu, &view.copies).unwrap();
        // Token id and position of every new slot, in slot_mapping order.
        let mut new_tokens = Vec::with_capacity(view.slot_mapping.len());
        for r in step.rows() {
            new_tokens.extend(r.positions.clone().map(|p| (0u32, p)));
        }
        for (nt, &t) in new_tokens.iter_mut().zip(step.tokens()) {
            nt.0 = t;
        }
        let params = AttnParams::new(self.cfg.num_heads as usize, d);
        let dtype = self.cfg.dtype;
        for layer in 0..self.cfg.layers {
            let mut k = Vec::with_capacity(new_tokens.len() * row);
            let mut v = Vec::with_capacity(new_tokens.len() * row);
            for &(t, p) in &new_tokens {
                let (kk, vv) = kv_of(layer, t, p, row);
                k.extend(kk);
                v.extend(vv);
            }
            self.kv
                .write_kv(self.gpu, layer, &k, &v, &view.slot_mapping)
                .unwrap();
            let host = &mut self.mirror[layer as usize];
            host.copy_blocks(&view.copies);
            host.write(&view.slot_mapping, &k, &v, Stored::from(dtype));
            if step.rows().is_empty() {
                continue;
            }
            let q = self
                .rng
                .signed_vec(step.rows().len() * self.cfg.num_heads as usize * d);
            let out = self
                .attn
                .decode(
                    self.gpu,
                    &self.kv,
                    layer,
                    &q,
                    &view.kv_indptr,
                    &view.kv_indices,
                    &view.seq_lens,
                    &AttnOptions::default(),
                )
                .unwrap();
            let pool = self.mirror[layer as usize].view();
            let want = reference::decode(
                &pool,
                &params,
                &q,
                &view.kv_indptr,
                &view.kv_indices,
                &view.seq_lens,
            );
            let e = rel_l2(&out, &want);
            assert!(
                e < tolerance(dtype),
                "step {} layer {layer}: rel L2 {e:.2e}",
                self.rep.steps
            );
            self.rep.max_rel_err = self.rep.max_rel_err.max(e);
        }
    }

    /// Reads every layer back: each live sequence's slots hold its own
    /// tokens' K and V, the pool equals the mirror, and the accounting adds up.
    fn full_check(&mut self) {
        let (kvh, d, bs) = (
            self.cfg.num_kv_heads as usize,
            self.cfg.head_dim as usize,
            self.cfg.block_size as usize,
        );
        let row = kvh * d;
        let m = self.sched.blocks();
        let all = m.sequence_ids();
        let mut held: HashSet<SeqId> = HashSet::new();
        for &rid in self.live.keys() {
            held.extend(self.sched.sequences(rid).unwrap().iter().copied());
        }
        assert_eq!(all.iter().copied().collect::<HashSet<_>>(), held);
        // Swapped-out sequences hold no pool blocks.
        let ids: Vec<SeqId> = all
            .iter()
            .copied()
            .filter(|&id| !m.is_swapped(id).unwrap())
            .collect();
        for layer in 0..self.cfg.layers {
            let (gk, gv) = self.kv.read_layer(self.gpu, layer).unwrap();
            let (mk, mv) = (
                &self.mirror[layer as usize].k,
                &self.mirror[layer as usize].v,
            );
            // Only slots of live sequences are defined (freed blocks keep stale data).
            for &id in &ids {
                let toks = m.tokens(id).unwrap();
                let table = m.block_table(id).unwrap();
                // Positions not computed yet (a prompt's later chunks, the
                // children appended for the next step) hold nothing yet.
                let written = toks.len() - m.pending_tokens(id).unwrap();
                for (p, &t) in toks.iter().enumerate().take(written) {
                    let (b, o) = (table[p / bs] as usize, p % bs);
                    let (k, v) = kv_of(layer, t, p, row);
                    for h in 0..kvh {
                        let at = ((b * kvh + h) * bs + o) * d;
                        for i in 0..d {
                            let (wk, wv) = (
                                round(k[h * d + i], self.cfg.dtype),
                                round(v[h * d + i], self.cfg.dtype),
                            );
                            assert!(
                                gk[at + i] == wk && gv[at + i] == wv,
                                "step {}: {id} position {p} (block {b}) layer {layer} holds another token's K/V",
                                self.rep.steps
                            );
                            assert!(mk[at + i] == wk && mv[at + i] == wv, "mirror out of step");
                        }
                    }
                }
            }
        }
        // Block accounting.
        let st = m.stats();
        let mut holders: HashMap<u32, u32> = HashMap::new();
        let mut logical = 0;
        for &id in &ids {
            logical += m.seq_len(id).unwrap();
            for &b in m.block_table(id).unwrap() {
                *holders.entry(b).or_default() += 1;
            }
        }
        for b in 0..self.cfg.num_blocks {
            assert_eq!(m.ref_count(b), Some(holders.get(&b).copied().unwrap_or(0)));
        }
        assert_eq!(st.used, holders.len());
        assert_eq!(st.shared, holders.values().filter(|&&h| h > 1).count());
        assert_eq!(
            st.free + st.evictable + st.used + st.awaiting_copy,
            st.total
        );
        assert_eq!(st.logical_tokens, logical);
        assert_eq!(st.sequences, all.len());
        assert_eq!(st.swapped_sequences, all.len() - ids.len());
        assert_eq!(st.pending_copies, 0, "a commit took every copy");
        assert_eq!(m.available_blocks(), st.free + st.evictable);
        self.rep.full_checks += 1;
    }
}

fn soak(gpu: &Gpu, cfg: SoakConfig) -> SoakReport {
    let t = Instant::now();
    let rss0 = rss_mib();
    let mut s = Soak::new(gpu, cfg.clone());
    let total = cfg.requests;
    let mut warm: Option<f64> = None;
    let mut peak: f64 = rss0;
    while !s.done() {
        s.step();
        if s.rep.steps.is_multiple_of(cfg.check_every) {
            s.full_check();
            let rss = rss_mib();
            peak = peak.max(rss);
            // Warm: a fifth of the requests through, every buffer size seen.
            if warm.is_none() && s.rep.requests_done * 5 >= total {
                warm = Some(rss);
            }
        }
        assert!(s.rep.steps < 200_000, "the soak did not finish");
    }
    s.full_check();
    // Nothing leaked: no sequence, no copy, every block back in the pool
    // (cached ones evictable), and plain free once the cache is dropped.
    let st = s.sched.blocks().stats();
    assert_eq!(
        (
            st.sequences,
            st.used,
            st.pending_copies,
            st.awaiting_copy,
            st.swap_used
        ),
        (0, 0, 0, 0, 0),
        "{st:?}"
    );
    assert_eq!(st.free + st.evictable, st.total, "{st:?}");
    assert_eq!(s.sched.blocks().available_blocks(), cfg.num_blocks as usize);
    assert_eq!(s.rep.requests_done, total);
    let ss = s.sched.stats();
    s.rep.preemptions = ss.recomputed_groups + ss.swapped_groups;
    s.rep.prefix_hit_tokens = s.sched.blocks().prefix_hit_tokens();
    assert_eq!(ss.blocks_swapped_in, ss.blocks_swapped_out);
    gpu.wait().unwrap();
    let end = rss_mib();
    let mut rep = s.rep;
    rep.rss_start_mib = rss0;
    rep.rss_warm_mib = warm.unwrap_or(rss0);
    rep.rss_end_mib = end;
    rep.rss_peak_mib = peak.max(end);
    rep.seconds = t.elapsed().as_secs_f64();
    eprintln!("soak {cfg:?}\n  {rep:?}");
    rep
}

fn config(requests: usize) -> SoakConfig {
    SoakConfig {
        seed: std::env::var("PAGEDATTN_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0x50A6),
        requests,
        samples: 2,
        rate: 0.5,
        max_len: 256,
        shared_prefix: 32,
        block_size: 16,
        num_blocks: 192,
        layers: 2,
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 64,
        dtype: KvDtype::F16,
        max_batch: 48,
        check_every: 25,
        preemption: Preemption::Recompute,
    }
}

/// The memory bound: the resident set may not grow by more than this after
/// warm-up (allocator and driver caches settle; a leak of per-call GPU
/// buffers or host state over thousands of steps would pass it).
const RSS_GROWTH_MIB: f64 = 48.0;

fn check_report(r: &SoakReport, cfg: &SoakConfig) {
    assert!(r.preemptions > 0, "the pool never ran short: {r:?}");
    if cfg.preemption == Preemption::Swap {
        assert!(
            r.swapped_groups > 0 && r.blocks_swapped > 0,
            "never swapped: {r:?}"
        );
    }
    assert!(r.copies > 0 && r.prefix_hit_tokens > 0, "{r:?}");
    assert!(r.full_checks >= r.steps / cfg.check_every);
    assert!(
        r.rss_end_mib - r.rss_warm_mib < RSS_GROWTH_MIB,
        "resident set grew from {:.1} MiB after warm-up to {:.1} MiB",
        r.rss_warm_mib,
        r.rss_end_mib
    );
}

#[test]
fn soak_small() {
    let Some(gpu) = gpu() else { return };
    for preemption in [Preemption::Recompute, Preemption::Swap] {
        let cfg = SoakConfig {
            num_blocks: 48,
            max_batch: 24,
            preemption,
            ..config(100)
        };
        let r = soak(&gpu, cfg.clone());
        check_report(&r, &cfg);
    }
}

#[test]
#[ignore = "minutes: cargo test --test soak -- --ignored"]
fn soak_full() {
    let Some(gpu) = gpu() else { return };
    let requests = std::env::var("PAGEDATTN_SOAK_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    for preemption in [Preemption::Recompute, Preemption::Swap] {
        let cfg = SoakConfig {
            preemption,
            ..config(requests)
        };
        let r = soak(&gpu, cfg.clone());
        check_report(&r, &cfg);
    }
}
