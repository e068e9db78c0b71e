//! Replays the block-manager fuzz corpus on stable Rust, through the same
//! interpreter and checker as the fuzz target (tests/common/block_ops.rs).
//!
//! `fuzz/corpus/block_manager/` holds a minimised set of inputs that
//! libFuzzer found interesting (each covered code the others did not), plus
//! any input that once broke an invariant. Every one must pass, and together
//! they must still reach every outcome the checker counts, so a change to the
//! input format that silently empties the corpus's meaning fails here.
//! `BLOCK_OPS_INPUT=<file>` replays one file (with the failing call's
//! history printed on failure).

#[path = "common/block_ops.rs"]
mod block_ops;

use std::path::{Path, PathBuf};

use block_ops::Coverage;
use pagedattn::rng::SplitMix64;

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/block_manager")
}

fn replay(path: &Path, total: &mut Coverage) {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let res = std::panic::catch_unwind(|| block_ops::run(&data));
    match res {
        Ok(c) => total.add(&c),
        Err(p) => {
            eprintln!("corpus input {} failed", path.display());
            std::panic::resume_unwind(p);
        }
    }
}

#[test]
fn committed_corpus_passes_and_covers_every_outcome() {
    let mut total = Coverage::default();
    if let Ok(one) = std::env::var("BLOCK_OPS_INPUT") {
        replay(Path::new(&one), &mut total);
        println!("{:?}", total.named());
        return;
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .expect("fuzz/corpus/block_manager")
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(files.len() >= 20, "only {} corpus files", files.len());
    for f in &files {
        replay(f, &mut total);
    }
    println!("{} inputs: {:?}", files.len(), total.named());
    for (what, n) in total.named() {
        // A block awaiting a copy is a copy-on-write source: the partly
        // filled last block of a sequence. The prefix cache holds only full
        // blocks, and filling a shared block copies it first, so no run has
        // found a cached block that awaits a copy (the manager handles it
        // anyway, and so does the checker).
        if what == "revivals of blocks awaiting a copy" {
            continue;
        }
        assert!(
            n > 0,
            "the corpus never reaches {what}: {:?}",
            total.named()
        );
    }
}

/// Seeded random byte strings through the same checker: a little extra
/// exploration on every run, deterministic so a failure replays.
#[test]
fn random_inputs_keep_the_invariants() {
    let mut rng = SplitMix64::new(0xF022_B10C);
    let mut total = Coverage::default();
    for i in 0..300 {
        let len = rng.range(4, 3000) as usize;
        let mut data: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
        // Mostly valid configurations: a bad one ends the input at once.
        data[0] %= 0xF8;
        data[1] = data[1].clamp(1, 0xFE);
        let res = std::panic::catch_unwind(|| block_ops::run(&data));
        if let Err(p) = res {
            let path = std::env::temp_dir().join(format!("block_ops_random_{i}"));
            let _ = std::fs::write(&path, &data);
            eprintln!(
                "random input {i} failed; saved to {} (replay with BLOCK_OPS_INPUT)",
                path.display()
            );
            std::panic::resume_unwind(p);
        }
        total.add(&res.unwrap());
    }
    println!("{:?}", total.named());
    assert!(
        total.ops > 10_000 && total.views > 500 && total.cow > 20,
        "{:?}",
        total.named()
    );
}

// The command-line fuzz target's corpus and a seeded random exploration,
// through the same harness (tests/common/cli_args.rs) and the binary's own
// parser and checks (src/cli.rs). `CLI_ARGS_INPUT=<file>` replays one file.

#[allow(dead_code)]
#[path = "../src/cli.rs"]
mod cli;

#[path = "common/cli_args.rs"]
mod cli_args;

fn replay_cli(path: &Path, total: &mut cli_args::Outcome) {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    match std::panic::catch_unwind(|| cli_args::run(&data)) {
        Ok(o) => total.add(&o),
        Err(p) => {
            eprintln!(
                "cli_args corpus input {} failed: argv {:?}",
                path.display(),
                cli_args::argv(&data)
            );
            std::panic::resume_unwind(p);
        }
    }
}

#[test]
fn cli_args_corpus_passes_and_reaches_every_outcome() {
    let mut total = cli_args::Outcome::default();
    if let Ok(one) = std::env::var("CLI_ARGS_INPUT") {
        replay_cli(Path::new(&one), &mut total);
        println!("{:?}", total.named());
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/cli_args");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("fuzz/corpus/cli_args")
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(files.len() >= 20, "only {} corpus files", files.len());
    for f in &files {
        replay_cli(f, &mut total);
    }
    println!("{} inputs: {:?}", files.len(), total.named());
    for (what, n) in total.named() {
        assert!(
            n > 0,
            "the corpus never reaches {what}: {:?}",
            total.named()
        );
    }
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
