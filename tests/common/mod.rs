//! Shared by the GPU tests: adapter discovery and random paged batches.
#![allow(dead_code)]

use pagedattn::blocks::{BatchView, BlockManager, BlockManagerConfig, SeqId};
use pagedattn::gpu::{Gpu, KvDtype};
use pagedattn::rng::SplitMix64;

/// The default adapter, or `None` (skip) when there is none and
/// `PAGEDATTN_REQUIRE_GPU` is not set. With it set, a missing adapter fails.
pub fn gpu() -> Option<Gpu> {
    match Gpu::new() {
        Ok(g) => {
            eprintln!("adapter: {}", g.describe());
            Some(g)
        }
        Err(e) => {
            if std::env::var("PAGEDATTN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("PAGEDATTN_REQUIRE_GPU=1 but no adapter: {e}");
            }
            eprintln!("skipped: no GPU adapter ({e})");
            None
        }
    }
}

/// Says, for the test log, that part of a test cannot run on this adapter
/// (a missing feature or limit), instead of passing silently.
pub fn unsupported(gpu: &Gpu, what: &str) {
    eprintln!("unsupported on {}: {what}", gpu.describe());
}

/// A seed: `PAGEDATTN_SEED` if set, else a fixed one derived from the
/// test's name (so every run is reproducible, and tests differ from each
/// other). Printed, and every failure message names it, so a failure can be
/// replayed; set `PAGEDATTN_SEED` to explore fresh inputs.
pub fn seed(test: &str) -> u64 {
    let s = std::env::var("PAGEDATTN_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            // FNV-1a: stable across Rust releases and platforms.
            test.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
            })
        });
    eprintln!("{test}: seed {s} (replay with PAGEDATTN_SEED={s})");
    s
}

/// Rounds through f16 the way the packed pool stores values.
pub fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// A host mirror of one layer's pool, filled by scattering rows to slots.
pub struct HostPool {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub num_kv_heads: usize,
    pub block_size: usize,
    pub head_dim: usize,
}

impl HostPool {
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

    /// Scatters `[n][num_kv_heads][head_dim]` rows into `slots`.
    pub fn write(&mut self, slots: &[u32], k: &[f32], v: &[f32], dtype: KvDtype) {
        let (h, d, bs) = (self.num_kv_heads, self.head_dim, self.block_size);
        for (t, &slot) in slots.iter().enumerate() {
            let (b, o) = (slot as usize / bs, slot as usize % bs);
            for kh in 0..h {
                let dst = ((b * h + kh) * bs + o) * d;
                let src = (t * h + kh) * d;
                for i in 0..d {
                    let (kk, vv) = (k[src + i], v[src + i]);
                    let (kk, vv) = match dtype {
                        KvDtype::F32 => (kk, vv),
                        KvDtype::F16 => (round_f16(kk), round_f16(vv)),
                        // The exact inputs: the quantization error is what
                        // the quantized suites bound.
                        KvDtype::Int8 | KvDtype::Fp8E4M3 => (kk, vv),
                    };
                    self.k[dst + i] = kk;
                    self.v[dst + i] = vv;
                }
            }
        }
    }

    /// Copies block `src` to `dst`.
    pub fn copy(&mut self, src: u32, dst: u32) {
        let per = self.num_kv_heads * self.block_size * self.head_dim;
        let (s, d) = (src as usize * per, dst as usize * per);
        self.k.copy_within(s..s + per, d);
        self.v.copy_within(s..s + per, d);
    }

    pub fn view(&self) -> pagedattn::reference::PagedPool<'_> {
        pagedattn::reference::PagedPool {
            k: &self.k,
            v: &self.v,
            num_kv_heads: self.num_kv_heads,
            block_size: self.block_size,
            head_dim: self.head_dim,
        }
    }
}

/// Sequences of the given lengths, added to a manager whose free list is
/// scrambled, so physical blocks come in shuffled order.
pub fn shuffled_batch(
    rng: &mut SplitMix64,
    num_blocks: u32,
    block_size: u32,
    lens: &[usize],
) -> (BlockManager, Vec<SeqId>, BatchView) {
    let mut m = BlockManager::new(BlockManagerConfig::new(num_blocks, block_size)).unwrap();
    m.scramble_free_list(rng.next_u64());
    let ids: Vec<SeqId> = lens
        .iter()
        .map(|&l| {
            let prompt: Vec<u32> = (0..l).map(|_| rng.below(32000) as u32).collect();
            m.add_sequence(&prompt).unwrap()
        })
        .collect();
    let view = m.batch_view(&ids).unwrap();
    (m, ids, view)
}

/// Blocks needed by sequences of these lengths, plus slack.
pub fn blocks_for(lens: &[usize], block_size: u32, slack: u32) -> u32 {
    lens.iter()
        .map(|&l| l.div_ceil(block_size as usize) as u32)
        .sum::<u32>()
        + slack
}
