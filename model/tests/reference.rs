//! SmolLM2-135M through pagedattn against an independent runtime: the
//! committed fixture (`tests/fixture/reference.json`, made by
//! `scripts/make-fixture.py` with llama.cpp on an F32 copy of the same
//! weights, F32 KV cache). The fixture's prompts were chosen so that every
//! greedy step's top-1/top-2 margin, every beam gap and every sampling
//! boundary is wide enough for a different f32 implementation to agree.
//!
//! Tolerances: logprobs within 2e-3 of the reference's at every step (f32
//! activations, a different summation order and RoPE table; measured
//! worst values are printed).

mod common;

use common::*;
use pagedattn::blocks::Preemption;
use pagedattn::gpu::{KvDtype, PagedAttention};
use pagedattn_model::sample::SamplingParams;
use pagedattn_model::serve::{Decoding, Request, ServerConfig};

const LOGPROB_TOL: f64 = 2e-3;

fn cfg() -> ServerConfig {
    ServerConfig {
        max_seqs: MAX_SEQS,
        max_batch_tokens: MAX_ROWS,
        ..ServerConfig::default()
    }
}

fn greedy_request(g: &Greedy, n: usize, top: usize) -> Request {
    let mut r = Request::greedy(g.prompt_ids.clone(), n);
    r.record_top = top;
    r
}

/// Identical greedy tokens for the first `n` tokens of the first
/// `done.len()` fixture prompts.
fn assert_greedy(done: &[pagedattn_model::serve::Completion], n: usize, what: &str) {
    let f = fixture();
    assert!(!done.is_empty() && done.len() <= f.greedy.len(), "{what}");
    for (c, g) in done.iter().zip(&f.greedy) {
        assert!(!c.aborted, "{what}: {:?} aborted", g.user);
        assert_eq!(c.sequences.len(), 1);
        assert_eq!(
            c.sequences[0].tokens,
            g.tokens[..n],
            "{what}: prompt {:?}",
            g.user
        );
    }
}

#[test]
fn greedy_matches_the_reference_token_for_token_with_its_logprobs() {
    let Some(mut m) = model("greedy") else { return };
    let f = fixture();
    assert!(f.greedy.len() >= 8);
    let reqs = f.greedy.iter().map(|g| greedy_request(g, 64, 10)).collect();
    let (done, stats, _) = serve(&mut m, cfg(), reqs);
    assert_greedy(&done, 64, "greedy");
    let mut worst: f64 = 0.0;
    for (c, g) in done.iter().zip(&f.greedy) {
        let ours = &c.sequences[0].top;
        assert_eq!(ours.len(), 64);
        for (step, (want, got)) in g.top5.iter().zip(ours).enumerate() {
            for &(id, lp) in want {
                let mine = got.iter().find(|x| x.0 == id).unwrap_or_else(|| {
                    panic!(
                        "{:?} step {step}: reference top-5 token {id} not in our top-10",
                        g.user
                    )
                });
                let d = (mine.1 - lp).abs();
                assert!(d.is_finite());
                worst = worst.max(d);
                assert!(
                    d <= LOGPROB_TOL,
                    "{:?} step {step} token {id}: logprob {} vs the reference's {lp}",
                    g.user,
                    mine.1
                );
            }
        }
    }
    eprintln!(
        "greedy: {} prompts x 64 tokens identical; worst top-5 logprob difference {worst:.2e} (tolerance {LOGPROB_TOL:.0e}); {} steps",
        done.len(),
        stats.steps
    );
}

#[test]
fn beam_search_finds_the_reference_beams() {
    let Some(mut m) = model("beam") else { return };
    for b in &fixture().beam {
        let req = Request {
            decoding: Decoding::Beam { width: b.width },
            record_top: 0,
            ..Request::greedy(b.prompt_ids.clone(), b.steps)
        };
        let (done, stats, _) = serve(&mut m, cfg(), vec![req]);
        let got = &done[0].sequences;
        assert_eq!(got.len(), b.width, "{:?}", b.user);
        for (i, (g, w)) in got.iter().zip(&b.beams).enumerate() {
            assert_eq!(g.tokens, w.tokens, "{:?} beam {i}", b.user);
            assert!(
                (g.score - w.score).abs() <= 1e-2,
                "{:?} beam {i}: score {} vs {}",
                b.user,
                g.score,
                w.score
            );
        }
        assert!(
            stats.copies > 0,
            "beams that fork copy their shared last block"
        );
        eprintln!(
            "beam {:?}: {} beams identical, scores {:?}; peak {} blocks, {} shared",
            b.user,
            got.len(),
            got.iter().map(|g| g.score).collect::<Vec<_>>(),
            stats.peak_blocks_used,
            stats.peak_blocks_shared
        );
    }
}

#[test]
fn parallel_samples_match_the_reference_and_share_the_prompt_blocks() {
    let Some(mut slot) = model("samples") else {
        return;
    };
    for s in &fixture().sample {
        let params = SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            min_p: 0.0,
            top_p: s.top_p,
            seed: s.seed,
        };
        let req = Request {
            decoding: Decoding::Sample { params, n: s.n },
            ..Request::greedy(s.prompt_ids.clone(), s.max_tokens)
        };
        // Step by hand to look at the pool once the samples have forked.
        let model = slot.take().expect("model");
        let mut server = pagedattn_model::serve::Server::new(model, cfg()).expect("server");
        let id = server.add(req).expect("request");
        let full = s.prompt_ids.len() / 16;
        let mut checked = false;
        let mut done = Vec::new();
        while server.has_work() {
            done.extend(server.step(&mut |_, _| {}).expect("step"));
            let Ok(seqs) = server.sched.sequences(id) else {
                continue;
            };
            if seqs.len() == s.n && !checked {
                // Every sample's table starts with the same `full` blocks.
                let tables: Vec<Vec<u32>> = seqs
                    .iter()
                    .map(|&q| server.sched.blocks().block_table(q).unwrap().to_vec())
                    .collect();
                let mut first: Vec<u32> = tables.iter().flat_map(|t| t[..full].to_vec()).collect();
                first.sort();
                first.dedup();
                assert_eq!(first.len(), full, "the prompt's full blocks are held once");
                for b in &first {
                    assert_eq!(server.sched.blocks().ref_count(*b), Some(s.n as u32));
                }
                // What the browser page shows of a running request: one
                // live sequence per resident sample, each with its tokens.
                let p = server.progress(id).expect("running");
                assert_eq!(p.live.len() + p.done.len(), s.n);
                assert!(p.live.iter().all(|g| !g.tokens.is_empty()));
                checked = true;
            }
        }
        assert!(checked, "the samples were never resident together");
        assert!(
            server.progress(id).is_none(),
            "an ended request has no progress"
        );
        let st = server.sched.blocks().stats();
        assert_eq!(st.free + st.evictable, st.total, "no block leaked");
        slot.replace(server.into_model());
        let got = &done[0].sequences;
        assert_eq!(got.len(), s.n);
        for (b, (g, w)) in got.iter().zip(&s.branches).enumerate() {
            assert_eq!(&g.tokens, w, "{:?} branch {b}", s.user);
        }
        eprintln!(
            "samples {:?}: {} branches identical; prompt's {full} full blocks held once",
            s.user, s.n
        );
    }
}

#[test]
fn chunked_and_mixed_prefill_give_the_one_shot_tokens() {
    let Some(mut m) = model("chunked") else {
        return;
    };
    let f = fixture();
    let (n, k) = (8, 4);
    for chunk in [16, 64] {
        let reqs = f.greedy[..k]
            .iter()
            .map(|g| greedy_request(g, n, 0))
            .collect();
        let c = ServerConfig {
            max_batch_tokens: chunk,
            ..cfg()
        };
        let (done, stats, _) = serve(&mut m, c, reqs);
        assert_greedy(&done, n, &format!("chunks of {chunk}"));
        // At most `chunk` tokens a step: the prompt tokens computed (net of
        // prefix-cache hits) took at least that many steps; at 16, every
        // prompt (37 to 45 tokens) was split.
        let least = stats.prefill_tokens.div_ceil(chunk);
        assert!(
            stats.prefill_steps >= least && (chunk > 16 || stats.prefill_steps > k),
            "{} prompt tokens in chunks of {chunk}: {} steps with prompt work",
            stats.prefill_tokens,
            stats.prefill_steps
        );
    }
    // Mixed steps: prompts arrive while others decode.
    let model = m.take().expect("model");
    let mut server = pagedattn_model::serve::Server::new(model, cfg()).expect("server");
    let mut ids = Vec::new();
    let mut done = Vec::new();
    let mut mixed = 0;
    for g in &f.greedy[..k] {
        ids.push(server.add(greedy_request(g, n, 0)).expect("request"));
        let before = server.stats.prefill_tokens;
        done.extend(server.step(&mut |_, _| {}).expect("step"));
        mixed += (server.stats.prefill_tokens > before && ids.len() > 1) as usize;
    }
    done.extend(server.run(&mut |_, _| {}).expect("run"));
    let st = server.sched.blocks().stats();
    assert_eq!(st.free + st.evictable, st.total, "no block leaked");
    *m = Some(server.into_model());
    done.sort_by_key(|c| ids.iter().position(|i| *i == c.request));
    assert!(
        mixed >= k - 1,
        "steps mixing a prompt with decodes: {mixed}"
    );
    assert_greedy(&done, n, "mixed prefill + decode");
}

#[test]
fn a_prefix_cache_hit_gives_identical_tokens() {
    let Some(mut m) = model("prefix") else { return };
    let f = fixture();
    let n = 12;
    let g = &f.greedy[0];
    // The same prompt twice (the second entirely cached: its last token's
    // write is skipped), then another prompt with the same system prompt.
    let model = m.take().expect("model");
    let mut server = pagedattn_model::serve::Server::new(model, cfg()).expect("server");
    let a = server.add(greedy_request(g, n, 0)).expect("a");
    let mut done = server.run(&mut |_, _| {}).expect("run");
    let hits1 = server.sched.blocks().prefix_hit_tokens();
    let b = server.add(greedy_request(g, n, 0)).expect("b");
    done.extend(server.run(&mut |_, _| {}).expect("run"));
    let hits2 = server.sched.blocks().prefix_hit_tokens();
    let other = &f.greedy[1];
    let c = server.add(greedy_request(other, n, 0)).expect("c");
    done.extend(server.run(&mut |_, _| {}).expect("run"));
    let hits3 = server.sched.blocks().prefix_hit_tokens();
    let st = server.sched.blocks().stats();
    assert_eq!(st.free + st.evictable, st.total, "no block leaked");
    *m = Some(server.into_model());
    assert_eq!(hits1, 0, "a fresh pool has nothing cached");
    let full = (g.prompt_ids.len() / 16 * 16) as u64;
    assert!(
        hits2 - hits1 >= full,
        "the repeat hit its {full} cached prompt tokens ({})",
        hits2 - hits1
    );
    let shared_system = g
        .prompt_ids
        .iter()
        .zip(&other.prompt_ids)
        .take_while(|(x, y)| x == y)
        .count();
    assert!(
        hits3 - hits2 >= (shared_system / 16 * 16) as u64 && shared_system >= 16,
        "the system prompt's {shared_system} shared tokens hit"
    );
    for (id, want) in [(a, &g.tokens), (b, &g.tokens), (c, &other.tokens)] {
        let got = done.iter().find(|x| x.request == id).expect("finished");
        assert_eq!(got.sequences[0].tokens, want[..n]);
    }
}

/// A remote prefix hit (issue: KV beyond one machine): engine A serves a
/// prompt and exports the full blocks its block manager reports stored;
/// a second server, with its own scheduler and block manager over a pool
/// overwritten with noise (so nothing of A's K/V is left in place), gets
/// A's blocks for the prompt, imports them at admission and computes only
/// the rest: the same greedy tokens as the reference, with the imported
/// tokens' prefill skipped.
#[test]
fn a_remote_prefix_hit_gives_identical_tokens() {
    let Some(mut m) = model("remote prefix") else {
        return;
    };
    let f = fixture();
    let n = 12;
    let g = &f.greedy[0];
    let req = greedy_request(g, n, 0);
    let salt = req.salt.clone();
    let model = m.take().expect("model");
    let mut a = pagedattn_model::serve::Server::new(model, cfg()).expect("server A");
    a.sched.record_events(true);
    let ra = a.add(greedy_request(g, n, 0)).expect("a");
    let done = a.run(&mut |_, _| {}).expect("run A");
    let got = done.iter().find(|x| x.request == ra).expect("A finished");
    assert_eq!(got.sequences[0].tokens, g.tokens[..n]);
    // A's stored blocks, by digest: what a store would hold.
    let layers = a.model.cache().config().num_layers;
    let mut store = std::collections::HashMap::new();
    for e in a.sched.take_events() {
        if let pagedattn::blocks::KvEvent::Stored { hash, block } = e {
            let mut bytes =
                vec![0u8; a.model.cache().export_bytes(1, 0..layers).expect("size") as usize];
            let layout = a
                .model
                .cache()
                .export_blocks(&a.model.gpu, &[block], 0..layers, &mut bytes)
                .expect("export");
            store.insert(hash, (layout, bytes));
        }
    }
    let model = a.into_model();
    // Noise over every slot of every layer: A's K/V is gone from the pool.
    let c = *model.cache().config();
    let slots: Vec<u32> = (0..c.num_blocks * c.block_size).collect();
    let mut rng = pagedattn::rng::SplitMix64::new(0x6E01_5E00);
    for l in 0..c.num_layers {
        let n = slots.len() * (c.num_kv_heads * c.head_dim) as usize;
        let (k, v) = (rng.signed_vec(n), rng.signed_vec(n));
        model
            .cache()
            .write_kv(&model.gpu, l, &k, &v, &slots)
            .expect("noise");
    }
    let mut b = pagedattn_model::serve::Server::new(model, cfg()).expect("server B");
    let hashes = b.sched.blocks().prompt_hashes(&g.prompt_ids, &salt);
    let remote: Vec<_> = hashes.iter().map_while(|h| store.get(h).cloned()).collect();
    let full = g.prompt_ids.len() / c.block_size as usize;
    assert_eq!(remote.len(), full, "every full prompt block of A is found");
    let rb = b
        .add_with_remote(greedy_request(g, n, 0), remote)
        .expect("b");
    let done = b.run(&mut |_, _| {}).expect("run B");
    let imported = b.imported_blocks;
    let hits = b.sched.blocks().remote_hit_tokens();
    let prefill = b.stats.prefill_tokens;
    *m = Some(b.into_model());
    let got = done.iter().find(|x| x.request == rb).expect("B finished");
    eprintln!(
        "remote prefix: {imported} blocks imported ({hits} tokens), {prefill} prompt tokens computed of {}",
        g.prompt_ids.len()
    );
    assert_eq!(imported, full);
    assert_eq!(hits as usize, full * c.block_size as usize);
    assert!(prefill < g.prompt_ids.len(), "B skips the imported tokens");
    assert_eq!(
        got.sequences[0].tokens,
        g.tokens[..n],
        "B's tokens equal the reference's"
    );
}

#[test]
fn preemption_by_recompute_and_by_swap_keeps_the_tokens() {
    let Some(mut m) = model("preempt") else {
        return;
    };
    let f = fixture();
    let (n, k) = (32, 4);
    // Each sequence needs 5 blocks at its end; 4 of them need 20.
    for (preemption, swap) in [(Preemption::Recompute, 0), (Preemption::Swap, 64)] {
        let c = ServerConfig {
            num_blocks: Some(12),
            preemption,
            swap_blocks: swap,
            prefix_caching: false,
            ..cfg()
        };
        let reqs = f.greedy[..k]
            .iter()
            .map(|g| greedy_request(g, n, 0))
            .collect();
        let (done, stats, _) = serve(&mut m, c, reqs);
        assert!(
            stats.preempted > 0,
            "{preemption:?}: the pool was too small"
        );
        if swap > 0 {
            assert!(stats.swapped_out_blocks > 0, "swap preemption swapped");
        }
        assert_greedy(&done, n, &format!("{preemption:?}"));
        eprintln!(
            "{preemption:?}: {} preemptions, identical tokens",
            stats.preempted
        );
    }
}

#[test]
fn every_decode_kernel_gives_the_same_greedy_tokens() {
    let Some(mut m) = model("kernels") else {
        return;
    };
    let f = fixture();
    let (n, k) = (8, 3);
    let kernels = {
        let model = m.as_ref().expect("model");
        PagedAttention::eligible_kernels(&model.gpu, model.cache(), model.shape.heads as u32)
    };
    assert!(kernels.len() >= 2, "{kernels:?}");
    for &kernel in &kernels {
        m.as_mut()
            .expect("model")
            .reconfigure(POOL_BLOCKS, KvDtype::F32, Some(kernel))
            .expect("kernel");
        let reqs = f.greedy[..k]
            .iter()
            .map(|g| greedy_request(g, n, 0))
            .collect();
        let (done, _, _) = serve(&mut m, cfg(), reqs);
        assert_greedy(&done, n, &format!("kernel {kernel}"));
    }
    m.as_mut()
        .expect("model")
        .reconfigure(POOL_BLOCKS, KvDtype::F32, None)
        .expect("default");
    eprintln!("kernels {kernels:?}: identical greedy tokens");
}

#[test]
fn narrower_kv_pools_stay_close_to_f32() {
    let Some(mut m) = model("kv dtypes") else {
        return;
    };
    let f = fixture();
    let (n, k) = (24, 4);
    // Agreement of the greedy tokens with f32's (the first divergence ends
    // the comparison of a prompt) and the logprob drift of the tokens the
    // f32 run chose, over the steps before any divergence. Bounds: about
    // twice the values measured on lavapipe (f16 1.00 / 2.8e-3, bf16 1.00
    // / 2.6e-2, int8 1.00 / 0.15, fp8 1.00 / 0.38).
    for (dtype, min_agree, max_drift) in [
        (KvDtype::F16, 0.95, 0.01),
        // bf16: 3 mantissa bits fewer than f16.
        (KvDtype::Bf16, 0.9, 0.06),
        (KvDtype::Int8, 0.9, 0.3),
        (KvDtype::Fp8E4M3, 0.7, 0.6),
    ] {
        m.as_mut()
            .expect("model")
            .reconfigure(POOL_BLOCKS, dtype, None)
            .expect("dtype");
        let reqs = f.greedy[..k]
            .iter()
            .map(|g| greedy_request(g, n, 10))
            .collect();
        let (done, _, _) = serve(&mut m, cfg(), reqs);
        let (mut agree, mut total, mut drift): (usize, usize, f64) = (0, 0, 0.0);
        for (c, g) in done.iter().zip(&f.greedy) {
            let got = &c.sequences[0];
            total += n;
            for i in 0..n {
                if got.tokens[i] != g.tokens[i] {
                    break;
                }
                agree += 1;
                let want = g.top5[i][0].1;
                let mine = got.top[i][0].1;
                assert!(mine.is_finite());
                drift = drift.max((mine - want).abs());
            }
        }
        let share = agree as f64 / total as f64;
        eprintln!(
            "{}: greedy agreement with the reference {share:.3} ({agree}/{total} tokens before any divergence), worst top-1 logprob drift {drift:.3e}",
            dtype.name()
        );
        assert!(share >= min_agree, "{}: agreement {share}", dtype.name());
        assert!(drift <= max_drift, "{}: drift {drift}", dtype.name());
    }
    m.as_mut()
        .expect("model")
        .reconfigure(POOL_BLOCKS, KvDtype::F32, None)
        .expect("f32");
}
