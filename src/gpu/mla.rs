//! Multi-head latent attention (MLA: DeepSeek-V2/V3/R1, Kimi K2) over a
//! paged latent pool.
//!
//! An MLA layer caches one row per token instead of per-head K and V: the
//! compressed KV `c` (`kv_lora_rank` values, 512 in DeepSeek) and the
//! decoupled RoPE key `k_r` (`rope_dim`, 64), shared by every query head.
//! Decode and prefill run in the absorbed form: the engine folds `W_UK`
//! into each head's no-RoPE query, so head h's query is
//! `[W_UK_h^T q_nope_h; q_rope_h]` (`kv_lora_rank + rope_dim` values), its
//! score against token t is that vector dotted with the token's row, and
//! the output is the probability-weighted latent `sum_t p_t c_t`
//! (`kv_lora_rank` values), to which the engine applies `W_UV_h`.
//!
//! The pool ([`MlaCache`]) is paged like [`KvCache`](super::KvCache): the
//! same [`BlockManager`](crate::blocks::BlockManager) tables, slots and
//! copy-on-write lists, so parallel samples and beams share latent blocks.
//! Both are used the way [`KvCache`](super::KvCache) and
//! [`PagedAttention`](super::PagedAttention) are: the pool plans a step's
//! writes and copies into a reused [`WritePlan`](super::WritePlan) and
//! records them into the engine's encoder; [`MlaAttention`] plans the
//! step's attention from the same [`DecodeTables`](super::DecodeTables) or
//! [`PrefillTables`](super::PrefillTables) into a reused [`MlaPlan`] and
//! records each layer over the engine's buffer ranges, f32, f16 or bf16
//! (the plan module's `mla.rs`). The host-slice conveniences
//! ([`MlaAttention::decode`], [`MlaCache::write`]) are one-step plans in
//! the `host` module.
//!
//! The kernels are `shaders/mla/*.wgsl`. One workgroup serves up to
//! [`MLA_HEADS_PER_WORKGROUP`] heads of one query row: each tile of latent
//! rows is read from the pool once and used by all of them, and fits
//! WebGPU's default 16 KiB of workgroup memory at any row up to
//! [`MLA_MAX_ROW`] values (11 408 bytes at DeepSeek's 576 and 8 heads).

use super::attention::Split;
pub use super::compose::MlaShape;
use super::compose::{
    body, imports, io_codec, kv_codec, shared_source, Family, PipelineKey, Shader,
};
use super::context::Gpu;
use super::dtype::{ActDtype, KvDtype};
use super::error::{GpuError, MlaError, PoolError};
use super::pass::{cached_pipeline, next_id};

/// Threads that serve one query head (each holds every 16th vec4 of the query).
pub const MLA_LANES: u32 = 16;
/// Query heads one workgroup serves (fewer when the model has fewer).
pub const MLA_HEADS_PER_WORKGROUP: u32 = 8;
/// The most values a latent row may have (`kv_lora_rank + rope_dim`).
pub const MLA_MAX_ROW: u32 = 1024;
/// The most query heads.
pub const MLA_MAX_HEADS: u32 = 256;
/// The most query rows one call takes (decode: sequences; prefill: new tokens).
pub const MLA_MAX_QUERIES: u32 = 65535;
/// The most layers a latent pool has.
pub const MLA_MAX_LAYERS: u32 = 1024;
/// Workgroup memory the kernel's tile may use: leaves room under WebGPU's
/// 16 KiB default for the score partials.
const TILE_BYTES: u32 = 9216;
/// Loop iterations an invocation may run where the adapter ends loops
/// early (llvmpipe stops at 65535): the partition cap keeps under this.
const LOOP_BUDGET: u32 = 60000;
/// Workgroups a decode batch should fill before `Split::Auto` stops splitting.
const AUTO_WORKGROUPS: u64 = 256;
/// Shortest partition `Split::Auto` makes.
const AUTO_MIN_TOKENS: u32 = 256;

/// The shape of a latent pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaCacheConfig {
    /// Transformer layers (one pool buffer each).
    pub num_layers: u32,
    /// Physical blocks per layer.
    pub num_blocks: u32,
    /// Tokens per block (a power of two, 1..=256; 64 is common for MLA).
    pub block_size: u32,
    /// Width of the compressed KV (DeepSeek: 512); a positive multiple of 4.
    pub kv_lora_rank: u32,
    /// Width of the decoupled RoPE key (DeepSeek: 64); a multiple of 4.
    pub rope_dim: u32,
    /// Element type: f32, f16 or bf16.
    pub dtype: KvDtype,
}

impl MlaCacheConfig {
    /// DeepSeek-V2/V3's latent row (512 + 64) in bf16, 64-token blocks.
    pub fn deepseek(num_layers: u32, num_blocks: u32) -> Self {
        Self {
            num_layers,
            num_blocks,
            block_size: 64,
            kv_lora_rank: 512,
            rope_dim: 64,
            dtype: KvDtype::Bf16,
        }
    }

    /// Values in a token's row: `kv_lora_rank + rope_dim`.
    pub fn row_elems(&self) -> u32 {
        self.kv_lora_rank.saturating_add(self.rope_dim)
    }

    /// Bytes one block takes in one layer.
    pub fn block_bytes(&self) -> u64 {
        self.block_size as u64 * self.row_elems() as u64 * self.dtype.bytes()
    }

    /// Bytes a token takes over all layers (what decides how many fit).
    pub fn token_bytes(&self) -> u64 {
        self.num_layers as u64 * self.row_elems() as u64 * self.dtype.bytes()
    }

    /// Refuses a shape the kernels cannot take, with its numbers.
    pub fn validate(&self) -> Result<(), GpuError> {
        if !(1..=256).contains(&self.block_size) || !self.block_size.is_power_of_two() {
            return Err(PoolError::BlockSize(self.block_size).into());
        }
        let (rank, rope) = (self.kv_lora_rank, self.rope_dim);
        if rank == 0
            || !rank.is_multiple_of(4)
            || !rope.is_multiple_of(4)
            || rank as u64 + rope as u64 > MLA_MAX_ROW as u64
        {
            return Err(MlaError::Dims {
                rank,
                rope,
                limit: MLA_MAX_ROW,
            }
            .into());
        }
        if !matches!(self.dtype, KvDtype::F32 | KvDtype::F16 | KvDtype::Bf16) {
            return Err(MlaError::Dtype(self.dtype).into());
        }
        if self.num_layers == 0 || self.num_blocks == 0 || self.num_layers > MLA_MAX_LAYERS {
            return Err(MlaError::EmptyPool {
                layers: self.num_layers,
                blocks: self.num_blocks,
                limit: MLA_MAX_LAYERS,
            }
            .into());
        }
        Ok(())
    }

    /// Slots in one layer.
    fn slots(&self) -> u64 {
        self.num_blocks as u64 * self.block_size as u64
    }
}

impl MlaShape {
    /// The shape for a pool and a head count.
    pub fn new(cfg: &MlaCacheConfig, num_heads: u32) -> Self {
        let row4 = cfg.row_elems() / 4;
        let fit = (TILE_BYTES / (row4.max(1) * 16)).clamp(1, 8);
        Self {
            row4,
            v4: cfg.kv_lora_rank / 4,
            block_size: cfg.block_size,
            dtype: cfg.dtype,
            hg: num_heads.clamp(1, MLA_HEADS_PER_WORKGROUP),
            tile_rows: 1 << fit.ilog2(),
            act: ActDtype::F32,
            out: ActDtype::F32,
        }
    }

    /// This shape reading `act` activations and writing `out` outputs.
    pub fn with_io(self, act: ActDtype, out: ActDtype) -> Self {
        Self { act, out, ..self }
    }

    /// Threads per decode workgroup.
    pub fn workgroup_size(&self) -> u32 {
        self.hg * MLA_LANES
    }

    /// Workgroup memory the decode kernel declares: the tile, the score
    /// partials and the tile's row offsets.
    pub fn workgroup_bytes(&self) -> u32 {
        self.tile_rows * self.row4 * 16
            + self.tile_rows * self.workgroup_size() * 4
            + self.tile_rows * 4
            + self.hg * self.tile_rows * 4
    }

    /// The query's vec4s per lane (QN) and the accumulator's (AN).
    fn per_lane(&self) -> (u32, u32) {
        (self.row4.div_ceil(MLA_LANES), self.v4.div_ceil(MLA_LANES))
    }

    /// Loop iterations one invocation runs per tile, counting every loop
    /// of `decode.wgsl`'s tile body.
    fn iterations_per_tile(&self) -> u32 {
        let (qn, an) = self.per_lane();
        let t = self.tile_rows;
        1 + (t * self.row4).div_ceil(self.workgroup_size()) + t * qn + MLA_LANES + t + an + t * an
    }

    /// The most tokens one partition may walk where loops end early.
    fn loop_cap(&self) -> u32 {
        let (qn, an) = self.per_lane();
        let tiles = (LOOP_BUDGET - qn - an) / self.iterations_per_tile();
        (tiles * self.tile_rows).max(self.tile_rows)
    }

    /// The shape's constants (the `mla_constants` import: the only WGSL
    /// the Rust side writes for the MLA kernels).
    pub fn constants(&self) -> String {
        let (qn, an) = self.per_lane();
        let vars = [
            ("r4", self.row4 as i64),
            ("v4", self.v4 as i64),
            ("block_size", self.block_size as i64),
            ("hg", self.hg as i64),
            ("lanes", MLA_LANES as i64),
            ("wg", self.workgroup_size() as i64),
            ("tile_rows", self.tile_rows as i64),
            ("qn", qn as i64),
            ("an", an as i64),
        ];
        super::template::expand(MLA_CONSTANTS_TEMPLATE, &vars)
            .expect("the MLA constants template expands")
    }
}

/// The template of the MLA kernels' `mla_constants` import.
pub const MLA_CONSTANTS_TEMPLATE: &str = include_str!("../../shaders/templates/mla_constants.wgsl");

/// What the MLA kernels share (`shaders/mla/common.wgsl`).
const MLA_COMMON: &str = include_str!("../../shaders/mla/common.wgsl");

/// The full source of an MLA kernel at `shape`, as compiled: each import
/// its file names, in its order, then the file's own text; `None` for an
/// unknown name or import.
pub fn mla_source(kernel: Shader, shape: &MlaShape) -> Option<String> {
    if kernel.entry().family != Family::Mla {
        return None;
    }
    let file = kernel.entry().text;
    let mut out = String::new();
    for name in imports(file) {
        match name {
            "mla_constants" => out += &shape.constants(),
            "saturate" => out += body(shared_source("saturate")?),
            "kv" => out += body(kv_codec(shape.dtype)),
            "act" => out += body(io_codec(false, shape.act)),
            "out" => out += body(io_codec(true, shape.out)),
            "mla_common" => {
                out += body(MLA_COMMON);
                out.push('\n');
            }
            _ => return None,
        }
    }
    out += body(file);
    Some(out)
}

pub(in crate::gpu) fn mla_pipeline(
    gpu: &Gpu,
    kernel: Shader,
    shape: &MlaShape,
) -> Result<wgpu::ComputePipeline, GpuError> {
    cached_pipeline(gpu, kernel.name(), PipelineKey::Mla(*shape), || {
        mla_source(kernel, shape)
    })
}

/// The uniform block of `shaders/mla/common.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(in crate::gpu) struct MlaParams {
    pub(in crate::gpu) num_queries: u32,
    pub(in crate::gpu) num_heads: u32,
    pub(in crate::gpu) num_blocks: u32,
    pub(in crate::gpu) table_stride: u32,
    pub(in crate::gpu) parts: u32,
    pub(in crate::gpu) part_tokens: u32,
    pub(in crate::gpu) scale: f32,
    pub(in crate::gpu) count: u32,
    pub(in crate::gpu) stride: u32,
    pub(in crate::gpu) _pad: [u32; 3],
}

/// The most rows or copies one pool call takes.
pub(in crate::gpu) const MAX_ROWS_PER_CALL: usize = 1 << 20;

/// A paged latent pool: per layer, one row of `kv_lora_rank + rope_dim`
/// values per token, laid out `[block][row in block][row values]`.
pub struct MlaCache {
    pub(in crate::gpu) cfg: MlaCacheConfig,
    pub(in crate::gpu) shape: MlaShape,
    pub(in crate::gpu) layers: Vec<wgpu::Buffer>,
    pub(in crate::gpu) copy: wgpu::ComputePipeline,
    pub(in crate::gpu) id: u64,
    /// Write steps planned (`plan_write`): attention plans of an earlier
    /// step are stale.
    pub(in crate::gpu) write_epoch: std::sync::atomic::AtomicU64,
}

impl MlaCache {
    /// Allocates the pool (zeroed) and compiles its f32 write and copy
    /// kernels. Errors name the limit a shape breaks.
    pub fn new(gpu: &Gpu, cfg: MlaCacheConfig) -> Result<Self, GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        cfg.validate()?;
        gpu.require_limits(7)?;
        let bytes = cfg.block_bytes().saturating_mul(cfg.num_blocks as u64);
        let limit = gpu.max_binding_bytes();
        // Kernel indices are u32 vec4 offsets.
        let index_limit = (u32::MAX as u64) * 16;
        if bytes > limit.min(index_limit) {
            return Err(GpuError::CacheTooLarge {
                num_blocks: cfg.num_blocks,
                bytes,
                limit,
                max_blocks: (limit.min(index_limit) / cfg.block_bytes().max(1)).min(u32::MAX as u64)
                    as u32,
            });
        }
        let shape = MlaShape::new(&cfg, 1);
        mla_pipeline(gpu, Shader::MlaWrite, &shape)?;
        let copy = mla_pipeline(gpu, Shader::MlaCopy, &shape)?;
        let layers = gpu.scoped_try(|| {
            (0..cfg.num_layers)
                .map(|l| gpu.storage(&format!("mla pool layer {l}"), bytes))
                .collect::<Result<Vec<_>, _>>()
        })?;
        Ok(Self {
            cfg,
            shape,
            layers,
            copy,
            id: next_id(),
            write_epoch: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The pool's shape.
    pub fn config(&self) -> &MlaCacheConfig {
        &self.cfg
    }

    /// Write steps planned so far (what a stale attention plan is told by).
    pub fn write_epoch(&self) -> u64 {
        self.write_epoch.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One layer's buffer (for an engine's own kernels or a transfer).
    pub fn layer_buffer(&self, layer: u32) -> Result<&wgpu::Buffer, GpuError> {
        self.layers.get(layer as usize).ok_or_else(|| {
            MlaError::Layer {
                layer,
                layers: self.cfg.num_layers,
            }
            .into()
        })
    }

    /// Slots in one layer.
    pub(in crate::gpu) fn slots(&self) -> u64 {
        self.cfg.slots()
    }

    /// The rows at `slots` of `layer` as stored, widened to f32 (reads the
    /// layer back: for tests and debugging, not a step's path). Native only.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_rows(&self, gpu: &Gpu, layer: u32, slots: &[u32]) -> Result<Vec<f32>, GpuError> {
        let pool = self.layer_buffer(layer)?;
        if let Some(&slot) = slots.iter().find(|&&s| s as u64 >= self.cfg.slots()) {
            return Err(MlaError::Slot {
                slot,
                slots: self.cfg.slots(),
            }
            .into());
        }
        let words: Vec<u32> = gpu.read(pool, pool.size())?;
        let row = self.cfg.row_elems() as usize;
        let mut out = Vec::with_capacity(slots.len() * row);
        for &s in slots {
            for e in 0..row {
                let i = s as usize * row + e;
                out.push(match self.cfg.dtype {
                    KvDtype::F32 => f32::from_bits(words[i]),
                    KvDtype::F16 => {
                        half::f16::from_bits((words[i / 2] >> (16 * (i % 2))) as u16).to_f32()
                    }
                    _ => half::bf16::from_bits((words[i / 2] >> (16 * (i % 2))) as u16).to_f32(),
                });
            }
        }
        Ok(out)
    }
}

/// MLA attention in the absorbed form for a number of query heads over
/// one latent pool.
pub struct MlaAttention {
    pub(in crate::gpu) heads: u32,
    pub(in crate::gpu) scale: f32,
    pub(in crate::gpu) cfg: MlaCacheConfig,
    pub(in crate::gpu) shape: MlaShape,
    pub(in crate::gpu) cap: Option<u32>,
    pub(in crate::gpu) adapter: String,
    pub(in crate::gpu) id: u64,
}

impl MlaAttention {
    /// The kernels for `num_heads` query heads over `cache` (its plans
    /// index that pool; a pool of the same configuration takes them too),
    /// with the softmax `scale` (DeepSeek: `1 / sqrt(qk_nope_head_dim +
    /// rope_dim)`, times its YaRN factor; a plan's options may override
    /// it). Compiles the f32 decode pipelines;
    /// [`warm_up`](Self::warm_up) compiles the rest.
    pub fn new(gpu: &Gpu, cache: &MlaCache, num_heads: u32, scale: f32) -> Result<Self, GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        let cfg = &cache.cfg;
        if !(1..=MLA_MAX_HEADS).contains(&num_heads) {
            return Err(MlaError::Heads {
                heads: num_heads,
                limit: MLA_MAX_HEADS,
            }
            .into());
        }
        if !(scale.is_finite() && scale > 0.0) {
            return Err(MlaError::Scale(scale).into());
        }
        gpu.require_limits(7)?;
        let shape = MlaShape::new(cfg, num_heads);
        let need = shape.workgroup_bytes() as u64;
        if need > gpu.limits.max_compute_workgroup_storage_size as u64 {
            return Err(GpuError::DeviceLimit {
                limit: "max_compute_workgroup_storage_size",
                needed: need,
                available: gpu.limits.max_compute_workgroup_storage_size as u64,
            });
        }
        mla_pipeline(gpu, Shader::MlaDecode, &shape)?;
        Ok(Self {
            heads: num_heads,
            scale,
            cfg: *cfg,
            shape,
            cap: gpu.caps_loops().then(|| shape.loop_cap()),
            adapter: gpu.info.name.clone(),
            id: next_id(),
        })
    }

    /// The kernels' shape (its prelude is what `mla_source` composes).
    pub fn shape(&self) -> &MlaShape {
        &self.shape
    }

    /// Values of `q` per query row: heads x (kv_lora_rank + rope_dim).
    pub fn q_row_elems(&self) -> u64 {
        self.heads as u64 * self.cfg.row_elems() as u64
    }

    /// Values of the output per query row: heads x kv_lora_rank.
    pub fn out_row_elems(&self) -> u64 {
        self.heads as u64 * self.cfg.kv_lora_rank as u64
    }

    /// Tokens per partition for a batch of `rows` query rows whose longest
    /// sees `max_visible` tokens.
    pub(in crate::gpu) fn partition_tokens(
        &self,
        rows: u64,
        max_visible: u32,
        split: Split,
    ) -> Result<u32, GpuError> {
        let t = self.shape.tile_rows;
        let whole = max_visible.next_multiple_of(t);
        let tokens = match split {
            Split::Never => whole,
            Split::Tokens(n) => {
                if n == 0 || !n.is_multiple_of(t) {
                    return Err(MlaError::Split { tokens: n, tile: t }.into());
                }
                n.min(whole)
            }
            Split::Auto => {
                // Split only while the batch alone leaves the device idle,
                // never below AUTO_MIN_TOKENS, and within the loop cap.
                let wgs = rows * self.heads.div_ceil(self.shape.hg) as u64;
                let want = AUTO_WORKGROUPS.div_ceil(wgs.max(1)).min(u32::MAX as u64) as u32;
                let most = max_visible.div_ceil(AUTO_MIN_TOKENS).max(1);
                let parts = want.clamp(1, most);
                let mut n = max_visible.div_ceil(parts).next_multiple_of(t);
                if let Some(cap) = self.cap {
                    n = n.min(cap / t * t);
                }
                n.max(t)
            }
        };
        if let Some(cap) = self.cap.filter(|&c| tokens > c) {
            return Err(MlaError::PassTooLong {
                tokens,
                cap,
                adapter: self.adapter.clone(),
            }
            .into());
        }
        let parts = max_visible.div_ceil(tokens);
        if parts > 65535 {
            return Err(MlaError::Split { tokens, tile: t }.into());
        }
        Ok(tokens)
    }

    pub(in crate::gpu) fn check_cache(&self, cache: &MlaCache) -> Result<(), GpuError> {
        let (a, b) = (&self.cfg, &cache.cfg);
        if (
            a.block_size,
            a.kv_lora_rank,
            a.rope_dim,
            a.dtype,
            a.num_blocks,
        ) != (
            b.block_size,
            b.kv_lora_rank,
            b.rope_dim,
            b.dtype,
            b.num_blocks,
        ) {
            return Err(MlaError::Mismatch(
                "this MlaAttention was made for latent pools of another shape",
            )
            .into());
        }
        Ok(())
    }
}
