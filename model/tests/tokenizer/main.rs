//! The tokenizer against the reference (llama.cpp's, recorded in
//! tests/fixture/reference.json by scripts/make-fixture.py): identical ids
//! for every recorded text and every chat prompt, and decode inverting
//! encode.

use std::sync::OnceLock;
use std::time::Instant;

use pagedattn_model::config::model_path_or_skip;
use pagedattn_model::gguf::Gguf;
use pagedattn_model::tokenizer::{StreamDecoder, Tokenizer, DEFAULT_SYSTEM};
use serde_json::Value;

fn fixture() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixture/reference.json");
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{path}: {e} (made by scripts/make-fixture.py)"));
    serde_json::from_str(&text).expect("the fixture parses")
}

/// The model's tokenizer, read once per test binary; `None` (the test
/// skips, saying so) when the model is missing and not required.
fn tokenizer(test: &str) -> Option<&'static Tokenizer> {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    let path = model_path_or_skip(test)?;
    Some(T.get_or_init(|| {
        let g = Gguf::open(&path).expect("the model parses");
        Tokenizer::from_gguf(&g).expect("the tokenizer loads")
    }))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an id list")
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("an id")).expect("a u32 id"))
        .collect()
}

/// The recorded `{text, special, ids}` cases.
fn cases(fx: &Value) -> Vec<(String, bool, Vec<u32>)> {
    fx["tokenize"]
        .as_array()
        .expect("a \"tokenize\" list")
        .iter()
        .map(|c| {
            (
                c["text"].as_str().expect("text").to_string(),
                c["special"].as_bool().expect("special"),
                ids(&c["ids"]),
            )
        })
        .collect()
}

/// Every `(user, prompt_ids)` of the greedy, beam and sample entries.
fn chat_cases(fx: &Value) -> Vec<(String, Vec<u32>)> {
    let mut out = Vec::new();
    for key in ["greedy", "beam", "sample"] {
        for e in fx[key].as_array().map(|a| a.as_slice()).unwrap_or(&[]) {
            out.push((
                e["user"].as_str().expect("user").to_string(),
                ids(&e["prompt_ids"]),
            ));
        }
    }
    out
}

/// Token pieces, for readable failures.
fn show(t: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&i| format!("{i}:{:?}", t.token_str(i).unwrap_or("?")))
        .collect()
}

#[test]
fn every_fixture_text_encodes_to_the_reference_ids() {
    let Some(t) = tokenizer("every_fixture_text_encodes_to_the_reference_ids") else {
        return;
    };
    let fx = fixture();
    let cases = cases(&fx);
    assert!(cases.len() >= 20, "only {} tokenize cases", cases.len());
    let mut bad = Vec::new();
    for (text, special, want) in &cases {
        let got = t.encode(text, *special);
        if &got != want {
            bad.push(format!(
                "{text:?} (special {special}):\n  got  {:?}\n  want {:?}",
                show(t, &got),
                show(t, want)
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} differ:\n{}",
        bad.len(),
        cases.len(),
        bad.join("\n")
    );
    // Both modes are covered, and they differ where special tokens appear.
    assert!(cases.iter().any(|c| c.1) && cases.iter().any(|c| !c.1));
    let im_start = t.token_id("<|im_start|>").unwrap();
    for (text, special, want) in &cases {
        if text.contains("<|im_start|>") {
            assert_eq!(want.contains(&im_start), *special, "{text:?}");
        }
    }
}

#[test]
fn every_chat_prompt_encodes_to_the_reference_ids() {
    let Some(t) = tokenizer("every_chat_prompt_encodes_to_the_reference_ids") else {
        return;
    };
    let fx = fixture();
    // The system message the reference used is the template's default,
    // and the template is the GGUF's.
    let system = fx["system"]
        .as_str()
        .or(fx["meta"]["default_system"].as_str())
        .expect("the fixture names its system message");
    assert_eq!(system, DEFAULT_SYSTEM);
    assert_eq!(t.template_default_system(), Some(DEFAULT_SYSTEM));
    if let Some(tpl) = fx["meta"]["chat_template"].as_str() {
        assert_eq!(t.chat_template(), Some(tpl));
    }
    if let Some(format) = fx["meta"]["prompt_format"].as_str() {
        let want = format.replace("{SYSTEM}", system).replace("{USER}", "Hi");
        assert_eq!(t.chat_prompt("Hi", None), want);
    }
    let chats = chat_cases(&fx);
    assert!(
        !chats.is_empty(),
        "no greedy/beam/sample prompts in the fixture"
    );
    for (user, want) in &chats {
        let prompt = t.chat_prompt(user, None);
        let got = t.encode(&prompt, true);
        assert_eq!(
            &got,
            want,
            "{user:?}:\n  got  {:?}\n  want {:?}",
            show(t, &got),
            show(t, want)
        );
        assert_eq!(t.decode(&got), prompt);
        // The prompt opens a turn and ends where the answer starts.
        assert_eq!(got[0], t.token_id("<|im_start|>").unwrap());
        assert!(t.decode(&got[got.len() - 3..]).ends_with("assistant\n"));
    }
}

#[test]
fn decode_inverts_encode_and_streams_the_same_text() {
    let Some(t) = tokenizer("decode_inverts_encode_and_streams_the_same_text") else {
        return;
    };
    let fx = fixture();
    let mut texts: Vec<String> = cases(&fx).into_iter().map(|c| c.0).collect();
    texts.extend(chat_cases(&fx).iter().map(|(u, _)| t.chat_prompt(u, None)));
    texts.push("Zürich → 東京 🚄 ½ ² \u{a0}x\u{3000}y 'S'LL\r\n\t 0.5e-3".into());
    for text in &texts {
        for special in [false, true] {
            let ids = t.encode(text, special);
            assert_eq!(&t.decode(&ids), text, "special {special}");
            // Streaming token by token gives the same text, never a
            // broken character.
            let mut dec = StreamDecoder::new();
            let mut streamed = String::new();
            for &id in &ids {
                let piece = dec.push(t, id);
                assert!(!piece.contains('\u{fffd}'), "{text:?}: {piece:?}");
                streamed.push_str(&piece);
            }
            streamed.push_str(&dec.finish());
            assert_eq!(&streamed, text);
        }
    }
}

/// A prompt never changes silently: every Unicode scalar value either
/// round-trips through encode and decode, or `try_encode` refuses it,
/// naming it and its position.
#[test]
fn every_scalar_value_round_trips_or_is_refused() {
    let Some(t) = tokenizer("every_scalar_value_round_trips_or_is_refused") else {
        return;
    };
    let (mut kept, mut refused) = (0usize, Vec::new());
    for c in (0..=0x10FFFFu32).filter_map(char::from_u32) {
        let text = format!("a{c}");
        match t.try_encode(&text, false) {
            Ok(ids) => {
                assert_eq!(t.decode(&ids), text, "U+{:04X}", c as u32);
                kept += 1;
            }
            Err(e) => {
                let want = format!("(U+{:04X}) at position 1 ", c as u32);
                assert!(e.to_string().contains(&want), "{e}");
                refused.push(c);
            }
        }
    }
    // SmolLM2's vocabulary lacks 6 control bytes and the lead bytes of
    // U+40000..=U+BFFFF (0xF1, 0xF2): those characters, nothing else.
    let lacking = [0x04u8, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xF1, 0xF2];
    let spellable = |c: char| {
        let mut buf = [0u8; 4];
        !c.encode_utf8(&mut buf)
            .bytes()
            .any(|b| lacking.contains(&b))
    };
    assert!(refused.iter().all(|&c| !spellable(c)));
    assert_eq!(kept + refused.len(), 1_112_064);
    assert_eq!(refused.len(), 6 + 0x80000, "{}", refused.len());
    // The plain encode, given a refused character, drops it: why the
    // server encodes with try_encode.
    assert_ne!(t.decode(&t.encode("a\u{4}b", false)), "a\u{4}b");
}

#[test]
fn special_tokens_and_ids() {
    let Some(t) = tokenizer("special_tokens_and_ids") else {
        return;
    };
    assert_eq!(t.vocab_size(), 49152);
    assert_eq!(t.pre_name(), "smollm");
    assert_eq!(t.token_id("<|endoftext|>"), Some(0));
    assert_eq!(t.token_id("<|im_start|>"), Some(1));
    assert_eq!(t.token_id("<|im_end|>"), Some(2));
    assert_eq!(t.eos_id(), 2);
    assert!(t.stop_ids().contains(&0) && t.stop_ids().contains(&2));
    assert!(!t.add_bos());
    assert_eq!(t.encode("<|im_end|>", true), [2]);
    assert!(t.encode("<|im_end|>", false).len() > 1);
    assert_eq!(t.decode(&[1, 2, 0]), "<|im_start|><|im_end|><|endoftext|>");
    assert_eq!(t.token_bytes(t.token_id("Ġthe").unwrap()), b" the");
}

#[test]
fn a_long_prompt_encodes_quickly() {
    let Some(t) = tokenizer("a_long_prompt_encodes_quickly") else {
        return;
    };
    let para = "The quick brown fox jumps over the lazy dog; it's 42 degrees, isn't it? \
                Les élèves étudient l'histoire. 数学は楽しい。 fn main() { x += 1; }\n";
    let user = para.repeat(60);
    let prompt = t.chat_prompt(&user, None);
    let start = Instant::now();
    let ids = t.encode(&prompt, true);
    let took = start.elapsed();
    assert!(ids.len() > 2000, "{} tokens", ids.len());
    // Generous for a debug build on a slow machine; release takes ~1 ms.
    assert!(
        took.as_secs_f64() < 2.0,
        "{} tokens took {took:?}",
        ids.len()
    );
    // One long word (no spaces) is not quadratic either.
    let word = "ab".repeat(20_000);
    let start = Instant::now();
    let ids = t.encode(&word, false);
    assert!(start.elapsed().as_secs_f64() < 2.0, "{:?}", start.elapsed());
    assert_eq!(t.decode(&ids), word);
}

mod gguf_ops;
use gguf_ops::harness::{assert_reached, caught, corpus_files};

/// The GGUF fuzz harness's base file is a valid model: it parses,
/// configures and tokenizes (so the mutated inputs start from a file that
/// reaches the whole loading path).
#[test]
fn the_fuzz_base_file_loads_the_whole_way() {
    let mut r = gguf_ops::Reached::default();
    assert!(
        gguf_ops::load(gguf_ops::base_file(), &mut r),
        "{:?}",
        r.named()
    );
}

/// Replays the GGUF fuzz corpus (`fuzz/corpus/gguf/`, minimised by
/// libFuzzer) and seeded random edits of the base file through the
/// harness (model/tests/tokenizer/gguf_ops.rs): no input panics, a parsed file's
/// tensors lie inside it, and together they reach every outcome (parsed
/// and refused, configured and refused, tokenizer loaded and refused).
/// `GGUF_INPUT=<file>` replays one file.
#[test]
fn gguf_fuzz_corpus_and_random_edits_never_panic() {
    let run = |data: &[u8], what: &str, total: &mut gguf_ops::Reached| {
        total.add(&caught(what, || gguf_ops::run(data)))
    };
    let mut total = gguf_ops::Reached::default();
    if let Ok(one) = std::env::var("GGUF_INPUT") {
        run(&std::fs::read(&one).unwrap(), &one, &mut total);
        println!("{:?}", total.named());
        return;
    }
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus/gguf");
    for f in &corpus_files(std::path::Path::new(dir), 10) {
        run(
            &std::fs::read(f).unwrap(),
            &f.display().to_string(),
            &mut total,
        );
    }
    assert_reached(&total.named(), "the corpus", &[]);
    let mut rng = pagedattn::rng::SplitMix64::new(0x6607);
    let mut random = gguf_ops::Reached::default();
    for i in 0..400 {
        let len = 1 + rng.below(64) as usize;
        let mut data: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
        data[0] |= 1; // mutated mode
        run(&data, &format!("random edit {i}"), &mut random);
    }
    println!("corpus {:?}; random {:?}", total.named(), random.named());
}
