//! Gemma 3 270M through pagedattn against an independent runtime: the
//! committed fixture (`tests/fixture/gemma3.json`, made by
//! `scripts/make-gemma-fixture.py` with llama.cpp on an F32 copy of the
//! same weights, F32 KV cache, flash attention off). Its prompts were kept
//! only where every greedy step's top-1/top-2 margin and every beam gap is
//! at least 0.05, wide enough for another f32 implementation to agree. Two
//! prompts run past the local layers' window of 512 tokens.
//!
//! Tolerances: logprobs within 1e-2 of llama.cpp's (it reads GELU from an
//! f16 table: the fixture's float64 forward of the same weights differs
//! from it by 1.9e-3, measured when the fixture was made), within 1e-4 of
//! that float64 forward's; the dequantized weights to the fixture's seven
//! digits.
//!
//! The model is fetched by `scripts/fetch-gemma.sh`; without it the tests
//! skip, unless `PAGEDATTN_REQUIRE_MODEL=1` (or `CI`) makes them fail.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};

use pagedattn::blocks::RequestId;
use pagedattn_model::config::{model_required, Arch};
use pagedattn_model::engine::{EngineConfig, Model};
use pagedattn_model::generate::open_device;
use pagedattn_model::load::{load, Loaded};
use pagedattn_model::serve::{Completion, Decoding, Request, ServeStats, Server, ServerConfig};
use serde::Deserialize;

const LOGPROB_TOL: f64 = 1e-2;
/// Against the float64 forward pass: f32 arithmetic over the same weights.
const F64_TOL: f64 = 1e-4;

#[derive(Deserialize)]
struct Tokenize {
    text: String,
    special: bool,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct Dequant {
    tensor: String,
    #[serde(rename = "type")]
    ty: String,
    rows: Vec<Vec<f64>>,
}

#[derive(Deserialize)]
struct Greedy {
    user: String,
    prompt_ids: Vec<u32>,
    tokens: Vec<u32>,
    top5: Vec<Vec<(u32, f64)>>,
}

#[derive(Deserialize)]
struct BeamOut {
    tokens: Vec<u32>,
    score: f64,
}

#[derive(Deserialize)]
struct Beam {
    user: String,
    prompt_ids: Vec<u32>,
    width: usize,
    steps: usize,
    beams: Vec<BeamOut>,
}

#[derive(Deserialize)]
struct NumpyRow {
    tokens: usize,
    top5: Vec<(u32, f64)>,
}

#[derive(Deserialize)]
struct Fixture {
    tokenize: Vec<Tokenize>,
    dequant: Vec<Dequant>,
    greedy: Vec<Greedy>,
    beam: Vec<Beam>,
    numpy: Vec<NumpyRow>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixture/gemma3.json");
        let text = std::fs::read_to_string(path).expect("the committed Gemma 3 fixture");
        serde_json::from_str(&text).expect("fixture parses")
    })
}

/// Where the Gemma 3 file is: `$PAGEDATTN_GEMMA_MODEL`, else
/// `<repo>/models/gemma-3-270m-q4_k_m.gguf`.
fn model_path(test: &str) -> Option<PathBuf> {
    let path = match std::env::var_os("PAGEDATTN_GEMMA_MODEL") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../models/gemma-3-270m-q4_k_m.gguf"
        )),
    };
    if path.is_file() {
        return Some(path);
    }
    let msg = format!(
        "{test}: {} is missing (run `bash scripts/fetch-gemma.sh`)",
        path.display()
    );
    assert!(!model_required(), "{msg}");
    eprintln!("skipped: {msg}");
    None
}

fn loaded(test: &str) -> Option<&'static Loaded> {
    static L: OnceLock<Loaded> = OnceLock::new();
    let path = model_path(test)?;
    Some(L.get_or_init(|| load(&path).expect("Gemma 3 loads")))
}

const MAX_ROWS: usize = 256;
const MAX_SEQS: usize = 8;

fn backends() -> wgpu::Backends {
    match std::env::var("PAGEDATTN_BACKEND") {
        Ok(name) => {
            pagedattn::gpu::parse_backends(&name).expect("PAGEDATTN_BACKEND names a backend")
        }
        Err(_) => wgpu::Backends::all(),
    }
}

/// The GPU model the tests share (f32 pool of 16-token blocks).
fn model(test: &str) -> Option<MutexGuard<'static, Option<Model>>> {
    static M: OnceLock<Mutex<Option<Model>>> = OnceLock::new();
    let l = loaded(test)?;
    let m = M.get_or_init(|| {
        let (device, queue, _) = open_device(backends()).expect("an adapter");
        let cfg = EngineConfig {
            num_blocks: 256,
            max_rows: MAX_ROWS,
            max_logit_rows: MAX_SEQS,
            ..EngineConfig::default()
        };
        Mutex::new(Some(
            Model::new(&device, &queue, &l.weights, cfg).expect("model"),
        ))
    });
    Some(m.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Serves `requests` to their end; also the server's counters. Every
/// layer group's pool must get every block back.
fn serve(slot: &mut Option<Model>, requests: Vec<Request>) -> Vec<Completion> {
    serve_stats(slot, requests).0
}

fn serve_stats(slot: &mut Option<Model>, requests: Vec<Request>) -> (Vec<Completion>, ServeStats) {
    let model = slot.take().expect("the shared model");
    let cfg = ServerConfig {
        max_seqs: MAX_SEQS,
        max_batch_tokens: MAX_ROWS,
        ..ServerConfig::default()
    };
    let mut server = Server::new(model, cfg).expect("server");
    let ids: Vec<RequestId> = requests
        .into_iter()
        .map(|r| server.add(r).expect("request"))
        .collect();
    let result = server.run(&mut |_, _| {});
    let groups: Vec<_> = (0..server.sched.num_groups())
        .map(|g| server.sched.group_blocks(g).unwrap().stats())
        .collect();
    let stats = server.stats;
    *slot = Some(server.into_model());
    let mut done = result.expect("serving");
    for st in groups {
        assert_eq!(st.free + st.evictable, st.total, "blocks leaked: {st:?}");
    }
    done.sort_by_key(|c| ids.iter().position(|i| *i == c.request));
    (done, stats)
}

#[test]
fn the_file_is_gemma3_with_its_window() {
    let Some(l) = loaded("config") else { return };
    let c = &l.config;
    assert_eq!(c.arch.arch, Arch::Gemma3);
    assert_eq!(
        (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim),
        (18, 640, 4, 1, 256)
    );
    let full: Vec<usize> = (0..18)
        .filter(|&i| c.arch.layers[i].window.is_none())
        .collect();
    assert_eq!(full, vec![5, 11, 17]);
    assert!(c
        .arch
        .layers
        .iter()
        .all(|l| l.window.is_none_or(|w| w == 512)));
    assert_eq!(c.vocab_size, 262_144);
}

#[test]
fn the_tokenizer_gives_the_reference_ids() {
    let Some(l) = loaded("tokenizer") else { return };
    let t = &l.tokenizer;
    // A served prompt starts with Gemma's BOS, as the file asks, once.
    let bos = t.bos_token_id().expect("Gemma has a BOS");
    assert!(t.add_bos());
    let plain = t.encode_prompt("Hello there").expect("encodes");
    assert_eq!(plain[0], bos);
    assert_eq!(&plain[1..], &t.encode("Hello there", true)[..]);
    let templated = t.encode_prompt("<bos>Hello there").expect("encodes");
    assert_eq!(templated, plain, "a template's own BOS is not doubled");
    for case in &fixture().tokenize {
        assert_eq!(
            t.encode(&case.text, case.special),
            case.ids,
            "{:?} (special tokens parsed: {})",
            case.text,
            case.special
        );
        if !case.special {
            assert_eq!(
                t.decode(&case.ids),
                case.text,
                "{:?} decodes back",
                case.text
            );
        }
    }
    eprintln!("{} tokenizer cases identical", fixture().tokenize.len());
}

#[test]
fn every_weight_type_dequantizes_as_the_reference() {
    let Some(l) = loaded("dequant") else { return };
    let w = &l.weights;
    for d in &fixture().dequant {
        // The engine's matrices by GGUF name.
        let m = if d.tensor == "token_embd.weight" {
            &w.embed
        } else {
            let (layer, name) = d
                .tensor
                .strip_prefix("blk.")
                .and_then(|r| r.split_once('.'))
                .expect("a layer tensor");
            let l = &w.layers[layer.parse::<usize>().unwrap()];
            match name {
                "attn_q.weight" => &l.q,
                "attn_k.weight" => &l.k,
                "attn_v.weight" => &l.v,
                "attn_output.weight" => &l.o,
                "ffn_gate.weight" => &l.gate,
                "ffn_up.weight" => &l.up,
                "ffn_down.weight" => &l.down,
                other => panic!("{other}"),
            }
        };
        for (r, want) in d.rows.iter().enumerate() {
            let got = m.row_f32(r);
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                // The fixture rounds to 7 significant digits.
                assert!(
                    (g as f64 - w).abs() <= 1e-6 * w.abs().max(1e-3),
                    "{} ({}) row {r} element {i}: {g} vs {w}",
                    d.tensor,
                    d.ty
                );
            }
        }
    }
    let types: Vec<&str> = fixture().dequant.iter().map(|d| d.ty.as_str()).collect();
    eprintln!("dequantized as the reference: {types:?}");
    for t in ["Q5_0", "Q8_0", "Q4_K", "Q6_K"] {
        assert!(types.contains(&t), "the fixture checks {t}");
    }
}

#[test]
fn greedy_matches_the_reference_past_the_window() {
    let Some(mut m) = model("greedy") else { return };
    let f = fixture();
    assert!(
        f.greedy
            .iter()
            .filter(|g| g.prompt_ids.len() + g.tokens.len() > 600)
            .count()
            >= 2,
        "two prompts run past the window"
    );
    let reqs = f
        .greedy
        .iter()
        .map(|g| {
            let mut r = Request::greedy(g.prompt_ids.clone(), g.tokens.len());
            r.record_top = 10;
            r.stop = Vec::new();
            r
        })
        .collect();
    let (done, stats) = serve_stats(&mut m, reqs);
    // The local layers' pool really gave blocks back as the sequences ran
    // past the window: with a long prompt (800+ tokens) decoding, its 15
    // local layers held 32 or 33 blocks of its 51 or more, so at least
    // 15 x 17 layer-blocks were given back at one step (while one long
    // prompt prefills, the other's blocks are still all held).
    let layout = m.as_ref().unwrap().kv_layout().clone();
    assert_eq!(
        layout.groups().len(),
        2,
        "Gemma 3: a window group and a full group"
    );
    assert!(
        stats.most_layer_blocks_saved >= 15 * 17,
        "the window group gave back at most {} layer-blocks at one step",
        stats.most_layer_blocks_saved
    );
    eprintln!(
        "the window group gave back up to {} layer-blocks at one step; peak blocks per group {:?}",
        stats.most_layer_blocks_saved,
        &stats.peak_group_blocks[..2]
    );
    let mut worst: f64 = 0.0;
    for (c, g) in done.iter().zip(&f.greedy) {
        assert_eq!(
            c.sequences[0].tokens,
            g.tokens,
            "{:?}",
            &g.user[g.user.len().saturating_sub(60)..]
        );
        for (step, (want, got)) in g.top5.iter().zip(&c.sequences[0].top).enumerate() {
            for &(id, lp) in want {
                let mine = got.iter().find(|x| x.0 == id).unwrap_or_else(|| {
                    panic!("step {step}: reference top-5 token {id} not in our top-10")
                });
                let d = (mine.1 - lp).abs();
                assert!(d.is_finite());
                worst = worst.max(d);
                assert!(
                    d <= LOGPROB_TOL,
                    "step {step} token {id}: {} vs {lp}",
                    mine.1
                );
            }
        }
        eprintln!(
            "{} prompt tokens + {} identical greedy tokens",
            g.prompt_ids.len(),
            g.tokens.len()
        );
    }
    eprintln!("greedy: worst top-5 logprob difference {worst:.2e} (tolerance {LOGPROB_TOL:.0e})");
}

#[test]
fn beam_search_finds_the_reference_beams() {
    let Some(mut m) = model("beam") else { return };
    for b in &fixture().beam {
        let req = Request {
            decoding: Decoding::Beam { width: b.width },
            record_top: 0,
            stop: Vec::new(),
            ..Request::greedy(b.prompt_ids.clone(), b.steps)
        };
        let done = serve(&mut m, vec![req]);
        let got = &done[0].sequences;
        assert_eq!(got.len(), b.width, "{:?}", b.user);
        for (i, (g, w)) in got.iter().zip(&b.beams).enumerate() {
            assert_eq!(g.tokens, w.tokens, "{:?} beam {i}", b.user);
            assert!(
                (g.score - w.score).abs() <= 5e-2,
                "{:?} beam {i}: {} vs {}",
                b.user,
                g.score,
                w.score
            );
        }
        eprintln!("beam {:?}: {} beams identical", b.user, got.len());
    }
}

/// Our first step against the float64 forward pass of the same weights
/// (the fixture's `numpy` rows): the same top 5, logprobs within the
/// tolerance. The reference runtime is checked against the same rows when
/// the fixture is made.
#[test]
fn the_first_step_matches_the_float64_forward() {
    let Some(mut m) = model("numpy") else { return };
    let f = fixture();
    for row in &f.numpy {
        let g = f
            .greedy
            .iter()
            .find(|g| g.prompt_ids.len() == row.tokens)
            .expect("a greedy case of that prompt");
        let mut r = Request::greedy(g.prompt_ids.clone(), 1);
        r.record_top = 10;
        let done = serve(&mut m, vec![r]);
        let top = &done[0].sequences[0].top[0];
        let ids: Vec<u32> = top.iter().take(5).map(|x| x.0).collect();
        let want: Vec<u32> = row.top5.iter().map(|x| x.0).collect();
        assert_eq!(ids, want, "top 5 at {} tokens", row.tokens);
        let worst = row
            .top5
            .iter()
            .zip(top)
            .map(|(w, g)| (w.1 - g.1).abs())
            .fold(0.0, f64::max);
        assert!(worst <= F64_TOL, "{worst}");
        eprintln!(
            "float64 forward at {} tokens: same top 5, worst logprob difference {worst:.2e} (tolerance {F64_TOL:.0e})",
            row.tokens
        );
    }
}

/// A remote prefix hit with layer groups: server A serves a prompt past
/// the window; every group's cached blocks of it are exported, each
/// layout naming its group (`Server::export_prefix`); every slot of both
/// pools is overwritten with noise; server B imports the blocks into each
/// group's pool at admission, computes only the rest, and gives the
/// reference's tokens. Entries out of group order are refused by name.
#[test]
fn a_remote_prefix_hit_imports_every_layer_group() {
    let Some(mut m) = model("remote prefix") else {
        return;
    };
    let g = fixture()
        .greedy
        .iter()
        .find(|g| g.prompt_ids.len() > 600)
        .expect("a prompt past the window");
    let n = 4;
    let req = || {
        let mut r = Request::greedy(g.prompt_ids.clone(), n);
        r.stop = Vec::new();
        r
    };
    let cfg = ServerConfig {
        max_seqs: MAX_SEQS,
        max_batch_tokens: MAX_ROWS,
        ..ServerConfig::default()
    };
    let mut a = Server::new(m.take().expect("model"), cfg).expect("server A");
    a.add(req()).expect("a");
    let done = a.run(&mut |_, _| {}).expect("run A");
    assert_eq!(done[0].sequences[0].tokens, g.tokens[..n]);
    let remote = a.export_prefix(&g.prompt_ids, b"").expect("export");
    let full = g.prompt_ids.len() / 16;
    assert_eq!(remote.len(), 2 * full, "every full block, once per group");
    for (i, (l, _)) in remote.iter().enumerate() {
        assert_eq!(l.layer_group as usize, i % 2);
    }
    let model = a.into_model();
    let mut rng = pagedattn::rng::SplitMix64::new(0x6E01_5E01);
    for kg in &model.kv {
        let c = *kg.cache.config();
        let slots: Vec<u32> = (0..c.num_blocks * c.block_size).collect();
        let len = slots.len() * (c.num_kv_heads * c.head_dim) as usize;
        for l in 0..c.num_layers {
            let (k, v) = (rng.signed_vec(len), rng.signed_vec(len));
            kg.cache
                .write_kv(&model.gpu, l, &k, &v, &slots)
                .expect("noise");
        }
    }
    let mut b = Server::new(model, cfg).expect("server B");
    let mut swapped = remote.clone();
    swapped.swap(0, 1);
    let e = b
        .add_with_remote(req(), swapped)
        .expect_err("groups out of order");
    assert!(e.to_string().contains("layer group"), "{e}");
    let e = b
        .add_with_remote(req(), remote[..3].to_vec())
        .expect_err("a block short of a group");
    assert!(e.to_string().contains("one per group"), "{e}");
    b.add_with_remote(req(), remote).expect("b");
    let done = b.run(&mut |_, _| {}).expect("run B");
    let (imported, prefill) = (b.imported_blocks, b.stats.prefill_tokens);
    *m = Some(b.into_model());
    eprintln!(
        "remote prefix over 2 layer groups: {imported} blocks a group imported, {prefill} of {} prompt tokens computed",
        g.prompt_ids.len()
    );
    assert_eq!(imported, full);
    assert!(prefill < 16, "B computes only the prompt's tail: {prefill}");
    assert_eq!(
        done[0].sequences[0].tokens,
        g.tokens[..n],
        "B's tokens equal the reference's"
    );
}

/// Preemption by swap with layer groups: a pool of 4 blocks a group for
/// three short prompts, so that growing sequences swap the newest out;
/// each group's blocks go to its own swap space and back into its own
/// pool, and every request still gives the reference's greedy tokens.
#[test]
fn swapping_moves_every_layer_group_and_keeps_the_tokens() {
    let Some(mut m) = model("swap") else { return };
    let short: Vec<&Greedy> = fixture()
        .greedy
        .iter()
        .filter(|g| g.prompt_ids.len() < 32)
        .take(3)
        .collect();
    assert_eq!(short.len(), 3, "three short fixture prompts");
    let cfg = ServerConfig {
        max_seqs: MAX_SEQS,
        max_batch_tokens: MAX_ROWS,
        num_blocks: Some(4),
        swap_blocks: 16,
        preemption: pagedattn::blocks::Preemption::Swap,
        ..ServerConfig::default()
    };
    let mut server = Server::new(m.take().expect("model"), cfg).expect("server");
    assert_eq!(server.sched.num_groups(), 2);
    let ids: Vec<RequestId> = short
        .iter()
        .map(|g| {
            let mut r = Request::greedy(g.prompt_ids.clone(), g.tokens.len());
            r.stop = Vec::new();
            server.add(r).expect("request")
        })
        .collect();
    let done = server.run(&mut |_, _| {});
    let stats = server.stats;
    let swapped = server.sched.stats().swapped_groups;
    let leaks: Vec<_> = (0..2)
        .map(|g| server.sched.group_blocks(g).unwrap().stats())
        .collect();
    *m = Some(server.into_model());
    let done = done.expect("serving");
    assert!(
        swapped > 0 && stats.swapped_out_blocks > 0,
        "nothing swapped: {stats:?}"
    );
    for st in leaks {
        assert_eq!(st.free + st.evictable, st.total, "blocks leaked: {st:?}");
        assert_eq!(st.swap_used, 0);
    }
    for (id, g) in ids.iter().zip(&short) {
        let c = done.iter().find(|c| c.request == *id).expect("finished");
        assert_eq!(c.sequences[0].tokens, g.tokens, "{:?}", g.user);
    }
    eprintln!(
        "swap with 2 layer groups: {swapped} groups swapped, {} blocks out of group 0",
        stats.swapped_out_blocks
    );
}
