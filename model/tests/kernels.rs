//! The engine's kernels (embedding gather, RMSNorm, RoPE, the Q4_1 / Q8_0 /
//! F32 matmuls with the residual and the SiLU gate, the tied and untied LM
//! head) on a real adapter against an f64 host model of the same network,
//! on small random models (seeded), with every activation buffer poisoned
//! with NaN first. Needs no model file.
//!
//! Tolerance: logits relative L2 error 1e-4 (f32 accumulation over at most
//! 128 terms per dot against f64; measured values are printed).

use pagedattn::blocks::{BlockManager, BlockManagerConfig};
use pagedattn::reference::rel_l2;
use pagedattn::rng::SplitMix64;
use pagedattn_model::engine::{
    rope_table, EngineConfig, HostLayer, HostMatrix, HostWeights, MatmulStaging, Model, Shape,
    StepInput, WeightFormat,
};
use pagedattn_model::generate::open_device;

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
    for _ in 0..rows * cols / 32 {
        match fmt {
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

fn model_weights(seed: u64, embed_fmt: WeightFormat, tied: bool) -> HostWeights {
    let mut rng = SplitMix64::new(seed);
    let shape = Shape {
        layers: 2,
        d_model: 64,
        ffn: 96,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        vocab: 120,
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
            gate: random(&mut rng, WeightFormat::Q8_0, 96, d, 0.3),
            up: random(&mut rng, WeightFormat::Q8_0, 96, d, 0.3),
            down: random(&mut rng, WeightFormat::Q4_1, d, 96, 0.1),
        })
        .collect();
    HostWeights {
        shape,
        embed: random(&mut rng, embed_fmt, shape.vocab, d, 1.0),
        output: (!tied).then(|| random(&mut rng, WeightFormat::Q4_1, shape.vocab, d, 0.3)),
        output_norm: norm(&mut rng),
        layers,
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
    let (hd, g) = (s.head_dim, s.heads / s.kv_heads);
    let table = rope_table(s.context, hd, s.rope_base);
    let rope = |v: &mut [f64], pos: usize| {
        for h in 0..v.len() / hd {
            for i in 0..hd / 2 {
                let [c, sn] = table[pos * hd / 2 + i];
                let (c, sn) = (c as f64, sn as f64);
                let (a, b) = (v[h * hd + 2 * i], v[h * hd + 2 * i + 1]);
                v[h * hd + 2 * i] = a * c - b * sn;
                v[h * hd + 2 * i + 1] = a * sn + b * c;
            }
        }
    };
    let mut ks: Vec<Vec<Vec<f64>>> = vec![Vec::new(); s.layers];
    let mut vs: Vec<Vec<Vec<f64>>> = vec![Vec::new(); s.layers];
    let mut out = Vec::new();
    for (pos, &t) in tokens.iter().enumerate() {
        let mut x: Vec<f64> = w
            .embed
            .row_f32(t as usize)
            .iter()
            .map(|&v| v as f64)
            .collect();
        for (l, lw) in w.layers.iter().enumerate() {
            let xn = rmsnorm(&x, &lw.attn_norm, s.rms_eps);
            let mut q = matvec(&lw.q, &xn);
            let mut k = matvec(&lw.k, &xn);
            let v = matvec(&lw.v, &xn);
            rope(&mut q, pos);
            rope(&mut k, pos);
            ks[l].push(k);
            vs[l].push(v);
            let mut att = vec![0.0; s.heads * hd];
            for h in 0..s.heads {
                let kvh = h / g;
                let qh = &q[h * hd..(h + 1) * hd];
                let sc: Vec<f64> = (0..=pos)
                    .map(|j| {
                        let kj = &ks[l][j][kvh * hd..(kvh + 1) * hd];
                        qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                let e: Vec<f64> = sc.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for i in 0..hd {
                        att[h * hd + i] += ej / z * vs[l][j][kvh * hd + i];
                    }
                }
            }
            for (xi, oi) in x.iter_mut().zip(matvec(&lw.o, &att)) {
                *xi += oi;
            }
            let xn = rmsnorm(&x, &lw.ffn_norm, s.rms_eps);
            let gt = matvec(&lw.gate, &xn);
            let up = matvec(&lw.up, &xn);
            let hdn: Vec<f64> = gt
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            for (xi, di) in x.iter_mut().zip(matvec(&lw.down, &hdn)) {
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

/// For each matmul staging the device runs: two sequences through a
/// prefill step (every row's logits, some tiles partly filled) and three
/// decode steps of 2, 1 and 6 rows, against the host model.
fn check(embed_fmt: WeightFormat, tied: bool, seed: u64) {
    let Some((device, queue, adapter)) = device() else {
        return;
    };
    let w = model_weights(seed, embed_fmt, tied);
    for staging in stagings(&device, &queue) {
        let cfg = EngineConfig {
            num_blocks: 16,
            max_rows: 32,
            max_logit_rows: 32,
            matmul: staging,
            ..EngineConfig::default()
        };
        let mut model = Model::new(&device, &queue, &w, cfg).expect("model");
        let worst = steps(
            &mut model,
            &w,
            seed,
            &format!("{embed_fmt:?} tied {tied}, {staging:?}"),
        );
        eprintln!(
            "{adapter}: {embed_fmt:?} embedding, tied {tied}, {staging:?} matmul: worst logits rel L2 {worst:.2e}"
        );
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
    let mut bm = BlockManager::new(BlockManagerConfig::new(16, 16)).expect("manager");
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
                    bm.append(ids[i], &next).expect("append");
                    active.push(i);
                }
            }
        }
        let seqs: Vec<_> = active.iter().map(|&i| ids[i]).collect();
        let view = bm.batch_view(&seqs).expect("view");
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
                view: &view,
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
    worst
}

#[test]
fn q8_embedding_tied_head_matches_the_f64_model() {
    check(WeightFormat::Q8_0, true, 1);
}

#[test]
fn f32_embedding_untied_q4_head_matches_the_f64_model() {
    check(WeightFormat::F32, false, 2);
}

#[test]
fn q4_embedding_tied_head_matches_the_f64_model() {
    check(WeightFormat::Q4_1, true, 3);
}

#[test]
fn bad_steps_and_shapes_are_refused() {
    let Some((device, queue, _)) = device() else {
        return;
    };
    let mut w = model_weights(4, WeightFormat::Q8_0, true);
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
