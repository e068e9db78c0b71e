//! Gemma 3 (`general.architecture = "gemma3"`): its keys and tensors,
//! checked. What the file does not say is Gemma 3's own definition (as its
//! reference implementation and llama.cpp have it): one full-attention
//! layer every six (layers 5, 11, 17, ...), the others through the file's
//! sliding window with a RoPE base of 10,000; the query scale
//! 1 / sqrt(key_length); the embedding scaled by sqrt(d_model). A file
//! that sets these otherwise is refused, naming the key.

use super::{Activation, Arch, ArchSpec, LayerAttn, RopeStyle};
use crate::config::{
    check, check_widths, invalid, ConfigError, ModelConfig, EMBEDDING_TYPES, NORM_TYPES, OUTPUT,
    OUTPUT_NORM, TOKEN_EMBD, WEIGHT_TYPES,
};
use crate::gguf::Gguf;

/// One full-attention layer every this many.
pub const PERIOD: u32 = 6;
/// The local layers' RoPE base.
pub const LOCAL_ROPE_BASE: f32 = 10_000.0;

/// The configuration of a Gemma 3 GGUF.
pub fn config(g: &Gguf) -> Result<ModelConfig, ConfigError> {
    let size = |key: &'static str| -> Result<usize, ConfigError> {
        let v = g.get_u32(key)?;
        if v == 0 {
            return Err(invalid(key, v.to_string(), "must be positive".into()));
        }
        Ok(v as usize)
    };
    let n_layers = size("gemma3.block_count")?;
    let d_model = size("gemma3.embedding_length")?;
    let d_ffn = size("gemma3.feed_forward_length")?;
    let n_heads = size("gemma3.attention.head_count")?;
    let n_kv_heads = size("gemma3.attention.head_count_kv")?;
    let context_length = size("gemma3.context_length")?;
    let head_dim = size("gemma3.attention.key_length")?;
    let v_len = size("gemma3.attention.value_length")?;
    if v_len != head_dim || !head_dim.is_multiple_of(4) {
        return Err(invalid(
            "gemma3.attention.value_length",
            v_len.to_string(),
            format!("must equal key_length {head_dim}, a multiple of 4"),
        ));
    }
    if !n_heads.is_multiple_of(n_kv_heads) {
        return Err(invalid(
            "gemma3.attention.head_count_kv",
            n_kv_heads.to_string(),
            format!("must divide head_count {n_heads}"),
        ));
    }
    let window = size("gemma3.attention.sliding_window")? as u32;
    if let Some(_v) = g.get("gemma3.attention.sliding_window_pattern") {
        let p = g.get_u32("gemma3.attention.sliding_window_pattern")?;
        if p != PERIOD {
            return Err(invalid(
                "gemma3.attention.sliding_window_pattern",
                p.to_string(),
                format!("the engine runs Gemma 3's one full layer in {PERIOD}"),
            ));
        }
    }
    let f32_key = |key: &'static str, default: f32| -> Result<f32, ConfigError> {
        let v = match g.get(key) {
            None => default,
            Some(_) => g.get_f32(key)?,
        };
        if !(v.is_finite() && v > 0.0) {
            return Err(invalid(
                key,
                v.to_string(),
                "must be finite and positive".into(),
            ));
        }
        Ok(v)
    };
    let rope_base = f32_key("gemma3.rope.freq_base", 1_000_000.0)?;
    let local_base = f32_key("gemma3.rope.freq_base_swa", LOCAL_ROPE_BASE)?;
    let rms_eps = f32_key("gemma3.attention.layer_norm_rms_epsilon", 1e-6)?;
    for key in [
        "gemma3.rope.scaling.type",
        "gemma3.attn_logit_softcapping",
        "gemma3.final_logit_softcapping",
    ] {
        if g.get(key).is_some() {
            return Err(invalid(
                key,
                "set".into(),
                "not supported by the engine".into(),
            ));
        }
    }
    let head_scalar = match g.get("gemma3.attention.query_pre_attn_scalar") {
        None => head_dim as f32,
        Some(_) => g.get_f32("gemma3.attention.query_pre_attn_scalar")?,
    };
    check_widths(d_model, d_ffn)?;
    let vocab_size = g
        .get_str_array("tokenizer.ggml.tokens")
        .map(|t| t.len())
        .unwrap_or(0);
    if vocab_size == 0 {
        return Err(invalid(
            "tokenizer.ggml.tokens",
            "0".into(),
            "the vocabulary must not be empty".into(),
        ));
    }
    let layers = (0..n_layers)
        .map(|l| {
            let full = (l as u32 + 1).is_multiple_of(PERIOD);
            LayerAttn {
                rope_base: if full { rope_base } else { local_base },
                window: (!full).then_some(window),
            }
        })
        .collect();
    let arch = ArchSpec {
        arch: Arch::Gemma3,
        embed_scale: (d_model as f32).sqrt(),
        activation: Activation::GeluTanh,
        rope_style: RopeStyle::Halves,
        qk_norm: true,
        post_norms: true,
        attn_scale: Some(1.0 / head_scalar.sqrt()),
        layers,
    };
    let (d, q, kv, f, v) = (
        d_model as u64,
        (n_heads * head_dim) as u64,
        (n_kv_heads * head_dim) as u64,
        d_ffn as u64,
        vocab_size as u64,
    );
    let embedding_type = check(g, TOKEN_EMBD, &[d, v], EMBEDDING_TYPES)?;
    check(g, OUTPUT_NORM, &[d], NORM_TYPES)?;
    let (tied_embeddings, output_type) = if g.tensor_info(OUTPUT).is_some() {
        (false, check(g, OUTPUT, &[d, v], WEIGHT_TYPES)?)
    } else {
        (true, embedding_type)
    };
    let hd = head_dim as u64;
    for layer in 0..n_layers {
        let n = arch.tensor_names(layer);
        check(g, &n.attn_norm, &[d], NORM_TYPES)?;
        check(g, &n.attn_q, &[d, q], WEIGHT_TYPES)?;
        check(g, &n.attn_k, &[d, kv], WEIGHT_TYPES)?;
        check(g, &n.attn_v, &[d, kv], WEIGHT_TYPES)?;
        check(g, &n.attn_output, &[q, d], WEIGHT_TYPES)?;
        check(g, &n.ffn_norm, &[d], NORM_TYPES)?;
        check(g, &n.ffn_gate, &[d, f], WEIGHT_TYPES)?;
        check(g, &n.ffn_up, &[d, f], WEIGHT_TYPES)?;
        check(g, &n.ffn_down, &[f, d], WEIGHT_TYPES)?;
        for (name, len) in [
            (&n.attn_q_norm, hd),
            (&n.attn_k_norm, hd),
            (&n.post_attention_norm, d),
            (&n.post_ffw_norm, d),
        ] {
            let name = name.as_ref().expect("Gemma 3 names its norms");
            check(g, name, &[len], NORM_TYPES)?;
        }
    }
    Ok(ModelConfig {
        arch,
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
