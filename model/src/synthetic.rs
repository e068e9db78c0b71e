//! Synthetic models: the shapes and quant formats of real GGUF files, with
//! weights drawn from a seed, so that the bench, the server and the load
//! generator run a model no file holds (an 8B model on a machine without
//! its 4.5 GB download, or a few of its layers on a software adapter).
//!
//! A [`Synthetic`] writes the bytes of a GGUF file in memory (metadata,
//! tokenizer, tensor infos and data, as a converter would) and loads them
//! through [`Gguf::parse`] and [`from_gguf`]: every check a real file
//! passes, this one passes too, and the engine cannot tell the difference
//! except by the values.
//!
//! The values: every quantised block gets random quants and a fixed scale
//! chosen so that a matrix's elements have a mean of zero and a standard
//! deviation of about `1 / sqrt(k)` (`k` its row length, `ne0`); norm
//! weights are uniform in `[0.9, 1.1)`, but for Gemma 3's post norms,
//! 16 times that: its embedding, scaled by `sqrt(d_model)`, is also its
//! LM head, and with post norms of one the input token's own logit would
//! win every step (the model would repeat its input). Activations then stay of the order of one through every
//! layer and the logits are finite, of standard deviation about one:
//! sampling is valid, the text is noise, and speed is that of the real
//! model (it does not depend on the values).
//!
//! The tokenizer is a small valid vocabulary of the right size: for the
//! llama shapes a byte-level BPE (`gpt2`: `<|endoftext|>`, `<|im_start|>`,
//! `<|im_end|>`, the 256 byte tokens, then lower-case words, each the
//! merge of its prefix and its last letter), for Gemma 3 a SentencePiece
//! one (`<pad>`, `<eos>`, `<bos>`, `<unk>`, `<start_of_turn>`,
//! `<end_of_turn>`, the 256 byte tokens, printable characters, then words
//! scored shortest first). Neither has a chat template: the server and
//! `generate` fall back to ChatML and to Gemma's turns.
//!
//! Generation is parallel over fixed-size chunks of each tensor, each
//! chunk seeded from the seed, the tensor's name and its index, so the
//! bytes do not depend on the number of threads.

use std::fmt;
use std::str::FromStr;
use std::sync::Mutex;

use pagedattn::rng::SplitMix64;

use crate::gguf::{GgmlType, Gguf};
use crate::load::{from_gguf, Loaded};
use crate::tokenizer::{token_type, END_OF_TEXT, END_OF_TURN, IM_END, IM_START, START_OF_TURN};
use crate::ModelError;

/// The seed a synthetic model is built from when none is given.
pub const DEFAULT_SEED: u64 = 0;

/// The shapes a synthetic model can take: each one a real model's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SyntheticArch {
    /// SmolLM2-135M-Instruct as `SmolLM2-135M-Instruct.Q4_1.gguf` holds
    /// it: llama, 30 layers, d_model 576, FFN 1536, 9 heads over 3 KV
    /// heads of 64, vocabulary 49,152, RoPE base 100,000, tied embedding
    /// (Q8_0), every matrix Q4_1.
    SmolLm2_135M,
    /// Gemma 3 270M as `gemma-3-270m-q4_k_m.gguf` holds it: gemma3, 18
    /// layers, d_model 640, FFN 2048, 4 heads over 1 KV head of 256,
    /// vocabulary 262,144, five sliding-window (512) layers to a full one,
    /// Q/K norms and post norms, tied embedding (Q8_0); Q and K, gate and
    /// up Q5_0, the attention output Q4_K, V Q8_0 or Q5_0 and the FFN down
    /// Q6_K or Q4_K by layer (llama.cpp's Q4_K_M rule, as in the file).
    Gemma3_270M,
    /// Llama 3 8B as a Q4_K_M file: llama, 32 layers, d_model 4096, FFN
    /// 14,336, 32 heads over 8 KV heads of 128, vocabulary 128,256, RoPE
    /// base 500,000, untied output (Q6_K); Q4_K matrices, the FFN down
    /// Q6_K in the layers Q4_K_M gives more bits (the first and last
    /// eighth and every third between). Two departures from a Q4_K_M
    /// file, both where the engine reads less than llama.cpp writes: V
    /// stays Q4_K in those layers (the file's is Q6_K, but the engine
    /// fuses Q, K and V into one matrix of one format), and the embedding
    /// is Q4_1, not Q4_K (the embedding gather reads Q8_0, Q4_1 and F32).
    Llama3_8B,
    /// Qwen3 8B's shapes on the llama architecture (the engine has no
    /// `qwen3`, so there are no Q/K norms and RoPE pairs as llama's): 36
    /// layers, d_model 4096, FFN 12,288, 32 heads over 8 KV heads of 128,
    /// vocabulary 151,936, RoPE base 1,000,000, untied output; formats as
    /// [`SyntheticArch::Llama3_8B`]'s.
    Qwen3_8B,
}

impl SyntheticArch {
    /// Every shape, in the order their names are listed.
    pub const ALL: [SyntheticArch; 4] = [
        SyntheticArch::SmolLm2_135M,
        SyntheticArch::Gemma3_270M,
        SyntheticArch::Llama3_8B,
        SyntheticArch::Qwen3_8B,
    ];

    /// The name the command line takes (`smollm2-135m`, ...).
    pub fn name(self) -> &'static str {
        match self {
            SyntheticArch::SmolLm2_135M => "smollm2-135m",
            SyntheticArch::Gemma3_270M => "gemma3-270m",
            SyntheticArch::Llama3_8B => "llama3-8b",
            SyntheticArch::Qwen3_8B => "qwen3-8b",
        }
    }

    /// The real model's layer count (the most `--layers` takes).
    pub fn layers(self) -> usize {
        self.spec().layers
    }

    /// The names, comma-separated (for messages).
    pub fn names() -> String {
        let v: Vec<&str> = Self::ALL.iter().map(|a| a.name()).collect();
        v.join(", ")
    }

    fn spec(self) -> Spec {
        match self {
            SyntheticArch::SmolLm2_135M => Spec {
                gemma: false,
                layers: 30,
                d: 576,
                ffn: 1536,
                heads: 9,
                kv_heads: 3,
                head_dim: 64,
                vocab: 49_152,
                context: 8192,
                rope_base: 100_000.0,
                rms_eps: 1e-5,
                tied: true,
                quant: Quant::Q4_1,
                pre: "smollm",
            },
            SyntheticArch::Gemma3_270M => Spec {
                gemma: true,
                layers: 18,
                d: 640,
                ffn: 2048,
                heads: 4,
                kv_heads: 1,
                head_dim: 256,
                vocab: 262_144,
                context: 32_768,
                rope_base: 1_000_000.0,
                rms_eps: 1e-6,
                tied: true,
                quant: Quant::Gemma,
                pre: "default",
            },
            SyntheticArch::Llama3_8B => Spec {
                gemma: false,
                layers: 32,
                d: 4096,
                ffn: 14_336,
                heads: 32,
                kv_heads: 8,
                head_dim: 128,
                vocab: 128_256,
                context: 8192,
                rope_base: 500_000.0,
                rms_eps: 1e-5,
                tied: false,
                quant: Quant::Q4KM,
                pre: "gpt2",
            },
            SyntheticArch::Qwen3_8B => Spec {
                gemma: false,
                layers: 36,
                d: 4096,
                ffn: 12_288,
                heads: 32,
                kv_heads: 8,
                head_dim: 128,
                vocab: 151_936,
                context: 40_960,
                rope_base: 1_000_000.0,
                rms_eps: 1e-6,
                tied: false,
                quant: Quant::Q4KM,
                pre: "gpt2",
            },
        }
    }
}

impl fmt::Display for SyntheticArch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SyntheticArch {
    type Err = String;

    /// A name of [`SyntheticArch::ALL`]; the error lists them.
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| format!("{s:?} is not a synthetic model (one of {})", Self::names()))
    }
}

/// A synthetic model: a shape, how many of its layers, and the seed of its
/// weights.
///
/// ```
/// use pagedattn_model::synthetic::{Synthetic, SyntheticArch};
/// let s = Synthetic::new(SyntheticArch::SmolLm2_135M).with_layers(1).unwrap();
/// let l = s.load().unwrap();
/// assert_eq!(l.config.n_layers, 1);
/// assert_eq!(l.config.vocab_size, 49_152);
/// assert_eq!(s.name(), "synthetic-smollm2-135m");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Synthetic {
    pub arch: SyntheticArch,
    /// Transformer blocks: the first this many of the real model's, in
    /// its formats (1 to [`SyntheticArch::layers`]).
    pub layers: usize,
    pub seed: u64,
}

impl Synthetic {
    /// The whole model, from [`DEFAULT_SEED`].
    pub fn new(arch: SyntheticArch) -> Synthetic {
        Synthetic {
            arch,
            layers: arch.layers(),
            seed: DEFAULT_SEED,
        }
    }

    /// Its first `layers` layers; an error (naming the range) outside
    /// `1..=arch.layers()`.
    pub fn with_layers(self, layers: usize) -> Result<Synthetic, String> {
        let max = self.arch.layers();
        if !(1..=max).contains(&layers) {
            return Err(format!(
                "--layers {layers} outside 1..={max} ({} has {max} layers)",
                self.arch
            ));
        }
        Ok(Synthetic { layers, ..self })
    }

    /// Its weights from `seed`.
    pub fn with_seed(self, seed: u64) -> Synthetic {
        Synthetic { seed, ..self }
    }

    /// The name a server gives it: `synthetic-<arch>`.
    pub fn name(&self) -> String {
        format!("synthetic-{}", self.arch)
    }

    /// What it is, in words: `synthetic llama3-8b (2 of 32 layers, seed 0)`.
    pub fn describe(&self) -> String {
        let max = self.arch.layers();
        let layers = if self.layers == max {
            format!("{max} layers")
        } else {
            format!("{} of {max} layers", self.layers)
        };
        format!("synthetic {} ({layers}, seed {})", self.arch, self.seed)
    }

    /// The bytes of its GGUF file.
    pub fn gguf_bytes(&self) -> Vec<u8> {
        let spec = self.arch.spec();
        let mut w = Writer::default();
        spec.metadata(&mut w, self);
        spec.tokenizer(&mut w);
        spec.tensors(&mut w, self.layers);
        w.finish(self.seed)
    }

    /// Writes and loads it: the weights, configuration and tokenizer, as
    /// [`crate::load::load`] gives a file's (`file_bytes`: the size of the
    /// bytes written). The bytes are dropped once the weights are copied
    /// out, so memory peaks at about twice the model's size.
    pub fn load(&self) -> Result<Loaded, ModelError> {
        let bytes = self.gguf_bytes();
        let len = bytes.len() as u64;
        let g = Gguf::parse(bytes)?;
        from_gguf(&g, len)
    }
}

/// Which formats the matrices take.
#[derive(Clone, Copy, Debug)]
enum Quant {
    /// Every matrix Q4_1, the embedding Q8_0 (SmolLM2's Q4_1 file).
    Q4_1,
    /// Gemma 3 270M's Q4_K_M file.
    Gemma,
    /// A llama Q4_K_M file (the embedding Q4_1, see `Llama3_8B`).
    Q4KM,
}

/// A real model's shape.
#[derive(Clone, Copy, Debug)]
struct Spec {
    /// `gemma3` (else `llama`).
    gemma: bool,
    layers: usize,
    d: u64,
    ffn: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    vocab: usize,
    context: u32,
    rope_base: f32,
    rms_eps: f32,
    tied: bool,
    quant: Quant,
    /// `tokenizer.ggml.pre` of the byte-level BPE.
    pre: &'static str,
}

/// Whether llama.cpp's Q4_K_M gives layer `i` of `n` more bits (its
/// `use_more_bits`: the first and last eighth, and every third between).
fn more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The matrices of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Spec {
    fn prefix(&self) -> &'static str {
        if self.gemma {
            "gemma3"
        } else {
            "llama"
        }
    }

    fn metadata(&self, w: &mut Writer, s: &Synthetic) {
        let p = self.prefix();
        let key = |k: &str| format!("{p}.{k}");
        w.kv_str("general.architecture", p);
        w.kv_str("general.type", "model");
        w.kv_str("general.name", &s.describe());
        w.kv_u32(&key("block_count"), s.layers as u32);
        w.kv_u32(&key("context_length"), self.context);
        w.kv_u32(&key("embedding_length"), self.d as u32);
        w.kv_u32(&key("feed_forward_length"), self.ffn as u32);
        w.kv_u32(&key("attention.head_count"), self.heads as u32);
        w.kv_u32(&key("attention.head_count_kv"), self.kv_heads as u32);
        w.kv_f32(&key("rope.freq_base"), self.rope_base);
        w.kv_f32(&key("attention.layer_norm_rms_epsilon"), self.rms_eps);
        if self.gemma {
            w.kv_u32(&key("attention.key_length"), self.head_dim as u32);
            w.kv_u32(&key("attention.value_length"), self.head_dim as u32);
            w.kv_u32(&key("attention.sliding_window"), 512);
        } else {
            w.kv_u32(&key("vocab_size"), self.vocab as u32);
            w.kv_u32(&key("rope.dimension_count"), self.head_dim as u32);
        }
        // llama.cpp's file types: 3 = mostly Q4_1, 15 = Q4_K_M.
        let file_type = match self.quant {
            Quant::Q4_1 => 3,
            Quant::Gemma | Quant::Q4KM => 15,
        };
        w.kv_u32("general.file_type", file_type);
        w.kv_u32("general.quantization_version", 2);
    }

    fn tokenizer(&self, w: &mut Writer) {
        if self.gemma {
            let v = spm_vocab(self.vocab);
            w.kv_str("tokenizer.ggml.model", "llama");
            w.kv_str("tokenizer.ggml.pre", "default");
            w.kv_str_array("tokenizer.ggml.tokens", &v.tokens);
            w.kv_f32_array("tokenizer.ggml.scores", &v.scores);
            w.kv_i32_array("tokenizer.ggml.token_type", &v.types);
            w.kv_u32("tokenizer.ggml.bos_token_id", 2);
            w.kv_u32("tokenizer.ggml.eos_token_id", 1);
            w.kv_u32("tokenizer.ggml.unknown_token_id", 3);
            w.kv_u32("tokenizer.ggml.padding_token_id", 0);
            w.kv_bool("tokenizer.ggml.add_bos_token", true);
            w.kv_bool("tokenizer.ggml.add_eos_token", false);
            w.kv_bool("tokenizer.ggml.add_space_prefix", false);
        } else {
            let v = bpe_vocab(self.vocab);
            w.kv_str("tokenizer.ggml.model", "gpt2");
            w.kv_str("tokenizer.ggml.pre", self.pre);
            w.kv_str_array("tokenizer.ggml.tokens", &v.tokens);
            w.kv_i32_array("tokenizer.ggml.token_type", &v.types);
            w.kv_str_array("tokenizer.ggml.merges", &v.merges);
            w.kv_u32("tokenizer.ggml.bos_token_id", 1);
            w.kv_u32("tokenizer.ggml.eos_token_id", 2);
            w.kv_u32("tokenizer.ggml.unknown_token_id", 0);
            w.kv_u32("tokenizer.ggml.padding_token_id", 2);
            w.kv_bool("tokenizer.ggml.add_bos_token", false);
            w.kv_bool("tokenizer.ggml.add_space_prefix", false);
        }
    }

    /// The type of matrix `role` of layer `layer` (the real model's, whose
    /// layer count is `self.layers`).
    fn matrix_type(&self, role: Role, layer: usize) -> GgmlType {
        let more = more_bits(layer, self.layers);
        match (self.quant, role) {
            (Quant::Q4_1, _) => GgmlType::Q4_1,
            (Quant::Gemma, Role::Q | Role::K | Role::Gate | Role::Up) => GgmlType::Q5_0,
            (Quant::Gemma, Role::O) => GgmlType::Q4K,
            (Quant::Gemma, Role::V) if more => GgmlType::Q8_0,
            (Quant::Gemma, Role::V) => GgmlType::Q5_0,
            (Quant::Gemma | Quant::Q4KM, Role::Down) if more => GgmlType::Q6K,
            (Quant::Gemma | Quant::Q4KM, _) => GgmlType::Q4K,
        }
    }

    fn tensors(&self, w: &mut Writer, layers: usize) {
        let (d, f) = (self.d, self.ffn);
        let (q, kv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let v = self.vocab as u64;
        let embd = match self.quant {
            Quant::Q4_1 | Quant::Gemma => GgmlType::Q8_0,
            Quant::Q4KM => GgmlType::Q4_1,
        };
        w.tensor("token_embd.weight", &[d, v], embd, Fill::Matrix);
        if !self.tied {
            w.tensor("output.weight", &[d, v], GgmlType::Q6K, Fill::Matrix);
        }
        w.tensor("output_norm.weight", &[d], GgmlType::F32, Fill::Norm(1.0));
        for l in 0..layers {
            let name = |s: &str| format!("blk.{l}.{s}.weight");
            let norm = |w: &mut Writer, s: &str, len: u64| {
                w.tensor(&name(s), &[len], GgmlType::F32, Fill::Norm(1.0));
            };
            let mat = |w: &mut Writer, s: &str, dims: [u64; 2], role: Role| {
                w.tensor(&name(s), &dims, self.matrix_type(role, l), Fill::Matrix);
            };
            norm(w, "attn_norm", d);
            mat(w, "attn_q", [d, q], Role::Q);
            mat(w, "attn_k", [d, kv], Role::K);
            mat(w, "attn_v", [d, kv], Role::V);
            mat(w, "attn_output", [q, d], Role::O);
            norm(w, "ffn_norm", d);
            mat(w, "ffn_gate", [d, f], Role::Gate);
            mat(w, "ffn_up", [d, f], Role::Up);
            mat(w, "ffn_down", [f, d], Role::Down);
            if self.gemma {
                norm(w, "attn_q_norm", self.head_dim);
                norm(w, "attn_k_norm", self.head_dim);
                // Gemma scales the embedding by sqrt(d_model), and the LM
                // head is the embedding: with post norms of 1 the input
                // token's own logit would stand sqrt(d_model) / sqrt(1 +
                // layers) standard deviations above the rest, and the
                // model would repeat its input. Post norms of 16 (the
                // real file's run from 0.6 to 31 on average) let the
                // layers outweigh it from one layer on.
                let post = |w: &mut Writer, s: &str| {
                    w.tensor(&name(s), &[d], GgmlType::F32, Fill::Norm(16.0));
                };
                post(w, "post_attention_norm");
                post(w, "post_ffw_norm");
            }
        }
    }
}

/// A vocabulary's arrays.
#[derive(Default)]
struct Vocab {
    tokens: Vec<String>,
    types: Vec<i32>,
    merges: Vec<String>,
    scores: Vec<f32>,
}

/// Words of two characters and more, shortest first, each a first
/// character (`space`, the word-start marker, or a lower-case letter)
/// followed by lower-case letters; `f` gets each word and its prefix
/// without the last letter. Stops when `f` returns false.
fn words(space: char, mut f: impl FnMut(&str, &str) -> bool) {
    let first: Vec<char> = std::iter::once(space).chain('a'..='z').collect();
    let mut word = String::new();
    for len in 2u32.. {
        let rest = 26u64.pow(len - 1);
        for i in 0..first.len() as u64 * rest {
            word.clear();
            word.push(first[(i / rest) as usize]);
            let mut digits = Vec::with_capacity(len as usize - 1);
            let mut r = i % rest;
            for _ in 1..len {
                digits.push((b'a' + (r % 26) as u8) as char);
                r /= 26;
            }
            word.extend(digits.iter().rev());
            let cut = word.len() - 1;
            if !f(&word, &word[..cut]) {
                return;
            }
        }
    }
}

/// A byte-level BPE vocabulary of `n` tokens (n > 259): the three ChatML
/// specials, the 256 byte tokens, then words, each the merge of its
/// prefix and its last letter (so every merge's parts are tokens).
fn bpe_vocab(n: usize) -> Vocab {
    let mut v = Vocab::default();
    for s in [END_OF_TEXT, IM_START, IM_END] {
        v.tokens.push(s.into());
        v.types.push(token_type::CONTROL);
    }
    for b in 0..=255u8 {
        v.tokens.push(byte_char(b).to_string());
        v.types.push(token_type::NORMAL);
    }
    let space = byte_char(b' ');
    words(space, |word, prefix| {
        if v.tokens.len() >= n {
            return false;
        }
        v.tokens.push(word.to_string());
        v.types.push(token_type::NORMAL);
        let last = &word[prefix.len()..];
        v.merges.push(format!("{prefix} {last}"));
        true
    });
    v.tokens.truncate(n);
    v.types.truncate(n);
    v
}

/// A SentencePiece vocabulary of `n` tokens (n > 358) in Gemma's order:
/// `<pad>`, `<eos>`, `<bos>`, `<unk>`, the turn markers, the 256 byte
/// tokens, the printable ASCII characters and `▁`, then words starting
/// with `▁` or a letter, scored so that shorter words merge first.
fn spm_vocab(n: usize) -> Vocab {
    let mut v = Vocab::default();
    let push = |v: &mut Vocab, t: String, ty: i32, score: f32| {
        v.tokens.push(t);
        v.types.push(ty);
        v.scores.push(score);
    };
    for s in [
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        START_OF_TURN,
        END_OF_TURN,
    ] {
        push(&mut v, s.into(), token_type::CONTROL, 0.0);
    }
    for b in 0..=255u8 {
        push(&mut v, format!("<0x{b:02X}>"), token_type::BYTE, 0.0);
    }
    let space = '\u{2581}';
    for c in std::iter::once(space).chain((b'!'..=b'~').map(char::from)) {
        let score = -(v.tokens.len() as f32);
        push(&mut v, c.to_string(), token_type::NORMAL, score);
    }
    words(space, |word, _| {
        if v.tokens.len() >= n {
            return false;
        }
        let score = -(v.tokens.len() as f32);
        push(&mut v, word.to_string(), token_type::NORMAL, score);
        true
    });
    v.tokens.truncate(n);
    v.types.truncate(n);
    v.scores.truncate(n);
    v
}

/// GPT-2's byte-to-character map: printable Latin-1 bytes are their own
/// character, the others 256 + their rank among them.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).expect("a valid code point")
}

/// What a tensor's values are.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fill {
    /// A weight matrix: elements of standard deviation `1 / sqrt(ne0)`.
    Matrix,
    /// RMSNorm weights: uniform within 10 % of this.
    Norm(f32),
}

struct TensorSpec {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    fill: Fill,
    bytes: usize,
}

/// GGUF v3 in memory: metadata as it is added, tensors laid out (aligned
/// to the default 32 bytes) and filled at the end.
#[derive(Default)]
struct Writer {
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<TensorSpec>,
}

/// Value type ids of GGUF metadata.
mod vt {
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
}

const ALIGN: usize = crate::gguf::DEFAULT_ALIGNMENT as usize;

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl Writer {
    fn key(&mut self, key: &str, ty: u32) {
        put_str(&mut self.kv, key);
        self.kv.extend_from_slice(&ty.to_le_bytes());
        self.n_kv += 1;
    }

    fn kv_u32(&mut self, key: &str, v: u32) {
        self.key(key, vt::U32);
        self.kv.extend_from_slice(&v.to_le_bytes());
    }

    fn kv_f32(&mut self, key: &str, v: f32) {
        self.key(key, vt::F32);
        self.kv.extend_from_slice(&v.to_le_bytes());
    }

    fn kv_bool(&mut self, key: &str, v: bool) {
        self.key(key, vt::BOOL);
        self.kv.push(u8::from(v));
    }

    fn kv_str(&mut self, key: &str, v: &str) {
        self.key(key, vt::STRING);
        put_str(&mut self.kv, v);
    }

    fn array_head(&mut self, key: &str, ty: u32, len: usize) {
        self.key(key, vt::ARRAY);
        self.kv.extend_from_slice(&ty.to_le_bytes());
        self.kv.extend_from_slice(&(len as u64).to_le_bytes());
    }

    fn kv_str_array(&mut self, key: &str, v: &[String]) {
        self.array_head(key, vt::STRING, v.len());
        for s in v {
            put_str(&mut self.kv, s);
        }
    }

    fn kv_i32_array(&mut self, key: &str, v: &[i32]) {
        self.array_head(key, vt::I32, v.len());
        for x in v {
            self.kv.extend_from_slice(&x.to_le_bytes());
        }
    }

    fn kv_f32_array(&mut self, key: &str, v: &[f32]) {
        self.array_head(key, vt::F32, v.len());
        for x in v {
            self.kv.extend_from_slice(&x.to_le_bytes());
        }
    }

    fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, fill: Fill) {
        let n = dims.iter().product::<u64>();
        let bytes = ty.bytes_for(n).expect("whole blocks") as usize;
        self.tensors.push(TensorSpec {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
            fill,
            bytes,
        });
    }

    /// The file: header, tensor infos, then the data, filled from `seed`.
    fn finish(self, seed: u64) -> Vec<u8> {
        let mut head = Vec::with_capacity(self.kv.len() + 64 * self.tensors.len() + 24);
        head.extend_from_slice(b"GGUF");
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&self.n_kv.to_le_bytes());
        head.extend_from_slice(&self.kv);
        let mut offset = 0usize;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            put_str(&mut head, &t.name);
            head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.ty.id().to_le_bytes());
            head.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.bytes).next_multiple_of(ALIGN);
        }
        let data_start = head.len().next_multiple_of(ALIGN);
        let end = offsets
            .last()
            .zip(self.tensors.last())
            .map_or(0, |(o, t)| o + t.bytes);
        // Zeroed memory from the allocator (pages the OS maps on first
        // write), then the header and each tensor written once.
        let mut out = vec![0u8; data_start + end];
        out[..head.len()].copy_from_slice(&head);

        let mut jobs = Vec::new();
        let mut rest = &mut out[data_start..];
        let mut at = 0usize;
        for (t, &o) in self.tensors.iter().zip(&offsets) {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(o - at);
            let (data, tail) = tail.split_at_mut(t.bytes);
            rest = tail;
            at = o + t.bytes;
            let (block_elems, block_bytes) = t.ty.block_layout().expect("a known type");
            let scale = tensor_scale(t);
            let tseed = mix(seed, fnv1a(t.name.as_bytes()));
            // Chunks of whole blocks, of a size fixed by the format alone.
            let per_chunk = (CHUNK_BYTES / block_bytes as usize).max(1) * block_bytes as usize;
            for (i, chunk) in data.chunks_mut(per_chunk).enumerate() {
                jobs.push(Job {
                    data: chunk,
                    ty: t.ty,
                    fill: t.fill,
                    scale,
                    block: (block_elems as usize, block_bytes as usize),
                    seed: mix(tseed, i as u64),
                });
            }
        }
        run_jobs(jobs);
        out
    }
}

/// Bytes of one generation job (its seed fixed by its index).
const CHUNK_BYTES: usize = 4 << 20;

struct Job<'a> {
    data: &'a mut [u8],
    ty: GgmlType,
    fill: Fill,
    /// The elements' standard deviation (matrices).
    scale: f32,
    block: (usize, usize),
    seed: u64,
}

/// The elements' standard deviation of a tensor: `1 / sqrt(ne0)`.
fn tensor_scale(t: &TensorSpec) -> f32 {
    1.0 / (t.dims[0] as f32).sqrt()
}

fn run_jobs(jobs: Vec<Job<'_>>) {
    let threads = if cfg!(target_arch = "wasm32") {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get().min(16))
    };
    if threads <= 1 || jobs.len() <= 1 {
        jobs.into_iter().for_each(Job::run);
        return;
    }
    let queue = Mutex::new(jobs.into_iter());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                match next {
                    Some(job) => job.run(),
                    None => break,
                }
            });
        }
    });
}

/// Standard deviation of a uniform integer on `0..n`.
fn uniform_std(n: u32) -> f32 {
    (((n * n - 1) as f32) / 12.0).sqrt()
}

fn f16_bytes(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

impl Job<'_> {
    fn run(self) {
        let mut rng = SplitMix64::new(self.seed);
        if self.ty == GgmlType::F32 {
            let (center, spread) = match self.fill {
                Fill::Norm(center) => (center, 0.1 * center),
                // Uniform on [-a, a) has standard deviation a / sqrt(3).
                Fill::Matrix => (0.0, self.scale * 3f32.sqrt()),
            };
            for c in self.data.chunks_exact_mut(4) {
                let v = center + spread * rng.next_signed();
                c.copy_from_slice(&v.to_le_bytes());
            }
            return;
        }
        // Random quants everywhere, then each block's scales set so that
        // the values have a mean of zero: a matrix whose elements share a
        // bias maps every input onto one direction (its rows' sums), which
        // then swamps the logits (one token wins whatever the input).
        let mut words = self.data.chunks_exact_mut(8);
        for w in &mut words {
            w.copy_from_slice(&rng.next_u64().to_le_bytes());
        }
        let tail = words.into_remainder();
        let last = rng.next_u64().to_le_bytes();
        let n = tail.len();
        tail.copy_from_slice(&last[..n]);
        let s = self.scale;
        let (_, bb) = self.block;
        match self.ty {
            GgmlType::Q4_1 => {
                // d * q + m, q in 0..16, m = -7.5d: d * (q - 7.5).
                let d = s / uniform_std(16);
                let (db, mb) = (f16_bytes(d), f16_bytes(-7.5 * d));
                for b in self.data.chunks_exact_mut(bb) {
                    b[0..2].copy_from_slice(&db);
                    b[2..4].copy_from_slice(&mb);
                }
            }
            GgmlType::Q8_0 | GgmlType::Q5_0 => {
                // d * q, q in -128..128 (Q8_0), or d * (q - 16), q in
                // 0..32 (Q5_0): a mean of -d/2, so d alternates in sign
                // from block to block.
                let levels = if self.ty == GgmlType::Q8_0 { 256 } else { 32 };
                let d = s / uniform_std(levels);
                let signed = [f16_bytes(d), f16_bytes(-d)];
                for (i, b) in self.data.chunks_exact_mut(bb).enumerate() {
                    b[0..2].copy_from_slice(&signed[i % 2]);
                }
            }
            GgmlType::Q4K => {
                // Every sub-block's 6-bit scale and minimum 8 (bytes 0..8
                // hold them for sub-blocks 0..4, bytes 8..12 the low
                // nibbles of the rest; the high bits are 0): d * 8 * q -
                // dmin * 8 with dmin = 7.5d is 8d * (q - 7.5).
                let d = s / (8.0 * uniform_std(16));
                let (db, mb) = (f16_bytes(d), f16_bytes(7.5 * d));
                let scales = [8, 8, 8, 8, 8, 8, 8, 8, 0x88, 0x88, 0x88, 0x88];
                for b in self.data.chunks_exact_mut(bb) {
                    b[0..2].copy_from_slice(&db);
                    b[2..4].copy_from_slice(&mb);
                    b[4..16].copy_from_slice(&scales);
                }
            }
            GgmlType::Q6K => {
                // d * sc * (q - 32), q in 0..64: a mean of -d * sc / 2, so
                // the 16-element scales alternate between 16 and -16.
                let db = f16_bytes(s / (16.0 * uniform_std(64)));
                let scales: [u8; 16] = std::array::from_fn(|i| (16i8 * [1, -1][i % 2]) as u8);
                for b in self.data.chunks_exact_mut(bb) {
                    b[192..208].copy_from_slice(&scales);
                    b[208..210].copy_from_slice(&db);
                }
            }
            other => unreachable!("no synthetic {other} weights"),
        }
    }
}

/// One SplitMix64 output of `a` and `b` together.
fn mix(a: u64, b: u64) -> u64 {
    SplitMix64::new(a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64()
}

/// FNV-1a of a name.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::Tokenizer;

    #[test]
    fn names_parse_and_a_wrong_one_lists_them() {
        for a in SyntheticArch::ALL {
            assert_eq!(a.name().parse::<SyntheticArch>(), Ok(a));
        }
        let e = "nope".parse::<SyntheticArch>().unwrap_err();
        assert!(
            e.contains("\"nope\"") && e.contains("llama3-8b, qwen3-8b"),
            "{e}"
        );
        let s = Synthetic::new(SyntheticArch::Gemma3_270M);
        assert_eq!(s.layers, 18);
        assert!(s.with_layers(0).unwrap_err().contains("1..=18"));
        assert!(s.with_layers(19).is_err());
        assert_eq!(
            s.with_layers(18).unwrap().describe(),
            "synthetic gemma3-270m (18 layers, seed 0)"
        );
    }

    #[test]
    fn the_q4_k_m_rule_is_llama_cpps() {
        let more: Vec<usize> = (0..18).filter(|&i| more_bits(i, 18)).collect();
        // As gemma-3-270m-q4_k_m.gguf has it (V in Q8_0, down in Q6_K).
        assert_eq!(more, [0, 1, 4, 7, 10, 13, 15, 16, 17]);
        assert_eq!((0..32).filter(|&i| more_bits(i, 32)).count(), 16);
    }

    /// Every format's elements dequantize to a mean of zero and a
    /// standard deviation of 1 / sqrt(k).
    #[test]
    fn the_values_are_centred_and_scaled() {
        use crate::weights::HostMatrix;
        let types = [
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q5_0,
            GgmlType::Q4K,
            GgmlType::Q6K,
            GgmlType::F32,
        ];
        let (k, rows) = (1024u64, 64u64);
        let mut w = Writer::default();
        for ty in types {
            w.tensor(&format!("{ty}"), &[k, rows], ty, Fill::Matrix);
        }
        w.tensor("norm", &[k], GgmlType::F32, Fill::Norm(1.0));
        let g = Gguf::parse(w.finish(7)).unwrap();
        let sigma = 1.0 / (k as f64).sqrt();
        for ty in types {
            let t = g.tensor(&format!("{ty}")).unwrap();
            let m = HostMatrix::from_gguf(ty, rows as usize, k as usize, t.data).unwrap();
            let v: Vec<f64> = (0..rows as usize)
                .flat_map(|r| m.row_f32(r))
                .map(f64::from)
                .collect();
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
            assert!(
                mean.abs() < 0.02 * sigma,
                "{ty}: mean {mean}, sigma {sigma}"
            );
            assert!(
                (std / sigma - 1.0).abs() < 0.05,
                "{ty}: std {std}, sigma {sigma}"
            );
        }
        let n = g.tensor("norm").unwrap().to_f32().unwrap();
        assert!(n.iter().all(|x| (0.9..1.1).contains(x)));
    }

    /// The engine fuses Q, K and V, and gate and up, into one matrix each
    /// (of one GPU format: Q5_0 reads as Q8_0): every layer of every shape
    /// at full depth can be fused.
    #[test]
    fn every_layer_fuses() {
        let gpu = |t: GgmlType| match t {
            GgmlType::Q5_0 => GgmlType::Q8_0,
            t => t,
        };
        for arch in SyntheticArch::ALL {
            let spec = arch.spec();
            for l in 0..spec.layers {
                let ty = |r| gpu(spec.matrix_type(r, l));
                assert_eq!(ty(Role::Q), ty(Role::K), "{arch} layer {l}");
                assert_eq!(ty(Role::Q), ty(Role::V), "{arch} layer {l}");
                assert_eq!(ty(Role::Gate), ty(Role::Up), "{arch} layer {l}");
            }
        }
    }

    #[test]
    fn the_byte_map_is_gpt2s() {
        assert_eq!(byte_char(b'a'), 'a');
        assert_eq!(byte_char(b' '), 'Ġ');
        assert_eq!(byte_char(b'\n'), 'Ċ');
        let all: std::collections::HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(all.len(), 256);
    }

    /// Both vocabularies are valid, of the size asked, and encode text
    /// into words and back.
    #[test]
    fn the_vocabularies_tokenize() {
        for arch in [SyntheticArch::SmolLm2_135M, SyntheticArch::Gemma3_270M] {
            let spec = arch.spec();
            let mut w = Writer::default();
            spec.tokenizer(&mut w);
            let bytes = w.finish(0);
            let t = Tokenizer::from_gguf(&Gguf::parse(bytes).unwrap()).unwrap();
            assert_eq!(t.vocab_size(), spec.vocab, "{arch}");
            let text = "the keeper climbed the stairs, Chapter 12.\n";
            let ids = t.encode(text, false);
            // Words, not bytes.
            assert!(
                ids.len() * 3 < text.len() * 2,
                "{arch}: {} tokens",
                ids.len()
            );
            assert_eq!(t.decode(&ids), text, "{arch}");
            assert!(t.unencodable("naïve ✓").is_none(), "{arch}");
            let chat = t.chat_prompt("hi", None);
            let ids = t.encode(&chat, true);
            assert!(ids.iter().any(|&i| t.is_control(i)), "{arch}: {chat}");
        }
    }
}
