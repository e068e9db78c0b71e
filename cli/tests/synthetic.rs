//! `--synthetic ARCH [--layers N]` from the command line: `bench --only
//! model`, `serve` and `loadgen` run a model built from a seed in memory
//! (no GGUF file), and bad values are usage errors (one `error:` line,
//! exit code 2) before anything is built. The runs skip without an adapter
//! (fail with `PAGEDATTN_REQUIRE_GPU=1`).

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use pagedattn_test_support::common;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pagedattn"));
    // Without it the Vulkan loader may print lines of its own on stderr.
    let xdg = std::env::temp_dir().join(format!("pagedattn-synth-xdg-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&xdg);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&xdg, std::fs::Permissions::from_mode(0o700));
    }
    c.env("XDG_RUNTIME_DIR", xdg);
    c
}

/// Waits for `child`, killing it (and failing) after `limit`.
fn wait(mut child: Child, limit: Duration, what: &str) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            return st;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("`pagedattn {what}` still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs the binary with `args` within `limit`, stdout and stderr captured.
fn run_for(args: &[&str], limit: Duration) -> Output {
    let mut child = bin()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pagedattn");
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = so.read_to_end(&mut v);
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = se.read_to_end(&mut v);
        v
    });
    let status = wait(child, limit, &args.join(" "));
    Output {
        status,
        stdout: t_out.join().unwrap(),
        stderr: t_err.join().unwrap(),
    }
}

/// Exit code 2 and one `error:` line holding every one of `needles`.
fn assert_usage_error(args: &[&str], needles: &[&str]) {
    let out = run_for(args, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    let cmd = format!("pagedattn {}", args.join(" "));
    assert_eq!(out.status.code(), Some(2), "{cmd}: {err:?}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{cmd}: not one stderr line: {err:?}");
    assert!(lines[0].starts_with("error: "), "{cmd}: {err:?}");
    for n in needles {
        assert!(lines[0].contains(n), "{cmd}: {n:?} not in {err:?}");
    }
}

#[test]
fn synthetic_arguments_are_usage_errors() {
    let only = ["bench", "--only", "model"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        only.iter().chain(extra).copied().collect()
    };
    assert_usage_error(
        &with(&["--synthetic", "nope"]),
        &["nope", "smollm2-135m, gemma3-270m, llama3-8b, qwen3-8b"],
    );
    assert_usage_error(
        &with(&["--synthetic", "smollm2-135m", "--layers", "0"]),
        &["--layers 0", "1..=30"],
    );
    assert_usage_error(
        &with(&["--synthetic", "llama3-8b", "--layers", "33"]),
        &["--layers 33", "1..=32", "llama3-8b has 32 layers"],
    );
    assert_usage_error(&with(&["--layers", "2"]), &["--synthetic"]);
    assert_usage_error(&["bench", "--synthetic", "gemma3-270m"], &["--only model"]);
    assert_usage_error(
        &["serve", "--synthetic", "qwen3-8b", "--model", "x.gguf"],
        &["--synthetic", "--model"],
    );
    assert_usage_error(
        &["serve", "--synthetic", "qwen3-8b", "--layers", "37"],
        &["1..=36"],
    );
    assert_usage_error(
        &["loadgen", "--synthetic", "gemma3-270m", "--layers", "19"],
        &["1..=18"],
    );
    assert_usage_error(
        &[
            "loadgen",
            "--synthetic",
            "gemma3-270m",
            "--base",
            "http://127.0.0.1:9",
        ],
        &["--base"],
    );
    assert_usage_error(&["generate", "--synthetic", "llama"], &["\"llama\""]);
}

fn have_adapter() -> bool {
    common::gpu().is_some()
}

/// `bench --only model --synthetic smollm2-135m --layers 2 --quick` prints
/// the model section's figures for the synthetic model.
#[test]
fn bench_runs_a_synthetic_model() {
    if !have_adapter() {
        return;
    }
    let args = [
        "bench",
        "--only",
        "model",
        "--synthetic",
        "smollm2-135m",
        "--layers",
        "2",
        "--quick",
    ];
    let out = run_for(&args, Duration::from_secs(600));
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{text}\n{err}");
    eprintln!("{text}");
    assert!(
        text.contains("model: synthetic smollm2-135m (2 of 30 layers, seed 0)"),
        "{text}"
    );
    assert!(text.contains("prefill ("), "{text}");
    // The decode rows: batch, tokens/s, ms/step, each positive.
    let rows: Vec<Vec<f64>> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<f64> = l
                .split_whitespace()
                .take(3)
                .map_while(|w| w.parse().ok())
                .collect();
            (f.len() == 3).then_some(f)
        })
        .collect();
    let batches: Vec<f64> = rows.iter().map(|r| r[0]).collect();
    assert!(
        batches.len() >= 3 && batches[..3] == [1.0, 8.0, 32.0],
        "{text}"
    );
    assert!(rows.iter().all(|r| r[1] > 0.0 && r[2] > 0.0), "{text}");
}

/// `serve --synthetic` names the model `synthetic-<arch>` and answers a
/// chat request (no chat template: ChatML); `loadgen --synthetic` starts
/// its own server on the synthetic model and completes its requests.
#[test]
fn serve_and_loadgen_run_a_synthetic_model() {
    if !have_adapter() {
        return;
    }
    let mut server = bin()
        .args([
            "serve",
            "--port",
            "0",
            "--synthetic",
            "smollm2-135m",
            "--layers",
            "2",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .expect("serve starts");
    let (tx, rx) = mpsc::channel::<String>();
    let err = server.stderr.take().expect("piped");
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            eprintln!("serve: {line}");
            let _ = tx.send(line);
        }
    });
    let addr = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(300))
            .expect("the server says it is ready");
        if let Some(rest) = line.split("ready on http://").nth(1) {
            break rest.split(':').take(2).collect::<Vec<_>>().join(":");
        }
    };
    let curl = |path: &str, body: Option<&str>| -> String {
        let mut c = Command::new("curl");
        c.args(["-s", "--max-time", "120"]);
        if let Some(b) = body {
            c.args(["-H", "content-type: application/json", "-d", b]);
        }
        let o = c
            .arg(format!("http://{addr}{path}"))
            .output()
            .expect("curl runs");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let models = curl("/v1/models", None);
    let chat = curl(
        "/v1/chat/completions",
        Some(r#"{"messages":[{"role":"user","content":"Hello"}],"max_tokens":4}"#),
    );
    let _ = server.kill();
    let _ = server.wait();
    assert!(models.contains("\"synthetic-smollm2-135m\""), "{models}");
    let v: serde_json::Value = serde_json::from_str(&chat).expect("JSON");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{chat}");
    assert_eq!(v["model"], "synthetic-smollm2-135m", "{chat}");

    let args = [
        "loadgen",
        "--synthetic",
        "smollm2-135m",
        "--layers",
        "2",
        "--requests",
        "4",
        "--concurrency",
        "4",
        "--scale",
        "16",
        "--max-model-len",
        "256",
    ];
    let out = run_for(&args, Duration::from_secs(300));
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{text}\n{err}");
    assert!(text.contains("4 sent, 4 completed, 0 failed"), "{text}");
}
