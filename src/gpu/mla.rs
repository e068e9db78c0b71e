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
//! [`MlaAttention`] plans a batch once ([`MlaPlan`]: its tables, the
//! split-K partitions) and records it into an engine's encoder with
//! [`run`](MlaAttention::run), or answers host slices with
//! [`decode`](MlaAttention::decode) and [`prefill`](MlaAttention::prefill).
//!
//! The kernels are `shaders/mla/*.wgsl`. One workgroup serves up to
//! [`MLA_HEADS_PER_WORKGROUP`] heads of one query row: each tile of latent
//! rows is read from the pool once and used by all of them, and fits
//! WebGPU's default 16 KiB of workgroup memory at any row up to
//! [`MLA_MAX_ROW`] values (11 408 bytes at DeepSeek's 576 and 8 heads).

use super::attention::{Split, MAX_SEQ_LEN};
pub use super::compose::MlaShape;
use super::compose::{shared_source, PipelineKey};
use super::context::Gpu;
use super::dtype::KvDtype;
use super::error::{BindingError, GpuError, MlaError, PoolError};
use super::pass::{bind, cached_pipeline, dispatch, grid_1d, next_id};

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
        }
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

    /// The generated constants (the only WGSL the Rust side writes), then
    /// the shared saturation and the pool's KV codec.
    pub fn prelude(&self) -> String {
        let (qn, an) = self.per_lane();
        let kv = match self.dtype {
            KvDtype::F16 => shared_source("kv_f16"),
            KvDtype::Bf16 => shared_source("kv_bf16"),
            _ => shared_source("kv_f32"),
        };
        format!(
            "// generated by src/gpu/mla.rs: the shape's constants\n\
             const R4: u32 = {}u;\nconst V4: u32 = {}u;\nconst BLOCK_SIZE: u32 = {}u;\n\
             const HG: u32 = {}u;\nconst LANES: u32 = {MLA_LANES}u;\nconst WG: u32 = {}u;\n\
             const TILE_ROWS: u32 = {}u;\nconst QN: u32 = {qn}u;\nconst AN: u32 = {an}u;\n{}{}",
            self.row4,
            self.v4,
            self.block_size,
            self.hg,
            self.workgroup_size(),
            self.tile_rows,
            shared_source("saturate").unwrap_or_default(),
            kv.unwrap_or_default(),
        )
    }
}

/// The MLA kernels: (name, source without prelude and common part).
pub const MLA_KERNELS: &[(&str, &str)] = &[
    ("mla_decode", include_str!("../../shaders/mla/decode.wgsl")),
    ("mla_merge", include_str!("../../shaders/mla/merge.wgsl")),
    ("mla_write", include_str!("../../shaders/mla/write.wgsl")),
    ("mla_copy", include_str!("../../shaders/mla/copy.wgsl")),
];

/// What the MLA kernels share (`shaders/mla/common.wgsl`).
const MLA_COMMON: &str = include_str!("../../shaders/mla/common.wgsl");

/// The full source of an MLA kernel at `shape`, as compiled; `None` for an
/// unknown name.
pub fn mla_source(kernel: &str, shape: &MlaShape) -> Option<String> {
    let body = MLA_KERNELS.iter().find(|(n, _)| *n == kernel)?.1;
    Some(format!("{}{MLA_COMMON}\n{body}", shape.prelude()))
}

fn mla_pipeline(
    gpu: &Gpu,
    kernel: &'static str,
    shape: &MlaShape,
) -> Result<wgpu::ComputePipeline, GpuError> {
    cached_pipeline(gpu, kernel, PipelineKey::Mla(*shape), || {
        mla_source(kernel, shape)
    })
}

/// The uniform block of `shaders/mla/common.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct MlaParams {
    num_queries: u32,
    num_heads: u32,
    num_blocks: u32,
    table_stride: u32,
    parts: u32,
    part_tokens: u32,
    scale: f32,
    count: u32,
}

/// The most rows or copies one pool call takes.
const MAX_ROWS_PER_CALL: usize = 1 << 20;

/// A paged latent pool: per layer, one row of `kv_lora_rank + rope_dim`
/// values per token, laid out `[block][row in block][row values]`.
pub struct MlaCache {
    cfg: MlaCacheConfig,
    shape: MlaShape,
    layers: Vec<wgpu::Buffer>,
    write: wgpu::ComputePipeline,
    copy: wgpu::ComputePipeline,
    id: u64,
}

impl MlaCache {
    /// Allocates the pool (zeroed). Errors name the limit a shape breaks.
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
        let write = mla_pipeline(gpu, "mla_write", &shape)?;
        let copy = mla_pipeline(gpu, "mla_copy", &shape)?;
        let layers = gpu.scoped_try(|| {
            (0..cfg.num_layers)
                .map(|l| gpu.storage(&format!("mla pool layer {l}"), bytes))
                .collect::<Result<Vec<_>, _>>()
        })?;
        Ok(Self {
            cfg,
            shape,
            layers,
            write,
            copy,
            id: next_id(),
        })
    }

    /// The pool's shape.
    pub fn config(&self) -> &MlaCacheConfig {
        &self.cfg
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

    /// Writes the rows of new tokens (`rows`: `slots.len()` rows of
    /// [`row_elems`](MlaCacheConfig::row_elems) f32 values, latent first)
    /// into `layer` at `slots`, stored in the pool's dtype (rounded to
    /// nearest, saturating). Refused before anything is written: a layer
    /// or slot outside the pool, a slot named twice, `rows` of the wrong
    /// length.
    pub fn write(
        &self,
        gpu: &Gpu,
        layer: u32,
        slots: &[u32],
        rows: &[f32],
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        let pool = self.layer_buffer(layer)?;
        self.check_write(slots, rows)?;
        if slots.is_empty() {
            return Ok(());
        }
        gpu.scoped_try(|| {
            let inputs = [
                gpu.storage_init("mla slots", slots)?,
                gpu.storage_init("mla rows", rows)?,
            ];
            let threads = slots.len() as u64 * self.shape.row4 as u64;
            self.submit_pool_pass(
                gpu,
                "mla_write",
                &self.write,
                slots.len(),
                &inputs,
                &[pool],
                threads,
            )
        })
    }

    /// One dispatch of `pipe` per pool buffer in `pools`, of `threads`
    /// threads, binding (params, inputs..., pool); one submit.
    #[allow(clippy::too_many_arguments)]
    fn submit_pool_pass(
        &self,
        gpu: &Gpu,
        label: &str,
        pipe: &wgpu::ComputePipeline,
        count: usize,
        inputs: &[wgpu::Buffer],
        pools: &[&wgpu::Buffer],
        threads: u64,
    ) -> Result<(), GpuError> {
        let params = gpu.uniform(
            label,
            &MlaParams {
                num_blocks: self.cfg.num_blocks,
                count: count as u32,
                ..Default::default()
            },
        )?;
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        let (x, y) = grid_1d(threads);
        for pool in pools {
            let mut bufs: Vec<&wgpu::Buffer> = vec![&params];
            bufs.extend(inputs);
            bufs.push(pool);
            let bg = bind(gpu, pipe, &bufs);
            dispatch(&mut enc, label, pipe, &bg, (x, y, 1));
        }
        gpu.queue.submit([enc.finish()]);
        Ok(())
    }

    fn check_write(&self, slots: &[u32], rows: &[f32]) -> Result<(), GpuError> {
        let want = slots.len() as u64 * self.cfg.row_elems() as u64;
        if rows.len() as u64 != want || slots.len() > MAX_ROWS_PER_CALL {
            return Err(MlaError::Len {
                what: "rows",
                got: rows.len() as u64,
                want: want.min(MAX_ROWS_PER_CALL as u64 * self.cfg.row_elems() as u64),
            }
            .into());
        }
        if let Some(&slot) = slots.iter().find(|&&s| s as u64 >= self.cfg.slots()) {
            return Err(MlaError::Slot {
                slot,
                slots: self.cfg.slots(),
            }
            .into());
        }
        let mut sorted = slots.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(MlaError::SlotTwice(w[0]).into());
        }
        Ok(())
    }

    /// Applies a copy-on-write list
    /// ([`BlockManager::take_copies`](crate::blocks::BlockManager::take_copies))
    /// in every layer: block
    /// `dst` becomes a copy of `src`. Refused before anything is recorded:
    /// a block outside the pool, a destination named twice or also a source.
    pub fn copy_blocks(&self, gpu: &Gpu, copies: &[[u32; 2]]) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        self.check_copies(copies)?;
        if copies.is_empty() {
            return Ok(());
        }
        gpu.scoped_try(|| {
            let list = [gpu.storage_init("mla copies", copies)?];
            let threads = copies.len() as u64 * self.cfg.block_size as u64 * self.shape.row4 as u64;
            let pools: Vec<&wgpu::Buffer> = self.layers.iter().collect();
            self.submit_pool_pass(
                gpu,
                "mla_copy",
                &self.copy,
                copies.len(),
                &list,
                &pools,
                threads,
            )
        })
    }

    fn check_copies(&self, copies: &[[u32; 2]]) -> Result<(), GpuError> {
        if copies.len() > MAX_ROWS_PER_CALL {
            return Err(MlaError::Len {
                what: "copies",
                got: copies.len() as u64,
                want: MAX_ROWS_PER_CALL as u64,
            }
            .into());
        }
        let blocks = self.cfg.num_blocks;
        if let Some(&b) = copies.iter().flatten().find(|&&b| b >= blocks) {
            return Err(MlaError::Block {
                what: "copy",
                block: b,
                blocks,
            }
            .into());
        }
        let mut dst: Vec<u32> = copies.iter().map(|c| c[1]).collect();
        dst.sort_unstable();
        if let Some(w) = dst.windows(2).find(|w| w[0] == w[1]) {
            return Err(MlaError::CopyOverlap(w[0]).into());
        }
        if let Some(c) = copies.iter().find(|c| dst.binary_search(&c[0]).is_ok()) {
            return Err(MlaError::CopyOverlap(c[0]).into());
        }
        Ok(())
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

/// A batch planned for [`MlaAttention::run`]: its query rows, tables and
/// split, uploaded once. Made for one attention object and one pool.
pub struct MlaPlan {
    owner: u64,
    cache: u64,
    num_queries: u32,
    parts: u32,
    part_tokens: u32,
    params: wgpu::Buffer,
    queries: wgpu::Buffer,
    tables: wgpu::Buffer,
    /// Split-K partials and their (max, sum), or a placeholder when unsplit.
    acc: wgpu::Buffer,
    ml: wgpu::Buffer,
}

impl MlaPlan {
    /// Query rows: what `q` holds rows of, and `out` receives.
    pub fn num_queries(&self) -> u32 {
        self.num_queries
    }

    /// Split-K partitions per query row (1: unsplit).
    pub fn partitions(&self) -> u32 {
        self.parts
    }

    /// Tokens per partition.
    pub fn partition_tokens(&self) -> u32 {
        self.part_tokens
    }
}

/// MLA attention in the absorbed form for a number of query heads over
/// pools of one shape.
pub struct MlaAttention {
    heads: u32,
    scale: f32,
    cfg: MlaCacheConfig,
    shape: MlaShape,
    decode: wgpu::ComputePipeline,
    merge: wgpu::ComputePipeline,
    cap: Option<u32>,
    adapter: String,
    id: u64,
}

impl MlaAttention {
    /// The kernels for `num_heads` query heads over pools shaped like
    /// `cfg` (its layer and block counts do not matter), with the softmax
    /// `scale` (DeepSeek: `1 / sqrt(qk_nope_head_dim + rope_dim)`, times
    /// its YaRN factor).
    pub fn new(
        gpu: &Gpu,
        cfg: &MlaCacheConfig,
        num_heads: u32,
        scale: f32,
    ) -> Result<Self, GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        cfg.validate()?;
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
        let decode = mla_pipeline(gpu, "mla_decode", &shape)?;
        let merge = mla_pipeline(gpu, "mla_merge", &shape)?;
        Ok(Self {
            heads: num_heads,
            scale,
            cfg: *cfg,
            shape,
            decode,
            merge,
            cap: gpu.caps_loops().then(|| shape.loop_cap()),
            adapter: gpu.info.name.clone(),
            id: next_id(),
        })
    }

    /// The kernels' shape (its prelude is what `mla_source` composes).
    pub fn shape(&self) -> &MlaShape {
        &self.shape
    }

    /// f32 values of `q` per query row: heads x (kv_lora_rank + rope_dim).
    pub fn q_row_elems(&self) -> u64 {
        self.heads as u64 * self.cfg.row_elems() as u64
    }

    /// f32 values of the output per query row: heads x kv_lora_rank.
    pub fn out_row_elems(&self) -> u64 {
        self.heads as u64 * self.cfg.kv_lora_rank as u64
    }

    /// Plans decode: one query row per sequence, seeing its `lens[i]`
    /// tokens through `tables[i]`.
    pub fn plan_decode(
        &self,
        gpu: &Gpu,
        cache: &MlaCache,
        tables: &[&[u32]],
        lens: &[u32],
        split: Split,
    ) -> Result<MlaPlan, GpuError> {
        if lens.len() != tables.len() {
            return Err(MlaError::Len {
                what: "lens",
                got: lens.len() as u64,
                want: tables.len() as u64,
            }
            .into());
        }
        let queries: Vec<[u32; 2]> = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| [i as u32, l])
            .collect();
        self.plan(gpu, cache, tables, &queries, split)
    }

    /// Plans prefill: sequence i has `starts[i]` tokens cached before its
    /// `new_tokens[i]` new ones (whose rows the pool already holds), and
    /// each new token is a query row that sees the tokens up to its own
    /// (the causal mask). Rows are ordered by sequence, then position.
    pub fn plan_prefill(
        &self,
        gpu: &Gpu,
        cache: &MlaCache,
        tables: &[&[u32]],
        starts: &[u32],
        new_tokens: &[u32],
        split: Split,
    ) -> Result<MlaPlan, GpuError> {
        for (what, v) in [("starts", starts), ("new_tokens", new_tokens)] {
            if v.len() != tables.len() {
                return Err(MlaError::Len {
                    what,
                    got: v.len() as u64,
                    want: tables.len() as u64,
                }
                .into());
            }
        }
        let total: u64 = new_tokens.iter().map(|&n| n as u64).sum();
        if total == 0 || total > MLA_MAX_QUERIES as u64 {
            return Err(MlaError::Queries {
                count: total,
                limit: MLA_MAX_QUERIES,
            }
            .into());
        }
        let mut queries = Vec::with_capacity(total as usize);
        for (i, (&s, &n)) in starts.iter().zip(new_tokens).enumerate() {
            for k in 0..n as u64 {
                let visible = (s as u64 + k + 1).min(u32::MAX as u64) as u32;
                queries.push([i as u32, visible]);
            }
        }
        self.plan(gpu, cache, tables, &queries, split)
    }

    fn plan(
        &self,
        gpu: &Gpu,
        cache: &MlaCache,
        tables: &[&[u32]],
        queries: &[[u32; 2]],
        split: Split,
    ) -> Result<MlaPlan, GpuError> {
        let _serial = gpu.serial();
        self.check_cache(cache)?;
        if queries.is_empty() || queries.len() > MLA_MAX_QUERIES as usize {
            return Err(MlaError::Queries {
                count: queries.len() as u64,
                limit: MLA_MAX_QUERIES,
            }
            .into());
        }
        let bs = self.cfg.block_size as u64;
        let blocks = cache.cfg.num_blocks;
        for t in tables {
            if let Some(&b) = t.iter().find(|&&b| b >= blocks) {
                return Err(MlaError::Block {
                    what: "table",
                    block: b,
                    blocks,
                }
                .into());
            }
        }
        let stride = tables.iter().map(|t| t.len()).max().unwrap_or(0).max(1);
        // Every table entry's index, and every token position, fits a u32.
        let cells = stride as u64 * tables.len() as u64;
        if cells > u32::MAX as u64 / 2 || stride as u64 * bs > MAX_SEQ_LEN as u64 {
            return Err(MlaError::Len {
                what: "table entries",
                got: cells,
                want: (MAX_SEQ_LEN as u64 / bs).min(u32::MAX as u64 / 2),
            }
            .into());
        }
        for (qi, &[seq, visible]) in queries.iter().enumerate() {
            let held = tables.get(seq as usize).map_or(0, |t| t.len() as u64 * bs);
            if visible == 0 || visible as u64 > held {
                return Err(MlaError::Visible {
                    query: qi,
                    visible: visible as u64,
                    held,
                }
                .into());
            }
        }
        let max_visible = queries.iter().map(|q| q[1]).max().unwrap_or(1);
        let part_tokens = self.partition_tokens(queries.len() as u64, max_visible, split)?;
        let parts = max_visible.div_ceil(part_tokens);
        let mut packed = vec![u32::MAX; stride * tables.len().max(1)];
        for (i, t) in tables.iter().enumerate() {
            packed[i * stride..i * stride + t.len()].copy_from_slice(t);
        }
        let slots = queries.len() as u64 * self.heads as u64 * parts as u64;
        gpu.scoped_try(|| {
            let params = gpu.uniform(
                "mla params",
                &MlaParams {
                    num_queries: queries.len() as u32,
                    num_heads: self.heads,
                    num_blocks: blocks,
                    table_stride: stride as u32,
                    parts,
                    part_tokens,
                    scale: self.scale,
                    count: 0,
                },
            )?;
            let (acc, ml) = if parts > 1 {
                (
                    gpu.storage("mla partials", slots * self.shape.v4 as u64 * 16)?,
                    gpu.storage("mla partial max and sum", slots * 8)?,
                )
            } else {
                (
                    gpu.storage("mla no partials", 16)?,
                    gpu.storage("mla no partials", 16)?,
                )
            };
            Ok(MlaPlan {
                owner: self.id,
                cache: cache.id,
                num_queries: queries.len() as u32,
                parts,
                part_tokens,
                params,
                queries: gpu.storage_init("mla queries", queries)?,
                tables: gpu.storage_init("mla tables", &packed)?,
                acc,
                ml,
            })
        })
    }

    /// Tokens per partition for a batch of `rows` query rows whose longest
    /// sees `max_visible` tokens.
    fn partition_tokens(&self, rows: u64, max_visible: u32, split: Split) -> Result<u32, GpuError> {
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

    fn check_cache(&self, cache: &MlaCache) -> Result<(), GpuError> {
        let (a, b) = (&self.cfg, &cache.cfg);
        if (a.block_size, a.kv_lora_rank, a.rope_dim, a.dtype)
            != (b.block_size, b.kv_lora_rank, b.rope_dim, b.dtype)
        {
            return Err(MlaError::Mismatch(
                "this MlaAttention was made for latent pools of another shape",
            )
            .into());
        }
        Ok(())
    }

    /// Records `plan` on `layer` of `cache` into `enc`: `q` holds the
    /// plan's query rows ([`q_row_elems`](Self::q_row_elems) f32 each, in
    /// the plan's order, RoPE part last), `out` receives
    /// [`out_row_elems`](Self::out_row_elems) f32 per row. Refused before
    /// anything is recorded: a plan of another attention object or pool, a
    /// layer outside the pool, a buffer too small or without `STORAGE`.
    pub fn run(
        &self,
        gpu: &Gpu,
        enc: &mut wgpu::CommandEncoder,
        plan: &MlaPlan,
        cache: &MlaCache,
        layer: u32,
        q: &wgpu::Buffer,
        out: &wgpu::Buffer,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        if plan.owner != self.id {
            return Err(MlaError::Mismatch("this plan was made by another MlaAttention").into());
        }
        if plan.cache != cache.id {
            return Err(MlaError::Mismatch("this plan was made for another latent pool").into());
        }
        let pool = cache.layer_buffer(layer)?;
        let rows = plan.num_queries as u64;
        for (which, buf, floats) in [
            ("q", q, rows * self.q_row_elems()),
            ("out", out, rows * self.out_row_elems()),
        ] {
            if !buf.usage().contains(wgpu::BufferUsages::STORAGE) {
                return Err(GpuError::Binding {
                    which,
                    problem: BindingError::NotStorage {
                        usage: format!("{:?}", buf.usage()),
                    },
                });
            }
            if buf.size() < floats * 4 {
                return Err(GpuError::Binding {
                    which,
                    problem: BindingError::TooSmall {
                        bound: buf.size(),
                        needed: floats * 4,
                    },
                });
            }
        }
        gpu.scoped_try(|| {
            let split = plan.parts > 1;
            let target = if split { &plan.acc } else { out };
            let bg = bind(
                gpu,
                &self.decode,
                &[
                    &plan.params,
                    q,
                    &plan.queries,
                    &plan.tables,
                    pool,
                    target,
                    &plan.ml,
                ],
            );
            let grid = (
                self.heads.div_ceil(self.shape.hg),
                plan.num_queries,
                plan.parts,
            );
            dispatch(enc, "mla_decode", &self.decode, &bg, grid);
            if split {
                let bg = bind(gpu, &self.merge, &[&plan.params, &plan.acc, &plan.ml, out]);
                let o = rows * self.heads as u64;
                let y = o.min(65535) as u32;
                let z = o.div_ceil(y as u64) as u32;
                dispatch(
                    enc,
                    "mla_merge",
                    &self.merge,
                    &bg,
                    (self.shape.v4.div_ceil(64), y, z),
                );
            }
            Ok(())
        })
    }

    /// Uploads `q`, records `plan` and submits; the output buffer.
    fn submit(
        &self,
        gpu: &Gpu,
        plan: &MlaPlan,
        cache: &MlaCache,
        layer: u32,
        q: &[f32],
    ) -> Result<wgpu::Buffer, GpuError> {
        let want = plan.num_queries as u64 * self.q_row_elems();
        if q.len() as u64 != want {
            return Err(MlaError::Len {
                what: "q",
                got: q.len() as u64,
                want,
            }
            .into());
        }
        cache.layer_buffer(layer)?;
        let (q_buf, out) = gpu.scoped_try(|| {
            Ok((
                gpu.storage_init("mla q", q)?,
                gpu.storage(
                    "mla out",
                    plan.num_queries as u64 * self.out_row_elems() * 4,
                )?,
            ))
        })?;
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        self.run(gpu, &mut enc, plan, cache, layer, &q_buf, &out)?;
        gpu.queue.submit([enc.finish()]);
        Ok(out)
    }

    /// Decode on host slices: `q` holds one row per sequence; returns one
    /// output row per sequence (heads x kv_lora_rank). Native only.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn decode(
        &self,
        gpu: &Gpu,
        cache: &MlaCache,
        layer: u32,
        q: &[f32],
        tables: &[&[u32]],
        lens: &[u32],
        split: Split,
    ) -> Result<Vec<f32>, GpuError> {
        let _serial = gpu.serial();
        let plan = self.plan_decode(gpu, cache, tables, lens, split)?;
        let out = self.submit(gpu, &plan, cache, layer, q)?;
        gpu.read(&out, out.size())
    }

    /// Prefill on host slices: `q` holds one row per new token, ordered as
    /// [`plan_prefill`](Self::plan_prefill) says. Native only.
    #[cfg(not(target_arch = "wasm32"))]
    #[allow(clippy::too_many_arguments)]
    pub fn prefill(
        &self,
        gpu: &Gpu,
        cache: &MlaCache,
        layer: u32,
        q: &[f32],
        tables: &[&[u32]],
        starts: &[u32],
        new_tokens: &[u32],
        split: Split,
    ) -> Result<Vec<f32>, GpuError> {
        let _serial = gpu.serial();
        let plan = self.plan_prefill(gpu, cache, tables, starts, new_tokens, split)?;
        let out = self.submit(gpu, &plan, cache, layer, q)?;
        gpu.read(&out, out.size())
    }

    /// [`decode`](Self::decode) or [`prefill`](Self::prefill) of a
    /// planned batch without blocking (the browser's path).
    pub async fn run_async(
        &self,
        gpu: &Gpu,
        plan: &MlaPlan,
        cache: &MlaCache,
        layer: u32,
        q: &[f32],
    ) -> Result<Vec<f32>, GpuError> {
        let out = self.submit(gpu, plan, cache, layer, q)?;
        gpu.read_async(&out, out.size()).await
    }
}
