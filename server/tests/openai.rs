//! `pagedattn serve` against the official `openai` Python client (pinned
//! and installed by `.ci/run`), driven by `client.py` beside this file:
//!
//! - a server with two tenants: completions and chat, whole and streamed;
//!   greedy tokens (prompts as token ids), samples and beams equal to the
//!   llama.cpp fixture's; logprobs; stop strings and ids; penalties; echo;
//!   the prompt's blocks shared by n = 4 samples in /metrics; one tenant's
//!   cached prompt never a hit for the other; the bad-input matrix; a
//!   stream cut mid-way aborted within a step while another is unchanged;
//! - a small pool: 200 concurrent streams all finish with the fixture's
//!   tokens and leave no block held; a stream queued behind them gets
//!   keep-alive comments; past the server's limit, 429 with Retry-After.
//!
//! Skips, saying so, without the model, an adapter or Python's `openai`;
//! fails instead with `PAGEDATTN_REQUIRE_MODEL` / `PAGEDATTN_REQUIRE_GPU` /
//! `PAGEDATTN_REQUIRE_OPENAI` (CI sets them all).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use pagedattn_model::config::model_path_or_skip;
use pagedattn_server::{ApiKeys, Handle, ServeConfig};

fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1") || std::env::var_os("CI").is_some()
}

/// Whether `python3` can import `openai`; `false` (the test skips, saying
/// so) unless required.
fn openai_client(test: &str) -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        let msg = "python3 with the openai package (pip install openai==3.63.0)";
        if required("PAGEDATTN_REQUIRE_OPENAI") {
            panic!("{test}: PAGEDATTN_REQUIRE_OPENAI is set but there is no {msg}");
        }
        eprintln!("{test}: skipped: no {msg}");
    }
    ok
}

/// A server for `cfg`, or `None` (skipped) where there is no adapter and
/// none is required.
fn start(test: &str, cfg: ServeConfig) -> Option<Handle> {
    match Handle::start(cfg) {
        Ok(h) => Some(h),
        Err(e)
            if e.to_string().contains("no GPU adapter") && !required("PAGEDATTN_REQUIRE_GPU") =>
        {
            eprintln!("{test}: skipped: {e}");
            None
        }
        Err(e) => panic!("{test}: the server did not start: {e}"),
    }
}

fn here(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(file)
}

/// Runs `client.py` with `args`, echoing its lines; panics on failure.
fn client(test: &str, args: &[String]) {
    let mut child = Command::new("python3")
        .arg(here("tests/client.py"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3 runs");
    let out = child.stdout.take().expect("piped");
    let mut failed = None;
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        eprintln!("{test}: {line}");
        if line.starts_with("FAILED") {
            failed = Some(line);
        }
    }
    let status = child.wait().expect("python3 ends");
    assert!(
        status.success() && failed.is_none(),
        "{test}: {failed:?} ({status})"
    );
}

fn fixture() -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixture/reference.json");
    p.to_string_lossy().into_owned()
}

#[test]
fn the_openai_client_against_a_server_with_two_tenants() {
    let test = "the_openai_client_against_a_server_with_two_tenants";
    let Some(model) = model_path_or_skip(test) else {
        return;
    };
    if !openai_client(test) {
        return;
    }
    let (a, b) = ("sk-test-alice-1", "sk-test-bob-22");
    let keys = ApiKeys::parse(&format!("{a} alice\n{b} bob\n")).expect("keys");
    let cfg = ServeConfig {
        model,
        port: 0,
        api_keys: Some(keys),
        ..ServeConfig::default()
    };
    let Some(h) = start(test, cfg) else { return };
    let base = format!("http://{}", h.addr);
    let args = [
        "main",
        "--base",
        &base,
        "--key-a",
        a,
        "--key-b",
        b,
        "--fixture",
        &fixture(),
    ];
    client(test, &args.map(String::from));
    h.stop().expect("a clean stop");
}

#[test]
fn two_hundred_streams_on_a_small_pool() {
    let test = "two_hundred_streams_on_a_small_pool";
    let Some(model) = model_path_or_skip(test) else {
        return;
    };
    if !openai_client(test) {
        return;
    }
    // 48 blocks of 16 tokens: room for about 12 of the 56-token streams
    // at once; 16 sequences a step; 200 held beyond them.
    let cfg = ServeConfig {
        model,
        port: 0,
        num_blocks: 48,
        max_seqs: 16,
        max_queue: 200,
        keep_alive: std::time::Duration::from_secs(1),
        ..ServeConfig::default()
    };
    let limit = (cfg.max_seqs + cfg.max_queue).to_string();
    let Some(h) = start(test, cfg) else { return };
    let base = format!("http://{}", h.addr);
    let args = [
        "load",
        "--base",
        &base,
        "--fixture",
        &fixture(),
        "--streams",
        "200",
        "--limit",
        &limit,
    ];
    client(test, &args.map(String::from));
    h.stop().expect("a clean stop");
}
