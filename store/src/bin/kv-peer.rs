//! One engine process of the two-process check (`tests/two_processes.rs`):
//! its own GPU device, pool and block manager, serving one prompt (a
//! system prompt shared with the other process, then its own suffix)
//! through the Redis prefix store.
//!
//! It looks the prompt's chain digests up in the store, imports the
//! leading blocks found (an import refused, a block of another layout:
//! those blocks are uncached and the prompt computed in full), computes the rest, publishes the full blocks
//! its manager reports stored, and decodes one query on every layer. It
//! checks the output against the f64 reference over its own host mirror
//! (exit 2 past 1e-5) and prints one line:
//! `imported N computed M of T refused R unavailable U rel_l2 E`, writing
//! the output's f32 bytes to `--out`.
//!
//! `kv-peer --redis URL|none [--mac-key KEY] --salt S --suffix-seed N
//! [--dtype f16|f32] [--pause-ms MS] --out FILE`; with `--keys-only 1` it
//! prints the store keys of its prompt's full blocks and stops.
//! (exit 3: no GPU adapter).

use std::collections::HashMap;

use pagedattn::blocks::{BlockManager, BlockManagerConfig, KvEvent, SeqId};
use pagedattn::gpu::{AttnOptions, Gpu, KvCache, KvCacheConfig, KvDtype, PagedAttention};
use pagedattn::reference::{self, rel_l2, AttnParams, HostPool, Stored};
use pagedattn::rng::SplitMix64;
use pagedattn_store::{Fetch, RedisPrefixStore, StoreConfig};

const LAYERS: u32 = 2;
const BLOCKS: u32 = 24;
const BS: u32 = 16;
const KVH: u32 = 2;
const HEADS: u32 = 8;
const HD: u32 = 64;
/// The shared system prompt: three full blocks and five tokens.
const SYSTEM: usize = 3 * BS as usize + 5;

/// K and V rows of the token at `pos` of `tokens` in `layer`: a function
/// of the tokens up to it, as a model's are, so two processes computing one
/// prefix write the same values.
fn kv_row(tokens: &[u32], pos: usize, layer: u32) -> (Vec<f32>, Vec<f32>) {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ layer as u64;
    for &t in &tokens[..=pos] {
        h = (h ^ t as u64).wrapping_mul(0x100_0000_01b3);
    }
    let mut rng = SplitMix64::new(h);
    let n = (KVH * HD) as usize;
    (rng.signed_vec(n), rng.signed_vec(n))
}

fn args() -> Result<HashMap<String, String>, String> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let mut out = HashMap::new();
    for p in a.chunks(2) {
        match p {
            [k, v] if k.starts_with("--") => {
                out.insert(k[2..].to_string(), v.clone());
            }
            _ => return Err(format!("arguments go in --name value pairs: {p:?}")),
        }
    }
    Ok(out)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("kv-peer: {e}");
        std::process::exit(1);
    }
}

/// This process's engine: its device, pool, attention, block manager and
/// the host mirror of the pool the reference reads.
struct Peer {
    gpu: Gpu,
    kv: KvCache,
    attn: PagedAttention,
    m: BlockManager,
    host: Vec<HostPool>,
    stored: Stored,
}

/// Counts of one lookup: blocks imported, and imports refused.
struct Lookup {
    id: SeqId,
    imported: usize,
    refused: usize,
}

impl Peer {
    /// The K/V of `tokens[first..]` at `slots` into the host mirror, per
    /// layer; returns them for the GPU write.
    fn mirror(
        &mut self,
        tokens: &[u32],
        first: usize,
        slots: &[u32],
    ) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for l in 0..LAYERS {
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for pos in first..first + slots.len() {
                let (kr, vr) = kv_row(tokens, pos, l);
                k.extend(kr);
                v.extend(vr);
            }
            self.host[l as usize].write(slots, &k, &v, self.stored);
            ks.push(k);
            vs.push(v);
        }
        (ks, vs)
    }

    /// Adds the prompt with the remote blocks `fetch` found imported. An
    /// import refused (a block of another layout) uncaches them and adds
    /// the prompt to be computed in full.
    fn add_prompt(&mut self, prompt: &[u32], salt: &[u8], fetch: &Fetch) -> Result<Lookup, String> {
        let (id, imports): (SeqId, _) = self
            .m
            .add_sequence_with_remote(prompt, salt, fetch.blocks.len())
            .map_err(|e| e.to_string())?;
        let mut look = Lookup {
            id,
            imported: 0,
            refused: fetch.refused.len(),
        };
        // The local cache's hits come first: the imports are the last found.
        let skip = fetch.blocks.len() - imports.len();
        for ((block, _), fb) in imports.iter().zip(&fetch.blocks[skip..]) {
            match self
                .kv
                .import_blocks(&self.gpu, &fb.layout, &fb.bytes, &[*block])
            {
                Ok(()) => look.imported += 1,
                Err(e) => {
                    // Its digest matched: a block of another layout (another
                    // engine's pool), not a corrupt one, so it stays stored.
                    eprintln!(
                        "warning: kv-peer: import refused ({e}); computing the prompt locally"
                    );
                    look.refused += 1;
                    break;
                }
            }
        }
        if look.imported < imports.len() {
            let blocks: Vec<u32> = imports.iter().map(|i| i.0).collect();
            self.m.uncache(&blocks);
            self.m.free(id).map_err(|e| e.to_string())?;
            look.id = self
                .m
                .add_sequence_salted(prompt, salt)
                .map_err(|e| e.to_string())?;
            look.imported = 0;
        } else {
            // The mirror of the imported blocks, from the same function.
            for (i, (block, _)) in imports.iter().enumerate() {
                let slots: Vec<u32> = (0..BS).map(|o| block * BS + o).collect();
                self.mirror(prompt, (skip + i) * BS as usize, &slots);
            }
        }
        Ok(look)
    }

    /// Computes the rest of the prompt (one prefill step's K/V) and
    /// publishes the full blocks the manager reports stored. Returns the
    /// tokens computed.
    fn compute_and_publish(
        &mut self,
        id: SeqId,
        prompt: &[u32],
        salt: &[u8],
        store: Option<&mut RedisPrefixStore>,
    ) -> Result<usize, String> {
        let view = self.m.batch_view(&[id]).map_err(|e| e.to_string())?;
        let computed = view.slot_mapping.len();
        let first = prompt.len() - computed;
        let (ks, vs) = self.mirror(prompt, first, &view.slot_mapping);
        for l in 0..LAYERS {
            let (k, v) = (&ks[l as usize], &vs[l as usize]);
            self.kv
                .write_kv(&self.gpu, l, k, v, &view.slot_mapping)
                .map_err(|e| e.to_string())?;
        }
        let Some(s) = store else {
            return Ok(computed);
        };
        for e in self.m.take_events() {
            if let KvEvent::Stored { hash, block } = e {
                let len = self
                    .kv
                    .export_bytes(1, 0..LAYERS)
                    .map_err(|e| e.to_string())?;
                let mut bytes = vec![0u8; len as usize];
                let layout = self
                    .kv
                    .export_blocks(&self.gpu, &[block], 0..LAYERS, &mut bytes)
                    .map_err(|e| e.to_string())?;
                if let Err(e) = s.put(salt, &hash, &layout, &bytes) {
                    eprintln!("warning: kv-peer: publishing a block failed: {e}");
                    break;
                }
            }
        }
        Ok(computed)
    }

    /// Decodes `q` on every layer; returns the output and the f64
    /// reference's over the host mirror.
    fn decode(&mut self, id: SeqId, q: &[f32]) -> Result<(Vec<f32>, Vec<f64>), String> {
        let view = self.m.batch_view(&[id]).map_err(|e| e.to_string())?;
        let p = AttnParams::new(HEADS as usize, HD as usize);
        let (mut out, mut want) = (Vec::new(), Vec::new());
        let (indptr, indices, lens) = (&view.kv_indptr, &view.kv_indices, &view.seq_lens);
        for l in 0..LAYERS {
            let o = self.attn.decode(
                &self.gpu,
                &self.kv,
                l,
                q,
                indptr,
                indices,
                lens,
                &AttnOptions::default(),
            );
            out.extend(o.map_err(|e| e.to_string())?);
            let pool = self.host[l as usize].view();
            want.extend(reference::decode(&pool, &p, q, indptr, indices, lens));
        }
        Ok((out, want))
    }
}

/// The store's configuration: the engines' MAC key from `--mac-key`.
fn store_config(a: &HashMap<String, String>) -> Result<StoreConfig, String> {
    let key = a
        .get("mac-key")
        .ok_or("--mac-key is required with a store")?;
    Ok(StoreConfig {
        mac_key: key.as_bytes().to_vec(),
        ..StoreConfig::default()
    })
}

fn run() -> Result<(), String> {
    let a = args()?;
    let get = |k: &str| a.get(k).cloned().ok_or(format!("--{k} is required"));
    let (url, salt, out_path) = (get("redis")?, get("salt")?, get("out")?);
    let suffix_seed: u64 = get("suffix-seed")?
        .parse()
        .map_err(|e| format!("--suffix-seed: {e}"))?;
    let dtype = match a.get("dtype").map(String::as_str) {
        None | Some("f16") => KvDtype::F16,
        Some("f32") => KvDtype::F32,
        Some(d) => return Err(format!("--dtype {d}: f16 or f32")),
    };
    let salt = salt.as_bytes();

    // The prompt: the shared system prompt, then this process's suffix.
    let mut rng = SplitMix64::new(0x0051_57E3);
    let mut prompt: Vec<u32> = (0..SYSTEM).map(|_| rng.below(32000) as u32).collect();
    let mut own = SplitMix64::new(suffix_seed);
    let n_suffix = 20 + own.below(20) as usize;
    prompt.extend((0..n_suffix).map(|_| own.below(32000) as u32));
    let q = own.signed_vec((HEADS * HD) as usize);

    // `--keys-only`: the store keys this prompt's full blocks have (the
    // test plants values under them), one a line; nothing else runs.
    if a.contains_key("keys-only") {
        let m = BlockManager::new(BlockManagerConfig::new(BLOCKS, BS).with_prefix_caching(true))
            .map_err(|e| e.to_string())?;
        let store = RedisPrefixStore::open(&url, store_config(&a)?).map_err(|e| e.to_string())?;
        for h in m.prompt_hashes(&prompt, salt) {
            println!("{}", store.key(salt, &h));
        }
        return Ok(());
    }

    let gpu = match Gpu::new() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("kv-peer: no GPU adapter: {e}");
            std::process::exit(3);
        }
    };
    let cfg = KvCacheConfig::new(BLOCKS, BS, KVH, HD)
        .with_layers(LAYERS)
        .with_dtype(dtype);
    let kv = KvCache::new(&gpu, cfg).map_err(|e| e.to_string())?;
    let attn =
        PagedAttention::new(&gpu, &kv, HEADS, &Default::default()).map_err(|e| e.to_string())?;
    let mut m = BlockManager::new(BlockManagerConfig::new(BLOCKS, BS).with_prefix_caching(true))
        .map_err(|e| e.to_string())?;
    m.scramble_free_list(suffix_seed);
    m.record_events(true);
    let host = (0..LAYERS)
        .map(|_| HostPool::new(BLOCKS as usize, KVH as usize, BS as usize, HD as usize))
        .collect();
    let mut peer = Peer {
        gpu,
        kv,
        attn,
        m,
        host,
        stored: Stored::from(dtype),
    };

    // Look the prefix up; import what was found.
    let mut store = if url == "none" {
        None
    } else {
        Some(RedisPrefixStore::open(&url, store_config(&a)?).map_err(|e| e.to_string())?)
    };
    let hashes = peer.m.prompt_hashes(&prompt, salt);
    let fetch = match store.as_mut() {
        Some(s) => s.fetch_prefix(salt, &hashes),
        None => Default::default(),
    };
    let look = peer.add_prompt(&prompt, salt, &fetch)?;

    // A pause before the rest (`--pause-ms`): the two-process test kills
    // Redis here, mid-run, once this line is out.
    if let Some(ms) = a.get("pause-ms") {
        let ms: u64 = ms.parse().map_err(|e| format!("--pause-ms: {e}"))?;
        println!("looked-up");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }

    let computed = peer.compute_and_publish(look.id, &prompt, salt, store.as_mut())?;
    // Decode on every layer, against the reference.
    let (out, want) = peer.decode(look.id, &q)?;
    let err = rel_l2(&out, &want);
    println!(
        "imported {} computed {computed} of {} refused {} unavailable {} rel_l2 {err:.3e}",
        look.imported,
        prompt.len(),
        look.refused,
        fetch.unavailable.is_some() as u32
    );
    let bytes: Vec<u8> = out.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(&out_path, bytes).map_err(|e| format!("{out_path}: {e}"))?;
    if err.is_nan() || err >= 1e-5 {
        eprintln!("kv-peer: rel L2 {err:.3e} against the f64 reference");
        std::process::exit(2);
    }
    Ok(())
}
