//! From a GGUF file to the engine's [`HostWeights`]: every tensor checked by
//! [`LlamaConfig::from_gguf`] first, so nothing reaches the device for a
//! file the engine cannot run.

use std::path::Path;

use crate::config::{LlamaConfig, OUTPUT_NORM, TOKEN_EMBD};
use crate::engine::{HostLayer, HostMatrix, HostWeights, Shape, WeightFormat};
use crate::gguf::{GgmlType, Gguf};
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

fn format(name: &str, ty: GgmlType) -> Result<WeightFormat, ModelError> {
    match ty {
        GgmlType::Q4_1 => Ok(WeightFormat::Q4_1),
        GgmlType::Q8_0 => Ok(WeightFormat::Q8_0),
        GgmlType::F32 => Ok(WeightFormat::F32),
        other => Err(ModelError::Shape(format!(
            "{name}: {other} weights are not supported (Q4_1, Q8_0 or F32)"
        ))),
    }
}

fn matrix(g: &Gguf, name: &str) -> Result<HostMatrix, ModelError> {
    let t = g.tensor(name)?;
    let fmt = format(name, t.ty())?;
    let dims = t.dims();
    let cols = dims.first().copied().unwrap_or(0) as usize;
    let rows = dims.iter().skip(1).product::<u64>() as usize;
    let m = HostMatrix {
        fmt,
        rows,
        cols,
        data: t.data.to_vec(),
    };
    m.check(name)?;
    Ok(m)
}

fn vector(g: &Gguf, name: &str) -> Result<Vec<f32>, ModelError> {
    Ok(g.tensor(name)?.to_f32()?)
}

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
        context: c.context_length,
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
    };
    Ok(Loaded {
        weights,
        config,
        tokenizer,
        file_bytes,
    })
}
