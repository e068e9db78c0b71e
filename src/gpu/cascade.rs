//! Cascade decode: shared prefixes read once for every query that shares
//! them. Found from the block tables alone (no hints): a prefix tree over
//! physical block ids at equal logical positions. Each run of tree nodes
//! shared by the same sequences, cut into chunks of at most `chunk_blocks`
//! blocks, becomes one segment: one pass (attention_rows.wgsl on GPUs,
//! the cascade mode of attention_serial.wgsl or attention.wgsl where decode
//! runs those) scores every query row of every sharing sequence against it and
//! writes (max, sum, acc) partials at the segment's depth. Each sequence's
//! private suffix is a normal split decode; reduce.wgsl merges the slots.
//!
//! Positions: a segment's tokens are numbered from its first token and each
//! query's position is taken relative to it; the suffix's likewise. ALiBi
//! and sliding windows depend on differences of positions only, so both are
//! exact.

use std::collections::HashMap;

/// When decode reads shared prefixes once (`AttnOptions::cascade`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Cascade {
    /// The cascade where it pays: on the `serial` kernel (software
    /// adapters) when [`CascadeTables::pays_serial`] says so (fewer K/V
    /// loads by a margin); on GPUs, where decode runs `lanes` and the
    /// segment pass the rows kernel, when [`CascadeTables::pays_gpu`] says
    /// so (at most 3/4 of plain decode's bytes, and at least
    /// [`CASCADE_MIN_SAVED_BYTES`] saved). On the `tiled` kernel, plain
    /// decode.
    #[default]
    Auto,
    /// Whenever the batch shares at least one segment.
    On,
    /// Never: plain paged decode.
    Off,
}

/// A batch cut into shared segments and private suffixes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CascadeTables {
    /// Per sequence: its blocks after the shared prefix, CSR like the input.
    pub suffix_indptr: Vec<u32>,
    pub suffix_indices: Vec<u32>,
    /// Tokens after the shared prefix.
    pub suffix_lens: Vec<u32>,
    /// Per segment: its blocks (CSR) and tokens.
    pub seg_indptr: Vec<u32>,
    pub seg_indices: Vec<u32>,
    pub seg_lens: Vec<u32>,
    /// Per segment: offsets into `qmap` (CSR over segments).
    pub seg_qo: Vec<u32>,
    /// (sequence, query position relative to the segment's first token)
    /// pairs, segment after segment.
    pub qmap: Vec<u32>,
    /// Per segment: its depth on the sharing sequences' paths (the same for
    /// all of them); the partial slot is `suffix partitions + depth`.
    pub seg_depth: Vec<u32>,
    /// Most segments on one sequence's path.
    pub max_depth: u32,
    /// Tokens of K/V the cascade reads (segments once, suffixes) and plain
    /// decode reads (every sequence's whole context).
    pub cascade_tokens: u64,
    pub plain_tokens: u64,
}

impl CascadeTables {
    /// Segments found.
    pub fn num_segments(&self) -> usize {
        self.seg_lens.len()
    }

    /// The cost model of `Cascade::Auto`: K/V bytes read, plus the partials
    /// each extra slot writes and the merge reads (`partial_bytes` per
    /// (sequence, query head, slot)). Pays when that is at most 3/4 of plain
    /// decode's bytes.
    pub fn pays(&self, bytes_per_token: u64, num_seqs: u64, partial_bytes: u64) -> bool {
        if self.num_segments() == 0 {
            return false;
        }
        let cascade = self.cascade_tokens * bytes_per_token
            + num_seqs * self.max_depth as u64 * partial_bytes;
        let plain = self.plain_tokens * bytes_per_token;
        4 * cascade <= 3 * plain
    }

    /// The cost model of `Cascade::Auto` on GPUs (the rows segment pass):
    /// [`pays`](Self::pays), and at least [`CASCADE_MIN_SAVED_BYTES`] of
    /// K/V reads saved in the layer.
    pub fn pays_gpu(&self, bytes_per_token: u64, num_seqs: u64, partial_bytes: u64) -> bool {
        let saved = self.plain_tokens.saturating_sub(self.cascade_tokens) * bytes_per_token;
        self.pays(bytes_per_token, num_seqs, partial_bytes) && saved >= CASCADE_MIN_SAVED_BYTES
    }

    /// Token visits (one K/V row load per token, KV head and head tile) of
    /// the cascade on the `serial` kernel, whose segment pass holds `slots`
    /// queries per invocation, and of plain decode: (cascade, plain). A
    /// segment shared by k sequences costs ceil(k / slots) visits per
    /// token; each suffix and each plain context one. On a software adapter
    /// the loads are what decode pays for (a lane-varying load is a loop
    /// over the SIMD lanes), while the arithmetic per query row is the same
    /// both ways.
    pub fn serial_visits(&self, slots: u32) -> (u64, u64) {
        let qs = slots.max(1) as u64;
        let seg: u64 = (0..self.num_segments())
            .map(|i| {
                let k = self.seg_qo[i + 1].saturating_sub(self.seg_qo[i]) as u64;
                self.seg_lens[i] as u64 * k.div_ceil(qs)
            })
            .sum();
        let suffix: u64 = self.suffix_lens.iter().map(|&l| l as u64).sum();
        (seg + suffix, self.plain_tokens)
    }

    /// The cost model of `Cascade::Auto` on the `serial` kernel: at most
    /// 3/4 of plain decode's token visits ([`serial_visits`](Self::serial_visits)),
    /// and visits saved worth at least `SERIAL_CASCADE_MIN_SAVED_BYTES`
    /// at `bytes_per_token` (K and V of every KV head).
    pub fn pays_serial(&self, slots: u32, bytes_per_token: u64) -> bool {
        if self.num_segments() == 0 {
            return false;
        }
        let (c, p) = self.serial_visits(slots);
        4 * c <= 3 * p
            && (p - c.min(p)).saturating_mul(bytes_per_token) >= SERIAL_CASCADE_MIN_SAVED_BYTES
    }
}

/// K/V bytes of token visits the serial segment pass must save before
/// `Auto` takes it: more than its two extra dispatches and the merge cost
/// on lavapipe. The demo's batches (a few sequences of a few hundred
/// tokens, 1 KiB of K/V per token) save about 0.3 MiB and measured slower
/// with the cascade (0.69 vs 0.48 ms a step); the bench's smallest shared
/// cell (4 over 512 tokens) saves 4 MiB and measured 1.25x.
pub(crate) const SERIAL_CASCADE_MIN_SAVED_BYTES: u64 = 1 << 20;

/// K/V bytes a layer's cascade must save before `Auto` takes it on a GPU
/// (the rows segment pass). Measured on an NVIDIA H200 (Vulkan, 2026-11-30,
/// `bench --only cascade`, f16, 8 KV heads of 128): the cascade was 1.13x
/// of plain decode's speed at 32 sequences over 16384 shared tokens (2.1
/// GB saved), but 0.93x at 32 over 4096 (0.52 GB) and 0.90x at 8 over
/// 16384 (0.47 GB), and slower still below: plain decode there reads
/// shared blocks from cache, and the segment pass pays per query row in
/// arithmetic what it saves in bytes.
pub const CASCADE_MIN_SAVED_BYTES: u64 = 1 << 30;

/// Finds the shared segments of a decode batch. Only whole blocks are
/// shared (a segment ends at a block edge); a block id shared at different
/// logical positions, `RELEASED`, or outside the pool is never shared.
/// Tables are assumed checked (`check_csr_tables`).
pub fn find_segments(
    num_blocks: u32,
    block_size: u32,
    kv_indptr: &[u32],
    kv_indices: &[u32],
    seq_lens: &[u32],
    chunk_blocks: u32,
) -> CascadeTables {
    let n = seq_lens.len();
    let bs = block_size.max(1);
    let chunk_blocks = chunk_blocks.max(1);
    // The common case, no two sequences starting on the same full block:
    // nothing is shared, so skip the tree (O(n log n) instead of a hash
    // map over every block).
    let mut firsts: Vec<u32> = (0..n)
        .filter(|&s| seq_lens[s] >= bs && kv_indptr[s] < kv_indptr[s + 1])
        .map(|s| kv_indices[kv_indptr[s] as usize])
        .filter(|&b| b < num_blocks)
        .collect();
    firsts.sort_unstable();
    if firsts.windows(2).all(|w| w[0] != w[1]) {
        let tokens = seq_lens.iter().map(|&l| l as u64).sum();
        return CascadeTables {
            suffix_indptr: kv_indptr.to_vec(),
            suffix_indices: kv_indices.to_vec(),
            suffix_lens: seq_lens.to_vec(),
            seg_indptr: vec![0],
            seg_qo: vec![0],
            plain_tokens: tokens,
            cascade_tokens: tokens,
            ..Default::default()
        };
    }
    // The prefix tree: node = (parent, block) -> id; sharers per node.
    let mut ids: HashMap<(u32, u32), u32> = HashMap::new();
    let mut count: Vec<u32> = Vec::new();
    let mut paths: Vec<Vec<u32>> = Vec::with_capacity(n);
    for s in 0..n {
        let start = kv_indptr[s] as usize;
        let full = (seq_lens[s] / bs) as usize;
        let mut parent = u32::MAX;
        let mut path = Vec::with_capacity(full);
        for j in 0..full {
            let b = kv_indices[start + j];
            if b >= num_blocks {
                break;
            }
            let next = count.len() as u32;
            let id = *ids.entry((parent, b)).or_insert(next);
            if id == next {
                count.push(0);
            }
            count[id as usize] += 1;
            path.push(id);
            parent = id;
        }
        paths.push(path);
    }
    let mut t = CascadeTables {
        suffix_indptr: vec![0],
        seg_indptr: vec![0],
        seg_qo: vec![0],
        ..Default::default()
    };
    // Segments keyed by their first node; members in sequence order.
    let mut seg_of: HashMap<u32, usize> = HashMap::new();
    let mut members: Vec<Vec<(u32, u32)>> = Vec::new();
    for s in 0..n {
        let path = &paths[s];
        let shared = path
            .iter()
            .take_while(|&&id| count[id as usize] >= 2)
            .count();
        let start = kv_indptr[s] as usize;
        let mut j = 0;
        let mut depth = 0u32;
        while j < shared {
            // A run of nodes with the same sharers, at most chunk_blocks long.
            let c = count[path[j] as usize];
            let mut e = j + 1;
            while e < shared && count[path[e] as usize] == c && (e - j) < chunk_blocks as usize {
                e += 1;
            }
            let seg = *seg_of.entry(path[j]).or_insert_with(|| {
                t.seg_indices
                    .extend_from_slice(&kv_indices[start + j..start + e]);
                t.seg_indptr.push(t.seg_indices.len() as u32);
                t.seg_lens.push((e - j) as u32 * bs);
                t.seg_depth.push(depth);
                members.push(Vec::new());
                members.len() - 1
            });
            // The query sits at the sequence's last position.
            let pos = seq_lens[s] - 1 - j as u32 * bs;
            members[seg].push((s as u32, pos));
            depth += 1;
            j = e;
        }
        t.max_depth = t.max_depth.max(depth);
        let end = kv_indptr[s + 1] as usize;
        t.suffix_indices
            .extend_from_slice(&kv_indices[start + shared..end]);
        t.suffix_indptr.push(t.suffix_indices.len() as u32);
        t.suffix_lens.push(seq_lens[s] - shared as u32 * bs);
    }
    for m in &members {
        for &(s, pos) in m {
            t.qmap.extend_from_slice(&[s, pos]);
        }
        t.seg_qo.push((t.qmap.len() / 2) as u32);
    }
    t.plain_tokens = seq_lens.iter().map(|&l| l as u64).sum();
    t.cascade_tokens = t.seg_lens.iter().map(|&l| l as u64).sum::<u64>()
        + t.suffix_lens.iter().map(|&l| l as u64).sum::<u64>();
    t
}

/// Longest shared segment one cascade pass walks (longer shared prefixes
/// are cut into several segments, which also spreads them over more
/// workgroups: on an H200, 2048-token segments left most of the GPU idle
/// and made the cascade 6.7x slower than plain decode at 8 sequences over
/// 4096 shared tokens; 256 gives split-K's parallelism).
pub const CASCADE_CHUNK_TOKENS: u32 = 256;

/// Whether `Cascade::Auto` may take the cascade where its segment pass
/// runs on the rows kernel (GPUs, where decode runs `lanes`), when
/// `CascadeTables::pays_gpu` says so: at most 3/4 of plain decode's K/V
/// bytes and at least `CASCADE_MIN_SAVED_BYTES` (1 GiB) saved per layer.
/// Measured on an NVIDIA H200 (Vulkan, 2026-11-30, `bench --only cascade`,
/// the full grid): the rows pass was 1.13x of plain decode's speed at 32
/// sequences over 16384 shared tokens and 0.36-0.93x in the other shared
/// cells, all of which save less than 1 GiB (the tiled pass had been
/// 0.39-0.88x everywhere). Where the segment pass runs on the tiled
/// kernel, `Auto` is plain decode. The serial kernel has its own rule
/// (`SERIAL_CASCADE_AUTO`).
pub const CASCADE_AUTO: bool = true;

/// Longest shared segment of a cascade pass on the `serial` kernel (one
/// invocation per tile of query slots, head tile and segment): shorter, so
/// a few shared prefixes still make enough invocations for every core.
pub(crate) const SERIAL_CASCADE_CHUNK_TOKENS: u32 = 512;

/// Whether `Cascade::Auto` takes the cascade where the segment pass runs on
/// the `serial` kernel (the decode kernel of software adapters) and
/// `CascadeTables::pays_serial` says so. Measured on lavapipe (2026-11-30,
/// `bench --only cascade`, the full grid, 2 query slots per invocation):
/// 0.98-1.54x of plain decode's speed in the cells with 4 or more
/// sequences sharing a prompt (10 of 12 cells faster); one sequence stays
/// plain.
pub const SERIAL_CASCADE_AUTO: bool = true;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_samples_of_one_prompt_share_its_full_blocks() {
        // Prompt of 3 full blocks (ids 0,1,2) shared; then private 3 / 4.
        let t = find_segments(10, 4, &[0, 4, 8], &[0, 1, 2, 3, 0, 1, 2, 4], &[14, 13], 2);
        assert_eq!(t.num_segments(), 2); // 3 blocks in chunks of 2 and 1
        assert_eq!(t.seg_lens, vec![8, 4]);
        assert_eq!(t.seg_depth, vec![0, 1]);
        assert_eq!(t.seg_qo, vec![0, 2, 4]);
        // Query positions relative to each segment: 13 and 12, then (from
        // token 8 on) 5 and 4.
        assert_eq!(t.qmap, vec![0, 13, 1, 12, 0, 5, 1, 4]);
        assert_eq!(t.suffix_indices, vec![3, 4]);
        assert_eq!(t.suffix_lens, vec![2, 1]);
        assert_eq!(t.max_depth, 2);
        assert_eq!(t.plain_tokens, 27);
        assert_eq!(t.cascade_tokens, 12 + 3);
    }

    #[test]
    fn a_tree_of_forks_gives_nested_segments() {
        // A, B, C share block 0; B and C also share block 1; D holds
        // block 0 only partly (3 of 4 tokens... of 2: one full block).
        let t = find_segments(
            10,
            2,
            &[0, 2, 4, 6, 8],
            &[0, 5, 0, 1, 0, 1, 0, 1],
            &[4, 4, 4, 3],
            8,
        );
        assert_eq!(t.seg_lens, vec![2, 2]);
        assert_eq!(t.seg_depth, vec![0, 1]);
        // Block 1 of D is partial: not in the tree, so D shares block 0 only.
        assert_eq!(t.seg_qo, vec![0, 4, 6]);
        assert_eq!(t.qmap, vec![0, 3, 1, 3, 2, 3, 3, 2, 1, 1, 2, 1]);
        assert_eq!(t.suffix_lens, vec![2, 0, 0, 1]);
        assert_eq!(t.suffix_indices, vec![5, 1]);
    }

    #[test]
    fn nothing_shared_means_no_segment() {
        let t = find_segments(10, 2, &[0, 1, 2], &[3, 4], &[2, 2], 8);
        assert_eq!(t.num_segments(), 0);
        assert!(!t.pays(100, 2, 10));
        assert_eq!(t.suffix_lens, vec![2, 2]);
    }
}
