//! `pagedattn serve` as a process: `/health` is 503 while the model loads
//! and 200 once it is ready; SIGTERM stops accepting, gives the
//! stream in flight `--shutdown-timeout` to finish, aborts it with an
//! error event when it does not, and exits 0. Arguments that are wrong
//! fail before anything loads.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use pagedattn_cli::model::config::model_path_or_skip;

fn pagedattn() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pagedattn"))
}

#[test]
fn bad_serve_arguments_fail_before_loading() {
    for (args, want) in [
        (&["--reservation", "greedy"][..], "--reservation \"greedy\""),
        (&["--preemption", "never"], "--preemption \"never\""),
        (&["--host", "0.0.0.0"], "--api-keys"),
        (&["--max-seqs", "0"], "--max-seqs 0"),
        (
            &["--api-keys", "/nonexistent/keys"],
            "--api-keys /nonexistent/keys",
        ),
        (&["--shutdown-timeout", "0"], "--shutdown-timeout 0"),
    ] {
        let out = pagedattn().arg("serve").args(args).output().expect("runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.starts_with("error: ") && err.contains(want),
            "{args:?}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

#[test]
fn sigterm_drains_then_exits_zero() {
    let test = "sigterm_drains_then_exits_zero";
    let Some(model) = model_path_or_skip(test) else {
        return;
    };
    let openai = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !openai {
        if std::env::var_os("CI").is_some()
            || std::env::var_os("PAGEDATTN_REQUIRE_OPENAI").is_some()
        {
            panic!("{test}: no python3 with the openai package");
        }
        eprintln!("{test}: skipped: no python3 with the openai package");
        return;
    }
    let mut server = pagedattn()
        .args(["serve", "--port", "0", "--shutdown-timeout", "3", "--model"])
        .arg(&model)
        .stderr(Stdio::piped())
        .spawn()
        .expect("serve starts");
    // Its lines, read on a thread: the address once ready.
    let (tx, rx) = mpsc::channel::<String>();
    let err = server.stderr.take().expect("piped");
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            eprintln!("serve: {line}");
            let _ = tx.send(line);
        }
    });
    // While the model loads, /health answers 503 (asked with curl, as an
    // orchestrator's probe would).
    let health = |addr: &str| -> String {
        let o = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
            .arg(format!("http://{addr}/health"))
            .output()
            .expect("curl runs");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let mut loading = Vec::new();
    let ready = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(300))
            .expect("the server says it is ready");
        if let Some(rest) = line.split("listening on http://").nth(1) {
            let addr = rest.split_whitespace().next().unwrap_or("").to_string();
            loading.push(health(&addr));
        }
        if let Some(rest) = line.split("ready on http://").nth(1) {
            break rest.split(':').take(2).collect::<Vec<_>>().join(":");
        }
    };
    assert_eq!(loading, ["503"], "/health while loading");
    assert_eq!(health(&ready), "200", "/health once ready");
    let base = format!("http://{ready}");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../server/tests/client.py");
    let mut client = Command::new("python3")
        .args([script, "until-end", "--base", &base])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut out = BufReader::new(client.stdout.take().expect("piped"));
    let mut line = String::new();
    out.read_line(&mut line).expect("reads");
    assert_eq!(line.trim(), "streaming", "{line}");
    // SIGTERM while the 4000-token stream runs.
    let t0 = Instant::now();
    let killed = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    let status = loop {
        if let Some(s) = server.try_wait().expect("waits") {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "still running 30 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = t0.elapsed();
    assert_eq!(status.code(), Some(0), "exit status after SIGTERM");
    let mut rest = String::new();
    out.read_to_string(&mut rest).expect("reads");
    assert!(client.wait().expect("ends").success(), "{rest}");
    // The stream ran on through the 3 s, then ended with an error event
    // saying why, and [DONE].
    assert!(
        rest.contains("ended:") && rest.contains("shutting down"),
        "{rest}"
    );
    assert!(rest.contains("done true"), "{rest}");
    assert!(
        took >= Duration::from_secs(3),
        "stopped after {took:?}, before the timeout"
    );
    let stopped = rx.try_iter().any(|l| l.contains("stopped"));
    assert!(stopped, "the server said it stopped");
}
