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

use pagedattn::blocks::{BatchView, GroupKind, LayerGroups};
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

mod build;
use build::*;
pub use build::{rope_table, shader_source, KERNELS};

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
    /// How the matmul shares activation rows among its invocations (and
    /// how the split-K matmul reduces: workgroup memory or subgroups).
    pub matmul: MatmulStaging,
    /// The matmul of steps of at most [`SPLITK_MAX_ROWS`] rows (decode).
    pub decode_matmul: DecodeMatmul,
    /// One pool per layer group, so that a sliding-window group keeps
    /// only its window's blocks (`true`), or one pool for every layer
    /// (`false`: full retention, what a hybrid model is measured against).
    /// A model whose layers all attend alike has one group either way.
    pub layer_groups: bool,
    /// Blocks of each window group's pool (`None`: `num_blocks`).
    pub window_blocks: Option<u32>,
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

/// The matmul a step of few rows (decode, at most [`SPLITK_MAX_ROWS`])
/// runs; longer steps (prefill, big batches) run the tiled matmul, which
/// dequantizes each weight block once for up to 16 rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DecodeMatmul {
    /// [`Tiled`](Self::Tiled) on a CPU adapter (measured there:
    /// benches/NOTES.md), [`SplitK`](Self::SplitK) on every GPU.
    #[default]
    Auto,
    /// The tiled matmul: an invocation per output column walks its weight
    /// row alone. A CPU's caches like it; a GPU's loads land far apart.
    Tiled,
    /// A workgroup per output column, its lanes splitting the row into
    /// contiguous loads, dequantized in registers and summed across the
    /// workgroup (matmul_splitk.wgsl). Every adapter.
    SplitK,
}

impl DecodeMatmul {
    /// What this choice runs on `gpu`: `Tiled` or `SplitK`.
    pub fn resolve(self, gpu: &Gpu) -> Self {
        match self {
            Self::Auto if gpu.info.device_type == wgpu::DeviceType::Cpu => Self::Tiled,
            Self::Auto => Self::SplitK,
            other => other,
        }
    }
}

/// The most rows a step may have for [`DecodeMatmul::SplitK`] to run it.
pub const SPLITK_MAX_ROWS: usize = 8;

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
            decode_matmul: DecodeMatmul::Auto,
            layer_groups: true,
            window_blocks: None,
        }
    }
}

/// One step's input: the scheduler's view (tables, slots, copies), the
/// token and position of every row, and the rows whose logits are wanted.
/// A model with several layer groups ([`Model::kv_layout`]) takes one view
/// per group, each in that group's pool: `view` is group 0's, `more` the
/// others' in order.
#[derive(Clone, Copy, Debug)]
pub struct StepInput<'a> {
    pub view: &'a BatchView,
    pub more: &'a [&'a BatchView],
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    pub logit_rows: &'a [u32],
}

const MATMUL_TILES: [u32; 4] = [1, 4, 8, 16];
/// The split-K matmul's row tiles (at most [`SPLITK_MAX_ROWS`]).
const SPLITK_TILES: [u32; 3] = [1, 4, 8];
const WG: usize = 64;

/// The workgroups of a matmul of `n` output columns over `rows` rows at row
/// tile `rt`: an invocation computes two columns, a workgroup 128.
fn grid(n: u32, rt: u32, rows: u32) -> (u32, u32) {
    (n.div_ceil(2 * WG as u32), rows.div_ceil(rt))
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

/// One layer group's pool and attention (the layers of group `g` of
/// [`Model::kv_layout`], in the group's order).
pub struct KvGroup {
    pub cache: KvCache,
    pub attn: PagedAttention,
    wplan: WritePlan,
    aplan: AttentionPlan,
    /// The group's attention variants (its windows).
    variants: Vec<AttnOptions>,
}

/// The GPU model. Everything is allocated in [`Model::new`]; a step
/// creates no buffer and no bind group.
pub struct Model {
    pub gpu: Gpu,
    /// Each layer group's pool and attention.
    pub kv: Vec<KvGroup>,
    kv_layout: LayerGroups,
    /// Per layer: its group, its layer in the group's pool, its variant.
    layer_kv: Vec<(usize, u32, usize)>,
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
    /// The split-K matmul's pipelines (empty where the tiled matmul runs
    /// every step).
    splitks: HashMap<(WeightFormat, u32), ComputePipeline>,
    /// The split-K matmul with the RMSNorm fused in front (QKV, gate/up).
    splitks_norm: HashMap<(WeightFormat, u32), ComputePipeline>,
    /// The dispatches the last step recorded.
    last_dispatches: usize,
    layers: Vec<LayerGpu>,
    groups: Vec<LayerBinds>,
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

impl Mat {
    fn upload(gpu: &Gpu, label: &str, m: &HostMatrix) -> Self {
        Mat {
            buf: upload(gpu, label, &m.gpu_words()),
            fmt: m.fmt,
        }
    }
}

impl Model {
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
        let (layout, kv, layer_kv) = attention(&self.gpu, &self.shape, &self.arch, &cfg)?;
        (self.kv_layout, self.kv, self.layer_kv) = (layout, kv, layer_kv);
        self.cfg = cfg;
        Ok(())
    }

    /// Rebuilds the pools with one per layer group (`true`) or one for
    /// every layer, keeping the weights and kernels. The pools start
    /// empty: serve no sequence across this call.
    pub fn set_layer_groups(
        &mut self,
        on: bool,
        window_blocks: Option<u32>,
    ) -> Result<(), ModelError> {
        let cfg = EngineConfig {
            layer_groups: on,
            window_blocks,
            ..self.cfg
        };
        let (layout, kv, layer_kv) = attention(&self.gpu, &self.shape, &self.arch, &cfg)?;
        (self.kv_layout, self.kv, self.layer_kv) = (layout, kv, layer_kv);
        self.cfg = cfg;
        Ok(())
    }

    /// Group 0's pool (a model whose layers attend alike has only it).
    pub fn cache(&self) -> &KvCache {
        &self.kv[0].cache
    }

    /// The layer groups the pools follow: one per window with
    /// `EngineConfig::layer_groups`, else one.
    pub fn kv_layout(&self) -> &LayerGroups {
        &self.kv_layout
    }

    /// Layer groups (pools).
    pub fn num_groups(&self) -> usize {
        self.kv.len()
    }

    /// The pipeline layout kernels of four bindings use (for tools).
    pub fn pipeline_layout(&self) -> &PipelineLayout {
        &self.playout4
    }

    /// Floats per fused QKV row, and K's and V's offsets in it.
    pub fn qkv_layout(&self) -> (usize, usize, usize) {
        (self.qkv_row, self.k_off, self.v_off)
    }

    /// The pipeline and grid of a matmul of `n` output columns (`gated`:
    /// `n` gate and up row pairs) over `m` rows: split-K for a step of few
    /// rows where the engine runs it, else tiled.
    fn matmul(
        &self,
        fmt: WeightFormat,
        m: usize,
        n: u32,
        gated: bool,
    ) -> (&ComputePipeline, [u32; 3]) {
        let rows = m as u32;
        if m <= SPLITK_MAX_ROWS && !self.splitks.is_empty() {
            let rt = SPLITK_TILES
                .iter()
                .copied()
                .find(|&t| t as usize >= m)
                .unwrap_or(8);
            // One workgroup per column, folded past the grid's x limit.
            const MAX_X: u32 = 65535;
            let grid = [n.min(MAX_X), n.div_ceil(MAX_X), rows.div_ceil(rt)];
            return (&self.splitks[&(fmt, rt)], grid);
        }
        let rt = MATMUL_TILES
            .iter()
            .copied()
            .find(|&t| t as usize >= m)
            .unwrap_or(16);
        // Tiled: 64 gated columns a workgroup (a gate and an up row each),
        // else 128.
        let (gx, gy) = if gated {
            (n.div_ceil(WG as u32), rows.div_ceil(rt))
        } else {
            grid(n, rt, rows)
        };
        (&self.matmuls[&(fmt, rt)], [gx, gy, 1])
    }

    /// The split-K matmul with the norm fused in, for a step of `m` rows
    /// over `fmt` weights (`None`: norm, then the plain matmul).
    fn matmul_normed(
        &self,
        fmt: WeightFormat,
        m: usize,
        n: u32,
    ) -> Option<(&ComputePipeline, [u32; 3])> {
        let (_, grid) = self.matmul(fmt, m, n, false);
        if m > SPLITK_MAX_ROWS || self.splitks.is_empty() {
            return None;
        }
        let rt = SPLITK_TILES.iter().copied().find(|&t| t as usize >= m)?;
        self.splitks_norm.get(&(fmt, rt)).map(|p| (p, grid))
    }

    /// Dispatches the last step recorded: the model's own passes and the
    /// library's (the K/V write, block copies, attention). Exact where one
    /// thread records GPU work at a time.
    pub fn last_dispatches(&self) -> usize {
        self.last_dispatches
    }

    /// Which matmul a step of `rows` rows runs (for reports).
    pub fn matmul_for(&self, rows: usize) -> DecodeMatmul {
        if rows <= SPLITK_MAX_ROWS && !self.splitks.is_empty() {
            DecodeMatmul::SplitK
        } else {
            DecodeMatmul::Tiled
        }
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
        if s.more.len() + 1 != self.kv.len() {
            return bad(format!(
                "views for {} layer groups; the model keeps {}",
                s.more.len() + 1,
                self.kv.len()
            ));
        }
        for (g, v) in s.more.iter().enumerate() {
            if v.slot_mapping.len() != m
                || v.seq_lens != s.view.seq_lens
                || v.new_indptr != s.view.new_indptr
            {
                return bad(format!(
                    "layer group {}'s view is of another step: its rows, lengths or slots differ from group 0's",
                    g + 1
                ));
            }
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
        let prefill = s.view.new_indptr.windows(2).any(|w| w[1] - w[0] != 1);
        for (g, kg) in self.kv.iter_mut().enumerate() {
            let view = if g == 0 { s.view } else { s.more[g - 1] };
            kg.cache
                .plan_write(gpu, &mut kg.wplan, &view.slot_mapping, &view.copies)?;
            if prefill {
                let t = PrefillTables::from_view(view);
                kg.attn.plan_prefill(gpu, &mut kg.aplan, &t, &kg.variants)?;
            } else {
                let t = DecodeTables::from_view(view);
                kg.attn.plan_decode(gpu, &mut kg.aplan, &t, &kg.variants)?;
            }
        }
        self.write_params(s);
        let library_before = pagedattn::gpu::dispatches_recorded();
        let mut own = 0usize;

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
                own += 1;
            }
        }
        for kg in &mut self.kv {
            kg.cache.run_copy_blocks(gpu, &mut enc, &mut kg.wplan)?;
        }
        own += self.record_layers(&mut enc, m)?;
        let gpu = &self.gpu;
        // A step of prompt chunks only (none reaching its end) needs no logits.
        if l > 0 {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&self.pipe_norm);
            pass.set_bind_group(0, &self.g_final, &[]);
            pass.dispatch_workgroups(l32, 1, 1);
            own += 1;
            for (_, n, _, g) in &self.g_head {
                let (p, [x, y, z]) = self.matmul(self.head_fmt, l, *n, false);
                pass.set_pipeline(p);
                pass.set_bind_group(0, g, &[]);
                pass.dispatch_workgroups(x, y, z);
                own += 1;
            }
        }
        self.last_dispatches =
            own + (pagedattn::gpu::dispatches_recorded() - library_before) as usize;
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
        // The fused norm's epsilon in word 6 (the tiled matmul ignores it).
        q.write_buffer(&u.qkv, 0, words(&[m32, d, row, 0, d, row, eps, 0]));
        q.write_buffer(&u.o, 0, words(&[m32, qw, d, proj, qw, d, 0, 0]));
        q.write_buffer(&u.gate_up, 0, words(&[m32, d, ffn, gate, d, ffn, eps, 0]));
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
    ) -> Result<usize, ModelError> {
        let sh = self.shape;
        let gpu = &self.gpu;
        let m32 = m as u32;
        let (d, ffn, row) = (sh.d_model as u32, sh.ffn as u32, self.qkv_row as u32);
        let rope_heads = (sh.heads + sh.kv_heads) as u32;
        let half = (sh.head_dim / 2) as u32;
        let mut own = 0;
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
                if let Some((p, [x, y, z])) = self.matmul_normed(lw.qkv.fmt, m, row) {
                    pass.set_pipeline(p);
                    pass.set_bind_group(0, &g.qkv_normed, &[]);
                    pass.dispatch_workgroups(x, y, z);
                    own += 1;
                } else {
                    pass.set_pipeline(&self.pipe_norm);
                    pass.set_bind_group(0, &g.norm1, &[]);
                    pass.dispatch_workgroups(m32, 1, 1);
                    let (p, [x, y, z]) = self.matmul(lw.qkv.fmt, m, row, false);
                    pass.set_pipeline(p);
                    pass.set_bind_group(0, &g.qkv, &[]);
                    pass.dispatch_workgroups(x, y, z);
                    own += 2;
                }
                if let Some(qk) = &g.qk_norm {
                    pass.set_pipeline(&self.pipe_headnorm);
                    pass.set_bind_group(0, qk, &[]);
                    pass.dispatch_workgroups(m32 * rope_heads, 1, 1);
                    own += 1;
                }
                pass.set_pipeline(&self.pipe_rope);
                pass.set_bind_group(0, &self.g_ropes[self.layer_rope[i]], &[]);
                pass.dispatch_workgroups((m32 * rope_heads * half).div_ceil(WG as u32), 1, 1);
                own += 1;
            }
            let (kgi, layer, variant) = self.layer_kv[i];
            let kg = &mut self.kv[kgi];
            kg.cache
                .run_write_kv(gpu, enc, &mut kg.wplan, layer, &k_bind, &v_bind)?;
            if !self.skip_attention {
                let qb = self.qkv.as_entire_buffer_binding();
                let ob = self.attn_out.as_entire_buffer_binding();
                kg.attn
                    .run(gpu, enc, &mut kg.aplan, &kg.cache, layer, variant, &qb, &ob)?;
            }
            let mut pass = enc.begin_compute_pass(&Default::default());
            let (p, [x, y, z]) = self.matmul(lw.o.fmt, m, d, false);
            pass.set_pipeline(p);
            pass.set_bind_group(0, &g.o, &[]);
            pass.dispatch_workgroups(x, y, z);
            own += 1;
            if let Some(post) = &g.post_attn {
                pass.set_pipeline(&self.pipe_norm);
                pass.set_bind_group(0, post, &[]);
                pass.dispatch_workgroups(m32, 1, 1);
                own += 1;
            }
            if let Some((p, [x, y, z])) = self.matmul_normed(lw.gate_up.fmt, m, ffn) {
                pass.set_pipeline(p);
                pass.set_bind_group(0, &g.gate_up_normed, &[]);
                pass.dispatch_workgroups(x, y, z);
                own += 1;
            } else {
                pass.set_pipeline(&self.pipe_norm);
                pass.set_bind_group(0, &g.norm2, &[]);
                pass.dispatch_workgroups(m32, 1, 1);
                let (p, [x, y, z]) = self.matmul(lw.gate_up.fmt, m, ffn, true);
                pass.set_pipeline(p);
                pass.set_bind_group(0, &g.gate_up, &[]);
                pass.dispatch_workgroups(x, y, z);
                own += 2;
            }
            let (p, [x, y, z]) = self.matmul(lw.down.fmt, m, d, false);
            pass.set_pipeline(p);
            pass.set_bind_group(0, &g.down, &[]);
            pass.dispatch_workgroups(x, y, z);
            own += 1;
            if let Some(post) = &g.post_ffn {
                pass.set_pipeline(&self.pipe_norm);
                pass.set_bind_group(0, post, &[]);
                pass.dispatch_workgroups(m32, 1, 1);
                own += 1;
            }
        }
        Ok(own)
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
