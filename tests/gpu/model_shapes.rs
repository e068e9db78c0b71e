//! Every real model shape in the table, decode (every kernel variant) and
//! chunked prefill, f32 and f16 KV (and bf16 for the 2025-26 rows), with
//! each model's window, sinks, soft-cap or ALiBi, against the f64
//! reference on a real adapter: fresh random inputs (seed printed),
//! shuffled blocks, output poisoned (NaN) first. Tolerance: relative L2 <
//! 1e-5 (f32 and bf16 KV over the rounded mirror), < 2e-3 (f16). Each kernel stays within WebGPU's default 16 KiB of workgroup
//! memory, and no GQA group is refused: large and odd groups are tiled.

use crate::common;

use common::*;
use pagedattn::gpu::{
    AttnOptions, Gpu, Kernel, KvCache, KvCacheConfig, KvDtype, PagedAttention,
    PORTABLE_WORKGROUP_BYTES,
};
use pagedattn::reference::{self, rel_l2};
use pagedattn::rng::SplitMix64;

struct Model {
    name: &'static str,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    window: Option<u32>,
    /// Some layers have no window (gpt-oss alternates, Gemma-3 has one
    /// global layer in six): those run too.
    global_layers: bool,
    soft_cap: Option<f32>,
    alibi: bool,
    /// A learned sink logit per query head (gpt-oss).
    sinks: bool,
    /// A bf16 pool runs too (the 2025-26 rows: their checkpoints' dtype).
    bf16: bool,
}

const fn m(name: &'static str, heads: u32, kv_heads: u32, head_dim: u32) -> Model {
    Model {
        name,
        heads,
        kv_heads,
        head_dim,
        window: None,
        global_layers: false,
        soft_cap: None,
        alibi: false,
        sinks: false,
        bf16: false,
    }
}

/// A 2025-26 row: its bf16 pool runs too.
const fn new(md: Model) -> Model {
    Model { bf16: true, ..md }
}

fn models() -> Vec<Model> {
    vec![
        m("Llama-3-8B", 32, 8, 128),
        m("Llama-3.2-1B", 32, 8, 64),
        m("Qwen2.5-7B", 28, 4, 128),
        m("Qwen2.5-0.5B", 14, 2, 64),
        Model {
            window: Some(4096),
            ..m("Mistral-7B", 32, 8, 128)
        },
        Model {
            window: Some(4096),
            soft_cap: Some(50.0),
            ..m("Gemma-2-2B", 8, 4, 256)
        },
        m("Phi-3-mini", 32, 32, 96),
        m("Falcon-7B", 71, 1, 64),
        m("StarCoder2-15B", 48, 4, 128),
        m("Llama-3-70B", 64, 8, 128),
        m("GPT-2", 12, 12, 64),
        Model {
            alibi: true,
            ..m("MPT-7B", 32, 32, 128)
        },
        // 2025-26 models.
        Model {
            window: Some(128),
            global_layers: true,
            sinks: true,
            bf16: true,
            ..m("gpt-oss-20b", 64, 8, 64)
        },
        Model {
            window: Some(1024),
            global_layers: true,
            bf16: true,
            ..m("Gemma-3-4B", 8, 4, 256)
        },
        Model {
            window: Some(1024),
            global_layers: true,
            bf16: true,
            ..m("Gemma-3-27B", 32, 16, 128)
        },
        new(m("Qwen3-8B", 32, 8, 128)),
        new(m("Qwen3-0.6B", 16, 8, 128)),
        new(m("SmolLM2-135M", 9, 3, 64)),
    ]
}

/// Sink logits of `n` heads, spread over the range a trained model shows.
fn sink_logits(n: u32) -> Vec<f32> {
    (0..n).map(|h| (h as f32 * 0.37).sin() * 3.0).collect()
}

/// ALiBi slopes of `n` heads (n a power of two): 2^(-8 (h + 1) / n).
fn alibi(n: u32) -> Vec<f32> {
    (0..n)
        .map(|h| 2f32.powf(-8.0 * (h as f32 + 1.0) / n as f32))
        .collect()
}

/// Decode lengths and prefill (context, chunk) pairs: block edges, a
/// single token, a few hundred tokens.
const DECODE_LENS: [usize; 3] = [1, 45, 260];
const PREFILL: [(usize, usize); 3] = [(45, 45), (260, 20), (17, 1)];

fn run_model(gpu: &Gpu, md: &Model, dtype: KvDtype, window: Option<u32>) {
    let name = format!(
        "{} {dtype:?}{}",
        md.name,
        window.map_or(String::new(), |w| format!(" window {w}"))
    );
    let s = seed(&name);
    let mut rng = SplitMix64::new(s);
    let lens: Vec<usize> = DECODE_LENS.to_vec();
    let bs = 16;
    let nb = blocks_for(&lens, bs, 3) + blocks_for(&PREFILL.map(|p| p.0), bs, 3);
    let cfg = KvCacheConfig::new(nb, bs, md.kv_heads, md.head_dim).with_dtype(dtype);
    let cache = KvCache::new(gpu, cfg).unwrap();
    let mut all: Vec<usize> = lens.clone();
    all.extend(PREFILL.iter().map(|p| p.0));
    let (_m, _ids, view) = shuffled_batch(&mut rng, nb, bs, &all);
    let row = (md.kv_heads * md.head_dim) as usize;
    let ntok = view.slot_mapping.len();
    let (k, v) = (rng.signed_vec(ntok * row), rng.signed_vec(ntok * row));
    cache.write_kv(gpu, 0, &k, &v, &view.slot_mapping).unwrap();
    let mut host = HostPool::new(
        nb as usize,
        md.kv_heads as usize,
        bs as usize,
        md.head_dim as usize,
    );
    host.write(&view.slot_mapping, &k, &v, Stored::from(dtype));
    let opts = AttnOptions {
        sliding_window: window,
        soft_cap: md.soft_cap,
        alibi_slopes: md.alibi.then(|| alibi(md.heads)),
        sinks: md.sinks.then(|| sink_logits(md.heads)),
        ..Default::default()
    };
    let p = ref_params(md.heads, md.head_dim, &opts);
    // The host mirror holds the pool's rounded values: f32 and bf16 pools
    // agree to f32 rounding (as gpu_decode::mixed_batch_bf16 checks); f16
    // at the bound this table has always used.
    let tol = if dtype == KvDtype::F16 { 2e-3 } else { 1e-5 };
    let hd = md.head_dim as usize;
    let nh = md.heads as usize;

    // Decode: the first sequences of the view.
    let nd = lens.len();
    let ip = &view.kv_indptr[..=nd];
    let ix = &view.kv_indices[..view.kv_indptr[nd] as usize];
    let ln = &view.seq_lens[..nd];
    let q: Vec<f32> = rng.signed_vec(nd * nh * hd);
    let want = reference::decode(&host.view(), &p, &q, ip, ix, ln);
    let eligible = PagedAttention::eligible_kernels(gpu, &cache, md.heads);
    // Every kernel runs every shape.
    let kernels: Vec<Kernel> = Kernel::ALL.to_vec();
    assert_eq!(eligible, kernels, "{name}: every kernel runs this shape");
    for kernel in kernels {
        let attn = PagedAttention::new(
            gpu,
            &cache,
            md.heads,
            &pagedattn::gpu::AttentionConfig::new().kernel(kernel),
        )
        .unwrap();
        let (wd, wp) = attn.workgroup_bytes();
        assert!(
            wd <= PORTABLE_WORKGROUP_BYTES && wp <= PORTABLE_WORKGROUP_BYTES,
            "{name} [{kernel}]: {wd} / {wp} bytes of workgroup memory"
        );
        let out = attn.decode(gpu, &cache, 0, &q, ip, ix, ln, &opts).unwrap();
        let err = rel_l2(&out, &want);
        eprintln!(
            "{name} decode [{kernel}, head tile {}]: rel L2 {err:.3e} (tolerance {tol:.0e})",
            attn.decode_head_tile()
        );
        assert!(
            err < tol,
            "{name} decode [{kernel}]: rel L2 {err:.3e} on {} (seed {s})",
            gpu.describe()
        );
    }

    // Chunked prefill: the remaining sequences, each with its newest tokens as queries.
    let attn = PagedAttention::new(gpu, &cache, md.heads, &Default::default()).unwrap();
    let base = view.kv_indptr[nd];
    let ip: Vec<u32> = view.kv_indptr[nd..].iter().map(|x| x - base).collect();
    let ix = &view.kv_indices[base as usize..];
    let ln = &view.seq_lens[nd..];
    let mut qo = vec![0u32];
    for pr in PREFILL {
        qo.push(qo.last().unwrap() + pr.1 as u32);
    }
    let q: Vec<f32> = rng.signed_vec(*qo.last().unwrap() as usize * nh * hd);
    let want = reference::prefill(&host.view(), &p, &q, &qo, &ip, ix, ln);
    let out = attn
        .prefill(gpu, &cache, 0, &q, &qo, &ip, ix, ln, &opts)
        .unwrap();
    let err = rel_l2(&out, &want);
    eprintln!("{name} prefill: rel L2 {err:.3e} (tolerance {tol:.0e})");
    assert!(
        err < tol,
        "{name} prefill: rel L2 {err:.3e} on {} (seed {s})",
        gpu.describe()
    );
}

/// Every run of one model: f32 and f16 KV (and bf16 for the 2025-26 rows),
/// a window shorter than the contexts where the model has one, and the
/// layers without a window where the model mixes them.
fn model_row(name: &str) {
    let Some(gpu) = gpu() else { return };
    let md = models().into_iter().find(|m| m.name == name);
    let md = md.unwrap_or_else(|| panic!("{name} is not in the model table"));
    for dtype in [KvDtype::F32, KvDtype::F16] {
        run_model(&gpu, &md, dtype, md.window);
    }
    if md.bf16 {
        run_model(&gpu, &md, KvDtype::Bf16, md.window);
    }
    if md.window.is_some() {
        run_model(&gpu, &md, KvDtype::F16, Some(100));
    }
    if md.global_layers {
        run_model(&gpu, &md, KvDtype::F16, None);
    }
}

/// One test a model, so the harness's threads share the table (each test
/// opens its own device, and every shape compiles its own pipelines).
macro_rules! model_rows {
    ($($test:ident: $name:literal,)*) => {
        $(
            #[test]
            fn $test() {
                model_row($name);
            }
        )*

        /// The tests above name every model of the table, each once.
        #[test]
        fn every_model_has_its_test() {
            let mut tested = vec![$($name),*];
            let mut table: Vec<&str> = models().iter().map(|m| m.name).collect();
            tested.sort_unstable();
            table.sort_unstable();
            assert_eq!(tested, table);
        }
    };
}

model_rows! {
    llama_3_8b: "Llama-3-8B",
    llama_3_2_1b: "Llama-3.2-1B",
    qwen2_5_7b: "Qwen2.5-7B",
    qwen2_5_0_5b: "Qwen2.5-0.5B",
    mistral_7b: "Mistral-7B",
    gemma_2_2b: "Gemma-2-2B",
    phi_3_mini: "Phi-3-mini",
    falcon_7b: "Falcon-7B",
    starcoder2_15b: "StarCoder2-15B",
    llama_3_70b: "Llama-3-70B",
    gpt_2: "GPT-2",
    mpt_7b: "MPT-7B",
    gpt_oss_20b: "gpt-oss-20b",
    gemma_3_4b: "Gemma-3-4B",
    gemma_3_27b: "Gemma-3-27B",
    qwen3_8b: "Qwen3-8B",
    qwen3_0_6b: "Qwen3-0.6B",
    smollm2_135m: "SmolLM2-135M",
}

/// The MLA models (DeepSeek-V2-Lite, DeepSeek-V3, Kimi K2: one 512 + 64
/// latent row per token, shared by every head): decode and prefill over a
/// bf16 latent pool, against the absorbed and unabsorbed f64 reference
/// (`mla.rs` holds the checks and their tolerances).
#[test]
fn mla_model_shape_table() {
    use crate::mla::{decode_case, prefill_case, Model, V2_LITE, V3};
    let Some(gpu) = gpu() else { return };
    let kimi = Model {
        name: "Kimi-K2",
        heads: 64,
        ..V3
    };
    let seed = common::seed("model_shapes::mla_model_shape_table");
    for (i, md) in [V2_LITE, V3, kimi].iter().enumerate() {
        let checked = [0, md.heads / 2, md.heads - 1];
        let s = seed + 10 * i as u64;
        decode_case(
            &gpu,
            md,
            KvDtype::Bf16,
            &DECODE_LENS,
            64,
            pagedattn::gpu::Split::Auto,
            &checked,
            s,
        );
        prefill_case(
            &gpu,
            md,
            KvDtype::Bf16,
            &[45, 0],
            &[20, 17],
            pagedattn::gpu::Split::Auto,
            &checked,
            s + 1,
        );
    }
}
