//! Synthetic models (`pagedattn_model::synthetic`): every shape loads
//! through the real loader with a layer or two, runs a prefill and a
//! decode step on the default adapter, and gives finite logits that are
//! not all equal; the bytes are a function of the seed; the shapes and
//! formats are the real files' (where they are in `models/`).
//!
//! The GPU cases skip without an adapter, and fail instead with
//! `PAGEDATTN_REQUIRE_GPU=1`. The cases take one lock: one model on the
//! adapter at a time (the 8B shapes' embedding and LM head are 0.3 and
//! 0.4 GB each).

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use pagedattn::blocks::{BlockManager, BlockManagerConfig};
use pagedattn_model::config::{model_required, Arch};
use pagedattn_model::engine::{EngineConfig, Model, StepInput};
use pagedattn_model::generate::open_device;
use pagedattn_model::gguf::{Gguf, Value};
use pagedattn_model::synthetic::{Synthetic, SyntheticArch};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn backends() -> wgpu::Backends {
    match std::env::var("PAGEDATTN_BACKEND") {
        Ok(name) => {
            pagedattn::gpu::parse_backends(&name).expect("PAGEDATTN_BACKEND names a backend")
        }
        Err(_) => wgpu::Backends::all(),
    }
}

/// The default adapter's device; `None` (skip) without one unless
/// `PAGEDATTN_REQUIRE_GPU=1`.
fn device(test: &str) -> Option<(wgpu::Device, wgpu::Queue, String)> {
    match open_device(backends()) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("PAGEDATTN_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("{test}: {e}")
        }
        Err(e) => {
            eprintln!("{test}: skipped: {e}");
            None
        }
    }
}

/// Loads `layers` layers of `arch`, runs a prefill of 12 tokens and one
/// decode step, and checks both steps' logits.
fn steps(arch: SyntheticArch, layers: usize) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let test = format!("synthetic {arch}");
    let t0 = Instant::now();
    let s = Synthetic::new(arch).with_layers(layers).unwrap();
    let l = s.load().expect("a synthetic model loads");
    let load_s = t0.elapsed().as_secs_f64();
    assert_eq!(l.config.n_layers, layers);
    assert_eq!(l.weights.layers.len(), layers);
    let want_arch = match arch {
        SyntheticArch::Gemma3_270M => Arch::Gemma3,
        _ => Arch::Llama,
    };
    assert_eq!(l.config.arch.arch, want_arch);
    assert_eq!(l.tokenizer.vocab_size(), l.config.vocab_size);
    let Some((device, queue, adapter)) = device(&test) else {
        return;
    };
    let cfg = EngineConfig {
        num_blocks: 8,
        max_rows: 16,
        max_logit_rows: 1,
        // One block manager drives every layer here.
        layer_groups: false,
        ..EngineConfig::default()
    };
    let mut model = Model::new(&device, &queue, &l.weights, cfg).expect("the model builds");
    let built_s = t0.elapsed().as_secs_f64();
    let mut bm = BlockManager::new(BlockManagerConfig::new(8, 16)).unwrap();
    let prompt = l
        .tokenizer
        .encode_prompt(&l.tokenizer.chat_prompt("Tell me a story", None))
        .unwrap();
    let prompt = &prompt[..prompt.len().min(12)];
    let id = bm.add_sequence(prompt).unwrap();
    let view = bm.batch_view(&[id]).unwrap();
    let positions: Vec<u32> = (0..prompt.len() as u32).collect();
    let vocab = l.config.vocab_size;
    let check = |logits: &[f32], what: &str| {
        assert_eq!(logits.len(), vocab, "{arch} {what}");
        assert!(
            logits.iter().all(|x| x.is_finite()),
            "{arch} {what}: a logit is not finite"
        );
        let mean = logits.iter().map(|&x| f64::from(x)).sum::<f64>() / vocab as f64;
        let var = logits
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / vocab as f64;
        let std = var.sqrt();
        assert!(
            (0.05..50.0).contains(&std),
            "{arch} {what}: logits' standard deviation {std}"
        );
        std
    };
    let logits = model
        .forward(&StepInput {
            view: &view,
            more: &[],
            tokens: prompt,
            positions: &positions,
            logit_rows: &[prompt.len() as u32 - 1],
        })
        .expect("prefill");
    let std_prefill = check(&logits, "prefill");
    let next = argmax(&logits);
    // Random weights, but not a model that repeats its input (a tied LM
    // head can make the input token's own logit win every step).
    let last = *prompt.last().unwrap();
    assert_ne!(next, last, "{arch}: the prefill's argmax is its last token");
    bm.append(id, &[next]).unwrap();
    let view = bm.batch_view(&[id]).unwrap();
    let logits = model
        .forward(&StepInput {
            view: &view,
            more: &[],
            tokens: &[next],
            positions: &[prompt.len() as u32],
            logit_rows: &[0],
        })
        .expect("decode");
    let std_decode = check(&logits, "decode");
    assert_ne!(
        argmax(&logits),
        next,
        "{arch}: the decode's argmax is its token"
    );
    eprintln!(
        "{} on {adapter}: {:.0} MB of GGUF written and loaded in {load_s:.1} s, on the device at {built_s:.1} s, two steps by {:.1} s; logits' std {std_prefill:.2} (prefill), {std_decode:.2} (decode)",
        s.describe(),
        l.file_bytes as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn smollm2_135m_steps_with_finite_logits() {
    steps(SyntheticArch::SmolLm2_135M, 2);
}

/// Six layers: five window layers and the full one.
#[test]
fn gemma3_270m_steps_with_finite_logits() {
    steps(SyntheticArch::Gemma3_270M, 6);
}

#[test]
fn llama3_8b_steps_with_finite_logits() {
    steps(SyntheticArch::Llama3_8B, 1);
}

#[test]
fn qwen3_8b_steps_with_finite_logits() {
    steps(SyntheticArch::Qwen3_8B, 1);
}

/// Every layer of the full depth keeps the activations in range: the
/// whole SmolLM2 shape (30 layers) gives logits of modest size.
#[test]
fn smollm2_135m_at_full_depth_steps_with_finite_logits() {
    steps(SyntheticArch::SmolLm2_135M, 30);
}

#[test]
fn the_bytes_are_a_function_of_the_seed() {
    let s = Synthetic::new(SyntheticArch::SmolLm2_135M)
        .with_layers(1)
        .unwrap();
    let a = s.gguf_bytes();
    assert_eq!(a, s.gguf_bytes(), "the same seed gives the same bytes");
    let b = s.with_seed(1).gguf_bytes();
    assert_eq!(a.len(), b.len());
    assert_ne!(a, b, "another seed gives other weights");
    // Only the data and the name (which says the seed) differ: the
    // metadata's values and the tensor infos are the same.
    let (ga, gb) = (Gguf::parse(a).unwrap(), Gguf::parse(b).unwrap());
    assert_eq!(ga.tensor_infos(), gb.tensor_infos());
    let name = |g: &Gguf| g.get_str("general.name").unwrap().to_string();
    assert_ne!(name(&ga), name(&gb));
    for t in ga.tensor_infos() {
        let (da, db) = (ga.tensor(&t.name).unwrap(), gb.tensor(&t.name).unwrap());
        assert_ne!(da.data, db.data, "{}", t.name);
    }
}

/// `<repo>/models/<file>`, or `None` (skip, saying so) when absent and
/// not required.
fn real_file(test: &str, file: &str) -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models")
        .join(file);
    if path.is_file() {
        return Some(path);
    }
    if model_required() {
        panic!("{test}: {} not found", path.display());
    }
    eprintln!("{test}: skipped: {} not found", path.display());
    None
}

/// The synthetic file has the real file's tensors (names, shapes, types)
/// and its model metadata (every `<arch>.*` key, and the tokenizer's ids).
fn same_shape_as(arch: SyntheticArch, file: &str) {
    let Some(path) = real_file(arch.name(), file) else {
        return;
    };
    let real = Gguf::open(&path).unwrap();
    let ours = Gguf::parse(Synthetic::new(arch).gguf_bytes()).unwrap();
    let infos = |g: &Gguf| {
        let mut v: Vec<_> = g
            .tensor_infos()
            .iter()
            .map(|t| (t.name.clone(), t.dims.clone(), t.ty))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    assert_eq!(infos(&ours), infos(&real), "{arch}: tensors");
    let prefix = real.get_str("general.architecture").unwrap().to_string();
    for (k, v) in real.metadata() {
        let model_key = k.starts_with(&format!("{prefix}."));
        let id_key = k.starts_with("tokenizer.ggml.") && k.ends_with("_id");
        if !(model_key || id_key || k == "tokenizer.ggml.add_bos_token") {
            continue;
        }
        let got = ours.get(k).unwrap_or_else(|| panic!("{arch}: no {k}"));
        let same = match (v, got) {
            (Value::F32(a), Value::F32(b)) => (a - b).abs() <= 1e-6 * a.abs(),
            _ => v == got,
        };
        assert!(same, "{arch}: {k} is {got:?}, the file's {v:?}");
    }
    let n = |g: &Gguf| g.get_str_array("tokenizer.ggml.tokens").unwrap().len();
    assert_eq!(n(&ours), n(&real), "{arch}: vocabulary size");
}

#[test]
fn smollm2_135m_has_the_real_files_shapes() {
    same_shape_as(
        SyntheticArch::SmolLm2_135M,
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    );
}

#[test]
fn gemma3_270m_has_the_real_files_shapes() {
    same_shape_as(SyntheticArch::Gemma3_270M, "gemma-3-270m-q4_k_m.gguf");
}
