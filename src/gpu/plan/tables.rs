//! The tables a step is planned from: decode, prefill, and the one shape
//! the planner takes both in.

/// Decode tables, from a batch view: sequence `i` owns
/// `kv_indices[kv_indptr[i]..kv_indptr[i + 1]]`, holds `seq_lens[i]` tokens
/// (its new token included), and has one query, at position
/// `seq_lens[i] - 1`.
#[derive(Clone, Copy, Debug)]
pub struct DecodeTables<'a> {
    /// `num_seqs + 1` offsets into `kv_indices`.
    pub kv_indptr: &'a [u32],
    /// Physical block ids.
    pub kv_indices: &'a [u32],
    /// Tokens held by each sequence, the new one included.
    pub seq_lens: &'a [u32],
}

impl<'a> DecodeTables<'a> {
    /// The decode tables of a batch view.
    pub fn from_view(v: &'a crate::blocks::BatchView) -> Self {
        Self {
            kv_indptr: &v.kv_indptr,
            kv_indices: &v.kv_indices,
            seq_lens: &v.seq_lens,
        }
    }
}

/// Prefill tables (chunked prefill, and mixed steps): sequence `i` has
/// queries `qo_indptr[i]..qo_indptr[i + 1]`, its newest positions (a chunk
/// of `qo_len` tokens at positions `seq_lens[i] - qo_len ..`), which attend
/// causally to its whole paged context including the chunk.
#[derive(Clone, Copy, Debug)]
pub struct PrefillTables<'a> {
    /// `num_seqs + 1` offsets into `kv_indices`.
    pub kv_indptr: &'a [u32],
    /// Physical block ids.
    pub kv_indices: &'a [u32],
    /// Tokens held by each sequence, the chunk included.
    pub seq_lens: &'a [u32],
    /// `num_seqs + 1` offsets into the query rows.
    pub qo_indptr: &'a [u32],
}

impl<'a> PrefillTables<'a> {
    /// The prefill tables of a batch view: the queries are the tokens each
    /// sequence gained since its previous view (`new_indptr`), so a view
    /// mixing new prompts (or chunks) and decodes is one prefill.
    pub fn from_view(v: &'a crate::blocks::BatchView) -> Self {
        Self {
            kv_indptr: &v.kv_indptr,
            kv_indices: &v.kv_indices,
            seq_lens: &v.seq_lens,
            qo_indptr: &v.new_indptr,
        }
    }
}

/// A step's tables as `plan_any` takes them: decode without `qo_indptr`.
pub(in crate::gpu) struct StepTables<'a> {
    pub(in crate::gpu) kv_indptr: &'a [u32],
    pub(in crate::gpu) kv_indices: &'a [u32],
    pub(in crate::gpu) seq_lens: &'a [u32],
    pub(in crate::gpu) qo_indptr: Option<&'a [u32]>,
}

impl<'a> StepTables<'a> {
    pub(in crate::gpu) fn decode(
        kv_indptr: &'a [u32],
        kv_indices: &'a [u32],
        seq_lens: &'a [u32],
    ) -> Self {
        Self {
            kv_indptr,
            kv_indices,
            seq_lens,
            qo_indptr: None,
        }
    }
}
