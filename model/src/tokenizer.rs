//! Byte-level BPE (the GPT-2 scheme) from a GGUF's own vocabulary and
//! merges, and the Instruct model's ChatML chat prompt.
//!
//! Encoding plain text:
//! 1. pre-tokenize: for `tokenizer.ggml.pre = "smollm"` every Unicode
//!    number (`\p{N}`) is first split off as a piece of its own (HF's
//!    `Digits(individual_digits)`); then each piece is split like GPT-2's
//!    regex `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
//!    (case-sensitive contractions), implemented by hand below;
//! 2. map each piece's UTF-8 bytes to GPT-2's printable byte characters;
//! 3. merge adjacent symbols by merge rank (lowest first, leftmost on
//!    ties) until no merge applies.
//!
//! With `parse_special`, control tokens (`<|im_start|>`, `<|im_end|>`,
//! `<|endoftext|>`, ...) written in the text become single tokens (the
//! leftmost, longest match first) and the text between them is encoded as
//! plain text.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use unicode_general_category::{get_general_category, GeneralCategory};

use crate::gguf::{Gguf, GgufError};

/// The system message SmolLM2-Instruct's chat template uses when the
/// conversation has none.
pub const DEFAULT_SYSTEM: &str =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/// ChatML turn start.
pub const IM_START: &str = "<|im_start|>";
/// ChatML turn end: what the Instruct model emits when it is done.
pub const IM_END: &str = "<|im_end|>";
/// End of document.
pub const END_OF_TEXT: &str = "<|endoftext|>";
/// Gemma's turn start.
pub const START_OF_TURN: &str = "<start_of_turn>";
/// Gemma's turn end: what Gemma emits when it is done.
pub const END_OF_TURN: &str = "<end_of_turn>";

/// GGUF `tokenizer.ggml.token_type` values.
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// What can be wrong with a GGUF's tokenizer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("tokenizer.ggml.model is {0:?}; supported: \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece BPE with byte fallback)")]
    UnsupportedModel(String),
    #[error("{tokens} tokens but {scores} scores")]
    ScoreMismatch { tokens: usize, scores: usize },
    #[error("tokenizer.ggml.pre is {0:?}; supported: \"smollm\" (digits split, then the GPT-2 regex) and \"gpt2\"/\"default\"")]
    UnsupportedPre(String),
    #[error("tokenizer.ggml.tokens is empty")]
    EmptyVocab,
    #[error("{tokens} tokens but {types} token types")]
    LengthMismatch { tokens: usize, types: usize },
    #[error("vocabulary of {0} tokens does not fit u32 ids")]
    VocabTooLarge(usize),
    #[error("{key} = {id} is not a token id (vocabulary of {vocab})")]
    BadTokenId {
        key: &'static str,
        id: u64,
        vocab: usize,
    },
    #[error("merge {rank} {merge:?}: {why}")]
    BadMerge {
        rank: usize,
        merge: String,
        why: &'static str,
    },
    #[error("no end-of-turn token: neither {IM_END:?} nor tokenizer.ggml.eos_token_id")]
    NoEos,
    /// Text the vocabulary cannot spell: one of the character's UTF-8
    /// bytes has no token (and the vocabulary has no byte fallback).
    #[error("character {} (U+{:04X}) at position {at} has no token in the vocabulary: the text cannot be encoded without changing it", .ch.escape_debug(), *.ch as u32)]
    Unencodable { ch: char, at: usize },
}

/// Which pre-tokenizer splits plain text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// Every `\p{N}` alone, then the GPT-2 regex (`"smollm"`).
    SmolLm,
    /// The GPT-2 regex (`"gpt2"`, `"default"`, or no `tokenizer.ggml.pre`).
    Gpt2,
}

/// GPT-2's byte-to-character map: printable Latin-1 bytes stand for
/// themselves, the other 68 bytes for U+0100 onwards, in byte order.
fn byte_to_char_table() -> [char; 256] {
    let mut t = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        let c = if printable {
            b
        } else {
            extra += 1;
            0xff + extra
        };
        t[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    t
}

/// The inverse of [`byte_to_char_table`] for one character.
fn char_to_byte(c: char) -> Option<u8> {
    let c = c as u32;
    let printable =
        (0x21..=0x7e).contains(&c) || (0xa1..=0xac).contains(&c) || (0xae..=0xff).contains(&c);
    if printable {
        return Some(c as u8);
    }
    if !(0x100..0x100 + 68).contains(&c) {
        return None;
    }
    // The n-th non-printable byte (n from 0).
    let n = c - 0x100;
    let mut seen = 0u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        if !printable {
            if seen == n {
                return Some(b as u8);
            }
            seen += 1;
        }
    }
    None
}

/// Character classes of the pre-tokenizer regex.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// `\p{L}`: general category Lu, Ll, Lt, Lm or Lo.
    Letter,
    /// `\p{N}`: general category Nd, Nl or No.
    Number,
    /// `\s`: the Unicode White_Space property.
    Space,
    /// Anything else: `[^\s\p{L}\p{N}]`.
    Other,
}

fn class(c: char) -> Class {
    if c.is_ascii() {
        return if c.is_ascii_alphabetic() {
            Class::Letter
        } else if c.is_ascii_digit() {
            Class::Number
        } else if c.is_whitespace() {
            Class::Space
        } else {
            Class::Other
        };
    }
    if c.is_whitespace() {
        return Class::Space;
    }
    // char::is_numeric is exactly Nd | Nl | No.
    if c.is_numeric() {
        return Class::Number;
    }
    use GeneralCategory as G;
    match get_general_category(c) {
        G::UppercaseLetter
        | G::LowercaseLetter
        | G::TitlecaseLetter
        | G::ModifierLetter
        | G::OtherLetter => Class::Letter,
        _ => Class::Other,
    }
}

/// Splits `text` into pre-tokens, calling `emit` with each in order.
fn pre_tokenize<'t>(text: &'t str, pre: PreTokenizer, mut emit: impl FnMut(&'t str)) {
    let chars: Vec<(usize, char, Class)> =
        text.char_indices().map(|(i, c)| (i, c, class(c))).collect();
    let off = |i: usize| chars.get(i).map_or(text.len(), |c| c.0);
    match pre {
        PreTokenizer::Gpt2 => gpt2_split(text, &chars, 0, chars.len(), &off, &mut emit),
        PreTokenizer::SmolLm => {
            let mut start = 0;
            for (i, &(_, _, cl)) in chars.iter().enumerate() {
                if cl == Class::Number {
                    gpt2_split(text, &chars, start, i, &off, &mut emit);
                    emit(&text[off(i)..off(i + 1)]);
                    start = i + 1;
                }
            }
            gpt2_split(text, &chars, start, chars.len(), &off, &mut emit);
        }
    }
}

/// The GPT-2 regex over `chars[start..end]`, which it sees as the whole
/// input (the lookahead `(?!\S)` stops at `end`).
fn gpt2_split<'t>(
    text: &'t str,
    chars: &[(usize, char, Class)],
    start: usize,
    end: usize,
    off: &impl Fn(usize) -> usize,
    emit: &mut impl FnMut(&'t str),
) {
    let c = |i: usize| if i < end { Some(chars[i].1) } else { None };
    let cl = |i: usize| if i < end { Some(chars[i].2) } else { None };
    let run = |mut k: usize, want: Class| {
        while cl(k) == Some(want) {
            k += 1;
        }
        k
    };
    let mut i = start;
    while i < end {
        // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive).
        if c(i) == Some('\'') {
            let len = match (c(i + 1), c(i + 2)) {
                (Some('s' | 't' | 'm' | 'd'), _) => 2,
                (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => 3,
                _ => 0,
            };
            if len > 0 {
                emit(&text[off(i)..off(i + len)]);
                i += len;
                continue;
            }
        }
        //  ?\p{L}+ |  ?\p{N}+ |  ?[^\s\p{L}\p{N}]+
        let j = if c(i) == Some(' ') { i + 1 } else { i };
        if let Some(k) = cl(j).filter(|&k| k != Class::Space) {
            let e = run(j, k);
            emit(&text[off(i)..off(e)]);
            i = e;
            continue;
        }
        // \s+(?!\S) | \s+ : a run of spaces, less its last one when a
        // non-space follows (that one goes with the next piece), unless
        // the run is that one alone.
        let e = run(i, Class::Space);
        let e = if e < end && e - i > 1 { e - 1 } else { e };
        emit(&text[off(i)..off(e)]);
        i = e;
    }
}

/// A byte-level BPE tokenizer read from a GGUF.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    model: String,
    pre_name: String,
    pre: PreTokenizer,
    tokens: Vec<String>,
    types: Vec<i32>,
    /// Raw bytes of each token, back to back; token `i` is
    /// `bytes[starts[i]..starts[i + 1]]`.
    bytes: Vec<u8>,
    starts: Vec<usize>,
    vocab: HashMap<String, u32>,
    merges: Merges,
    /// The token of each single byte, if the vocabulary has one.
    byte_ids: [Option<u32>; 256],
    /// Tokens matched in text: `(text, id, control)`, longest first.
    specials: Vec<Special>,
    special_first: [bool; 256],
    eos_token_id: Option<u32>,
    bos_token_id: Option<u32>,
    padding_token_id: Option<u32>,
    unknown_token_id: Option<u32>,
    add_bos: bool,
    im_end: u32,
    chat_template: Option<String>,
    /// SentencePiece (`tokenizer.ggml.model = "llama"`): each token's
    /// score, by which adjacent pieces merge (highest first); `None` for
    /// byte-level BPE, which merges by `merges`' rank.
    spm_scores: Option<Vec<f32>>,
}

/// `(text, id, control)` of a token matched in text.
type Special = (String, u32, bool);

/// `(left, right) -> (rank, merged)`.
type Merges = HashMap<(u32, u32), (u32, u32)>;

/// The vocabulary's index, every token's raw bytes back to back with
/// their starts (one more than the tokens), and the tokens matched in
/// text (control and user-defined ones, whose text is their bytes).
fn token_bytes(
    tokens: &[String],
    types: &[i32],
    spm: bool,
) -> (HashMap<String, u32>, Vec<u8>, Vec<usize>, Vec<Special>) {
    let mut vocab = HashMap::with_capacity(tokens.len());
    let mut bytes = Vec::new();
    let mut starts = Vec::with_capacity(tokens.len() + 1);
    let mut specials = Vec::new();
    for (id, (tok, &ty)) in tokens.iter().zip(types).enumerate() {
        let id = id as u32;
        vocab.entry(tok.clone()).or_insert(id);
        starts.push(bytes.len());
        let text_is_bytes = ty == token_type::CONTROL || ty == token_type::USER_DEFINED;
        if text_is_bytes {
            bytes.extend_from_slice(tok.as_bytes());
            if !tok.is_empty() {
                specials.push((tok.clone(), id, ty == token_type::CONTROL));
            }
        } else if spm {
            // SentencePiece: `<0xAB>` is the byte 0xAB, `▁` a space.
            match (ty == token_type::BYTE).then(|| spm_byte(tok)).flatten() {
                Some(b) => bytes.push(b),
                None => bytes.extend_from_slice(tok.replace('\u{2581}', " ").as_bytes()),
            }
        } else {
            for ch in tok.chars() {
                match char_to_byte(ch) {
                    Some(b) => bytes.push(b),
                    None => {
                        let mut buf = [0u8; 4];
                        bytes.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                    }
                }
            }
        }
    }
    starts.push(bytes.len());
    (vocab, bytes, starts, specials)
}

/// The merges, `(left, right) -> (rank, merged)`: each two vocabulary
/// tokens whose concatenation is one too; the first occurrence of a pair
/// wins.
fn read_merges(g: &Gguf, vocab: &HashMap<String, u32>) -> Result<Merges, TokenizerError> {
    let merge_list: &[String] = match g.get("tokenizer.ggml.merges") {
        None => &[],
        Some(_) => g.get_str_array("tokenizer.ggml.merges")?,
    };
    let mut merges = HashMap::with_capacity(merge_list.len());
    for (rank, m) in merge_list.iter().enumerate() {
        let bad = |why| TokenizerError::BadMerge {
            rank,
            merge: m.clone(),
            why,
        };
        let (a, b) = m
            .split_once(' ')
            .ok_or_else(|| bad("no space between the two parts"))?;
        if a.is_empty() || b.is_empty() || b.contains(' ') {
            return Err(bad("not two non-empty parts separated by one space"));
        }
        let ia = *vocab
            .get(a)
            .ok_or_else(|| bad("left part not in the vocabulary"))?;
        let ib = *vocab
            .get(b)
            .ok_or_else(|| bad("right part not in the vocabulary"))?;
        let joined = format!("{a}{b}");
        let ij = *vocab
            .get(&joined)
            .ok_or_else(|| bad("merged token not in the vocabulary"))?;
        // The first (lowest-ranked) occurrence of a pair wins.
        merges.entry((ia, ib)).or_insert((rank as u32, ij));
    }
    Ok(merges)
}

/// The byte of a SentencePiece byte token (`<0xAB>`).
fn spm_byte(tok: &str) -> Option<u8> {
    let hex = tok.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2)
        .then(|| u8::from_str_radix(hex, 16).ok())
        .flatten()
}

/// A float that orders totally (the merge heap's key).
#[derive(Clone, Copy, PartialEq)]
struct Score(f32);
impl Eq for Score {}
impl PartialOrd for Score {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Score {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

impl Tokenizer {
    /// Reads the tokenizer of a GGUF (`tokenizer.ggml.*`).
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer, TokenizerError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        let spm = match model {
            "gpt2" => false,
            "llama" => true,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        let pre_name = match g.get("tokenizer.ggml.pre") {
            None => String::new(),
            Some(_) => g.get_str("tokenizer.ggml.pre")?.to_string(),
        };
        let pre = match pre_name.as_str() {
            "smollm" => PreTokenizer::SmolLm,
            "gpt2" | "default" | "" => PreTokenizer::Gpt2,
            other => return Err(TokenizerError::UnsupportedPre(other.to_string())),
        };
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?.to_vec();
        if tokens.is_empty() {
            return Err(TokenizerError::EmptyVocab);
        }
        if u32::try_from(tokens.len()).is_err() {
            return Err(TokenizerError::VocabTooLarge(tokens.len()));
        }
        let types = match g.get("tokenizer.ggml.token_type") {
            None => vec![token_type::NORMAL; tokens.len()],
            Some(_) => g.get_i32_array("tokenizer.ggml.token_type")?.to_vec(),
        };
        if types.len() != tokens.len() {
            return Err(TokenizerError::LengthMismatch {
                tokens: tokens.len(),
                types: types.len(),
            });
        }

        let (vocab, bytes, starts, mut specials) = token_bytes(&tokens, &types, spm);
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut special_first = [false; 256];
        for (s, _, _) in &specials {
            special_first[s.as_bytes()[0] as usize] = true;
        }

        // Byte tokens; SmolLM2 has none for 21 bytes (0x04, 0x06, 0x13,
        // 0x14, 0x16, 0x1d, 0xc0, 0xc1, 0xf1, 0xf2, 0xf5..=0xff): like HF's
        // BPE without an unknown token, such bytes are left out.
        let table = byte_to_char_table();
        let mut byte_ids = [None; 256];
        for (b, id) in byte_ids.iter_mut().enumerate() {
            *id = if spm {
                vocab.get(&format!("<0x{b:02X}>")).copied()
            } else {
                vocab
                    .get(table[b].encode_utf8(&mut [0u8; 4]) as &str)
                    .copied()
            };
        }

        let merges = if spm {
            Merges::new()
        } else {
            read_merges(g, &vocab)?
        };
        let spm_scores = if spm {
            let scores = g.get_f32_array("tokenizer.ggml.scores")?.to_vec();
            if scores.len() != tokens.len() {
                return Err(TokenizerError::ScoreMismatch {
                    tokens: tokens.len(),
                    scores: scores.len(),
                });
            }
            Some(scores)
        } else {
            None
        };

        let n = tokens.len();
        let id_key = |key: &'static str| -> Result<Option<u32>, TokenizerError> {
            if g.get(key).is_none() {
                return Ok(None);
            }
            let id = g.get_u64(key)?;
            if id >= n as u64 {
                return Err(TokenizerError::BadTokenId { key, id, vocab: n });
            }
            Ok(Some(id as u32))
        };
        let eos_token_id = id_key("tokenizer.ggml.eos_token_id")?;
        let bos_token_id = id_key("tokenizer.ggml.bos_token_id")?;
        let padding_token_id = id_key("tokenizer.ggml.padding_token_id")?;
        let unknown_token_id = id_key("tokenizer.ggml.unknown_token_id")?;
        let add_bos = match g.get("tokenizer.ggml.add_bos_token") {
            None => false,
            Some(_) => g.get_bool("tokenizer.ggml.add_bos_token")?,
        };
        let im_end = vocab
            .get(IM_END)
            .or_else(|| vocab.get(END_OF_TURN))
            .copied()
            .or(eos_token_id)
            .ok_or(TokenizerError::NoEos)?;
        let chat_template = match g.get("tokenizer.chat_template") {
            None => None,
            Some(_) => Some(g.get_str("tokenizer.chat_template")?.to_string()),
        };

        Ok(Tokenizer {
            model: model.to_string(),
            pre_name,
            pre,
            tokens,
            types,
            bytes,
            starts,
            vocab,
            merges,
            byte_ids,
            specials,
            special_first,
            eos_token_id,
            bos_token_id,
            padding_token_id,
            unknown_token_id,
            add_bos,
            im_end,
            chat_template,
            spm_scores,
        })
    }

    /// Encodes `text`. With `parse_special`, control tokens written in the
    /// text become single tokens; user-defined tokens always do. No BOS is
    /// added (SmolLM2 uses none; see [`Tokenizer::add_bos`]).
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let b = text.as_bytes();
        let mut plain_start = 0;
        let mut i = 0;
        while i < b.len() {
            if self.special_first[b[i] as usize] {
                let hit = self.specials.iter().find(|(s, _, control)| {
                    (parse_special || !*control) && b[i..].starts_with(s.as_bytes())
                });
                if let Some((s, id, _)) = hit {
                    // Specials start with their first byte, so i is on a
                    // char boundary.
                    self.encode_plain(&text[plain_start..i], &mut out);
                    out.push(*id);
                    i += s.len();
                    plain_start = i;
                    continue;
                }
            }
            i += 1;
        }
        self.encode_plain(&text[plain_start..], &mut out);
        out
    }

    /// A prompt as a server takes it: [`try_encode`](Self::try_encode) with
    /// special tokens parsed, and the file's BOS in front where it asks for
    /// one (`tokenizer.ggml.add_bos_token`: Gemma) and the text did not
    /// start with it already (a chat template that writes it).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = self.try_encode(text, true)?;
        if let Some(bos) = self.bos_token_id().filter(|_| self.add_bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// [`encode`](Self::encode), refusing text that would not come back
    /// from [`decode`](Self::decode) as it went in: a character one of
    /// whose UTF-8 bytes has no token would otherwise be dropped.
    pub fn try_encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        if let Some((at, ch)) = self.unencodable(text) {
            return Err(TokenizerError::Unencodable { ch, at });
        }
        Ok(self.encode(text, parse_special))
    }

    /// The first character of `text` the vocabulary cannot spell, and its
    /// position in characters.
    pub fn unencodable(&self, text: &str) -> Option<(usize, char)> {
        if text.bytes().all(|b| self.byte_ids[b as usize].is_some()) {
            return None;
        }
        text.chars().enumerate().find(|(_, c)| {
            let mut buf = [0u8; 4];
            c.encode_utf8(&mut buf)
                .bytes()
                .any(|b| self.byte_ids[b as usize].is_none())
        })
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        if let Some(scores) = &self.spm_scores {
            self.spm(text, scores, out);
            return;
        }
        let mut scratch = Scratch::default();
        pre_tokenize(text, self.pre, |piece| {
            self.bpe(piece.as_bytes(), &mut scratch, out)
        });
    }

    /// SentencePiece BPE, as SentencePiece and llama.cpp run it: spaces
    /// become `▁`, the text splits into characters, and adjacent pieces
    /// whose concatenation is a token merge, the highest-scoring pair first
    /// (the leftmost on ties), until none does; a piece that is no token
    /// falls back to its bytes' tokens (`<0xAB>`).
    fn spm(&self, text: &str, scores: &[f32], out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        let text = text.replace(' ', "\u{2581}");
        // Pieces as byte ranges of `text`, one per character to begin with.
        let start: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        let n = start.len();
        let mut len: Vec<usize> = (0..n)
            .map(|i| start.get(i + 1).copied().unwrap_or(text.len()) - start[i])
            .collect();
        let mut prev: Vec<usize> = (0..n).map(|i| if i == 0 { NONE } else { i - 1 }).collect();
        let mut next: Vec<usize> = (0..n)
            .map(|i| if i + 1 == n { NONE } else { i + 1 })
            .collect();
        let mut heap: BinaryHeap<(Score, Reverse<usize>, usize)> = BinaryHeap::new();
        let push =
            |heap: &mut BinaryHeap<_>, start: &[usize], len: &[usize], l: usize, r: usize| {
                if l == NONE || r == NONE {
                    return;
                }
                let joined = &text[start[l]..start[r] + len[r]];
                if let Some(&id) = self.vocab.get(joined) {
                    heap.push((Score(scores[id as usize]), Reverse(l), joined.len()));
                }
            };
        for i in 1..n {
            push(&mut heap, &start, &len, i - 1, i);
        }
        while let Some((_, Reverse(l), size)) = heap.pop() {
            let r = next[l];
            if len[l] == 0 || r == NONE || len[r] == 0 || len[l] + len[r] != size {
                continue; // stale: one side has merged since
            }
            len[l] += len[r];
            len[r] = 0;
            next[l] = next[r];
            if next[r] != NONE {
                prev[next[r]] = l;
            }
            push(&mut heap, &start, &len, prev[l], l);
            push(&mut heap, &start, &len, l, next[l]);
        }
        let mut i = if n == 0 { NONE } else { 0 };
        while i != NONE {
            let piece = &text[start[i]..start[i] + len[i]];
            match self.vocab.get(piece) {
                Some(&id) => out.push(id),
                None => out.extend(piece.bytes().filter_map(|b| self.byte_ids[b as usize])),
            }
            i = next[i];
        }
    }

    /// Merges one pre-token's bytes by rank: lowest rank first, leftmost on
    /// ties, re-pairing merged symbols with their neighbours.
    fn bpe(&self, piece: &[u8], s: &mut Scratch, out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        s.ids.clear();
        s.ids
            .extend(piece.iter().filter_map(|&b| self.byte_ids[b as usize]));
        let n = s.ids.len();
        if n <= 1 {
            out.extend_from_slice(&s.ids);
            return;
        }
        s.prev.clear();
        s.prev
            .extend((0..n).map(|i| if i == 0 { NONE } else { i - 1 }));
        s.next.clear();
        s.next
            .extend((0..n).map(|i| if i + 1 == n { NONE } else { i + 1 }));
        s.alive.clear();
        s.alive.resize(n, true);
        s.heap.clear();
        let push = |heap: &mut BinaryHeap<_>, ids: &[u32], l: usize, r: usize| {
            if let Some(&(rank, _)) = self.merges.get(&(ids[l], ids[r])) {
                heap.push(Reverse((rank, l, ids[l], ids[r])));
            }
        };
        for i in 0..n - 1 {
            push(&mut s.heap, &s.ids, i, i + 1);
        }
        while let Some(Reverse((_, l, lid, rid))) = s.heap.pop() {
            let r = s.next[l];
            if !s.alive[l] || s.ids[l] != lid || r == NONE || s.ids[r] != rid {
                continue; // stale: one side has merged since
            }
            let Some(&(_, merged)) = self.merges.get(&(lid, rid)) else {
                continue;
            };
            s.ids[l] = merged;
            s.alive[r] = false;
            let rn = s.next[r];
            s.next[l] = rn;
            if rn != NONE {
                s.prev[rn] = l;
            }
            if s.prev[l] != NONE {
                push(&mut s.heap, &s.ids, s.prev[l], l);
            }
            if rn != NONE {
                push(&mut s.heap, &s.ids, l, rn);
            }
        }
        let mut i = 0;
        while i != NONE {
            out.push(s.ids[i]);
            i = s.next[i];
        }
    }

    /// The raw bytes of token `id` (control tokens: their text); empty for
    /// an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let i = id as usize;
        match (self.starts.get(i), self.starts.get(i + 1)) {
            (Some(&a), Some(&b)) => &self.bytes[a..b],
            _ => &[],
        }
    }

    /// Decodes `ids` to text (invalid UTF-8 becomes U+FFFD; ids outside
    /// the vocabulary are skipped).
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Decodes generated `ids` as a reply reads: without the end-of-turn
    /// token [`eos_id`](Self::eos_id) the model stopped on.
    pub fn decode_reply(&self, ids: &[u32]) -> String {
        let kept: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&t| t != self.eos_id())
            .collect();
        self.decode(&kept)
    }

    /// The id of the token spelled `token` in the GGUF (byte-level
    /// characters for normal tokens, e.g. `"Ġthe"`; text for control ones).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    /// The GGUF spelling of token `id`.
    pub fn token_str(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(|s| s.as_str())
    }

    /// The GGUF token type of `id` (see [`token_type`]).
    pub fn token_type(&self, id: u32) -> Option<i32> {
        self.types.get(id as usize).copied()
    }

    /// Whether `id` is a control token (`<|im_start|>`, ...).
    pub fn is_control(&self, id: u32) -> bool {
        self.token_type(id) == Some(token_type::CONTROL)
    }

    /// Number of tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The end-of-turn token `<|im_end|>` (else the GGUF's EOS): where the
    /// Instruct model stops.
    pub fn eos_id(&self) -> u32 {
        self.im_end
    }

    /// Tokens that end generation: `eos_id()`, the GGUF's EOS and
    /// `<|endoftext|>`, without repeats.
    pub fn stop_ids(&self) -> Vec<u32> {
        let mut v = vec![self.im_end];
        for id in [self.eos_token_id, self.token_id(END_OF_TEXT)]
            .into_iter()
            .flatten()
        {
            if !v.contains(&id) {
                v.push(id);
            }
        }
        v
    }

    /// `tokenizer.ggml.eos_token_id`.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// `tokenizer.ggml.bos_token_id`.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// `tokenizer.ggml.padding_token_id`.
    pub fn padding_token_id(&self) -> Option<u32> {
        self.padding_token_id
    }

    /// `tokenizer.ggml.unknown_token_id`.
    pub fn unknown_token_id(&self) -> Option<u32> {
        self.unknown_token_id
    }

    /// `tokenizer.ggml.add_bos_token` (false when absent; false for
    /// SmolLM2).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// `tokenizer.ggml.model` (`"gpt2"`).
    pub fn model(&self) -> &str {
        &self.model
    }

    /// `tokenizer.ggml.pre` as written (`"smollm"`), empty when absent.
    pub fn pre_name(&self) -> &str {
        &self.pre_name
    }

    /// The pre-tokenizer in use.
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }

    /// `tokenizer.chat_template`, if the GGUF has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The system message the chat template inserts when there is none:
    /// the text between `<|im_start|>system\n` and `<|im_end|>` in the
    /// template, if it has one.
    pub fn template_default_system(&self) -> Option<&str> {
        let t = self.chat_template.as_deref()?;
        let open = "<|im_start|>system\n";
        let start = t.find(open)? + open.len();
        let len = t[start..].find(IM_END)?;
        Some(&t[start..start + len])
    }

    /// The ChatML prompt for one user turn, ending where the assistant's
    /// answer starts. `system` defaults to [`DEFAULT_SYSTEM`], which is what
    /// SmolLM2-Instruct's template uses. Encode it with `parse_special`.
    pub fn chat_prompt(&self, user: &str, system: Option<&str>) -> String {
        if self.vocab.contains_key(START_OF_TURN) && !self.vocab.contains_key(IM_START) {
            // Gemma: BOS, then turns; a system prompt opens the user turn.
            let bos = self
                .bos_token_id
                .and_then(|id| self.token_str(id))
                .unwrap_or("");
            let system = system.map(|s| format!("{s}\n\n")).unwrap_or_default();
            return format!(
                "{bos}{START_OF_TURN}user\n{system}{user}{END_OF_TURN}\n{START_OF_TURN}model\n"
            );
        }
        let system = system.unwrap_or(DEFAULT_SYSTEM);
        format!("{IM_START}system\n{system}{IM_END}\n{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n")
    }
}

/// Buffers reused across the pre-tokens of one encode.
#[derive(Default)]
struct Scratch {
    ids: Vec<u32>,
    prev: Vec<usize>,
    next: Vec<usize>,
    alive: Vec<bool>,
    heap: BinaryHeap<Reverse<(u32, usize, u32, u32)>>,
}

/// Turns generated ids into text as it becomes complete: bytes of a UTF-8
/// sequence split across tokens are held back until the sequence ends
/// (invalid bytes become U+FFFD).
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// An empty decoder.
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Feeds one id; returns the text that is now complete (maybe empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.push_bytes(tokenizer.token_bytes(id))
    }

    /// Feeds raw bytes; returns the text that is now complete.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // valid_up_to marks a char boundary.
                    out.push_str(std::str::from_utf8(&rest[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete sequence at the end: keep it.
                        None => {
                            rest = &rest[valid..];
                            break;
                        }
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &rest[valid + n..];
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Bytes held back, waiting for the rest of a UTF-8 sequence.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: what was held back, lossily.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::tests::Builder;

    fn pieces(text: &str, pre: PreTokenizer) -> Vec<&str> {
        let mut v = Vec::new();
        pre_tokenize(text, pre, |p| v.push(p));
        v
    }

    #[test]
    fn byte_map() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0], 'Ā');
        assert_eq!(t[0xad], 'Ń');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(t[b as usize]), Some(b));
        }
        let mut sorted: Vec<char> = t.to_vec();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
        assert_eq!(char_to_byte('€'), None);
    }

    #[test]
    fn classes() {
        assert_eq!(class('a'), Class::Letter);
        assert_eq!(class('é'), Class::Letter);
        assert_eq!(class('中'), Class::Letter);
        assert_eq!(class('ʰ'), Class::Letter); // Lm
        assert_eq!(class('٣'), Class::Number); // Arabic-Indic digit
        assert_eq!(class('½'), Class::Number); // No
        assert_eq!(class('Ⅻ'), Class::Number); // Nl
        assert_eq!(class('\u{0301}'), Class::Other); // combining mark
        assert_eq!(class('\u{093f}'), Class::Other); // Mc: alphabetic but not L
        assert_eq!(class('\u{a0}'), Class::Space);
        assert_eq!(class('\u{3000}'), Class::Space);
        assert_eq!(class('\u{0b}'), Class::Space);
        assert_eq!(class('\u{200b}'), Class::Other); // zero width space is Cf
        assert_eq!(class('😀'), Class::Other);
    }

    #[test]
    fn pre_tokenizer() {
        use PreTokenizer::*;
        assert_eq!(pieces("Hello world", Gpt2), ["Hello", " world"]);
        assert_eq!(pieces("Hello  world", Gpt2), ["Hello", " ", " world"]);
        assert_eq!(pieces("a   b  ", Gpt2), ["a", "  ", " b", "  "]);
        assert_eq!(
            pieces("it's I'M we're", Gpt2),
            ["it", "'s", " I", "'", "M", " we", "'re"]
        );
        assert_eq!(pieces("x 123 4", Gpt2), ["x", " 123", " 4"]);
        assert_eq!(
            pieces("x 123 4", SmolLm),
            ["x", " ", "1", "2", "3", " ", "4"]
        );
        assert_eq!(pieces("a1b", SmolLm), ["a", "1", "b"]);
        assert_eq!(pieces("hi!! ?'s", Gpt2), ["hi", "!!", " ?'", "s"]);
        assert_eq!(pieces("a\n\nb", Gpt2), ["a", "\n", "\n", "b"]);
        assert_eq!(pieces("\tb", Gpt2), ["\t", "b"]);
        assert_eq!(pieces(" \t b", Gpt2), [" \t", " b"]);
        assert_eq!(pieces("'", Gpt2), ["'"]);
        assert_eq!(pieces("''s", Gpt2), ["''", "s"]);
        assert_eq!(pieces("", Gpt2), Vec::<&str>::new());
        assert_eq!(pieces("  ", SmolLm), ["  "]);
        assert_eq!(pieces("x  1", SmolLm), ["x", "  ", "1"]);
        assert_eq!(pieces("naïve café", Gpt2), ["naïve", " café"]);
        // A combining mark is not a letter: it splits the word.
        assert_eq!(pieces("e\u{301}t", Gpt2), ["e", "\u{301}", "t"]);
    }

    /// A toy vocabulary: the 256 byte tokens, a few merges, two controls.
    fn toy() -> Tokenizer {
        let table = byte_to_char_table();
        let mut tokens: Vec<String> = vec![END_OF_TEXT.into(), IM_START.into(), IM_END.into()];
        let mut types = vec![3, 3, 3];
        for c in table {
            tokens.push(c.to_string());
            types.push(1);
        }
        let merges = [
            "Ġ t", "h e", "Ġt he", "l l", "ll o", "he llo", "a a", "aa aa",
        ];
        for m in merges {
            tokens.push(m.replace(' ', ""));
            types.push(1);
        }
        let tok_refs: Vec<&str> = tokens.iter().map(|s| s.as_str()).collect();
        let mut b = Builder::new();
        b.kv_str("tokenizer.ggml.model", "gpt2")
            .kv_str("tokenizer.ggml.pre", "smollm")
            .kv_str_array("tokenizer.ggml.tokens", &tok_refs)
            .kv_i32_array("tokenizer.ggml.token_type", &types)
            .kv_str_array("tokenizer.ggml.merges", &merges)
            .kv_u32("tokenizer.ggml.eos_token_id", 2)
            .kv_u32("tokenizer.ggml.bos_token_id", 1)
            .kv_bool("tokenizer.ggml.add_bos_token", false)
            .kv_str(
                "tokenizer.chat_template",
                "{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}",
            );
        Tokenizer::from_gguf(&Gguf::parse(b.build()).unwrap()).unwrap()
    }

    #[test]
    fn toy_bpe() {
        let t = toy();
        let id = |s: &str| t.token_id(s).unwrap();
        assert_eq!(
            t.encode(" the hello", false),
            [id("Ġthe"), id("Ġ"), id("hello")]
        );
        // Equal ranks resolve leftmost first: "aaa" -> "aa" "a".
        assert_eq!(t.encode("aaa", false), [id("aa"), id("a")]);
        assert_eq!(t.encode("aaaa", false), [id("aaaa")]);
        assert_eq!(t.encode("aaaaa", false), [id("aaaa"), id("a")]);
        let s = "<|im_start|>user\nhello<|im_end|>";
        assert_eq!(t.encode(s, true)[0], 1);
        assert_eq!(*t.encode(s, true).last().unwrap(), 2);
        assert_eq!(t.encode(s, true).len(), 1 + 4 + 1 + 1 + 1);
        assert!(t.encode(s, false).len() > 20);
        assert_eq!(t.decode(&t.encode(s, false)), s);
        assert_eq!(t.decode(&t.encode(s, true)), s);
        assert_eq!(t.eos_id(), 2);
        assert_eq!(t.template_default_system(), Some("Be brief."));
        assert_eq!(t.stop_ids(), [2, 0]);
        let text = "héllo wörld 123 😀 \u{0}\t\n  x";
        assert_eq!(t.decode(&t.encode(text, false)), text);
    }

    #[test]
    fn stream_decoder() {
        let t = toy();
        let ids = t.encode("a😀é", false);
        assert_eq!(ids.len(), 1 + 4 + 2);
        let mut d = StreamDecoder::new();
        let mut got = Vec::new();
        for &id in &ids {
            got.push(d.push(&t, id));
        }
        assert_eq!(got, ["a", "", "", "", "😀", "", "é"]);
        assert!(d.pending().is_empty());
        assert_eq!(d.push_bytes(&[0xff, b'x', 0xe2, 0x82]), "\u{fffd}x");
        assert_eq!(d.pending(), &[0xe2, 0x82]);
        assert_eq!(d.finish(), "\u{fffd}");
    }

    #[test]
    fn errors() {
        let mut b = Builder::new();
        b.kv_str("tokenizer.ggml.model", "rwkv");
        let e = Tokenizer::from_gguf(&Gguf::parse(b.build()).unwrap()).unwrap_err();
        assert!(
            matches!(&e, TokenizerError::UnsupportedModel(m) if m == "rwkv"),
            "{e}"
        );
        let mut b = Builder::new();
        b.kv_str("tokenizer.ggml.model", "gpt2")
            .kv_str("tokenizer.ggml.pre", "qwen2");
        let e = Tokenizer::from_gguf(&Gguf::parse(b.build()).unwrap()).unwrap_err();
        assert!(matches!(e, TokenizerError::UnsupportedPre(_)), "{e}");
        let mut b = Builder::new();
        b.kv_str("tokenizer.ggml.model", "gpt2")
            .kv_str_array("tokenizer.ggml.tokens", &["a", "b"])
            .kv_str_array("tokenizer.ggml.merges", &["a c"]);
        let e = Tokenizer::from_gguf(&Gguf::parse(b.build()).unwrap()).unwrap_err();
        assert!(matches!(e, TokenizerError::BadMerge { rank: 0, .. }), "{e}");
        // Bytes without a token are left out.
        let mut b = Builder::new();
        b.kv_str("tokenizer.ggml.model", "gpt2")
            .kv_str_array("tokenizer.ggml.tokens", &["a", "b", "ab", "<|im_end|>"])
            .kv_i32_array("tokenizer.ggml.token_type", &[1, 1, 1, 3])
            .kv_str_array("tokenizer.ggml.merges", &["a b"]);
        let t = Tokenizer::from_gguf(&Gguf::parse(b.build()).unwrap()).unwrap();
        assert_eq!(t.encode("a", false), [0]);
        assert_eq!(t.encode("ab", false), [2]);
        assert_eq!(t.encode("xa", false), [0]);
        assert_eq!(t.encode("x", false), Vec::<u32>::new());
        assert_eq!(t.eos_id(), 3);
    }

    #[test]
    fn real_model() {
        let Some(path) = crate::config::model_path_or_skip("tokenizer::real_model") else {
            return;
        };
        let g = Gguf::open(path).unwrap();
        let t = Tokenizer::from_gguf(&g).unwrap();
        assert_eq!(t.model(), "gpt2");
        assert_eq!(t.pre_name(), "smollm");
        assert_eq!(t.pre_tokenizer(), PreTokenizer::SmolLm);
        assert_eq!(t.vocab_size(), 49152);
        assert_eq!(t.eos_id(), 2);
        assert_eq!(t.token_id(IM_START), Some(1));
        assert_eq!(t.token_id(END_OF_TEXT), Some(0));
        assert!(!t.add_bos());
        assert_eq!(t.template_default_system(), Some(DEFAULT_SYSTEM));
        let tpl = t.chat_template().unwrap();
        assert!(tpl.contains(&format!("<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n")));
        assert!(
            tpl.contains("'<|im_start|>assistant\\n'") || tpl.contains("'<|im_start|>assistant\n'")
        );
        let p = t.chat_prompt("Hi", None);
        let ids = t.encode(&p, true);
        assert_eq!(ids[0], 1);
        assert_eq!(t.decode(&ids), p);
        assert_eq!(t.encode(" the", false), [t.token_id("Ġthe").unwrap()]);
        let mut reply = t.encode("Paris.", false);
        reply.push(t.eos_id());
        assert_eq!(t.decode_reply(&reply), "Paris.");
        assert!(t.decode(&reply).ends_with("<|im_end|>"));
    }
}
