//! The host-side argument checks of the GPU layer, driven by arbitrary
//! bytes: `check_csr_tables`, `AttnOptions::validate`,
//! `KvCacheConfig::validate` (with its size helpers) and the encoder-path
//! table packing (`PackedTables::pack`). None needs an adapter. Each check
//! must never panic, and must accept exactly what an independent statement
//! of its contract accepts. Shared by the fuzz target
//! (`fuzz/fuzz_targets/gpu_args.rs`) and its corpus replay
//! (`tests/fuzz_corpus_gpu_args.rs`).
#![allow(dead_code)]

use pagedattn::blocks::RELEASED;
use pagedattn::gpu::{
    check_csr_tables, AttnOptions, KvCacheConfig, KvDtype, PackedTables, Split, MAX_BATCH,
    MAX_KV_HEADS, MAX_LAYERS, MAX_SEQ_LEN,
};

pub use crate::harness;

tally! {
    /// What one input reached, summed by the replay to show the corpus still
    /// covers every outcome.
    pub struct Reached: usize {
        tables_ok: "tables accepted",
        tables_err: "tables refused",
        options_ok: "options accepted",
        options_err: "options refused",
        config_ok: "cache shapes accepted",
        config_err: "cache shapes refused",
        pack_ok: "tables packed",
        pack_err: "packing refused",
    }
}

/// The input, read a byte at a time.
type Cursor<'a> = harness::Input<'a>;

impl Cursor<'_> {
    fn u32(&mut self) -> u32 {
        match self.byte() % 8 {
            0 => self.byte() as u32 % 8,
            1 => u32::MAX - self.byte() as u32 % 4,
            2 => 1u32 << (self.byte() % 32),
            3 => (1u32 << (self.byte() % 32))
                .wrapping_add(self.byte() as u32 % 3)
                .wrapping_sub(1),
            4 => MAX_SEQ_LEN
                .wrapping_add(self.byte() as u32 % 3)
                .wrapping_sub(1),
            _ => u32::from_le_bytes([self.byte(), self.byte(), 0, 0]) % 600,
        }
    }

    fn f32(&mut self) -> f32 {
        match self.byte() % 8 {
            0 => f32::NAN,
            1 => f32::INFINITY,
            2 => f32::NEG_INFINITY,
            3 => 0.0,
            4 => -(self.byte() as f32),
            5 => f32::MAX,
            _ => self.byte() as f32 / 16.0,
        }
    }

    fn vec_u32(&mut self, max: usize) -> Vec<u32> {
        let n = self.byte() as usize % (max + 1);
        (0..n).map(|_| self.u32()).collect()
    }
}

/// Runs every check the input asks for and returns what was reached.
pub fn run(data: &[u8]) -> Reached {
    let mut c = Cursor::new(data);
    let mut r = Reached::default();
    while !c.done() {
        match c.byte() % 4 {
            0 => tables(&mut c, &mut r),
            1 => options(&mut c, &mut r),
            2 => config(&mut c, &mut r),
            _ => pack(&mut c, &mut r),
        }
    }
    r
}

/// Mostly well-formed CSR tables, perturbed by the input.
fn csr(c: &mut Cursor) -> (u32, u32, Vec<u32>, Vec<u32>, Vec<u32>) {
    let num_blocks = c.u32();
    let block_size = [1, 2, 16, 256, 3, 0][c.byte() as usize % 6];
    let n = c.byte() as usize % 6;
    let mut indptr = vec![0u32];
    let mut indices = Vec::new();
    let mut lens = Vec::new();
    for _ in 0..n {
        let blocks = c.byte() as usize % 5;
        for _ in 0..blocks {
            indices.push(match c.byte() % 4 {
                0 => RELEASED,
                1 => c.u32(),
                _ => c.byte() as u32 % 8,
            });
        }
        indptr.push(indices.len() as u32);
        lens.push(match c.byte() % 3 {
            0 => c.u32(),
            _ => (blocks as u32 * block_size).saturating_sub(c.byte() as u32 % 4),
        });
    }
    match c.byte() % 6 {
        0 => indptr.pop().map(|_| ()).unwrap_or(()),
        1 => indptr.push(c.u32()),
        2 => {
            let i = c.byte() as usize % indptr.len();
            indptr[i] = c.u32();
        }
        3 => indices.extend(c.vec_u32(3)),
        _ => {}
    }
    (num_blocks, block_size, indptr, indices, lens)
}

/// The contract of `check_csr_tables`, stated independently.
fn tables_valid(nb: u32, bs: u32, indptr: &[u32], indices: &[u32], lens: &[u32]) -> bool {
    let n = lens.len();
    indptr.len() == n + 1
        && indptr[0] == 0
        && indptr.windows(2).all(|w| w[0] <= w[1])
        && indptr[n] as usize == indices.len()
        && n <= MAX_BATCH as usize
        && (0..n).all(|s| {
            let blocks = (indptr[s + 1] - indptr[s]) as u64;
            lens[s] as u64 <= blocks * bs as u64 && lens[s] <= MAX_SEQ_LEN
        })
        && indices.iter().all(|&b| b < nb || b == RELEASED)
}

fn tables(c: &mut Cursor, r: &mut Reached) {
    let (nb, bs, indptr, indices, lens) = csr(c);
    let got = check_csr_tables(nb, bs, &indptr, &indices, &lens);
    let want = tables_valid(nb, bs, &indptr, &indices, &lens);
    assert_eq!(
        got.is_ok(),
        want,
        "check_csr_tables({nb}, {bs}, {indptr:?}, {indices:?}, {lens:?}) = {got:?}"
    );
    if let Err(m) = &got {
        assert!(!m.to_string().is_empty());
    }
    if want {
        r.tables_ok += 1;
    } else {
        r.tables_err += 1;
    }
}

fn options(c: &mut Cursor, r: &mut Reached) {
    let num_heads = c.byte() as u32 % 5;
    let opt = |c: &mut Cursor| c.byte().is_multiple_of(2);
    let o = AttnOptions {
        scale: opt(c).then(|| c.f32()),
        soft_cap: opt(c).then(|| c.f32()),
        sliding_window: opt(c).then(|| c.u32()),
        alibi_slopes: opt(c).then(|| {
            let n = c.byte() as usize % 5;
            (0..n).map(|_| c.f32()).collect()
        }),
        split: match c.byte() % 3 {
            0 => Split::Auto,
            1 => Split::Never,
            _ => Split::Tokens(c.u32()),
        },
        // Not read by `validate`; the corpus bytes stay as they were.
        cascade: pagedattn::gpu::Cascade::Auto,
        // Read last, so the bytes before mean what they meant.
        sinks: opt(c).then(|| {
            let n = c.byte() as usize % 5;
            (0..n).map(|_| c.f32()).collect()
        }),
        sink_tokens: opt(c).then(|| c.u32() % 3),
    };
    let want = o.scale.is_none_or(f32::is_finite)
        && o.soft_cap.is_none_or(|x| x.is_finite() && x > 0.0)
        && o.sliding_window != Some(0)
        && o.alibi_slopes
            .as_ref()
            .is_none_or(|s| s.len() == num_heads as usize && s.iter().all(|x| x.is_finite()))
        && o.sinks
            .as_ref()
            .is_none_or(|s| s.len() == num_heads as usize && s.iter().all(|x| x.is_finite()))
        && o.sink_tokens
            .is_none_or(|k| k > 0 && o.sliding_window.is_some())
        && match o.split {
            Split::Tokens(t) => t > 0 && t % 64 == 0,
            _ => true,
        };
    let got = o.validate(num_heads);
    assert_eq!(got.is_ok(), want, "{o:?} for {num_heads} heads: {got:?}");
    if want {
        r.options_ok += 1;
    } else {
        r.options_err += 1;
    }
}

fn config(c: &mut Cursor, r: &mut Reached) {
    let cfg = KvCacheConfig {
        num_layers: c.u32(),
        num_blocks: c.u32(),
        block_size: c.u32(),
        num_kv_heads: c.u32(),
        head_dim: c.u32(),
        dtype: if c.byte().is_multiple_of(2) {
            KvDtype::F32
        } else {
            KvDtype::F16
        },
        layer_group: 0,
    };
    let want = (1..=256).contains(&cfg.block_size)
        && cfg.block_size.is_power_of_two()
        && cfg.head_dim > 0
        && cfg.head_dim.is_multiple_of(4)
        && cfg.head_dim <= 256
        && (1..=MAX_LAYERS).contains(&cfg.num_layers)
        && (1..=MAX_KV_HEADS).contains(&cfg.num_kv_heads)
        && cfg.num_blocks > 0;
    let got = cfg.validate();
    assert_eq!(got.is_ok(), want, "{cfg:?}: {got:?}");
    // The size helpers never panic, valid or not; for a valid shape they
    // are exact and the block count they allow keeps every offset in u32.
    let limit = [0, 1 << 20, 128 << 20, u64::MAX][c.byte() as usize % 4];
    let max = cfg.max_blocks_for(limit);
    let (bytes, elems4) = (cfg.buffer_block_bytes(true), cfg.block_elems4());
    if want {
        let exact = cfg.num_kv_heads as u64 * cfg.block_size as u64 * cfg.head_dim as u64 / 4;
        assert_eq!(elems4 as u64, exact, "{cfg:?}");
        assert!(
            max as u64 * exact <= u32::MAX as u64,
            "{cfg:?}: {max} blocks"
        );
        assert!(
            max as u64 * bytes <= limit,
            "{cfg:?}: {max} blocks over {limit}"
        );
        r.config_ok += 1;
    } else {
        r.config_err += 1;
    }
}

fn pack(c: &mut Cursor, r: &mut Reached) {
    let (_, _, indptr, indices, lens) = csr(c);
    let slopes: Option<Vec<f32>> = c.byte().is_multiple_of(2).then(|| {
        let n = c.byte() as usize % 4;
        (0..n).map(|_| c.f32()).collect()
    });
    let qtile = c.u32();
    let qo: Option<Vec<u32>> = c.byte().is_multiple_of(2).then(|| {
        let mut v = vec![0u32];
        for _ in 0..lens.len() {
            let last = *v.last().unwrap();
            v.push(match c.byte() % 4 {
                0 => c.u32(),
                _ => last.saturating_add(c.byte() as u32 % 9),
            });
        }
        if c.byte().is_multiple_of(5) {
            v.pop();
        }
        v
    });
    let got = PackedTables::pack(
        &indptr,
        &indices,
        &lens,
        slopes.as_deref(),
        qo.as_deref().map(|q| (q, qtile)),
    );
    let slopes_ok = slopes
        .as_ref()
        .is_none_or(|s| s.iter().all(|x| x.is_finite()));
    let lens_ok = lens.iter().all(|&l| l <= MAX_SEQ_LEN) && lens.len() <= MAX_BATCH as usize;
    let tiles: u64 = qo.as_ref().map_or(0, |q| {
        (0..lens.len())
            .map(|s| {
                let nq = q
                    .get(s + 1)
                    .unwrap_or(&0)
                    .saturating_sub(*q.get(s).unwrap_or(&0));
                nq.div_ceil(qtile.max(1)) as u64
            })
            .sum()
    });
    let want = slopes_ok && lens_ok && tiles <= MAX_BATCH as u64;
    assert_eq!(
        got.is_ok(),
        want,
        "pack({indptr:?}, {indices:?}, {lens:?}, {slopes:?}, {qo:?}, {qtile}): {got:?}"
    );
    if let Ok(p) = got {
        let n = lens.len();
        let expect = 2 * n
            + 1
            + indices.len()
            + slopes.as_ref().map_or(0, |s| s.len())
            + qo.as_ref().map_or(0, |_| n + 1 + 2 * tiles as usize);
        assert_eq!(p.words.len(), expect);
        assert_eq!(p.num_tiles as u64, tiles);
        assert_eq!(p.max_len, lens.iter().copied().max().unwrap_or(0));
        r.pack_ok += 1;
    } else {
        r.pack_err += 1;
    }
}
