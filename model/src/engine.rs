//! The model on the GPU: the engine's own kernels (`model/shaders/`) around
//! pagedattn's paged KV cache and attention.
//!
//! One step, one encoder, one submit, one readback:
//! `embed -> 30 x [RMSNorm -> fused QKV matmul -> RoPE -> write_kv ->
//! paged attention -> output matmul + residual -> RMSNorm -> gate/up matmul
//! with SiLU gate -> down matmul + residual] -> final RMSNorm of the rows
//! whose logits are needed -> tied LM head`. Weights stay in GPU memory in
//! their GGUF format (Q4_1, Q8_0 or F32) and are dequantized inside the
//! matmul, with f32 accumulation. Q, K and V are read by pagedattn straight
//! from the fused projection rows through its row strides.

use std::collections::HashMap;

use pagedattn::blocks::BatchView;
use pagedattn::gpu::{
    ActDtype, AttentionPlan, AttnOptions, DecodeTables, Gpu, Kernel, KvCache, KvCacheConfig,
    KvDtype, PagedAttention, PrefillTables, WritePlan,
};
use wgpu::{
    BindGroup, BindGroupLayout, Buffer, BufferUsages as U, ComputePipeline, PipelineLayout,
};

use crate::config::{Activation, ArchSpec, RopeStyle};
use crate::ModelError;

pub use crate::weights::{HostMatrix, WeightFormat};

/// One decoder layer's weights.
#[derive(Clone, Debug)]
pub struct HostLayer {
    pub attn_norm: Vec<f32>,
    pub q: HostMatrix,
    pub k: HostMatrix,
    pub v: HostMatrix,
    pub o: HostMatrix,
    pub ffn_norm: Vec<f32>,
    pub gate: HostMatrix,
    pub up: HostMatrix,
    pub down: HostMatrix,
    /// RMSNorm weights of each Q and K head (`ArchSpec::qk_norm`).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// RMSNorm weights of the attention and FFN outputs
    /// (`ArchSpec::post_norms`).
    pub post_attn_norm: Option<Vec<f32>>,
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// The model's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shape {
    pub layers: usize,
    pub d_model: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub context: usize,
}

/// Everything the GPU model needs from the file.
#[derive(Clone, Debug)]
pub struct HostWeights {
    pub shape: Shape,
    pub embed: HostMatrix,
    /// `None`: tied to the embedding.
    pub output: Option<HostMatrix>,
    pub output_norm: Vec<f32>,
    pub layers: Vec<HostLayer>,
    /// What the architecture's step does (per-layer RoPE base and window,
    /// norms, activation, embedding scale).
    pub arch: ArchSpec,
}

/// How the engine sizes its cache and batches.
#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// Blocks in the pool (every layer).
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Pool dtype.
    pub kv_dtype: KvDtype,
    /// Token rows one step may carry (the scheduler's `max_batch_tokens`).
    pub max_rows: usize,
    /// Rows whose logits one step may ask for (at least `max_seqs`).
    pub max_logit_rows: usize,
    /// The decode kernel; `None`: pagedattn's default for the adapter.
    pub kernel: Option<Kernel>,
    /// How the matmul shares activation rows among its invocations.
    pub matmul: MatmulStaging,
}

/// How the matmul's invocations share the activation rows of a tile (each
/// invocation computes output columns, and every column needs every row).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MatmulStaging {
    /// [`Subgroup`](Self::Subgroup) on a CPU adapter whose device has
    /// subgroups of at least 8 lanes (measured there: benches/NOTES.md),
    /// [`Workgroup`](Self::Workgroup) everywhere else.
    #[default]
    Auto,
    /// The workgroup copies the rows into workgroup memory, and every
    /// invocation reads them from there. Every adapter.
    Workgroup,
    /// Each lane loads an eighth of the rows, and subgroup shuffles hand
    /// them to the others: no workgroup memory, no barriers. Needs
    /// `Features::SUBGROUP` with subgroups of at least 8 lanes.
    Subgroup,
}

impl MatmulStaging {
    /// Whether `gpu`'s device runs the subgroup staging.
    pub fn subgroups_fit(gpu: &Gpu) -> bool {
        gpu.features.contains(wgpu::Features::SUBGROUP) && gpu.info.subgroup_min_size >= 8
    }

    /// What this choice runs on `gpu`: `Workgroup` or `Subgroup`; an error
    /// for `Subgroup` where the device has no subgroups of 8 lanes.
    pub fn resolve(self, gpu: &Gpu) -> Result<Self, ModelError> {
        let fit = Self::subgroups_fit(gpu);
        match self {
            Self::Auto if fit && gpu.info.device_type == wgpu::DeviceType::Cpu => Ok(Self::Subgroup),
            Self::Auto | Self::Workgroup => Ok(Self::Workgroup),
            Self::Subgroup if fit => Ok(Self::Subgroup),
            Self::Subgroup => Err(ModelError::Shape(format!(
                "the subgroup matmul needs Features::SUBGROUP with subgroups of at least 8 lanes; {} has {}",
                gpu.info.name,
                if gpu.features.contains(wgpu::Features::SUBGROUP) {
                    format!("subgroups of {} to {} lanes", gpu.info.subgroup_min_size, gpu.info.subgroup_max_size)
                } else {
                    "no subgroups on this device".to_string()
                }
            ))),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            num_blocks: 256,
            block_size: 16,
            kv_dtype: KvDtype::F32,
            max_rows: 256,
            max_logit_rows: 32,
            kernel: None,
            matmul: MatmulStaging::Auto,
        }
    }
}

/// One step's input: the scheduler's view (tables, slots, copies), the
/// token and position of every row, and the rows whose logits are wanted.
#[derive(Clone, Copy, Debug)]
pub struct StepInput<'a> {
    pub view: &'a BatchView,
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    pub logit_rows: &'a [u32],
}

const MATMUL_TILES: [u32; 4] = [1, 4, 8, 16];
const WG: usize = 64;

/// The workgroups of a matmul of `n` output columns over `rows` rows at row
/// tile `rt`: an invocation computes two columns, a workgroup 128.
fn grid(n: u32, rt: u32, rows: u32) -> (u32, u32) {
    (n.div_ceil(2 * WG as u32), rows.div_ceil(rt))
}

struct Mat {
    buf: Buffer,
    fmt: WeightFormat,
}

struct LayerGpu {
    attn_norm: Buffer,
    qkv: Mat,
    o: Mat,
    ffn_norm: Buffer,
    gate_up: Mat,
    down: Mat,
    /// The Q then K head-norm weights.
    qk_norm: Option<Buffer>,
    post_attn: Option<Buffer>,
    post_ffn: Option<Buffer>,
}

/// Bind groups of one layer: norm 1, QKV, the head norms, output, its
/// post-norm, norm 2, gate/up, down, its post-norm.
struct LayerGroups {
    norm1: BindGroup,
    qkv: BindGroup,
    qk_norm: Option<BindGroup>,
    o: BindGroup,
    post_attn: Option<BindGroup>,
    norm2: BindGroup,
    gate_up: BindGroup,
    down: BindGroup,
    post_ffn: Option<BindGroup>,
}

/// The uniforms written each step.
struct Uniforms {
    norm: Buffer,
    norm_add: Buffer,
    headnorm: Buffer,
    final_norm: Buffer,
    rope: Buffer,
    qkv: Buffer,
    o: Buffer,
    gate_up: Buffer,
    down: Buffer,
}

/// The GPU model. Everything is allocated in [`Model::new`]; a step
/// creates no buffer and no bind group.
pub struct Model {
    pub gpu: Gpu,
    pub cache: KvCache,
    pub attn: PagedAttention,
    wplan: WritePlan,
    aplan: AttentionPlan,
    /// The attention variants (full, and each window) and each layer's.
    variants: Vec<AttnOptions>,
    layer_variant: Vec<usize>,
    arch: ArchSpec,
    pub shape: Shape,
    pub cfg: EngineConfig,
    /// Floats per fused QKV row and the K and V offsets in it (256-byte
    /// aligned, as bound buffer offsets must be).
    qkv_row: usize,
    k_off: usize,
    v_off: usize,
    layout4: BindGroupLayout,
    layout5: BindGroupLayout,
    playout4: PipelineLayout,
    pipe_embed: ComputePipeline,
    pipe_norm: ComputePipeline,
    pipe_rope: ComputePipeline,
    pipe_headnorm: ComputePipeline,
    matmuls: HashMap<(WeightFormat, u32), ComputePipeline>,
    layers: Vec<LayerGpu>,
    groups: Vec<LayerGroups>,
    /// The embedding in row chunks that each fit one storage binding:
    /// (first row, rows, matrix).
    embed_chunks: Vec<(u32, u32, Mat)>,
    head_fmt: WeightFormat,
    /// Per embedding chunk: its uniform and bind group.
    g_embed: Vec<(Buffer, BindGroup)>,
    /// One RoPE table bind group per base, and each layer's.
    g_ropes: Vec<BindGroup>,
    layer_rope: Vec<usize>,
    g_final: BindGroup,
    /// Per LM head chunk: (first row, rows, its uniform, its bind group).
    g_head: Vec<(u32, u32, Buffer, BindGroup)>,
    u: Uniforms,
    ids: Buffer,
    pos: Buffer,
    logit_idx: Buffer,
    qkv: Buffer,
    attn_out: Buffer,
    logits: Buffer,
    staging: Buffer,
    /// Skip the attention kernels (profiling only: the output is then wrong).
    pub skip_attention: bool,
    // Kept alive for their bind groups.
    _keep: Vec<Buffer>,
}

fn storage(dev: &wgpu::Device, label: &str, bytes: usize, extra: U) -> Buffer {
    dev.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: bytes.max(16) as u64,
        usage: U::STORAGE | U::COPY_DST | extra,
        mapped_at_creation: false,
    })
}

fn upload<T: bytemuck::Pod>(gpu: &Gpu, label: &str, data: &[T]) -> Buffer {
    let bytes: &[u8] = bytemuck::cast_slice(data);
    let b = storage(&gpu.device, label, bytes.len(), U::empty());
    gpu.queue.write_buffer(&b, 0, bytes);
    b
}

fn uniform(dev: &wgpu::Device, label: &str) -> Buffer {
    dev.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: 32,
        usage: U::UNIFORM | U::COPY_DST,
        mapped_at_creation: false,
    })
}

fn layout(dev: &wgpu::Device, n_read: u32) -> BindGroupLayout {
    let entry = |binding, ty| wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty,
        count: None,
    };
    let st = |read_only| wgpu::BindingType::Buffer {
        ty: wgpu::BufferBindingType::Storage { read_only },
        has_dynamic_offset: false,
        min_binding_size: None,
    };
    let mut entries = vec![entry(
        0,
        wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Uniform,
            has_dynamic_offset: false,
            min_binding_size: None,
        },
    )];
    for i in 0..n_read {
        entries.push(entry(1 + i, st(true)));
    }
    entries.push(entry(1 + n_read, st(false)));
    dev.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some("model layout"),
        entries: &entries,
    })
}

fn bind(dev: &wgpu::Device, layout: &BindGroupLayout, bufs: &[&Buffer]) -> BindGroup {
    let entries: Vec<_> = (0u32..)
        .zip(bufs)
        .map(|(i, b)| wgpu::BindGroupEntry {
            binding: i,
            resource: b.as_entire_binding(),
        })
        .collect();
    dev.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout,
        entries: &entries,
    })
}

/// The WGSL source of a kernel as compiled: the prelude of constants, the
/// shared quant helpers, the kernel file, and for the matmul the staging
/// file `staging` picks (`Auto` reads as `Workgroup` here: resolve it
/// against a device first).
pub fn shader_source(
    kernel: &str,
    fmt: WeightFormat,
    rt: u32,
    staging: MatmulStaging,
) -> Result<String, ModelError> {
    const BLOCK: &str = include_str!("../shaders/block.wgsl");
    let (body, tail) = match kernel {
        "matmul" => (
            include_str!("../shaders/matmul.wgsl"),
            match staging {
                MatmulStaging::Subgroup => {
                    concat!(
                        include_str!("../shaders/matmul_subgroup.wgsl"),
                        "\n",
                        include_str!("../shaders/block.wgsl")
                    )
                }
                _ => concat!(
                    include_str!("../shaders/matmul_tile.wgsl"),
                    "\n",
                    include_str!("../shaders/block.wgsl")
                ),
            },
        ),
        "embed" => (include_str!("../shaders/embed.wgsl"), BLOCK),
        "rmsnorm" => (include_str!("../shaders/rmsnorm.wgsl"), ""),
        "rope" => (include_str!("../shaders/rope.wgsl"), ""),
        "headnorm" => (include_str!("../shaders/headnorm.wgsl"), ""),
        other => return Err(ModelError::Shape(format!("no kernel named {other}"))),
    };
    Ok(format!(
        "// prelude (generated)\nconst FMT: u32 = {}u;\nconst BLOCK_WORDS: u32 = {}u;\nconst R: u32 = {rt}u;\n\n{}\n{body}\n{tail}",
        fmt.shader_id(),
        fmt.gpu_block_words(),
        include_str!("../shaders/quant.wgsl"),
    ))
}

/// The kernels' names, for a tool that prints every shader.
pub const KERNELS: [&str; 5] = ["matmul", "embed", "rmsnorm", "rope", "headnorm"];

fn pipeline(
    gpu: &Gpu,
    layout: &PipelineLayout,
    kernel: &str,
    fmt: WeightFormat,
    rt: u32,
    staging: MatmulStaging,
) -> Result<ComputePipeline, ModelError> {
    let src = shader_source(kernel, fmt, rt, staging)?;
    let module = gpu
        .device
        .create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(kernel),
            source: wgpu::ShaderSource::Wgsl(src.into()),
        });
    Ok(gpu
        .device
        .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(kernel),
            layout: Some(layout),
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        }))
}

/// A readback or poll failure, as the library reports its own.
#[cfg(not(target_arch = "wasm32"))]
fn device_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Gpu(pagedattn::gpu::GpuError::Device(e.to_string()))
}

fn words(v: &[u32; 8]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn f(x: f32) -> u32 {
    x.to_bits()
}

/// The cos/sin table of RoPE, as llama.cpp computes it: theta_i = pos *
/// base^(-2i/d) with the power taken in f32 step by step, then cos and sin.
pub fn rope_table(max_pos: usize, head_dim: usize, base: f32) -> Vec<[f32; 2]> {
    let half = head_dim / 2;
    let scale = base.powf(-2.0 / head_dim as f32);
    let mut t = Vec::with_capacity(max_pos * half);
    for p in 0..max_pos {
        let mut theta = p as f32;
        for _ in 0..half {
            let th = theta as f64;
            t.push([th.cos() as f32, th.sin() as f32]);
            theta *= scale;
        }
    }
    t
}

/// The fused QKV row: Q, then K and V each on a 256-byte boundary.
/// Returns K's offset, V's offset and the row's length, in floats.
fn fused_qkv(s: &Shape) -> [usize; 3] {
    let (qw, kw) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let align = |x: usize| x.div_ceil(64) * 64;
    let k_off = align(qw);
    let v_off = align(k_off + kw);
    [k_off, v_off, (v_off + kw).div_ceil(4) * 4]
}

/// The matmul pipelines of every weight format the model holds, at each
/// row tile.
fn matmul_pipelines(
    gpu: &Gpu,
    layout: &PipelineLayout,
    w: &HostWeights,
    staging: MatmulStaging,
) -> Result<HashMap<(WeightFormat, u32), ComputePipeline>, ModelError> {
    let head = w.output.as_ref().unwrap_or(&w.embed);
    let mut fmts = vec![head.fmt];
    for l in &w.layers {
        fmts.extend([l.q.fmt, l.o.fmt, l.gate.fmt, l.down.fmt]);
    }
    fmts.sort_by_key(|f| f.shader_id());
    fmts.dedup();
    let mut matmuls = HashMap::new();
    for &fm in &fmts {
        for rt in MATMUL_TILES {
            matmuls.insert((fm, rt), pipeline(gpu, layout, "matmul", fm, rt, staging)?);
        }
    }
    Ok(matmuls)
}

/// Every layer's weights on the device: Q, K and V stacked into one matrix
/// at the fused row's offsets ([`fused_qkv`]), gate and up into another.
fn upload_layers(gpu: &Gpu, w: &HostWeights) -> Result<Vec<LayerGpu>, ModelError> {
    let s = w.shape;
    let [k_off, v_off, qkv_row] = fused_qkv(&s);
    let (qw, kw) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let mut layers = Vec::with_capacity(s.layers);
    for (i, l) in w.layers.iter().enumerate() {
        let qkv = HostMatrix::stack(
            &format!("blk.{i} qkv"),
            &[
                (&l.q, k_off - qw),
                (&l.k, v_off - k_off - kw),
                (&l.v, qkv_row - v_off - kw),
            ],
        )?;
        let gate_up = HostMatrix::stack(&format!("blk.{i} gate/up"), &[(&l.gate, 0), (&l.up, 0)])?;
        layers.push(LayerGpu {
            attn_norm: upload(gpu, "attn norm", &l.attn_norm),
            qkv: Mat::upload(gpu, "qkv", &qkv),
            o: Mat::upload(gpu, "attn output", &l.o),
            ffn_norm: upload(gpu, "ffn norm", &l.ffn_norm),
            gate_up: Mat::upload(gpu, "gate/up", &gate_up),
            down: Mat::upload(gpu, "down", &l.down),
            qk_norm: match (&l.q_norm, &l.k_norm) {
                (Some(q), Some(k)) => Some(upload(gpu, "qk norm", &[q.as_slice(), k].concat())),
                _ => None,
            },
            post_attn: l
                .post_attn_norm
                .as_ref()
                .map(|w| upload(gpu, "post-attention norm", w)),
            post_ffn: l
                .post_ffn_norm
                .as_ref()
                .map(|w| upload(gpu, "post-FFN norm", w)),
        });
    }
    Ok(layers)
}

/// The model's KV cache (one layer a transformer layer), its attention
/// with its pipelines compiled, and their plans, which read K, V and Q
/// from the fused QKV rows ([`fused_qkv`]).
fn attention(
    gpu: &Gpu,
    s: &Shape,
    cfg: &EngineConfig,
) -> Result<(KvCache, PagedAttention, WritePlan, AttentionPlan), ModelError> {
    let cache = KvCache::new(
        gpu,
        KvCacheConfig::new(
            cfg.num_blocks,
            cfg.block_size,
            s.kv_heads as u32,
            s.head_dim as u32,
        )
        .with_layers(s.layers as u32)
        .with_dtype(cfg.kv_dtype),
    )?;
    let attn = match cfg.kernel {
        Some(k) => PagedAttention::new(
            gpu,
            &cache,
            s.heads as u32,
            &pagedattn::gpu::AttentionConfig::new().kernel(k),
        )?,
        None => PagedAttention::new(gpu, &cache, s.heads as u32, &Default::default())?,
    };
    attn.warm_up(gpu, &[ActDtype::F32])?;
    let qkv_row = fused_qkv(s)[2] as u32;
    let (mut wplan, mut aplan) = (cache.plan(), attn.plan());
    wplan.set_kv_stride(Some(qkv_row));
    aplan.set_q_stride(Some(qkv_row));
    Ok((cache, attn, wplan, aplan))
}

impl LayerGroups {
    /// One layer's bind groups over the activations `[x, x normed, logit
    /// rows, qkv, attn out, ffn hidden]`.
    fn new(
        dev: &wgpu::Device,
        [layout4, layout5]: [&BindGroupLayout; 2],
        u: &Uniforms,
        l: &LayerGpu,
        [x, xn, logit_idx, qkv, attn_out, h]: [&Buffer; 6],
    ) -> Self {
        // With post-norms the projections write xn (free by then), and a
        // norm adds it to the residual x; else they add to x themselves.
        let post = l.post_attn.is_some();
        let proj_out = if post { xn } else { x };
        let norm_add = |w: &Option<Buffer>| {
            w.as_ref()
                .map(|w| bind(dev, layout5, &[&u.norm_add, xn, w, logit_idx, x]))
        };
        LayerGroups {
            norm1: bind(dev, layout5, &[&u.norm, x, &l.attn_norm, logit_idx, xn]),
            qkv: bind(dev, layout4, &[&u.qkv, xn, &l.qkv.buf, qkv]),
            qk_norm: l
                .qk_norm
                .as_ref()
                .map(|w| bind(dev, layout4, &[&u.headnorm, w, logit_idx, qkv])),
            o: bind(dev, layout4, &[&u.o, attn_out, &l.o.buf, proj_out]),
            post_attn: norm_add(&l.post_attn),
            norm2: bind(dev, layout5, &[&u.norm, x, &l.ffn_norm, logit_idx, xn]),
            gate_up: bind(dev, layout4, &[&u.gate_up, xn, &l.gate_up.buf, h]),
            down: bind(dev, layout4, &[&u.down, h, &l.down.buf, proj_out]),
            post_ffn: norm_add(&l.post_ffn),
        }
    }
}

impl Mat {
    fn upload(gpu: &Gpu, label: &str, m: &HostMatrix) -> Self {
        Mat {
            buf: upload(gpu, label, &m.gpu_words()),
            fmt: m.fmt,
        }
    }
}

impl Uniforms {
    fn new(dev: &wgpu::Device) -> Self {
        Uniforms {
            norm: uniform(dev, "norm params"),
            norm_add: uniform(dev, "norm-add params"),
            headnorm: uniform(dev, "head norm params"),
            final_norm: uniform(dev, "final norm params"),
            rope: uniform(dev, "rope params"),
            qkv: uniform(dev, "qkv params"),
            o: uniform(dev, "o params"),
            gate_up: uniform(dev, "gate/up params"),
            down: uniform(dev, "down params"),
        }
    }
}

impl Model {
    /// Uploads the weights, makes the cache, the attention and every
    /// pipeline and bind group. Checks the shapes first: nothing is put on
    /// the device for a model this engine cannot run.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new(
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        w: &HostWeights,
        cfg: EngineConfig,
    ) -> Result<Self, ModelError> {
        pollster::block_on(Self::new_async(device, queue, w, cfg))
    }

    /// [`new`](Self::new) without blocking the thread: the path a browser
    /// takes (its error scopes resolve on the event loop).
    pub async fn new_async(
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        w: &HostWeights,
        cfg: EngineConfig,
    ) -> Result<Self, ModelError> {
        let s = w.shape;
        Self::check(w, &cfg)?;
        let gpu = Gpu::from_device(device, queue);
        // Refused before anything is made on the engine's device.
        let staging = cfg.matmul.resolve(&gpu)?;
        let dev = &gpu.device;
        let scope = dev.push_error_scope(wgpu::ErrorFilter::Validation);
        let oom = dev.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let (cache, attn, wplan, aplan) = attention(&gpu, &s, &cfg)?;

        let qw = s.heads * s.head_dim;
        let [k_off, v_off, qkv_row] = fused_qkv(&s);

        let layout4 = layout(dev, 2);
        let layout5 = layout(dev, 3);
        let pl = |l: &BindGroupLayout| {
            dev.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some("model"),
                bind_group_layouts: &[Some(l)],
                immediate_size: 0,
            })
        };
        let (playout4, playout5) = (pl(&layout4), pl(&layout5));
        let embed_fmt = w.embed.fmt;
        let head = w.output.as_ref().unwrap_or(&w.embed);
        // Only the matmul reads a staging; the other kernels take any.
        let unused = MatmulStaging::Workgroup;
        let pipe_embed = pipeline(&gpu, &playout4, "embed", embed_fmt, 1, unused)?;
        let pipe_norm = pipeline(&gpu, &playout5, "rmsnorm", WeightFormat::F32, 1, unused)?;
        let pipe_rope = pipeline(&gpu, &playout4, "rope", WeightFormat::F32, 1, unused)?;
        let pipe_headnorm = pipeline(&gpu, &playout4, "headnorm", WeightFormat::F32, 1, unused)?;
        let matmuls = matmul_pipelines(&gpu, &playout4, w, staging)?;
        let layers = upload_layers(&gpu, w)?;
        // Matrices of more rows than one binding holds (Gemma's 262,144-row
        // embedding, 189 MB in Q8_0) go up in row chunks.
        let upload_chunks = |label: &str, m: &HostMatrix| -> Vec<(u32, u32, Mat)> {
            let row_bytes = (m.cols / 32 * m.fmt.gpu_block_words() * 4) as u64;
            let most = (gpu.max_binding_bytes() / row_bytes.max(1)).max(1) as usize;
            // Chunks of a multiple of 64 rows, so the head's output offsets
            // stay 256-byte aligned.
            let per = if most >= m.rows {
                m.rows
            } else {
                (most / 64).max(1) * 64
            };
            (0..m.rows)
                .step_by(per)
                .map(|lo| {
                    let n = per.min(m.rows - lo);
                    (
                        lo as u32,
                        n as u32,
                        Mat::upload(&gpu, label, &m.row_range(lo, n)),
                    )
                })
                .collect()
        };
        let embed_chunks = upload_chunks("embedding", &w.embed);
        let head_chunks = w.output.as_ref().map(|m| upload_chunks("output", m));
        let out_norm = upload(&gpu, "output norm", &w.output_norm);
        // One table per RoPE base (Gemma 3: local and global layers).
        let bases = w.arch.rope_bases();
        let ropes: Vec<Buffer> = bases
            .iter()
            .map(|&b| upload(&gpu, "rope table", &rope_table(s.context, s.head_dim, b)))
            .collect();
        let layer_rope: Vec<usize> = w
            .arch
            .layers
            .iter()
            .map(|l| {
                bases
                    .iter()
                    .position(|&b| b == l.rope_base)
                    .expect("listed")
            })
            .collect();
        let windows = w.arch.windows();
        let variants: Vec<AttnOptions> = windows
            .iter()
            .map(|&window| AttnOptions {
                sliding_window: window,
                scale: w.arch.attn_scale,
                ..Default::default()
            })
            .collect();
        let layer_variant: Vec<usize> = w
            .arch
            .layers
            .iter()
            .map(|l| windows.iter().position(|&x| x == l.window).expect("listed"))
            .collect();

        let (r, lr) = (cfg.max_rows, cfg.max_logit_rows);
        let ids = storage(dev, "ids", r * 4, U::empty());
        let pos = storage(dev, "positions", r * 4, U::empty());
        let logit_idx = storage(dev, "logit rows", lr * 4, U::empty());
        let x = storage(dev, "x", r * s.d_model * 4, U::empty());
        let xn = storage(dev, "x normed", r * s.d_model * 4, U::empty());
        let qkv = storage(dev, "qkv", r * qkv_row * 4, U::empty());
        let attn_out = storage(dev, "attn out", r * qw * 4, U::empty());
        let h = storage(dev, "ffn hidden", r * s.ffn * 4, U::empty());
        let xl = storage(dev, "x last", lr * s.d_model * 4, U::empty());
        let logits = storage(dev, "logits", lr * s.vocab * 4, U::COPY_SRC);
        let staging = dev.create_buffer(&wgpu::BufferDescriptor {
            label: Some("logits readback"),
            size: (lr * s.vocab * 4) as u64,
            usage: U::MAP_READ | U::COPY_DST,
            mapped_at_creation: false,
        });
        let u = Uniforms::new(dev);
        let acts = [&x, &xn, &logit_idx, &qkv, &attn_out, &h];
        let groups = layers
            .iter()
            .map(|l| LayerGroups::new(dev, [&layout4, &layout5], &u, l, acts))
            .collect();
        let g_embed = embed_chunks
            .iter()
            .map(|(_, _, m)| {
                let u = uniform(dev, "embed params");
                let g = bind(dev, &layout4, &[&u, &ids, &m.buf, &x]);
                (u, g)
            })
            .collect();
        let g_ropes = ropes
            .iter()
            .map(|t| bind(dev, &layout4, &[&u.rope, &pos, t, &qkv]))
            .collect();
        let g_final = bind(
            dev,
            &layout5,
            &[&u.final_norm, &x, &out_norm, &logit_idx, &xl],
        );
        let g_head = head_chunks
            .as_ref()
            .unwrap_or(&embed_chunks)
            .iter()
            .map(|(lo, n, m)| {
                let u = uniform(dev, "head params");
                // Columns lo.. of every logits row.
                let out = wgpu::BufferBinding {
                    buffer: &logits,
                    offset: *lo as u64 * 4,
                    size: None,
                };
                let g = dev.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("head"),
                    layout: &layout4,
                    entries: &[
                        wgpu::BindGroupEntry {
                            binding: 0,
                            resource: u.as_entire_binding(),
                        },
                        wgpu::BindGroupEntry {
                            binding: 1,
                            resource: xl.as_entire_binding(),
                        },
                        wgpu::BindGroupEntry {
                            binding: 2,
                            resource: m.buf.as_entire_binding(),
                        },
                        wgpu::BindGroupEntry {
                            binding: 3,
                            resource: wgpu::BindingResource::Buffer(out),
                        },
                    ],
                });
                (*lo, *n, u, g)
            })
            .collect();
        let keep = [x, xn, h, xl, out_norm]
            .into_iter()
            .chain(ropes)
            .chain(head_chunks.into_iter().flatten().map(|(_, _, m)| m.buf))
            .collect();
        // Both popped (innermost first) before awaiting: no scope guard
        // lives across an await.
        let (oe, ve) = (oom.pop(), scope.pop());
        if let Some(e) = oe.await.or(ve.await) {
            return Err(ModelError::Gpu(e.into()));
        }
        Ok(Self {
            gpu,
            cache,
            attn,
            wplan,
            aplan,
            variants,
            layer_variant,
            arch: w.arch.clone(),
            shape: s,
            cfg,
            qkv_row,
            k_off,
            v_off,
            layout4,
            layout5,
            playout4,
            pipe_embed,
            pipe_norm,
            pipe_rope,
            pipe_headnorm,
            matmuls,
            layers,
            groups,
            embed_chunks,
            head_fmt: head.fmt,
            g_embed,
            g_ropes,
            layer_rope,
            g_final,
            g_head,
            u,
            ids,
            pos,
            logit_idx,
            qkv,
            attn_out,
            logits,
            staging,
            skip_attention: false,
            _keep: keep,
        })
    }

    fn check(w: &HostWeights, cfg: &EngineConfig) -> Result<(), ModelError> {
        let s = w.shape;
        let bad = |m: String| Err(ModelError::Shape(m));
        if s.layers != w.layers.len() || s.layers == 0 {
            return bad(format!(
                "{} layers in the shape, {} loaded",
                s.layers,
                w.layers.len()
            ));
        }
        if !s.d_model.is_multiple_of(32)
            || !s.ffn.is_multiple_of(32)
            || !s.head_dim.is_multiple_of(4)
            || s.head_dim == 0
        {
            return bad(format!(
                "d_model {} and ffn {} must be multiples of 32, head_dim {} of 4",
                s.d_model, s.ffn, s.head_dim
            ));
        }
        if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
            return bad(format!("{} heads over {} KV heads", s.heads, s.kv_heads));
        }
        if s.context == 0 || s.context > 1 << 20 {
            return bad(format!("context {} outside 1..=2^20", s.context));
        }
        if cfg.max_rows == 0 || cfg.max_logit_rows == 0 || cfg.max_logit_rows > cfg.max_rows {
            return bad(format!(
                "max_rows {} and max_logit_rows {} must be positive, logit rows at most the rows",
                cfg.max_rows, cfg.max_logit_rows
            ));
        }
        let (d, qw, kw) = (s.d_model, s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let want = |name: String, m: &HostMatrix, rows: usize, cols: usize| {
            m.check(&name)?;
            if m.rows != rows || m.cols != cols {
                return Err(ModelError::Shape(format!(
                    "{name}: {} x {}, expected {rows} x {cols}",
                    m.rows, m.cols
                )));
            }
            Ok(())
        };
        want("token_embd".into(), &w.embed, s.vocab, d)?;
        if let Some(o) = &w.output {
            want("output".into(), o, s.vocab, d)?;
        }
        if w.output_norm.len() != d {
            return bad(format!(
                "output_norm has {} values, expected {d}",
                w.output_norm.len()
            ));
        }
        for (i, l) in w.layers.iter().enumerate() {
            want(format!("blk.{i}.attn_q"), &l.q, qw, d)?;
            want(format!("blk.{i}.attn_k"), &l.k, kw, d)?;
            want(format!("blk.{i}.attn_v"), &l.v, kw, d)?;
            want(format!("blk.{i}.attn_output"), &l.o, d, qw)?;
            want(format!("blk.{i}.ffn_gate"), &l.gate, s.ffn, d)?;
            want(format!("blk.{i}.ffn_up"), &l.up, s.ffn, d)?;
            want(format!("blk.{i}.ffn_down"), &l.down, d, s.ffn)?;
            if l.attn_norm.len() != d || l.ffn_norm.len() != d {
                return bad(format!("blk.{i}: norms must have {d} values"));
            }
            let hd = s.head_dim;
            let a = &w.arch;
            for (what, v, want, len) in [
                ("attn_q_norm", &l.q_norm, a.qk_norm, hd),
                ("attn_k_norm", &l.k_norm, a.qk_norm, hd),
                ("post_attention_norm", &l.post_attn_norm, a.post_norms, d),
                ("post_ffw_norm", &l.post_ffn_norm, a.post_norms, d),
            ] {
                match v {
                    Some(v) if want && v.len() == len => {}
                    None if !want => {}
                    _ => {
                        return bad(format!(
                            "blk.{i}.{what}: {} ({len} values where the architecture has it)",
                            if want {
                                "missing or of the wrong length"
                            } else {
                                "not used by this architecture"
                            }
                        ))
                    }
                }
            }
        }
        if w.arch.layers.len() != s.layers {
            return bad(format!(
                "{} layers described by the architecture, {} in the shape",
                w.arch.layers.len(),
                s.layers
            ));
        }
        Ok(())
    }

    /// Rebuilds the pool and the attention for another KV dtype, block
    /// count or decode kernel, keeping the weights, kernels and activations.
    /// The pool starts empty: serve no sequence across this call.
    pub fn reconfigure(
        &mut self,
        num_blocks: u32,
        kv_dtype: KvDtype,
        kernel: Option<Kernel>,
    ) -> Result<(), ModelError> {
        let cfg = EngineConfig {
            num_blocks,
            kv_dtype,
            kernel,
            ..self.cfg
        };
        let (cache, attn, wplan, aplan) = attention(&self.gpu, &self.shape, &cfg)?;
        (self.cache, self.attn, self.wplan, self.aplan) = (cache, attn, wplan, aplan);
        self.cfg = cfg;
        Ok(())
    }

    /// The pipeline layout kernels of four bindings use (for tools).
    pub fn pipeline_layout(&self) -> &PipelineLayout {
        &self.playout4
    }

    /// Floats per fused QKV row, and K's and V's offsets in it.
    pub fn qkv_layout(&self) -> (usize, usize, usize) {
        (self.qkv_row, self.k_off, self.v_off)
    }

    fn matmul(&self, fmt: WeightFormat, m: usize) -> (&ComputePipeline, u32) {
        let rt = MATMUL_TILES
            .iter()
            .copied()
            .find(|&t| t as usize >= m)
            .unwrap_or(16);
        (&self.matmuls[&(fmt, rt)], rt)
    }

    /// Checks a step against the engine's limits and the view.
    fn check_step(&self, s: &StepInput) -> Result<(), ModelError> {
        let m = s.tokens.len();
        let bad = |m: String| Err(ModelError::Step(m));
        if m == 0 {
            return bad("a step with no rows".into());
        }
        if m > self.cfg.max_rows {
            return bad(format!(
                "{m} rows, over the engine's max_rows {}",
                self.cfg.max_rows
            ));
        }
        if s.positions.len() != m || s.view.slot_mapping.len() != m {
            return bad(format!(
                "{m} tokens, {} positions, {} slots: they must match",
                s.positions.len(),
                s.view.slot_mapping.len()
            ));
        }
        if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= self.shape.vocab) {
            return bad(format!(
                "token {t} outside the vocabulary of {}",
                self.shape.vocab
            ));
        }
        if let Some(p) = s
            .positions
            .iter()
            .find(|&&p| p as usize >= self.shape.context)
        {
            return bad(format!(
                "position {p} past the context of {}",
                self.shape.context
            ));
        }
        let l = s.logit_rows.len();
        if l > self.cfg.max_logit_rows {
            return bad(format!(
                "{l} logit rows: at most max_logit_rows {}",
                self.cfg.max_logit_rows
            ));
        }
        if let Some(r) = s.logit_rows.iter().find(|&&r| r as usize >= m) {
            return bad(format!("logit row {r} outside the step's {m} rows"));
        }
        Ok(())
    }

    /// Runs one step; returns the logits of `logit_rows`, `[rows][vocab]`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward(&mut self, s: &StepInput) -> Result<Vec<f32>, ModelError> {
        pollster::block_on(self.forward_async(s))
    }

    /// [`forward`](Self::forward) without blocking the thread (the
    /// browser's path: the readback resolves on the event loop).
    pub async fn forward_async(&mut self, s: &StepInput<'_>) -> Result<Vec<f32>, ModelError> {
        self.check_step(s)?;
        let sh = self.shape;
        let (m, l) = (s.tokens.len(), s.logit_rows.len());
        let gpu = &self.gpu;
        // 1. Plans (host work, validated), then the step's uniforms and rows.
        self.cache
            .plan_write(gpu, &mut self.wplan, &s.view.slot_mapping, &s.view.copies)?;
        let prefill = s.view.new_indptr.windows(2).any(|w| w[1] - w[0] != 1);
        if prefill {
            let t = PrefillTables::from_view(s.view);
            self.attn
                .plan_prefill(gpu, &mut self.aplan, &t, &self.variants)?;
        } else {
            let t = DecodeTables::from_view(s.view);
            self.attn
                .plan_decode(gpu, &mut self.aplan, &t, &self.variants)?;
        }
        self.write_params(s);

        // 2. One encoder for the whole step.
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        let (m32, l32) = (m as u32, l as u32);
        let d = sh.d_model as u32;
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&self.pipe_embed);
            for (_, g) in &self.g_embed {
                pass.set_bind_group(0, g, &[]);
                pass.dispatch_workgroups((m32 * d / 4).div_ceil(WG as u32), 1, 1);
            }
        }
        self.cache.run_copy_blocks(gpu, &mut enc, &mut self.wplan)?;
        self.record_layers(&mut enc, m)?;
        let gpu = &self.gpu;
        // A step of prompt chunks only (none reaching its end) needs no logits.
        if l > 0 {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&self.pipe_norm);
            pass.set_bind_group(0, &self.g_final, &[]);
            pass.dispatch_workgroups(l32, 1, 1);
            let (p, rt) = self.matmul(self.head_fmt, l);
            pass.set_pipeline(p);
            for (_, n, _, g) in &self.g_head {
                pass.set_bind_group(0, g, &[]);
                let (gx, gy) = grid(*n, rt, l32);
                pass.dispatch_workgroups(gx, gy, 1);
            }
        }
        let bytes = (l * sh.vocab * 4) as u64;
        if l > 0 {
            enc.copy_buffer_to_buffer(&self.logits, 0, &self.staging, 0, bytes);
        }
        gpu.queue.submit([enc.finish()]);
        if let Some(e) = scope.pop().await {
            return Err(ModelError::Gpu(e.into()));
        }
        if l == 0 {
            // Wait for the step, so that a failure is this call's.
            #[cfg(not(target_arch = "wasm32"))]
            gpu.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(device_err)?;
            return Ok(Vec::new());
        }

        // 3. One readback, into the engine's own staging buffer.
        Ok(gpu.map_read::<f32>(&self.staging, bytes).await?)
    }

    /// The step's rows (token ids, positions, logit rows) and every
    /// pass's uniforms, written to the queue.
    fn write_params(&self, s: &StepInput) {
        let sh = self.shape;
        let (m, l) = (s.tokens.len(), s.logit_rows.len());
        let q = &self.gpu.queue;
        q.write_buffer(&self.ids, 0, bytemuck::cast_slice(s.tokens));
        q.write_buffer(&self.pos, 0, bytemuck::cast_slice(s.positions));
        q.write_buffer(&self.logit_idx, 0, bytemuck::cast_slice(s.logit_rows));
        let (m32, l32) = (m as u32, l as u32);
        let (d, qw) = (sh.d_model as u32, (sh.heads * sh.head_dim) as u32);
        let (ffn, vocab, row) = (sh.ffn as u32, sh.vocab as u32, self.qkv_row as u32);
        let eps = f(sh.rms_eps);
        let rope_heads = (sh.heads + sh.kv_heads) as u32;
        let half = (sh.head_dim / 2) as u32;
        let ctx = sh.context as u32;
        let u = &self.u;
        let a = &self.arch;
        let scale = f(a.embed_scale);
        for ((lo, n, _), (ub, _)) in self.embed_chunks.iter().zip(&self.g_embed) {
            q.write_buffer(ub, 0, words(&[m32, d, *lo, scale, *n, 0, 0, 0]));
        }
        q.write_buffer(&u.norm, 0, words(&[m32, d, eps, 0, 0, 0, 0, 0]));
        q.write_buffer(&u.norm_add, 0, words(&[m32, d, eps, 0, 1, 0, 0, 0]));
        q.write_buffer(&u.final_norm, 0, words(&[l32, d, eps, 1, 0, 0, 0, 0]));
        let style = match a.rope_style {
            RopeStyle::Adjacent => 0,
            RopeStyle::Halves => 1,
        };
        q.write_buffer(
            &u.rope,
            0,
            words(&[m32, rope_heads, half, row, ctx, style, 0, 0]),
        );
        let hd = sh.head_dim as u32;
        q.write_buffer(
            &u.headnorm,
            0,
            words(&[
                m32,
                rope_heads,
                sh.heads as u32,
                hd,
                row,
                self.k_off as u32,
                eps,
                0,
            ]),
        );
        // With post-norms the projections write (mode 0), and a norm adds.
        let proj = if a.post_norms { 0 } else { 1 };
        let gate = match a.activation {
            Activation::Silu => 2,
            Activation::GeluTanh => 3,
        };
        q.write_buffer(&u.qkv, 0, words(&[m32, d, row, 0, d, row, 0, 0]));
        q.write_buffer(&u.o, 0, words(&[m32, qw, d, proj, qw, d, 0, 0]));
        q.write_buffer(&u.gate_up, 0, words(&[m32, d, ffn, gate, d, ffn, 0, 0]));
        q.write_buffer(&u.down, 0, words(&[m32, ffn, d, proj, ffn, d, 0, 0]));
        for (_, n, ub, _) in &self.g_head {
            q.write_buffer(ub, 0, words(&[l32, d, *n, 0, d, vocab, 0, 0]));
        }
    }

    /// Every layer's passes for `m` rows: norm, QKV, rope, the K/V write,
    /// attention, the output projection, norm, gate/up and down.
    fn record_layers(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        m: usize,
    ) -> Result<(), ModelError> {
        let sh = self.shape;
        let gpu = &self.gpu;
        let m32 = m as u32;
        let (d, ffn, row) = (sh.d_model as u32, sh.ffn as u32, self.qkv_row as u32);
        let rope_heads = (sh.heads + sh.kv_heads) as u32;
        let half = (sh.head_dim / 2) as u32;
        // 64 gated columns a workgroup (a gate and an up row each).
        let grid_gated = |n: u32, rt: u32, rows: u32| (n.div_ceil(WG as u32), rows.div_ceil(rt));
        let (k_bind, v_bind) = (
            wgpu::BufferBinding {
                buffer: &self.qkv,
                offset: (self.k_off * 4) as u64,
                size: None,
            },
            wgpu::BufferBinding {
                buffer: &self.qkv,
                offset: (self.v_off * 4) as u64,
                size: None,
            },
        );
        for (i, (lw, g)) in self.layers.iter().zip(&self.groups).enumerate() {
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                pass.set_pipeline(&self.pipe_norm);
                pass.set_bind_group(0, &g.norm1, &[]);
                pass.dispatch_workgroups(m32, 1, 1);
                let (p, rt) = self.matmul(lw.qkv.fmt, m);
                pass.set_pipeline(p);
                pass.set_bind_group(0, &g.qkv, &[]);
                let (gx, gy) = grid(row, rt, m32);
                pass.dispatch_workgroups(gx, gy, 1);
                if let Some(qk) = &g.qk_norm {
                    pass.set_pipeline(&self.pipe_headnorm);
                    pass.set_bind_group(0, qk, &[]);
                    pass.dispatch_workgroups(m32 * rope_heads, 1, 1);
                }
                pass.set_pipeline(&self.pipe_rope);
                pass.set_bind_group(0, &self.g_ropes[self.layer_rope[i]], &[]);
                pass.dispatch_workgroups((m32 * rope_heads * half).div_ceil(WG as u32), 1, 1);
            }
            let layer = i as u32;
            self.cache
                .run_write_kv(gpu, enc, &mut self.wplan, layer, &k_bind, &v_bind)?;
            if !self.skip_attention {
                let qb = self.qkv.as_entire_buffer_binding();
                let ob = self.attn_out.as_entire_buffer_binding();
                let variant = self.layer_variant[i];
                self.attn.run(
                    gpu,
                    enc,
                    &mut self.aplan,
                    &self.cache,
                    layer,
                    variant,
                    &qb,
                    &ob,
                )?;
            }
            let mut pass = enc.begin_compute_pass(&Default::default());
            let (p, rt) = self.matmul(lw.o.fmt, m);
            pass.set_pipeline(p);
            pass.set_bind_group(0, &g.o, &[]);
            let (gx, gy) = grid(d, rt, m32);
            pass.dispatch_workgroups(gx, gy, 1);
            if let Some(post) = &g.post_attn {
                pass.set_pipeline(&self.pipe_norm);
                pass.set_bind_group(0, post, &[]);
                pass.dispatch_workgroups(m32, 1, 1);
            }
            pass.set_pipeline(&self.pipe_norm);
            pass.set_bind_group(0, &g.norm2, &[]);
            pass.dispatch_workgroups(m32, 1, 1);
            let (p, rt) = self.matmul(lw.gate_up.fmt, m);
            pass.set_pipeline(p);
            pass.set_bind_group(0, &g.gate_up, &[]);
            let (gx, gy) = grid_gated(ffn, rt, m32);
            pass.dispatch_workgroups(gx, gy, 1);
            let (p, rt) = self.matmul(lw.down.fmt, m);
            pass.set_pipeline(p);
            pass.set_bind_group(0, &g.down, &[]);
            let (gx, gy) = grid(d, rt, m32);
            pass.dispatch_workgroups(gx, gy, 1);
            if let Some(post) = &g.post_ffn {
                pass.set_pipeline(&self.pipe_norm);
                pass.set_bind_group(0, post, &[]);
                pass.dispatch_workgroups(m32, 1, 1);
            }
        }
        Ok(())
    }

    /// Fills every activation buffer and the logits with NaN (tests: a
    /// value a kernel failed to write shows).
    pub fn poison(&self) {
        let q = &self.gpu.queue;
        for b in [&self.qkv, &self.attn_out, &self.logits]
            .into_iter()
            .chain(self._keep.iter().take(4))
        {
            let words = vec![f32::NAN.to_bits(); (b.size() / 4) as usize];
            q.write_buffer(b, 0, bytemuck::cast_slice(&words));
        }
    }

    /// The embedding table's format (for reports).
    pub fn embed_format(&self) -> WeightFormat {
        self.embed_chunks[0].2.fmt
    }

    /// Layouts, for tools that build more pipelines on this model's buffers.
    pub fn layouts(&self) -> (&BindGroupLayout, &BindGroupLayout) {
        (&self.layout4, &self.layout5)
    }
}
