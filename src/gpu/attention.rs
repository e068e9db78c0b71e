//! Paged attention kernels on the GPU: decode (one query per sequence), with
//! an optional split-K path (partitions merged by `reduce`).

use super::kv_cache::{bind, dispatch, pipeline};
use super::shader::{self, ShaderShape};
use super::{params, Gpu, GpuError, KvCache};

/// How decode splits long sequences into partitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Split {
    /// Decide per batch with [`Split::choose`].
    #[default]
    Auto,
    /// One workgroup per (sequence, kv head).
    Never,
    /// Partitions of this many tokens (a positive multiple of 64).
    Tokens(u32),
}

/// Tokens per partition chosen by `Split::Auto`.
pub const AUTO_PARTITION_TOKENS: u32 = 512;

impl Split {
    /// The rule behind `Auto`: split when the batch alone would leave the GPU
    /// idle (fewer than 256 workgroups of (sequence, kv head)) and the longest
    /// sequence spans at least two partitions; and always beyond 4096 tokens,
    /// which bounds the work of one invocation (software rasterisers such as
    /// llvmpipe stop loops after 65535 iterations per invocation).
    pub fn choose(self, num_seqs: u32, num_kv_heads: u32, max_len: u32) -> u32 {
        match self {
            Split::Never => 0,
            Split::Tokens(t) => t,
            Split::Auto => {
                let workgroups = num_seqs * num_kv_heads;
                if max_len > 4096 || (workgroups < 256 && max_len >= 2 * AUTO_PARTITION_TOKENS) {
                    AUTO_PARTITION_TOKENS
                } else {
                    0
                }
            }
        }
    }
}

/// The attention variant and its options.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct AttnOptions {
    /// q·k multiplier; `1 / sqrt(head_dim)` when `None`.
    pub scale: Option<f32>,
    /// Logit soft-cap `cap * tanh(s / cap)`.
    pub soft_cap: Option<f32>,
    /// Attend to the last `w` positions only.
    pub sliding_window: Option<u32>,
    /// ALiBi slope per query head.
    pub alibi_slopes: Option<Vec<f32>>,
    /// Split-K policy.
    pub split: Split,
}

impl AttnOptions {
    /// Checks the options for `num_heads` query heads; the message says
    /// what is wrong. Shared by every backend's host path.
    pub fn validate(&self, num_heads: u32) -> Result<(), String> {
        if let Split::Tokens(t) = self.split {
            if t == 0 || !t.is_multiple_of(64) {
                return Err(format!(
                    "partition of {t} tokens: must be a positive multiple of 64"
                ));
            }
        }
        if let Some(s) = &self.alibi_slopes {
            if s.len() != num_heads as usize {
                return Err(format!("{} ALiBi slopes for {num_heads} heads", s.len()));
            }
        }
        if self.soft_cap.is_some_and(|c| c.is_nan() || c <= 0.0) || self.sliding_window == Some(0) {
            return Err("soft_cap must be positive and sliding_window at least 1".into());
        }
        Ok(())
    }
}

/// A batch's block tables packed into one GPU buffer:
/// `kv_indptr[n + 1] | seq_lens[n] | kv_indices[m] | alibi slopes[num_heads]`,
/// and for prefill `| qo_indptr[n + 1] | tile list (sequence, first query)`.
pub struct BatchTables {
    /// The packed buffer.
    pub buffer: wgpu::Buffer,
    /// Sequences.
    pub num_seqs: u32,
    /// Length of `kv_indices`.
    pub indices_len: u32,
    /// Longest sequence (for the split rule).
    pub max_len: u32,
    /// Whether slopes were packed.
    pub has_slopes: bool,
    /// Prefill only: offset of `qo_indptr` in the buffer (0 for decode).
    pub qo_off: u32,
    /// Prefill only: workgroups of the tile list.
    pub num_tiles: u32,
}

impl BatchTables {
    /// Packs and uploads decode tables. No validation: the kernels skip
    /// entries outside the pool. [`PagedAttention::check_tables`] checks host input.
    pub fn upload(
        gpu: &Gpu,
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        slopes: Option<&[f32]>,
    ) -> Self {
        Self::pack(gpu, kv_indptr, kv_indices, seq_lens, slopes, None)
    }

    /// Packs and uploads prefill tables: sequence `s` has queries
    /// `qo_indptr[s]..qo_indptr[s + 1]`, cut into tiles of `qtile` (see
    /// [`PagedAttention::prefill_qtile`]).
    pub fn upload_prefill(
        gpu: &Gpu,
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        slopes: Option<&[f32]>,
        qo_indptr: &[u32],
        qtile: u32,
    ) -> Self {
        Self::pack(
            gpu,
            kv_indptr,
            kv_indices,
            seq_lens,
            slopes,
            Some((qo_indptr, qtile)),
        )
    }

    fn pack(
        gpu: &Gpu,
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        slopes: Option<&[f32]>,
        prefill: Option<(&[u32], u32)>,
    ) -> Self {
        let n = seq_lens.len();
        let mut packed =
            Vec::with_capacity(2 * n + 1 + kv_indices.len() + slopes.map_or(0, |s| s.len()));
        packed.extend_from_slice(kv_indptr);
        packed.resize(n + 1, 0);
        packed.extend_from_slice(seq_lens);
        packed.extend_from_slice(kv_indices);
        if let Some(s) = slopes {
            packed.extend(s.iter().map(|x| x.to_bits()));
        }
        let (mut qo_off, mut num_tiles) = (0, 0);
        if let Some((qo, qtile)) = prefill {
            qo_off = packed.len() as u32;
            packed.extend_from_slice(qo);
            packed.resize(qo_off as usize + n + 1, 0);
            for s in 0..n {
                let nq = qo
                    .get(s + 1)
                    .unwrap_or(&0)
                    .saturating_sub(*qo.get(s).unwrap_or(&0));
                for first in (0..nq).step_by(qtile.max(1) as usize) {
                    packed.extend_from_slice(&[s as u32, first]);
                    num_tiles += 1;
                }
            }
        }
        Self {
            buffer: gpu.storage_init("tables", &packed),
            num_seqs: n as u32,
            indices_len: kv_indices.len() as u32,
            max_len: seq_lens.iter().copied().max().unwrap_or(0),
            has_slopes: slopes.is_some(),
            qo_off,
            num_tiles,
        }
    }
}

/// Decode kernels specialised for one cache shape and head count.
pub struct PagedAttention {
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    num_blocks: u32,
    decode: wgpu::ComputePipeline,
    reduce: wgpu::ComputePipeline,
    /// Built on first use: decode-only callers never pay for its compile
    /// (seconds per shape on software GL).
    prefill: std::sync::OnceLock<wgpu::ComputePipeline>,
    prefill_shape: ShaderShape,
    /// Bound in place of the split-K (max, sum) output when there is none,
    /// made once rather than per call.
    unused_ml: wgpu::Buffer,
}

impl PagedAttention {
    /// Builds the kernels for `num_heads` query heads over `cache`.
    pub fn new(gpu: &Gpu, cache: &KvCache, num_heads: u32) -> Result<Self, GpuError> {
        Self::with_layout(gpu, cache, num_heads, true)
    }

    /// The same kernels with `paged == false`: no per-token table lookup,
    /// each sequence's blocks assumed consecutive from its first table entry.
    /// A contiguous-KV baseline of the same design, for benchmarks.
    pub fn contiguous(gpu: &Gpu, cache: &KvCache, num_heads: u32) -> Result<Self, GpuError> {
        Self::with_layout(gpu, cache, num_heads, false)
    }

    fn with_layout(
        gpu: &Gpu,
        cache: &KvCache,
        num_heads: u32,
        paged: bool,
    ) -> Result<Self, GpuError> {
        let c = cache.config();
        if num_heads == 0 || !num_heads.is_multiple_of(c.num_kv_heads) {
            return Err(GpuError::InvalidArgument(format!(
                "num_heads {num_heads} is not a positive multiple of num_kv_heads {}",
                c.num_kv_heads
            )));
        }
        // Decode and prefill run a workgroup per KV head, reduce one per query head.
        let max_dim = gpu.limits.max_compute_workgroups_per_dimension;
        if num_heads > max_dim {
            return Err(GpuError::Unsupported(format!(
                "{num_heads} query heads: one dispatch dimension holds at most {max_dim} workgroups"
            )));
        }
        let shape = ShaderShape {
            head_dim: c.head_dim,
            group: num_heads / c.num_kv_heads,
            block_size: c.block_size,
            dtype: c.dtype,
            qtile: 1,
            paged,
        };
        let need = shader::attention_workgroup_bytes(&shape);
        let have = gpu.limits.max_compute_workgroup_storage_size;
        if need > have {
            return Err(GpuError::Unsupported(format!(
                "GQA group of {} heads with head_dim {} needs {need} bytes of workgroup memory; the adapter has {have}",
                shape.group, c.head_dim
            )));
        }
        let qtile = shader::prefill_qtile(&shape, have);
        Ok(Self {
            num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: c.block_size,
            num_blocks: c.num_blocks,
            decode: pipeline(gpu, "attention", &shape)?,
            reduce: pipeline(gpu, "reduce", &shape)?,
            prefill: std::sync::OnceLock::new(),
            prefill_shape: ShaderShape { qtile, ..shape },
            unused_ml: gpu.storage("unused split (max, sum)", 16),
        })
    }

    /// Queries per prefill workgroup (chosen from the adapter's workgroup memory).
    pub fn prefill_qtile(&self) -> u32 {
        self.prefill_shape.qtile
    }

    fn prefill_pipeline(&self, gpu: &Gpu) -> Result<&wgpu::ComputePipeline, GpuError> {
        if let Some(p) = self.prefill.get() {
            return Ok(p);
        }
        let p = pipeline(gpu, "attention", &self.prefill_shape)?;
        Ok(self.prefill.get_or_init(|| p))
    }

    /// Query heads.
    pub fn num_heads(&self) -> u32 {
        self.num_heads
    }

    fn attn_params(
        &self,
        t: &BatchTables,
        o: &AttnOptions,
        partition_tokens: u32,
        num_partitions: u32,
    ) -> params::AttnParams {
        let n = t.num_seqs;
        params::AttnParams {
            num_seqs: n,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            num_blocks: self.num_blocks,
            scale: o.scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt()),
            soft_cap: o.soft_cap.unwrap_or(0.0),
            sliding_window: o.sliding_window.unwrap_or(0),
            alibi: t.has_slopes as u32,
            partition_tokens,
            num_partitions,
            lens_off: n + 1,
            indices_off: 2 * n + 1,
            indices_len: t.indices_len,
            slopes_off: 2 * n + 1 + t.indices_len,
            qo_off: t.qo_off,
            _pad: 0,
        }
    }

    /// Records chunked prefill into `enc`: `tables` from
    /// [`BatchTables::upload_prefill`] with this kernel's
    /// [`prefill_qtile`](Self::prefill_qtile); `q` holds
    /// `[num_queries][num_heads][head_dim]` (sequence after sequence, as
    /// `qo_indptr`), `out` the same shape. Each sequence's queries are its
    /// newest positions and attend causally to its whole paged context,
    /// including the chunk itself (written beforehand by `write_kv`).
    #[allow(clippy::too_many_arguments)]
    pub fn encode_prefill(
        &self,
        gpu: &Gpu,
        enc: &mut wgpu::CommandEncoder,
        cache: &KvCache,
        layer: u32,
        q: &wgpu::Buffer,
        tables: &BatchTables,
        out: &wgpu::Buffer,
        opts: &AttnOptions,
    ) -> Result<(), GpuError> {
        self.check_options(opts)?;
        let [k, v] = cache.layer(layer)?;
        if tables.qo_off == 0 {
            return Err(GpuError::InvalidArgument(
                "prefill given decode tables (use BatchTables::upload_prefill)".into(),
            ));
        }
        if tables.num_tiles == 0 {
            return Ok(());
        }
        if tables.num_tiles > 65535 {
            return Err(GpuError::InvalidArgument(format!(
                "{} query tiles in one prefill (at most 65535; split the batch)",
                tables.num_tiles
            )));
        }
        let prefill = self.prefill_pipeline(gpu)?;
        let p = self.attn_params(tables, opts, 0, 1);
        let ub = gpu.uniform("prefill params", &p);
        let dummy = &self.unused_ml;
        let bg = bind(gpu, prefill, &[&ub, q, k, v, &tables.buffer, out, dummy]);
        dispatch(
            enc,
            "prefill",
            prefill,
            &bg,
            (tables.num_tiles, self.num_kv_heads, 1),
        );
        Ok(())
    }

    /// Prefill from host slices: validates, runs, returns
    /// `[num_queries][num_heads][head_dim]`. Native only.
    #[cfg(not(target_arch = "wasm32"))]
    #[allow(clippy::too_many_arguments)]
    pub fn prefill(
        &self,
        gpu: &Gpu,
        cache: &KvCache,
        layer: u32,
        q: &[f32],
        qo_indptr: &[u32],
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        opts: &AttnOptions,
    ) -> Result<Vec<f32>, GpuError> {
        cache.layer(layer)?;
        self.check_options(opts)?;
        self.check_tables(kv_indptr, kv_indices, seq_lens)?;
        let n = seq_lens.len();
        let bad = |m: String| Err(GpuError::InvalidArgument(m));
        if qo_indptr.len() != n + 1
            || qo_indptr[0] != 0
            || qo_indptr.windows(2).any(|w| w[0] > w[1])
        {
            return bad(format!(
                "qo_indptr must hold {} non-decreasing offsets from 0",
                n + 1
            ));
        }
        for s in 0..n {
            let nq = qo_indptr[s + 1] - qo_indptr[s];
            if nq > seq_lens[s] {
                return bad(format!(
                    "sequence {s} has {nq} queries but holds only {} tokens",
                    seq_lens[s]
                ));
            }
        }
        let row = (self.num_heads * self.head_dim) as usize;
        let nq = qo_indptr[n] as usize;
        if q.len() != nq * row {
            return bad(format!(
                "q has {} floats; {nq} queries need {}",
                q.len(),
                nq * row
            ));
        }
        let bytes = (q.len() * 4) as u64;
        let out = gpu.storage("prefill out", bytes);
        gpu.queue.write_buffer(
            &out,
            0,
            bytemuck::cast_slice(&vec![f32::NAN; q.len().max(4)]),
        );
        if nq == 0 {
            return Ok(Vec::new());
        }
        gpu.scoped_try(|| {
            let tables = BatchTables::upload_prefill(
                gpu,
                kv_indptr,
                kv_indices,
                seq_lens,
                opts.alibi_slopes.as_deref(),
                qo_indptr,
                self.prefill_shape.qtile,
            );
            let qb = gpu.storage_init("q", q);
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            self.encode_prefill(gpu, &mut enc, cache, layer, &qb, &tables, &out, opts)?;
            gpu.queue.submit([enc.finish()]);
            Ok(())
        })?;
        gpu.read(&out, bytes)
    }

    /// Checks host-side CSR tables against the pool and the batch
    /// ([`check_csr_tables`] with this kernel's pool).
    pub fn check_tables(
        &self,
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
    ) -> Result<(), GpuError> {
        check_csr_tables(
            self.num_blocks,
            self.block_size,
            kv_indptr,
            kv_indices,
            seq_lens,
        )
        .map_err(GpuError::InvalidArgument)
    }

    fn check_options(&self, o: &AttnOptions) -> Result<(), GpuError> {
        o.validate(self.num_heads)
            .map_err(GpuError::InvalidArgument)
    }

    /// Records decode into `enc`: `q` holds `[num_seqs][num_heads][head_dim]`
    /// f32, `out` receives the same shape. Split partials go to scratch
    /// buffers allocated here.
    #[allow(clippy::too_many_arguments)]
    pub fn encode_decode(
        &self,
        gpu: &Gpu,
        enc: &mut wgpu::CommandEncoder,
        cache: &KvCache,
        layer: u32,
        q: &wgpu::Buffer,
        tables: &BatchTables,
        out: &wgpu::Buffer,
        opts: &AttnOptions,
    ) -> Result<(), GpuError> {
        self.check_options(opts)?;
        let [k, v] = cache.layer(layer)?;
        let n = tables.num_seqs;
        if tables.qo_off != 0 {
            return Err(GpuError::InvalidArgument(
                "decode given prefill tables (use encode_prefill)".into(),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        if n > 65535 {
            return Err(GpuError::InvalidArgument(format!(
                "{n} sequences in one decode (at most 65535)"
            )));
        }
        let pt = opts.split.choose(n, self.num_kv_heads, tables.max_len);
        let d4 = self.head_dim as u64 / 4;
        if pt == 0 {
            let p = self.attn_params(tables, opts, 0, 1);
            let ub = gpu.uniform("decode params", &p);
            let dummy = &self.unused_ml;
            let bg = bind(
                gpu,
                &self.decode,
                &[&ub, q, k, v, &tables.buffer, out, dummy],
            );
            dispatch(enc, "decode", &self.decode, &bg, (n, self.num_kv_heads, 1));
            return Ok(());
        }
        let parts = tables.max_len.div_ceil(pt).max(1);
        if parts > 65535 {
            return Err(GpuError::InvalidArgument(format!(
                "{parts} partitions (at most 65535)"
            )));
        }
        let p = self.attn_params(tables, opts, pt, parts);
        let ub = gpu.uniform("decode params", &p);
        let rows = n as u64 * self.num_heads as u64 * parts as u64;
        let acc = gpu.storage("split acc", rows * d4 * 16);
        let ml = gpu.storage("split ml", rows * 8);
        let bg = bind(
            gpu,
            &self.decode,
            &[&ub, q, k, v, &tables.buffer, &acc, &ml],
        );
        dispatch(
            enc,
            "decode split",
            &self.decode,
            &bg,
            (n, self.num_kv_heads, parts),
        );
        let bg = bind(gpu, &self.reduce, &[&ub, &acc, &ml, out]);
        dispatch(enc, "reduce", &self.reduce, &bg, (n, self.num_heads, 1));
        Ok(())
    }

    /// Decode from host slices: validates everything, runs, returns
    /// `[num_seqs][num_heads][head_dim]`. Native only (blocks on readback).
    #[cfg(not(target_arch = "wasm32"))]
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        gpu: &Gpu,
        cache: &KvCache,
        layer: u32,
        q: &[f32],
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        opts: &AttnOptions,
    ) -> Result<Vec<f32>, GpuError> {
        let (out, bytes) = gpu.scoped_try(|| {
            self.submit_decode(gpu, cache, layer, q, kv_indptr, kv_indices, seq_lens, opts)
        })?;
        gpu.read(&out, bytes)
    }

    /// Async twin of [`decode`](Self::decode) (the browser path).
    #[allow(clippy::too_many_arguments)]
    pub async fn decode_async(
        &self,
        gpu: &Gpu,
        cache: &KvCache,
        layer: u32,
        q: &[f32],
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        opts: &AttnOptions,
    ) -> Result<Vec<f32>, GpuError> {
        let (out, bytes) = gpu
            .scoped(|| {
                self.submit_decode(gpu, cache, layer, q, kv_indptr, kv_indices, seq_lens, opts)
            })
            .await??;
        gpu.read_async(&out, bytes).await
    }

    #[allow(clippy::too_many_arguments)]
    fn submit_decode(
        &self,
        gpu: &Gpu,
        cache: &KvCache,
        layer: u32,
        q: &[f32],
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        opts: &AttnOptions,
    ) -> Result<(wgpu::Buffer, u64), GpuError> {
        cache.layer(layer)?;
        self.check_options(opts)?;
        self.check_tables(kv_indptr, kv_indices, seq_lens)?;
        let n = seq_lens.len();
        let row = (self.num_heads * self.head_dim) as usize;
        if q.len() != n * row {
            return Err(GpuError::InvalidArgument(format!(
                "q has {} floats; {n} sequences x {} heads x {} need {}",
                q.len(),
                self.num_heads,
                self.head_dim,
                n * row
            )));
        }
        let bytes = (q.len() * 4) as u64;
        let out = gpu.storage("decode out", bytes);
        // Poison the output so a kernel that skips a write cannot pass.
        gpu.queue.write_buffer(
            &out,
            0,
            bytemuck::cast_slice(&vec![f32::NAN; q.len().max(4)]),
        );
        if n == 0 {
            return Ok((out, 0));
        }
        let tables = BatchTables::upload(
            gpu,
            kv_indptr,
            kv_indices,
            seq_lens,
            opts.alibi_slopes.as_deref(),
        );
        let qb = gpu.storage_init("q", q);
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        self.encode_decode(gpu, &mut enc, cache, layer, &qb, &tables, &out, opts)?;
        gpu.queue.submit([enc.finish()]);
        Ok((out, bytes))
    }
}

/// Checks CSR block tables for a pool of `num_blocks` blocks of `block_size`
/// tokens: `kv_indptr` has one entry more than `seq_lens`, starts at 0,
/// never decreases and ends at `kv_indices.len()`; each sequence's table
/// covers its length; every entry is in the pool or [`RELEASED`](crate::blocks::RELEASED).
/// The message says what is wrong. Shared by every backend's host path.
pub fn check_csr_tables(
    num_blocks: u32,
    block_size: u32,
    kv_indptr: &[u32],
    kv_indices: &[u32],
    seq_lens: &[u32],
) -> Result<(), String> {
    let n = seq_lens.len();
    if kv_indptr.len() != n + 1 {
        return Err(format!(
            "kv_indptr has {} entries for {n} sequences (need {})",
            kv_indptr.len(),
            n + 1
        ));
    }
    if kv_indptr[0] != 0
        || kv_indptr.windows(2).any(|w| w[0] > w[1])
        || kv_indptr[n] as usize != kv_indices.len()
    {
        return Err("kv_indptr must start at 0, never decrease and end at kv_indices.len()".into());
    }
    for s in 0..n {
        let blocks = (kv_indptr[s + 1] - kv_indptr[s]) as u64;
        if seq_lens[s] as u64 > blocks * block_size as u64 {
            return Err(format!(
                "sequence {s} holds {} tokens but its table has only {blocks} blocks",
                seq_lens[s]
            ));
        }
    }
    // RELEASED marks a block a sliding window dropped: skipped by the kernels.
    if let Some(b) = kv_indices
        .iter()
        .find(|&&b| b >= num_blocks && b != crate::blocks::RELEASED)
    {
        return Err(format!(
            "block id {b} outside the pool of {num_blocks} blocks"
        ));
    }
    Ok(())
}
