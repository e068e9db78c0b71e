//! The engine's kernels (embedding gather, RMSNorm, RoPE, the Q4_1 / Q8_0 /
//! F32 / Q4_K / Q6_K matmuls, tiled and split-K, each staging, with the
//! residual and the SiLU / GELU gate, the tied and untied LM head) on a
//! real adapter against an f64 host model of the same network,
//! on small random models (seeded), with every activation buffer poisoned
//! with NaN first. Needs no model file.
//!
//! Tolerance: logits relative L2 error 1e-4 (f32 accumulation over at most
//! 1280 terms per dot against f64; measured values are printed).

use pagedattn::blocks::{BlockManager, BlockManagerConfig, HybridManager};
use pagedattn::reference::rel_l2;
use pagedattn::rng::SplitMix64;
use pagedattn_model::config::{Activation, ArchSpec, LayerAttn, RopeStyle};
use pagedattn_model::engine::{
    rope_table, DecodeMatmul, EngineConfig, HostLayer, HostMatrix, HostWeights, MatmulStaging,
    Model, Shape, StepInput, WeightFormat,
};
use pagedattn_model::generate::open_device;
use pagedattn_model::gguf::GgmlType;

const TOL: f64 = 1e-4;

/// The default adapter's device; `None` (skip) without one unless
/// `PAGEDATTN_REQUIRE_GPU=1`.
fn device() -> Option<(wgpu::Device, wgpu::Queue, String)> {
    // The tests read PAGEDATTN_BACKEND; the model crate does not.
    let backends = match std::env::var("PAGEDATTN_BACKEND") {
        Ok(name) => {
            pagedattn::gpu::parse_backends(&name).expect("PAGEDATTN_BACKEND names a backend")
        }
        Err(_) => wgpu::Backends::all(),
    };
    match open_device(backends) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("PAGEDATTN_REQUIRE_GPU").is_ok_and(|v| v == "1") => panic!("{e}"),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

fn f16_bytes(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

/// A random matrix in `fmt` whose values are about `scale` in size.
fn random(
    rng: &mut SplitMix64,
    fmt: WeightFormat,
    rows: usize,
    cols: usize,
    scale: f32,
) -> HostMatrix {
    let mut data = Vec::new();
    for _ in 0..rows * cols / fmt.block_elems() {
        match fmt {
            WeightFormat::Q4K => {
                // value = d * sc * q - dmin * m: sc, m up to 63, q up to 15.
                let d = scale / (63.0 * 15.0) * (0.5 + rng.next_f64() as f32);
                data.extend(f16_bytes(d));
                data.extend(f16_bytes(d * 7.0 * (0.5 + rng.next_f64() as f32)));
                data.extend((0..140).map(|_| rng.below(256) as u8));
            }
            WeightFormat::Q6K => {
                data.extend((0..192).map(|_| rng.below(256) as u8));
                data.extend((0..16).map(|_| rng.below(256) as u8));
                data.extend(f16_bytes(
                    scale / (32.0 * 128.0) * (0.5 + rng.next_f64() as f32),
                ));
            }
            WeightFormat::Q4_1 => {
                let d = scale / 8.0 * (0.5 + rng.next_f64() as f32);
                data.extend(f16_bytes(d));
                data.extend(f16_bytes(-7.5 * d + rng.next_signed() * d));
                data.extend((0..16).map(|_| rng.below(256) as u8));
            }
            WeightFormat::Q8_0 => {
                let d = scale / 127.0 * (0.5 + rng.next_f64() as f32);
                data.extend(f16_bytes(d));
                data.extend((0..32).map(|_| rng.below(256) as u8));
            }
            WeightFormat::F32 => {
                for _ in 0..32 {
                    data.extend((rng.next_signed() * scale).to_le_bytes());
                }
            }
        }
    }
    HostMatrix {
        fmt,
        rows,
        cols,
        data,
    }
}

/// Random Q5_0 blocks (as a file holds them), loaded as the engine loads
/// them (widened to Q8_0).
fn random_q5_0(rng: &mut SplitMix64, rows: usize, cols: usize, scale: f32) -> HostMatrix {
    let mut data = Vec::new();
    for _ in 0..rows * cols / 32 {
        data.extend(f16_bytes(scale / 16.0 * (0.5 + rng.next_f64() as f32)));
        data.extend((0..20).map(|_| rng.below(256) as u8));
    }
    HostMatrix::from_gguf(GgmlType::Q5_0, rows, cols, &data).expect("Q5_0 loads")
}

/// A small Gemma-3-shaped model: head_dim 128 over a width of 64, one KV
/// head, Q and K norms, post-norms, the GELU-tanh gate, NeoX RoPE with a
/// local and a global base, a window of 8 on the first layer, a query
/// scale of its own; Q5_0, Q8_0, Q4_K and Q6_K weights.
fn gemma_weights(seed: u64) -> HostWeights {
    let mut rng = SplitMix64::new(seed);
    let (d, hd, heads, ffn) = (64usize, 128usize, 2usize, 256usize);
    let shape = Shape {
        layers: 2,
        d_model: d,
        ffn,
        heads,
        kv_heads: 1,
        head_dim: hd,
        vocab: 120,
        rope_base: 1_000_000.0,
        rms_eps: 1e-6,
        context: 64,
    };
    let norm = |rng: &mut SplitMix64, n: usize| -> Vec<f32> {
        (0..n).map(|_| 0.5 + rng.next_f64() as f32).collect()
    };
    let layers = (0..shape.layers)
        .map(|_| HostLayer {
            attn_norm: norm(&mut rng, d),
            q: random_q5_0(&mut rng, heads * hd, d, 0.3),
            k: random_q5_0(&mut rng, hd, d, 0.3),
            v: random(&mut rng, WeightFormat::Q8_0, hd, d, 0.3),
            o: random(&mut rng, WeightFormat::Q4K, d, heads * hd, 0.1),
            ffn_norm: norm(&mut rng, d),
            gate: random_q5_0(&mut rng, ffn, d, 0.3),
            up: random_q5_0(&mut rng, ffn, d, 0.3),
            down: random(&mut rng, WeightFormat::Q6K, d, ffn, 0.1),
            q_norm: Some(norm(&mut rng, hd)),
            k_norm: Some(norm(&mut rng, hd)),
            post_attn_norm: Some(norm(&mut rng, d)),
            post_ffn_norm: Some(norm(&mut rng, d)),
        })
        .collect();
    let arch = ArchSpec {
        arch: pagedattn_model::config::Arch::Gemma3,
        embed_scale: (d as f32).sqrt(),
        activation: Activation::GeluTanh,
        rope_style: RopeStyle::Halves,
        qk_norm: true,
        post_norms: true,
        attn_scale: Some(0.07),
        layers: vec![
            LayerAttn {
                rope_base: 10_000.0,
                window: Some(8),
            },
            LayerAttn {
                rope_base: 1_000_000.0,
                window: None,
            },
        ],
    };
    HostWeights {
        shape,
        embed: random(&mut rng, WeightFormat::Q8_0, shape.vocab, d, 1.0),
        output: None,
        output_norm: norm(&mut rng, d),
        layers,
        arch,
    }
}

/// A small llama-shaped model; `wide`: an FFN of 1280 (the down matmul's
/// rows span several rounds of the split-K matmul's 64 lanes) and a
/// vocabulary of 70,000 (the head's columns fold past a grid's 65,535).
fn model_weights(seed: u64, embed_fmt: WeightFormat, tied: bool, wide: bool) -> HostWeights {
    let mut rng = SplitMix64::new(seed);
    let (ffn, vocab) = if wide { (1280, 70_000) } else { (96, 120) };
    let shape = Shape {
        layers: 2,
        d_model: 64,
        ffn,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        vocab,
        rope_base: 10000.0,
        rms_eps: 1e-5,
        context: 64,
    };
    let (d, qw, kw) = (64, 128, 64);
    let norm = |rng: &mut SplitMix64| (0..d).map(|_| 0.5 + rng.next_f64() as f32).collect();
    let layers = (0..shape.layers)
        .map(|_| HostLayer {
            attn_norm: norm(&mut rng),
            q: random(&mut rng, WeightFormat::Q4_1, qw, d, 0.3),
            k: random(&mut rng, WeightFormat::Q4_1, kw, d, 0.3),
            v: random(&mut rng, WeightFormat::Q4_1, kw, d, 0.3),
            o: random(&mut rng, WeightFormat::F32, d, qw, 0.1),
            ffn_norm: norm(&mut rng),
            gate: random(&mut rng, WeightFormat::Q8_0, ffn, d, 0.3),
            up: random(&mut rng, WeightFormat::Q8_0, ffn, d, 0.3),
            down: random(&mut rng, WeightFormat::Q4_1, d, ffn, 0.1),
            q_norm: None,
            k_norm: None,
            post_attn_norm: None,
            post_ffn_norm: None,
        })
        .collect();
    HostWeights {
        shape,
        embed: random(&mut rng, embed_fmt, shape.vocab, d, 1.0),
        output: (!tied).then(|| random(&mut rng, WeightFormat::Q4_1, shape.vocab, d, 0.3)),
        output_norm: norm(&mut rng),
        layers,
        arch: ArchSpec::llama(shape.layers, shape.rope_base),
    }
}

fn matvec(m: &HostMatrix, x: &[f64]) -> Vec<f64> {
    (0..m.rows)
        .map(|r| {
            m.row_f32(r)
                .iter()
                .zip(x)
                .map(|(&w, &v)| w as f64 * v)
                .sum()
        })
        .collect()
}

fn rmsnorm(x: &[f64], w: &[f32], eps: f32) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps as f64).sqrt();
    x.iter().zip(w).map(|(v, &g)| v * s * g as f64).collect()
}

/// The f64 host model of one sequence: runs `tokens`, returns the logits
/// of every position.
fn host_logits(w: &HostWeights, tokens: &[u32]) -> Vec<Vec<f64>> {
    let s = w.shape;
    let a = &w.arch;
    let (hd, g) = (s.head_dim, s.heads / s.kv_heads);
    let rope = |v: &mut [f64], pos: usize, base: f32| {
        let table = rope_table(s.context, hd, base);
        for h in 0..v.len() / hd {
            for i in 0..hd / 2 {
                let [c, sn] = table[pos * hd / 2 + i];
                let (c, sn) = (c as f64, sn as f64);
                let (i0, i1) = match a.rope_style {
                    RopeStyle::Adjacent => (h * hd + 2 * i, h * hd + 2 * i + 1),
                    RopeStyle::Halves => (h * hd + i, h * hd + i + hd / 2),
                };
                let (x0, x1) = (v[i0], v[i1]);
                v[i0] = x0 * c - x1 * sn;
                v[i1] = x0 * sn + x1 * c;
            }
        }
    };
    let head_norm = |v: &mut [f64], w: &Option<Vec<f32>>| {
        if let Some(w) = w {
            for h in v.chunks_mut(hd) {
                let n = rmsnorm(h, w, s.rms_eps);
                h.copy_from_slice(&n);
            }
        }
    };
    let scale = a.attn_scale.map_or(1.0 / (hd as f64).sqrt(), f64::from);
    let mut ks: Vec<Vec<Vec<f64>>> = vec![Vec::new(); s.layers];
    let mut vs: Vec<Vec<Vec<f64>>> = vec![Vec::new(); s.layers];
    let mut out = Vec::new();
    for (pos, &t) in tokens.iter().enumerate() {
        let mut x: Vec<f64> = w
            .embed
            .row_f32(t as usize)
            .iter()
            .map(|&v| v as f64 * a.embed_scale as f64)
            .collect();
        for (l, lw) in w.layers.iter().enumerate() {
            let xn = rmsnorm(&x, &lw.attn_norm, s.rms_eps);
            let mut q = matvec(&lw.q, &xn);
            let mut k = matvec(&lw.k, &xn);
            let v = matvec(&lw.v, &xn);
            head_norm(&mut q, &lw.q_norm);
            head_norm(&mut k, &lw.k_norm);
            let la = a.layers[l];
            rope(&mut q, pos, la.rope_base);
            rope(&mut k, pos, la.rope_base);
            // The window: positions within `window` of the newest.
            let first = la
                .window
                .map_or(0, |w| (pos + 1).saturating_sub(w as usize));
            ks[l].push(k);
            vs[l].push(v);
            let mut att = vec![0.0; s.heads * hd];
            for h in 0..s.heads {
                let kvh = h / g;
                let qh = &q[h * hd..(h + 1) * hd];
                let sc: Vec<f64> = (first..=pos)
                    .map(|j| {
                        let kj = &ks[l][j][kvh * hd..(kvh + 1) * hd];
                        qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * scale
                    })
                    .collect();
                let m = sc.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                let e: Vec<f64> = sc.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for i in 0..hd {
                        att[h * hd + i] += ej / z * vs[l][first + j][kvh * hd + i];
                    }
                }
            }
            let mut o = matvec(&lw.o, &att);
            if let Some(pw) = &lw.post_attn_norm {
                o = rmsnorm(&o, pw, s.rms_eps);
            }
            for (xi, oi) in x.iter_mut().zip(o) {
                *xi += oi;
            }
            let xn = rmsnorm(&x, &lw.ffn_norm, s.rms_eps);
            let gt = matvec(&lw.gate, &xn);
            let up = matvec(&lw.up, &xn);
            let hdn: Vec<f64> = gt
                .iter()
                .zip(&up)
                .map(|(&g, u)| match a.activation {
                    Activation::Silu => g / (1.0 + (-g).exp()) * u,
                    Activation::GeluTanh => {
                        let c = (2.0 / std::f64::consts::PI).sqrt();
                        0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u
                    }
                })
                .collect();
            let mut dn = matvec(&lw.down, &hdn);
            if let Some(pw) = &lw.post_ffn_norm {
                dn = rmsnorm(&dn, pw, s.rms_eps);
            }
            for (xi, di) in x.iter_mut().zip(dn) {
                *xi += di;
            }
        }
        let xn = rmsnorm(&x, &w.output_norm, s.rms_eps);
        out.push(matvec(w.output.as_ref().unwrap_or(&w.embed), &xn));
    }
    out
}

/// The tokens each sequence appends before steps 1, 2 and 3: rows of 2, 1
/// and 6 (row tiles 4, 1 and 8; the prefill's 32 rows take tiles of 16).
const APPENDS: [[usize; 2]; 3] = [[1, 1], [1, 0], [3, 3]];

/// The matmul stagings the device runs: workgroup memory always, subgroup
/// shuffles where the device has subgroups of 8 lanes. CI's adapter
/// (lavapipe: Vulkan on the CPU, subgroups of 8) must run both, so a device
/// opened without subgroups fails there instead of skipping the staging.
fn stagings(device: &wgpu::Device, queue: &wgpu::Queue) -> Vec<MatmulStaging> {
    let mut v = vec![MatmulStaging::Workgroup];
    let gpu = pagedattn::gpu::Gpu::from_device(device, queue);
    if MatmulStaging::subgroups_fit(&gpu) {
        v.push(MatmulStaging::Subgroup);
    } else {
        let lavapipe = gpu.info.device_type == wgpu::DeviceType::Cpu
            && gpu.info.backend == wgpu::Backend::Vulkan;
        let required = std::env::var("PAGEDATTN_REQUIRE_GPU").is_ok_and(|v| v == "1");
        assert!(
            !(lavapipe && required),
            "{}: a CPU Vulkan adapter opened without subgroups of 8 lanes; the subgroup matmul would go untested",
            gpu.info.name
        );
        eprintln!(
            "{}: no subgroups of 8 lanes, the subgroup matmul not run",
            gpu.info.name
        );
    }
    v
}

/// Every matmul the device runs: each staging (workgroup memory, and
/// subgroups where there are 8 lanes) for the tiled matmul and for the
/// split-K matmul of decode steps (whose reduction the staging picks).
/// `PAGEDATTN_TEST_DECODE_MATMUL=splitk` keeps the split-K ones only (CI's
/// GL step: the tiled ones are the default there, already run on Vulkan,
/// and each pipeline compiles cold on llvmpipe's GL).
fn matmuls(device: &wgpu::Device, queue: &wgpu::Queue) -> Vec<(MatmulStaging, DecodeMatmul)> {
    let only_splitk = std::env::var("PAGEDATTN_TEST_DECODE_MATMUL").is_ok_and(|v| v == "splitk");
    let mut v = Vec::new();
    for staging in stagings(device, queue) {
        for decode in [DecodeMatmul::Tiled, DecodeMatmul::SplitK] {
            if decode == DecodeMatmul::SplitK || !only_splitk {
                v.push((staging, decode));
            }
        }
    }
    v
}

/// For each matmul the device runs: two sequences through a prefill step
/// (every row's logits, some tiles partly filled) and three decode steps
/// of 2, 1 and 6 rows, against the host model.
fn check(embed_fmt: WeightFormat, tied: bool, wide: bool, seed: u64) {
    let Some((device, queue, adapter)) = device() else {
        return;
    };
    let w = model_weights(seed, embed_fmt, tied, wide);
    let mut counts = Vec::new();
    for (staging, decode) in matmuls(&device, &queue) {
        let cfg = EngineConfig {
            num_blocks: 16,
            max_rows: 32,
            max_logit_rows: 32,
            matmul: staging,
            decode_matmul: decode,
            ..EngineConfig::default()
        };
        let mut model = Model::new(&device, &queue, &w, cfg).expect("model");
        assert_eq!(model.matmul_for(6), decode, "the decode steps' matmul");
        let worst = steps(
            &mut model,
            &w,
            seed,
            &format!("{embed_fmt:?} tied {tied} wide {wide}, {staging:?} {decode:?}"),
        );
        counts.push((decode, model.last_dispatches()));
        eprintln!(
            "{adapter}: {embed_fmt:?} embedding, tied {tied}, wide {wide}, {staging:?} staging, {decode:?} decode matmul: worst logits rel L2 {worst:.2e}"
        );
    }
    fused_norms_dropped_dispatches(&counts, w.shape.layers);
}

/// The last (decode) step's dispatches: split-K runs each layer's two
/// norms inside its QKV and gate/up matmuls, two fewer a layer.
fn fused_norms_dropped_dispatches(counts: &[(DecodeMatmul, usize)], layers: usize) {
    for &(decode, n) in counts {
        for &(other, m) in counts {
            if decode == DecodeMatmul::SplitK && other == DecodeMatmul::Tiled {
                assert_eq!(
                    n + 2 * layers,
                    m,
                    "decode step dispatches: split-K {n}, tiled {m}"
                );
            }
        }
        assert!(n > 0, "{decode:?}: no dispatch counted");
    }
}

/// Runs [`check`]'s steps on `model`; the worst logits error.
fn steps(model: &mut Model, w: &HostWeights, seed: u64, what: &str) -> f64 {
    let mut rng = SplitMix64::new(seed ^ 0xabc);
    // Lengths 13 and 19: prefill tiles of 16 rows, one full and one partial.
    let mut toks: Vec<Vec<u32>> = [13usize, 19]
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| rng.below(w.shape.vocab as u64) as u32)
                .collect()
        })
        .collect();
    // One pool per layer group of the model (a window group releases what
    // its window no longer reads at each view): the engine runs each layer
    // on its group's tables.
    let groups = model.kv_layout().clone();
    let bs = model.cfg.block_size;
    let pools = vec![model.cfg.num_blocks; groups.groups().len()];
    let mut bm = HybridManager::new(groups.clone(), &pools, bs, false).expect("manager");
    let ids: Vec<_> = toks
        .iter()
        .map(|t| bm.add_sequence(t).expect("seq"))
        .collect();
    let mut worst: f64 = 0.0;
    for step in 0..=APPENDS.len() {
        // Before a decode step, each sequence appends its random tokens.
        let mut active = vec![0, 1];
        if step > 0 {
            active.clear();
            for (i, &n) in APPENDS[step - 1].iter().enumerate() {
                let next: Vec<u32> = (0..n)
                    .map(|_| rng.below(w.shape.vocab as u64) as u32)
                    .collect();
                if n > 0 {
                    toks[i].extend(&next);
                    bm.append(&ids[i], &next).expect("append");
                    active.push(i);
                }
            }
        }
        let seqs: Vec<_> = active.iter().map(|&i| ids[i].clone()).collect();
        let views = bm.batch_view(&seqs).expect("view");
        let view = &views[0];
        let more: Vec<_> = views[1..].iter().collect();
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut want = Vec::new();
        let mut logit_rows = Vec::new();
        for (k, &i) in active.iter().enumerate() {
            let t = &toks[i];
            let n = (view.new_indptr[k + 1] - view.new_indptr[k]) as usize;
            let host = host_logits(w, t);
            for p in t.len() - n..t.len() {
                tokens.push(t[p]);
                positions.push(p as u32);
                // Every new row's logits.
                logit_rows.push(tokens.len() as u32 - 1);
                want.extend(host[p].iter().copied());
            }
        }
        model.poison();
        let got = model
            .forward(&StepInput {
                view,
                more: &more,
                tokens: &tokens,
                positions: &positions,
                logit_rows: &logit_rows,
            })
            .expect("forward");
        assert_eq!(got.len(), want.len());
        let err = rel_l2(&got, &want);
        worst = worst.max(err);
        assert!(
            err <= TOL,
            "{what}, step {step} ({} rows): logits rel L2 {err:.3e} over {TOL:.0e}",
            tokens.len()
        );
    }
    if groups.groups().len() > 1 {
        // The window group dropped the blocks behind its window.
        let held = bm.blocks_held(&ids[1]).expect("live");
        let w = groups
            .groups()
            .iter()
            .position(|g| g.kind != pagedattn::blocks::GroupKind::Full);
        let f = groups
            .groups()
            .iter()
            .position(|g| g.kind == pagedattn::blocks::GroupKind::Full);
        if let (Some(w), Some(f)) = (w, f) {
            assert!(held[w] < held[f], "{what}: blocks held per group {held:?}");
        }
    }
    worst
}

#[test]
fn q8_embedding_tied_head_matches_the_f64_model() {
    check(WeightFormat::Q8_0, true, false, 1);
}

#[test]
fn f32_embedding_untied_q4_head_matches_the_f64_model() {
    check(WeightFormat::F32, false, false, 2);
}

#[test]
fn q4_embedding_tied_head_matches_the_f64_model() {
    check(WeightFormat::Q4_1, true, false, 3);
}

/// Rows of 1280 elements (several rounds of the split-K matmul's lanes)
/// and a head of 70,000 columns (its split-K grid folded into y).
#[test]
fn wide_ffn_and_head_match_the_f64_model() {
    check(WeightFormat::Q8_0, false, true, 5);
}

/// Gemma 3's step (Q/K norms, post-norms, GELU-tanh, NeoX RoPE with two
/// bases, a window of 8 on one layer, its own query scale, the embedding
/// scaled) and the Q5_0, Q4_K and Q6_K weights, against the f64 model:
/// the sequences run past the window.
#[test]
fn gemma3_step_matches_the_f64_model() {
    let Some((device, queue, adapter)) = device() else {
        return;
    };
    let w = gemma_weights(4);
    let mut counts = Vec::new();
    for (staging, decode) in matmuls(&device, &queue) {
        // Blocks of 4 tokens, so that the window group's tables drop
        // blocks as the sequences (18 and 23 tokens) pass the window of 8.
        let cfg = EngineConfig {
            num_blocks: 64,
            block_size: 4,
            max_rows: 32,
            max_logit_rows: 32,
            matmul: staging,
            decode_matmul: decode,
            ..EngineConfig::default()
        };
        let mut model = Model::new(&device, &queue, &w, cfg).expect("model");
        assert_eq!(model.num_groups(), 2, "a window group and a full group");
        // Tables of another step for one group, or one group's only, are
        // refused by name before anything runs.
        {
            let mut a = BlockManager::new(BlockManagerConfig::new(64, 4)).expect("manager");
            let x = a.add_sequence(&[1, 2, 3]).expect("seq");
            let y = a.add_sequence(&[4, 5]).expect("seq");
            let vx = a.batch_view(&[x]).expect("view");
            let vy = a.batch_view(&[y]).expect("view");
            let mut step = |more: &[&pagedattn::blocks::BatchView]| {
                model
                    .forward(&StepInput {
                        view: &vx,
                        more,
                        tokens: &[1, 2, 3],
                        positions: &[0, 1, 2],
                        logit_rows: &[2],
                    })
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            };
            let e = step(&[&vy]).expect_err("another step's view");
            assert!(e.contains("another step"), "{e}");
            let e = step(&[]).expect_err("one view for two groups");
            assert!(e.contains("layer groups"), "{e}");
        }
        let worst = steps(&mut model, &w, 4, &format!("gemma3 {staging:?} {decode:?}"));
        counts.push((decode, model.last_dispatches()));
        eprintln!(
            "{adapter}: gemma3-shaped model, {staging:?} staging, {decode:?} decode matmul: worst logits rel L2 {worst:.2e}, {} dispatches a decode step",
            model.last_dispatches()
        );
    }
    fused_norms_dropped_dispatches(&counts, w.shape.layers);
}

/// The K-quant GPU blocks hold what the host dequantizer reads: every
/// element of random Q4_K and Q6_K rows, through the GPU words.
#[test]
fn k_quant_gpu_words_hold_the_file_values() {
    let mut rng = SplitMix64::new(5);
    for fmt in [WeightFormat::Q4K, WeightFormat::Q6K] {
        let m = random(&mut rng, fmt, 3, 512, 1.0);
        let words = m.gpu_words();
        assert_eq!(words.len(), 3 * 16 * fmt.gpu_block_words());
        for r in 0..3 {
            let row = m.row_f32(r);
            for b in 0..16 {
                let blk = &words[(r * 16 + b) * fmt.gpu_block_words()..];
                for e in 0..32 {
                    let v = match fmt {
                        WeightFormat::Q4K => {
                            let (scale, min) = (f32::from_bits(blk[0]), f32::from_bits(blk[1]));
                            let byte = (blk[2 + (e % 16) / 4] >> (8 * (e % 4))) & 0xff;
                            let q = if e < 16 { byte & 15 } else { byte >> 4 };
                            q as f32 * scale + min
                        }
                        _ => {
                            let s = f32::from_bits(blk[e / 16]);
                            let q = (blk[2 + e / 4] >> (8 * (e % 4))) as u8 as i8;
                            s * q as f32
                        }
                    };
                    assert_eq!(
                        v.to_bits(),
                        row[b * 32 + e].to_bits(),
                        "{fmt:?} row {r} block {b} element {e}"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_steps_and_shapes_are_refused() {
    let Some((device, queue, _)) = device() else {
        return;
    };
    let mut w = model_weights(4, WeightFormat::Q8_0, true, false);
    let cfg = EngineConfig {
        num_blocks: 16,
        max_rows: 8,
        max_logit_rows: 4,
        ..EngineConfig::default()
    };
    let mut model = Model::new(&device, &queue, &w, cfg).expect("model");
    let mut bm = BlockManager::new(BlockManagerConfig::new(16, 16)).expect("manager");
    let id = bm.add_sequence(&[1, 2, 3]).expect("seq");
    let view = bm.batch_view(&[id]).expect("view");
    let ok = StepInput {
        view: &view,
        more: &[],
        tokens: &[1, 2, 3],
        positions: &[0, 1, 2],
        logit_rows: &[2],
    };
    for (bad, what) in [
        (
            StepInput {
                tokens: &[1, 2, 500],
                ..ok
            },
            "vocabulary",
        ),
        (
            StepInput {
                positions: &[0, 1, 64],
                ..ok
            },
            "context",
        ),
        (
            StepInput {
                positions: &[0, 1],
                ..ok
            },
            "match",
        ),
        (
            StepInput {
                logit_rows: &[3],
                ..ok
            },
            "outside",
        ),
        (
            StepInput {
                logit_rows: &[0, 1, 2, 2, 2],
                ..ok
            },
            "logit rows",
        ),
        (
            // A second group's view for a model whose layers share one pool.
            StepInput {
                more: &[&view],
                ..ok
            },
            "layer groups",
        ),
    ] {
        let e = model.forward(&bad).expect_err(what).to_string();
        assert!(e.contains(what), "{what}: {e}");
    }
    assert_eq!(model.forward(&ok).expect("ok").len(), 120);
    // A step of prompt chunks only asks for no logits.
    let none = StepInput {
        logit_rows: &[],
        ..ok
    };
    assert!(model.forward(&none).expect("no logits").is_empty());
    // The subgroup matmul on a device opened without subgroups is refused
    // by name (the adapter's own device, without features).
    let info = device.adapter_info();
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = info.backend.into();
    let adapter =
        pollster::block_on(wgpu::Instance::new(desc).request_adapter(&Default::default()))
            .expect("the same adapter again");
    let (plain, plain_q) = pollster::block_on(adapter.request_device(&Default::default()))
        .expect("a device without features");
    let sub = EngineConfig {
        matmul: MatmulStaging::Subgroup,
        ..cfg
    };
    let e = Model::new(&plain, &plain_q, &w, sub)
        .err()
        .expect("subgroup matmul refused without subgroups")
        .to_string();
    assert!(e.contains("subgroups of at least 8 lanes"), "{e}");
    // Auto there runs the workgroup staging.
    let mut auto = Model::new(&plain, &plain_q, &w, cfg).expect("auto without subgroups");
    assert_eq!(auto.forward(&ok).expect("ok").len(), 120);
    // A weight of the wrong shape is refused before anything is made.
    w.layers[1].k.rows -= 1;
    let e = Model::new(&device, &queue, &w, cfg)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("blk.1.attn_k"), "{e}");
}
