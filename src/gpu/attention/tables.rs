//! Block tables as the kernels read them: packed on the host and checked.

use super::*;

impl PagedAttention {
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
}

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
