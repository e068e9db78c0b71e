//! Paged attention kernels on the GPU: decode (one query per sequence), with
//! an optional split-K path (partitions merged by `reduce`).

use super::kernel::{self, Kernel};
use super::kv_cache::{bind, dispatch, pipeline};
use super::shader::{self, ShaderShape};
use super::{params, Gpu, GpuError, KvCache};

/// How decode splits long sequences into partitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Split {
    /// Decide per batch, kernel and adapter
    /// ([`PagedAttention::partition_tokens`]): split when the batch alone
    /// would leave the device idle, and where the adapter ends long loops
    /// early (llvmpipe), keep each pass under its cap.
    #[default]
    Auto,
    /// One workgroup per (sequence, kv head).
    Never,
    /// Partitions of this many tokens (a positive multiple of 64).
    Tokens(u32),
}

/// Partition tokens of the bench's fixed split configuration.
pub const AUTO_PARTITION_TOKENS: u32 = 512;

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
    /// Shared prefixes read once (cascade decode; plan/run API, decode
    /// only). A plan uses the cascade for all its variants, or for none:
    /// none if any variant says `Off`; else when some variant says `On` and
    /// the batch shares a segment, or under `Auto` when the cost model pays.
    pub cascade: super::Cascade,
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
            if let Some((h, x)) = s.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                return Err(format!(
                    "ALiBi slope of head {h} is {x}: slopes must be finite"
                ));
            }
        }
        if let Some(x) = self.scale.filter(|x| !x.is_finite()) {
            return Err(format!("scale {x}: must be finite"));
        }
        if let Some(c) = self.soft_cap.filter(|c| !c.is_finite() || *c <= 0.0) {
            return Err(format!("soft_cap {c}: must be finite and positive"));
        }
        if self.sliding_window == Some(0) {
            return Err("sliding_window of 0 positions: must be at least 1".into());
        }
        Ok(())
    }
}

/// Longest sequence (tokens of context) the kernels take: positions and
/// tile counters are `u32`, and a length this far below `u32::MAX` can
/// never wrap them.
pub const MAX_SEQ_LEN: u32 = 1 << 31;

/// Most sequences in one decode, and most query tiles in one prefill (one
/// dispatch dimension).
pub const MAX_BATCH: u32 = 65535;

/// A batch's block tables packed as the kernels read them, on the host:
/// `kv_indptr[n + 1] | seq_lens[n] | kv_indices[m] | alibi slopes[num_heads]`,
/// and for prefill `| qo_indptr[n + 1] | tile list (sequence, first query)`.
/// [`BatchTables::upload`] puts it in a GPU buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedTables {
    /// The words of the buffer.
    pub words: Vec<u32>,
    /// Sequences.
    pub num_seqs: u32,
    /// Length of `kv_indices`.
    pub indices_len: u32,
    /// Longest sequence.
    pub max_len: u32,
    /// The ALiBi slopes packed, if any.
    pub slopes: Option<Vec<f32>>,
    /// Prefill only: offset of `qo_indptr` in the words (0 for decode).
    pub qo_off: u32,
    /// Prefill only: query tiles (workgroups).
    pub num_tiles: u32,
    /// Query rows: `qo_indptr[n]` for prefill, the sequences for decode.
    pub num_queries: u32,
}

impl PackedTables {
    /// Packs tables without a GPU. No check of the CSR structure or of block
    /// ids (the kernels clip ranges and skip ids outside the pool), but every
    /// bound the kernels and the host arithmetic rely on is enforced: at most
    /// [`MAX_BATCH`] sequences and query tiles, lengths up to
    /// [`MAX_SEQ_LEN`], offsets that fit a `u32`, finite slopes.
    pub fn pack(
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        slopes: Option<&[f32]>,
        prefill: Option<(&[u32], u32)>,
    ) -> Result<Self, GpuError> {
        let mut words = Vec::new();
        let m = pack_into(&mut words, kv_indptr, kv_indices, seq_lens, slopes, prefill)?;
        Ok(Self {
            words,
            num_seqs: m.num_seqs,
            indices_len: m.indices_len,
            max_len: m.max_len,
            slopes: slopes.map(|s| s.to_vec()),
            qo_off: m.qo_off,
            num_tiles: m.num_tiles,
            num_queries: m.num_queries,
        })
    }
}

/// What [`pack_into`] packed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PackedMeta {
    pub num_seqs: u32,
    pub indices_len: u32,
    pub max_len: u32,
    pub qo_off: u32,
    pub num_tiles: u32,
    pub num_queries: u32,
}

/// [`PackedTables::pack`] into a reused vector (cleared first).
pub(crate) fn pack_into(
    packed: &mut Vec<u32>,
    kv_indptr: &[u32],
    kv_indices: &[u32],
    seq_lens: &[u32],
    slopes: Option<&[f32]>,
    prefill: Option<(&[u32], u32)>,
) -> Result<PackedMeta, GpuError> {
    packed.clear();
    let bad = |m: String| Err(GpuError::InvalidArgument(m));
    let n = seq_lens.len();
    if n > MAX_BATCH as usize {
        return bad(format!("{n} sequences in one batch (at most {MAX_BATCH})"));
    }
    if let Some((s, &l)) = seq_lens.iter().enumerate().find(|(_, &l)| l > MAX_SEQ_LEN) {
        return bad(format!(
            "sequence {s} holds {l} tokens, over the limit of {MAX_SEQ_LEN}"
        ));
    }
    if let Some(x) = slopes.and_then(|s| s.iter().find(|x| !x.is_finite())) {
        return bad(format!("ALiBi slope {x}: slopes must be finite"));
    }
    let slopes_len = slopes.map_or(0, |s| s.len());
    let qo_len = prefill.map_or(0, |_| n + 1);
    // Every offset the kernels compute into the buffer fits a u32.
    let words = (2 * n + 1)
        .checked_add(kv_indices.len())
        .and_then(|w| w.checked_add(slopes_len))
        .and_then(|w| w.checked_add(qo_len))
        .filter(|&w| w <= (u32::MAX / 2) as usize);
    let Some(words) = words else {
        return bad(format!(
            "tables of {} block ids and {slopes_len} slopes do not fit u32 offsets",
            kv_indices.len()
        ));
    };
    packed.reserve(words);
    packed.extend_from_slice(&kv_indptr[..kv_indptr.len().min(n + 1)]);
    packed.resize(n + 1, 0);
    packed.extend_from_slice(seq_lens);
    packed.extend_from_slice(kv_indices);
    if let Some(s) = slopes {
        packed.extend(s.iter().map(|x| x.to_bits()));
    }
    let (mut qo_off, mut num_tiles, mut num_queries) = (0u32, 0u32, n as u32);
    if let Some((qo, qtile)) = prefill {
        let qtile = qtile.max(1);
        qo_off = packed.len() as u32;
        packed.extend_from_slice(&qo[..qo.len().min(n + 1)]);
        packed.resize(qo_off as usize + n + 1, 0);
        let mut tiles = 0u64;
        for s in 0..n {
            let nq = qo
                .get(s + 1)
                .unwrap_or(&0)
                .saturating_sub(*qo.get(s).unwrap_or(&0));
            tiles += nq.div_ceil(qtile) as u64;
        }
        if tiles > MAX_BATCH as u64 {
            return bad(format!(
                "{tiles} query tiles of {qtile} in one prefill (at most {MAX_BATCH}; split the batch)"
            ));
        }
        packed.reserve(2 * tiles as usize);
        for s in 0..n {
            let nq = qo
                .get(s + 1)
                .unwrap_or(&0)
                .saturating_sub(*qo.get(s).unwrap_or(&0));
            for first in (0..nq).step_by(qtile as usize) {
                packed.extend_from_slice(&[s as u32, first]);
            }
        }
        num_tiles = tiles as u32;
        num_queries = qo.get(n).copied().unwrap_or(0);
    }
    Ok(PackedMeta {
        num_seqs: n as u32,
        indices_len: kv_indices.len() as u32,
        max_len: seq_lens.iter().copied().max().unwrap_or(0),
        qo_off,
        num_tiles,
        num_queries,
    })
}

/// A batch's block tables in one GPU buffer ([`PackedTables`]'s layout).
pub struct BatchTables {
    /// The packed buffer.
    pub buffer: wgpu::Buffer,
    /// Sequences.
    pub num_seqs: u32,
    /// Length of `kv_indices`.
    pub indices_len: u32,
    /// Longest sequence (for the split rule).
    pub max_len: u32,
    /// The ALiBi slopes packed, if any: they must equal the
    /// [`AttnOptions::alibi_slopes`] given with these tables.
    pub slopes: Option<Vec<f32>>,
    /// Prefill only: offset of `qo_indptr` in the buffer (0 for decode).
    pub qo_off: u32,
    /// Prefill only: workgroups of the tile list.
    pub num_tiles: u32,
    /// Query rows: `qo_indptr[n]` for prefill, the sequences for decode.
    pub num_queries: u32,
    /// Decode only: the packed words kept on the host, so
    /// [`PagedAttention::encode_decode`] can find shared prefixes and run
    /// the cascade.
    host: Option<Vec<u32>>,
}

impl BatchTables {
    /// Packs ([`PackedTables::pack`]) and uploads decode tables. No check of
    /// the tables against a pool: the kernels skip entries outside it.
    /// [`PagedAttention::check_tables`] checks host input fully.
    pub fn upload(
        gpu: &Gpu,
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        slopes: Option<&[f32]>,
    ) -> Result<Self, GpuError> {
        Self::from_packed(
            gpu,
            PackedTables::pack(kv_indptr, kv_indices, seq_lens, slopes, None)?,
        )
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
    ) -> Result<Self, GpuError> {
        Self::from_packed(
            gpu,
            PackedTables::pack(
                kv_indptr,
                kv_indices,
                seq_lens,
                slopes,
                Some((qo_indptr, qtile)),
            )?,
        )
    }

    /// Uploads packed tables.
    pub fn from_packed(gpu: &Gpu, p: PackedTables) -> Result<Self, GpuError> {
        Ok(Self {
            buffer: gpu.storage_init("tables", &p.words)?,
            host: (p.qo_off == 0).then(|| p.words.clone()),
            num_seqs: p.num_seqs,
            indices_len: p.indices_len,
            max_len: p.max_len,
            slopes: p.slopes,
            qo_off: p.qo_off,
            num_tiles: p.num_tiles,
            num_queries: p.num_queries,
        })
    }
}

/// Decode kernels specialised for one cache shape and head count.
pub struct PagedAttention {
    /// The cache shape the kernels were built for.
    pub(super) cache_cfg: super::KvCacheConfig,
    pub(super) num_heads: u32,
    pub(super) num_kv_heads: u32,
    pub(super) head_dim: u32,
    pub(super) block_size: u32,
    pub(super) num_blocks: u32,
    /// The decode kernel variant, and its shape (f32 activations).
    pub(super) kernel: Kernel,
    pub(super) decode_shape: ShaderShape,
    /// Built on first use, like prefill's: prefill-only callers never pay
    /// for the decode kernel's compile.
    pub(super) decode: std::sync::OnceLock<wgpu::ComputePipeline>,
    pub(super) reduce: wgpu::ComputePipeline,
    /// Built on first use: decode-only callers never pay for its compile
    /// (seconds per shape on software GL).
    pub(super) prefill: std::sync::OnceLock<wgpu::ComputePipeline>,
    pub(super) prefill_shape: ShaderShape,
    /// Bound in place of the split-K (max, sum) output when there is none,
    /// made once rather than per call.
    pub(super) unused_ml: wgpu::Buffer,
    /// Longest shared segment of a cascade pass on the rows kernel.
    pub(super) cascade_chunk: u32,
    /// Identifies this instance to the plans it makes.
    pub(super) id: u64,
}

/// How a [`PagedAttention`] is built: passed at construction, never read
/// from the environment (the CLI maps `PAGEDATTN_KERNEL` onto it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AttentionConfig {
    /// The decode kernel; `None`: the adapter's default (see [`Kernel`]).
    pub kernel: Option<Kernel>,
    /// Longest shared segment one cascade pass walks where the segment pass
    /// runs on GPUs (the rows kernel), in tokens: a multiple of 16 from 16
    /// to 4096; [`CASCADE_CHUNK_TOKENS`](super::CASCADE_CHUNK_TOKENS) by
    /// default (shorter segments helped small batches on an H200 and hurt
    /// large ones: `benches/NOTES.md` item 33).
    pub cascade_chunk_tokens: u32,
}

impl Default for AttentionConfig {
    fn default() -> Self {
        Self {
            kernel: None,
            cascade_chunk_tokens: super::CASCADE_CHUNK_TOKENS,
        }
    }
}

impl AttentionConfig {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// With the decode kernel `kernel`.
    pub fn kernel(mut self, kernel: Kernel) -> Self {
        self.kernel = Some(kernel);
        self
    }

    /// With cascade segments of at most `tokens` on the rows kernel.
    pub fn cascade_chunk_tokens(mut self, tokens: u32) -> Self {
        self.cascade_chunk_tokens = tokens;
        self
    }
}

impl PagedAttention {
    /// Builds the kernels for `num_heads` query heads over `cache`, with
    /// the adapter's default decode kernel (see [`Kernel`]): `serial` on
    /// software adapters, `lanes` elsewhere, `tiled` where neither fits.
    /// Nothing read from the environment or tuned elsewhere changes it: an
    /// engine passes its choice ([`with_kernel`](Self::with_kernel),
    /// [`with_config`](Self::with_config)) or builds through a
    /// [`Tuner`](super::Tuner).
    pub fn new(gpu: &Gpu, cache: &KvCache, num_heads: u32) -> Result<Self, GpuError> {
        Self::with_layout(gpu, cache, num_heads, true, &AttentionConfig::default())
    }

    /// The same built as `config` says (its kernel, its cascade segment
    /// length); `Unsupported` when its kernel cannot run this shape here.
    pub fn with_config(
        gpu: &Gpu,
        cache: &KvCache,
        num_heads: u32,
        config: &AttentionConfig,
    ) -> Result<Self, GpuError> {
        Self::with_layout(gpu, cache, num_heads, true, config)
    }

    /// The same with the decode kernel chosen by the caller (an engine that
    /// tuned itself); `Unsupported` when it cannot run this shape here.
    pub fn with_kernel(
        gpu: &Gpu,
        cache: &KvCache,
        num_heads: u32,
        kernel: Kernel,
    ) -> Result<Self, GpuError> {
        Self::with_layout(
            gpu,
            cache,
            num_heads,
            true,
            &AttentionConfig::new().kernel(kernel),
        )
    }

    /// The same kernels with `paged == false`: no per-token table lookup,
    /// each sequence's blocks assumed consecutive from its first table entry.
    /// A contiguous-KV baseline of the same design, for benchmarks.
    pub fn contiguous(gpu: &Gpu, cache: &KvCache, num_heads: u32) -> Result<Self, GpuError> {
        Self::with_layout(gpu, cache, num_heads, false, &AttentionConfig::default())
    }

    /// [`contiguous`](Self::contiguous) with a given decode kernel.
    pub fn contiguous_with_kernel(
        gpu: &Gpu,
        cache: &KvCache,
        num_heads: u32,
        kernel: Kernel,
    ) -> Result<Self, GpuError> {
        Self::with_layout(
            gpu,
            cache,
            num_heads,
            false,
            &AttentionConfig::new().kernel(kernel),
        )
    }

    /// The decode kernel variant in use.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// Workgroup memory (bytes) of the decode and the prefill kernels as
    /// built: both within [`PORTABLE_WORKGROUP_BYTES`](super::PORTABLE_WORKGROUP_BYTES)
    /// (WebGPU's default) on every shape.
    pub fn workgroup_bytes(&self) -> (u32, u32) {
        let decode = super::kernels::decode(self.kernel).workgroup_bytes(&self.decode_shape);
        (
            decode,
            super::kernels::tiled::workgroup_bytes(&self.prefill_shape),
        )
    }

    /// Query heads per pass of the decode kernel (a GQA group larger than
    /// this runs as several head tiles).
    pub fn decode_head_tile(&self) -> u32 {
        self.decode_shape.head_tile()
    }

    /// The variants that can run this shape on `gpu`.
    pub fn eligible_kernels(gpu: &Gpu, cache: &KvCache, num_heads: u32) -> Vec<Kernel> {
        let c = cache.config();
        if num_heads == 0 || c.num_kv_heads == 0 || !num_heads.is_multiple_of(c.num_kv_heads) {
            return Vec::new();
        }
        let base = Self::base_shape(c, num_heads, true);
        Kernel::ALL
            .into_iter()
            .filter(|&k| kernel::decode_shape(gpu, k, base).is_some())
            .collect()
    }

    pub(super) fn base_shape(c: &super::KvCacheConfig, num_heads: u32, paged: bool) -> ShaderShape {
        ShaderShape {
            head_dim: c.head_dim,
            group: num_heads / c.num_kv_heads,
            block_size: c.block_size,
            dtype: c.dtype,
            qtile: 1,
            paged,
            ..ShaderShape::default()
        }
    }

    fn with_layout(
        gpu: &Gpu,
        cache: &KvCache,
        num_heads: u32,
        paged: bool,
        config: &AttentionConfig,
    ) -> Result<Self, GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        // The attention kernels bind six storage buffers (q, K, V, tables,
        // out, split-K partials).
        gpu.require_limits(6)?;
        let c = cache.config();
        if num_heads == 0 || !num_heads.is_multiple_of(c.num_kv_heads) {
            return Err(GpuError::InvalidArgument(format!(
                "num_heads {num_heads} is not a positive multiple of num_kv_heads {}",
                c.num_kv_heads
            )));
        }
        // Reduce runs a workgroup per query head.
        let max_dim = gpu.limits.max_compute_workgroups_per_dimension;
        if num_heads > max_dim {
            return Err(GpuError::Unsupported(format!(
                "{num_heads} query heads: one dispatch dimension holds at most {max_dim} workgroups"
            )));
        }
        let base = Self::base_shape(c, num_heads, paged);
        let tiled =
            kernel::decode_shape(gpu, Kernel::Tiled, base).ok_or(GpuError::DeviceLimit {
                limit: "max_compute_workgroup_storage_size",
                needed: kernel::min_workgroup_bytes(&base) as u64,
                available: gpu.limits.max_compute_workgroup_storage_size as u64,
            })?;
        if c.num_kv_heads as u64 * tiled.head_tiles() as u64 > max_dim as u64 {
            return Err(GpuError::Unsupported(format!(
                "{} kv heads x {} head tiles: one dispatch dimension holds at most {max_dim} workgroups",
                c.num_kv_heads,
                tiled.head_tiles()
            )));
        }
        let chunk = config.cascade_chunk_tokens;
        if !(16..=4096).contains(&chunk) || !chunk.is_multiple_of(16) {
            return Err(GpuError::InvalidArgument(format!(
                "cascade_chunk_tokens {chunk}: a multiple of 16 from 16 to 4096"
            )));
        }
        let (kernel, strict) = match config.kernel {
            Some(k) => (k, true),
            None => (kernel::default_kernel(gpu), false),
        };
        let (kernel, decode_shape) = match kernel::decode_shape(gpu, kernel, base) {
            Some(s) => (kernel, s),
            None if !strict => (Kernel::Tiled, tiled),
            None => {
                return Err(GpuError::Unsupported(format!(
                    "the {kernel} kernel cannot run {} query heads over {} kv heads at head_dim {} \
                     on {} (workgroup memory); eligible: {:?}",
                    num_heads,
                    c.num_kv_heads,
                    c.head_dim,
                    gpu.info.name,
                    Self::eligible_kernels(gpu, cache, num_heads)
                )))
            }
        };
        // Prefill tiles stay within WebGPU's default workgroup memory too.
        let have = gpu
            .limits
            .max_compute_workgroup_storage_size
            .min(kernel::PORTABLE_WORKGROUP_BYTES);
        let qtile = super::kernels::tiled::prefill_qtile(&tiled, have);
        Ok(Self {
            cache_cfg: *c,
            num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: c.block_size,
            num_blocks: c.num_blocks,
            kernel,
            decode_shape,
            decode: std::sync::OnceLock::new(),
            reduce: pipeline(gpu, "reduce", &tiled)?,
            prefill: std::sync::OnceLock::new(),
            prefill_shape: ShaderShape { qtile, ..tiled },
            unused_ml: gpu.storage("unused split (max, sum)", 16)?,
            cascade_chunk: chunk,
            id: super::plan::next_id(),
        })
    }

    /// Partition tokens for a decode of `n` sequences whose longest holds
    /// `max_len` tokens under `split`, for this kernel and adapter: `0` for
    /// one pass per sequence.
    pub(super) fn decode_partition(&self, gpu: &Gpu, split: Split, n: u32, max_len: u32) -> u32 {
        match split {
            Split::Never => 0,
            Split::Tokens(t) => t,
            Split::Auto => {
                let passes =
                    n as u64 * self.num_kv_heads as u64 * self.decode_shape.head_tiles() as u64;
                kernel::auto_partition(
                    self.kernel,
                    passes,
                    max_len,
                    kernel::pass_cap(gpu, self.kernel, &self.decode_shape),
                )
            }
        }
    }

    /// Partition tokens for a prefill of `tiles` query tiles (0: unsplit).
    /// Split only under `Split::Auto`, and only when the output rows fit one
    /// dispatch dimension of the merge.
    pub(super) fn prefill_partition(
        &self,
        gpu: &Gpu,
        split: Split,
        tiles: u32,
        num_queries: u32,
        max_len: u32,
    ) -> u32 {
        if split != Split::Auto || num_queries > MAX_BATCH {
            return 0;
        }
        let passes =
            tiles as u64 * self.num_kv_heads as u64 * self.prefill_shape.head_tiles() as u64;
        kernel::auto_partition(
            Kernel::Tiled,
            passes,
            max_len,
            kernel::pass_cap(gpu, Kernel::Tiled, &self.prefill_shape),
        )
    }

    /// The most tokens one decode pass may walk here (`None`: no limit).
    pub(super) fn decode_pass_cap(&self, gpu: &Gpu) -> Option<u32> {
        kernel::pass_cap(gpu, self.kernel, &self.decode_shape)
    }

    /// The decode grid of `n` sequences in `parts` partitions.
    pub(super) fn decode_grid(&self, n: u32, parts: u32) -> Result<(u32, u32, u32), GpuError> {
        self.serial_grid(
            n,
            parts,
            shader::serial_workgroup_size(self.decode_shape.qtile),
        )
    }

    /// `decode_grid` with `per_wg` invocations per workgroup of the
    /// flattened (serial) kernel.
    pub(super) fn serial_grid(
        &self,
        n: u32,
        parts: u32,
        per_wg: u32,
    ) -> Result<(u32, u32, u32), GpuError> {
        let units = self.num_kv_heads * self.decode_shape.head_tiles();
        match super::kernels::decode(self.kernel).flat_grid() {
            false => Ok((n, units, parts)),
            true => {
                let total = n as u64 * units as u64 * parts as u64;
                if total > u32::MAX as u64 / 2 {
                    return Err(GpuError::InvalidArgument(format!(
                        "{total} decode passes in one dispatch (at most {})",
                        u32::MAX / 2
                    )));
                }
                let wgs = total.div_ceil(per_wg.max(1) as u64) as u32;
                let x = wgs.clamp(1, 65535);
                Ok((x, wgs.div_ceil(x).max(1), 1))
            }
        }
    }

    /// Queries per prefill workgroup (chosen from the adapter's workgroup memory).
    pub fn prefill_qtile(&self) -> u32 {
        self.prefill_shape.qtile
    }

    pub(super) fn decode_pipeline(&self, gpu: &Gpu) -> Result<&wgpu::ComputePipeline, GpuError> {
        let _serial = gpu.serial();
        if let Some(p) = self.decode.get() {
            return Ok(p);
        }
        let p = pipeline(gpu, self.kernel.shader(), &self.decode_shape)?;
        Ok(self.decode.get_or_init(|| p))
    }

    pub(super) fn prefill_pipeline(&self, gpu: &Gpu) -> Result<&wgpu::ComputePipeline, GpuError> {
        let _serial = gpu.serial();
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
    ) -> Result<params::AttnParams, GpuError> {
        let n = t.num_seqs;
        // The offsets of the packed layout; checked, since BatchTables'
        // fields are public and may not come from `pack`.
        let off = |parts: &[u32]| {
            parts
                .iter()
                .try_fold(0u32, |a, &b| a.checked_add(b))
                .ok_or_else(|| {
                    GpuError::InvalidArgument(format!(
                        "tables of {n} sequences and {} block ids overflow u32 offsets",
                        t.indices_len
                    ))
                })
        };
        off(&[n, 1])?;
        let indices_off = off(&[n, n, 1])?;
        let slopes_off = off(&[indices_off, t.indices_len])?;
        off(&[slopes_off, self.num_heads])?;
        let meta = PackedMeta {
            num_seqs: n,
            indices_len: t.indices_len,
            max_len: t.max_len,
            qo_off: t.qo_off,
            num_tiles: t.num_tiles,
            num_queries: t.num_queries,
        };
        Ok(self.params_for(o, &meta, partition_tokens, num_partitions, slopes_off, 0))
    }

    /// The uniform of one option set over packed tables described by
    /// `meta` (offsets already checked), for the host, encoder and plan paths.
    pub(super) fn params_for(
        &self,
        o: &AttnOptions,
        meta: &PackedMeta,
        partition_tokens: u32,
        num_partitions: u32,
        slopes_off: u32,
        q_stride4: u32,
    ) -> params::AttnParams {
        let n = meta.num_seqs;
        // A sliding window at least as long as every sequence masks
        // nothing: passed as "no window", so the kernels never add it to a
        // position (any u32 window is exact).
        let window = o
            .sliding_window
            .filter(|&w| w < meta.max_len.max(1))
            .unwrap_or(0);
        params::AttnParams {
            num_seqs: n,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            num_blocks: self.num_blocks,
            scale: o.scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt()),
            soft_cap: o.soft_cap.unwrap_or(0.0),
            sliding_window: window,
            alibi: o.alibi_slopes.is_some() as u32,
            partition_tokens,
            num_partitions,
            lens_off: n + 1,
            indices_off: 2 * n + 1,
            indices_len: meta.indices_len,
            slopes_off,
            qo_off: meta.qo_off,
            q_stride: q_stride4,
            ..Default::default()
        }
    }

    /// Checks what every call checks: the device is alive, `cache` is the
    /// shape these kernels were built for, the options are valid, and the
    /// ALiBi slopes packed in `tables` (if any) are the options' slopes.
    pub(super) fn check_call(
        &self,
        gpu: &Gpu,
        cache: &KvCache,
        opts: &AttnOptions,
        tables: Option<&BatchTables>,
    ) -> Result<(), GpuError> {
        gpu.alive()?;
        if cache.config() != &self.cache_cfg {
            return Err(GpuError::InvalidArgument(format!(
                "this PagedAttention was built for a cache of {:?}, but was given one of {:?}",
                self.cache_cfg,
                cache.config()
            )));
        }
        self.check_options(opts)?;
        if let Some(t) = tables {
            let same = match (&t.slopes, &opts.alibi_slopes) {
                (None, None) => true,
                (Some(a), Some(b)) => {
                    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                }
                _ => false,
            };
            if !same {
                return Err(GpuError::InvalidArgument(
                    "the ALiBi slopes packed in the tables differ from AttnOptions::alibi_slopes; \
                     pass the same slopes to BatchTables::upload and to the options"
                        .into(),
                ));
            }
            if t.max_len > MAX_SEQ_LEN {
                return Err(GpuError::InvalidArgument(format!(
                    "a sequence of {} tokens, over the limit of {MAX_SEQ_LEN}",
                    t.max_len
                )));
            }
        }
        Ok(())
    }

    /// On an adapter that ends long loops early (llvmpipe: 65535 loop
    /// iterations per invocation), refuses a pass over more tokens than it
    /// can finish (`cap`), instead of returning a silently wrong answer.
    pub(super) fn check_pass_tokens(
        &self,
        gpu: &Gpu,
        tokens: u32,
        what: &str,
        cap: Option<u32>,
    ) -> Result<(), GpuError> {
        match cap {
            Some(cap) if tokens > cap => Err(GpuError::Unsupported(format!(
                "{what} walks {tokens} tokens in one pass, but {} ends loops after 65535 \
                 iterations per invocation (at most {cap} tokens per pass for the {} kernel at \
                 head_dim {}): use Split::Auto or Split::Tokens({cap}) or less",
                gpu.info.name,
                if what == "decode" {
                    self.kernel
                } else {
                    Kernel::Tiled
                },
                self.head_dim
            ))),
            _ => Ok(()),
        }
    }

    /// Tokens per split-K partition that a decode of `n` sequences, the
    /// longest `max_len` tokens, uses under `split` with this kernel on
    /// `gpu` (0: one pass per sequence).
    pub fn partition_tokens(&self, gpu: &Gpu, split: Split, n: u32, max_len: u32) -> u32 {
        self.decode_partition(gpu, split, n, max_len)
    }

    /// Checks a prefill's pass and chooses its split: (partition tokens,
    /// partitions).
    pub(super) fn prefill_split(
        &self,
        gpu: &Gpu,
        split: Split,
        tiles: u32,
        num_queries: u32,
        max_len: u32,
    ) -> Result<(u32, u32), GpuError> {
        let pt = self.prefill_partition(gpu, split, tiles, num_queries, max_len);
        let cap = kernel::pass_cap(gpu, Kernel::Tiled, &self.prefill_shape);
        self.checked_split(gpu, pt, max_len, "prefill", cap)
    }

    /// Checks a decode's pass and chooses its split: (partition tokens,
    /// partitions).
    pub(super) fn decode_split(
        &self,
        gpu: &Gpu,
        split: Split,
        n: u32,
        max_len: u32,
    ) -> Result<(u32, u32), GpuError> {
        let pt = self.decode_partition(gpu, split, n, max_len);
        self.checked_split(gpu, pt, max_len, "decode", self.decode_pass_cap(gpu))
    }

    /// (partition tokens, partitions) for `pt` over `max_len` tokens, once
    /// each pass is known to fit the adapter's loop cap and the partitions
    /// one dispatch dimension.
    fn checked_split(
        &self,
        gpu: &Gpu,
        pt: u32,
        max_len: u32,
        what: &str,
        cap: Option<u32>,
    ) -> Result<(u32, u32), GpuError> {
        self.check_pass_tokens(
            gpu,
            if pt == 0 { max_len } else { pt.min(max_len) },
            what,
            cap,
        )?;
        if pt == 0 {
            return Ok((0, 1));
        }
        let parts = max_len.div_ceil(pt).max(1);
        if parts > 65535 {
            return Err(GpuError::InvalidArgument(format!(
                "{parts} partitions (at most 65535)"
            )));
        }
        Ok((pt, parts))
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
        let _serial = gpu.serial();
        self.check_call(gpu, cache, opts, Some(tables))?;
        let [k, v] = cache.layer(layer)?;
        if tables.qo_off == 0 {
            return Err(GpuError::InvalidArgument(
                "prefill given decode tables (use BatchTables::upload_prefill)".into(),
            ));
        }
        if tables.num_tiles == 0 {
            return Ok(());
        }
        if tables.num_tiles > MAX_BATCH {
            return Err(GpuError::InvalidArgument(format!(
                "{} query tiles in one prefill (at most {MAX_BATCH}; split the batch)",
                tables.num_tiles
            )));
        }
        let nq = tables.num_queries;
        let (pt, parts) =
            self.prefill_split(gpu, opts.split, tables.num_tiles, nq, tables.max_len)?;
        let prefill = self.prefill_pipeline(gpu)?;
        let p = self.attn_params(tables, opts, pt, parts)?;
        let ub = gpu.uniform("prefill params", &p)?;
        let units = self.num_kv_heads * self.prefill_shape.head_tiles();
        if pt == 0 {
            let dummy = &self.unused_ml;
            let bg = bind(gpu, prefill, &[&ub, q, k, v, &tables.buffer, out, dummy]);
            dispatch(enc, "prefill", prefill, &bg, (tables.num_tiles, units, 1));
            return Ok(());
        }
        // Split-KV: f32 partials per (query row, head, partition), merged by reduce.
        let rows = nq as u64 * self.num_heads as u64 * parts as u64;
        let acc = gpu.storage("prefill split acc", rows * self.head_dim as u64 * 4)?;
        let ml = gpu.storage("prefill split ml", rows * 8)?;
        let bg = bind(gpu, prefill, &[&ub, q, k, v, &tables.buffer, &acc, &ml]);
        dispatch(
            enc,
            "prefill split",
            prefill,
            &bg,
            (tables.num_tiles, units, parts),
        );
        let bg = bind(gpu, &self.reduce, &[&ub, &acc, &ml, out]);
        dispatch(enc, "reduce", &self.reduce, &bg, (nq, self.num_heads, 1));
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
        let _serial = gpu.serial();
        self.check_call(gpu, cache, opts, None)?;
        cache.layer(layer)?;
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
        let row = self.num_heads as usize * self.head_dim as usize;
        let nq = qo_indptr[n] as usize;
        if nq.checked_mul(row) != Some(q.len()) {
            return bad(format!(
                "q has {} floats; {nq} queries x {row} need {}",
                q.len(),
                nq as u128 * row as u128
            ));
        }
        if nq == 0 {
            return Ok(Vec::new());
        }
        let bytes = (q.len() * 4) as u64;
        let tables = PackedTables::pack(
            kv_indptr,
            kv_indices,
            seq_lens,
            opts.alibi_slopes.as_deref(),
            Some((qo_indptr, self.prefill_shape.qtile)),
        )?;
        self.prefill_split(gpu, opts.split, tables.num_tiles, nq as u32, tables.max_len)?;
        let out = gpu.scoped_try(|| {
            let out = gpu.storage("prefill out", bytes)?;
            // Poisoned, so a kernel that skips a write cannot pass.
            gpu.queue
                .write_buffer(&out, 0, bytemuck::cast_slice(&vec![f32::NAN; q.len()]));
            let tables = BatchTables::from_packed(gpu, tables)?;
            let qb = gpu.storage_init("q", q)?;
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            self.encode_prefill(gpu, &mut enc, cache, layer, &qb, &tables, &out, opts)?;
            gpu.queue.submit([enc.finish()]);
            Ok(out)
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

    pub(super) fn check_options(&self, o: &AttnOptions) -> Result<(), GpuError> {
        o.validate(self.num_heads)
            .map_err(GpuError::InvalidArgument)
    }

    /// Records decode into `enc`: `q` holds `[num_seqs][num_heads][head_dim]`
    /// f32, `out` receives the same shape. Split partials go to scratch
    /// buffers allocated here. With [`Cascade::On`](super::Cascade::On), or
    /// `Auto` where the cost model says it pays, and tables whose sequences
    /// share prefixes (checked against the pool), shared prefixes are read
    /// once: the call goes through a one-step plan, as the host
    /// [`decode`](Self::decode) does (see [`plan_decode`](Self::plan_decode)).
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
        let _serial = gpu.serial();
        self.check_call(gpu, cache, opts, Some(tables))?;
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
        if n > MAX_BATCH {
            return Err(GpuError::InvalidArgument(format!(
                "{n} sequences in one decode (at most {MAX_BATCH})"
            )));
        }
        if opts.cascade != super::Cascade::Off {
            if let Some(mut plan) = self.cascade_plan(gpu, tables, opts)? {
                return self.run(
                    gpu,
                    enc,
                    &mut plan,
                    cache,
                    layer,
                    0,
                    &q.as_entire_buffer_binding(),
                    &out.as_entire_buffer_binding(),
                );
            }
        }
        let (pt, parts) = self.decode_split(gpu, opts.split, n, tables.max_len)?;
        let d4 = self.head_dim as u64 / 4;
        let decode = self.decode_pipeline(gpu)?;
        if pt == 0 {
            let grid = self.decode_grid(n, 1)?;
            let p = self.attn_params(tables, opts, 0, 1)?;
            let ub = gpu.uniform("decode params", &p)?;
            let dummy = &self.unused_ml;
            let bg = bind(gpu, decode, &[&ub, q, k, v, &tables.buffer, out, dummy]);
            dispatch(enc, "decode", decode, &bg, grid);
            return Ok(());
        }
        let grid = self.decode_grid(n, parts)?;
        let p = self.attn_params(tables, opts, pt, parts)?;
        let ub = gpu.uniform("decode params", &p)?;
        let rows = n as u64 * self.num_heads as u64 * parts as u64;
        let acc = gpu.storage("split acc", rows * d4 * 16)?;
        let ml = gpu.storage("split ml", rows * 8)?;
        let bg = bind(gpu, decode, &[&ub, q, k, v, &tables.buffer, &acc, &ml]);
        dispatch(enc, "decode split", decode, &bg, grid);
        let bg = bind(gpu, &self.reduce, &[&ub, &acc, &ml, out]);
        dispatch(enc, "reduce", &self.reduce, &bg, (n, self.num_heads, 1));
        Ok(())
    }

    /// A one-step plan for decode tables whose sequences share blocks, when
    /// it runs the cascade; `None` for tables without host words, tables the
    /// pool check refuses (the plain path skips bad entries instead), no
    /// two sequences starting on one block, or a plan that stays plain.
    fn cascade_plan(
        &self,
        gpu: &Gpu,
        tables: &BatchTables,
        opts: &AttnOptions,
    ) -> Result<Option<super::AttentionPlan>, GpuError> {
        let Some(w) = &tables.host else {
            return Ok(None);
        };
        let n = tables.num_seqs as usize;
        let m = tables.indices_len as usize;
        let (Some(ip), Some(ln), Some(ix)) = (
            w.get(..n + 1),
            w.get(n + 1..2 * n + 1),
            w.get(2 * n + 1..2 * n + 1 + m),
        ) else {
            return Ok(None);
        };
        if self.check_tables(ip, ix, ln).is_err() {
            return Ok(None);
        }
        let mut firsts: Vec<u32> = (0..n)
            .filter(|&s| ip[s] < ip[s + 1])
            .map(|s| ix[ip[s] as usize])
            .collect();
        firsts.sort_unstable();
        if !firsts.windows(2).any(|p| p[0] == p[1]) {
            return Ok(None);
        }
        let mut plan = self.plan();
        self.plan_decode(
            gpu,
            &mut plan,
            &super::DecodeTables {
                kv_indptr: ip,
                kv_indices: ix,
                seq_lens: ln,
            },
            std::slice::from_ref(opts),
        )?;
        Ok(plan.cascade().is_some().then_some(plan))
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
        let _serial = gpu.serial();
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
        self.check_call(gpu, cache, opts, None)?;
        cache.layer(layer)?;
        self.check_tables(kv_indptr, kv_indices, seq_lens)?;
        let n = seq_lens.len();
        let row = self.num_heads as usize * self.head_dim as usize;
        if n.checked_mul(row) != Some(q.len()) {
            return Err(GpuError::InvalidArgument(format!(
                "q has {} floats; {n} sequences x {} heads x {} need {}",
                q.len(),
                self.num_heads,
                self.head_dim,
                n * row
            )));
        }
        let bytes = (q.len() * 4) as u64;
        let out = gpu.storage("decode out", bytes)?;
        // Poison the output so a kernel that skips a write cannot pass.
        gpu.queue.write_buffer(
            &out,
            0,
            bytemuck::cast_slice(&vec![f32::NAN; q.len().max(4)]),
        );
        if n == 0 {
            return Ok((out, 0));
        }
        // Through a one-step plan, so host calls get what plans get (the
        // cascade over shared prefixes included).
        let mut plan = self.plan();
        self.plan_decode(
            gpu,
            &mut plan,
            &super::DecodeTables {
                kv_indptr,
                kv_indices,
                seq_lens,
            },
            std::slice::from_ref(opts),
        )?;
        let qb = gpu.storage_init("q", q)?;
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        self.run(
            gpu,
            &mut enc,
            &mut plan,
            cache,
            layer,
            0,
            &qb.as_entire_buffer_binding(),
            &out.as_entire_buffer_binding(),
        )?;
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
        if seq_lens[s] > MAX_SEQ_LEN {
            return Err(format!(
                "sequence {s} holds {} tokens, over the limit of {MAX_SEQ_LEN}",
                seq_lens[s]
            ));
        }
    }
    if n > MAX_BATCH as usize {
        return Err(format!("{n} sequences in one batch (at most {MAX_BATCH})"));
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
