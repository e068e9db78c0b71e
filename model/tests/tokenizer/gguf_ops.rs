//! The GGUF loader, the llama configuration and the tokenizer on hostile
//! files, driven by arbitrary bytes. Shared by the fuzz target
//! (`fuzz/fuzz_targets/gguf.rs`) and its corpus replay
//! (`model/tests/tokenizer.rs`).
//!
//! An input's first byte picks the mode: raw (the rest of the input is the
//! file) or mutated (a small valid llama GGUF with a byte-level BPE
//! vocabulary, built here, then edited as the input says: bytes
//! overwritten, counts and lengths set to extreme values, the file cut
//! short or extended). Then the whole loading path runs: `Gguf::parse`;
//! for a file that parses, every tensor's first rows read and dequantized
//! (`row_data`, `dequant_row`, and `to_f32` for small tensors),
//! `LlamaConfig::from_gguf`, `Tokenizer::from_gguf` and, for a tokenizer
//! that loads, encode and decode of a short text.
//!
//! Checked: nothing panics or allocates without bound (a count is checked
//! against the bytes left before anything is reserved); a parsed file's
//! tensors all lie inside it (their first rows read); the unedited file
//! parses, configures and tokenizes, and decode inverts encode on it.
#![allow(dead_code)]

use pagedattn_model::config::LlamaConfig;
use pagedattn_model::gguf::Gguf;
use pagedattn_model::tokenizer::Tokenizer;

#[allow(unused_imports)]
pub use pagedattn_test_support::harness;
use pagedattn_test_support::tally;

tally! {
    /// What one input reached.
    pub struct Reached: usize {
        parsed: "parsed",
        refused: "refused",
        configured: "configured",
        config_refused: "config refused",
        tokenizer_loaded: "tokenizer loaded",
        tokenizer_refused: "tokenizer refused",
    }
}

/// A GGUF v3 writer: just enough for the harness's base file.
struct Writer {
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    data: Vec<u8>,
    n_tensors: u64,
}

impl Writer {
    fn new() -> Self {
        Self {
            kv: Vec::new(),
            n_kv: 0,
            infos: Vec::new(),
            data: Vec::new(),
            n_tensors: 0,
        }
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    fn key(&mut self, k: &str, ty: u32) {
        Self::string(&mut self.kv, k);
        self.kv.extend(ty.to_le_bytes());
        self.n_kv += 1;
    }

    fn u32(&mut self, k: &str, v: u32) -> &mut Self {
        self.key(k, 4);
        self.kv.extend(v.to_le_bytes());
        self
    }

    fn f32(&mut self, k: &str, v: f32) -> &mut Self {
        self.key(k, 6);
        self.kv.extend(v.to_le_bytes());
        self
    }

    fn str(&mut self, k: &str, v: &str) -> &mut Self {
        self.key(k, 8);
        Self::string(&mut self.kv, v);
        self
    }

    fn strs(&mut self, k: &str, v: &[&str]) -> &mut Self {
        self.key(k, 9);
        self.kv.extend(8u32.to_le_bytes());
        self.kv.extend((v.len() as u64).to_le_bytes());
        for s in v {
            Self::string(&mut self.kv, s);
        }
        self
    }

    fn i32s(&mut self, k: &str, v: &[i32]) -> &mut Self {
        self.key(k, 9);
        self.kv.extend(5u32.to_le_bytes());
        self.kv.extend((v.len() as u64).to_le_bytes());
        for x in v {
            self.kv.extend(x.to_le_bytes());
        }
        self
    }

    /// An f32 tensor of `dims` (ne0 first), filled with a ramp.
    fn tensor(&mut self, name: &str, dims: &[u64]) -> &mut Self {
        while !self.data.len().is_multiple_of(32) {
            self.data.push(0);
        }
        Self::string(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(0u32.to_le_bytes()); // F32
        self.infos.extend((self.data.len() as u64).to_le_bytes());
        let n: u64 = dims.iter().product();
        for i in 0..n {
            self.data
                .extend(((i % 13) as f32 / 13.0 - 0.5).to_le_bytes());
        }
        self.n_tensors += 1;
        self
    }

    fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        out.extend(&self.infos);
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        out.extend(&self.data);
        out
    }
}

/// The base file: a one-layer llama (d_model 64, 2 query heads and 1 KV
/// head of 32, FFN 64) with an 8-token byte-level BPE vocabulary.
pub fn base_file() -> Vec<u8> {
    let tokens = [
        "<unk>", "<s>", "</s>", "a", "b", "\u{120}", "ab", "\u{120}a",
    ];
    let types = [2, 3, 3, 1, 1, 1, 1, 1];
    let mut w = Writer::new();
    w.str("general.architecture", "llama")
        .u32("llama.block_count", 1)
        .u32("llama.context_length", 128)
        .u32("llama.embedding_length", 64)
        .u32("llama.feed_forward_length", 64)
        .u32("llama.attention.head_count", 2)
        .u32("llama.attention.head_count_kv", 1)
        .f32("llama.rope.freq_base", 10000.0)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .str("tokenizer.ggml.model", "gpt2")
        .str("tokenizer.ggml.pre", "smollm")
        .strs("tokenizer.ggml.tokens", &tokens)
        .i32s("tokenizer.ggml.token_type", &types)
        .strs("tokenizer.ggml.merges", &["a b", "\u{120} a"])
        .u32("tokenizer.ggml.eos_token_id", 2)
        .u32("tokenizer.ggml.bos_token_id", 1);
    let v = tokens.len() as u64;
    w.tensor("token_embd.weight", &[64, v])
        .tensor("output_norm.weight", &[64]);
    for (name, dims) in [
        ("attn_norm", [64u64, 1]),
        ("attn_q", [64, 64]),
        ("attn_k", [64, 32]),
        ("attn_v", [64, 32]),
        ("attn_output", [64, 64]),
        ("ffn_norm", [64, 1]),
        ("ffn_gate", [64, 64]),
        ("ffn_up", [64, 64]),
        ("ffn_down", [64, 64]),
    ] {
        let dims: &[u64] = if dims[1] == 1 { &dims[..1] } else { &dims };
        w.tensor(&format!("blk.0.{name}.weight"), dims);
    }
    w.build()
}

/// Loads `file` the whole way, as the engine does; counts what happened.
pub fn load(file: Vec<u8>, r: &mut Reached) -> bool {
    let len = file.len() as u64;
    let g = match Gguf::parse(file) {
        Ok(g) => g,
        Err(e) => {
            let _ = e.to_string();
            r.refused += 1;
            return false;
        }
    };
    r.parsed += 1;
    assert!(g.data_offset() <= len);
    for info in g.tensor_infos().iter().take(64) {
        let t = g.tensor(&info.name).expect("a listed tensor opens");
        for row in 0..info.n_rows().min(2) {
            let data = t
                .row_data(row)
                .expect("a parsed tensor's rows lie inside the file");
            assert!(data.as_ptr() >= g.bytes().as_ptr());
            let _ = t.dequant_row(row);
        }
        if info.n_elements <= 4096 {
            let _ = t.to_f32();
        }
        assert!(
            t.row_data(info.n_rows()).is_err(),
            "a row past the end reads"
        );
    }
    let mut all = true;
    match LlamaConfig::from_gguf(&g) {
        Ok(_) => r.configured += 1,
        Err(e) => {
            let _ = e.to_string();
            r.config_refused += 1;
            all = false;
        }
    }
    match Tokenizer::from_gguf(&g) {
        Ok(t) => {
            r.tokenizer_loaded += 1;
            for text in ["ab a", "a\u{0}b <s>", "\u{1F600}", ""] {
                let ids = t.encode(text, true);
                assert!(ids.iter().all(|&i| (i as usize) < t.vocab_size()));
                let _ = t.decode(&ids);
            }
        }
        Err(e) => {
            let _ = e.to_string();
            r.tokenizer_refused += 1;
            all = false;
        }
    }
    all
}

/// Runs one input.
pub fn run(data: &[u8]) -> Reached {
    let mut r = Reached::default();
    let Some((&mode, rest)) = data.split_first() else {
        return r;
    };
    if mode % 4 == 0 {
        load(rest.to_vec(), &mut r);
        return r;
    }
    let mut file = base_file();
    for edit in rest.chunks(4) {
        let at = u16::from_le_bytes([edit[0], *edit.get(1).unwrap_or(&0)]) as usize;
        let val = *edit.get(2).unwrap_or(&0);
        let at = at % file.len().max(1);
        match edit.get(3).copied().unwrap_or(0) % 8 {
            // Overwrite a byte.
            0..=2 => file[at] = val,
            // An extreme little-endian u64 at `at` (a count or a length).
            3 => {
                let x = [u64::MAX, 1 << 40, u32::MAX as u64, 0, 1 << 62][val as usize % 5];
                let end = (at + 8).min(file.len());
                file[at..end].copy_from_slice(&x.to_le_bytes()[..end - at]);
            }
            4 => file.truncate(at),
            5 => file.extend(std::iter::repeat_n(val, at % 97)),
            6 => file[at] ^= 1 << (val % 8),
            _ => {
                let end = (at + 4).min(file.len());
                file[at..end]
                    .copy_from_slice(&(val as u32 * 0x0101_0101).to_le_bytes()[..end - at]);
            }
        }
        if file.is_empty() {
            break;
        }
    }
    load(file, &mut r);
    r
}
