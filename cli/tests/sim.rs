//! Tests of the multi-tenant memory simulator: determinism, the JSON and SVG
//! outputs, the invariants of each policy (paged beats max-length
//! reservation, bounded paged waste, every request finishes, no block
//! leaks), and that forks and prefix caching really share memory.

use clap::Parser;
use pagedattn_cli::sim::workload::{generate, WorkloadSpec};
use pagedattn_cli::sim::{
    simulate, Dataset, LenDist, PolicyKind, PolicyReport, Report, Sampling, SimConfig, SimulateArgs,
};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: SimulateArgs,
}

fn args(extra: &[&str]) -> SimulateArgs {
    let mut v = vec!["simulate"];
    v.extend_from_slice(extra);
    Cli::try_parse_from(v).expect("valid flags").args
}

/// [`small`] with its flags in one line, split at spaces.
fn small_line(flags: &str) -> Report {
    small(&flags.split_whitespace().collect::<Vec<_>>())
}

/// A small sharegpt run that still puts memory under pressure; flags in
/// `extra` replace the defaults set here.
fn small(extra: &[&str]) -> Report {
    let mut flags: Vec<&str> = extra.to_vec();
    for (flag, value) in [
        ("--requests", "120"),
        ("--budget", "16384"),
        ("--arrival", "poisson:2"),
        ("--seed", "7"),
    ] {
        if !extra.contains(&flag) {
            flags.extend([flag, value]);
        }
    }
    let cfg = SimConfig::from_args(&args(&flags)).expect("valid config");
    simulate(&cfg).expect("simulation runs")
}

fn policy<'a>(r: &'a Report, sampling: &str, label: &str) -> &'a PolicyReport {
    r.scenarios
        .iter()
        .find(|s| s.sampling == sampling)
        .unwrap_or_else(|| panic!("no scenario {sampling}"))
        .policies
        .iter()
        .find(|p| p.label == label)
        .unwrap_or_else(|| panic!("no policy {label}"))
}

#[test]
fn same_seed_gives_identical_json_and_svg() {
    let a = small(&["--sampling", "single,beam:3"]);
    let b = small(&["--sampling", "single,beam:3"]);
    assert_eq!(a.to_json(), b.to_json());
    assert_eq!(a.table(), b.table());
    assert_eq!(a.svg(), b.svg());
    let c = small(&["--sampling", "single,beam:3", "--seed", "8"]);
    assert_ne!(a.to_json(), c.to_json(), "the seed must matter");
}

#[test]
fn json_parses_and_has_the_documented_fields() {
    let r = small(&["--sampling", "single,parallel:2"]);
    let v: serde_json::Value = serde_json::from_str(&r.to_json()).expect("valid JSON");
    assert_eq!(v["config"]["budget_tokens"], 16384);
    assert_eq!(v["config"]["seed"], 7);
    let scenarios = v["scenarios"].as_array().expect("scenarios");
    assert_eq!(scenarios.len(), 2);
    assert_eq!(scenarios[1]["sampling"], "parallel:2");
    assert_eq!(scenarios[0]["workload"]["requests"], 120);
    let labels: Vec<&str> = scenarios[0]["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["label"].as_str().unwrap())
        .collect();
    assert_eq!(labels, ["paged/16", "contig-max", "contig-oracle"]);
    for p in scenarios[0]["policies"].as_array().unwrap() {
        for field in [
            "utilisation",
            "utilisation_at_peak",
            "internal_frag_frac",
            "reserved_frac",
            "peak_seqs",
            "mean_seqs",
            "max_queue",
            "preemptions",
            "sharing_saved_mean",
            "steps",
            "tokens_per_step",
        ] {
            assert!(p[field].is_number(), "{field} missing in {p}");
        }
        assert!(p.get("series").is_none(), "series stay out of the JSON");
    }
}

/// Checks that every tag is closed in order, ignoring text; enough to catch
/// a broken writer without an XML parser.
fn assert_well_formed(svg: &str) {
    let mut stack: Vec<&str> = Vec::new();
    let mut rest = svg;
    while let Some(open) = rest.find('<') {
        let close = rest[open..].find('>').expect("unterminated tag") + open;
        let tag = &rest[open + 1..close];
        assert!(!tag.contains('<'), "'<' inside a tag: {tag}");
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(stack.pop(), Some(name.trim()), "mismatched </{name}>");
        } else if !tag.ends_with('/') {
            let name = tag.split_whitespace().next().expect("tag name");
            stack.push(name);
        }
        rest = &rest[close + 1..];
    }
    assert!(stack.is_empty(), "unclosed tags: {stack:?}");
    assert!(!rest.contains('>'), "stray '>' after the last tag");
}

#[test]
fn svg_is_a_well_formed_standalone_document() {
    let r = small(&["--sampling", "single,parallel:2", "--block-size", "8,16"]);
    let svg = r.svg();
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert!(svg.trim_end().ends_with("</svg>"));
    assert_well_formed(&svg);
    // Two lines per policy per scenario, a legend entry per policy, axes labelled.
    assert_eq!(svg.matches("<polyline").count(), 2 * 2 * 4);
    assert!(svg.contains("paged/8 held") && svg.contains("contig-max stored"));
    assert!(svg.contains("scheduler step") && svg.contains("KV slots"));
    assert!(!svg.contains("NaN") && !svg.contains("inf"));
}

#[test]
fn paged_beats_max_reservation_without_losing_anything() {
    let r = small(&["--sampling", "single"]);
    let paged = policy(&r, "single", "paged/16");
    let max = policy(&r, "single", "contig-max");
    let oracle = policy(&r, "single", "contig-oracle");
    assert!(paged.utilisation > max.utilisation);
    assert!(paged.utilisation > oracle.utilisation);
    assert!(
        paged.utilisation > 0.9,
        "paged utilisation {}",
        paged.utilisation
    );
    assert!(max.utilisation < 0.5, "max utilisation {}", max.utilisation);
    assert!(paged.mean_seqs >= 2.0 * max.mean_seqs);
    assert!(paged.steps < max.steps);
    // The oracle never wastes a slot it will not fill.
    assert_eq!(oracle.internal_frag_frac, 0.0);
    for p in [paged, max, oracle] {
        assert_eq!(p.requests_finished, 120, "{}", p.label);
        assert_eq!(p.leaked_tokens, 0, "{}", p.label);
        // Same workload, same decode: the same tokens come out of every policy.
        assert_eq!(p.generated_tokens, paged.generated_tokens);
        assert!(p.peak_held_tokens <= p.capacity_tokens);
    }
    assert_eq!(paged.blocks_free_at_end, paged.blocks_total);
    assert_eq!(paged.blocks_total, Some(16384 / 16));
    assert_eq!(max.preemptions + oracle.preemptions, 0);
}

#[test]
fn paged_waste_stays_under_one_block_per_sequence() {
    let r = small(&[
        "--sampling",
        "single,parallel:3,beam:3",
        "--block-size",
        "8,32",
    ]);
    for sc in &r.scenarios {
        for p in sc.policies.iter().filter(|p| p.policy == "paged") {
            let bs = p.block_size.unwrap() as f64;
            assert!(
                p.waste_per_seq_max < bs,
                "{} {}: waste {} per sequence",
                sc.sampling,
                p.label,
                p.waste_per_seq_max
            );
            for s in &p.series {
                assert!(s.stored <= s.held && s.held as usize <= p.capacity_tokens);
                assert!(s.stored + s.reserved <= s.held);
            }
            assert_eq!(p.blocks_free_at_end, p.blocks_total);
            assert_eq!(p.copy_conflicts, 0);
        }
    }
}

#[test]
fn forks_share_the_prompt_instead_of_copying_it() {
    // Ample memory and every request at step 0: paged and the oracle
    // reservation (the same library scheduler) then schedule identically,
    // so any gap in tokens stored is sharing: a reservation's sequences
    // each write their own prompt.
    let r = small(&[
        "--sampling",
        "parallel:4,beam:4",
        "--arrival",
        "all",
        "--requests",
        "40",
        "--budget",
        "400000",
        "--policies",
        "paged,oracle",
    ]);
    for sampling in ["parallel:4", "beam:4"] {
        let paged = policy(&r, sampling, "paged/16");
        let oracle = policy(&r, sampling, "contig-oracle");
        assert_eq!(paged.steps, oracle.steps, "{sampling}");
        assert!(paged.cow_copies > 0, "{sampling}: forks must copy on write");
        assert!(paged.sharing_saved_peak > 0, "{sampling}");
        assert!(
            paged.peak_stored_tokens < oracle.peak_stored_tokens,
            "{sampling}: {} shared vs {} unshared",
            paged.peak_stored_tokens,
            oracle.peak_stored_tokens
        );
        assert_eq!(
            paged.generated_tokens, oracle.generated_tokens,
            "{sampling}"
        );
        for (p, o) in paged.series.iter().zip(&oracle.series) {
            // The same sequences at the same lengths, step for step.
            assert_eq!(p.logical, o.stored);
            assert!(p.stored <= p.logical);
        }
    }
    // Beams share their common history too, so they save more than samples.
    assert!(
        policy(&r, "beam:4", "paged/16").sharing_saved_frac
            > policy(&r, "parallel:4", "paged/16").sharing_saved_frac
    );
}

#[test]
fn a_shared_system_prompt_hits_the_prefix_cache() {
    let r = small(&["--sampling", "single", "--shared-prefix", "64"]);
    let paged = policy(&r, "single", "paged/16");
    assert!(
        paged.prefix_hit_tokens >= 64 * 100,
        "{}",
        paged.prefix_hit_tokens
    );
    assert!(paged.sharing_saved_peak > 0);
    assert_eq!(paged.blocks_free_at_end, paged.blocks_total);
    let plain = small(&["--sampling", "single"]);
    assert_eq!(policy(&plain, "single", "paged/16").prefix_hit_tokens, 0);
}

#[test]
fn length_presets_match_the_paper_means() {
    for (dataset, mean_in, mean_out) in [
        (Dataset::ShareGpt, 161.0, 338.0),
        (Dataset::Alpaca, 19.0, 58.0),
    ] {
        let spec = WorkloadSpec {
            input: dataset.input(),
            output: dataset.output(),
            requests: 4000,
            arrival: "all".parse().unwrap(),
            max_len: 2048,
            max_output: 2048,
            shared_prefix: 0,
            seed: 1,
        };
        let reqs = generate(&spec, Sampling::Parallel(1));
        let n = reqs.len() as f64;
        let inp = reqs.iter().map(|r| r.prompt.len()).sum::<usize>() as f64 / n;
        let out = reqs.iter().map(|r| r.outputs[0]).sum::<usize>() as f64 / n;
        assert!(
            (inp / mean_in - 1.0).abs() < 0.1,
            "{dataset:?} input mean {inp}"
        );
        assert!(
            (out / mean_out - 1.0).abs() < 0.1,
            "{dataset:?} output mean {out}"
        );
        for r in &reqs {
            assert!(!r.prompt.is_empty() && r.outputs[0] >= 1);
            assert!(r.prompt.len() + r.outputs[0] <= 2048);
            assert_eq!(r.reserve_max, 2048);
        }
    }
}

#[test]
fn explicit_distributions_and_arrivals_parse_and_draw() {
    let a = args(&[
        "--input-len",
        "uniform:10:200",
        "--output-len",
        "fixed:100",
        "--arrival",
        "fixed:0.5",
        "--max-output",
        "150",
    ]);
    let cfg = SimConfig::from_args(&a).unwrap();
    assert_eq!(cfg.workload.input, LenDist::Uniform(10, 200));
    let reqs = generate(&cfg.workload, Sampling::Parallel(2));
    for (i, r) in reqs.iter().enumerate() {
        assert!((10..=200).contains(&r.prompt.len()));
        assert_eq!(r.outputs, [100, 100]);
        assert_eq!(r.arrival, i as u64 * 2);
        assert_eq!(r.reserve_max, r.prompt.len() + 150);
    }
    for bad in ["uniform:5:1", "lognormal:0:1", "fixed", "zipf:3"] {
        assert!(bad.parse::<LenDist>().is_err(), "{bad}");
    }
    assert!(Cli::try_parse_from(["simulate", "--sampling", "beam:0"]).is_err());
    assert!(Cli::try_parse_from(["simulate", "--arrival", "poisson:-1"]).is_err());
    assert!(SimConfig::from_args(&args(&["--block-size", "12"])).is_err());
    assert!(SimConfig::from_args(&args(&["--max-seqs", "2"])).is_err());
}

#[test]
fn the_defaults_tell_the_papers_story() {
    // The defaults are the CLI's; a cut-down request count keeps this fast.
    let mut cfg = SimConfig::default();
    assert_eq!(cfg.budget, 32768);
    assert_eq!(cfg.workload.max_len, 2048);
    assert_eq!(cfg.block_sizes, [16]);
    cfg.workload.requests = 150;
    cfg.sampling = vec![Sampling::Parallel(1)];
    let r = simulate(&cfg).unwrap();
    let paged = policy(&r, "single", "paged/16");
    let max = policy(&r, "single", "contig-max");
    assert!(
        1.0 - paged.utilisation < 0.04,
        "paged waste {}",
        1.0 - paged.utilisation
    );
    assert!(
        1.0 - max.utilisation > 0.5,
        "max waste {}",
        1.0 - max.utilisation
    );
    assert!(paged.mean_seqs >= 2.0 * max.mean_seqs);
}

#[test]
fn a_request_too_large_for_the_budget_is_an_error_not_a_hang() {
    let cfg = SimConfig::from_args(&args(&[
        "--budget",
        "1024",
        "--input-len",
        "fixed:600",
        "--output-len",
        "fixed:600",
        "--requests",
        "3",
        "--sampling",
        "single",
    ]))
    .unwrap();
    for kind in [PolicyKind::Paged, PolicyKind::Max, PolicyKind::Oracle] {
        let mut c = cfg.clone();
        c.policies = vec![kind];
        let err = simulate(&c).expect_err("cannot fit").to_string();
        assert!(err.contains("does not fit"), "{kind:?}: {err}");
    }
}

/// `--kv-dtype`: the same bytes hold about twice the tokens in int8 and
/// fp8, so the paged policy runs more sequences at once and finishes in
/// fewer steps; f16 is the default and its numbers are unchanged.
#[test]
fn quantized_kv_buys_concurrency_under_the_same_memory() {
    // Every request at once: memory, not arrivals, sets the pace.
    let r = small(&[
        "--kv-dtype",
        "f16,int8,fp8",
        "--policies",
        "paged",
        "--sampling",
        "single",
        "--arrival",
        "all",
        "--requests",
        "500",
    ]);
    let p = &r.scenarios[0].policies;
    assert_eq!(p.len(), 3);
    let (f16, int8, fp8) = (&p[0], &p[1], &p[2]);
    assert_eq!(
        (
            f16.kv_dtype.as_str(),
            int8.kv_dtype.as_str(),
            fp8.kv_dtype.as_str()
        ),
        ("f16", "int8", "fp8")
    );
    // K and V of a token per KV head at head_dim 128: f16 512 bytes, int8
    // 262 (side words: K's 4, V's 2), fp8 260 (K's 4).
    let cap = |x: &PolicyReport| x.capacity_tokens as f64;
    assert!(
        (cap(int8) / cap(f16) - 512.0 / 262.0).abs() < 0.01,
        "{} {}",
        cap(int8),
        cap(f16)
    );
    assert!((cap(fp8) / cap(f16) - 512.0 / 260.0).abs() < 0.01);
    assert!(int8.mean_seqs > f16.mean_seqs && fp8.mean_seqs >= int8.mean_seqs);
    assert!(int8.steps < f16.steps);
    let plain = small(&[
        "--policies",
        "paged",
        "--sampling",
        "single",
        "--arrival",
        "all",
        "--requests",
        "500",
    ]);
    assert_eq!(plain.scenarios[0].policies[0].steps, f16.steps);
}

/// A bf16 model's pool: two bytes a value like f16, so the same memory
/// holds the same tokens and the paged run is step for step f16's.
#[test]
fn bf16_kv_holds_what_f16_holds() {
    let r = small_line(
        "--kv-dtype f16,bf16 --policies paged --sampling single --arrival all --requests 300",
    );
    let p = &r.scenarios[0].policies;
    assert_eq!(p.len(), 2);
    let (f16, bf16) = (&p[0], &p[1]);
    assert_eq!(
        (f16.kv_dtype.as_str(), bf16.kv_dtype.as_str()),
        ("f16", "bf16")
    );
    assert_eq!(bf16.capacity_tokens, f16.capacity_tokens);
    assert_eq!(bf16.steps, f16.steps);
    assert!(bf16.capacity_tokens > 0);
}

/// The K/V attention reads per generated token, plain and with the cascade:
/// equal when nothing is shared, lower for parallel samples, lowest for
/// beams (which share most of their history).
#[test]
fn the_cascade_reads_shared_prefixes_once() {
    let r = small(&[
        "--policies",
        "paged",
        "--sampling",
        "single,parallel:4,beam:4",
    ]);
    let read = |i: usize| {
        let p = &r.scenarios[i].policies[0];
        (p.attn_read_per_token_plain, p.attn_read_per_token_cascade)
    };
    let (single, parallel, beam) = (read(0), read(1), read(2));
    assert!(single.0 > 0.0 && single.1 == single.0, "{single:?}");
    assert!(parallel.1 < parallel.0, "{parallel:?}");
    assert!(beam.1 < 0.6 * beam.0, "{beam:?}");
}

/// The paged policy runs the library scheduler under each preemption
/// policy; the cost model prices them, and, as in the vLLM paper's Figure
/// 19, swapping loses at one-token blocks (a copy per block, layer and K or
/// V is mostly overhead) and wins at large blocks.
#[test]
fn recompute_and_swap_are_compared_by_block_size() {
    let r = small(&[
        "--sampling",
        "parallel:4",
        "--policies",
        "paged",
        "--block-size",
        "1,64",
        "--preemption",
        "recompute,swap",
    ]);
    for bs in [1, 64] {
        let rc = policy(&r, "parallel:4", &format!("paged/{bs} recompute"));
        let sw = policy(&r, "parallel:4", &format!("paged/{bs} swap"));
        assert_eq!(rc.preemption.as_deref(), Some("recompute"));
        assert!(rc.recomputed_groups > 0 && rc.swapped_groups == 0, "{bs}");
        assert!(rc.recompute_ms > 0.0 && rc.swap_ms == 0.0);
        assert!(sw.swapped_groups > 0 && sw.swapped_bytes > 0, "{bs}");
        assert!(sw.swap_ms > 0.0);
        // Same work either way.
        assert_eq!(rc.generated_tokens, sw.generated_tokens);
        let (r_ms, s_ms) = (rc.recompute_ms + rc.swap_ms, sw.recompute_ms + sw.swap_ms);
        if bs == 1 {
            assert!(
                s_ms > r_ms,
                "block 1: swap {s_ms} ms vs recompute {r_ms} ms"
            );
        } else {
            assert!(
                s_ms < r_ms,
                "block 64: swap {s_ms} ms vs recompute {r_ms} ms"
            );
        }
    }
}

/// An MLA model's latent pool (DeepSeek's 512 + 64 values per token and
/// layer, bf16) in the same bytes as the GQA model's f16 K/V (8 KV heads
/// of 128): 4096 / 1152 bytes per token and layer, so it holds 3.5x the
/// tokens, and the same requests finish in no more steps.
#[test]
fn an_mla_pool_holds_what_its_bytes_hold() {
    let r = small_line("--kv-dtype f16 --mla 512:64 --policies paged --sampling single --budget 4096 --requests 200");
    let p = &r.scenarios[0].policies;
    assert_eq!(p.len(), 2);
    let (gqa, mla) = (&p[0], &p[1]);
    assert_eq!(
        (gqa.kv_dtype.as_str(), mla.kv_dtype.as_str()),
        ("f16", "mla-512+64-f16")
    );
    let ratio = mla.capacity_tokens as f64 / gqa.capacity_tokens as f64;
    assert!(
        (ratio - 4096.0 / 1152.0).abs() < 0.02,
        "capacity ratio {ratio}"
    );
    assert!(mla.steps <= gqa.steps, "{} > {}", mla.steps, gqa.steps);
    eprintln!(
        "GQA f16: {} tokens, {} steps; MLA: {} tokens, {} steps",
        gqa.capacity_tokens, gqa.steps, mla.capacity_tokens, mla.steps
    );
    // A quantized latent pool, or a row the kernels cannot take, is refused.
    for (dtype, row) in [
        ("int8", "512:64"),
        ("f16", "510:64"),
        ("f16", "512"),
        ("f16", "2048:64"),
    ] {
        let e = SimConfig::from_args(&args(&["--kv-dtype", dtype, "--mla", row])).unwrap_err();
        assert!(e.to_string().contains("--mla"), "{dtype} {row}: {e}");
    }
}

/// `--layer-groups`: the library scheduler over layer groups, a pool per
/// group in the budget's bytes. On 2,048-token sequences a Gemma 3 stack
/// (window 512, 18 layers: the 270M) and gpt-oss keep far more sequences
/// running than full retention on the same bytes, and finish in fewer
/// steps; an all-window stack whose window is longer than every sequence
/// (Mistral's 4096) behaves exactly as full retention. Every request
/// finishes and every block comes back.
#[test]
fn layer_groups_serve_more_long_sequences_on_the_same_bytes() {
    let r = small_line(
        "--layer-groups gemma3-w512,gpt-oss,mistral --model-layers 18 --policies paged \
         --sampling single --input-len fixed:1792 --output-len fixed:256 --max-len 4096 \
         --arrival all --budget 65536",
    );
    let full = policy(&r, "single", "paged/16");
    let gemma = policy(&r, "single", "paged/16 gemma3-w512");
    let gpt = policy(&r, "single", "paged/16 gpt-oss");
    let mistral = policy(&r, "single", "paged/16 mistral");
    for p in [full, gemma, gpt, mistral] {
        assert_eq!(p.requests_finished, 120, "{}", p.label);
        assert_eq!(p.leaked_tokens, 0, "{}", p.label);
        assert_eq!(p.generated_tokens, full.generated_tokens, "{}", p.label);
    }
    assert!(
        gemma.mean_seqs > 1.9 * full.mean_seqs && gemma.steps * 19 < full.steps * 10,
        "gemma3-w512 {} sequences on average in {} steps, full retention {} in {}",
        gemma.mean_seqs,
        gemma.steps,
        full.mean_seqs,
        full.steps
    );
    assert!(
        gpt.mean_seqs > 1.3 * full.mean_seqs,
        "{} vs {}",
        gpt.mean_seqs,
        full.mean_seqs
    );
    assert_eq!(mistral.steps, full.steps);
    assert_eq!(mistral.mean_seqs, full.mean_seqs);
    assert_eq!(mistral.preemptions, full.preemptions);
}
