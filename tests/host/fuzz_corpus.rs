//! Replays the block-manager fuzz corpus on stable Rust, through the same
//! interpreter and checker as the fuzz target (test-support/src/block_ops.rs).
//!
//! `fuzz/corpus/block_manager/` holds a minimised set of inputs that
//! libFuzzer found interesting (each covered code the others did not), plus
//! any input that once broke an invariant. Every one must pass, and together
//! they must still reach every outcome the checker counts, so a change to the
//! input format that silently empties the corpus's meaning fails here.
//! `BLOCK_OPS_INPUT=<file>` replays one file (with the failing call's
//! history printed on failure).

use crate::block_ops;

use std::path::{Path, PathBuf};

use block_ops::harness::{assert_reached, caught, corpus_files};
use block_ops::Coverage;
use pagedattn::rng::SplitMix64;

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/block_manager")
}

/// A block awaiting a copy is a copy-on-write source: the partly filled
/// last block of a sequence. The prefix cache holds only full blocks, and
/// filling a shared block copies it first, so no run has found a cached
/// block that awaits a copy (the manager handles it anyway, and so does the
/// checker).
const UNREACHED: [&str; 1] = ["revivals of blocks awaiting a copy"];

fn replay(path: &Path, total: &mut Coverage) {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let what = format!("corpus input {}", path.display());
    total.add(&caught(&what, || block_ops::run(&data)));
}

#[test]
fn committed_corpus_passes_and_covers_every_outcome() {
    let mut total = Coverage::default();
    if let Ok(one) = std::env::var("BLOCK_OPS_INPUT") {
        replay(Path::new(&one), &mut total);
        println!("{:?}", total.named());
        return;
    }
    let files = corpus_files(&corpus_dir(), 20);
    for f in &files {
        replay(f, &mut total);
    }
    println!("{} inputs: {:?}", files.len(), total.named());
    assert_reached(&total.named(), "the corpus", &UNREACHED);
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
        total.ops > 10_000
            && total.views > 500
            && total.cow > 20
            && total.swapped_out > 0
            && total.swapped_in > 0
            && total.chunked > 0,
        "{:?}",
        total.named()
    );
}

/// Adds to the corpus seeded random inputs that reach outcomes the corpus
/// misses (after a change of the input format or new operations). Run by
/// hand: `cargo test --test fuzz_corpus grow_corpus -- --ignored`.
#[test]
#[ignore = "writes fuzz/corpus/block_manager; run by hand"]
fn grow_corpus() {
    let mut total = Coverage::default();
    for e in std::fs::read_dir(corpus_dir()).unwrap() {
        let p = e.unwrap().path();
        total.add(&block_ops::run(&std::fs::read(&p).unwrap()));
    }
    let mut rng = SplitMix64::new(0x6E0_C0DE);
    let mut added = 0;
    for i in 0..20_000 {
        let missing: Vec<&str> = total
            .named()
            .into_iter()
            .filter(|&(w, n)| n == 0 && !UNREACHED.contains(&w))
            .map(|(w, _)| w)
            .collect();
        if missing.is_empty() {
            break;
        }
        let len = rng.range(16, 600) as usize;
        let mut data: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
        data[0] %= 0xF8;
        data[1] = data[1].clamp(1, 0xFE);
        let c = block_ops::run(&data);
        let gains = c
            .named()
            .into_iter()
            .any(|(w, n)| n > 0 && missing.contains(&w));
        if gains {
            let path = corpus_dir().join(format!("grown-{i:05}"));
            std::fs::write(&path, &data).unwrap();
            total.add(&c);
            added += 1;
        }
    }
    println!("added {added}: {:?}", total.named());
}
