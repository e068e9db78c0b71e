//! What each architecture the engine runs does differently, in one place:
//! its tensor names, its per-layer attention (RoPE base, window), its
//! normalisation, activation and embedding scale. The step loop
//! (`engine.rs`), serving and sampling are shared; adding an architecture
//! is a module here (its GGUF keys, checked, into an [`ArchSpec`]) and its
//! arm in `ModelConfig::from_gguf`.

pub mod gemma3;

use crate::config::{tensor_names, LayerNames};

/// The architectures the engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama (SmolLM2): RMSNorm, RoPE, SiLU-gated FFN, no window.
    Llama,
    /// Gemma 3: Q/K norms, pre and post norms around attention and FFN,
    /// GELU-tanh gated FFN, the embedding scaled by sqrt(d_model), five
    /// sliding-window layers per full-attention layer.
    Gemma3,
}

/// The FFN's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(x)`.
    Silu,
    /// GELU's tanh approximation.
    GeluTanh,
}

/// Which elements RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i + 1)` (GGUF's llama: the converter permuted
    /// Q and K so that these pair).
    Adjacent,
    /// The two halves `(i, i + head_dim / 2)` (NeoX; Gemma).
    Halves,
}

/// How one layer attends.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttn {
    /// Its RoPE base.
    pub rope_base: f32,
    /// The positions it sees before the newest (`None`: all).
    pub window: Option<u32>,
}

/// An architecture's description.
#[derive(Clone, Debug, PartialEq)]
pub struct ArchSpec {
    /// Which.
    pub arch: Arch,
    /// The factor the embedding rows are multiplied by.
    pub embed_scale: f32,
    /// The FFN's gate activation.
    pub activation: Activation,
    /// RoPE's pairs.
    pub rope_style: RopeStyle,
    /// RMSNorm of every Q and K head before RoPE.
    pub qk_norm: bool,
    /// RMSNorm of the attention and FFN outputs before their residuals.
    pub post_norms: bool,
    /// The attention's softmax scale (`None`: 1 / sqrt(head_dim)).
    pub attn_scale: Option<f32>,
    /// Each layer's attention.
    pub layers: Vec<LayerAttn>,
}

impl ArchSpec {
    /// Llama: every layer full, one RoPE base.
    pub fn llama(n_layers: usize, rope_base: f32) -> ArchSpec {
        ArchSpec {
            arch: Arch::Llama,
            embed_scale: 1.0,
            activation: Activation::Silu,
            rope_style: RopeStyle::Adjacent,
            qk_norm: false,
            post_norms: false,
            attn_scale: None,
            layers: vec![
                LayerAttn {
                    rope_base,
                    window: None,
                };
                n_layers
            ],
        }
    }

    /// The tensor names of block `layer`.
    pub fn tensor_names(&self, layer: usize) -> LayerNames {
        let mut n = tensor_names(layer);
        let name = |s: &str| Some(format!("blk.{layer}.{s}.weight"));
        if self.qk_norm {
            n.attn_q_norm = name("attn_q_norm");
            n.attn_k_norm = name("attn_k_norm");
        }
        if self.post_norms {
            n.post_attention_norm = name("post_attention_norm");
            n.post_ffw_norm = name("post_ffw_norm");
        }
        n
    }

    /// The distinct windows of the stack (`None` for full attention), in
    /// first-use order: the attention variants of a step.
    pub fn windows(&self) -> Vec<Option<u32>> {
        let mut out: Vec<Option<u32>> = Vec::new();
        for l in &self.layers {
            if !out.contains(&l.window) {
                out.push(l.window);
            }
        }
        out
    }

    /// The stack's layer groups for the library's block managers: one group
    /// per distinct window (full attention: `GroupKind::Full`).
    pub fn layer_groups(&self) -> pagedattn::blocks::LayerGroups {
        use pagedattn::blocks::{GroupKind, LayerGroup, LayerGroups};
        let groups = self
            .windows()
            .into_iter()
            .map(|w| LayerGroup {
                kind: w.map_or(GroupKind::Full, GroupKind::Window),
                layers: (0..self.layers.len() as u32)
                    .filter(|&l| self.layers[l as usize].window == w)
                    .collect(),
            })
            .collect();
        LayerGroups::new(self.layers.len() as u32, groups)
            .expect("every layer is in the group of its window")
    }

    /// The distinct RoPE bases, in first-use order.
    pub fn rope_bases(&self) -> Vec<f32> {
        let mut out: Vec<f32> = Vec::new();
        for l in &self.layers {
            if !out.contains(&l.rope_base) {
                out.push(l.rope_base);
            }
        }
        out
    }
}
