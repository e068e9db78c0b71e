//! Replays the command-line fuzz target's corpus (`fuzz/corpus/cli_args/`)
//! on stable Rust, and a seeded random exploration, through the same
//! harness as the fuzz target (cli/tests/fuzz_corpus_cli/cli_args.rs) and the binary's
//! own parser and checks (`pagedattn_cli::args`). `CLI_ARGS_INPUT=<file>` replays one
//! file.

use std::path::Path;

use pagedattn::rng::SplitMix64;

mod cli_args;
use cli_args::harness::{assert_reached, caught, corpus_files};

fn replay_cli(path: &Path, total: &mut cli_args::Outcome) {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let what = format!(
        "cli_args corpus input {}: argv {:?}",
        path.display(),
        cli_args::argv(&data)
    );
    total.add(&caught(&what, || cli_args::run(&data)));
}

#[test]
fn cli_args_corpus_passes_and_reaches_every_outcome() {
    let mut total = cli_args::Outcome::default();
    if let Ok(one) = std::env::var("CLI_ARGS_INPUT") {
        replay_cli(Path::new(&one), &mut total);
        println!("{:?}", total.named());
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/cli_args");
    let files = corpus_files(&dir, 20);
    for f in &files {
        replay_cli(f, &mut total);
    }
    println!("{} inputs: {:?}", files.len(), total.named());
    assert_reached(&total.named(), "the corpus", &[]);
}

/// Random argvs from each subcommand's flags, with values of the right
/// kind (in and out of range) or of any kind. The seed is fixed (override
/// with CLI_ARGS_SEED) and printed with a failing argv.
#[test]
fn random_argvs_are_parsed_and_checked_without_panicking() {
    let seed = std::env::var("CLI_ARGS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0xC11_A265u64);
    let mut rng = SplitMix64::new(seed);
    let ints = "0 1 2 3 7 16 64 65 256 257 4096 65536 1000000 1048576 1048577 4294967295 \
                4294967296 18446744073709551615 -1";
    let floats = "0 0.5 25 -1 -0.5 nan inf -inf 1e-300 1e300 1e309";
    let dists = "fixed:0 fixed:5 fixed:1048577 uniform:0:18446744073709551615 uniform:3:1 \
                 uniform:1:40 lognormal:20:1 lognormal:0:1 lognormal:5:11 lognormal:nan:1 \
                 geometric:4 geometric:0.5 geometric:inf zipf:1";
    let commands: [(&str, Vec<(&str, &str)>); 3] = [
        (
            "demo",
            vec![
                ("--requests", ints),
                ("--samples", ints),
                ("--block-size", ints),
                ("--num-blocks", ints),
                ("--seed", ints),
                ("--f32", ""),
                ("--verbose", ""),
            ],
        ),
        (
            "simulate",
            vec![
                ("--requests", ints),
                ("--budget", ints),
                ("--max-len", ints),
                ("--max-output", ints),
                ("--shared-prefix", ints),
                ("--max-seqs", ints),
                ("--seed", ints),
                ("--block-size", "1 2 16 256 512 12 0 1,2,4 8,16 16,16,16"),
                ("--dataset", "sharegpt alpaca wiki"),
                ("--input-len", dists),
                ("--output-len", dists),
                (
                    "--arrival",
                    "all poisson:1 poisson:0 poisson:nan fixed:1e-300 fixed:0.000001 \
                     fixed:1e6 fixed:1e7 burst:2",
                ),
                ("--policies", "paged max oracle max,oracle paged,paged lru"),
                (
                    "--sampling",
                    "single parallel:4 beam:3 beam:64 beam:65 parallel:0 \
                     single,beam:2,parallel:3 n:2",
                ),
                ("--json", ""),
            ],
        ),
        (
            "bench",
            vec![
                ("--max-seconds", floats),
                ("--quick", ""),
                ("--json", ""),
                ("--wall-clock", ""),
            ],
        ),
    ];
    let joined = [ints, floats, dists].join(" ");
    let any: Vec<&str> = joined.split_whitespace().collect();
    fn pick<'a>(rng: &mut SplitMix64, v: &[&'a str]) -> &'a str {
        v[rng.below(v.len() as u64) as usize]
    }
    let mut total = cli_args::Outcome::default();
    for i in 0..400 {
        let (cmd, flags) = &commands[rng.below(3) as usize];
        let mut words: Vec<&str> = vec![cmd];
        if *cmd == "simulate" && rng.below(4) > 0 {
            // Most simulations small enough to pass the checks.
            words.extend(["--requests", "5", "--max-len", "96", "--budget", "2048"]);
        }
        for _ in 0..rng.below(5) {
            let (flag, values) = flags[rng.below(flags.len() as u64) as usize];
            words.push(flag);
            let values: Vec<&str> = values.split_whitespace().collect();
            match rng.below(10) {
                _ if values.is_empty() => {}
                0 => words.push(pick(&mut rng, &any)),
                1 => {}
                _ => words.push(pick(&mut rng, &values)),
            }
        }
        if rng.below(20) == 0 {
            words.push(pick(&mut rng, &["--help", "--bogus", "-x", "extra"]));
        }
        let data = words.join("\n").into_bytes();
        match std::panic::catch_unwind(|| cli_args::run(&data)) {
            Ok(o) => total.add(&o),
            Err(p) => {
                let path = std::env::temp_dir().join(format!("cli_args_random_{seed}_{i}"));
                let _ = std::fs::write(&path, &data);
                eprintln!(
                    "random argv {i} failed (replay with CLI_ARGS_SEED={seed}, or \
                     CLI_ARGS_INPUT={}): {words:?}",
                    path.display()
                );
                std::panic::resume_unwind(p);
            }
        }
    }
    println!("seed {seed}: {:?}", total.named());
    assert!(
        total.usage_errors > 0
            && total.check_errors > 0
            && total.sim_runs > 0
            && total.demo > 0
            && total.bench > 0,
        "seed {seed}: {:?}",
        total.named()
    );
}
