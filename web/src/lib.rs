#![cfg(target_arch = "wasm32")]
//! The browser side of the demo: wasm-bindgen bindings that run the same
//! [`Demo`] as the native CLI on the page's WebGPU device and hand the page a
//! JSON snapshot of the pool after every step.
//!
//! Nothing about paging or attention is reimplemented here: the page only
//! draws what [`BlockManager`] holds and what [`Demo::step`] reports. What this
//! module adds is the view (who owns each block, which blocks were just
//! copied), the contiguous-reservation comparison, and an independent
//! recount of the block accounting from the block tables, so that the page
//! and its end-to-end test can see a bookkeeping bug instead of drawing it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use serde::{Deserialize, Serialize};
use wasm_bindgen::prelude::*;

mod model;
pub use model::WebModel;

use pagedattn::blocks::BlockManager;
use pagedattn::gpu::{Gpu, KvCacheConfig, KvDtype};
use pagedattn_cli::demo::{tolerance, Demo, DemoConfig, StepReport};

thread_local! {
    /// One device for the page's lifetime: opening an adapter takes a
    /// while, and a reset only needs a fresh pool.
    static GPU: RefCell<Option<Rc<Gpu>>> = const { RefCell::new(None) };
}

#[wasm_bindgen]
extern "C" {
    #[wasm_bindgen(js_namespace = console, js_name = error)]
    fn console_error(msg: &str);
}

/// Runs once when the module is instantiated: panics go to the console and
/// to `window.pagedattnPanic`, so the page can show them instead of a trap.
#[wasm_bindgen(start)]
pub fn start() {
    std::panic::set_hook(Box::new(|info| {
        let msg = info.to_string();
        console_error(&msg);
        let _ = js_sys::Reflect::set(
            &js_sys::global(),
            &JsValue::from_str("pagedattnPanic"),
            &JsValue::from_str(&msg),
        );
    }));
}

async fn gpu() -> Result<Rc<Gpu>, JsValue> {
    if let Some(g) = GPU.with(|g| g.borrow().clone()) {
        return Ok(g);
    }
    let g = Rc::new(Gpu::new_async().await.map_err(err)?);
    // Validation errors outside an error scope would otherwise only reach the
    // console; the page reports them next to the kernels' results.
    g.device.on_uncaptured_error(std::sync::Arc::new(|e| {
        console_error(&format!("uncaptured WebGPU error: {e}"));
        GPU_ERRORS.with(|l| l.borrow_mut().push(e.to_string()));
    }));
    GPU.with(|s| *s.borrow_mut() = Some(g.clone()));
    Ok(g)
}

thread_local! {
    static GPU_ERRORS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

fn err(e: impl std::fmt::Display) -> JsValue {
    JsValue::from_str(&e.to_string())
}

fn json(v: &impl Serialize) -> Result<String, JsValue> {
    serde_json::to_string(v).map_err(err)
}

/// What the page can choose; the model shape stays the demo's default.
#[derive(Clone, Debug, Deserialize)]
struct WebConfig {
    seed: u64,
    requests: u32,
    samples: u32,
    block_size: u32,
    num_blocks: u32,
    /// "f16" (default), "f32", "bf16", "int8" or "fp8".
    #[serde(default)]
    kv_dtype: Option<String>,
}

impl WebConfig {
    fn demo(&self) -> DemoConfig {
        DemoConfig {
            seed: self.seed,
            requests: self.requests,
            samples: self.samples,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            // Packed f16 (the default) needs no `shader-f16` (SwiftShader
            // has none); int8 and fp8 need no feature either.
            dtype: self
                .kv_dtype
                .as_deref()
                .and_then(KvDtype::from_name)
                .unwrap_or(KvDtype::F16),
            ..DemoConfig::default()
        }
    }
}

/// The adapter, as the page shows it.
#[derive(Serialize)]
struct AdapterView {
    name: String,
    /// wgpu's name of the backend (`BrowserWebGpu` in a browser).
    backend: String,
    webgpu: bool,
    driver: String,
    max_storage_binding_mib: u64,
    max_buffer_mib: u64,
    storage_buffers_per_stage: u32,
    shader_f16: bool,
}

/// Opens the browser's WebGPU adapter and describes it as JSON. Fails with
/// a readable message when there is none.
#[wasm_bindgen]
pub async fn adapter() -> Result<String, JsValue> {
    let g = gpu().await?;
    json(&AdapterView {
        name: g.info.name.clone(),
        backend: format!("{:?}", g.info.backend),
        webgpu: g.info.backend == wgpu::Backend::BrowserWebGpu,
        driver: g.info.driver.clone(),
        max_storage_binding_mib: g.limits.max_storage_buffer_binding_size as u64 >> 20,
        max_buffer_mib: g.limits.max_buffer_size >> 20,
        storage_buffers_per_stage: g.limits.max_storage_buffers_per_shader_stage,
        shader_f16: g.features.contains(wgpu::Features::SHADER_F16),
    })
}

/// Largest pool (in blocks) of the demo's shape at `block_size` that fits
/// one storage binding of this adapter.
#[wasm_bindgen]
pub async fn max_blocks(block_size: u32) -> Result<u32, JsValue> {
    let g = gpu().await?;
    let d = DemoConfig::default();
    let cfg = KvCacheConfig::new(1, block_size, d.num_kv_heads, d.head_dim)
        .with_layers(d.layers)
        .with_dtype(KvDtype::F16);
    Ok(cfg.max_blocks_for(g.max_binding_bytes()))
}

struct Inner {
    gpu: Rc<Gpu>,
    /// `None` while a step is in flight (it owns the demo across the await).
    demo: Option<Demo>,
    /// Prompt length of each admitted request, for the contiguous comparison.
    prompts: HashMap<u32, u32>,
    last: Option<StepReport>,
}

/// A running demo, driven by the page one step at a time.
#[wasm_bindgen]
pub struct WebDemo {
    inner: Rc<RefCell<Inner>>,
}

#[wasm_bindgen]
impl WebDemo {
    /// A fresh pool and workload from `config` (JSON: seed, requests,
    /// samples, block_size, num_blocks).
    pub async fn create(config: String) -> Result<WebDemo, JsValue> {
        let wc: WebConfig = serde_json::from_str(&config).map_err(err)?;
        let g = gpu().await?;
        let demo = Demo::new(&g, wc.demo()).map_err(err)?;
        Ok(WebDemo {
            inner: Rc::new(RefCell::new(Inner {
                gpu: g,
                demo: Some(demo),
                prompts: HashMap::new(),
                last: None,
            })),
        })
    }

    /// Runs one step of the demo (copy_blocks, write_kv and decode on the
    /// GPU, checked against the f64 reference); resolves to the snapshot.
    pub fn step(&self) -> js_sys::Promise {
        let inner = self.inner.clone();
        wasm_bindgen_futures::future_to_promise(async move {
            let (gpu, mut demo) = {
                let mut s = inner.borrow_mut();
                let demo = s
                    .demo
                    .take()
                    .ok_or_else(|| JsValue::from_str("a step is already running"))?;
                (s.gpu.clone(), demo)
            };
            let result = demo.step(&gpu).await;
            let mut s = inner.borrow_mut();
            s.demo = Some(demo);
            let report = result.map_err(err)?;
            s.last = Some(report);
            Ok(JsValue::from_str(&snapshot(&mut s)?))
        })
    }

    /// The current state as JSON (the same shape `step` resolves to).
    pub fn snapshot(&self) -> Result<String, JsValue> {
        snapshot(&mut self.inner.borrow_mut())
    }
}

/// One physical block as drawn (the demo's page and the model's).
#[derive(Serialize)]
struct BlockView {
    /// Reference count (0: free).
    refs: u32,
    /// Request of the sequences holding it; -1 when free or held by
    /// several requests.
    request: i64,
    /// The holding sequence's index in its request (the demo's sample, the
    /// model's sample or beam) when one sequence holds it, else -1.
    sample: i64,
    /// Tokens filled (the most any holder has written into it).
    fill: u32,
    /// Destination of a copy-on-write copy this step.
    copied_to: bool,
    /// Source of a copy-on-write copy this step.
    copied_from: bool,
}

/// The pool recounted from the block tables, for drawing and for checking
/// the block manager: who holds each block and how full it is, what the
/// step copied, and every disagreement with the manager's own counts.
struct Tally {
    blocks: Vec<BlockView>,
    holders: Vec<u32>,
    owner: Vec<Option<u64>>,
    mixed: Vec<bool>,
    problems: Vec<String>,
    block_size: u32,
    tables: usize,
}

impl Tally {
    fn new(m: &BlockManager) -> Self {
        let n = m.config().num_blocks;
        Self {
            blocks: (0..n)
                .map(|b| BlockView {
                    refs: m.ref_count(b).unwrap_or(0),
                    request: -1,
                    sample: -1,
                    fill: 0,
                    copied_to: false,
                    copied_from: false,
                })
                .collect(),
            holders: vec![0; n as usize],
            owner: vec![None; n as usize],
            mixed: vec![false; n as usize],
            problems: Vec::new(),
            block_size: m.config().block_size,
            tables: 0,
        }
    }

    /// Counts sequence `id` (index `sample` of `request`), holding `len`
    /// tokens in `table`.
    fn add(
        &mut self,
        id: impl std::fmt::Display,
        request: u64,
        sample: u32,
        table: &[u32],
        len: u32,
    ) {
        let bs = self.block_size;
        self.tables += 1;
        if table.len() as u32 != len.div_ceil(bs) {
            self.problems.push(format!(
                "sequence {id} holds {len} tokens in {} blocks",
                table.len()
            ));
        }
        for (i, &b) in table.iter().enumerate() {
            let Some(v) = self.blocks.get_mut(b as usize) else {
                self.problems
                    .push(format!("sequence {id} maps to block {b} outside the pool"));
                continue;
            };
            let bi = b as usize;
            self.holders[bi] += 1;
            match self.owner[bi] {
                None => self.owner[bi] = Some(request),
                Some(r) if r != request => self.mixed[bi] = true,
                _ => {}
            }
            v.sample = if self.holders[bi] == 1 {
                sample as i64
            } else {
                -1
            };
            v.fill = v.fill.max(len.saturating_sub(i as u32 * bs).min(bs));
        }
    }

    /// Marks the step's copy-on-write copies (source, destination).
    fn copies(&mut self, copies: &[[u32; 2]]) {
        for c in copies {
            if let Some(v) = self.blocks.get_mut(c[1] as usize) {
                v.copied_to = true;
            }
            if let Some(v) = self.blocks.get_mut(c[0] as usize) {
                v.copied_from = true;
            }
        }
    }

    /// Blocks the tables hold, and those more than one table holds.
    fn held(&self) -> (usize, usize) {
        let used = self.holders.iter().filter(|&&h| h > 0).count();
        let shared = self.holders.iter().filter(|&&h| h > 1).count();
        (used, shared)
    }

    /// The blocks as drawn, and every disagreement with `m`.
    fn finish(mut self, m: &BlockManager) -> (Vec<BlockView>, Vec<String>) {
        for (b, v) in self.blocks.iter_mut().enumerate() {
            if v.refs != self.holders[b] {
                self.problems.push(format!(
                    "block {b}: ref count {} but {} tables hold it",
                    v.refs, self.holders[b]
                ));
            }
            if let (Some(r), false) = (self.owner[b], self.mixed[b]) {
                v.request = r as i64;
            }
        }
        let st = m.stats();
        if st.sequences != self.tables {
            self.problems.push(format!(
                "manager has {} sequences, the page tracks {}",
                st.sequences, self.tables
            ));
        }
        let (used, shared) = self.held();
        if used != st.used || shared != st.shared {
            self.problems.push(format!(
                "tables hold {used} blocks ({shared} shared), manager counts {} ({} shared)",
                st.used, st.shared
            ));
        }
        if st.used + st.free + st.evictable != st.total {
            self.problems.push(format!(
                "used {} + free {} + evictable {} != total {}",
                st.used, st.free, st.evictable, st.total
            ));
        }
        (self.blocks, self.problems)
    }
}

#[derive(Serialize)]
struct SeqView {
    id: String,
    request: u32,
    sample: u32,
    len: u32,
    remaining: u32,
    table: Vec<u32>,
}

#[derive(Serialize)]
struct Numbers {
    total: u32,
    used: u32,
    free: u32,
    shared: u32,
    sequences: u32,
    waiting: u32,
    tokens_stored: u32,
    logical_tokens: u32,
    /// Token slots held but not filled, as a share of held slots.
    waste_pct: f64,
    /// What reserving `prompt + max_output` tokens per live sequence, with
    /// no sharing, would take, in blocks of this size.
    contiguous_blocks: u32,
    contiguous_tokens: u32,
    max_output: u32,
}

#[derive(Serialize)]
struct Check {
    /// The recount from the block tables agrees with the manager.
    consistent: bool,
    problems: Vec<String>,
    tolerance: f64,
    /// The pool's element type ("f16", "int8", ...).
    kv_dtype: &'static str,
    /// Worst error over every step so far.
    worst_err: f64,
    total_copies: u64,
    /// WebGPU errors raised outside an error scope since the page loaded.
    gpu_errors: Vec<String>,
}

#[derive(Serialize)]
struct Snapshot<'a> {
    step: Option<&'a StepReport>,
    done: bool,
    block_size: u32,
    blocks: Vec<BlockView>,
    seqs: Vec<SeqView>,
    numbers: Numbers,
    check: Check,
}

fn snapshot(s: &mut Inner) -> Result<String, JsValue> {
    let Inner {
        demo,
        prompts,
        last,
        ..
    } = s;
    let demo = demo
        .as_ref()
        .ok_or_else(|| JsValue::from_str("a step is running"))?;
    let cfg = demo.config();
    let m = demo.manager();
    let bs = cfg.block_size;
    let mut tally = Tally::new(m);
    let mut seqs = Vec::new();
    let mut contiguous_tokens = 0u32;
    for q in demo.sequences() {
        let id = q.seq;
        let table = m.block_table(id).map_err(err)?.to_vec();
        let len = m.seq_len(id).map_err(err)? as u32;
        // A request is first seen right after admission, holding its prompt;
        // its forks share that prompt.
        let prompt = *prompts.entry(q.request).or_insert(len);
        contiguous_tokens += prompt + cfg.max_output;
        tally.add(id, q.request as u64, q.sample, &table, len);
        seqs.push(SeqView {
            id: q.seq.to_string(),
            request: q.request,
            sample: q.sample,
            len,
            remaining: q.remaining,
            table,
        });
    }
    if let Some(r) = last.as_ref() {
        tally.copies(&r.copies);
    }
    let (blocks, problems) = tally.finish(m);
    let st = m.stats();
    let waste_pct = if st.capacity_held == 0 {
        0.0
    } else {
        100.0 * (st.capacity_held - st.tokens_stored) as f64 / st.capacity_held as f64
    };
    let snap = Snapshot {
        step: last.as_ref(),
        done: demo.done(),
        block_size: bs,
        blocks,
        seqs,
        numbers: Numbers {
            total: st.total as u32,
            used: st.used as u32,
            free: (st.free + st.evictable) as u32,
            shared: st.shared as u32,
            sequences: st.sequences as u32,
            waiting: last.as_ref().map_or(cfg.requests, |r| r.waiting),
            tokens_stored: st.tokens_stored as u32,
            logical_tokens: st.logical_tokens as u32,
            waste_pct,
            contiguous_blocks: contiguous_tokens.div_ceil(bs),
            contiguous_tokens,
            max_output: cfg.max_output,
        },
        check: Check {
            consistent: problems.is_empty(),
            problems,
            tolerance: tolerance(cfg.dtype),
            kv_dtype: cfg.dtype.name(),
            worst_err: demo.worst_err,
            total_copies: demo.total_copies,
            gpu_errors: GPU_ERRORS.with(|l| l.borrow().clone()),
        },
    };
    json(&snap)
}

/// One decode kernel variant checked on this page's adapter.
#[derive(Serialize)]
struct KernelCheck {
    kernel: &'static str,
    dtype: &'static str,
    /// `plain`, `sinks` (a logit per head) or `sink tokens` (StreamingLLM).
    form: &'static str,
    /// Relative L2 error against the f64 reference (`null` if not finite).
    rel_l2: Option<f64>,
    error: Option<String>,
}

impl KernelCheck {
    /// A run's result against the reference.
    fn of(
        kernel: &'static str,
        dtype: &'static str,
        form: &'static str,
        r: Result<Vec<f32>, pagedattn::gpu::GpuError>,
        want: &[f64],
    ) -> Self {
        let (rel_l2, error) = match r {
            Ok(out) => {
                let e = pagedattn::reference::rel_l2(&out, want);
                (e.is_finite().then_some(e), None)
            }
            Err(e) => (None, Some(e.to_string())),
        };
        Self {
            kernel,
            dtype,
            form,
            rel_l2,
            error,
        }
    }
}

/// Runs every decode kernel variant (tiled, lanes, serial) on this adapter
/// over a random paged batch (shuffled blocks, odd GQA group of 3, split
/// and unsplit, f32 and packed-f16 KV) against the f64 reference: the
/// end-to-end test checks each result against the demo's tolerance.
#[wasm_bindgen]
pub async fn kernel_check(seed: u64) -> Result<String, JsValue> {
    use pagedattn::gpu::{AttnOptions, KvCache, PagedAttention, Split};
    use pagedattn::reference::{self, PagedPool};
    let g = gpu().await?;
    let mut rng = pagedattn::rng::SplitMix64::new(seed);
    let (kvh, group, hd, bs) = (2u32, 3u32, 64u32, 16u32);
    let lens = [1u32, 30, 333, 700];
    let blocks: Vec<u32> = lens.iter().map(|l| l.div_ceil(bs)).collect();
    let nb: u32 = blocks.iter().sum::<u32>() + 3;
    let mut ids: Vec<u32> = (0..nb).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut indptr = vec![0u32];
    for b in &blocks {
        indptr.push(indptr.last().unwrap() + b);
    }
    let indices = &ids[..*indptr.last().unwrap() as usize];
    let elems = (nb * kvh * bs * hd) as usize;
    let heads = kvh * group;
    let q = rng.signed_vec(lens.len() * (heads * hd) as usize);
    let mut results = Vec::new();
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
        let cfg = KvCacheConfig::new(nb, bs, kvh, hd).with_dtype(dtype);
        let cache = KvCache::new(&g, cfg).map_err(err)?;
        let (mut k, mut v) = (rng.signed_vec(elems), rng.signed_vec(elems));
        let [kb, vb] = cache.layer(0).map_err(err)?;
        for (host, buf) in [(&mut k, kb), (&mut v, vb)] {
            match dtype {
                KvDtype::F32 => g.queue.write_buffer(buf, 0, bytemuck::cast_slice(host)),
                KvDtype::F16 => {
                    let h: Vec<half::f16> = host.iter().map(|&x| half::f16::from_f32(x)).collect();
                    host.iter_mut().zip(&h).for_each(|(x, y)| *x = y.to_f32());
                    g.queue.write_buffer(buf, 0, bytemuck::cast_slice(&h));
                }
                KvDtype::Bf16 => {
                    let h: Vec<half::bf16> =
                        host.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    host.iter_mut().zip(&h).for_each(|(x, y)| *x = y.to_f32());
                    g.queue.write_buffer(buf, 0, bytemuck::cast_slice(&h));
                }
                // Not checked here (the quantized suites run natively).
                KvDtype::Int8 | KvDtype::Fp8E4M3 => {}
            }
        }
        let pool = PagedPool {
            k: &k,
            v: &v,
            num_kv_heads: kvh as usize,
            block_size: bs as usize,
            head_dim: hd as usize,
        };
        let p = reference::AttnParams::new(heads as usize, hd as usize);
        let want = reference::decode(&pool, &p, &q, &indptr, indices, &lens);
        for kernel in PagedAttention::eligible_kernels(&g, &cache, heads) {
            for split in [Split::Never, Split::Tokens(128)] {
                let r = async {
                    let attn = PagedAttention::new(
                        &g,
                        &cache,
                        heads,
                        &pagedattn::gpu::AttentionConfig::new().kernel(kernel),
                    )?;
                    let opts = AttnOptions {
                        split,
                        ..Default::default()
                    };
                    attn.decode_async(&g, &cache, 0, &q, &indptr, indices, &lens, &opts)
                        .await
                }
                .await;
                results.push(KernelCheck::of(
                    kernel.name(),
                    dtype.name(),
                    "plain",
                    r,
                    &want,
                ));
            }
            // The attention forms of 2025-26 models, on the bf16 pool:
            // gpt-oss's sink logits across a split, and StreamingLLM's
            // sink tokens beside a 100-token window.
            if dtype != KvDtype::Bf16 {
                continue;
            }
            let forms = [
                (
                    "sinks",
                    AttnOptions {
                        sinks: Some(vec![0.5, -1.0, 2.0, 0.0, 1.5, -0.5]),
                        split: Split::Tokens(128),
                        ..Default::default()
                    },
                ),
                (
                    "sink tokens",
                    AttnOptions {
                        sliding_window: Some(100),
                        sink_tokens: Some(4),
                        split: Split::Never,
                        ..Default::default()
                    },
                ),
            ];
            for (form, opts) in forms {
                let mut rp = reference::AttnParams::new(heads as usize, hd as usize);
                rp.sinks = opts.sinks.clone();
                rp.sliding_window = opts.sliding_window;
                rp.sink_tokens = opts.sink_tokens;
                let want = reference::decode(&pool, &rp, &q, &indptr, indices, &lens);
                let r = async {
                    let attn = PagedAttention::new(
                        &g,
                        &cache,
                        heads,
                        &pagedattn::gpu::AttentionConfig::new().kernel(kernel),
                    )?;
                    attn.decode_async(&g, &cache, 0, &q, &indptr, indices, &lens, &opts)
                        .await
                }
                .await;
                results.push(KernelCheck::of(kernel.name(), dtype.name(), form, r, &want));
            }
        }
    }
    json(&results)
}

/// One MLA run checked on this page's adapter.
#[derive(Serialize)]
struct MlaCheck {
    /// `decode` or `prefill`.
    form: &'static str,
    dtype: &'static str,
    /// Split-K partitions the plan used.
    partitions: u32,
    /// Worst relative L2 error over the heads against the absorbed f64
    /// reference (`null` if not finite).
    rel_absorbed: Option<f64>,
    /// Worst over the checked heads, up-projected, against the unabsorbed
    /// f64 reference (keys and values materialised per head).
    rel_unabsorbed: Option<f64>,
    error: Option<String>,
}

/// The MLA check's shape and its up-projections: `checked` heads get
/// queries absorbed from (q_nope, q_rope) and are checked unabsorbed too.
struct MlaCase {
    heads: usize,
    rank: usize,
    rope: usize,
    nope: usize,
    scale: f64,
    checked: [usize; 2],
    weights: pagedattn::reference::mla::Weights,
}

/// Each checked head's (q_nope, q_rope), per query row.
type Unabsorbed = Vec<Vec<(Vec<f64>, Vec<f64>)>>;

impl MlaCase {
    /// `n` query rows: the checked heads absorbed from random (q_nope,
    /// q_rope), the others random. Returns the rows and the checked heads'
    /// originals.
    fn queries(&self, rng: &mut pagedattn::rng::SplitMix64, n: usize) -> (Vec<f32>, Unabsorbed) {
        let (heads, row) = (self.heads, self.rank + self.rope);
        let mut q = Vec::with_capacity(n * heads * row);
        let mut orig = Vec::new();
        for _ in 0..n {
            let mut o = Vec::new();
            for h in 0..heads {
                if let Some(i) = self.checked.iter().position(|&c| c == h) {
                    let qn: Vec<f64> = (0..self.nope).map(|_| rng.next_signed() as f64).collect();
                    let qr: Vec<f64> = (0..self.rope)
                        .map(|_| rng.next_signed() as f64 * 2.0)
                        .collect();
                    q.extend(self.weights.absorb(i, &qn, &qr).iter().map(|&x| x as f32));
                    o.push((qn, qr));
                } else {
                    q.extend((0..row).map(|_| rng.next_signed() * 1.9));
                }
            }
            orig.push(o);
        }
        (q, orig)
    }

    /// The worst relative errors of `out` against the absorbed reference
    /// (every head) and the unabsorbed one (the checked heads; in prefill,
    /// every eighth row). `rows_q`: each query row's (sequence, tokens
    /// seen) over the `stored` latent rows.
    fn errors(
        &self,
        form: &str,
        rows_q: &[(usize, usize)],
        stored: &[Vec<f32>],
        q: &[f32],
        out: &[f32],
        orig: &Unabsorbed,
    ) -> (f64, f64) {
        use pagedattn::reference::{mla::absorbed, rel_l2};
        let (heads, rank, row, scale) = (self.heads, self.rank, self.rank + self.rope, self.scale);
        let (mut wa, mut wu) = (0.0f64, 0.0f64);
        for (r, &(s, seen)) in rows_q.iter().enumerate() {
            let rows: Vec<&[f32]> = stored[s].chunks(row).take(seen).collect();
            for h in 0..heads {
                let qa: Vec<f64> = q[(r * heads + h) * row..][..row]
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                let got = &out[(r * heads + h) * rank..][..rank];
                wa = wa.max(rel_l2(got, &absorbed(&qa, &rows, rank, scale)));
                let unabsorbed = self.checked.iter().position(|&c| c == h);
                let Some(i) = unabsorbed.filter(|_| form == "decode" || r % 8 == 0) else {
                    continue;
                };
                let g64: Vec<f64> = got.iter().map(|&x| x as f64).collect();
                let up: Vec<f32> = self
                    .weights
                    .up_project(i, &g64)
                    .iter()
                    .map(|&x| x as f32)
                    .collect();
                let (qn, qr) = &orig[r][i];
                let want = self.weights.unabsorbed(i, qn, qr, &rows, scale);
                wu = wu.max(rel_l2(&up, &want));
            }
        }
        (wa, wu)
    }
}

/// Multi-head latent attention at DeepSeek-V2-Lite's shape (16 heads, a
/// latent row of 512 + 64) on this adapter: decode (unsplit and split) and
/// causal prefill over a cached prefix, f32, f16 and bf16 latent pools
/// with shuffled blocks, against the f64 reference in the absorbed form
/// (every head) and the unabsorbed form (two heads, through random
/// W_UK / W_UV). The kernel's tile fits WebGPU's default 16 KiB of
/// workgroup memory.
#[wasm_bindgen]
pub async fn mla_check(seed: u64) -> Result<String, JsValue> {
    use pagedattn::gpu::{MlaAttention, MlaCache, MlaCacheConfig, Split};
    use pagedattn::reference::mla::Weights;
    let g = gpu().await?;
    let mut rng = pagedattn::rng::SplitMix64::new(seed);
    let (heads, rank, rope, nope, bs) = (16usize, 512usize, 64usize, 128usize, 64u32);
    let row = rank + rope;
    let scale = 1.0 / ((nope + rope) as f64).sqrt();
    let checked = [0usize, 11];
    let mut w = |n: usize| -> Vec<f64> { (0..n).map(|_| rng.next_signed() as f64 * 0.5).collect() };
    let weights = Weights {
        heads: checked.len(),
        rank,
        nope,
        v_dim: nope,
        w_uk: w(checked.len() * rank * nope),
        w_uv: w(checked.len() * rank * nope),
    };
    let case = MlaCase {
        heads,
        rank,
        rope,
        nope,
        scale,
        checked,
        weights,
    };
    // Decode: three sequences; prefill: the last 30 tokens of each.
    let lens = [1u32, 70, 200];
    let per: Vec<u32> = lens.iter().map(|l| l.div_ceil(bs)).collect();
    let nb: u32 = per.iter().sum::<u32>() + 2;
    let mut ids: Vec<u32> = (0..nb).collect();
    rng.shuffle(&mut ids);
    let mut tables = Vec::new();
    let mut at = 0;
    for &p in &per {
        tables.push(ids[at..at + p as usize].to_vec());
        at += p as usize;
    }
    let refs: Vec<&[u32]> = tables.iter().map(|t| t.as_slice()).collect();
    let mut results = Vec::new();
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
        let cfg = MlaCacheConfig {
            num_layers: 1,
            num_blocks: nb,
            block_size: bs,
            kv_lora_rank: rank as u32,
            rope_dim: rope as u32,
            dtype,
        };
        let r: Result<(), pagedattn::gpu::GpuError> = async {
            let cache = MlaCache::new(&g, cfg)?;
            let attn = MlaAttention::new(&g, &cache, heads as u32, scale as f32)?;
            let mut stored: Vec<Vec<f32>> = Vec::new();
            for (t, &len) in tables.iter().zip(&lens) {
                let rows = rng.signed_vec(len as usize * row);
                let slots: Vec<u32> = (0..len)
                    .map(|p| t[(p / bs) as usize] * bs + p % bs)
                    .collect();
                cache.write(&g, 0, &slots, &rows)?;
                stored.push(
                    rows.iter()
                        .map(|&x| match dtype {
                            KvDtype::F16 => half::f16::from_f32(x).to_f32(),
                            KvDtype::Bf16 => half::bf16::from_f32(x).to_f32(),
                            _ => x,
                        })
                        .collect(),
                );
            }
            // Query rows: (sequence, tokens seen); checked heads absorbed
            // from (q_nope, q_rope), the others random.
            let decode: Vec<(usize, usize)> = lens
                .iter()
                .enumerate()
                .map(|(s, &l)| (s, l as usize))
                .collect();
            let starts: Vec<u32> = lens.iter().map(|&l| l.saturating_sub(30)).collect();
            let news: Vec<u32> = lens.iter().zip(&starts).map(|(l, s)| l - s).collect();
            let prefill: Vec<(usize, usize)> = (0..3)
                .flat_map(|s| {
                    let start = starts[s] as usize;
                    (0..news[s] as usize).map(move |k| (s, start + k + 1))
                })
                .collect();
            for (form, rows_q, split) in [
                ("decode", &decode, Split::Never),
                ("decode", &decode, Split::Tokens(64)),
                ("prefill", &prefill, Split::Auto),
            ] {
                let (q, orig) = case.queries(&mut rng, rows_q.len());
                let mut plan = attn.plan();
                if form == "decode" {
                    attn.plan_decode_slices(&g, &mut plan, &refs, &lens, split)?;
                } else {
                    attn.plan_prefill_slices(&g, &mut plan, &refs, &starts, &news, split)?;
                }
                let out = attn.run_async(&g, &mut plan, &cache, 0, &q).await?;
                let (wa, wu) = case.errors(form, rows_q, &stored, &q, &out, &orig);
                results.push(MlaCheck {
                    form,
                    dtype: dtype.name(),
                    partitions: plan.partitions(0),
                    rel_absorbed: wa.is_finite().then_some(wa),
                    rel_unabsorbed: wu.is_finite().then_some(wu),
                    error: None,
                });
            }
            Ok(())
        }
        .await;
        if let Err(e) = r {
            results.push(MlaCheck {
                form: "setup",
                dtype: dtype.name(),
                partitions: 0,
                rel_absorbed: None,
                rel_unabsorbed: None,
                error: Some(e.to_string()),
            });
        }
    }
    json(&results)
}
