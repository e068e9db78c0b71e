//! The f64 paged reference (`pagedattn::reference`) against the plain dense
//! oracle on K/V gathered per sequence: random pools (fixed seed per test, printed;
//! `PAGEDATTN_SEED` overrides), logical blocks scattered over shuffled physical
//! blocks, every unused slot poisoned with large values; decode and causal
//! prefill; GQA ratios 1, 4, 8; sliding window, ALiBi, soft-cap and a custom
//! scale; split-K partials merged by log-sum-exp; corrupt table entries
//! skipped; `rel_l2` never passing NaN.

use pagedattn::reference::{self, dense, merge, partial, rel_l2, AttnParams, PagedPool, Partial};
use pagedattn::rng::SplitMix64;

/// `PAGEDATTN_SEED` when set, else a fixed seed from the test's name;
/// printed so a failure replays.
fn seed(test: &str) -> u64 {
    let s = std::env::var("PAGEDATTN_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            test.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
            })
        });
    eprintln!("{test}: seed {s} (replay with PAGEDATTN_SEED={s})");
    s
}

/// A batch of sequences scattered over a shuffled paged pool, with the same
/// K/V kept per sequence in logical order for the dense oracle.
struct Batch {
    k: Vec<f32>,
    v: Vec<f32>,
    num_kv_heads: usize,
    block_size: usize,
    head_dim: usize,
    kv_indptr: Vec<u32>,
    kv_indices: Vec<u32>,
    seq_lens: Vec<u32>,
    /// `keys[s][kv_head][pos]`, one row of `head_dim`.
    keys: Vec<Vec<Vec<Vec<f32>>>>,
    values: Vec<Vec<Vec<Vec<f32>>>>,
}

impl Batch {
    fn new(
        rng: &mut SplitMix64,
        lens: &[usize],
        num_kv_heads: usize,
        block_size: usize,
        head_dim: usize,
    ) -> Self {
        let used: usize = lens.iter().map(|l| l.div_ceil(block_size)).sum();
        let nb = used + 3; // spare blocks nobody owns
        let mut physical: Vec<u32> = (0..nb as u32).collect();
        rng.shuffle(&mut physical);
        let rows = nb * num_kv_heads * block_size;
        // Poison: a reference that reads a slot it should not gets a very different answer.
        let mut k: Vec<f32> = (0..rows * head_dim)
            .map(|_| 50.0 + 50.0 * rng.next_f64() as f32)
            .collect();
        let mut v: Vec<f32> = (0..rows * head_dim)
            .map(|_| 1e4 * rng.next_signed())
            .collect();
        let mut kv_indptr = vec![0u32];
        let mut kv_indices = Vec::new();
        let mut keys = Vec::new();
        let mut values = Vec::new();
        let mut next = 0;
        for &len in lens {
            let table: Vec<u32> = physical[next..next + len.div_ceil(block_size)].to_vec();
            next += table.len();
            kv_indices.extend_from_slice(&table);
            kv_indptr.push(kv_indices.len() as u32);
            let mut ks = vec![Vec::new(); num_kv_heads];
            let mut vs = vec![Vec::new(); num_kv_heads];
            for pos in 0..len {
                for h in 0..num_kv_heads {
                    let kr = rng.signed_vec(head_dim);
                    let vr = rng.signed_vec(head_dim);
                    // Layout [num_blocks][num_kv_heads][block_size][head_dim].
                    let b = table[pos / block_size] as usize;
                    let at = ((b * num_kv_heads + h) * block_size + pos % block_size) * head_dim;
                    k[at..at + head_dim].copy_from_slice(&kr);
                    v[at..at + head_dim].copy_from_slice(&vr);
                    ks[h].push(kr);
                    vs[h].push(vr);
                }
            }
            keys.push(ks);
            values.push(vs);
        }
        Batch {
            k,
            v,
            num_kv_heads,
            block_size,
            head_dim,
            kv_indptr,
            kv_indices,
            seq_lens: lens.iter().map(|&l| l as u32).collect(),
            keys,
            values,
        }
    }

    fn pool(&self) -> PagedPool<'_> {
        PagedPool {
            k: &self.k,
            v: &self.v,
            num_kv_heads: self.num_kv_heads,
            block_size: self.block_size,
            head_dim: self.head_dim,
        }
    }

    fn num_blocks(&self) -> usize {
        self.k.len() / (self.num_kv_heads * self.block_size * self.head_dim)
    }

    /// Table of sequence `s` as `partial` takes it.
    fn table(&self, s: usize) -> (&[u32], usize, usize) {
        (
            &self.kv_indices,
            self.kv_indptr[s] as usize,
            self.kv_indptr[s + 1] as usize,
        )
    }
}

/// Largest difference, relative to the largest magnitude of `want` (at least 1).
fn max_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1.0f64, |m, x| m.max(x.abs()));
    got.iter()
        .zip(want)
        .map(|(a, b)| {
            if a.is_finite() {
                (a - b).abs() / scale
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}

const TOL: f64 = 1e-12;

/// Dense output of every query of a prefill-shaped batch: sequence `s` has
/// `nq[s]` queries at its newest positions.
fn dense_all(b: &Batch, p: &AttnParams, q: &[f32], nq: &[usize]) -> Vec<f64> {
    let (d, hq) = (b.head_dim, p.num_heads);
    let group = hq / b.num_kv_heads;
    let mut out = Vec::with_capacity(q.len());
    let mut row = 0;
    for (s, &n) in nq.iter().enumerate() {
        let len = b.seq_lens[s] as usize;
        for i in 0..n {
            for h in 0..hq {
                let qv = &q[(row * hq + h) * d..][..d];
                let kvh = h / group;
                out.extend(dense(
                    p,
                    h,
                    qv,
                    len - n + i,
                    &b.keys[s][kvh],
                    &b.values[s][kvh],
                ));
            }
            row += 1;
        }
    }
    out
}

fn alibi_slopes(n: usize) -> Vec<f32> {
    (0..n)
        .map(|h| 2f32.powf(-8.0 * (h + 1) as f32 / n as f32))
        .collect()
}

/// The attention variants every layout is checked under.
fn variants(
    num_heads: usize,
    head_dim: usize,
    block_size: usize,
) -> Vec<(&'static str, AttnParams)> {
    let plain = AttnParams::new(num_heads, head_dim);
    let with = |f: &dyn Fn(&mut AttnParams)| {
        let mut p = plain.clone();
        f(&mut p);
        p
    };
    vec![
        ("plain", plain.clone()),
        ("window 1", with(&|p| p.sliding_window = Some(1))),
        (
            "window block",
            with(&|p| p.sliding_window = Some(block_size as u32)),
        ),
        ("window 37", with(&|p| p.sliding_window = Some(37))),
        (
            "alibi",
            with(&|p| p.alibi_slopes = Some(alibi_slopes(num_heads))),
        ),
        ("soft cap", with(&|p| p.soft_cap = Some(1.5))),
        ("scale", with(&|p| p.scale = 0.31)),
        (
            "all",
            with(&|p| {
                p.sliding_window = Some(2 * block_size as u32 + 3);
                p.alibi_slopes = Some(alibi_slopes(num_heads));
                p.soft_cap = Some(4.0);
                p.scale = 0.9;
            }),
        ),
    ]
}

#[test]
fn decode_matches_dense_attention_on_gathered_kv() {
    let seed = seed("decode");
    let mut rng = SplitMix64::new(seed);
    let mut checked = 0;
    for (bs, d) in [(8, 64), (16, 80), (32, 128), (16, 256)] {
        for group in [1, 4, 8] {
            let hkv = if d == 256 { 1 } else { 2 };
            let lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5, 300];
            let b = Batch::new(&mut rng, &lens, hkv, bs, d);
            let hq = hkv * group;
            // Queries large enough that the soft-cap and the window matter.
            let q: Vec<f32> = rng
                .signed_vec(lens.len() * hq * d)
                .iter()
                .map(|x| x * 4.0)
                .collect();
            for (name, p) in variants(hq, d, bs) {
                let got =
                    reference::decode(&b.pool(), &p, &q, &b.kv_indptr, &b.kv_indices, &b.seq_lens);
                let want = dense_all(&b, &p, &q, &[1; 6]);
                let err = max_err(&got, &want);
                assert!(
                    err < TOL,
                    "{name}, bs {bs}, head_dim {d}, group {group}: error {err:e} (seed {seed})"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 4 * 3 * 8);
}

#[test]
fn prefill_is_causal_over_the_paged_context() {
    let seed = seed("prefill");
    let mut rng = SplitMix64::new(seed);
    for (bs, d, hkv, group) in [(8, 64, 2, 1), (16, 64, 1, 4), (32, 80, 2, 8)] {
        let lens = [1, 5, bs, 2 * bs + 1, 70];
        // Queries per sequence: one, a few, and a whole prompt.
        let nq = [1, 3, bs, 7, 70];
        let b = Batch::new(&mut rng, &lens, hkv, bs, d);
        let hq = hkv * group;
        let total: usize = nq.iter().sum();
        let q: Vec<f32> = rng
            .signed_vec(total * hq * d)
            .iter()
            .map(|x| x * 4.0)
            .collect();
        let mut qo_indptr = vec![0u32];
        for n in nq {
            qo_indptr.push(qo_indptr.last().unwrap() + n as u32);
        }
        for (name, p) in variants(hq, d, bs) {
            let got = reference::prefill(
                &b.pool(),
                &p,
                &q,
                &qo_indptr,
                &b.kv_indptr,
                &b.kv_indices,
                &b.seq_lens,
            );
            let want = dense_all(&b, &p, &q, &nq);
            let err = max_err(&got, &want);
            assert!(
                err < TOL,
                "{name}, bs {bs}, group {group}: error {err:e} (seed {seed})"
            );
        }
    }
}

#[test]
fn decode_is_prefill_with_one_query_per_sequence() {
    let mut rng = SplitMix64::new(seed("decode vs prefill"));
    let lens = [3, 17, 40];
    let b = Batch::new(&mut rng, &lens, 2, 8, 32);
    let p = AttnParams::new(8, 32);
    let q = rng.signed_vec(3 * 8 * 32);
    let dec = reference::decode(&b.pool(), &p, &q, &b.kv_indptr, &b.kv_indices, &b.seq_lens);
    let pre = reference::prefill(
        &b.pool(),
        &p,
        &q,
        &[0, 1, 2, 3],
        &b.kv_indptr,
        &b.kv_indices,
        &b.seq_lens,
    );
    assert_eq!(dec, pre);
}

#[test]
fn query_heads_of_one_group_share_their_kv_head() {
    let mut rng = SplitMix64::new(seed("gqa"));
    let (hkv, group, d) = (2, 4, 16);
    let b = Batch::new(&mut rng, &[20], hkv, 4, d);
    let p = AttnParams::new(hkv * group, d);
    // The same query vector for every head.
    let one = rng.signed_vec(d);
    let q: Vec<f32> = (0..hkv * group).flat_map(|_| one.clone()).collect();
    let out = reference::decode(&b.pool(), &p, &q, &b.kv_indptr, &b.kv_indices, &b.seq_lens);
    let head = |h: usize| &out[h * d..(h + 1) * d];
    for h in 1..group {
        assert_eq!(head(h), head(0), "head {h} of group 0");
        assert_eq!(head(group + h), head(group), "head {h} of group 1");
    }
    assert_ne!(head(0), head(group), "two groups read the same KV head");
}

#[test]
fn the_variants_change_the_answer() {
    // Guards the comparisons above against variants that silently do nothing.
    let mut rng = SplitMix64::new(seed("variants"));
    let b = Batch::new(&mut rng, &[90], 1, 16, 32);
    let q: Vec<f32> = rng.signed_vec(2 * 32).iter().map(|x| x * 4.0).collect();
    let vs = variants(2, 32, 16);
    let outs: Vec<Vec<f64>> = vs
        .iter()
        .map(|(_, p)| reference::decode(&b.pool(), p, &q, &b.kv_indptr, &b.kv_indices, &b.seq_lens))
        .collect();
    for i in 1..outs.len() {
        assert!(
            max_err(&outs[i], &outs[0]) > 1e-6,
            "{} gives the plain answer",
            vs[i].0
        );
    }
    // A window of one attends to the newest token only: its value row.
    let last = &b.values[0][0][89];
    let w1 = &outs[1][..32];
    assert!(w1
        .iter()
        .zip(last)
        .all(|(a, b)| (a - *b as f64).abs() < 1e-12));
}

#[test]
fn logit_applies_mask_cap_and_bias_in_order() {
    let mut p = AttnParams::new(2, 4);
    assert_eq!(p.scale, 0.5);
    assert_eq!(p.logit(0, 2.0, 5, 5), Some(1.0));
    assert_eq!(
        p.logit(0, 2.0, 5, 6),
        None,
        "a key after the query is masked"
    );
    p.sliding_window = Some(3);
    assert!(p.logit(0, 2.0, 5, 3).is_some());
    assert_eq!(p.logit(0, 2.0, 5, 2), None, "outside the window");
    p.soft_cap = Some(2.0);
    let capped = p.logit(0, 100.0, 5, 5).unwrap();
    assert!((capped - 2.0 * (50.0f64 / 2.0).tanh()).abs() < 1e-15);
    p.alibi_slopes = Some(vec![0.5, 0.25]);
    let with_bias = p.logit(1, 2.0, 5, 3).unwrap();
    let cap_only = 2.0 * (1.0f64 / 2.0).tanh();
    assert!(
        (with_bias - (cap_only - 0.5)).abs() < 1e-15,
        "ALiBi is added after the cap"
    );
}

#[test]
fn dense_is_a_softmax_weighted_sum() {
    let p = AttnParams {
        scale: 1.0,
        ..AttnParams::new(1, 2)
    };
    let keys = vec![vec![0.0, 0.0], vec![1.0, 0.0], vec![5.0, 5.0]];
    let values = vec![vec![1.0, 0.0], vec![0.0, 1.0], vec![9.0, 9.0]];
    // Query at position 1: the third key is in the future.
    let out = dense(&p, 0, &[1.0, 0.0], 1, &keys, &values);
    let e = std::f64::consts::E;
    let want = [1.0 / (1.0 + e), e / (1.0 + e)];
    assert!(
        out.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-15),
        "{out:?}"
    );
    // Nothing attended: zeros.
    let none = AttnParams {
        sliding_window: Some(0),
        ..p
    };
    assert_eq!(
        dense(&none, 0, &[1.0, 0.0], 1, &keys, &values),
        vec![0.0, 0.0]
    );
}

#[test]
fn split_k_partials_merge_to_the_whole_range() {
    let seed = seed("split-k");
    let mut rng = SplitMix64::new(seed);
    let (bs, d, hkv, group) = (16, 64, 2, 4);
    let lens = [1, 33, 300, 513];
    let b = Batch::new(&mut rng, &lens, hkv, bs, d);
    let hq = hkv * group;
    for (name, p) in variants(hq, d, bs) {
        for (s, &len) in lens.iter().enumerate() {
            let q: Vec<f32> = rng.signed_vec(d).iter().map(|x| x * 4.0).collect();
            let h = rng.below(hq as u64) as usize;
            let q_pos = len - 1;
            let whole = partial(&b.pool(), &p, h, &q, q_pos, b.table(s), 0, len);
            // Partitions of 64 tokens (as the split kernel), uneven cuts, and
            // cuts with empty ranges.
            let mut cut_sets: Vec<Vec<usize>> = vec![(0..=len).step_by(64).chain([len]).collect()];
            let mut cuts: Vec<usize> = (0..3).map(|_| rng.below(len as u64 + 1) as usize).collect();
            cuts.extend([0, len, cuts[0]]);
            cuts.sort();
            cut_sets.push(cuts);
            for cuts in cut_sets {
                let parts: Vec<Partial> = cuts
                    .windows(2)
                    .map(|w| partial(&b.pool(), &p, h, &q, q_pos, b.table(s), w[0], w[1]))
                    .collect();
                let merged = merge(&parts, d);
                let ctx = format!("{name}, len {len}, cuts {cuts:?} (seed {seed})");
                assert_eq!(merged.max, whole.max, "{ctx}");
                assert!((merged.sum - whole.sum).abs() <= TOL * whole.sum, "{ctx}");
                assert!(max_err(&merged.output(), &whole.output()) < TOL, "{ctx}");
                let mut reversed = parts.clone();
                reversed.reverse();
                assert!(
                    max_err(&merge(&reversed, d).output(), &whole.output()) < TOL,
                    "{ctx}"
                );
            }
            // The whole range is the decode answer.
            let want = dense(
                &p,
                h,
                &q,
                q_pos,
                &b.keys[s][h / group],
                &b.values[s][h / group],
            );
            assert!(
                max_err(&whole.output(), &want) < TOL,
                "{name}, len {len} (seed {seed})"
            );
        }
    }
}

#[test]
fn merging_nothing_gives_the_empty_state() {
    let d = 8;
    let empty = Partial::empty(d);
    assert_eq!(merge(&[], d), empty);
    assert_eq!(merge(&[empty.clone(), empty.clone()], d), empty);
    assert_eq!(empty.output(), vec![0.0; d]);
    let one = Partial {
        max: 0.5,
        sum: 2.0,
        acc: vec![1.0; d],
    };
    let merged = merge(&[empty.clone(), one.clone(), empty], d);
    assert_eq!(merged, one);
    assert_eq!(merged.output(), vec![0.5; d]);
}

#[test]
fn corrupt_table_entries_are_skipped() {
    let seed = seed("corrupt table");
    let mut rng = SplitMix64::new(seed);
    let (bs, d, hkv, group) = (8, 32, 2, 4);
    let lens = [30, 41, 17];
    let hq = hkv * group;
    let q: Vec<f32> = rng
        .signed_vec(lens.len() * hq * d)
        .iter()
        .map(|x| x * 3.0)
        .collect();
    let clean = Batch::new(&mut rng, &lens, hkv, bs, d);
    let nb = clean.num_blocks() as u32;
    for (s, &len) in lens.iter().enumerate() {
        let blocks = len.div_ceil(bs);
        // A middle block, and the last (partial) one; just out of range and far out.
        for (logical, bad) in [
            (1, nb),
            (blocks - 1, nb),
            (blocks - 1, u32::MAX),
            (0, nb + 7),
        ] {
            let mut indices = clean.kv_indices.clone();
            indices[clean.kv_indptr[s] as usize + logical] = bad;
            let skipped = logical * bs..((logical + 1) * bs).min(len);
            let last_block = logical == blocks - 1;
            for (name, p) in variants(hq, d, bs) {
                // With a middle block gone, the remaining keys keep their
                // positions; the dense oracle numbers keys by index, so only
                // position-free variants can be checked that way.
                let positional = p.sliding_window.is_some() || p.alibi_slopes.is_some();
                if positional && !last_block {
                    continue;
                }
                let got = reference::decode(
                    &clean.pool(),
                    &p,
                    &q,
                    &clean.kv_indptr,
                    &indices,
                    &clean.seq_lens,
                );
                for h in 0..hq {
                    let kvh = h / group;
                    let keep = |rows: &Vec<Vec<f32>>| -> Vec<Vec<f32>> {
                        rows.iter()
                            .enumerate()
                            .filter(|(pos, _)| !skipped.contains(pos))
                            .map(|(_, r)| r.clone())
                            .collect()
                    };
                    let (keys, values) = (keep(&clean.keys[s][kvh]), keep(&clean.values[s][kvh]));
                    // The query stays at position len - 1.
                    let q_pos = if last_block { len - 1 } else { keys.len() - 1 };
                    let qv = &q[(s * hq + h) * d..][..d];
                    let want = dense(&p, h, qv, q_pos, &keys, &values);
                    let row = &got[(s * hq + h) * d..][..d];
                    let err = max_err(row, &want);
                    assert!(
                        err < TOL,
                        "{name}: seq {s}, block {logical} -> {bad}, head {h}: error {err:e} (seed {seed})"
                    );
                }
                // The other sequences are untouched.
                let want = reference::decode(
                    &clean.pool(),
                    &p,
                    &q,
                    &clean.kv_indptr,
                    &clean.kv_indices,
                    &clean.seq_lens,
                );
                for other in (0..lens.len()).filter(|&o| o != s) {
                    let r = other * hq * d..(other + 1) * hq * d;
                    assert_eq!(got[r.clone()], want[r], "{name}: seq {other}");
                }
            }
        }
    }
}

#[test]
fn a_table_of_only_corrupt_entries_attends_to_nothing() {
    let mut rng = SplitMix64::new(seed("all corrupt"));
    let mut b = Batch::new(&mut rng, &[20], 1, 4, 8);
    let nb = b.num_blocks() as u32;
    b.kv_indices.iter_mut().for_each(|e| *e = nb);
    let p = AttnParams::new(2, 8);
    let q = rng.signed_vec(2 * 8);
    let out = reference::decode(&b.pool(), &p, &q, &b.kv_indptr, &b.kv_indices, &b.seq_lens);
    assert_eq!(out, vec![0.0; 16]);
}

#[test]
fn a_csr_range_past_the_indices_is_skipped() {
    let mut rng = SplitMix64::new(seed("short indices"));
    let (bs, d) = (4, 8);
    let b = Batch::new(&mut rng, &[6, 10], 1, bs, d);
    let p = AttnParams::new(1, d);
    let q = rng.signed_vec(2 * d);
    // Drop the last index: sequence 1's last block (positions 8, 9) is missing.
    let short = &b.kv_indices[..b.kv_indices.len() - 1];
    let got = reference::decode(&b.pool(), &p, &q, &b.kv_indptr, short, &b.seq_lens);
    let want = dense(&p, 0, &q[d..], 9, &b.keys[1][0][..8], &b.values[1][0][..8]);
    assert!(max_err(&got[d..], &want) < TOL);
}

#[test]
fn rel_l2_never_passes_nan_or_infinity() {
    assert_eq!(rel_l2(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
    let r = rel_l2(&[1.0, 0.0], &[1.0, 1.0]);
    assert!((r - 0.5f64.sqrt()).abs() < 1e-15);
    assert_eq!(rel_l2(&[f32::NAN, 1.0], &[1.0, 1.0]), f64::INFINITY);
    assert_eq!(rel_l2(&[1.0, 1.0], &[1.0, f64::NAN]), f64::INFINITY);
    assert_eq!(rel_l2(&[f32::INFINITY], &[1.0]), f64::INFINITY);
    assert_eq!(rel_l2(&[1.0], &[f64::NEG_INFINITY]), f64::INFINITY);
    assert_eq!(rel_l2(&[f32::NAN], &[0.0]), f64::INFINITY);
    // An all-zero reference: only an all-zero output matches.
    assert_eq!(rel_l2(&[0.0, -0.0], &[0.0, 0.0]), 0.0);
    assert_eq!(rel_l2(&[1e-30, 0.0], &[0.0, 0.0]), f64::INFINITY);
    assert_eq!(rel_l2(&[], &[]), 0.0);
    // And NaN is not a small error: it fails any tolerance.
    assert!(rel_l2(&[f32::NAN], &[1.0]).partial_cmp(&1e-5) == Some(std::cmp::Ordering::Greater));
}

#[test]
#[should_panic(expected = "differ in length")]
fn rel_l2_rejects_vectors_of_different_lengths() {
    rel_l2(&[1.0], &[1.0, 2.0]);
}

#[test]
fn decode_of_an_empty_sequence_is_zero() {
    // A batch may carry a sequence with no tokens (padding); it attends to
    // nothing, like a fully masked one, instead of underflowing `len - 1`.
    let mut rng = SplitMix64::new(seed("empty sequence"));
    let b = Batch::new(&mut rng, &[5], 1, 4, 8);
    let p = AttnParams::new(1, 8);
    let q = rng.signed_vec(2 * 8);
    let kv_indptr = [0, 2, 2];
    let out = reference::decode(&b.pool(), &p, &q, &kv_indptr, &b.kv_indices, &[5, 0]);
    assert_eq!(&out[8..], &[0.0; 8]);
}

/// A sink logit joins the denominator with no value: one key of logit 0
/// and a sink of 0 give half the key's value; no key attended gives zeros.
/// StreamingLLM in the reference: a position below `sink_tokens` is
/// visible however far before the window, the others between are masked.
#[test]
fn sink_tokens_stay_visible_beside_the_window() {
    let mut p = AttnParams::new(1, 4);
    p.sliding_window = Some(10);
    assert!(p.logit(0, 1.0, 1000, 0).is_none());
    p.sink_tokens = Some(4);
    for k in 0..4 {
        assert!(p.logit(0, 1.0, 1000, k).is_some(), "sink {k}");
    }
    for k in [4, 500, 990] {
        assert!(p.logit(0, 1.0, 1000, k).is_none(), "position {k}");
    }
    for k in 991..=1000 {
        assert!(p.logit(0, 1.0, 1000, k).is_some(), "window {k}");
    }
    assert!(p.logit(0, 1.0, 1000, 1001).is_none(), "causal");
}

#[test]
fn a_sink_joins_the_denominator_only() {
    let mut p = AttnParams {
        scale: 1.0,
        ..AttnParams::new(1, 2)
    };
    p.sinks = Some(vec![0.0]);
    let pool_k = vec![0.0f32, 0.0];
    let pool_v = vec![4.0f32, -2.0];
    let pool = pagedattn::reference::PagedPool {
        k: &pool_k,
        v: &pool_v,
        num_kv_heads: 1,
        block_size: 1,
        head_dim: 2,
    };
    let out = pagedattn::reference::decode(&pool, &p, &[1.0, 1.0], &[0, 1], &[0], &[1]);
    assert!(
        (out[0] - 2.0).abs() < 1e-12 && (out[1] + 1.0).abs() < 1e-12,
        "{out:?}"
    );
    let none = pagedattn::reference::decode(&pool, &p, &[1.0, 1.0], &[0, 0], &[], &[0]);
    assert_eq!(none, vec![0.0, 0.0]);
}
