//! A shared prefix store for pagedattn's KV blocks on Redis or Valkey: the
//! full, immutable blocks an engine's block manager reports stored
//! (`KvEvent::Stored`), exported with their `KvLayout`
//! (`KvCache::export_blocks`), and found again by any engine that shares
//! the prompt's prefix and tenant (`BlockManager::prompt_hashes`, then
//! `add_sequence_with_remote` and `KvCache::import_blocks`).
//!
//! - **Trust.** The engines are trusted and share a MAC key
//!   ([`StoreConfig::mac_key`]); Redis, the network and whoever else can
//!   write to Redis are not. Every value carries an HMAC-SHA256, under that
//!   key, of the tenant's salt, the chain digest it claims to hold, its
//!   descriptor and its bytes: a value planted under a key, copied from
//!   another tenant's or another block's key, corrupted or truncated does
//!   not verify, is refused as a miss (and deleted), and that sequence
//!   recomputes. Redis can still withhold or delete values (a miss), and
//!   read them: the store keeps KV from tampering, not from view.
//! - **Keys**: `{prefix}{salt digest}:{chain digest}`, both hex; give
//!   each model and pool layout its own prefix (an engine of another
//!   layout finds the blocks, and its import refuses them). The salt's
//!   digest in the key lets one tenant's blocks be listed or dropped by
//!   pattern.
//! - **Values**: the 108-byte layout descriptor, the 32-byte tag, then the
//!   block's bytes. Reads check each value's size on the server first (one
//!   script: `STRLEN`, then `GET` only under the limit), so an oversized
//!   value is never downloaded.
//! - **Writes** are `SET .. NX EX ttl`: a block is written once, when it is
//!   full, and expires after the TTL. The memory bound is the server's
//!   `maxmemory` with an LRU policy ([`RedisPrefixStore::bound_memory`]
//!   sets both on a server the engine owns).
//! - **Failures degrade**: a store that is down, slow or trickling is a
//!   miss, with a warning on stderr; nothing panics, and no call (connect
//!   and reply together) takes longer than [`StoreConfig::timeout`].
//!
//! Redis Cluster or Valkey is what a deployment grows into: the commands
//! are plain `GET`/`SET`/`DEL` on one key each and one read-only script
//! over a sequence's keys (with a cluster, give the keys a hash tag through
//! the prefix). The calls block the calling thread (they run on a runtime
//! of the store's own): do not call them from inside an async runtime.

use std::time::Duration;

use hmac::{Hmac, Mac};
use pagedattn::gpu::{KvLayout, TransferError, KV_LAYOUT_BYTES};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// The shortest MAC key accepted, in bytes.
pub const MIN_MAC_KEY: usize = 16;

/// How the store names, keeps and bounds what it writes.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Key prefix (a namespace per deployment or model).
    pub key_prefix: String,
    /// Seconds a block lives in the store.
    pub ttl_secs: u64,
    /// The most one call takes, connecting included.
    pub timeout: Duration,
    /// Largest value written or read; larger ones are refused, and never
    /// downloaded.
    pub max_value_bytes: usize,
    /// The key every value's tag is made with: shared by the engines,
    /// never sent to Redis; at least [`MIN_MAC_KEY`] bytes.
    pub mac_key: Vec<u8>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            key_prefix: "pagedattn:kv:".into(),
            ttl_secs: 3600,
            timeout: Duration::from_secs(2),
            max_value_bytes: 64 << 20,
            mac_key: Vec::new(),
        }
    }
}

/// Why a store call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The server could not be reached or answered with an error.
    #[error("redis: {0}")]
    Redis(String),
    /// The call did not finish within the timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// A configuration the store cannot run with.
    #[error("{0}")]
    Config(String),
    /// A value that is not a block this library wrote.
    #[error("refused value: {0}")]
    Value(ValueError),
}

/// Why a stored value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ValueError {
    /// Shorter than a descriptor and digest.
    #[error("{0} bytes: shorter than a descriptor and its digest")]
    Short(usize),
    /// Over [`StoreConfig::max_value_bytes`].
    #[error("{got} bytes: over the limit of {limit}")]
    TooLarge {
        /// The value's bytes.
        got: usize,
        /// The limit.
        limit: usize,
    },
    /// The tag does not verify: corrupt, truncated, planted without the
    /// key, or stored under another tenant's or block's key.
    #[error("its tag does not verify (corrupt, truncated, planted, or stored under another tenant's or block's key)")]
    Tag,
    /// The descriptor is not one (or of another version).
    #[error("{0}")]
    Descriptor(TransferError),
    /// A block of another layer group than the key's (a value copied from
    /// another group's key: its tag verifies, its descriptor names the
    /// group it came from).
    #[error("a block of layer group {got} under layer group {want}'s key")]
    WrongGroup {
        /// The group its descriptor names.
        got: u16,
        /// The key's group.
        want: u16,
    },
    /// The bytes are not the descriptor's block size.
    #[error("{got} bytes of block where its descriptor says {want}")]
    Length {
        /// Bytes after the header.
        got: u64,
        /// What the descriptor says one block takes.
        want: u64,
    },
}

impl From<redis::RedisError> for StoreError {
    fn from(e: redis::RedisError) -> Self {
        StoreError::Redis(e.to_string())
    }
}

const TAG: usize = 32;

/// The tag of a value: HMAC-SHA256 under `mac_key` of the salt, the chain
/// digest, the descriptor and the bytes (lengths framed, so no two
/// different inputs share an encoding).
fn tag(mac_key: &[u8], salt: &[u8], hash: &[u8; 32], desc: &[u8], bytes: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length.
    let mut m = HmacSha256::new_from_slice(mac_key).expect("HMAC takes any key length");
    m.update(b"pagedattn-store v2\0");
    m.update(&(salt.len() as u64).to_le_bytes());
    m.update(salt);
    m.update(hash);
    m.update(desc);
    m.update(bytes);
    m
}

/// The value of block `hash` in `salt`'s namespace: descriptor, tag,
/// bytes.
pub fn encode_value(
    mac_key: &[u8],
    salt: &[u8],
    hash: &[u8; 32],
    layout: &KvLayout,
    bytes: &[u8],
) -> Vec<u8> {
    let desc = layout.to_bytes();
    let t = tag(mac_key, salt, hash, &desc, bytes)
        .finalize()
        .into_bytes();
    let mut v = Vec::with_capacity(KV_LAYOUT_BYTES + TAG + bytes.len());
    v.extend_from_slice(&desc);
    v.extend_from_slice(&t);
    v.extend_from_slice(bytes);
    v
}

/// Reads a value [`encode_value`] wrote for block `hash` of `salt`: the
/// descriptor and the block's bytes, or why it is refused (the tag is
/// checked in constant time). Never panics.
pub fn decode_value<'v>(
    mac_key: &[u8],
    salt: &[u8],
    hash: &[u8; 32],
    v: &'v [u8],
) -> Result<(KvLayout, &'v [u8]), ValueError> {
    if v.len() < KV_LAYOUT_BYTES + TAG {
        return Err(ValueError::Short(v.len()));
    }
    let (desc, rest) = v.split_at(KV_LAYOUT_BYTES);
    let (t, bytes) = rest.split_at(TAG);
    tag(mac_key, salt, hash, desc, bytes)
        .verify_slice(t)
        .map_err(|_| ValueError::Tag)?;
    let layout = KvLayout::from_bytes(desc).map_err(ValueError::Descriptor)?;
    if bytes.len() as u64 != layout.block_bytes() {
        return Err(ValueError::Length {
            got: bytes.len() as u64,
            want: layout.block_bytes(),
        });
    }
    Ok((layout, bytes))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A block found in the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchedBlock {
    /// Its layout.
    pub layout: KvLayout,
    /// Its bytes (`layout.block_bytes()` of them).
    pub bytes: Vec<u8>,
}

/// What a prefix lookup found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fetch {
    /// The leading blocks found, in order.
    pub blocks: Vec<FetchedBlock>,
    /// Values refused (and deleted).
    pub refused: Vec<ValueError>,
    /// The store could not be asked: everything is computed locally.
    pub unavailable: Option<StoreError>,
}

/// Reads a sequence's values, each only if it is at most `ARGV[1]` bytes:
/// the value, or its length (an integer) when over, or nil when absent.
/// Nothing over the limit leaves the server.
const FETCH_SCRIPT: &str = r"
local out = {}
local limit = tonumber(ARGV[1])
for i, k in ipairs(KEYS) do
  local n = redis.call('STRLEN', k)
  if n == 0 then
    out[i] = false
  elseif n > limit then
    out[i] = n
  else
    out[i] = redis.call('GET', k)
  end
end
return out
";

/// A prefix store on one Redis or Valkey server, connected lazily (and
/// again after a failure or a timeout).
pub struct RedisPrefixStore {
    client: redis::Client,
    conn: Option<redis::aio::MultiplexedConnection>,
    rt: tokio::runtime::Runtime,
    cfg: StoreConfig,
    /// Warnings printed so far (a store that was down, refused values).
    pub warnings: u64,
}

impl RedisPrefixStore {
    /// A store at `url` (`redis://host:port/db`); nothing is connected yet.
    /// Refused without a MAC key of at least [`MIN_MAC_KEY`] bytes.
    pub fn open(url: &str, cfg: StoreConfig) -> Result<Self, StoreError> {
        if cfg.mac_key.len() < MIN_MAC_KEY {
            return Err(StoreError::Config(format!(
                "a MAC key of at least {MIN_MAC_KEY} bytes is needed (StoreConfig::mac_key, {} given): the engines share it and Redis never sees it",
                cfg.mac_key.len()
            )));
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| StoreError::Config(format!("the store's runtime: {e}")))?;
        Ok(Self {
            client: redis::Client::open(url)?,
            conn: None,
            rt,
            cfg,
            warnings: 0,
        })
    }

    /// The key of block `hash` in `salt`'s namespace (layer group 0's).
    pub fn key(&self, salt: &[u8], hash: &[u8; 32]) -> String {
        self.group_key(salt, hash, 0)
    }

    /// The key of layer group `group`'s block `hash` in `salt`'s namespace:
    /// a hybrid model stores one block per group under one chain digest
    /// (group 0's key is [`key`](Self::key)'s; another group's ends in
    /// `:g<group>`).
    pub fn group_key(&self, salt: &[u8], hash: &[u8; 32], group: u16) -> String {
        let s: [u8; 32] = Sha256::digest(salt).into();
        let tail = if group == 0 {
            String::new()
        } else {
            format!(":g{group}")
        };
        format!(
            "{}{}:{}{tail}",
            self.cfg.key_prefix,
            hex(&s[..8]),
            hex(hash)
        )
    }

    /// Runs `cmd` within the timeout, connecting first if need be; a
    /// failure or a timeout drops the connection (the next call connects
    /// again).
    fn query<T: redis::FromRedisValue>(&mut self, cmd: &redis::Cmd) -> Result<T, StoreError> {
        let limit = self.cfg.timeout;
        let (client, slot) = (&self.client, &mut self.conn);
        let r = self.rt.block_on(async {
            tokio::time::timeout(limit, async {
                if slot.is_none() {
                    *slot = Some(client.get_multiplexed_async_connection().await?);
                }
                let c = slot.as_mut().expect("just set");
                cmd.query_async::<T>(c).await
            })
            .await
        });
        match r {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                self.conn = None;
                Err(e.into())
            }
            Err(_) => {
                self.conn = None;
                Err(StoreError::Timeout(limit))
            }
        }
    }

    fn warn(&mut self, what: &str) {
        self.warnings += 1;
        eprintln!("warning: pagedattn-store: {what}");
    }

    /// Stores block `hash` of `salt` once (`SET NX` with the TTL), under
    /// the key of the layer group its layout names: `Ok(true)` when
    /// written, `Ok(false)` when it was there already.
    pub fn put(
        &mut self,
        salt: &[u8],
        hash: &[u8; 32],
        layout: &KvLayout,
        bytes: &[u8],
    ) -> Result<bool, StoreError> {
        let value = encode_value(&self.cfg.mac_key, salt, hash, layout, bytes);
        if value.len() > self.cfg.max_value_bytes {
            return Err(StoreError::Value(ValueError::TooLarge {
                got: value.len(),
                limit: self.cfg.max_value_bytes,
            }));
        }
        let key = self.group_key(salt, hash, layout.layer_group);
        let ttl = self.cfg.ttl_secs.max(1);
        let mut cmd = redis::cmd("SET");
        cmd.arg(&key).arg(value).arg("NX").arg("EX").arg(ttl);
        let r: Option<String> = self.query(&cmd)?;
        Ok(r.is_some())
    }

    /// The leading blocks of `hashes` (a prompt's chain digests, in order)
    /// the store holds for `salt`, in one call: up to the first missing
    /// or refused value (every refused one is deleted, with a warning). A
    /// store that cannot be asked in time is a miss, with a warning.
    pub fn fetch_prefix(&mut self, salt: &[u8], hashes: &[[u8; 32]]) -> Fetch {
        self.fetch_group_prefix(salt, hashes, 0)
    }

    /// [`fetch_prefix`](Self::fetch_prefix) of layer group `group`'s
    /// blocks: a value whose descriptor names another group is refused.
    pub fn fetch_group_prefix(&mut self, salt: &[u8], hashes: &[[u8; 32]], group: u16) -> Fetch {
        let mut out = Fetch::default();
        if hashes.is_empty() {
            return out;
        }
        let keys: Vec<String> = hashes
            .iter()
            .map(|h| self.group_key(salt, h, group))
            .collect();
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(FETCH_SCRIPT).arg(keys.len());
        for k in &keys {
            cmd.arg(k);
        }
        cmd.arg(self.cfg.max_value_bytes);
        let values: Vec<redis::Value> = match self.query(&cmd) {
            Ok(v) => v,
            Err(e) => {
                self.warn(&format!("prefix lookup failed, computing locally: {e}"));
                out.unavailable = Some(e);
                return out;
            }
        };
        // The leading run of valid values is the hit; every refused value
        // is deleted (so the next engine that computes the block may
        // store it again), wherever it lies.
        let mut leading = true;
        for ((key, hash), v) in keys.iter().zip(hashes).zip(values) {
            let decoded = match v {
                redis::Value::Nil => {
                    leading = false;
                    continue;
                }
                redis::Value::Int(n) => Err(ValueError::TooLarge {
                    got: n.max(0) as usize,
                    limit: self.cfg.max_value_bytes,
                }),
                redis::Value::BulkString(v) => decode_value(&self.cfg.mac_key, salt, hash, &v)
                    .and_then(|(layout, bytes)| {
                        if layout.layer_group != group {
                            return Err(ValueError::WrongGroup {
                                got: layout.layer_group,
                                want: group,
                            });
                        }
                        Ok(FetchedBlock {
                            layout,
                            bytes: bytes.to_vec(),
                        })
                    }),
                other => Err(ValueError::Short(match other {
                    redis::Value::SimpleString(s) => s.len(),
                    _ => 0,
                })),
            };
            match decoded {
                Ok(b) if leading => out.blocks.push(b),
                Ok(_) => {}
                Err(e) => {
                    self.warn(&format!("refused {key}: {e}; deleting it"));
                    let mut del = redis::cmd("DEL");
                    del.arg(key);
                    let _ = self.query::<i64>(&del);
                    out.refused.push(e);
                    leading = false;
                }
            }
        }
        out
    }

    /// Deletes block `hash` of `salt` (one an import refused).
    pub fn remove(&mut self, salt: &[u8], hash: &[u8; 32]) -> Result<bool, StoreError> {
        let key = self.key(salt, hash);
        let mut cmd = redis::cmd("DEL");
        cmd.arg(&key);
        let n: i64 = self.query(&cmd)?;
        Ok(n > 0)
    }

    /// Bounds the server's memory at `bytes`, evicting least recently used
    /// keys past it (`CONFIG SET maxmemory`, `maxmemory-policy
    /// allkeys-lru`): for a server the engine owns.
    pub fn bound_memory(&mut self, bytes: u64) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("SET").arg("maxmemory").arg(bytes);
        self.query::<()>(&cmd)?;
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("SET").arg("maxmemory-policy").arg("allkeys-lru");
        self.query::<()>(&cmd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagedattn::gpu::{KvDtype, KV_LAYOUT_VERSION};

    const KEY: &[u8] = b"0123456789abcdef-engines-only";

    fn layout() -> KvLayout {
        KvLayout {
            version: KV_LAYOUT_VERSION,
            library: [0, 1, 0],
            dtype: KvDtype::F16,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 4,
            layer_group: 0,
            layers: 0..2,
            parts: [32, 0, 32, 0],
            layer_state: [3; 32],
        }
    }

    fn cfg() -> StoreConfig {
        StoreConfig {
            mac_key: KEY.to_vec(),
            ..StoreConfig::default()
        }
    }

    #[test]
    fn values_round_trip_and_refuse_damage() {
        let l = layout();
        let (salt, hash) = (b"tenant-a", [7u8; 32]);
        let bytes: Vec<u8> = (0..128).map(|i| i as u8).collect();
        let v = encode_value(KEY, salt, &hash, &l, &bytes);
        assert_eq!(
            decode_value(KEY, salt, &hash, &v),
            Ok((l.clone(), &bytes[..]))
        );
        // Any one flipped byte is refused.
        for i in 0..v.len() {
            let mut bad = v.clone();
            bad[i] ^= 0x10;
            assert!(decode_value(KEY, salt, &hash, &bad).is_err(), "byte {i}");
        }
        // Any truncation is refused.
        for n in 0..v.len() {
            assert!(
                decode_value(KEY, salt, &hash, &v[..n]).is_err(),
                "{n} bytes"
            );
        }
        // A tag that verifies over bytes of the wrong length: refused too.
        let short = encode_value(KEY, salt, &hash, &l, &bytes[..64]);
        assert_eq!(
            decode_value(KEY, salt, &hash, &short),
            Err(ValueError::Length { got: 64, want: 128 })
        );
    }

    #[test]
    fn a_value_is_bound_to_its_tenant_block_and_key() {
        let l = layout();
        let bytes = vec![5u8; 128];
        let v = encode_value(KEY, b"tenant-a", &[7; 32], &l, &bytes);
        // Copied under another tenant's key, or another block's: refused.
        assert_eq!(
            decode_value(KEY, b"tenant-b", &[7; 32], &v),
            Err(ValueError::Tag)
        );
        assert_eq!(
            decode_value(KEY, b"tenant-a", &[8; 32], &v),
            Err(ValueError::Tag)
        );
        // Planted by someone without the engines' key: refused.
        let planted = encode_value(b"guessed-key-0000", b"tenant-a", &[7; 32], &l, &bytes);
        assert_eq!(
            decode_value(KEY, b"tenant-a", &[7; 32], &planted),
            Err(ValueError::Tag)
        );
        // The salt's length is framed: ("ab", h) and ("a", "b"+h) differ.
        let a = encode_value(KEY, b"ab", &[7; 32], &l, &bytes);
        assert!(decode_value(KEY, b"a", &[7; 32], &a).is_err());
    }

    #[test]
    fn keys_separate_tenants() {
        let s = RedisPrefixStore::open("redis://127.0.0.1:1/", cfg()).unwrap();
        let h = [9u8; 32];
        assert_ne!(s.key(b"a", &h), s.key(b"b", &h));
        assert!(s.key(b"a", &h).starts_with("pagedattn:kv:"));
        assert!(s.key(b"a", &h).ends_with(&hex(&h)));
    }

    #[test]
    fn a_store_without_a_mac_key_is_refused() {
        for key in [Vec::new(), vec![1u8; MIN_MAC_KEY - 1]] {
            let c = StoreConfig {
                mac_key: key,
                ..StoreConfig::default()
            };
            let e = RedisPrefixStore::open("redis://127.0.0.1:1/", c)
                .err()
                .unwrap();
            assert!(e.to_string().contains("MAC key"), "{e}");
        }
    }

    #[test]
    fn a_store_that_is_down_is_a_miss() {
        // Port 1 on loopback: nothing listens.
        let c = StoreConfig {
            timeout: Duration::from_millis(300),
            ..cfg()
        };
        let mut s = RedisPrefixStore::open("redis://127.0.0.1:1/", c).unwrap();
        let f = s.fetch_prefix(b"t", &[[1; 32], [2; 32]]);
        assert!(f.blocks.is_empty());
        assert!(f.unavailable.is_some());
        assert_eq!(s.warnings, 1);
        assert!(s.put(b"t", &[1; 32], &layout(), &[0; 128]).is_err());
    }

    /// A server that accepts and then trickles one byte a second: the call
    /// ends at the timeout, not when the reply would.
    #[test]
    fn a_trickling_server_cannot_hold_a_call_past_the_timeout() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            if let Ok((mut sock, _)) = listener.accept() {
                let mut buf = [0u8; 4096];
                // The start of a valid reply (a long bulk string), then a
                // byte of it every 200 ms, whatever was asked.
                sock.set_read_timeout(Some(Duration::from_millis(200))).ok();
                let _ = sock.read(&mut buf);
                if sock.write_all(b"*1\r\n$100000\r\n").is_err() {
                    return;
                }
                loop {
                    let _ = sock.read(&mut buf);
                    if sock.write_all(b"a").is_err() {
                        return;
                    }
                }
            }
        });
        let c = StoreConfig {
            timeout: Duration::from_millis(800),
            ..cfg()
        };
        let mut s = RedisPrefixStore::open(&format!("redis://127.0.0.1:{port}/"), c).unwrap();
        let t0 = std::time::Instant::now();
        let f = s.fetch_prefix(b"t", &[[1; 32]]);
        let took = t0.elapsed();
        // The deadline ended it (not an error from the server), on time.
        assert!(
            matches!(f.unavailable, Some(StoreError::Timeout(_))),
            "{f:?}"
        );
        assert!(took >= Duration::from_millis(800), "took {took:?}");
        assert!(took < Duration::from_millis(2000), "took {took:?}");
    }
}
