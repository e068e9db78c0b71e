//! The end-to-end demo: a seeded multi-tenant decode loop on a real adapter.
//!
//! Requests arrive, their prompts are written to the paged pool, each forks
//! into `n` parallel samples that share the prompt's blocks, and every step
//! runs the real pipeline (`copy_blocks` -> `write_kv` -> `decode`, for every
//! layer) and checks each output against the f64 reference computed on a host
//! mirror of the pool. The same code drives the native CLI and the browser
//! page (everything GPU-facing is async; natively it is blocked on).

use std::collections::HashMap;

use pagedattn::blocks::{
    BlockError, BlockManager, BlockManagerConfig, Child, GroupOutput, RequestId, Scheduler,
    SchedulerConfig, SchedulerError, SeqId, SKIP_WRITE,
};
use pagedattn::gpu::{
    AttentionPlan, AttnOptions, DecodeTables, Gpu, GpuError, KvCache, KvCacheConfig, KvDtype,
    PagedAttention, SwapSpace,
};
use pagedattn::reference::{self, rel_l2, AttnParams, HostPool, Stored};
use pagedattn::rng::SplitMix64;

/// Demo settings.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DemoConfig {
    /// Seed of everything random.
    pub seed: u64,
    /// Requests in the workload.
    pub requests: u32,
    /// Parallel samples per request (forks sharing the prompt).
    pub samples: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks in the pool.
    pub num_blocks: u32,
    /// Transformer layers.
    pub layers: u32,
    /// Query heads.
    pub num_heads: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Element type of the pool (packed f16 by default; int8 and fp8 are
    /// quantized, and checked against the exact values). Serialized by name.
    #[serde(with = "dtype_name")]
    pub dtype: KvDtype,
    /// Prompt lengths are drawn from `[1, max_prompt]`.
    pub max_prompt: u32,
    /// Output lengths are drawn from `[1, max_output]`.
    pub max_output: u32,
    /// A new request arrives every this many steps.
    pub arrival_every: u32,
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self {
            seed: 7,
            requests: 8,
            samples: 3,
            block_size: 16,
            num_blocks: 256,
            layers: 2,
            num_heads: 8,
            num_kv_heads: 2,
            head_dim: 64,
            dtype: KvDtype::F16,
            max_prompt: 120,
            max_output: 48,
            arrival_every: 4,
        }
    }
}

/// Most requests a demo may have (its queue is drawn up front).
pub const MAX_REQUESTS: u32 = 10_000;
/// Most parallel samples per request.
pub const MAX_SAMPLES: u32 = 64;
/// Largest host mirror of the pool (K and V of every layer, f32), in bytes:
/// 1 GiB, or 524,288 token slots (`num_blocks * block_size`) at the
/// default shape.
pub const MAX_MIRROR_BYTES: u64 = 1 << 30;

impl DemoConfig {
    /// Bytes of the host mirrors the reference check keeps of the pool and
    /// of the swap space (as large as the pool).
    pub fn mirror_bytes(&self) -> u128 {
        self.layers as u128
            * 4
            * self.num_blocks as u128
            * self.num_kv_heads as u128
            * self.block_size as u128
            * self.head_dim as u128
            * 4
    }

    /// Blocks a request with the longest prompt needs to be admitted: its
    /// prompt, plus the two blocks per sample the demo keeps for growth.
    pub fn blocks_to_admit_longest(&self) -> u64 {
        let bs = self.block_size.max(1) as u64;
        (self.max_prompt.max(1) as u64).div_ceil(bs) + 2 * self.samples as u64
    }

    /// Checks what can be checked without an adapter: the block size (a
    /// power of two in 1..=256), a non-empty pool whose host mirror is at
    /// most [`MAX_MIRROR_BYTES`] and that can admit a request with the
    /// longest prompt, at most [`MAX_REQUESTS`] requests and
    /// [`MAX_SAMPLES`] samples. Zero requests, samples, lengths or arrival
    /// gaps are degenerate but valid. [`Demo::new`] checks first; the
    /// adapter's own limits (heads, head_dim, binding size) are checked there.
    pub fn validate(&self) -> Result<(), DemoError> {
        let bad = |m: String| Err(DemoError::Config(m));
        let bs = self.block_size;
        if !(1..=256).contains(&bs) || !bs.is_power_of_two() {
            return bad(format!("block size {bs} is not a power of two in 1..=256"));
        }
        if self.num_blocks == 0 {
            return bad("the pool needs at least 1 block".into());
        }
        if self.requests > MAX_REQUESTS {
            return bad(format!(
                "{} requests is over the limit of {MAX_REQUESTS}",
                self.requests
            ));
        }
        if self.samples > MAX_SAMPLES {
            return bad(format!(
                "{} samples per request is over the limit of {MAX_SAMPLES}",
                self.samples
            ));
        }
        let bytes = self.mirror_bytes();
        if bytes > MAX_MIRROR_BYTES as u128 {
            return bad(format!(
                "a pool of {} blocks of {bs} tokens needs a {} MiB host mirror for the \
                 reference check, over the limit of {} MiB; use fewer blocks",
                self.num_blocks,
                bytes >> 20,
                MAX_MIRROR_BYTES >> 20
            ));
        }
        let need = self.blocks_to_admit_longest();
        if need > self.num_blocks as u64 {
            return bad(format!(
                "a pool of {} blocks of {bs} tokens cannot admit a request with the longest \
                 prompt ({} tokens) and {} samples: that takes {need} blocks (the prompt, plus \
                 2 per sample for growth); use more blocks, a larger block size or fewer samples",
                self.num_blocks, self.max_prompt, self.samples
            ));
        }
        Ok(())
    }
}

/// What went wrong in a demo step.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DemoError {
    /// The settings are out of range (see [`DemoConfig::validate`]).
    #[error("invalid demo settings: {0}")]
    Config(String),
    /// Nothing was scheduled twice in a row while requests were held (the
    /// scheduler preempts, so this is a backstop against a bug).
    #[error("the demo is stuck: {0}")]
    Stalled(String),
    /// From the block manager.
    #[error(transparent)]
    Blocks(#[from] BlockError),
    /// From the scheduler.
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    /// From the GPU layer.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// One sequence the demo ran in a step.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DemoSeq {
    /// Block-manager handle.
    #[serde(skip)]
    pub seq: SeqId,
    /// Request it belongs to.
    pub request: u32,
    /// Sample index within the request.
    pub sample: u32,
    /// Tokens still to generate.
    pub remaining: u32,
}

/// What one step did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StepReport {
    /// Step number, from 0.
    pub step: u32,
    /// Requests admitted this step.
    pub admitted: u32,
    /// Sequences forked this step.
    pub forked: u32,
    /// Sequences finished this step.
    pub finished: u32,
    /// Sequences decoded this step.
    pub decoded: u32,
    /// Tokens written to the pool this step (all layers count once).
    pub written: u32,
    /// Copy-on-write block copies applied this step.
    pub copied: u32,
    /// The copies themselves, `(src, dst)`.
    pub copies: Vec<[u32; 2]>,
    /// Requests preempted this step (swapped out or freed for recompute).
    pub preempted: u32,
    /// Blocks swapped out to host memory and back in this step.
    pub swapped_out: u32,
    pub swapped_in: u32,
    /// Blocks held by sequences.
    pub used: u32,
    /// Blocks held by more than one sequence.
    pub shared: u32,
    /// Free blocks.
    pub free: u32,
    /// Distinct token slots filled.
    pub tokens_stored: u32,
    /// Sum of sequence lengths (what unshared storage would hold).
    pub logical_tokens: u32,
    /// Worst relative L2 error of any decode output against the reference.
    pub max_rel_err: f64,
    /// Wall time of the GPU work and readback, milliseconds.
    pub gpu_ms: f64,
    /// Requests waiting to be admitted (arrived or not).
    pub waiting: u32,
    /// Requests swapped out to host memory.
    pub swapped: u32,
    /// K/V bytes one layer's decode read this step (shared prefixes once
    /// when the cascade ran), and what plain paged decode reads.
    pub kv_bytes: u64,
    pub kv_bytes_plain: u64,
    /// Shared segments attended once this step (0: plain decode).
    pub cascade_segments: u32,
    /// Blocks of those segments (the page marks them).
    pub cascade_blocks: Vec<u32>,
    /// Wall time of layer 0's decode with the step's plan (the cascade when
    /// it ran), submit to readback, milliseconds; and, in steps that ran
    /// the cascade, of plain paged decode over the same tables and query
    /// (else the same figure).
    pub decode_ms: f64,
    pub decode_ms_plain: f64,
    /// Whether `Cascade::Auto` (the library's default, by its cost model
    /// for this adapter's kernel) takes the cascade on this step. The demo
    /// forces it on wherever prompts are shared, to show it, and times
    /// plain decode beside it: this says which of the two an engine on
    /// the defaults would run.
    pub auto_cascade: bool,
}

/// A request the scheduler holds: its samples, in the order of its
/// group's sequences.
struct ReqState {
    request: u32,
    output: u32,
    /// `(sample, tokens still to generate)`; empty until the prompt sampled.
    samples: Vec<(u32, u32)>,
}

/// The running demo.
pub struct Demo {
    cfg: DemoConfig,
    rng: SplitMix64,
    sched: Scheduler,
    cache: KvCache,
    attn: PagedAttention,
    /// The step's decode plan (tables and workspace reused across steps).
    plan: AttentionPlan,
    /// Plain decode of the same step, timed beside the cascade.
    plain_plan: AttentionPlan,
    /// Whether a cascade step has run: the first one is run once untimed
    /// first, so its time is decode, not the segment pass's pipeline
    /// compile (which a browser does at first use).
    cascade_warm: bool,
    /// Host mirror of each layer's pool.
    mirror: Vec<HostPool>,
    /// Host swap space, and its mirror.
    swap: SwapSpace,
    mirror_swap: Vec<HostPool>,
    seqs: Vec<DemoSeq>,
    reqs: HashMap<RequestId, ReqState>,
    /// Requests not yet arrived: (request, prompt length, output length).
    queue: Vec<(u32, u32, u32)>,
    step: u32,
    /// Copies applied in total.
    pub total_copies: u64,
    /// Worst error seen in any step.
    pub worst_err: f64,
    /// Consecutive steps that ran nothing while requests were held.
    idle: u32,
}

/// Tolerance of the demo's check: f32 and bf16 KV 1e-5, packed f16 2e-3
/// (the mirror holds the same rounded values, so these are loose bounds);
/// int8 1e-2 and fp8 5e-2 against the exact values (the library's
/// quantization bounds).
pub fn tolerance(dtype: KvDtype) -> f64 {
    match dtype {
        KvDtype::F32 | KvDtype::Bf16 => 1e-5,
        KvDtype::F16 => 2e-3,
        KvDtype::Int8 => 1e-2,
        KvDtype::Fp8E4M3 => 5e-2,
    }
}

impl Demo {
    /// Sets up the pool and the workload, with the adapter's default
    /// decode kernel.
    pub fn new(gpu: &Gpu, cfg: DemoConfig) -> Result<Self, DemoError> {
        Self::with_attention(gpu, cfg, &pagedattn::gpu::AttentionConfig::default())
    }

    /// The same with the attention built as `attn_cfg` says (the CLI's
    /// tuned or forced kernel).
    pub fn with_attention(
        gpu: &Gpu,
        cfg: DemoConfig,
        attn_cfg: &pagedattn::gpu::AttentionConfig,
    ) -> Result<Self, DemoError> {
        cfg.validate()?;
        let mut rng = SplitMix64::new(cfg.seed);
        let width = cfg.samples.max(1) as usize;
        let mut sched = Scheduler::new(
            BlockManagerConfig::new(cfg.num_blocks, cfg.block_size).with_swap_space(cfg.num_blocks),
            SchedulerConfig::new(
                (cfg.max_prompt as usize).max(width).max(256),
                256.max(width),
            ),
        )?;
        sched.scramble_free_list(rng.next_u64());
        let cache = KvCache::new(
            gpu,
            KvCacheConfig::new(
                cfg.num_blocks,
                cfg.block_size,
                cfg.num_kv_heads,
                cfg.head_dim,
            )
            .with_layers(cfg.layers)
            .with_dtype(cfg.dtype),
        )?;
        if cfg.dtype == KvDtype::Fp8E4M3 {
            // K and V are drawn from [-1, 1]: map 1 to E4M3's 448.
            let s = vec![1.0 / 448.0; cfg.num_kv_heads as usize];
            for layer in 0..cfg.layers {
                cache.set_fp8_scales(gpu, layer, &s, &s)?;
            }
        }
        let attn = PagedAttention::new(gpu, &cache, cfg.num_heads, attn_cfg)?;
        let swap = cache.swap_space(cfg.num_blocks)?;
        // Bounded by `validate` (MAX_MIRROR_BYTES), so this fits.
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
        let queue = (0..cfg.requests)
            .map(|r| {
                let p = rng.range(1, cfg.max_prompt.max(1) as u64) as u32;
                let o = rng.range(1, cfg.max_output.max(1) as u64) as u32;
                (r, p, o)
            })
            .collect();
        Ok(Self {
            cfg,
            rng,
            sched,
            cache,
            plan: attn.plan(),
            plain_plan: attn.plan(),
            cascade_warm: false,
            attn,
            mirror,
            swap,
            mirror_swap,
            seqs: Vec::new(),
            reqs: HashMap::new(),
            queue,
            step: 0,
            total_copies: 0,
            worst_err: 0.0,
            idle: 0,
        })
    }

    /// The decode kernel variant the demo runs.
    pub fn kernel(&self) -> pagedattn::gpu::Kernel {
        self.attn.kernel()
    }

    /// Settings.
    pub fn config(&self) -> &DemoConfig {
        &self.cfg
    }

    /// The block manager (for views of the pool).
    pub fn manager(&self) -> &BlockManager {
        self.sched.blocks()
    }

    /// The scheduler (queues, preemption counters).
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// The sequences the pool holds after the last step.
    pub fn sequences(&self) -> &[DemoSeq] {
        &self.seqs
    }

    /// True when every request has finished.
    pub fn done(&self) -> bool {
        self.queue.is_empty() && !self.sched.has_work()
    }

    fn kv_dtype(&self) -> KvDtype {
        self.cache.config().dtype
    }

    /// One step of the library's scheduler: arrivals join its queue; it
    /// decides the batch (preempting by swap or recompute when the pool is
    /// full); then swap-out -> swap-in -> copy-on-write -> write_kv ->
    /// decode on the GPU for every layer, checked against the reference;
    /// then the sampled tokens go back to the scheduler.
    pub async fn step(&mut self, gpu: &Gpu) -> Result<StepReport, DemoError> {
        let mut rep = StepReport {
            step: self.step,
            ..Default::default()
        };
        self.arrive()?;
        let step = self.sched.schedule()?;
        let view = step.view();
        rep.preempted = step.preempted().len() as u32;
        rep.swapped_out = step.swap_out().len() as u32;
        rep.swapped_in = step.swap_in().len() as u32;
        rep.copied = view.copies.len() as u32;
        rep.copies = view.copies.clone();
        rep.written = view
            .slot_mapping
            .iter()
            .filter(|&&s| s != SKIP_WRITE)
            .count() as u32;
        rep.decoded = step.rows().len() as u32;
        self.total_copies += view.copies.len() as u64;
        if step.rows().is_empty() && self.sched.has_work() {
            self.idle += 1;
        } else {
            self.idle = 0;
        }
        if self.idle >= 2 {
            let (w, r, s) = self.sched.queue_lengths();
            return Err(DemoError::Stalled(format!(
                "at step {}, {w} requests wait, {r} run and {s} are swapped out, but \
                 nothing was scheduled twice in a row",
                self.step
            )));
        }
        if !step.rows().is_empty() {
            self.plan_step(gpu, view, &mut rep)?;
        }
        let t0 = now_ms();
        self.move_blocks(gpu, &step).await?;
        let mut max_err: f64 = 0.0;
        for layer in 0..self.cfg.layers {
            max_err = max_err.max(self.run_layer(gpu, &step, layer, &mut rep).await?);
        }
        rep.gpu_ms = now_ms() - t0;
        rep.max_rel_err = max_err;
        self.worst_err = self.worst_err.max(max_err);
        let outputs = self.sample(&step, &mut rep)?;
        for f in self.sched.commit(&step, &outputs)? {
            rep.finished += f.sequences.len() as u32;
            self.reqs.remove(&f.request);
        }
        self.refresh_sequences()?;
        let (w, _, s) = self.sched.queue_lengths();
        rep.waiting = w as u32 + self.queue.len() as u32;
        rep.swapped = s as u32;
        let st = self.sched.blocks().stats();
        rep.used = st.used as u32;
        rep.shared = st.shared as u32;
        rep.free = (st.free + st.evictable) as u32;
        rep.tokens_stored = st.tokens_stored as u32;
        rep.logical_tokens = st.logical_tokens as u32;
        self.step = self.step.saturating_add(1);
        Ok(rep)
    }

    /// The next request of the workload joins the scheduler's queue, every
    /// `arrival_every` steps.
    fn arrive(&mut self) -> Result<(), DemoError> {
        if !self.step.is_multiple_of(self.cfg.arrival_every.max(1)) || self.queue.is_empty() {
            return Ok(());
        }
        let (r, p, o) = self.queue.remove(0);
        let prompt: Vec<u32> = (0..p).map(|_| self.rng.below(32000) as u32).collect();
        let width = self.cfg.samples.max(1) as usize;
        let id = self.sched.add_request(&prompt, width, b"")?;
        let state = ReqState {
            request: r,
            output: o,
            samples: Vec::new(),
        };
        self.reqs.insert(id, state);
        Ok(())
    }

    /// One plan for the step's decode (the same tables in every layer): it
    /// finds the shared prefixes and reads each once (the cascade). Forced
    /// on, to show it: under Auto a software adapter (the browser's
    /// SwiftShader, lavapipe) keeps plain decode. Where the step has shared
    /// segments, the plain plan is made too, so layer 0 can time both.
    fn plan_step(
        &mut self,
        gpu: &Gpu,
        view: &pagedattn::blocks::BatchView,
        rep: &mut StepReport,
    ) -> Result<(), DemoError> {
        let with = |cascade: pagedattn::gpu::Cascade| {
            [AttnOptions {
                cascade,
                ..Default::default()
            }]
        };
        let tables = DecodeTables::from_view(view);
        let on = with(pagedattn::gpu::Cascade::On);
        self.attn.plan_decode(gpu, &mut self.plan, &tables, &on)?;
        rep.kv_bytes = self.plan.kv_bytes_per_layer();
        rep.kv_bytes_plain = self.plan.cascade().map_or(rep.kv_bytes, |c| c.1);
        rep.cascade_segments = self.plan.cascade().map_or(0, |c| c.2 as u32);
        if rep.cascade_segments == 0 {
            return Ok(());
        }
        let t = pagedattn::gpu::find_segments(
            self.cfg.num_blocks,
            self.cfg.block_size,
            &view.kv_indptr,
            &view.kv_indices,
            &view.seq_lens,
            pagedattn::gpu::CASCADE_CHUNK_TOKENS / self.cfg.block_size,
        );
        rep.cascade_blocks = t.seg_indices;
        let auto = [AttnOptions::default()];
        self.attn
            .plan_decode(gpu, &mut self.plain_plan, &tables, &auto)?;
        rep.auto_cascade = self.plain_plan.cascade().is_some();
        // Where Auto stays plain, its plan is the plain one to time.
        if rep.auto_cascade {
            let off = with(pagedattn::gpu::Cascade::Off);
            self.attn
                .plan_decode(gpu, &mut self.plain_plan, &tables, &off)?;
        }
        Ok(())
    }

    /// Swap out (pool -> host) before anything reuses those blocks, then
    /// swap in, then copy-on-write (all layers, one submit each), on the
    /// GPU and on the host mirror alike.
    async fn move_blocks(
        &mut self,
        gpu: &Gpu,
        step: &pagedattn::blocks::Step,
    ) -> Result<(), DemoError> {
        if !step.swap_out().is_empty() {
            self.cache
                .swap_out_async(gpu, step.swap_out(), &mut self.swap)
                .await?;
            for (pool, swap) in self.mirror.iter().zip(self.mirror_swap.iter_mut()) {
                swap.take_blocks(pool, step.swap_out());
            }
        }
        if !step.swap_in().is_empty() {
            self.cache.swap_in(gpu, step.swap_in(), &self.swap)?;
            for (pool, swap) in self.mirror.iter_mut().zip(self.mirror_swap.iter()) {
                pool.take_blocks(swap, step.swap_in());
            }
        }
        self.cache.copy_blocks(gpu, &step.view().copies)?;
        Ok(())
    }

    /// One layer: the step's new K/V written (GPU and mirror), then its
    /// decode run and checked against the reference. Returns the worst
    /// relative error of the layer's runs.
    async fn run_layer(
        &mut self,
        gpu: &Gpu,
        step: &pagedattn::blocks::Step,
        layer: u32,
        rep: &mut StepReport,
    ) -> Result<f64, DemoError> {
        let view = step.view();
        let (nkv, d) = (self.cfg.num_kv_heads as usize, self.cfg.head_dim as usize);
        let dtype = self.kv_dtype();
        let n = view.slot_mapping.len();
        let k = self.rng.signed_vec(n * nkv * d);
        let v = self.rng.signed_vec(n * nkv * d);
        self.cache
            .write_kv(gpu, layer, &k, &v, &view.slot_mapping)?;
        let host = &mut self.mirror[layer as usize];
        host.copy_blocks(&view.copies);
        // SKIP_WRITE (a cached prompt's last token) is outside the pool:
        // not written, as the kernel skips it.
        host.write(&view.slot_mapping, &k, &v, Stored::from(dtype));
        if step.rows().is_empty() {
            return Ok(0.0);
        }
        let q = self
            .rng
            .signed_vec(step.rows().len() * self.cfg.num_heads as usize * d);
        let bytes = (q.len() * 4) as u64;
        let qb = gpu.storage_init("q", &q)?;
        // Layer 0 of a cascade step also runs plain decode, timed the
        // same way, so both times can be shown.
        let plain = layer == 0 && rep.cascade_segments > 0;
        // The first cascade step runs its plan once more, first, and
        // drops that run (its time includes the pipeline's compile).
        let warm = plain && !self.cascade_warm;
        self.cascade_warm |= plain;
        // (the step's plan or plain decode's, whether it runs)
        let runs = [(true, warm), (true, true), (false, plain)];
        let mut outs = Vec::new();
        for (main, _) in runs.into_iter().filter(|&(_, run)| run) {
            let plan = if main {
                &mut self.plan
            } else {
                &mut self.plain_plan
            };
            let ob = gpu.storage_init("out", &vec![f32::NAN; q.len()])?;
            let t = now_ms();
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            self.attn.run(
                gpu,
                &mut enc,
                plan,
                &self.cache,
                layer,
                0,
                &qb.as_entire_buffer_binding(),
                &ob.as_entire_buffer_binding(),
            )?;
            gpu.queue.submit([enc.finish()]);
            let out: Vec<f32> = gpu.read_async(&ob, bytes).await?;
            outs.push((out, now_ms() - t));
        }
        if warm {
            outs.remove(0);
        }
        if layer == 0 {
            rep.decode_ms = outs[0].1;
            rep.decode_ms_plain = outs.last().map_or(0.0, |o| o.1);
        }
        let pool = self.mirror[layer as usize].view();
        let p = AttnParams::new(self.cfg.num_heads as usize, d);
        let want = reference::decode(
            &pool,
            &p,
            &q,
            &view.kv_indptr,
            &view.kv_indices,
            &view.seq_lens,
        );
        Ok(outs
            .iter()
            .map(|(out, _)| rel_l2(out, &want))
            .fold(0.0, f64::max))
    }

    /// Sampling: the prompt's first token starts `samples` sequences, each
    /// with its own output length; then one token per sequence.
    fn sample(
        &mut self,
        step: &pagedattn::blocks::Step,
        rep: &mut StepReport,
    ) -> Result<Vec<GroupOutput>, DemoError> {
        let mut outputs = Vec::with_capacity(step.sample().len());
        for &rid in step.sample() {
            let st = self
                .reqs
                .get_mut(&rid)
                .ok_or(SchedulerError::UnknownRequest(rid))?;
            let mut children = Vec::new();
            let mut next = Vec::new();
            let fresh = st.samples.is_empty();
            rep.admitted += fresh as u32;
            let count = if fresh {
                self.cfg.samples.max(1) as usize
            } else {
                st.samples.len()
            };
            for i in 0..count {
                // (parent, sample, tokens still to generate)
                let (parent, s, remaining) = if fresh {
                    let s = i as u32;
                    rep.forked += (s > 0) as u32;
                    let remaining = if s == 0 {
                        st.output
                    } else {
                        self.rng.range(1, st.output.max(1) as u64) as u32
                    };
                    (0, s, remaining)
                } else {
                    let (s, remaining) = st.samples[i];
                    (i, s, remaining)
                };
                let token = self.rng.below(32000) as u32;
                children.push(Child {
                    parent,
                    token,
                    finished: remaining <= 1,
                });
                if remaining > 1 {
                    next.push((s, remaining - 1));
                }
            }
            st.samples = next;
            outputs.push(GroupOutput {
                request: rid,
                children,
            });
        }
        Ok(outputs)
    }

    /// The sequences the pool holds now (swapped-out ones aside), by
    /// request; a group's children join at the next step.
    fn refresh_sequences(&mut self) -> Result<(), DemoError> {
        self.seqs.clear();
        for (rid, st) in &self.reqs {
            for (i, &seq) in self.sched.sequences(*rid)?.iter().enumerate() {
                if self.sched.blocks().is_swapped(seq)? {
                    continue;
                }
                let (sample, remaining) =
                    st.samples.get(i).copied().unwrap_or((i as u32, st.output));
                self.seqs.push(DemoSeq {
                    seq,
                    request: st.request,
                    sample,
                    remaining,
                });
            }
        }
        self.seqs.sort_by_key(|q| (q.request, q.sample));
        Ok(())
    }
}

/// Milliseconds from a monotonic clock (performance.now() in the browser).
pub fn now_ms() -> f64 {
    #[cfg(not(target_arch = "wasm32"))]
    {
        use std::sync::OnceLock;
        static START: OnceLock<std::time::Instant> = OnceLock::new();
        START
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_secs_f64()
            * 1e3
    }
    #[cfg(target_arch = "wasm32")]
    {
        js_sys::Date::now()
    }
}

/// `KvDtype` as its name ("f32", "f16", "int8", "fp8") in serialized configs.
mod dtype_name {
    use pagedattn::gpu::KvDtype;

    pub fn serialize<S: serde::Serializer>(d: &KvDtype, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(d.name())
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<KvDtype, D::Error> {
        let name = <String as serde::Deserialize>::deserialize(d)?;
        super::parse_kv_dtype(&name).map_err(serde::de::Error::custom)
    }
}

/// A KV dtype by name (`--kv-dtype`): f32, f16, bf16, int8 or fp8.
pub fn parse_kv_dtype(s: &str) -> Result<KvDtype, String> {
    KvDtype::from_name(s)
        .ok_or_else(|| format!("--kv-dtype {s}: not one of f32, f16, bf16, int8, fp8"))
}
