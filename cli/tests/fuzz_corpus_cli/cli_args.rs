//! The command-line fuzz harness: bytes -> argv -> the binary's own parser
//! and checks (`pagedattn_cli::args`) ->
//! a bounded run of whatever needs no adapter. Shared by the fuzz target
//! (fuzz/fuzz_targets/cli_args.rs) and its stable replay
//! (cli/tests/fuzz_corpus_cli.rs).
//!
//! Input format: argv words (after the program name) separated by NUL or
//! newline bytes; a trailing separator is ignored, empty words are kept,
//! and words need not be UTF-8.
//!
//! What must hold, for every input:
//! - nothing panics (in the fuzz build, with overflow checks);
//! - a usage error or a failed check is one `error: ...` line, exit code 2;
//! - help and version go to stdout with exit code 0;
//! - a checked demo or bench configuration passes the library's own
//!   validation, and a checked simulation runs: it is clamped to a few
//!   small requests first so that each input stays cheap, and then every
//!   request finishes, nothing leaks, and the table, JSON and SVG hold no
//!   NaN or infinity. A request too large for the budget is a clean error.
//!   The demo and the bench need an adapter and are not run.

use std::ffi::OsString;

use pagedattn_cli::args::{self as cli, Checked, Parsed};
use pagedattn_cli::sim::{simulate, Sampling, SimError};

#[allow(unused_imports)]
pub use pagedattn_test_support::harness;
use pagedattn_test_support::tally;

tally! {
    /// Which ways an input went, counted over a corpus.
    pub struct Outcome: u64 {
        inputs: "inputs",
        help: "help or version",
        usage_errors: "usage errors",
        check_errors: "failed checks",
        demo: "checked demos",
        bench: "checked benches",
        generate: "checked generates",
        serve: "checked serves and load generators",
        sim_runs: "simulations run",
        sim_too_small: "requests too large for the budget",
    }
}

/// The argv the harness parses: the program name, then the input's words.
pub fn argv(data: &[u8]) -> Vec<OsString> {
    let data = match data.last() {
        Some(b'\n' | 0) => &data[..data.len() - 1],
        _ => data,
    };
    let mut v = vec![OsString::from("pagedattn")];
    if data.is_empty() {
        return v;
    }
    for w in data.split(|&b| b == 0 || b == b'\n') {
        #[cfg(unix)]
        v.push(std::os::unix::ffi::OsStringExt::from_vec(w.to_vec()));
        #[cfg(not(unix))]
        v.push(OsString::from(String::from_utf8_lossy(w).into_owned()));
    }
    v
}

fn one_error_line(line: &str, argv: &[OsString]) {
    assert!(
        line.starts_with("error: ") && !line.contains('\n') && line.len() > 7,
        "not one error line for {argv:?}: {line:?}"
    );
}

/// Parses, checks and (bounded) runs one input; panics on a broken rule.
pub fn run(data: &[u8]) -> Outcome {
    let argv = argv(data);
    let mut o = Outcome {
        inputs: 1,
        ..Default::default()
    };
    let parsed = cli::parse(argv.clone());
    let c = match parsed {
        Parsed::Exit { text, stdout, code } => {
            if stdout {
                assert_eq!(code, 0, "{argv:?}");
                assert!(!text.is_empty(), "{argv:?}");
                o.help += 1;
            } else {
                assert_eq!(code, cli::EXIT_USAGE, "{argv:?}");
                one_error_line(&text, &argv);
                o.usage_errors += 1;
            }
            return o;
        }
        Parsed::Run(c) => c,
    };
    match cli::check(c) {
        Err(msg) => {
            one_error_line(&cli::error_line(&msg), &argv);
            o.check_errors += 1;
        }
        Ok(Checked::Demo { cfg, .. }) => {
            cfg.validate()
                .unwrap_or_else(|e| panic!("{argv:?}: checked demo fails validate: {e}"));
            assert!(cfg.requests >= 1 && cfg.samples >= 1, "{argv:?}");
            assert!(
                cfg.mirror_bytes() <= pagedattn_cli::demo::MAX_MIRROR_BYTES as u128,
                "{argv:?}"
            );
            o.demo += 1;
        }
        Ok(Checked::Bench { cfg, .. }) => {
            cfg.validate()
                .unwrap_or_else(|e| panic!("{argv:?}: checked bench fails validate: {e}"));
            assert!(cfg.max_seconds.is_finite() && cfg.max_seconds >= 0.0);
            o.bench += 1;
        }
        // Need an adapter: checked, not run (nothing to bound: no sizes).
        Ok(Checked::Sweep { .. } | Checked::PipelineStats { .. }) => {
            o.bench += 1;
        }
        // Need the model and an adapter: checked (the config passes its
        // own check), not run.
        Ok(Checked::Serve { cfg }) => {
            cfg.check()
                .unwrap_or_else(|e| panic!("{argv:?}: checked serve fails check: {e}"));
            o.serve += 1;
        }
        Ok(Checked::Loadgen { server, spec, .. }) => {
            server
                .check()
                .unwrap_or_else(|e| panic!("{argv:?}: checked loadgen fails check: {e}"));
            assert!(spec.requests >= 1 && spec.slo > 0.0, "{argv:?}");
            o.serve += 1;
        }
        Ok(Checked::Generate { opts }) => {
            // Needs the model and an adapter: checked, not run.
            pagedattn_cli::model::generate::check(&opts)
                .unwrap_or_else(|e| panic!("{argv:?}: checked generate fails check: {e}"));
            o.generate += 1;
        }
        Ok(Checked::Simulate { cfg, args }) => {
            assert!(args.requests >= 1);
            // The full configuration is valid and bounded; run a cut-down
            // copy of it so that every input stays cheap.
            let mut c = cfg.clone();
            let w = &mut c.workload;
            w.requests = w.requests.min(6);
            w.max_len = w.max_len.min(128);
            w.shared_prefix = w.shared_prefix.min(w.max_len - 2);
            c.budget = c.budget.min(4096);
            c.block_sizes.truncate(3);
            c.policies.truncate(3);
            c.sampling.truncate(3);
            for s in &mut c.sampling {
                *s = match *s {
                    Sampling::Parallel(n) => Sampling::Parallel(n.min(6)),
                    Sampling::Beam(k) => Sampling::Beam(k.min(6)),
                };
            }
            c.check()
                .unwrap_or_else(|e| panic!("{argv:?}: the cut-down config fails: {e}"));
            match simulate(&c) {
                Ok(r) => {
                    for sc in &r.scenarios {
                        for p in &sc.policies {
                            assert_eq!(p.requests_finished, c.workload.requests, "{argv:?}");
                            assert_eq!(p.leaked_tokens, 0, "{argv:?} {}", p.label);
                        }
                    }
                    let (table, json, svg) = (r.table(), r.to_json(), r.svg());
                    for (what, text) in [("table", &table), ("json", &json), ("svg", &svg)] {
                        assert!(
                            !text.contains("NaN") && !text.contains("inf"),
                            "{argv:?}: NaN or inf in the {what}"
                        );
                    }
                    o.sim_runs += 1;
                }
                Err(SimError::TooSmall { .. }) => o.sim_too_small += 1,
                Err(e) => panic!("{argv:?}: {e}"),
            }
        }
    }
    o
}
