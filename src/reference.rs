//! The attention math of every kernel, on the CPU in f64, over the same
//! paged layout as the GPU pool. Tests compare the kernels to this.
//!
//! Written to read like the kernels: walk the CSR block table, score each
//! token, softmax, weight V. Positions whose physical block is out of range
//! (a corrupt table) are skipped, exactly as the kernels skip them.

/// A paged K/V pool in the GPU layout `[num_blocks][num_kv_heads][block_size][head_dim]`,
/// one layer, values as f32 (f16 pools are compared after rounding through f16).
#[derive(Clone, Copy, Debug)]
pub struct PagedPool<'a> {
    /// Keys.
    pub k: &'a [f32],
    /// Values.
    pub v: &'a [f32],
    /// KV heads.
    pub num_kv_heads: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl PagedPool<'_> {
    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.k.len() / (self.num_kv_heads * self.block_size * self.head_dim)
    }

    fn row(&self, block: usize, kv_head: usize, offset: usize) -> usize {
        ((block * self.num_kv_heads + kv_head) * self.block_size + offset) * self.head_dim
    }
}

/// How a [`HostPool`] stores a written value: as the GPU pool holds it
/// (f32 exact, f16 rounded), or exact for the quantized pools, whose
/// rounding is what their tests bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    /// The value as written.
    Exact,
    /// Rounded through IEEE binary16, as a packed f16 pool stores it.
    F16,
    /// Rounded to bfloat16 (nearest, ties to even), as a bf16 pool stores
    /// it.
    Bf16,
}

impl Stored {
    /// The value as stored.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Stored::Exact => x,
            Stored::F16 => half::f16::from_f32(x).to_f32(),
            Stored::Bf16 => half::bf16::from_f32(x).to_f32(),
        }
    }
}

/// A host mirror of one layer's pool, in the GPU layout, kept by the same
/// operations an engine sends to the GPU (write to slots, copy-on-write
/// copies, swap moves): what the f64 reference reads through
/// [`view`](Self::view). Tests, the demo and the soak keep one per layer;
/// an engine can check its own pool the same way.
#[derive(Clone, Debug, PartialEq)]
pub struct HostPool {
    /// Keys, `[num_blocks][num_kv_heads][block_size][head_dim]`.
    pub k: Vec<f32>,
    /// Values, the same layout.
    pub v: Vec<f32>,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl HostPool {
    /// A pool of zeros.
    pub fn new(num_blocks: usize, num_kv_heads: usize, block_size: usize, head_dim: usize) -> Self {
        let n = num_blocks * num_kv_heads * block_size * head_dim;
        Self {
            k: vec![0.0; n],
            v: vec![0.0; n],
            num_kv_heads,
            block_size,
            head_dim,
        }
    }

    /// Floats per block.
    pub fn block_len(&self) -> usize {
        self.num_kv_heads * self.block_size * self.head_dim
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.k.len() / self.block_len().max(1)
    }

    /// Scatters `[n][num_kv_heads][head_dim]` rows of `k` and `v` into
    /// `slots`, stored as `stored` says; a slot outside the pool (such as
    /// [`SKIP_WRITE`](crate::blocks::SKIP_WRITE)) is not written, as the
    /// kernel skips it.
    pub fn write(&mut self, slots: &[u32], k: &[f32], v: &[f32], stored: Stored) {
        let (h, d, bs) = (self.num_kv_heads, self.head_dim, self.block_size);
        let cap = self.num_blocks() * bs;
        for (t, &slot) in slots.iter().enumerate() {
            if slot as usize >= cap {
                continue;
            }
            let (b, o) = (slot as usize / bs, slot as usize % bs);
            for kh in 0..h {
                let dst = ((b * h + kh) * bs + o) * d;
                let src = (t * h + kh) * d;
                for i in 0..d {
                    self.k[dst + i] = stored.round(k[src + i]);
                    self.v[dst + i] = stored.round(v[src + i]);
                }
            }
        }
    }

    /// Copies block `src` to `dst`.
    pub fn copy(&mut self, src: u32, dst: u32) {
        let per = self.block_len();
        let (s, d) = (src as usize * per, dst as usize * per);
        self.k.copy_within(s..s + per, d);
        self.v.copy_within(s..s + per, d);
    }

    /// Applies a copy-on-write list of `[src, dst]` pairs, in order.
    pub fn copy_blocks(&mut self, copies: &[[u32; 2]]) {
        for c in copies {
            self.copy(c[0], c[1]);
        }
    }

    /// Moves blocks from `src` to this pool: `pairs` of (block in `src`,
    /// block here), as a swap out or in moves them between the pool and
    /// the swap space.
    pub fn take_blocks(&mut self, src: &HostPool, pairs: &[[u32; 2]]) {
        let per = self.block_len();
        for p in pairs {
            let (s, t) = (p[0] as usize * per, p[1] as usize * per);
            self.k[t..t + per].copy_from_slice(&src.k[s..s + per]);
            self.v[t..t + per].copy_from_slice(&src.v[s..s + per]);
        }
    }

    /// The pool as the reference reads it.
    pub fn view(&self) -> PagedPool<'_> {
        PagedPool {
            k: &self.k,
            v: &self.v,
            num_kv_heads: self.num_kv_heads,
            block_size: self.block_size,
            head_dim: self.head_dim,
        }
    }
}

/// The attention variant, shared by decode and prefill.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnParams {
    /// Query heads.
    pub num_heads: usize,
    /// Multiplies q·k; usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Attend only to the last `w` positions up to and including the query's.
    pub sliding_window: Option<u32>,
    /// Logit soft-cap: `cap * tanh(score / cap)`, applied before ALiBi.
    pub soft_cap: Option<f32>,
    /// ALiBi slope per query head; bias `slope * (key_pos - query_pos)`.
    pub alibi_slopes: Option<Vec<f32>>,
    /// Attention sink logit per query head (gpt-oss): `exp(sink)` joins
    /// the softmax denominator and adds no value.
    pub sinks: Option<Vec<f32>>,
    /// StreamingLLM: positions below this stay visible beside the sliding
    /// window.
    pub sink_tokens: Option<u32>,
}

impl AttnParams {
    /// Plain softmax attention with scale `1 / sqrt(head_dim)`.
    pub fn new(num_heads: usize, head_dim: usize) -> Self {
        Self {
            num_heads,
            scale: 1.0 / (head_dim as f32).sqrt(),
            sliding_window: None,
            soft_cap: None,
            alibi_slopes: None,
            sinks: None,
            sink_tokens: None,
        }
    }

    /// The logit of query head `h` at `q_pos` for a key at `k_pos` with
    /// dot product `dot`, or `None` when the key is masked.
    pub fn logit(&self, h: usize, dot: f64, q_pos: usize, k_pos: usize) -> Option<f64> {
        if k_pos > q_pos {
            return None;
        }
        if let Some(w) = self.sliding_window {
            let sink = k_pos < self.sink_tokens.unwrap_or(0) as usize;
            if q_pos - k_pos >= w as usize && !sink {
                return None;
            }
        }
        let mut s = dot * self.scale as f64;
        if let Some(cap) = self.soft_cap {
            let cap = cap as f64;
            s = cap * (s / cap).tanh();
        }
        if let Some(sl) = &self.alibi_slopes {
            s += sl[h] as f64 * (k_pos as f64 - q_pos as f64);
        }
        Some(s)
    }
}

/// Online-softmax state of one query head over a range of keys: running max,
/// running sum of `exp(s - max)` and the accumulator `sum exp(s - max) * v`.
#[derive(Clone, Debug, PartialEq)]
pub struct Partial {
    /// Largest logit seen (`-inf` when none).
    pub max: f64,
    /// Sum of `exp(logit - max)`.
    pub sum: f64,
    /// Sum of `exp(logit - max) * v`.
    pub acc: Vec<f64>,
}

impl Partial {
    /// The empty state.
    pub fn empty(head_dim: usize) -> Self {
        Self {
            max: f64::NEG_INFINITY,
            sum: 0.0,
            acc: vec![0.0; head_dim],
        }
    }

    /// The normalised output (zeros when no key was attended).
    pub fn output(&self) -> Vec<f64> {
        self.output_with_sink(None)
    }

    /// The output with a sink logit in the denominator: `acc / (sum +
    /// exp(sink - max))` (zeros when no key was attended).
    pub fn output_with_sink(&self, sink: Option<f64>) -> Vec<f64> {
        if self.sum == 0.0 {
            return vec![0.0; self.acc.len()];
        }
        let l = self.sum + sink.map_or(0.0, |s| (s - self.max).exp());
        self.acc.iter().map(|a| a / l).collect()
    }
}

/// Merges partial states by log-sum-exp, as the split-K reduce kernel does.
pub fn merge(parts: &[Partial], head_dim: usize) -> Partial {
    let max = parts
        .iter()
        .map(|p| p.max)
        .fold(f64::NEG_INFINITY, f64::max);
    let mut out = Partial::empty(head_dim);
    if max == f64::NEG_INFINITY {
        return out;
    }
    out.max = max;
    for p in parts {
        if p.sum == 0.0 {
            continue;
        }
        let w = (p.max - max).exp();
        out.sum += p.sum * w;
        for (o, a) in out.acc.iter_mut().zip(&p.acc) {
            *o += a * w;
        }
    }
    out
}

/// Physical block of logical block `i` of a sequence, `None` if the table
/// entry is outside the pool or the CSR range runs past `kv_indices`.
fn physical(
    kv_indices: &[u32],
    start: usize,
    end: usize,
    i: usize,
    nblocks: usize,
) -> Option<usize> {
    let j = start + i;
    if j >= end || j >= kv_indices.len() {
        return None;
    }
    let b = kv_indices[j] as usize;
    (b < nblocks).then_some(b)
}

/// The partial state of query head `h` (at position `q_pos`, vector `q`)
/// over key positions `[from, to)` of one sequence.
#[allow(clippy::too_many_arguments)]
pub fn partial(
    pool: &PagedPool,
    p: &AttnParams,
    h: usize,
    q: &[f32],
    q_pos: usize,
    table: (&[u32], usize, usize),
    from: usize,
    to: usize,
) -> Partial {
    let d = pool.head_dim;
    let group = p.num_heads / pool.num_kv_heads;
    let kvh = h / group;
    let (indices, start, end) = table;
    let mut logits = Vec::new();
    for pos in from..to {
        let Some(b) = physical(
            indices,
            start,
            end,
            pos / pool.block_size,
            pool.num_blocks(),
        ) else {
            continue;
        };
        let r = pool.row(b, kvh, pos % pool.block_size);
        let dot: f64 = (0..d).map(|i| q[i] as f64 * pool.k[r + i] as f64).sum();
        if let Some(s) = p.logit(h, dot, q_pos, pos) {
            logits.push((s, r));
        }
    }
    let mut out = Partial::empty(d);
    out.max = logits.iter().map(|l| l.0).fold(f64::NEG_INFINITY, f64::max);
    for (s, r) in logits {
        let e = (s - out.max).exp();
        out.sum += e;
        for i in 0..d {
            out.acc[i] += e * pool.v[r + i] as f64;
        }
    }
    out
}

/// Decode: one query per sequence at position `seq_len - 1`.
/// `q` is `[num_seqs][num_heads][head_dim]`; so is the result.
pub fn decode(
    pool: &PagedPool,
    p: &AttnParams,
    q: &[f32],
    kv_indptr: &[u32],
    kv_indices: &[u32],
    seq_lens: &[u32],
) -> Vec<f64> {
    let qo_indptr: Vec<u32> = (0..=seq_lens.len() as u32).collect();
    prefill(pool, p, q, &qo_indptr, kv_indptr, kv_indices, seq_lens)
}

/// Prefill: sequence `s` has queries `qo_indptr[s]..qo_indptr[s + 1]` (rows
/// of `q`, `[total_q][num_heads][head_dim]`), the newest positions of its
/// `seq_lens[s]` tokens, each attending causally to the paged context.
pub fn prefill(
    pool: &PagedPool,
    p: &AttnParams,
    q: &[f32],
    qo_indptr: &[u32],
    kv_indptr: &[u32],
    kv_indices: &[u32],
    seq_lens: &[u32],
) -> Vec<f64> {
    let d = pool.head_dim;
    let hq = p.num_heads;
    let mut out = vec![0.0; q.len()];
    for s in 0..seq_lens.len() {
        // As the kernels: a length past what the table holds (a corrupt
        // table) is cut to the table's blocks.
        let start = (kv_indptr[s] as usize).min(kv_indices.len());
        let end = (kv_indptr[s + 1] as usize).min(kv_indices.len()).max(start);
        let len = (seq_lens[s] as usize).min((end - start) * pool.block_size);
        let (q0, q1) = (qo_indptr[s] as usize, qo_indptr[s + 1] as usize);
        let table = (kv_indices, kv_indptr[s] as usize, kv_indptr[s + 1] as usize);
        for (i, row) in (q0..q1).enumerate() {
            let q_pos = len.saturating_sub(q1 - q0) + i;
            for h in 0..hq {
                let qv = &q[(row * hq + h) * d..][..d];
                let part = partial(pool, p, h, qv, q_pos, table, 0, len);
                let sink = p.sinks.as_ref().map(|s| s[h] as f64);
                out[(row * hq + h) * d..][..d].copy_from_slice(&part.output_with_sink(sink));
            }
        }
    }
    out
}

/// Plain dense attention of one query over gathered keys and values (rows of
/// `head_dim`), with the same variant rules: the oracle the paged reference
/// is tested against.
pub fn dense(
    p: &AttnParams,
    h: usize,
    q: &[f32],
    q_pos: usize,
    keys: &[Vec<f32>],
    values: &[Vec<f32>],
) -> Vec<f64> {
    let d = q.len();
    let logits: Vec<Option<f64>> = keys
        .iter()
        .enumerate()
        .map(|(j, k)| {
            let dot: f64 = q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum();
            p.logit(h, dot, q_pos, j)
        })
        .collect();
    let max = logits
        .iter()
        .flatten()
        .fold(f64::NEG_INFINITY, |a, &b| a.max(b));
    let mut out = vec![0.0; d];
    if max == f64::NEG_INFINITY {
        return out;
    }
    let mut sum = 0.0;
    for (l, v) in logits.iter().zip(values) {
        if let Some(l) = l {
            let e = (l - max).exp();
            sum += e;
            for i in 0..d {
                out[i] += e * v[i] as f64;
            }
        }
    }
    out.iter_mut().for_each(|o| *o /= sum);
    out
}

/// `||a - b|| / ||b||`; NaN or infinity anywhere gives infinity, so NaN never passes.
pub fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared vectors differ in length");
    let mut num = 0.0;
    let mut den = 0.0;
    for (&x, &y) in a.iter().zip(b) {
        if !x.is_finite() || !y.is_finite() {
            return f64::INFINITY;
        }
        num += (x as f64 - y).powi(2);
        den += y * y;
    }
    if den == 0.0 {
        return if num == 0.0 { 0.0 } else { f64::INFINITY };
    }
    (num / den).sqrt()
}

/// Multi-head latent attention (DeepSeek-V2/V3) in f64, in both forms: the
/// absorbed one the kernels compute ([`mla::absorbed`]) and the unabsorbed
/// one a model's weights define ([`mla::Weights::unabsorbed`]), so tests can show that they
/// agree and that the kernels agree with both.
///
/// Shapes: a token's latent row is `rank + rope` values (the compressed
/// KV, then the RoPE key). `W_UK` is `[head][rank][nope]`, `W_UV`
/// `[head][rank][v_dim]`. Queries are per head: `q_nope` `[head][nope]`,
/// `q_rope` `[head][rope]`.
pub mod mla {
    /// The up-projections of one MLA layer, for a set of heads.
    #[derive(Clone, Debug)]
    pub struct Weights {
        /// Heads these weights hold.
        pub heads: usize,
        /// kv_lora_rank.
        pub rank: usize,
        /// qk_nope_head_dim.
        pub nope: usize,
        /// v_head_dim.
        pub v_dim: usize,
        /// `[head][rank][nope]`: the compressed KV to a head's no-RoPE key.
        pub w_uk: Vec<f64>,
        /// `[head][rank][v_dim]`: the compressed KV to a head's value.
        pub w_uv: Vec<f64>,
    }

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// Softmax weights of `scores` (max-subtracted).
    fn softmax(scores: &[f64]) -> Vec<f64> {
        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let l: f64 = e.iter().sum();
        e.into_iter().map(|x| x / l).collect()
    }

    impl Weights {
        /// Head h's absorbed query `[W_UK_h q_nope_h; q_rope_h]`
        /// (`rank + rope` values).
        pub fn absorb(&self, h: usize, q_nope: &[f64], q_rope: &[f64]) -> Vec<f64> {
            let w = &self.w_uk[h * self.rank * self.nope..(h + 1) * self.rank * self.nope];
            let mut q: Vec<f64> = (0..self.rank)
                .map(|r| dot(&w[r * self.nope..(r + 1) * self.nope], q_nope))
                .collect();
            q.extend_from_slice(q_rope);
            q
        }

        /// Head h's value from a latent output: `W_UV_h^T o` (`v_dim` values).
        pub fn up_project(&self, h: usize, latent: &[f64]) -> Vec<f64> {
            let w = &self.w_uv[h * self.rank * self.v_dim..(h + 1) * self.rank * self.v_dim];
            let mut v = vec![0.0; self.v_dim];
            for (r, &c) in latent.iter().enumerate().take(self.rank) {
                for (d, x) in v.iter_mut().enumerate() {
                    *x += c * w[r * self.v_dim + d];
                }
            }
            v
        }

        /// Head h's output in the unabsorbed form: keys
        /// `[W_UK_h^T c_t; k_rope_t]` and values `W_UV_h^T c_t` materialised
        /// per token, `softmax(scale * q . k) . v` (`v_dim` values).
        pub fn unabsorbed(
            &self,
            h: usize,
            q_nope: &[f64],
            q_rope: &[f64],
            rows: &[&[f32]],
            scale: f64,
        ) -> Vec<f64> {
            let (rank, nope, vd) = (self.rank, self.nope, self.v_dim);
            let wk = &self.w_uk[h * rank * nope..(h + 1) * rank * nope];
            let wv = &self.w_uv[h * rank * vd..(h + 1) * rank * vd];
            let mut scores = Vec::with_capacity(rows.len());
            let mut values = Vec::with_capacity(rows.len());
            for row in rows {
                let c: Vec<f64> = row[..rank].iter().map(|&x| x as f64).collect();
                let k_rope: Vec<f64> = row[rank..].iter().map(|&x| x as f64).collect();
                let mut k = vec![0.0; nope];
                let mut v = vec![0.0; vd];
                for (r, &cr) in c.iter().enumerate() {
                    for (d, x) in k.iter_mut().enumerate() {
                        *x += cr * wk[r * nope + d];
                    }
                    for (d, x) in v.iter_mut().enumerate() {
                        *x += cr * wv[r * vd + d];
                    }
                }
                scores.push(scale * (dot(q_nope, &k) + dot(q_rope, &k_rope)));
                values.push(v);
            }
            let p = softmax(&scores);
            let mut o = vec![0.0; vd];
            for (pt, v) in p.iter().zip(&values) {
                for (x, y) in o.iter_mut().zip(v) {
                    *x += pt * y;
                }
            }
            o
        }
    }

    /// One head's latent output in the absorbed form: `softmax(scale *
    /// q . row_t) . c_t` over `rows` (`rank` values), for an absorbed
    /// query `q` of `rank + rope` values.
    pub fn absorbed(q: &[f64], rows: &[&[f32]], rank: usize, scale: f64) -> Vec<f64> {
        let scores: Vec<f64> = rows
            .iter()
            .map(|row| scale * row.iter().zip(q).map(|(&x, y)| x as f64 * y).sum::<f64>())
            .collect();
        let p = softmax(&scores);
        let mut o = vec![0.0; rank];
        for (pt, row) in p.iter().zip(rows) {
            for (x, &y) in o.iter_mut().zip(row.iter()) {
                *x += pt * y as f64;
            }
        }
        o
    }
}
