//! Two engines sharing prefill through a prefix store, in one process: each
//! has its own pool and block manager; A's full blocks go to the store
//! keyed by their chain digests as A's manager reports them stored
//! (`KvEvent::Stored`), with their `KvLayout`; B, given the same system
//! prompt, finds them by `prompt_hashes`, starts with them
//! (`add_sequence_with_remote` + `import_blocks`) and computes only the
//! rest. B's decode equals a cold engine's bit for bit and the f64
//! reference; another tenant's salt misses; a corrupt or truncated value is
//! refused and that sequence recomputes. (The store is a map here: what
//! Redis would hold, keyed and valued the same way.)

use std::collections::HashMap;

use crate::common;

use common::*;
use pagedattn::blocks::{BlockManager, BlockManagerConfig, KvEvent, SeqId};
use pagedattn::gpu::{
    AttnOptions, Gpu, GpuError, KvCache, KvCacheConfig, KvDtype, KvLayout, PagedAttention,
    TransferError, KV_LAYOUT_BYTES,
};
use pagedattn::reference::{self, rel_l2, AttnParams};
use pagedattn::rng::SplitMix64;

const LAYERS: u32 = 2;
const BS: u32 = 16;
const KVH: u32 = 2;
const HEADS: u32 = 8;
const HD: u32 = 64;

type Store = HashMap<[u8; 32], Vec<u8>>;

/// K and V rows of the token at `pos` of `tokens`, layer `layer`: a
/// function of the tokens up to it, as a model's would be, so two engines
/// computing one prefix write the same values.
fn kv_row(tokens: &[u32], pos: usize, layer: u32) -> (Vec<f32>, Vec<f32>) {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ layer as u64;
    for &t in &tokens[..=pos] {
        h = (h ^ t as u64).wrapping_mul(0x100_0000_01b3);
    }
    let mut rng = SplitMix64::new(h);
    let n = (KVH * HD) as usize;
    (rng.signed_vec(n), rng.signed_vec(n))
}

struct Engine {
    m: BlockManager,
    kv: KvCache,
    attn: PagedAttention,
    /// The pool as the reference sees it.
    host: Vec<HostPool>,
    /// Tokens whose K/V this engine computed and wrote.
    computed: usize,
}

impl Engine {
    fn new(gpu: &Gpu) -> Engine {
        let cfg = KvCacheConfig::new(24, BS, KVH, HD)
            .with_layers(LAYERS)
            .with_dtype(KvDtype::F16);
        let kv = KvCache::new(gpu, cfg).unwrap();
        let attn = PagedAttention::new(gpu, &kv, HEADS, &Default::default()).unwrap();
        let mut m =
            BlockManager::new(BlockManagerConfig::new(24, BS).with_prefix_caching(true)).unwrap();
        m.scramble_free_list(7);
        m.record_events(true);
        let host = (0..LAYERS)
            .map(|_| HostPool::new(24, KVH as usize, BS as usize, HD as usize))
            .collect();
        Engine {
            m,
            kv,
            attn,
            host,
            computed: 0,
        }
    }

    /// Runs the sequence's pending tokens (a prefill step): writes their
    /// K/V in every layer.
    fn step(&mut self, gpu: &Gpu, id: SeqId) {
        let view = self.m.batch_view(&[id]).unwrap();
        let tokens = self.m.tokens(id).unwrap().to_vec();
        let n = view.slot_mapping.len();
        let first = tokens.len() - n;
        for l in 0..LAYERS {
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for pos in first..tokens.len() {
                let (kr, vr) = kv_row(&tokens, pos, l);
                k.extend(kr);
                v.extend(vr);
            }
            self.kv
                .write_kv(gpu, l, &k, &v, &view.slot_mapping)
                .unwrap();
            self.host[l as usize].write(&view.slot_mapping, &k, &v, Stored::F16);
        }
        self.computed += n;
    }

    /// Exports the blocks the manager reports stored into `store`:
    /// descriptor, then the block's bytes of every layer.
    fn publish(&mut self, gpu: &Gpu, store: &mut Store) -> usize {
        let mut n = 0;
        for e in self.m.take_events() {
            if let KvEvent::Stored { hash, block } = e {
                let mut bytes = vec![0u8; self.kv.export_bytes(1, 0..LAYERS).unwrap() as usize];
                let layout = self
                    .kv
                    .export_blocks(gpu, &[block], 0..LAYERS, &mut bytes)
                    .unwrap();
                let mut value = layout.to_bytes().to_vec();
                value.extend(bytes);
                store.insert(hash, value);
                n += 1;
            }
        }
        n
    }

    /// Admits `prompt` with whatever prefix `store` holds for it: imports
    /// those blocks, or on a refused value uncaches them and adds the
    /// prompt again without them. Returns the sequence and the blocks
    /// imported.
    fn admit(
        &mut self,
        gpu: &Gpu,
        prompt: &[u32],
        salt: &[u8],
        store: &Store,
    ) -> (SeqId, usize, Vec<GpuError>) {
        let found = self
            .m
            .prompt_hashes(prompt, salt)
            .iter()
            .take_while(|h| store.contains_key(*h))
            .count();
        let (id, imports) = self
            .m
            .add_sequence_with_remote(prompt, salt, found)
            .unwrap();
        let mut refused = Vec::new();
        for &(block, hash) in &imports {
            let value = &store[&hash];
            let r = KvLayout::from_bytes(&value[..KV_LAYOUT_BYTES.min(value.len())])
                .map_err(GpuError::from)
                .and_then(|layout| {
                    self.kv.import_blocks(
                        gpu,
                        &layout,
                        &value[KV_LAYOUT_BYTES.min(value.len())..],
                        &[block],
                    )
                });
            match r {
                Ok(()) => {
                    // The mirror: the bytes decoded as the pool holds them.
                    let tokens = self.m.tokens(id).unwrap().to_vec();
                    let i = self
                        .m
                        .block_table(id)
                        .unwrap()
                        .iter()
                        .position(|&b| b == block)
                        .unwrap();
                    let slots: Vec<u32> = (0..BS).map(|o| block * BS + o).collect();
                    for l in 0..LAYERS {
                        let (mut k, mut v) = (Vec::new(), Vec::new());
                        for pos in i * BS as usize..(i + 1) * BS as usize {
                            let (kr, vr) = kv_row(&tokens, pos, l);
                            k.extend(kr);
                            v.extend(vr);
                        }
                        self.host[l as usize].write(&slots, &k, &v, Stored::F16);
                    }
                }
                Err(e) => refused.push(e),
            }
        }
        if refused.is_empty() {
            return (id, imports.len(), refused);
        }
        // Imported blocks join the cache only when their step commits: a
        // refused import leaves nothing to uncache; freeing the sequence
        // is the whole recovery.
        let blocks: Vec<u32> = imports.iter().map(|i| i.0).collect();
        assert_eq!(self.m.uncache(&blocks), 0);
        self.m.free(id).unwrap();
        let id = self.m.add_sequence_salted(prompt, salt).unwrap();
        (id, 0, refused)
    }

    /// Decode of the sequence's next query on every layer, with its reference.
    fn decode(&mut self, gpu: &Gpu, id: SeqId, q: &[f32]) -> (Vec<f32>, Vec<f64>) {
        let view = self.m.batch_view(&[id]).unwrap();
        assert!(view.slot_mapping.is_empty());
        let (mut out, mut want) = (Vec::new(), Vec::new());
        let p = AttnParams::new(HEADS as usize, HD as usize);
        for l in 0..LAYERS {
            out.extend(
                self.attn
                    .decode(
                        gpu,
                        &self.kv,
                        l,
                        q,
                        &view.kv_indptr,
                        &view.kv_indices,
                        &view.seq_lens,
                        &AttnOptions::default(),
                    )
                    .unwrap(),
            );
            want.extend(reference::decode(
                &self.host[l as usize].view(),
                &p,
                q,
                &view.kv_indptr,
                &view.kv_indices,
                &view.seq_lens,
            ));
        }
        (out, want)
    }
}

fn prompt(rng: &mut SplitMix64, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(32000) as u32).collect()
}

#[test]
fn two_engines_share_a_prefix_through_a_store() {
    let Some(gpu) = gpu() else { return };
    let s = seed("remote prefix");
    let mut rng = SplitMix64::new(s);
    let system = prompt(&mut rng, 3 * BS as usize + 5);
    let cat = |tail: &[u32]| [system.as_slice(), tail].concat();
    let (pa, pb) = (cat(&prompt(&mut rng, 20)), cat(&prompt(&mut rng, 30)));
    let q = rng.signed_vec((HEADS * HD) as usize);
    let salt = b"tenant-1".as_slice();
    let mut store = Store::new();

    // A serves its prompt and publishes its full blocks.
    let mut a = Engine::new(&gpu);
    let ida = a.m.add_sequence_salted(&pa, salt).unwrap();
    a.step(&gpu, ida);
    let published = a.publish(&gpu, &mut store);
    assert_eq!(
        published,
        pa.len() / BS as usize,
        "every full block of A is stored"
    );

    // A cold engine computes B's prompt from scratch: the expected output.
    let mut cold = Engine::new(&gpu);
    let idc = cold.m.add_sequence_salted(&pb, salt).unwrap();
    cold.step(&gpu, idc);
    let (want_out, want_ref) = cold.decode(&gpu, idc, &q);
    assert!(rel_l2(&want_out, &want_ref) < 1e-5);

    // B finds the system prompt's three full blocks and computes the rest.
    let mut b = Engine::new(&gpu);
    let (idb, imported, refused) = b.admit(&gpu, &pb, salt, &store);
    assert!(refused.is_empty(), "{refused:?}");
    assert_eq!(
        imported, 3,
        "the system prompt's full blocks come from the store"
    );
    b.step(&gpu, idb);
    assert_eq!(
        b.computed,
        pb.len() - 3 * BS as usize,
        "B computes only the rest"
    );
    assert_eq!(b.m.remote_hit_tokens(), 3 * BS as u64);
    let (out, want) = b.decode(&gpu, idb, &q);
    let e = rel_l2(&out, &want);
    eprintln!(
        "B: {} of {} prompt tokens computed (cold: {}), rel L2 {e:.2e}, identical to cold: {}",
        b.computed,
        pb.len(),
        cold.computed,
        out == want_out
    );
    assert!(e < 1e-5, "{e:.2e} (seed {s})");
    assert!(out == want_out, "B's decode differs from the cold engine's");
    // The imported blocks joined B's own prefix cache: a second sequence
    // of B shares them without the store.
    let id2 = b.m.add_sequence_salted(&pb, salt).unwrap();
    assert_eq!(
        b.m.block_table(id2).unwrap()[..3],
        b.m.block_table(idb).unwrap()[..3]
    );

    // Another tenant's salt finds nothing.
    let mut t2 = Engine::new(&gpu);
    let (id, imported, _) = t2.admit(&gpu, &pb, b"tenant-2", &store);
    assert_eq!(imported, 0, "a cross-tenant lookup is a miss");
    t2.step(&gpu, id);
    assert_eq!(t2.computed, pb.len());

    // A corrupt value (a flipped shape byte) and a truncated one: refused,
    // and the sequence recomputes everything, with the cold engine's result.
    let hashes = a.m.prompt_hashes(&pb, salt);
    for (what, damage) in [
        (
            "corrupt",
            Box::new(|v: &mut Vec<u8>| v[32] ^= 0x40) as Box<dyn Fn(&mut Vec<u8>)>,
        ),
        (
            "truncated",
            Box::new(|v: &mut Vec<u8>| v.truncate(v.len() - 100)),
        ),
        (
            "descriptor cut short",
            Box::new(|v: &mut Vec<u8>| v.truncate(50)),
        ),
    ] {
        let mut bad = store.clone();
        damage(bad.get_mut(&hashes[1]).unwrap());
        let mut e = Engine::new(&gpu);
        let (id, imported, refused) = e.admit(&gpu, &pb, salt, &bad);
        assert_eq!(imported, 0);
        assert!(
            refused.iter().any(|r| matches!(
                r,
                GpuError::Transfer(
                    TransferError::Mismatch { .. }
                        | TransferError::Bytes { .. }
                        | TransferError::Descriptor(_)
                )
            )),
            "{what}: {refused:?}"
        );
        e.step(&gpu, id);
        assert_eq!(e.computed, pb.len(), "{what}: the sequence recomputes");
        let (out, _) = e.decode(&gpu, id, &q);
        assert!(out == want_out, "{what}: the recomputed output differs");
        eprintln!("{what} value: refused ({}), recomputed", refused[0]);
    }
}
