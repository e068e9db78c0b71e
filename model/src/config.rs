//! The llama hyper-parameters and tensor names of a GGUF model, checked
//! against the tensors the file holds; and where the tests find the model.

use std::path::PathBuf;

pub use crate::arch::{Activation, Arch, ArchSpec, LayerAttn, RopeStyle};
use crate::gguf::{GgmlType, Gguf, GgufError};

/// Types accepted for the matmul weights (attention, FFN, untied output).
pub const WEIGHT_TYPES: &[GgmlType] = &[
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q6K,
    GgmlType::F32,
];
/// Types accepted for the token embedding.
pub const EMBEDDING_TYPES: &[GgmlType] = &[GgmlType::Q8_0, GgmlType::F32, GgmlType::Q4_1];
/// Types accepted for the RMSNorm weights.
pub const NORM_TYPES: &[GgmlType] = &[GgmlType::F32];

/// `llama.rope.freq_base` when the file does not set it.
pub const DEFAULT_ROPE_BASE: f32 = 10_000.0;
/// `llama.attention.layer_norm_rms_epsilon` when the file does not set it.
pub const DEFAULT_RMS_EPS: f32 = 1e-5;

/// Everything that can be wrong with a model's configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("general.architecture is {0:?}; supported: \"llama\", \"gemma3\"")]
    WrongArchitecture(String),
    #[error("{key} = {value} is invalid: {why}")]
    Invalid {
        key: &'static str,
        value: String,
        why: String,
    },
    #[error("missing tensor {0:?}")]
    MissingTensor(String),
    #[error("tensor {name:?} has shape {found:?} (ne0 first), expected {expected:?}")]
    BadShape {
        name: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("tensor {name:?} has type {found}, supported: {}", list(supported))]
    UnsupportedType {
        name: String,
        found: GgmlType,
        supported: &'static [GgmlType],
    },
}

fn list(types: &[GgmlType]) -> String {
    let names: Vec<String> = types.iter().map(|t| t.to_string()).collect();
    names.join(", ")
}

/// The tensor names of one transformer block (the norms an architecture
/// lacks are `None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerNames {
    /// RMSNorm of each query head (Gemma 3).
    pub attn_q_norm: Option<String>,
    /// RMSNorm of each key head (Gemma 3).
    pub attn_k_norm: Option<String>,
    /// RMSNorm of the attention output before the residual (Gemma 3).
    pub post_attention_norm: Option<String>,
    /// RMSNorm of the FFN output before the residual (Gemma 3).
    pub post_ffw_norm: Option<String>,
    pub attn_norm: String,
    pub attn_q: String,
    pub attn_k: String,
    pub attn_v: String,
    pub attn_output: String,
    pub ffn_norm: String,
    pub ffn_gate: String,
    pub ffn_up: String,
    pub ffn_down: String,
}

/// Name of the token embedding tensor (`[d_model, vocab]`, ne0 first).
pub const TOKEN_EMBD: &str = "token_embd.weight";
/// Name of the final norm (`[d_model]`).
pub const OUTPUT_NORM: &str = "output_norm.weight";
/// Name of the untied LM head (`[d_model, vocab]`), when there is one.
pub const OUTPUT: &str = "output.weight";

/// The tensor names of block `layer`.
pub fn tensor_names(layer: usize) -> LayerNames {
    let n = |s: &str| format!("blk.{layer}.{s}.weight");
    LayerNames {
        attn_q_norm: None,
        attn_k_norm: None,
        post_attention_norm: None,
        post_ffw_norm: None,
        attn_norm: n("attn_norm"),
        attn_q: n("attn_q"),
        attn_k: n("attn_k"),
        attn_v: n("attn_v"),
        attn_output: n("attn_output"),
        ffn_norm: n("ffn_norm"),
        ffn_gate: n("ffn_gate"),
        ffn_up: n("ffn_up"),
        ffn_down: n("ffn_down"),
    }
}

/// The name this type had when the engine ran llama only.
pub type LlamaConfig = ModelConfig;

/// A model's hyper-parameters, checked against its tensors: what every
/// architecture shares, and what its `arch` module says of it
/// ([`ArchSpec`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The architecture and what its step does differently.
    pub arch: ArchSpec,
    /// Transformer blocks (`llama.block_count`).
    pub n_layers: usize,
    /// Hidden size (`llama.embedding_length`).
    pub d_model: usize,
    /// FFN inner size (`llama.feed_forward_length`).
    pub d_ffn: usize,
    /// Query heads (`llama.attention.head_count`).
    pub n_heads: usize,
    /// Key/value heads (`llama.attention.head_count_kv`).
    pub n_kv_heads: usize,
    /// Elements per head (`d_model / n_heads` for llama; Gemma 3's file
    /// says it: `key_length`).
    pub head_dim: usize,
    /// RoPE base (`llama.rope.freq_base`, default 10000).
    pub rope_base: f32,
    /// RMSNorm epsilon (`llama.attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// Training context (`llama.context_length`).
    pub context_length: usize,
    /// Vocabulary size: rows of the embedding.
    pub vocab_size: usize,
    /// Whether the LM head is the token embedding (no `output.weight`).
    pub tied_embeddings: bool,
    /// Type of `token_embd.weight`.
    pub embedding_type: GgmlType,
    /// Type of `output.weight`, or of the embedding when tied.
    pub output_type: GgmlType,
}

pub(crate) fn invalid(key: &'static str, value: String, why: String) -> ConfigError {
    ConfigError::Invalid { key, value, why }
}

/// The head shape: heads dividing the model width into a head_dim that is
/// a multiple of 4, KV heads dividing the heads, and no key, value or
/// rotary length other than head_dim. Returns head_dim.
fn check_heads(
    g: &Gguf,
    d_model: usize,
    n_heads: usize,
    n_kv_heads: usize,
) -> Result<usize, ConfigError> {
    if !d_model.is_multiple_of(n_heads) {
        return Err(invalid(
            "llama.attention.head_count",
            n_heads.to_string(),
            format!("does not divide embedding_length {d_model}"),
        ));
    }
    let head_dim = d_model / n_heads;
    if !head_dim.is_multiple_of(4) {
        return Err(invalid(
            "llama.attention.head_count",
            n_heads.to_string(),
            format!("head_dim = {d_model} / {n_heads} = {head_dim} is not a multiple of 4"),
        ));
    }
    if n_kv_heads > n_heads || !n_heads.is_multiple_of(n_kv_heads) {
        return Err(invalid(
            "llama.attention.head_count_kv",
            n_kv_heads.to_string(),
            format!("must divide head_count {n_heads}"),
        ));
    }
    for key in ["llama.attention.key_length", "llama.attention.value_length"] {
        if g.get(key).is_some() {
            let v = g.get_u32(key)? as usize;
            if v != head_dim {
                return Err(invalid(
                    key,
                    v.to_string(),
                    format!(
                        "only head_dim = embedding_length / head_count = {head_dim} is supported"
                    ),
                ));
            }
        }
    }
    if g.get("llama.rope.dimension_count").is_some() {
        let v = g.get_u32("llama.rope.dimension_count")? as usize;
        if v != head_dim {
            return Err(invalid(
                "llama.rope.dimension_count",
                v.to_string(),
                format!("only full rotary embedding (= head_dim {head_dim}) is supported"),
            ));
        }
    }
    Ok(head_dim)
}

/// The model and FFN widths on the quantisation block.
pub(crate) fn check_widths(d_model: usize, d_ffn: usize) -> Result<(), ConfigError> {
    for (key, v) in [
        ("llama.embedding_length", d_model),
        ("llama.feed_forward_length", d_ffn),
    ] {
        if v % 32 != 0 {
            return Err(invalid(
                key,
                v.to_string(),
                "must be a multiple of 32 (the quantisation block)".into(),
            ));
        }
    }
    Ok(())
}

/// Every layer's tensors, of the shapes `[d_model, q width, kv width,
/// ffn]` make and of the types the engine reads.
fn check_layers(g: &Gguf, n_layers: usize, [d, q, kv, f]: [u64; 4]) -> Result<(), ConfigError> {
    for layer in 0..n_layers {
        let n = tensor_names(layer);
        check(g, &n.attn_norm, &[d], NORM_TYPES)?;
        check(g, &n.attn_q, &[d, q], WEIGHT_TYPES)?;
        check(g, &n.attn_k, &[d, kv], WEIGHT_TYPES)?;
        check(g, &n.attn_v, &[d, kv], WEIGHT_TYPES)?;
        check(g, &n.attn_output, &[q, d], WEIGHT_TYPES)?;
        check(g, &n.ffn_norm, &[d], NORM_TYPES)?;
        check(g, &n.ffn_gate, &[d, f], WEIGHT_TYPES)?;
        check(g, &n.ffn_up, &[d, f], WEIGHT_TYPES)?;
        check(g, &n.ffn_down, &[f, d], WEIGHT_TYPES)?;
    }
    Ok(())
}

impl ModelConfig {
    /// Reads and checks the configuration of a GGUF of an architecture the
    /// engine runs (`general.architecture`: `llama`, `gemma3`).
    pub fn from_gguf(g: &Gguf) -> Result<ModelConfig, ConfigError> {
        let arch = g.get_str("general.architecture")?;
        match arch {
            "llama" => Self::llama(g),
            "gemma3" => crate::arch::gemma3::config(g),
            other => Err(ConfigError::WrongArchitecture(other.to_string())),
        }
    }

    /// The configuration of a llama GGUF.
    fn llama(g: &Gguf) -> Result<ModelConfig, ConfigError> {
        let size = |key: &'static str| -> Result<usize, ConfigError> {
            let v = g.get_u32(key)?;
            if v == 0 {
                return Err(invalid(key, v.to_string(), "must be positive".into()));
            }
            Ok(v as usize)
        };
        let n_layers = size("llama.block_count")?;
        let d_model = size("llama.embedding_length")?;
        let d_ffn = size("llama.feed_forward_length")?;
        let n_heads = size("llama.attention.head_count")?;
        let n_kv_heads = size("llama.attention.head_count_kv")?;
        let context_length = size("llama.context_length")?;
        let rope_base = match g.get("llama.rope.freq_base") {
            None => DEFAULT_ROPE_BASE,
            Some(_) => g.get_f32("llama.rope.freq_base")?,
        };
        let rms_eps = match g.get("llama.attention.layer_norm_rms_epsilon") {
            None => DEFAULT_RMS_EPS,
            Some(_) => g.get_f32("llama.attention.layer_norm_rms_epsilon")?,
        };
        if !(rope_base.is_finite() && rope_base > 0.0) {
            return Err(invalid(
                "llama.rope.freq_base",
                rope_base.to_string(),
                "must be finite and positive".into(),
            ));
        }
        if !(rms_eps.is_finite() && rms_eps > 0.0) {
            return Err(invalid(
                "llama.attention.layer_norm_rms_epsilon",
                rms_eps.to_string(),
                "must be finite and positive".into(),
            ));
        }
        let head_dim = check_heads(g, d_model, n_heads, n_kv_heads)?;
        check_widths(d_model, d_ffn)?;

        let embd = g
            .tensor_info(TOKEN_EMBD)
            .ok_or_else(|| ConfigError::MissingTensor(TOKEN_EMBD.into()))?;
        let vocab_size = if g.get("llama.vocab_size").is_some() {
            size("llama.vocab_size")?
        } else if let Ok(tokens) = g.get_str_array("tokenizer.ggml.tokens") {
            tokens.len()
        } else {
            embd.dims.get(1).copied().unwrap_or(0) as usize
        };
        if vocab_size == 0 {
            return Err(invalid(
                "llama.vocab_size",
                "0".into(),
                "must be positive".into(),
            ));
        }

        let d = d_model as u64;
        let q = (n_heads * head_dim) as u64;
        let kv = (n_kv_heads * head_dim) as u64;
        let f = d_ffn as u64;
        let v = vocab_size as u64;
        let embedding_type = check(g, TOKEN_EMBD, &[d, v], EMBEDDING_TYPES)?;
        check(g, OUTPUT_NORM, &[d], NORM_TYPES)?;
        let (tied_embeddings, output_type) = if g.tensor_info(OUTPUT).is_some() {
            (false, check(g, OUTPUT, &[d, v], WEIGHT_TYPES)?)
        } else {
            (true, embedding_type)
        };
        check_layers(g, n_layers, [d, q, kv, f])?;

        Ok(ModelConfig {
            arch: ArchSpec::llama(n_layers, rope_base),
            n_layers,
            d_model,
            d_ffn,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_base,
            rms_eps,
            context_length,
            vocab_size,
            tied_embeddings,
            embedding_type,
            output_type,
        })
    }

    /// The tensor names of block `layer`.
    pub fn tensor_names(&self, layer: usize) -> LayerNames {
        self.arch.tensor_names(layer)
    }

    /// The name of the LM head: `output.weight`, or the token embedding
    /// when tied.
    pub fn output_name(&self) -> &'static str {
        if self.tied_embeddings {
            TOKEN_EMBD
        } else {
            OUTPUT
        }
    }

    /// Query heads per key/value head.
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}

/// Checks that tensor `name` exists with shape `dims` (ne0 first; trailing
/// 1s are ignored) and one of `types`; returns its type.
pub(crate) fn check(
    g: &Gguf,
    name: &str,
    dims: &[u64],
    types: &'static [GgmlType],
) -> Result<GgmlType, ConfigError> {
    let t = g
        .tensor_info(name)
        .ok_or_else(|| ConfigError::MissingTensor(name.to_string()))?;
    let trim = |d: &[u64]| {
        let mut v = d.to_vec();
        while v.len() > 1 && v.last() == Some(&1) {
            v.pop();
        }
        v
    };
    if trim(&t.dims) != trim(dims) {
        return Err(ConfigError::BadShape {
            name: name.to_string(),
            found: t.dims.clone(),
            expected: dims.to_vec(),
        });
    }
    if !types.contains(&t.ty) {
        return Err(ConfigError::UnsupportedType {
            name: name.to_string(),
            found: t.ty,
            supported: types,
        });
    }
    Ok(t.ty)
}

/// The model file's name under `<repo>/models/`.
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The model file is not where the tests look for it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("model file {} not found (set PAGEDATTN_MODEL, or run `bash scripts/fetch-model.sh`)", path.display())]
pub struct ModelMissing {
    pub path: PathBuf,
}

/// The one default model path: `<repo>/models/SmolLM2-135M-Instruct.Q4_1.gguf`,
/// where `scripts/fetch-model.sh` puts it (the repository this crate was
/// built in). The crate reads no environment for it: callers pass a path.
pub fn default_model_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("models")
        .join(MODEL_FILE)
}

/// For tests: where the model is, `$PAGEDATTN_MODEL` if set, else
/// [`default_model_path`]; an error when no file is there.
pub fn model_path() -> Result<PathBuf, ModelMissing> {
    let path = match std::env::var_os("PAGEDATTN_MODEL") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => default_model_path(),
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(ModelMissing { path })
    }
}

/// Whether a missing model must fail a test: `PAGEDATTN_REQUIRE_MODEL=1`
/// or `CI` set (to anything but empty, `0` or `false`).
pub fn model_required() -> bool {
    let set = |k: &str| {
        std::env::var(k)
            .is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
    };
    std::env::var("PAGEDATTN_REQUIRE_MODEL").is_ok_and(|v| v == "1") || set("CI")
}

/// For tests: the model path, or `None` after printing that the test
/// skips. Panics (naming `bash scripts/fetch-model.sh`) instead of skipping
/// when [`model_required`].
pub fn model_path_or_skip(test: &str) -> Option<PathBuf> {
    match model_path() {
        Ok(p) => Some(p),
        Err(e) if model_required() => panic!("{test}: {e}"),
        Err(e) => {
            eprintln!("{test}: skipped: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::tests::Builder;

    struct Spec {
        layers: usize,
        d: u64,
        ffn: u64,
        heads: u32,
        kv: u32,
        vocab: u64,
        output: Option<u32>,
    }

    const SMALL: Spec = Spec {
        layers: 2,
        d: 64,
        ffn: 96,
        heads: 4,
        kv: 2,
        vocab: 10,
        output: None,
    };

    /// A tiny llama file; `tweak` may change each tensor's shape and type,
    /// or drop it by returning false.
    fn file(s: &Spec, tweak: impl Fn(&str, &mut Vec<u64>, &mut u32) -> bool) -> Vec<u8> {
        let mut b = Builder::new();
        b.kv_str("general.architecture", "llama")
            .kv_u32("llama.block_count", s.layers as u32)
            .kv_u32("llama.context_length", 128)
            .kv_u32("llama.embedding_length", s.d as u32)
            .kv_u32("llama.feed_forward_length", s.ffn as u32)
            .kv_u32("llama.attention.head_count", s.heads)
            .kv_u32("llama.attention.head_count_kv", s.kv)
            .kv_f32("llama.rope.freq_base", 1e5)
            .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
            .kv_u32("llama.vocab_size", s.vocab as u32);
        let hd = s.d / u64::from(s.heads);
        let q = hd * u64::from(s.heads);
        let kv = hd * u64::from(s.kv);
        // Q4_1 where the shapes allow it, else F32.
        let w = if q.is_multiple_of(32) && kv.is_multiple_of(32) && s.ffn.is_multiple_of(32) {
            3
        } else {
            0
        };
        let mut ts: Vec<(String, Vec<u64>, u32)> = vec![
            (TOKEN_EMBD.into(), vec![s.d, s.vocab], 8),
            (OUTPUT_NORM.into(), vec![s.d], 0),
        ];
        if let Some(ty) = s.output {
            ts.push((OUTPUT.into(), vec![s.d, s.vocab], ty));
        }
        for l in 0..s.layers {
            let n = tensor_names(l);
            ts.push((n.attn_norm, vec![s.d], 0));
            ts.push((n.attn_q, vec![s.d, q], w));
            ts.push((n.attn_k, vec![s.d, kv], w));
            ts.push((n.attn_v, vec![s.d, kv], w));
            ts.push((n.attn_output, vec![q, s.d], w));
            ts.push((n.ffn_norm, vec![s.d], 0));
            ts.push((n.ffn_gate, vec![s.d, s.ffn], w));
            ts.push((n.ffn_up, vec![s.d, s.ffn], w));
            ts.push((n.ffn_down, vec![s.ffn, s.d], w));
        }
        for (name, mut dims, mut ty) in ts {
            if !tweak(&name, &mut dims, &mut ty) {
                continue;
            }
            let n: u64 = dims.iter().product();
            let bytes = GgmlType::from_id(ty).bytes_for(n).unwrap_or(0);
            b.tensor(&name, &dims, ty, &vec![0u8; bytes as usize]);
        }
        b.build()
    }

    fn cfg(bytes: Vec<u8>) -> Result<LlamaConfig, ConfigError> {
        LlamaConfig::from_gguf(&Gguf::parse(bytes).unwrap())
    }

    #[test]
    fn valid() {
        let c = cfg(file(&SMALL, |_, _, _| true)).unwrap();
        assert_eq!(c.n_layers, 2);
        assert_eq!(c.d_model, 64);
        assert_eq!(c.d_ffn, 96);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.group_size(), 2);
        assert_eq!(c.vocab_size, 10);
        assert_eq!(c.rope_base, 1e5);
        assert!(c.tied_embeddings);
        assert_eq!(c.embedding_type, GgmlType::Q8_0);
        assert_eq!(c.output_name(), TOKEN_EMBD);
        assert_eq!(c.tensor_names(1).ffn_down, "blk.1.ffn_down.weight");
    }

    #[test]
    fn untied() {
        let c = cfg(file_with_output(GgmlType::Q4_1)).unwrap();
        assert!(!c.tied_embeddings);
        assert_eq!(c.output_type, GgmlType::Q4_1);
        assert_eq!(c.output_name(), OUTPUT);
        let e = cfg(file_with_output(GgmlType::F16)).unwrap_err();
        assert!(
            matches!(&e, ConfigError::UnsupportedType { name, .. } if name == OUTPUT),
            "{e}"
        );
    }

    fn file_with_output(ty: GgmlType) -> Vec<u8> {
        file(
            &Spec {
                output: Some(ty.id()),
                ..SMALL
            },
            |_, _, _| true,
        )
    }

    #[test]
    fn errors() {
        // Architecture.
        let mut b = Builder::new();
        b.kv_str("general.architecture", "gpt2");
        let e = cfg(b.build()).unwrap_err();
        assert!(matches!(&e, ConfigError::WrongArchitecture(a) if a == "gpt2"));
        assert!(e.to_string().contains("\"gpt2\""), "{e}");
        let e = cfg(Builder::new().build()).unwrap_err();
        assert!(
            matches!(e, ConfigError::Gguf(GgufError::MissingKey(_))),
            "{e}"
        );

        // Head layout.
        let bad = |heads, kv| cfg(file(&Spec { heads, kv, ..SMALL }, |_, _, _| true)).unwrap_err();
        let e = bad(3, 1);
        assert!(
            matches!(
                e,
                ConfigError::Invalid {
                    key: "llama.attention.head_count",
                    ..
                }
            ),
            "{e}"
        );
        let e = bad(4, 3);
        assert!(
            matches!(
                e,
                ConfigError::Invalid {
                    key: "llama.attention.head_count_kv",
                    ..
                }
            ),
            "{e}"
        );
        let e = bad(32, 1); // head_dim 2
        assert!(e.to_string().contains("multiple of 4"), "{e}");
        let e = cfg(file(&Spec { ffn: 100, ..SMALL }, |_, _, _| true)).unwrap_err();
        assert!(
            matches!(
                e,
                ConfigError::Invalid {
                    key: "llama.feed_forward_length",
                    ..
                }
            ),
            "{e}"
        );

        // Missing, misshapen and mistyped tensors.
        let e = cfg(file(&SMALL, |n, _, _| n != "blk.1.attn_v.weight")).unwrap_err();
        assert!(
            matches!(&e, ConfigError::MissingTensor(n) if n == "blk.1.attn_v.weight"),
            "{e}"
        );
        let e = cfg(file(&SMALL, |n, d, _| {
            if n == "blk.0.ffn_down.weight" {
                d.swap(0, 1);
            }
            true
        }))
        .unwrap_err();
        assert!(
            matches!(&e, ConfigError::BadShape { name, found, expected } if name == "blk.0.ffn_down.weight" && found == &[64, 96] && expected == &[96, 64]),
            "{e}"
        );
        let e = cfg(file(&SMALL, |n, _, t| {
            if n == "blk.0.attn_q.weight" {
                *t = 2; // Q4_0
            }
            true
        }))
        .unwrap_err();
        assert!(
            matches!(&e, ConfigError::UnsupportedType { name, found: GgmlType::Q4_0, .. } if name == "blk.0.attn_q.weight"),
            "{e}"
        );
        assert!(
            e.to_string().contains("Q4_0")
                && e.to_string().contains("Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, F32"),
            "{e}"
        );
        let e = cfg(file(&SMALL, |n, _, t| {
            if n == "blk.1.ffn_norm.weight" {
                *t = 1; // F16
            }
            true
        }))
        .unwrap_err();
        assert!(
            matches!(
                e,
                ConfigError::UnsupportedType {
                    found: GgmlType::F16,
                    ..
                }
            ),
            "{e}"
        );
        let e = cfg(file(&SMALL, |n, d, _| {
            if n == TOKEN_EMBD {
                d[1] = 11;
            }
            true
        }))
        .unwrap_err();
        assert!(matches!(e, ConfigError::BadShape { .. }), "{e}");
    }

    #[test]
    fn real_model() {
        let Some(path) = model_path_or_skip("config::real_model") else {
            return;
        };
        let g = Gguf::open(&path).unwrap();
        let c = LlamaConfig::from_gguf(&g).unwrap();
        assert_eq!(g.version(), 3);
        assert_eq!(c.n_layers, 30);
        assert_eq!(c.d_model, 576);
        assert_eq!(c.d_ffn, 1536);
        assert_eq!(c.n_heads, 9);
        assert_eq!(c.n_kv_heads, 3);
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.vocab_size, 49152);
        assert_eq!(c.context_length, 8192);
        assert_eq!(c.rope_base, 1e5);
        assert!((c.rms_eps - 1e-5).abs() < 1e-9);
        assert!(c.tied_embeddings);
        assert_eq!(c.embedding_type, GgmlType::Q8_0);
        assert_eq!(
            g.tensor_info(&c.tensor_names(0).attn_q).unwrap().ty,
            GgmlType::Q4_1
        );
        // Dequantised weights look like weights.
        let e = g.tensor(TOKEN_EMBD).unwrap().dequant_row(1000).unwrap();
        assert_eq!(e.len(), 576);
        assert!(e.iter().all(|x| x.is_finite()) && e.iter().any(|&x| x != 0.0));
        let q = g
            .tensor(&c.tensor_names(29).ffn_down)
            .unwrap()
            .dequant_row(575)
            .unwrap();
        assert_eq!(q.len(), 1536);
        assert!(q.iter().all(|x| x.is_finite() && x.abs() < 100.0));
        let n = g.tensor(OUTPUT_NORM).unwrap().to_f32().unwrap();
        assert!(n.iter().all(|x| x.is_finite()));
    }
}
