//! Two engine processes, each with its own GPU device, share one Redis
//! started here (`redis-server` from Debian): process A serves a prompt and
//! publishes its full blocks; process B, given the same system prompt and
//! its own suffix, imports A's blocks, computes only the rest, and its
//! output equals a cold run's bit for bit and the f64 reference (each peer
//! checks that, `src/bin/kv-peer.rs`). Then the faults: another tenant's
//! salt misses; corrupt and truncated values are refused, deleted and
//! recomputed; a pool of another layout refuses the blocks and recomputes;
//! B given A's whole prompt returns A's output; with Redis killed mid-run
//! (after B's lookup) B finishes and its publish fails with a warning; with
//! Redis down from the start B recomputes with a warning. Without `redis-server`
//! the test skips, unless `PAGEDATTN_REQUIRE_REDIS=1`; without a GPU
//! adapter likewise, unless `PAGEDATTN_REQUIRE_GPU=1`.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Redis {
    child: Child,
    url: String,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn redis() -> Option<Redis> {
    let port = TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"])
        .stdout(Stdio::null())
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => {
            if std::env::var("PAGEDATTN_REQUIRE_REDIS").is_ok_and(|v| v == "1") {
                panic!("PAGEDATTN_REQUIRE_REDIS=1 but redis-server: {e}");
            }
            eprintln!("redis-server: {e}; skipped");
            return None;
        }
    };
    let url = format!("redis://127.0.0.1:{port}/");
    let r = Redis { child, url };
    let t0 = Instant::now();
    loop {
        let ok = redis::Client::open(r.url.as_str())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok();
        if ok {
            return Some(r);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "redis-server did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The key the engines share (Redis never sees it).
const MAC_KEY: &str = "engines-only-key-0123";

/// The store keys of the prompt a peer with `salt` and `suffix_seed` serves.
fn keys_of(url: &str, salt: &str, suffix_seed: u64) -> Vec<String> {
    let o = Command::new(env!("CARGO_BIN_EXE_kv-peer"))
        .args(["--redis", url, "--salt", salt, "--mac-key", MAC_KEY])
        .args([
            "--suffix-seed",
            &suffix_seed.to_string(),
            "--out",
            "-",
            "--keys-only",
            "1",
        ])
        .output()
        .expect("kv-peer runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(String::from)
        .collect()
}

/// What one peer run printed.
#[derive(Debug)]
struct Run {
    imported: usize,
    computed: usize,
    total: usize,
    refused: usize,
    unavailable: bool,
    out: Vec<u8>,
    stderr: String,
}

fn peer(
    url: &str,
    salt: &str,
    suffix_seed: u64,
    dtype: &str,
    dir: &Path,
    tag: &str,
) -> Option<Run> {
    let out = dir.join(format!("{tag}.bin"));
    let o = Command::new(env!("CARGO_BIN_EXE_kv-peer"))
        .args(["--redis", url, "--salt", salt, "--dtype", dtype])
        .args(["--mac-key", MAC_KEY])
        .args(["--suffix-seed", &suffix_seed.to_string(), "--out"])
        .arg(&out)
        .output()
        .expect("kv-peer runs");
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    if o.status.code() == Some(3) {
        if std::env::var("PAGEDATTN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            panic!("PAGEDATTN_REQUIRE_GPU=1 but kv-peer: {stderr}");
        }
        eprintln!("no GPU adapter; skipped");
        return None;
    }
    assert!(
        o.status.success(),
        "{tag}: kv-peer failed ({:?}): {stderr}",
        o.status
    );
    let line = String::from_utf8_lossy(&o.stdout).into_owned();
    parse(tag, &line, &out, stderr)
}

fn parse(tag: &str, stdout: &str, out: &Path, stderr: String) -> Option<Run> {
    let line = stdout.lines().last().unwrap_or("").to_string();
    let w: Vec<&str> = line.split_whitespace().collect();
    let num = |key: &str| -> usize {
        let i = w
            .iter()
            .position(|x| *x == key)
            .unwrap_or_else(|| panic!("{tag}: {line}"));
        w[i + 1].parse().unwrap_or_else(|_| panic!("{tag}: {line}"))
    };
    let run = Run {
        imported: num("imported"),
        computed: num("computed"),
        total: num("of"),
        refused: num("refused"),
        unavailable: num("unavailable") == 1,
        out: std::fs::read(out).unwrap(),
        stderr,
    };
    eprintln!("{tag}: {}", line.trim());
    Some(run)
}

fn corrupt_all(url: &str, f: impl Fn(&mut redis::Connection, &str)) -> usize {
    let mut c = redis::Client::open(url).unwrap().get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("pagedattn:kv:*")
        .query(&mut c)
        .unwrap();
    for k in &keys {
        f(&mut c, k);
    }
    keys.len()
}

#[test]
fn two_processes_share_prefill_through_redis() {
    let Some(r) = redis() else { return };
    let dir = std::env::temp_dir().join(format!("pagedattn-store-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = r.url.clone();

    // A serves its prompt: nothing found, everything computed, published.
    let Some(a) = peer(&url, "tenant-1", 1, "f16", &dir, "A") else {
        return;
    };
    assert_eq!((a.imported, a.computed), (0, a.total));
    // A cold run of B's prompt (no store): the output to match.
    let cold = peer("none", "tenant-1", 2, "f16", &dir, "B cold").unwrap();
    assert_eq!(cold.computed, cold.total);
    // B imports the system prompt's three full blocks, computes the rest.
    let b = peer(&url, "tenant-1", 2, "f16", &dir, "B").unwrap();
    assert_eq!(b.imported, 3, "{b:?}");
    assert_eq!(b.computed, b.total - 48, "B computes only its suffix");
    assert!(b.out == cold.out, "B's output differs from the cold run's");

    // B given A's whole prompt: every full block imported, A's output.
    let same = peer(&url, "tenant-1", 1, "f16", &dir, "B with A's prompt").unwrap();
    assert_eq!(same.imported, a.total / 16);
    assert_eq!(same.computed, a.total - same.imported * 16);
    assert!(same.out == a.out, "B's output differs from A's");

    // Another tenant's salt: a miss.
    let t2 = peer(&url, "tenant-2", 2, "f16", &dir, "B as tenant 2").unwrap();
    assert_eq!((t2.imported, t2.computed), (0, t2.total));
    assert!(t2.out == cold.out);

    // A pool of another layout (f32): the f16 blocks are refused, B
    // recomputes, and matches its own cold run.
    let cold32 = peer("none", "tenant-1", 2, "f32", &dir, "B cold f32").unwrap();
    let b32 = peer(&url, "tenant-1", 2, "f32", &dir, "B f32").unwrap();
    assert_eq!((b32.imported, b32.computed), (0, b32.total));
    assert!(
        b32.refused >= 1 && b32.stderr.contains("import refused"),
        "{}",
        b32.stderr
    );
    assert!(b32.out == cold32.out);

    // Corrupt values (a byte of every block flipped): refused, deleted, recomputed.
    let n = corrupt_all(&url, |c, k| {
        let v: Vec<u8> = redis::cmd("GETRANGE")
            .arg(k)
            .arg(300)
            .arg(300)
            .query(c)
            .unwrap();
        let _: i64 = redis::cmd("SETRANGE")
            .arg(k)
            .arg(300)
            .arg(&[v[0] ^ 0x5a][..])
            .query(c)
            .unwrap();
    });
    assert!(n >= 4, "{n} keys");
    let bc = peer(&url, "tenant-1", 2, "f16", &dir, "B after corruption").unwrap();
    assert_eq!((bc.imported, bc.computed), (0, bc.total));
    assert!(
        bc.refused >= 1 && bc.stderr.contains("tag does not verify"),
        "{}",
        bc.stderr
    );
    assert!(bc.out == cold.out);
    // That run deleted the refused value and published its own: B finds
    // its blocks again.
    let again = peer(&url, "tenant-1", 2, "f16", &dir, "B again").unwrap();
    assert!(again.imported >= 3, "{again:?}");
    assert!(again.out == cold.out);

    // Poisoning across tenants: tenant 1's valid values planted under the
    // keys tenant 2's prompt asks for (as anyone who can write to Redis
    // could, before tenant 2 writes). They do not verify for tenant 2:
    // refused and deleted, tenant 2 computes, and its own blocks then
    // take those keys (its `SET NX` is no longer blocked).
    let (t1, t2) = (keys_of(&url, "tenant-1", 2), keys_of(&url, "tenant-2", 2));
    assert_eq!(t1.len(), t2.len());
    let mut c = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let mut planted = 0;
    for (from, to) in t1.iter().zip(&t2) {
        let v: Option<Vec<u8>> = redis::cmd("GET").arg(from).query(&mut c).unwrap();
        if let Some(v) = v {
            let _: () = redis::cmd("SET").arg(to).arg(v).query(&mut c).unwrap();
            planted += 1;
        }
    }
    assert!(planted >= 3, "{planted} values planted");
    let p2 = peer(&url, "tenant-2", 2, "f16", &dir, "B as tenant 2, poisoned").unwrap();
    assert_eq!((p2.imported, p2.computed), (0, p2.total), "{p2:?}");
    assert!(
        p2.refused >= 1 && p2.stderr.contains("tag does not verify"),
        "{}",
        p2.stderr
    );
    assert!(p2.out == cold.out);
    let p2b = peer(&url, "tenant-2", 2, "f16", &dir, "B as tenant 2, after").unwrap();
    assert!(p2b.imported >= 3 && p2b.refused == 0, "{p2b:?}");
    assert!(p2b.out == cold.out);

    // Truncated values: refused, recomputed.
    corrupt_all(&url, |c, k| {
        let len: i64 = redis::cmd("STRLEN").arg(k).query(c).unwrap();
        let v: Vec<u8> = redis::cmd("GETRANGE")
            .arg(k)
            .arg(0)
            .arg(len - 65)
            .query(c)
            .unwrap();
        let _: () = redis::cmd("SET").arg(k).arg(v).query(c).unwrap();
    });
    let bt = peer(&url, "tenant-1", 2, "f16", &dir, "B after truncation").unwrap();
    assert_eq!((bt.imported, bt.computed), (0, bt.total));
    assert!(bt.refused >= 1);
    assert!(bt.out == cold.out);

    // Redis killed mid-run, after B's lookup and before it publishes: B
    // finishes with its imported blocks, the publish fails with a warning.
    let out = dir.join("mid.bin");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kv-peer"))
        .args([
            "--mac-key",
            MAC_KEY,
            "--redis",
            &url,
            "--salt",
            "tenant-1",
            "--dtype",
            "f16",
            "--suffix-seed",
            "3",
        ])
        .args(["--pause-ms", "1500", "--out"])
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kv-peer runs");
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("piped"));
    let mut first = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut first).unwrap();
    assert_eq!(first.trim(), "looked-up", "{first}");
    drop(r);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("piped"), &mut stderr).unwrap();
    assert!(child.wait().unwrap().success(), "{stderr}");
    let mid = parse("B with Redis killed mid-run", &rest, &out, stderr).unwrap();
    assert_eq!(mid.imported, 3, "{mid:?}");
    assert!(
        mid.stderr.contains("publishing a block failed"),
        "{}",
        mid.stderr
    );
    let cold3 = peer("none", "tenant-1", 3, "f16", &dir, "B3 cold").unwrap();
    assert!(mid.out == cold3.out);

    // Redis down from the start: B recomputes, with a warning.
    let down = peer(&url, "tenant-1", 2, "f16", &dir, "B with Redis down").unwrap();
    assert!(down.unavailable, "{down:?}");
    assert_eq!((down.imported, down.computed), (0, down.total));
    assert!(
        down.stderr.contains("warning: pagedattn-store"),
        "{}",
        down.stderr
    );
    assert!(down.out == cold.out);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A hybrid model's layer groups share chain digests: each group's block
/// has its own key, a fetch of one group returns that group's bytes, and a
/// value copied from another group's key (its tag verifies) is refused,
/// deleted, and ends the hit.
#[test]
fn layer_groups_keep_their_own_blocks_in_redis() {
    use pagedattn::gpu::{KvDtype, KvLayout, KV_LAYOUT_VERSION};
    use pagedattn_store::{RedisPrefixStore, StoreConfig, ValueError};
    let Some(r) = redis() else { return };
    let cfg = StoreConfig {
        key_prefix: "groups:".into(),
        mac_key: MAC_KEY.as_bytes().to_vec(),
        ..StoreConfig::default()
    };
    let mut store = RedisPrefixStore::open(&r.url, cfg).expect("store");
    let layout = |g: u16| KvLayout {
        version: KV_LAYOUT_VERSION,
        library: [0, 1, 0],
        dtype: KvDtype::F16,
        block_size: 4,
        num_kv_heads: 1,
        head_dim: 4,
        layer_group: g,
        layers: 0..2,
        parts: [32, 0, 32, 0],
        layer_state: [0; 32],
    };
    let (salt, hash) = (b"tenant".as_slice(), [7u8; 32]);
    let bytes = |g: u8| vec![g + 1; 128];
    assert_ne!(
        store.group_key(salt, &hash, 0),
        store.group_key(salt, &hash, 1)
    );
    assert_eq!(store.group_key(salt, &hash, 0), store.key(salt, &hash));
    for g in 0..2u16 {
        assert!(store
            .put(salt, &hash, &layout(g), &bytes(g as u8))
            .expect("put"));
    }
    for g in 0..2u16 {
        let f = store.fetch_group_prefix(salt, &[hash], g);
        assert_eq!(f.blocks.len(), 1, "group {g}");
        assert_eq!(f.blocks[0].layout.layer_group, g);
        assert_eq!(f.blocks[0].bytes, bytes(g as u8));
    }
    // Group 0's value planted under group 1's key.
    let mut c = redis::Client::open(r.url.as_str())
        .and_then(|c| c.get_connection())
        .expect("redis");
    let v: Vec<u8> = redis::cmd("GET")
        .arg(store.group_key(salt, &hash, 0))
        .query(&mut c)
        .expect("get");
    let () = redis::cmd("SET")
        .arg(store.group_key(salt, &hash, 1))
        .arg(v)
        .query(&mut c)
        .expect("set");
    let f = store.fetch_group_prefix(salt, &[hash], 1);
    assert!(f.blocks.is_empty());
    assert!(
        matches!(f.refused[..], [ValueError::WrongGroup { got: 0, want: 1 }]),
        "{:?}",
        f.refused
    );
    let gone: i64 = redis::cmd("EXISTS")
        .arg(store.group_key(salt, &hash, 1))
        .query(&mut c)
        .expect("exists");
    assert_eq!(gone, 0, "the refused value is deleted");
}
