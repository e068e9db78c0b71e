//! An engine on pagedattn, end to end: the example to copy.
//!
//! A toy 4-layer decoder (random weights, fixed seed) serves two requests:
//! - A: a 37-token prompt with parallel sampling (n = 4): one prefill, then
//!   three forks that share A's blocks; sample k always takes the k-th best
//!   token, so the samples diverge and their first writes copy the shared,
//!   partly filled last block (copy-on-write);
//! - B: a prompt whose first 32 tokens (two full blocks) are A's, added after
//!   A's prompt went to the GPU: with prefix caching B reuses those blocks,
//!   and only its 9 other tokens are run through the model.
//!
//! What the engine owns: its device (plain wgpu, lent to pagedattn with
//! [`Gpu::from_device`]), weights, activations, and its own kernels
//! (embedding, matmul with optional residual, logits). What pagedattn owns:
//! the paged K/V pool ([`KvCache`]), the attention kernels
//! ([`PagedAttention`]), and the scheduling and host bookkeeping
//! ([`Scheduler`] over its block manager).
//!
//! Each step: the scheduler's step (rows, token ids, tables, slots,
//! copies) -> plan (host work, once per step) -> ONE encoder with every layer's
//! `QKV matmul -> write_kv -> paged attention -> output matmul + residual`,
//! then the logits -> ONE submit -> ONE readback -> sampled tokens back to
//! the scheduler's commit. Every step's logits are checked against an f64
//! CPU model of the same network.
//!
//! Run it with `cargo run --example engine` (`PAGEDATTN_BACKEND=vulkan` etc.
//! picks a backend); `tests/gpu/engine_example.rs` runs it as a test.

// tests/gpu/engine_example.rs includes this file as a module, where main is unused.
#![allow(dead_code)]

use std::error::Error;
use std::time::Instant;

use pagedattn::blocks::{
    BatchView, BlockManagerConfig, Child, GroupOutput, RequestId, Scheduler, SchedulerConfig, Step,
};
use pagedattn::gpu::{
    ActDtype, AttentionPlan, AttnOptions, DecodeTables, Gpu, KvCache, KvCacheConfig,
    PagedAttention, PrefillTables, WritePlan,
};
use pagedattn::reference::{rel_l2, AttnParams};
use pagedattn::rng::SplitMix64;
use wgpu::{BindGroup, Buffer, BufferUsages as U, CommandEncoder, ComputePipeline, Device, Queue};

type Res<T> = Result<T, Box<dyn Error>>;

// The model. One fused QKV row is [q: HQ*HD | k: KVH*HD | v: KVH*HD] floats;
// pagedattn reads Q, K and V in place at byte offsets 0, Q_BYTES and
// Q_BYTES + K_BYTES of the row buffer, and a bound offset must be a multiple
// of the device's min_storage_buffer_offset_alignment (at most 256). Here
// 512 and 768: with other head counts, pad the weight's columns so that K
// and V start on 256-byte boundaries (or write K and V to buffers of their own).
const VOCAB: usize = 64;
const D: usize = 128; // d_model
const LAYERS: usize = 4;
const HQ: usize = 4; // query heads
const KVH: usize = 2; // KV heads (grouped-query attention: 2 query heads each)
const HD: usize = 32; // head_dim
const QW: usize = HQ * HD;
const KW: usize = KVH * HD;
const QKV: usize = QW + 2 * KW; // floats per fused row
const MAX_POS: usize = 64; // learned position embeddings
/// The last layer attends to the last WINDOW positions only.
const WINDOW: u32 = 20;

// The cache and the batch.
const BS: u32 = 16; // tokens per block
const NUM_BLOCKS: u32 = 32;
const MAX_ROWS: usize = 64; // new tokens one step may carry
const SAMPLES: usize = 4; // parallel sampling of request A
const GEN: usize = 8; // tokens generated per sequence
const SEED: u64 = 0x5eed_2026;

/// f32 on the GPU against f64 on the host: the worst step measured 3.9e-7
/// (lavapipe); 1e-5 leaves room for other drivers' summation orders.
pub const TOL: f64 = 1e-5;

/// What a run did, for the caller (and the test) to check.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    pub adapter: String,
    pub steps: usize,
    /// Token rows run through the model (prompt tokens served from the
    /// prefix cache are not).
    pub rows: usize,
    /// Each sequence's name and generated tokens.
    pub generated: Vec<(String, Vec<u32>)>,
    /// Copy-on-write block copies.
    pub copies: usize,
    pub prefix_hit_tokens: u64,
    pub peak_blocks_used: usize,
    pub peak_blocks_shared: usize,
    /// Worst logits relative L2 error of a step, GPU against the f64 model.
    pub max_err: f64,
    pub tol: f64,
    /// Buffers and bind groups pagedattn created after the third step (the
    /// first decode step): a steady state creates none.
    pub objects_after_warmup: u64,
    pub seconds: f64,
}

// ---------------------------------------------------------------------------
// Weights, shared by the GPU and the f64 host model.

struct Weights {
    emb: Vec<f32>,       // [VOCAB][D]; also the output projection (tied)
    pos: Vec<f32>,       // [MAX_POS][D]
    wqkv: Vec<Vec<f32>>, // per layer [D][QKV]
    wo: Vec<Vec<f32>>,   // per layer [QW][D]
}

impl Weights {
    fn random(rng: &mut SplitMix64) -> Self {
        // Uniform(-1, 1) scaled by sqrt(3 / fan_in): outputs of unit variance.
        let mut mat = |rows: usize, cols: usize, fan_in: usize| -> Vec<f32> {
            let s = (3.0 / fan_in as f64).sqrt() as f32;
            (0..rows * cols).map(|_| rng.next_signed() * s).collect()
        };
        Self {
            emb: mat(VOCAB, D, 3),
            pos: mat(MAX_POS, D, 12),
            wqkv: (0..LAYERS).map(|_| mat(D, QKV, D)).collect(),
            wo: (0..LAYERS).map(|_| mat(QW, D, QW)).collect(),
        }
    }
}

/// Attention options per layer: full attention, the last layer windowed.
/// Index = the plan's variant. (Only one layer is windowed, so the engine
/// cannot `release_outside_window`: the other layers still read old blocks.)
fn variants() -> [AttnOptions; 2] {
    let window = AttnOptions {
        sliding_window: Some(WINDOW),
        ..Default::default()
    };
    [AttnOptions::default(), window]
}

fn variant_of(layer: usize) -> usize {
    (layer == LAYERS - 1) as usize
}

// ---------------------------------------------------------------------------
// The engine's own kernels: naive, one thread per output element.

/// out[r][c] (= or +=) sum_j a[r][j] * w(j, c), where w is [k][n] row-major,
/// or [n][k] (`flags & 1`, for logits against the embedding); `flags & 2`
/// adds into out (the residual).
const MATMUL_WGSL: &str = r#"
struct P { m: u32, k: u32, n: u32, flags: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= p.m * p.n) { return; }
    let r = i / p.n;
    let c = i % p.n;
    var s = 0.0;
    for (var j = 0u; j < p.k; j++) {
        var wv: f32;
        if ((p.flags & 1u) != 0u) { wv = w[c * p.k + j]; } else { wv = w[j * p.n + c]; }
        s += a[r * p.k + j] * wv;
    }
    if ((p.flags & 2u) != 0u) { s += out[i]; }
    out[i] = s;
}
"#;

/// x[r] = emb[token[r]] + pos[position[r]], from (token, position) pairs.
const EMBED_WGSL: &str = r#"
struct P { m: u32, d: u32, _a: u32, _b: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> ids: array<vec2<u32>>;
@group(0) @binding(2) var<storage, read> emb: array<f32>;
@group(0) @binding(3) var<storage, read> pos: array<f32>;
@group(0) @binding(4) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= p.m * p.d) { return; }
    let id = ids[i / p.d];
    let c = i % p.d;
    x[i] = emb[id.x * p.d + c] + pos[id.y * p.d + c];
}
"#;

// ---------------------------------------------------------------------------
// The device: the engine's, opened with plain wgpu.

/// Opens the engine's device on the default adapter of the backends
/// `PAGEDATTN_BACKEND` allows (all when unset).
pub fn engine_device() -> Res<(Device, Queue)> {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = match std::env::var("PAGEDATTN_BACKEND") {
        Ok(name) => pagedattn::gpu::parse_backends(&name)?,
        Err(_) => wgpu::Backends::all(),
    };
    let instance = wgpu::Instance::new(desc);
    let adapter = pollster::block_on(instance.request_adapter(&Default::default()))
        .map_err(|e| format!("no GPU adapter ({e}); on Linux, lavapipe is mesa-vulkan-drivers"))?;
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("engine"),
        required_limits: adapter.limits(),
        ..Default::default()
    }))?;
    Ok((device, queue))
}

fn buffer(dev: &Device, label: &str, bytes: usize, usage: U) -> Buffer {
    let (label, size) = (Some(label), bytes as u64);
    let mapped_at_creation = false;
    dev.create_buffer(&wgpu::BufferDescriptor {
        label,
        size,
        usage,
        mapped_at_creation,
    })
}

fn uploaded(dev: &Device, q: &Queue, label: &str, data: &[f32]) -> Buffer {
    let usage = U::STORAGE | U::COPY_DST;
    let b = buffer(dev, label, data.len() * 4, usage);
    q.write_buffer(&b, 0, bytemuck::cast_slice(data));
    b
}

fn pipeline(dev: &Device, label: &str, src: &str) -> ComputePipeline {
    let source = wgpu::ShaderSource::Wgsl(src.into());
    let module = dev.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(label),
        source,
    });
    dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(label),
        layout: None, // derived from the shader: bindings 0.. of group 0
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    })
}

fn bind(dev: &Device, pipe: &ComputePipeline, bufs: &[&Buffer]) -> BindGroup {
    let entries: Vec<_> = (0..)
        .zip(bufs)
        .map(|(i, b)| wgpu::BindGroupEntry {
            binding: i,
            resource: b.as_entire_binding(),
        })
        .collect();
    let layout = pipe.get_bind_group_layout(0);
    dev.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &layout,
        entries: &entries,
    })
}

/// One pass of `threads` threads (64 a workgroup).
fn dispatch(enc: &mut CommandEncoder, pipe: &ComputePipeline, bg: &BindGroup, threads: usize) {
    let mut pass = enc.begin_compute_pass(&Default::default());
    pass.set_pipeline(pipe);
    pass.set_bind_group(0, bg, &[]);
    pass.dispatch_workgroups(threads.div_ceil(64) as u32, 1, 1);
}

/// A range of a buffer from `offset` to its end.
fn at(buf: &Buffer, offset: usize) -> wgpu::BufferBinding<'_> {
    wgpu::BufferBinding {
        buffer: buf,
        offset: offset as u64,
        size: None,
    }
}

/// The model on the GPU: pagedattn's cache and kernels, plus the engine's
/// weights, activations (sized for MAX_ROWS rows, allocated once) and
/// kernels, whose bind groups are all made up front.
struct Model {
    gpu: Gpu,
    cache: KvCache,
    attn: PagedAttention,
    // Plans: made once, refilled every step, reused buffers inside.
    wplan: WritePlan,
    aplan: AttentionPlan,
    variants: [AttnOptions; 2],
    matmul: ComputePipeline,
    embed: ComputePipeline,
    /// Bind groups: embed, logits, then per layer (QKV, output projection).
    groups: Vec<BindGroup>,
    /// Uniforms (rows, k, n, flags) of embed, QKV, output projection, logits.
    params: Vec<Buffer>,
    ids: Buffer,      // [MAX_ROWS] (token, position)
    qkv: Buffer,      // [MAX_ROWS][QKV], reused by every layer
    attn_out: Buffer, // [MAX_ROWS][QW]: a dispatch may not read and write one buffer
    logits: Buffer,   // [MAX_ROWS][VOCAB]
    staging: Buffer,  // MAP_READ copy of the logits
}

impl Model {
    fn new(device: &Device, queue: &Queue, w: &Weights) -> Res<Self> {
        // pagedattn borrows the device: it enables nothing and installs no
        // error handler (the engine's stay in place).
        let gpu = Gpu::from_device(device, queue);
        let cfg =
            KvCacheConfig::new(NUM_BLOCKS, BS, KVH as u32, HD as u32).with_layers(LAYERS as u32);
        let cache = KvCache::new(&gpu, cfg)?;
        // Times every decode kernel variant once for this adapter and shape
        // and builds the fastest (the engine's tuner could name a tune file
        // that keeps the pick across runs: `Tuner::with_file`).
        let (attn, _tuned) = pagedattn::gpu::Tuner::new().attention(&gpu, &cache, HQ as u32)?;
        // Compile every pipeline a step needs now, not mid-step.
        attn.warm_up(&gpu, &[ActDtype::F32])?;
        let (mut wplan, mut aplan) = (cache.plan(), attn.plan());
        // Q, K and V are read straight from the fused rows, QKV floats apart.
        wplan.set_kv_stride(Some(QKV as u32));
        aplan.set_q_stride(Some(QKV as u32));

        // Activations for up to MAX_ROWS rows (4 bytes an element).
        let (dev, q, st, r) = (device, queue, U::STORAGE | U::COPY_DST, MAX_ROWS * 4);
        let ids = buffer(dev, "ids", r * 2, st);
        let x = buffer(dev, "x", r * D, st); // the residual stream
        let qkv = buffer(dev, "qkv", r * QKV, st);
        let attn_out = buffer(dev, "attn out", r * QW, st);
        let logits = buffer(dev, "logits", r * VOCAB, st | U::COPY_SRC);
        let staging = buffer(dev, "readback", r * VOCAB, U::MAP_READ | U::COPY_DST);
        let uniform = || buffer(dev, "params", 16, U::UNIFORM | U::COPY_DST);
        let params: Vec<_> = (0..4).map(|_| uniform()).collect();
        let p = &params;
        let emb = uploaded(dev, q, "emb", &w.emb);
        let pos = uploaded(dev, q, "pos", &w.pos);

        let scope = dev.push_error_scope(wgpu::ErrorFilter::Validation);
        let matmul = pipeline(dev, "matmul", MATMUL_WGSL);
        let embed = pipeline(dev, "embed", EMBED_WGSL);
        let mut groups = vec![
            bind(dev, &embed, &[&p[0], &ids, &emb, &pos, &x]),
            bind(dev, &matmul, &[&p[3], &x, &emb, &logits]),
        ];
        for l in 0..LAYERS {
            let wqkv = uploaded(dev, q, "wqkv", &w.wqkv[l]);
            let wo = uploaded(dev, q, "wo", &w.wo[l]);
            groups.push(bind(dev, &matmul, &[&p[1], &x, &wqkv, &qkv]));
            groups.push(bind(dev, &matmul, &[&p[2], &attn_out, &wo, &x]));
        }
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(format!("engine kernels: {e}").into());
        }
        let variants = variants();
        Ok(Self {
            gpu,
            cache,
            attn,
            wplan,
            aplan,
            variants,
            matmul,
            embed,
            groups,
            params,
            ids,
            qkv,
            attn_out,
            logits,
            staging,
        })
    }

    /// One step: `rows` are the (token, position) pairs of the view's new
    /// tokens, sequence after sequence. Returns their logits, [rows][VOCAB].
    fn step(&mut self, view: &BatchView, rows: &[[u32; 2]], prefill: bool) -> Res<Vec<f32>> {
        let m = rows.len();
        if m > MAX_ROWS {
            return Err(format!("{m} rows in one step, the buffers hold {MAX_ROWS}").into());
        }
        let gpu = &self.gpu;
        // 1. Plan (host work, once for all layers): the new tokens' slots and
        //    the copy-on-write list; the attention tables of the batch.
        self.cache
            .plan_write(gpu, &mut self.wplan, &view.slot_mapping, &view.copies)?;
        if prefill {
            // Some sequence brings several tokens (a prompt): causal prefill,
            // decodes of the other sequences included.
            let t = PrefillTables::from_view(view);
            self.attn
                .plan_prefill(gpu, &mut self.aplan, &t, &self.variants)?;
        } else {
            let t = DecodeTables::from_view(view);
            self.attn
                .plan_decode(gpu, &mut self.aplan, &t, &self.variants)?;
        }
        let q = &gpu.queue;
        q.write_buffer(&self.ids, 0, bytemuck::cast_slice(rows));
        let (m32, d, qw) = (m as u32, D as u32, QW as u32);
        let shapes = [
            [m32, d, 0, 0],            // embed: rows, d_model
            [m32, d, QKV as u32, 0],   // x [m][D] * Wqkv [D][QKV]
            [m32, qw, d, 2],           // x += attn [m][QW] * Wo [QW][D]
            [m32, d, VOCAB as u32, 1], // x * emb^T
        ];
        for (b, shape) in self.params.iter().zip(&shapes) {
            q.write_buffer(b, 0, bytemuck::cast_slice(shape));
        }

        // 2. Record everything into one encoder. pagedattn checks its
        //    bindings before recording; the scope catches the engine's own
        //    mistakes as an Err instead of wgpu's default panic.
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        dispatch(&mut enc, &self.embed, &self.groups[0], m * D);
        // Copy-on-write copies (every layer) before any write of this step.
        self.cache.run_copy_blocks(gpu, &mut enc, &mut self.wplan)?;
        for l in 0..LAYERS {
            dispatch(&mut enc, &self.matmul, &self.groups[2 + 2 * l], m * QKV);
            // K and V of the new tokens into their slots of the paged pool.
            let (k, v) = (at(&self.qkv, QW * 4), at(&self.qkv, (QW + KW) * 4));
            self.cache
                .run_write_kv(gpu, &mut enc, &mut self.wplan, l as u32, &k, &v)?;
            // Attention of the new tokens over each sequence's whole context.
            self.attn.run(
                gpu,
                &mut enc,
                &mut self.aplan,
                &self.cache,
                l as u32,
                variant_of(l),
                &at(&self.qkv, 0),
                &self.attn_out.as_entire_buffer_binding(),
            )?;
            dispatch(&mut enc, &self.matmul, &self.groups[3 + 2 * l], m * D);
        }
        dispatch(&mut enc, &self.matmul, &self.groups[1], m * VOCAB);
        let bytes = (m * VOCAB * 4) as u64;
        enc.copy_buffer_to_buffer(&self.logits, 0, &self.staging, 0, bytes);
        q.submit([enc.finish()]);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(format!("step: {e}").into());
        }

        // 3. One readback.
        let (tx, rx) = std::sync::mpsc::channel();
        self.staging
            .map_async(wgpu::MapMode::Read, 0..bytes, move |r| drop(tx.send(r)));
        gpu.device.poll(wgpu::PollType::wait_indefinitely())?;
        rx.recv()??;
        let out = bytemuck::cast_slice(&self.staging.get_mapped_range(0..bytes)?).to_vec();
        self.staging.unmap();
        Ok(out)
    }
}

// ---------------------------------------------------------------------------
// The f64 host model: the same network, with dense attention over each
// sequence's own K/V history (what the paged pool holds, without pages).

#[derive(Clone)]
struct HostSeq {
    k: Vec<Vec<f64>>, // per layer [len][KW]
    v: Vec<Vec<f64>>,
    len: usize,
}

impl HostSeq {
    fn new() -> Self {
        let k = vec![Vec::new(); LAYERS];
        Self {
            v: k.clone(),
            k,
            len: 0,
        }
    }

    /// Runs the token at the next position; returns its logits.
    fn forward(&mut self, w: &Weights, token: u32) -> Vec<f64> {
        let pos = self.len;
        let matvec = |x: &[f64], m: &[f32], n: usize| -> Vec<f64> {
            let mut y = vec![0.0; n];
            for (j, &xj) in x.iter().enumerate() {
                for (c, yc) in y.iter_mut().enumerate() {
                    *yc += xj * m[j * n + c] as f64;
                }
            }
            y
        };
        let mut x: Vec<f64> = (0..D)
            .map(|c| w.emb[token as usize * D + c] as f64 + w.pos[pos * D + c] as f64)
            .collect();
        for l in 0..LAYERS {
            let qkv = matvec(&x, &w.wqkv[l], QKV);
            self.k[l].extend_from_slice(&qkv[QW..QW + KW]);
            self.v[l].extend_from_slice(&qkv[QW + KW..]);
            // The library's own masking and scale rules (window included).
            let mut p = AttnParams::new(HQ, HD);
            p.sliding_window = variants()[variant_of(l)].sliding_window;
            let mut o = vec![0.0; QW];
            for h in 0..HQ {
                let kvh = h / (HQ / KVH);
                let qh = &qkv[h * HD..(h + 1) * HD];
                let scores: Vec<Option<f64>> = (0..=pos)
                    .map(|t| {
                        let k = &self.k[l][t * KW + kvh * HD..][..HD];
                        let dot = qh.iter().zip(k).map(|(a, b)| a * b).sum();
                        p.logit(h, dot, pos, t)
                    })
                    .collect();
                let max = scores
                    .iter()
                    .flatten()
                    .fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                let mut sum = 0.0;
                for (t, s) in scores.iter().enumerate() {
                    let Some(s) = s else { continue };
                    let e = (s - max).exp();
                    sum += e;
                    let vt = &self.v[l][t * KW + kvh * HD..][..HD];
                    for i in 0..HD {
                        o[h * HD + i] += e * vt[i];
                    }
                }
                o[h * HD..(h + 1) * HD].iter_mut().for_each(|a| *a /= sum);
            }
            for (xc, y) in x.iter_mut().zip(matvec(&o, &w.wo[l], D)) {
                *xc += y;
            }
        }
        self.len += 1;
        (0..VOCAB)
            .map(|t| (0..D).map(|c| x[c] * w.emb[t * D + c] as f64).sum())
            .collect()
    }
}

// ---------------------------------------------------------------------------
// Serving.

/// A live sequence: the manager's id, which rank it samples, its host
/// model, what it generated.
struct Live {
    name: String,
    rank: usize,
    host: HostSeq,
    out: Vec<u32>,
}

impl Live {
    fn new(name: &str, rank: usize, host: HostSeq) -> Self {
        let (name, out) = (name.to_string(), Vec::new());
        Self {
            name,
            rank,
            host,
            out,
        }
    }
}

/// The `rank`-th best token of a row of logits (0: greedy).
fn pick(row: &[f32], rank: usize) -> u32 {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    order[rank] as u32
}

/// Each live sequence's group, by request.
type Groups = Vec<(RequestId, Vec<Live>)>;

/// The f64 model's logits for the rows the GPU ran: each sequence's host
/// model runs its tokens up to the row's end. (B's host model runs its
/// whole prompt: the GPU ran only what the prefix cache did not hold, so
/// this also checks the shared blocks.)
fn host_logits(step: &Step, live: &mut Groups, sched: &Scheduler, w: &Weights) -> Res<Vec<f64>> {
    let mut want = Vec::with_capacity(step.tokens().len() * VOCAB);
    for row in step.rows() {
        let group = &mut live
            .iter_mut()
            .find(|g| g.0 == row.request)
            .ok_or("a row of an untracked request")?
            .1;
        let l = &mut group[row.index];
        let tokens = sched.blocks().tokens(row.seq)?;
        while l.host.len < row.positions.end {
            let p = l.host.len;
            let lg = l.host.forward(w, tokens[p]);
            if p >= row.positions.start {
                want.extend(lg);
            }
        }
    }
    Ok(want)
}

/// Each sequence's next token from its last row. A's first sampling starts
/// its SAMPLES sequences off the prompt (the scheduler forks them next
/// step: they share every block of A, and their first writes copy the
/// shared, partly filled last block). Finished sequences go to `s`, each
/// token to `line`.
fn sample(
    step: &Step,
    live: &mut Groups,
    logits: &[f32],
    a: RequestId,
    s: &mut Summary,
    line: &mut Vec<String>,
) -> Res<Vec<GroupOutput>> {
    let mut last_row = std::collections::HashMap::new();
    let mut at = 0usize;
    for row in step.rows() {
        at += row.positions.len();
        last_row.insert((row.request, row.index), at - 1);
    }
    let mut outputs = Vec::new();
    for &request in step.sample() {
        let group = &mut live
            .iter_mut()
            .find(|g| g.0 == request)
            .ok_or("a sampled request untracked")?
            .1;
        let starting = request == a && group.len() == 1 && group[0].out.is_empty();
        let parents: Vec<(usize, usize)> = if starting {
            (0..SAMPLES).map(|k| (0, k)).collect()
        } else {
            (0..group.len()).map(|i| (i, group[i].rank)).collect()
        };
        let mut children = Vec::new();
        let mut next = Vec::new();
        for (parent, rank) in parents {
            let r = *last_row
                .get(&(request, parent))
                .ok_or("a sampled sequence without a row")?;
            let tok = pick(&logits[r * VOCAB..(r + 1) * VOCAB], rank);
            let p = &group[parent];
            let name = if starting && rank > 0 {
                format!("A{rank}")
            } else {
                p.name.clone()
            };
            let mut l = Live::new(&name, rank, p.host.clone());
            l.out = p.out.clone();
            l.out.push(tok);
            line.push(format!("{}:{tok}", l.name));
            let finished = l.out.len() == GEN;
            children.push(Child {
                parent,
                token: tok,
                finished,
            });
            if finished {
                s.generated.push((l.name.clone(), l.out.clone()));
            } else {
                next.push(l);
            }
        }
        *group = next;
        outputs.push(GroupOutput { request, children });
    }
    Ok(outputs)
}

/// Serves A (n = 4) and B on a device of the default adapter.
pub fn run(quiet: bool) -> Res<Summary> {
    let (device, queue) = engine_device()?;
    run_on(&device, &queue, quiet)
}

/// Serves A (n = 4) and B on the engine's device.
pub fn run_on(device: &Device, queue: &Queue, quiet: bool) -> Res<Summary> {
    let t0 = Instant::now();
    let say = |s: String| {
        if !quiet {
            println!("{s}");
        }
    };
    // Random weights: the generated "text" is noise (greedy sequences soon
    // repeat a token); what matters is that the GPU computes it exactly.
    let mut rng = SplitMix64::new(SEED);
    let w = Weights::random(&mut rng);
    let mut model = Model::new(device, queue, &w)?;
    let adapter = model.gpu.describe();
    say(format!(
        "engine on {adapter}: {LAYERS} layers, d_model {D}, {HQ}/{KVH} heads of {HD}, vocab {VOCAB}, \
         last layer windowed ({WINDOW}); pool of {NUM_BLOCKS} blocks of {BS}"
    ));

    let cfg = BlockManagerConfig::new(NUM_BLOCKS, BS).with_prefix_caching(true);
    let mut sched = Scheduler::new(cfg, SchedulerConfig::new(64, SAMPLES + 1))?;
    let prompt_a: Vec<u32> = (0..37).map(|_| rng.below(VOCAB as u64) as u32).collect();
    let mut prompt_b = prompt_a[..32].to_vec(); // A's first two full blocks
    prompt_b.extend((0..9).map(|_| rng.below(VOCAB as u64) as u32));
    let a = sched.add_request(&prompt_a, SAMPLES, b"")?;
    // Each request's sequences, in its group's order (the scheduler's
    // `Row::index`); A's prompt starts as one.
    let mut live: Groups = vec![(a, vec![Live::new("A", 0, HostSeq::new())])];

    let mut s = Summary {
        adapter,
        tol: TOL,
        ..Default::default()
    };
    let mut warm = None;
    while sched.has_work() {
        let ts = Instant::now();
        // The step: rows (prompt chunks and decodes), token ids, tables,
        // slots of the new tokens, pending copies.
        let step = sched.schedule()?;
        let view = step.view();
        let positions = step.rows().iter().flat_map(|r| r.positions.clone());
        let rows: Vec<[u32; 2]> = step
            .tokens()
            .iter()
            .zip(positions)
            .map(|(&t, p)| [t, p as u32])
            .collect();
        let prefill = view.new_indptr.windows(2).any(|w| w[1] - w[0] != 1);
        let logits = model.step(view, &rows, prefill)?;

        // Check: the f64 model runs each sequence's tokens up to its length,
        // and the logits of the rows the GPU ran are compared.
        let want = host_logits(&step, &mut live, &sched, &w)?;
        let err = rel_l2(&logits, &want); // NaN anywhere: infinity
        s.max_err = s.max_err.max(err);
        if err >= TOL {
            return Err(format!("step {}: logits rel L2 {err:.3e} over {TOL:.0e}", s.steps).into());
        }

        // Sample: each sequence's next token from its last row.
        let mut line = Vec::new();
        let outputs = sample(&step, &mut live, &logits, a, &mut s, &mut line)?;
        // Finished sequences' blocks go back (cached ones stay reusable).
        for f in sched.commit(&step, &outputs)? {
            live.retain(|g| g.0 != f.request);
        }
        if s.steps == 0 {
            // B comes after A's prompt was committed: its first two blocks are A's.
            let b = sched.add_request(&prompt_b, 1, b"")?;
            live.push((b, vec![Live::new("B", 0, HostSeq::new())]));
        }

        let st = sched.blocks().stats();
        s.peak_blocks_used = s.peak_blocks_used.max(st.used);
        s.peak_blocks_shared = s.peak_blocks_shared.max(st.shared);
        s.copies += view.copies.len();
        s.rows += rows.len();
        let kind = ["decode", "mixed", "prefill"][prefill as usize + (s.steps == 0) as usize];
        let (n, seqs, line) = (rows.len(), view.num_seqs(), line.join(" "));
        let (used, shared, copies) = (st.used, st.shared, view.copies.len());
        let ms = ts.elapsed().as_secs_f64() * 1e3;
        say(format!(
            "step {} {kind:7} {n:2} rows {seqs} seqs | {line:28} | pool after: {used:2} blocks, \
             {shared} shared | copies {copies} | err {err:.1e} | {ms:.1} ms",
            s.steps
        ));
        s.steps += 1;
        let c = model.gpu.counters();
        if s.steps == 3 {
            warm = Some(c);
        } else if let Some(w) = warm {
            s.objects_after_warmup = c.buffers + c.bind_groups - w.buffers - w.bind_groups;
        }
    }
    s.prefix_hit_tokens = sched.blocks().prefix_hit_tokens();
    s.seconds = t0.elapsed().as_secs_f64();
    let Summary {
        steps,
        rows,
        copies,
        prefix_hit_tokens: hits,
        max_err,
        ..
    } = &s;
    let (used, shared, objs) = (
        s.peak_blocks_used,
        s.peak_blocks_shared,
        s.objects_after_warmup,
    );
    say(format!(
        "{steps} steps, {rows} rows, {copies} copies, {hits} prefix-hit tokens, peak {used} blocks \
         ({shared} shared); max logits rel L2 {max_err:.2e} (tolerance {TOL:.0e}); \
         {objs} library objects created after warm-up; {:.2} s",
        s.seconds
    ));
    for (name, toks) in &s.generated {
        say(format!("  {name:2} {toks:?}"));
    }
    Ok(s)
}

fn main() -> Res<()> {
    run(false).map(|_| ())
}
