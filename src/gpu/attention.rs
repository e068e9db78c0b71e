//! Paged attention kernels on the GPU: decode (one query per sequence), with
//! an optional split-K path (partitions merged by `reduce`).

use super::cascade::{Cascade, CASCADE_CHUNK_TOKENS};
use super::compose::ShaderShape;
use super::context::Gpu;
use super::error::{BatchError, GpuError, OptionError, ShapeError};
use super::kernel::{Kernel, PORTABLE_WORKGROUP_BYTES};
use super::kernels::{self, serial};
use super::kv_cache::{KvCache, KvCacheConfig};
use super::params;
use super::pass::{next_id, pipeline};

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
    /// Attention sink logit per query head (gpt-oss): `exp(sink)` joins
    /// the softmax denominator and adds no value. In the units of the
    /// scaled scores; applied once per query row, where the partials are
    /// merged (a plan with sinks always writes partials), so split-K, the
    /// cascade and prefill all take it.
    pub sinks: Option<Vec<f32>>,
    /// StreamingLLM: the first `k` positions stay visible beside the
    /// sliding window (which it needs). The blocks between may be released
    /// ([`crate::blocks::BlockManager::release_outside_sinks_and_window`]):
    /// their table entries stay, as [`crate::blocks::RELEASED`], so
    /// positions stay right. Decode and prefill on every kernel; `Auto`
    /// takes no cascade with it.
    pub sink_tokens: Option<u32>,
    /// Split-K policy.
    pub split: Split,
    /// Shared prefixes read once (cascade decode; plan/run API, decode
    /// only). A plan uses the cascade for all its variants, or for none:
    /// none if any variant says `Off`; else when some variant says `On` and
    /// the batch shares a segment, or under `Auto` when the cost model pays.
    pub cascade: Cascade,
}

impl AttnOptions {
    /// Checks the options for `num_heads` query heads; the message says
    /// what is wrong. Shared by every backend's host path.
    pub fn validate(&self, num_heads: u32) -> Result<(), OptionError> {
        if let Split::Tokens(t) = self.split {
            if t == 0 || !t.is_multiple_of(64) {
                return Err(OptionError::Partition(t));
            }
        }
        if let Some(s) = &self.alibi_slopes {
            if s.len() != num_heads as usize {
                return Err(OptionError::SlopeCount {
                    slopes: s.len() as u64,
                    heads: num_heads,
                });
            }
            if let Some((h, &x)) = s.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                return Err(OptionError::Slope {
                    head: h as u32,
                    value: x,
                });
            }
        }
        if let Some(s) = &self.sinks {
            if s.len() != num_heads as usize {
                return Err(OptionError::SinkCount {
                    sinks: s.len() as u64,
                    heads: num_heads,
                });
            }
            if let Some((h, &x)) = s.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                return Err(OptionError::Sink {
                    head: h as u32,
                    value: x,
                });
            }
        }
        if let Some(x) = self.scale.filter(|x| !x.is_finite()) {
            return Err(OptionError::Scale(x));
        }
        if let Some(c) = self.soft_cap.filter(|c| !c.is_finite() || *c <= 0.0) {
            return Err(OptionError::SoftCap(c));
        }
        if self.sliding_window == Some(0) {
            return Err(OptionError::ZeroWindow);
        }
        if let Some(k) = self.sink_tokens {
            if k == 0 || self.sliding_window.is_none() {
                return Err(OptionError::SinkTokens(k));
            }
            if self.cascade == Cascade::On {
                return Err(OptionError::CascadeWithSinkTokens);
            }
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
/// A plan packs its tables this way into a buffer it reuses.
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
    let n = seq_lens.len();
    if n > MAX_BATCH as usize {
        return Err(BatchError::TooManySeqs {
            seqs: n as u64,
            limit: MAX_BATCH,
        }
        .into());
    }
    if let Some((s, &l)) = seq_lens.iter().enumerate().find(|(_, &l)| l > MAX_SEQ_LEN) {
        return Err(BatchError::TooLong {
            seq: s as u32,
            tokens: l,
            limit: MAX_SEQ_LEN,
        }
        .into());
    }
    if let Some((h, &x)) = slopes.and_then(|s| s.iter().enumerate().find(|(_, x)| !x.is_finite())) {
        return Err(OptionError::Slope {
            head: h as u32,
            value: x,
        }
        .into());
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
        return Err(BatchError::Offsets {
            indices: kv_indices.len() as u64,
            slopes: slopes_len as u64,
        }
        .into());
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
            return Err(BatchError::TooManyTiles {
                tiles,
                qtile,
                limit: MAX_BATCH,
            }
            .into());
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

/// Decode kernels specialised for one cache shape and head count.
pub struct PagedAttention {
    /// The cache shape the kernels were built for.
    pub(super) cache_cfg: KvCacheConfig,
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
    /// to 4096; [`CASCADE_CHUNK_TOKENS`](CASCADE_CHUNK_TOKENS) by
    /// default (shorter segments helped small batches on an H200 and hurt
    /// large ones: `benches/NOTES.md` item 33).
    pub cascade_chunk_tokens: u32,
    /// Whether the attention kernels are built with wgpu's shader runtime
    /// checks ([`ShaderChecks`]).
    pub shader_checks: ShaderChecks,
    /// The `stream` kernel's tokens per lane group per step (1, 2 or 4);
    /// 0: its default, shrunk to fit the device.
    pub stream_unroll: u32,
    /// The `stream` kernel's invocations per workgroup (64, 128 or 256);
    /// 0: its default, shrunk to fit the device.
    pub stream_workgroup: u32,
}

/// Whether attention kernels are built with wgpu's shader runtime checks:
/// index clamping, loop bounding (a 64-bit counter and an extra exit test
/// in every loop) and integer division checks. Trusted modules skip them
/// (`create_shader_module_trusted`). That is sound here because every
/// table and argument is validated on the host before any dispatch, and
/// the kernels keep their own `INVALID` tests for table entries past the
/// pool; wgpu's Vulkan backend keeps the driver's robust buffer access
/// either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ShaderChecks {
    /// Trusted on native hardware adapters; checked on software adapters
    /// (llvmpipe, SwiftShader, WARP: there the checks cost little, `serial`
    /// 1.05x, and one unexplained crash in a cold run is not ruled out:
    /// `benches/NOTES.md` item 64) and in the browser (where wgpu has no
    /// trusted modules).
    #[default]
    Auto,
    /// wgpu's checks in every kernel.
    Checked,
    /// No runtime checks (native only; the browser stays checked).
    Trusted,
}

impl ShaderChecks {
    /// Whether kernels are built trusted under this choice on `gpu`.
    pub fn trusted_on(self, gpu: &Gpu) -> bool {
        !cfg!(target_arch = "wasm32")
            && match self {
                ShaderChecks::Trusted => true,
                ShaderChecks::Checked => false,
                ShaderChecks::Auto => !gpu.is_software(),
            }
    }
}

impl Default for AttentionConfig {
    fn default() -> Self {
        Self {
            kernel: None,
            cascade_chunk_tokens: CASCADE_CHUNK_TOKENS,
            shader_checks: ShaderChecks::Auto,
            stream_unroll: 0,
            stream_workgroup: 0,
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

    /// With the attention kernels' shader runtime checks as `checks` says.
    pub fn shader_checks(mut self, checks: ShaderChecks) -> Self {
        self.shader_checks = checks;
        self
    }

    /// With the `stream` kernel's step: `unroll` tokens per lane group
    /// (1, 2, 4) and `workgroup` invocations (64, 128, 256); 0 leaves either
    /// to the kernel. A step the device cannot run is refused by
    /// [`PagedAttention::with_config`].
    pub fn stream_step(mut self, unroll: u32, workgroup: u32) -> Self {
        self.stream_unroll = unroll;
        self.stream_workgroup = workgroup;
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
    /// length); `GpuError::Shape` when its kernel cannot run this shape here.
    pub fn with_config(
        gpu: &Gpu,
        cache: &KvCache,
        num_heads: u32,
        config: &AttentionConfig,
    ) -> Result<Self, GpuError> {
        Self::with_layout(gpu, cache, num_heads, true, config)
    }

    /// The same with the decode kernel chosen by the caller (an engine that
    /// tuned itself); `GpuError::Shape` when it cannot run this shape here.
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

    /// The kernels `config` says with `paged == false`: no per-token table
    /// lookup, each sequence's blocks assumed consecutive from its first
    /// table entry. A contiguous-KV baseline of the same design, for the
    /// bench's paged / contiguous ratio.
    pub fn contiguous(
        gpu: &Gpu,
        cache: &KvCache,
        num_heads: u32,
        config: &AttentionConfig,
    ) -> Result<Self, GpuError> {
        Self::with_layout(gpu, cache, num_heads, false, config)
    }

    /// The decode kernel variant in use.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// The decode kernel's WGSL file and the shape it was built at (for
    /// tools that compile the same source elsewhere: `pagedattn
    /// pipeline-stats`).
    #[doc(hidden)]
    pub fn decode_shader(&self) -> (&'static str, ShaderShape) {
        (kernels::decode(self.kernel).shader(), self.decode_shape)
    }

    /// Workgroup memory (bytes) of the decode and the prefill kernels as
    /// built: both within [`PORTABLE_WORKGROUP_BYTES`](super::PORTABLE_WORKGROUP_BYTES)
    /// (WebGPU's default) on every shape.
    pub fn workgroup_bytes(&self) -> (u32, u32) {
        let decode = kernels::decode(self.kernel).workgroup_bytes(&self.decode_shape);
        (decode, kernels::tiled::workgroup_bytes(&self.prefill_shape))
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
            .filter(|&k| kernels::decode_shape(gpu, k, base).is_some())
            .collect()
    }

    pub(super) fn base_shape(c: &KvCacheConfig, num_heads: u32, paged: bool) -> ShaderShape {
        ShaderShape {
            head_dim: c.head_dim,
            group: num_heads / c.num_kv_heads,
            block_size: c.block_size,
            dtype: c.dtype,
            paged,
            ..ShaderShape::default()
        }
    }

    /// `base_shape` as `config` builds it: its checks and stream step.
    pub(super) fn config_shape(
        gpu: &Gpu,
        c: &KvCacheConfig,
        num_heads: u32,
        paged: bool,
        config: &AttentionConfig,
    ) -> ShaderShape {
        ShaderShape {
            trusted: config.shader_checks.trusted_on(gpu),
            unroll: config.stream_unroll,
            workgroup: config.stream_workgroup,
            ..Self::base_shape(c, num_heads, paged)
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
            return Err(ShapeError::HeadRatio {
                heads: num_heads,
                kv_heads: c.num_kv_heads,
            }
            .into());
        }
        // Reduce runs a workgroup per query head.
        let max_dim = gpu.limits.max_compute_workgroups_per_dimension;
        if num_heads > max_dim {
            return Err(ShapeError::Dispatch {
                what: "query heads",
                count: num_heads as u64,
                limit: max_dim,
            }
            .into());
        }
        let base = Self::config_shape(gpu, c, num_heads, paged, config);
        let tiled =
            kernels::decode_shape(gpu, Kernel::Tiled, base).ok_or(GpuError::DeviceLimit {
                limit: "max_compute_workgroup_storage_size",
                needed: kernels::min_workgroup_bytes(&base) as u64,
                available: gpu.limits.max_compute_workgroup_storage_size as u64,
            })?;
        if c.num_kv_heads as u64 * tiled.head_tiles() as u64 > max_dim as u64 {
            return Err(ShapeError::Dispatch {
                what: "kv heads x head tiles",
                count: c.num_kv_heads as u64 * tiled.head_tiles() as u64,
                limit: max_dim,
            }
            .into());
        }
        let chunk = config.cascade_chunk_tokens;
        if !(16..=4096).contains(&chunk) || !chunk.is_multiple_of(16) {
            return Err(ShapeError::CascadeChunk(chunk).into());
        }
        let (kernel, strict) = match config.kernel {
            Some(k) => (k, true),
            None => (kernels::default_kernel(gpu), false),
        };
        let (kernel, decode_shape) = match kernels::decode_shape(gpu, kernel, base) {
            Some(s) => (kernel, s),
            None if !strict => (Kernel::Tiled, tiled),
            None => {
                return Err(ShapeError::Kernel {
                    kernel,
                    heads: num_heads,
                    kv_heads: c.num_kv_heads,
                    head_dim: c.head_dim,
                    adapter: gpu.info.name.clone(),
                    eligible: Self::eligible_kernels(gpu, cache, num_heads),
                }
                .into())
            }
        };
        // Prefill tiles stay within WebGPU's default workgroup memory too.
        let have = gpu
            .limits
            .max_compute_workgroup_storage_size
            .min(PORTABLE_WORKGROUP_BYTES);
        let qtile = kernels::tiled::prefill_qtile(&tiled, have);
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
            id: next_id(),
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
                kernels::auto_partition(
                    self.kernel,
                    &self.decode_shape,
                    passes,
                    max_len,
                    kernels::pass_cap(gpu, self.kernel, &self.decode_shape),
                    gpu.compute_units().map(|u| u.count),
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
        // Prefill keeps the fixed target: its query tiles are the work.
        kernels::auto_partition(
            Kernel::Tiled,
            &self.prefill_shape,
            passes,
            max_len,
            kernels::pass_cap(gpu, Kernel::Tiled, &self.prefill_shape),
            None,
        )
    }

    /// The most tokens one decode pass may walk here (`None`: no limit).
    pub(super) fn decode_pass_cap(&self, gpu: &Gpu) -> Option<u32> {
        kernels::pass_cap(gpu, self.kernel, &self.decode_shape)
    }

    /// The decode grid of `n` sequences in `parts` partitions.
    pub(super) fn decode_grid(&self, n: u32, parts: u32) -> Result<(u32, u32, u32), GpuError> {
        self.serial_grid(n, parts, serial::workgroup_size(self.decode_shape.qtile))
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
        match kernels::decode(self.kernel).flat_grid() {
            false => Ok((n, units, parts)),
            true => {
                let total = n as u64 * units as u64 * parts as u64;
                if total > u32::MAX as u64 / 2 {
                    return Err(BatchError::Dispatch {
                        what: "decode passes",
                        count: total,
                        limit: u32::MAX as u64 / 2,
                    }
                    .into());
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
        let p = pipeline(
            gpu,
            kernels::decode(self.kernel).shader(),
            &self.decode_shape,
        )?;
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
            // Only with a window: without one every position is visible.
            sink_tokens: if window != 0 {
                o.sink_tokens.unwrap_or(0)
            } else {
                0
            },
            ..Default::default()
        }
    }

    /// Checks what every run checks: the device is alive and `cache` is
    /// the shape these kernels were built for.
    pub(super) fn check_cache(&self, gpu: &Gpu, cache: &KvCache) -> Result<(), GpuError> {
        gpu.alive()?;
        if cache.config() != &self.cache_cfg {
            return Err(ShapeError::OtherCache {
                built: format!("{:?}", self.cache_cfg),
                given: format!("{:?}", cache.config()),
            }
            .into());
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
        what: &'static str,
        cap: Option<u32>,
    ) -> Result<(), GpuError> {
        match cap {
            Some(cap) if tokens > cap => Err(GpuError::PassTooLong {
                what,
                tokens,
                cap,
                adapter: gpu.info.name.clone(),
                kernel: if what == "decode" {
                    self.kernel
                } else {
                    Kernel::Tiled
                },
                head_dim: self.head_dim,
            }),
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
        let cap = kernels::pass_cap(gpu, Kernel::Tiled, &self.prefill_shape);
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
        what: &'static str,
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
            return Err(BatchError::Dispatch {
                what: "partitions",
                count: parts as u64,
                limit: 65535,
            }
            .into());
        }
        Ok((pt, parts))
    }

    /// Checks host-side CSR tables against the pool and the batch
    /// ([`check_csr_tables`] with this kernel's pool).
    pub(crate) fn check_tables(
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
        .map_err(GpuError::from)
    }

    pub(super) fn check_options(&self, o: &AttnOptions) -> Result<(), GpuError> {
        o.validate(self.num_heads).map_err(GpuError::from)
    }
}

/// Checks CSR block tables for a pool of `num_blocks` blocks of `block_size`
/// tokens: `kv_indptr` has one entry more than `seq_lens`, starts at 0,
/// never decreases and ends at `kv_indices.len()`; each sequence's table
/// covers its length; every entry is in the pool or [`RELEASED`](crate::blocks::RELEASED).
/// The error says what is wrong. Shared by every backend's host path.
pub fn check_csr_tables(
    num_blocks: u32,
    block_size: u32,
    kv_indptr: &[u32],
    kv_indices: &[u32],
    seq_lens: &[u32],
) -> Result<(), BatchError> {
    let n = seq_lens.len();
    if kv_indptr.len() != n + 1 {
        return Err(BatchError::IndptrLength {
            entries: kv_indptr.len() as u64,
            seqs: n as u64,
        });
    }
    if kv_indptr[0] != 0
        || kv_indptr.windows(2).any(|w| w[0] > w[1])
        || kv_indptr[n] as usize != kv_indices.len()
    {
        return Err(BatchError::IndptrOrder {
            indices: kv_indices.len() as u64,
        });
    }
    for s in 0..n {
        let blocks = (kv_indptr[s + 1] - kv_indptr[s]) as u64;
        if seq_lens[s] as u64 > blocks * block_size as u64 {
            return Err(BatchError::ShortTable {
                seq: s as u32,
                tokens: seq_lens[s],
                blocks,
            });
        }
        if seq_lens[s] > MAX_SEQ_LEN {
            return Err(BatchError::TooLong {
                seq: s as u32,
                tokens: seq_lens[s],
                limit: MAX_SEQ_LEN,
            });
        }
    }
    if n > MAX_BATCH as usize {
        return Err(BatchError::TooManySeqs {
            seqs: n as u64,
            limit: MAX_BATCH,
        });
    }
    // RELEASED marks a block a sliding window dropped: skipped by the kernels.
    if let Some(&b) = kv_indices
        .iter()
        .find(|&&b| b >= num_blocks && b != crate::blocks::RELEASED)
    {
        return Err(BatchError::BlockOutsidePool {
            block: b,
            blocks: num_blocks,
        });
    }
    Ok(())
}
