//! What the server is started with, checked before anything is loaded,
//! and the API-key file that maps bearer keys to tenants.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pagedattn::blocks::{Preemption, Reservation};
use pagedattn::gpu::KvDtype;
use pagedattn_model::defaults::GenerationOverrides;
use pagedattn_model::load::ModelSource;
use pagedattn_model::synthetic::Synthetic;

use crate::ServeError;

/// How `pagedattn serve` runs.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The GGUF file.
    pub model: PathBuf,
    /// A synthetic model instead of the file `model` (served as
    /// `synthetic-<arch>`).
    pub synthetic: Option<Synthetic>,
    /// The backends the device may be opened on.
    pub backends: wgpu::Backends,
    /// The name clients pass as `model` (default: the file's stem).
    pub served_model_name: Option<String>,
    pub host: IpAddr,
    /// 0: any free port (tests).
    pub port: u16,
    pub kv_dtype: KvDtype,
    /// KV blocks of 16 tokens in the pool (every layer).
    pub num_blocks: u32,
    /// Sequences in one step.
    pub max_seqs: usize,
    /// Tokens in one step (the prefill chunk).
    pub max_batch_tokens: usize,
    /// The longest sequence served, prompt and output (`None`: the model's
    /// context); what the `max` reservation reserves.
    pub max_model_len: Option<usize>,
    /// Requests held beyond `max_seqs` before new ones get 429.
    pub max_queue: usize,
    /// The largest request body accepted (413 past it).
    pub max_body_bytes: usize,
    /// Bearer keys and their tenants (`None`: one tenant, no key).
    pub api_keys: Option<ApiKeys>,
    /// Listen past loopback without API keys.
    pub allow_unauthenticated: bool,
    /// Paging, or a reservation baseline.
    pub reservation: Reservation,
    pub preemption: Preemption,
    /// Host swap blocks (0: preemption recomputes).
    pub swap_blocks: u32,
    pub prefix_caching: bool,
    /// After SIGINT/SIGTERM, how long requests in flight may take to
    /// finish before they are aborted.
    pub shutdown_timeout: Duration,
    /// The SSE keep-alive comment's interval while a stream waits.
    pub keep_alive: Duration,
    /// Defaults for the sampling fields and `max_tokens` requests omit,
    /// over the model's own ([`pagedattn_model::defaults`]).
    pub generation: GenerationOverrides,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            model: pagedattn_model::config::default_model_path(),
            synthetic: None,
            backends: wgpu::Backends::all(),
            served_model_name: None,
            host: IpAddr::from([127, 0, 0, 1]),
            port: 8000,
            kv_dtype: KvDtype::F16,
            num_blocks: 1024,
            max_seqs: 32,
            max_batch_tokens: 256,
            max_model_len: None,
            max_queue: 1024,
            max_body_bytes: 1 << 20,
            api_keys: None,
            allow_unauthenticated: false,
            reservation: Reservation::Paged,
            preemption: Preemption::Auto,
            swap_blocks: 1024,
            prefix_caching: true,
            shutdown_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            generation: GenerationOverrides::default(),
        }
    }
}

/// The most sequences one step may hold (the engine's logit rows).
pub const MAX_SEQS: usize = 256;

impl ServeConfig {
    /// Checks every value against its limit; the message names the flag.
    pub fn check(&self) -> Result<(), ServeError> {
        let bad = |m: String| Err(ServeError::Config(m));
        if self.api_keys.is_none() && !self.host.is_loopback() && !self.allow_unauthenticated {
            return bad(format!(
                "--host {} is not loopback and no --api-keys file is given: anyone who can reach it could use it; pass --api-keys FILE, or --allow-unauthenticated to mean it",
                self.host
            ));
        }
        if !(1..=MAX_SEQS).contains(&self.max_seqs) {
            return bad(format!(
                "--max-seqs {} outside 1..={MAX_SEQS}",
                self.max_seqs
            ));
        }
        if !(self.max_seqs..=8192).contains(&self.max_batch_tokens) {
            return bad(format!(
                "--max-batch-tokens {} outside {}..=8192 (at least --max-seqs)",
                self.max_batch_tokens, self.max_seqs
            ));
        }
        if !(1..=1 << 20).contains(&self.num_blocks) {
            return bad(format!(
                "--num-blocks {} outside 1..=1048576",
                self.num_blocks
            ));
        }
        if self.swap_blocks > 1 << 20 {
            return bad(format!("--swap-blocks {} over 1048576", self.swap_blocks));
        }
        if self.max_queue > 1 << 20 {
            return bad(format!("--max-queue {} over 1048576", self.max_queue));
        }
        if !(1024..=1 << 30).contains(&self.max_body_bytes) {
            return bad(format!(
                "--max-body-bytes {} outside 1024..=1073741824",
                self.max_body_bytes
            ));
        }
        self.generation
            .check()
            .map_err(|e| ServeError::Config(e.to_string()))?;
        if self.keep_alive.is_zero() {
            return bad("--keep-alive must be positive".into());
        }
        if let Some(name) = &self.served_model_name {
            if name.is_empty() || name.len() > 256 {
                return bad("--served-model-name must have 1 to 256 bytes".into());
            }
        }
        Ok(())
    }

    /// The name clients pass as `model`: `--served-model-name`, else the
    /// file's stem or `synthetic-<arch>`.
    pub fn model_name(&self) -> String {
        if let Some(n) = &self.served_model_name {
            return n.clone();
        }
        self.source().name()
    }

    /// Where the model comes from.
    pub fn source(&self) -> ModelSource {
        ModelSource::new(self.model.clone(), self.synthetic)
    }
}

/// Bearer keys and the tenant each one serves. Each tenant has its own
/// prefix-cache namespace: one tenant never hits, or times, another's
/// cached prompt.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKeys {
    keys: Vec<(String, String)>,
}

impl std::fmt::Debug for ApiKeys {
    // Never print the keys.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.keys.len())
    }
}

impl ApiKeys {
    /// Parses a key file: one `KEY TENANT` pair a line (blank lines and
    /// `#` comments skipped). Keys are unique, at least 8 printable ASCII
    /// characters; a tenant may have several keys.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut keys: Vec<(String, String)> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let n = i + 1;
            let mut parts = line.split_whitespace();
            let (Some(key), Some(tenant), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(format!("line {n}: expected `KEY TENANT`"));
            };
            if key.len() < 8 || !key.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!(
                    "line {n}: a key must be at least 8 printable ASCII characters"
                ));
            }
            if tenant.len() > 128 {
                return Err(format!("line {n}: a tenant name has at most 128 bytes"));
            }
            if keys.iter().any(|(k, _)| k == key) {
                return Err(format!("line {n}: this key is already given"));
            }
            keys.push((key.to_string(), tenant.to_string()));
        }
        if keys.is_empty() {
            return Err("no keys".into());
        }
        Ok(Self { keys })
    }

    /// Reads and parses a key file.
    pub fn load(path: &Path) -> Result<Self, ServeError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ServeError::Config(format!("--api-keys {}: {e}", path.display())))?;
        Self::parse(&text)
            .map_err(|e| ServeError::Config(format!("--api-keys {}: {e}", path.display())))
    }

    /// The tenant of `key`, comparing against every key in the same time
    /// whatever matches.
    pub fn tenant(&self, key: &str) -> Option<&str> {
        let mut found = None;
        for (k, t) in &self.keys {
            if constant_time_eq(k.as_bytes(), key.as_bytes()) {
                found = Some(t.as_str());
            }
        }
        found
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether there are none (never, once parsed).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_files_parse_and_refuse_what_is_wrong() {
        let k =
            ApiKeys::parse("# keys\nsk-aaaaaaaa alice\n\n  sk-bbbbbbbb bob \nsk-cccccccc alice\n")
                .unwrap();
        assert_eq!(k.len(), 3);
        assert_eq!(k.tenant("sk-aaaaaaaa"), Some("alice"));
        assert_eq!(k.tenant("sk-cccccccc"), Some("alice"));
        assert_eq!(k.tenant("sk-bbbbbbbb"), Some("bob"));
        assert_eq!(k.tenant("sk-bbbbbbb"), None);
        assert_eq!(k.tenant(""), None);
        assert!(!format!("{k:?}").contains("sk-"), "never printed");
        for (text, want) in [
            ("", "no keys"),
            ("sk-aaaaaaaa", "line 1: expected"),
            ("sk-aaaaaaaa a b", "line 1: expected"),
            ("short a", "line 1: a key must be"),
            (
                "sk-aaaaaaaa a\nsk-aaaaaaaa b",
                "line 2: this key is already given",
            ),
        ] {
            let e = ApiKeys::parse(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn the_config_refuses_an_open_network_without_keys() {
        let c = ServeConfig {
            host: IpAddr::from([0, 0, 0, 0]),
            ..ServeConfig::default()
        };
        let e = c.check().unwrap_err().to_string();
        assert!(e.contains("--api-keys") && e.contains("0.0.0.0"), "{e}");
        let c = ServeConfig {
            allow_unauthenticated: true,
            ..c
        };
        assert!(c.check().is_ok());
        assert!(ServeConfig::default().check().is_ok());
        let c = ServeConfig {
            max_seqs: 0,
            ..ServeConfig::default()
        };
        assert!(c.check().unwrap_err().to_string().contains("--max-seqs 0"));
        let c = ServeConfig {
            model: "/x/SmolLM2.Q4_1.gguf".into(),
            ..ServeConfig::default()
        };
        assert_eq!(c.model_name(), "SmolLM2.Q4_1");
        let c = ServeConfig {
            synthetic: Some(Synthetic::new(
                pagedattn_model::synthetic::SyntheticArch::Llama3_8B,
            )),
            ..c
        };
        assert_eq!(c.model_name(), "synthetic-llama3-8b");
    }
}
