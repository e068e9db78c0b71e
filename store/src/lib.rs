//! A shared prefix store for pagedattn's KV blocks on Redis or Valkey: the
//! full, immutable blocks an engine's block manager reports stored
//! (`KvEvent::Stored`), exported with their `KvLayout`
//! (`KvCache::export_blocks`), and found again by any engine that shares
//! the prompt's prefix and tenant (`BlockManager::prompt_hashes`, then
//! `add_sequence_with_remote` and `KvCache::import_blocks`).
//!
//! - **Keys**: `{prefix}{salt digest}:{chain digest}`, both hex; give
//!   each model and pool layout its own prefix (an engine of another
//!   layout finds the blocks, and its import refuses them). The chain
//!   digest already covers the salt; the salt's own digest in the key
//!   keeps each tenant's blocks apart even so, and lets one tenant's
//!   blocks be listed or dropped by pattern.
//! - **Values**: the 108-byte layout descriptor, a SHA-256 of descriptor
//!   and bytes, then the block's bytes. A value that is short, whose digest
//!   does not match, or whose descriptor is not one is refused (and
//!   deleted), and that sequence recomputes.
//! - **Writes** are `SET .. NX EX ttl`: a block is written once, when it is
//!   full, and expires after the TTL. The memory bound is the server's
//!   `maxmemory` with an LRU policy ([`RedisPrefixStore::bound_memory`]
//!   sets both on a server the engine owns).
//! - **Failures degrade**: a store that is down or times out is a miss,
//!   with a warning on stderr; nothing panics and nothing waits longer than
//!   the configured timeout.
//!
//! Redis Cluster or Valkey is what a deployment grows into: the commands
//! are plain `GET`/`MGET`/`SET`/`DEL` on one key each (`MGET` of one
//! sequence's keys; with a cluster, give the keys a hash tag through the
//! prefix).

use std::time::Duration;

use pagedattn::gpu::{KvLayout, TransferError, KV_LAYOUT_BYTES};
use sha2::{Digest, Sha256};

/// How the store names, keeps and bounds what it writes.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Key prefix (a namespace per deployment or model).
    pub key_prefix: String,
    /// Seconds a block lives in the store.
    pub ttl_secs: u64,
    /// Connect, read and write timeout.
    pub timeout: Duration,
    /// Largest value written or read; larger ones are refused.
    pub max_value_bytes: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            key_prefix: "pagedattn:kv:".into(),
            ttl_secs: 3600,
            timeout: Duration::from_secs(2),
            max_value_bytes: 64 << 20,
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
    /// The digest does not match the contents: corrupt or truncated.
    #[error("its digest does not match its contents (corrupt or truncated)")]
    Digest,
    /// The descriptor is not one (or of another version).
    #[error("{0}")]
    Descriptor(TransferError),
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

const DIGEST: usize = 32;

/// A stored value: descriptor, SHA-256 of descriptor and bytes, bytes.
pub fn encode_value(layout: &KvLayout, bytes: &[u8]) -> Vec<u8> {
    let desc = layout.to_bytes();
    let mut h = Sha256::new();
    h.update(desc);
    h.update(bytes);
    let mut v = Vec::with_capacity(KV_LAYOUT_BYTES + DIGEST + bytes.len());
    v.extend_from_slice(&desc);
    v.extend_from_slice(&h.finalize());
    v.extend_from_slice(bytes);
    v
}

/// Reads a value [`encode_value`] wrote: the descriptor and the block's
/// bytes, or why it is refused. Never panics.
pub fn decode_value(v: &[u8]) -> Result<(KvLayout, &[u8]), ValueError> {
    if v.len() < KV_LAYOUT_BYTES + DIGEST {
        return Err(ValueError::Short(v.len()));
    }
    let (desc, rest) = v.split_at(KV_LAYOUT_BYTES);
    let (digest, bytes) = rest.split_at(DIGEST);
    let mut h = Sha256::new();
    h.update(desc);
    h.update(bytes);
    if h.finalize().as_slice() != digest {
        return Err(ValueError::Digest);
    }
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

/// A prefix store on one Redis or Valkey server, connected lazily (and
/// again after a failure).
pub struct RedisPrefixStore {
    client: redis::Client,
    conn: Option<redis::Connection>,
    cfg: StoreConfig,
    /// Warnings printed so far (a store that was down, refused values).
    pub warnings: u64,
}

impl RedisPrefixStore {
    /// A store at `url` (`redis://host:port/db`); nothing is connected yet.
    pub fn open(url: &str, cfg: StoreConfig) -> Result<Self, StoreError> {
        Ok(Self {
            client: redis::Client::open(url)?,
            conn: None,
            cfg,
            warnings: 0,
        })
    }

    /// The key of block `hash` in `salt`'s namespace.
    pub fn key(&self, salt: &[u8], hash: &[u8; 32]) -> String {
        let s: [u8; 32] = Sha256::digest(salt).into();
        format!("{}{}:{}", self.cfg.key_prefix, hex(&s[..8]), hex(hash))
    }

    fn conn(&mut self) -> Result<&mut redis::Connection, StoreError> {
        if self.conn.is_none() {
            let c = self.client.get_connection_with_timeout(self.cfg.timeout)?;
            c.set_read_timeout(Some(self.cfg.timeout))?;
            c.set_write_timeout(Some(self.cfg.timeout))?;
            self.conn = Some(c);
        }
        Ok(self.conn.as_mut().expect("just set"))
    }

    /// Runs `f` on the connection; a failure drops the connection (the
    /// next call connects again).
    fn with<T>(
        &mut self,
        f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        let r = self.conn().and_then(|c| f(c).map_err(StoreError::from));
        if r.is_err() {
            self.conn = None;
        }
        r
    }

    fn warn(&mut self, what: &str) {
        self.warnings += 1;
        eprintln!("warning: pagedattn-store: {what}");
    }

    /// Stores block `hash` of `salt` once (`SET NX` with the TTL): `Ok(true)`
    /// when written, `Ok(false)` when it was there already.
    pub fn put(
        &mut self,
        salt: &[u8],
        hash: &[u8; 32],
        layout: &KvLayout,
        bytes: &[u8],
    ) -> Result<bool, StoreError> {
        let value = encode_value(layout, bytes);
        if value.len() > self.cfg.max_value_bytes {
            return Err(StoreError::Value(ValueError::TooLarge {
                got: value.len(),
                limit: self.cfg.max_value_bytes,
            }));
        }
        let key = self.key(salt, hash);
        let ttl = self.cfg.ttl_secs.max(1);
        let r: Option<String> = self.with(|c| {
            redis::cmd("SET")
                .arg(&key)
                .arg(value)
                .arg("NX")
                .arg("EX")
                .arg(ttl)
                .query(c)
        })?;
        Ok(r.is_some())
    }

    /// The leading blocks of `hashes` (a prompt's chain digests, in order)
    /// the store holds for `salt`, in one `MGET`: up to the first missing
    /// or refused value (every refused one is deleted, with a warning). A
    /// store that cannot be asked is a miss, with a warning.
    pub fn fetch_prefix(&mut self, salt: &[u8], hashes: &[[u8; 32]]) -> Fetch {
        let mut out = Fetch::default();
        if hashes.is_empty() {
            return out;
        }
        let keys: Vec<String> = hashes.iter().map(|h| self.key(salt, h)).collect();
        let values: Vec<Option<Vec<u8>>> = match self.with(|c| {
            let mut cmd = redis::cmd("MGET");
            for k in &keys {
                cmd.arg(k);
            }
            cmd.query(c)
        }) {
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
        for (key, v) in keys.iter().zip(values) {
            let Some(v) = v else {
                leading = false;
                continue;
            };
            let decoded = if v.len() > self.cfg.max_value_bytes {
                Err(ValueError::TooLarge {
                    got: v.len(),
                    limit: self.cfg.max_value_bytes,
                })
            } else {
                decode_value(&v).map(|(layout, bytes)| FetchedBlock {
                    layout,
                    bytes: bytes.to_vec(),
                })
            };
            match decoded {
                Ok(b) if leading => out.blocks.push(b),
                Ok(_) => {}
                Err(e) => {
                    self.warn(&format!("refused {key}: {e}; deleting it"));
                    let _ = self.with(|c| redis::cmd("DEL").arg(key).query::<i64>(c));
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
        let n: i64 = self.with(|c| redis::cmd("DEL").arg(&key).query(c))?;
        Ok(n > 0)
    }

    /// Bounds the server's memory at `bytes`, evicting least recently used
    /// keys past it (`CONFIG SET maxmemory`, `maxmemory-policy
    /// allkeys-lru`): for a server the engine owns.
    pub fn bound_memory(&mut self, bytes: u64) -> Result<(), StoreError> {
        self.with(|c| {
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory")
                .arg(bytes)
                .query::<()>(c)?;
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory-policy")
                .arg("allkeys-lru")
                .query::<()>(c)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagedattn::gpu::{KvDtype, KV_LAYOUT_VERSION};

    fn layout() -> KvLayout {
        KvLayout {
            version: KV_LAYOUT_VERSION,
            library: [0, 1, 0],
            dtype: KvDtype::F16,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 4,
            layers: 0..2,
            parts: [32, 0, 32, 0],
            layer_state: [3; 32],
        }
    }

    #[test]
    fn values_round_trip_and_refuse_damage() {
        let l = layout();
        let bytes: Vec<u8> = (0..128).map(|i| i as u8).collect();
        let v = encode_value(&l, &bytes);
        assert_eq!(decode_value(&v), Ok((l.clone(), &bytes[..])));
        // Any one flipped byte is refused.
        for i in 0..v.len() {
            let mut bad = v.clone();
            bad[i] ^= 0x10;
            assert!(decode_value(&bad).is_err(), "byte {i}");
        }
        // Any truncation is refused.
        for n in 0..v.len() {
            assert!(decode_value(&v[..n]).is_err(), "{n} bytes");
        }
        // A digest that matches bytes of the wrong length: refused too.
        let short = encode_value(&l, &bytes[..64]);
        assert_eq!(
            decode_value(&short),
            Err(ValueError::Length { got: 64, want: 128 })
        );
    }

    #[test]
    fn keys_separate_tenants() {
        let s = RedisPrefixStore::open("redis://127.0.0.1:1/", StoreConfig::default()).unwrap();
        let h = [9u8; 32];
        assert_ne!(s.key(b"a", &h), s.key(b"b", &h));
        assert!(s.key(b"a", &h).starts_with("pagedattn:kv:"));
        assert!(s.key(b"a", &h).ends_with(&hex(&h)));
    }

    #[test]
    fn a_store_that_is_down_is_a_miss() {
        // Port 1 on loopback: nothing listens.
        let cfg = StoreConfig {
            timeout: Duration::from_millis(300),
            ..Default::default()
        };
        let mut s = RedisPrefixStore::open("redis://127.0.0.1:1/", cfg).unwrap();
        let f = s.fetch_prefix(b"t", &[[1; 32], [2; 32]]);
        assert!(f.blocks.is_empty());
        assert!(f.unavailable.is_some());
        assert_eq!(s.warnings, 1);
        assert!(s.put(b"t", &[1; 32], &layout(), &[0; 128]).is_err());
    }
}
