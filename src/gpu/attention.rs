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
    let (mut qo_off, mut num_tiles) = (0u32, 0u32);
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
    }
    Ok(PackedMeta {
        num_seqs: n as u32,
        indices_len: kv_indices.len() as u32,
        max_len: seq_lens.iter().copied().max().unwrap_or(0),
        qo_off,
        num_tiles,
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
            num_seqs: p.num_seqs,
            indices_len: p.indices_len,
            max_len: p.max_len,
            slopes: p.slopes,
            qo_off: p.qo_off,
            num_tiles: p.num_tiles,
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
    pub(super) decode: wgpu::ComputePipeline,
    pub(super) reduce: wgpu::ComputePipeline,
    /// Built on first use: decode-only callers never pay for its compile
    /// (seconds per shape on software GL).
    pub(super) prefill: std::sync::OnceLock<wgpu::ComputePipeline>,
    pub(super) prefill_shape: ShaderShape,
    /// Bound in place of the split-K (max, sum) output when there is none,
    /// made once rather than per call.
    pub(super) unused_ml: wgpu::Buffer,
    /// Identifies this instance to the plans it makes.
    pub(super) id: u64,
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
        let _serial = gpu.serial();
        gpu.alive()?;
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
            q_f16: false,
            out_f16: false,
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
            cache_cfg: *c,
            num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: c.block_size,
            num_blocks: c.num_blocks,
            decode: pipeline(gpu, "attention", &shape)?,
            reduce: pipeline(gpu, "reduce", &shape)?,
            prefill: std::sync::OnceLock::new(),
            prefill_shape: ShaderShape { qtile, ..shape },
            unused_ml: gpu.storage("unused split (max, sum)", 16)?,
            id: super::plan::next_id(),
        })
    }

    /// Queries per prefill workgroup (chosen from the adapter's workgroup memory).
    pub fn prefill_qtile(&self) -> u32 {
        self.prefill_shape.qtile
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
    /// can finish, instead of returning a silently wrong answer.
    pub(super) fn check_pass_tokens(
        &self,
        gpu: &Gpu,
        tokens: u32,
        what: &str,
    ) -> Result<(), GpuError> {
        match gpu.max_tokens_per_pass(self.head_dim) {
            Some(cap) if tokens > cap => Err(GpuError::Unsupported(format!(
                "{what} walks {tokens} tokens in one pass, but {} ends loops after 65535 \
                 iterations per invocation (at most {cap} tokens per pass at head_dim {}): \
                 use Split::Auto or Split::Tokens({cap}) or less for decode; split the \
                 context of a prefill",
                gpu.info.name, self.head_dim
            ))),
            _ => Ok(()),
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
        self.check_pass_tokens(gpu, tables.max_len, "prefill")?;
        let prefill = self.prefill_pipeline(gpu)?;
        let p = self.attn_params(tables, opts, 0, 1)?;
        let ub = gpu.uniform("prefill params", &p)?;
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
        self.check_pass_tokens(gpu, tables.max_len, "prefill")?;
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
        let pt = opts.split.choose(n, self.num_kv_heads, tables.max_len);
        self.check_pass_tokens(
            gpu,
            if pt == 0 {
                tables.max_len
            } else {
                pt.min(tables.max_len)
            },
            "decode",
        )?;
        let d4 = self.head_dim as u64 / 4;
        if pt == 0 {
            let p = self.attn_params(tables, opts, 0, 1)?;
            let ub = gpu.uniform("decode params", &p)?;
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
        let p = self.attn_params(tables, opts, pt, parts)?;
        let ub = gpu.uniform("decode params", &p)?;
        let rows = n as u64 * self.num_heads as u64 * parts as u64;
        let acc = gpu.storage("split acc", rows * d4 * 16)?;
        let ml = gpu.storage("split ml", rows * 8)?;
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
        let tables = BatchTables::upload(
            gpu,
            kv_indptr,
            kv_indices,
            seq_lens,
            opts.alibi_slopes.as_deref(),
        )?;
        let qb = gpu.storage_init("q", q)?;
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
