//! Replays the fuzz corpora of the GPU layer's host-side argument checks
//! (test-support/src/gpu_args.rs) and of what crosses into a pool from
//! elsewhere: descriptors, import payloads, copy lists
//! (test-support/src/transfer_args.rs), on stable Rust, through the same
//! harnesses as the fuzz targets: every input must pass, and together they
//! must reach every outcome (accepted and refused, for each check). Then
//! seeded random inputs, deterministic so a failure replays
//! (`GPU_ARGS_INPUT=<file>` replays one gpu_args file).

use crate::gpu_args;

use std::path::Path;

use gpu_args::harness::{assert_reached, caught, corpus_files};
use gpu_args::Reached;
use pagedattn::rng::SplitMix64;

#[test]
fn gpu_args_corpus_passes_and_reaches_every_outcome() {
    let mut total = Reached::default();
    if let Ok(one) = std::env::var("GPU_ARGS_INPUT") {
        let data = std::fs::read(&one).unwrap();
        total.add(&caught(&one, || gpu_args::run(&data)));
        println!("{:?}", total.named());
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/gpu_args");
    let files = corpus_files(&dir, 20);
    for f in &files {
        let data = std::fs::read(f).unwrap();
        total.add(&caught(&f.display().to_string(), || gpu_args::run(&data)));
    }
    println!("{} inputs: {:?}", files.len(), total.named());
    assert_reached(&total.named(), "the corpus", &[]);
}

#[test]
fn gpu_args_random_inputs_keep_the_contracts() {
    let seed = std::env::var("PAGEDATTN_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x6A7A_A265u64);
    let mut rng = SplitMix64::new(seed);
    let mut total = Reached::default();
    for i in 0..3000 {
        let len = rng.range(1, 400) as usize;
        let data: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
        let what = format!("random input {i} (seed {seed}; PAGEDATTN_SEED replays)");
        match std::panic::catch_unwind(|| gpu_args::run(&data)) {
            Ok(r) => total.add(&r),
            Err(_) => {
                let path = std::env::temp_dir().join(format!("gpu_args_random_{i}"));
                let _ = std::fs::write(&path, &data);
                panic!(
                    "{what} failed; saved to {} (GPU_ARGS_INPUT replays)",
                    path.display()
                );
            }
        }
    }
    println!("{:?}", total.named());
    assert_reached(&total.named(), &format!("random inputs (seed {seed})"), &[]);
}

use crate::calibration;

/// The calibration checks' corpus (`fuzz/corpus/calibration/`) and seeded
/// random inputs through the fuzz target's harness
/// (test-support/src/calibration.rs): each check accepts exactly what its
/// contract states, and calibrated values always pass. Together they must
/// reach every outcome. `CALIBRATION_INPUT=<file>` replays one file.
#[test]
fn calibration_corpus_and_random_inputs_keep_the_contracts() {
    let run = |data: &[u8], what: &str, total: &mut calibration::Reached| {
        total.add(&caught(what, || calibration::run(data)))
    };
    let mut total = calibration::Reached::default();
    if let Ok(one) = std::env::var("CALIBRATION_INPUT") {
        run(&std::fs::read(&one).unwrap(), &one, &mut total);
        println!("{:?}", total.named());
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/calibration");
    for f in &corpus_files(&dir, 10) {
        run(
            &std::fs::read(f).unwrap(),
            &f.display().to_string(),
            &mut total,
        );
    }
    assert_reached(&total.named(), "the corpus", &[]);
    let seed = std::env::var("PAGEDATTN_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0xCA1Bu64);
    let mut rng = SplitMix64::new(seed);
    let mut random = calibration::Reached::default();
    for i in 0..3000 {
        let len = rng.range(1, 300) as usize;
        let data: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
        run(
            &data,
            &format!("random input {i} (seed {seed})"),
            &mut random,
        );
    }
    assert_reached(
        &random.named(),
        &format!("random inputs (seed {seed})"),
        &[],
    );
    println!("corpus {:?}; random {:?}", total.named(), random.named());
}

#[test]
fn transfer_args_corpus_passes_and_reaches_every_outcome() {
    use crate::transfer_args;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/transfer_args");
    let files = corpus_files(&dir, 20);
    let mut total = transfer_args::Reached::default();
    for f in &files {
        let data = std::fs::read(f).unwrap();
        total.add(&caught(&f.display().to_string(), || {
            transfer_args::run(&data)
        }));
    }
    println!("{} inputs: {:?}", files.len(), total.named());
    assert_reached(&total.named(), "the corpus", &[]);
}

#[test]
fn transfer_args_random_inputs_keep_the_contracts() {
    use crate::transfer_args;
    let seed = std::env::var("PAGEDATTN_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x7A45_F3E4u64);
    let mut rng = SplitMix64::new(seed);
    let mut total = transfer_args::Reached::default();
    for i in 0..3000 {
        let len = rng.range(1, 200) as usize;
        let data: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
        let what = format!("random input {i} (seed {seed}; PAGEDATTN_SEED replays)");
        total.add(&caught(&what, || transfer_args::run(&data)));
    }
    println!("{:?}", total.named());
    assert_reached(&total.named(), &format!("random inputs (seed {seed})"), &[]);
}
