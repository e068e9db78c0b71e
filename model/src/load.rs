//! From a GGUF file to the engine's [`HostWeights`]: every tensor checked by
//! [`LlamaConfig::from_gguf`] first, so nothing reaches the device for a
//! file the engine cannot run.

use std::path::{Path, PathBuf};

use crate::config::{LlamaConfig, OUTPUT_NORM, TOKEN_EMBD};
use crate::engine::{HostLayer, HostMatrix, HostWeights, Shape};
use crate::gguf::Gguf;
use crate::synthetic::Synthetic;
use crate::tokenizer::Tokenizer;
use crate::ModelError;

/// A loaded model: its weights on the host, its configuration, its tokenizer.
pub struct Loaded {
    pub weights: HostWeights,
    pub config: LlamaConfig,
    pub tokenizer: Tokenizer,
    /// The file's size in bytes.
    pub file_bytes: u64,
}

fn matrix(g: &Gguf, name: &str) -> Result<HostMatrix, ModelError> {
    let t = g.tensor(name)?;
    let dims = t.dims();
    let cols = dims.first().copied().unwrap_or(0) as usize;
    let rows = dims.iter().skip(1).product::<u64>() as usize;
    let m = HostMatrix::from_gguf(t.ty(), rows, cols, t.data).ok_or_else(|| {
        ModelError::Shape(format!(
            "{name}: {} weights are not supported (Q4_1, Q5_0, Q8_0, Q4_K, Q6_K or F32)",
            t.ty()
        ))
    })?;
    m.check(name)?;
    Ok(m)
}

fn vector(g: &Gguf, name: &str) -> Result<Vec<f32>, ModelError> {
    Ok(g.tensor(name)?.to_f32()?)
}

/// The vector `name` names, when the architecture has it.
fn optional(g: &Gguf, name: &Option<String>) -> Result<Option<Vec<f32>>, ModelError> {
    name.as_ref().map(|n| vector(g, n)).transpose()
}

/// The longest context the engine keeps RoPE tables for (a file may claim
/// more: Gemma 3 270M says 32,768).
pub const MAX_CONTEXT: usize = 8192;

/// Reads the model at `path`. A missing file names the fetch command.
pub fn load(path: &Path) -> Result<Loaded, ModelError> {
    if !path.is_file() {
        return Err(ModelError::Missing {
            path: path.to_path_buf(),
        });
    }
    let file_bytes = std::fs::metadata(path)
        .map_err(|e| ModelError::Io {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?
        .len();
    let g = Gguf::open(path)?;
    from_gguf(&g, file_bytes)
}

/// Where a model comes from: a GGUF file, or a [`Synthetic`] one (its
/// bytes written in memory from a seed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    File(PathBuf),
    Synthetic(Synthetic),
}

impl ModelSource {
    /// The file at `path`, or `synthetic` when given.
    pub fn new(path: PathBuf, synthetic: Option<Synthetic>) -> ModelSource {
        match synthetic {
            Some(s) => ModelSource::Synthetic(s),
            None => ModelSource::File(path),
        }
    }

    /// Reads the file ([`load`]) or writes and reads the synthetic model
    /// ([`Synthetic::load`]).
    pub fn load(&self) -> Result<Loaded, ModelError> {
        match self {
            ModelSource::File(path) => load(path),
            ModelSource::Synthetic(s) => s.load(),
        }
    }

    /// A short name: the file's stem, or `synthetic-<arch>`.
    pub fn name(&self) -> String {
        match self {
            ModelSource::File(path) => path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("model")
                .to_string(),
            ModelSource::Synthetic(s) => s.name(),
        }
    }

    /// What it is, for reports: the file's name, or the synthetic model's
    /// shape, layers and seed.
    pub fn describe(&self) -> String {
        match self {
            ModelSource::File(path) => path
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            ModelSource::Synthetic(s) => s.describe(),
        }
    }
}

/// The weights, configuration and tokenizer of a parsed GGUF.
pub fn from_gguf(g: &Gguf, file_bytes: u64) -> Result<Loaded, ModelError> {
    let config = LlamaConfig::from_gguf(g)?;
    let tokenizer = Tokenizer::from_gguf(g)?;
    let c = &config;
    let shape = Shape {
        layers: c.n_layers,
        d_model: c.d_model,
        ffn: c.d_ffn,
        heads: c.n_heads,
        kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        vocab: c.vocab_size,
        rope_base: c.rope_base,
        rms_eps: c.rms_eps,
        context: c.context_length.min(MAX_CONTEXT),
    };
    let mut layers = Vec::with_capacity(c.n_layers);
    for i in 0..c.n_layers {
        let n = c.tensor_names(i);
        layers.push(HostLayer {
            attn_norm: vector(g, &n.attn_norm)?,
            q: matrix(g, &n.attn_q)?,
            k: matrix(g, &n.attn_k)?,
            v: matrix(g, &n.attn_v)?,
            o: matrix(g, &n.attn_output)?,
            ffn_norm: vector(g, &n.ffn_norm)?,
            gate: matrix(g, &n.ffn_gate)?,
            up: matrix(g, &n.ffn_up)?,
            down: matrix(g, &n.ffn_down)?,
            q_norm: optional(g, &n.attn_q_norm)?,
            k_norm: optional(g, &n.attn_k_norm)?,
            post_attn_norm: optional(g, &n.post_attention_norm)?,
            post_ffn_norm: optional(g, &n.post_ffw_norm)?,
        });
    }
    let output = if c.tied_embeddings {
        None
    } else {
        Some(matrix(g, c.output_name())?)
    };
    let weights = HostWeights {
        shape,
        embed: matrix(g, TOKEN_EMBD)?,
        output,
        output_norm: vector(g, OUTPUT_NORM)?,
        layers,
        arch: c.arch.clone(),
    };
    Ok(Loaded {
        weights,
        config,
        tokenizer,
        file_bytes,
    })
}
