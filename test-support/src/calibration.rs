//! The quantization calibration checks, driven by arbitrary bytes:
//! `KvCacheConfig::check_fp8_scales`, `check_k_smoothing` and
//! `check_k_outlier_channels` (what `KvCache::set_fp8_scales`,
//! `set_k_smoothing` and `set_k_outlier_channels` run before anything
//! reaches the GPU), and the calibration helpers, whose output must always
//! pass them. None needs an adapter. Each check must never panic and must
//! accept exactly what an independent statement of its contract accepts.
//! Shared by the fuzz target (`fuzz/fuzz_targets/calibration.rs`) and its
//! corpus replay (`tests/fuzz_corpus_gpu_args.rs`).
//!
//! An input is a sequence of cases, a tag byte each: a configuration
//! (KV heads, head_dim), then fp8 scales, smoothing factors or outlier
//! lists of a length near the right one with values from a palette (the
//! range bounds and just past them, 0, negatives, NaN, infinities,
//! subnormals, f32::MAX, ordinary values), or sample rows for the
//! calibration helpers (ordinary, huge, tiny, non-finite).
#![allow(dead_code)]

use pagedattn::gpu::{
    KvCache, KvCacheConfig, KvDtype, FP8_SCALE_RANGE, K_OUTLIERS, K_OUTLIER_UNUSED,
    K_SMOOTHING_RANGE,
};

pub use crate::harness;

tally! {
    /// What one input reached.
    pub struct Reached: usize {
        fp8_ok: "fp8 scales accepted",
        fp8_err: "fp8 scales refused",
        smoothing_ok: "smoothing accepted",
        smoothing_err: "smoothing refused",
        outliers_ok: "outliers accepted",
        outliers_err: "outliers refused",
        calibrated: "calibrations checked",
    }
}

/// The input, read a byte at a time.
type Cursor<'a> = harness::Input<'a>;

impl Cursor<'_> {
    /// A value from the palette around `range`.
    fn value(&mut self, range: [f32; 2]) -> f32 {
        let [lo, hi] = range;
        match self.byte() % 16 {
            0 => f32::NAN,
            1 => f32::INFINITY,
            2 => f32::NEG_INFINITY,
            3 => 0.0,
            4 => -1.0,
            5 => f32::MAX,
            6 => f32::from_bits(1), // the smallest subnormal, 1e-45
            7 => lo,
            8 => hi,
            9 => f32::from_bits(lo.to_bits() - 1),
            10 => f32::from_bits(hi.to_bits() + 1),
            11 => 1e-20,
            _ => 1.0 + self.byte() as f32 / 8.0,
        }
    }

    /// A length near `n`.
    fn len(&mut self, n: usize) -> usize {
        match self.byte() % 8 {
            0 => 0,
            1 => n + 1,
            2 => n.saturating_sub(1),
            _ => n,
        }
    }

    /// A sample row value for the calibration helpers.
    fn sample(&mut self) -> f32 {
        match self.byte() % 10 {
            0 => f32::MAX,
            1 => -f32::MAX,
            2 => f32::NAN,
            3 => f32::INFINITY,
            4 => 1e-40,
            5 => 0.0,
            6 => 1e30,
            _ => (self.byte() as f32 - 128.0) / 16.0,
        }
    }
}

fn in_range(x: f32, [lo, hi]: [f32; 2]) -> bool {
    x >= lo && x <= hi
}

/// Runs every case the input asks for.
pub fn run(data: &[u8]) -> Reached {
    let mut c = Cursor::new(data);
    let mut r = Reached::default();
    while !c.done() {
        let tag = c.byte();
        let cfg = KvCacheConfig {
            num_layers: 1,
            num_blocks: 1,
            block_size: 16,
            num_kv_heads: 1 + c.byte() as u32 % 4,
            head_dim: 4 * (1 + c.byte() as u32 % 64),
            dtype: if tag & 16 != 0 {
                KvDtype::Int8
            } else {
                KvDtype::Fp8E4M3
            },
            layer_group: 0,
        };
        let h = cfg.num_kv_heads as usize;
        let d = cfg.head_dim as usize;
        match tag % 4 {
            0 => {
                let (nk, nv) = (c.len(h), c.len(h));
                let k: Vec<f32> = (0..nk).map(|_| c.value(FP8_SCALE_RANGE)).collect();
                let v: Vec<f32> = (0..nv).map(|_| c.value(FP8_SCALE_RANGE)).collect();
                let want =
                    nk == h && nv == h && k.iter().chain(&v).all(|&x| in_range(x, FP8_SCALE_RANGE));
                let got = cfg.check_fp8_scales(&k, &v);
                assert_eq!(got.is_ok(), want, "fp8 scales {k:?} {v:?}: {got:?}");
                if want {
                    r.fp8_ok += 1
                } else {
                    r.fp8_err += 1
                }
            }
            1 => {
                let n = c.len(h * d);
                // One value from the palette, the rest ordinary (or all).
                let odd = c.value(K_SMOOTHING_RANGE);
                let at = c.byte() as usize;
                let all = tag & 32 != 0;
                let f: Vec<f32> = (0..n)
                    .map(|i| if all || i == at % n.max(1) { odd } else { 1.0 })
                    .collect();
                let want = n == h * d && f.iter().all(|&x| in_range(x, K_SMOOTHING_RANGE));
                let got = cfg.check_k_smoothing(&f);
                assert_eq!(got.is_ok(), want, "smoothing {odd} at {at}: {got:?}");
                if want {
                    r.smoothing_ok += 1
                } else {
                    r.smoothing_err += 1
                }
            }
            2 => {
                let n = c.len(h * K_OUTLIERS as usize);
                let ch: Vec<u32> = (0..n)
                    .map(|_| match c.byte() % 6 {
                        0 => K_OUTLIER_UNUSED,
                        1 => K_OUTLIER_UNUSED - 1,
                        2 => cfg.head_dim,
                        3 => cfg.head_dim - 1,
                        _ => c.byte() as u32 % cfg.head_dim.min(8),
                    })
                    .collect();
                let heads_ok = ch.chunks(K_OUTLIERS as usize).all(|head| {
                    head.iter().enumerate().all(|(j, &x)| {
                        x == K_OUTLIER_UNUSED || (x < cfg.head_dim && !head[..j].contains(&x))
                    })
                });
                let want = n == h * K_OUTLIERS as usize && heads_ok;
                let got = cfg.check_k_outlier_channels(&ch);
                assert_eq!(got.is_ok(), want, "outliers {ch:?} (head_dim {d}): {got:?}");
                if want {
                    r.outliers_ok += 1
                } else {
                    r.outliers_err += 1
                }
            }
            _ => {
                let rows = 1 + c.byte() as usize % 4;
                let x: Vec<f32> = (0..rows * h * d).map(|_| c.sample()).collect();
                let sm = KvCache::calibrate_k_smoothing(&cfg, &x);
                cfg.check_k_smoothing(&sm)
                    .expect("calibrated smoothing passes its check");
                let sc = KvCache::calibrate_fp8_scales(&cfg, &x);
                cfg.check_fp8_scales(&sc, &sc)
                    .expect("calibrated fp8 scales pass their check");
                let ch = KvCache::calibrate_k_outlier_channels(&cfg, &x);
                cfg.check_k_outlier_channels(&ch)
                    .expect("calibrated outliers pass their check");
                r.calibrated += 1;
            }
        }
    }
    r
}
