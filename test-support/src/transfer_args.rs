//! What crosses into a pool from elsewhere, driven by arbitrary bytes: KV
//! layout descriptors (`KvLayout::from_bytes`), import payloads
//! (`check_import_payload`, what `KvCache::import_blocks` checks before it
//! writes) and copy-on-write lists (`check_copies`, what `copy_blocks` and
//! `plan_write` check). None needs an adapter. Each must never panic and
//! must accept exactly what an independent statement of its contract
//! accepts. Shared by the fuzz target (`fuzz/fuzz_targets/transfer_args.rs`)
//! and its corpus replay (`tests/host/fuzz_corpus_gpu_args.rs`).
#![allow(dead_code)]

use pagedattn::gpu::{
    check_copies, check_import_payload, KvCacheConfig, KvDtype, KvLayout, KV_LAYOUT_BYTES, KV_MAX,
};

pub use crate::harness;

tally! {
    /// What one input reached, summed by the replay to show the corpus still
    /// covers every outcome.
    pub struct Reached: usize {
        descriptor_ok: "descriptors read",
        descriptor_err: "descriptors refused",
        payload_ok: "payloads accepted",
        payload_bad_value: "payloads refused for a value",
        payload_err: "payloads refused for their shape",
        copies_ok: "copy lists accepted",
        copies_race: "copy lists refused as racing",
        copies_outside: "copy lists refused as outside the pool",
    }
}

type Cursor<'a> = harness::Input<'a>;

/// Runs every check the input asks for and returns what was reached.
pub fn run(data: &[u8]) -> Reached {
    let mut c = Cursor::new(data);
    let mut r = Reached::default();
    while !c.done() {
        match c.byte() % 3 {
            0 => descriptor(&mut c, &mut r),
            1 => payload(&mut c, &mut r),
            _ => copies(&mut c, &mut r),
        }
    }
    r
}

/// Descriptor bytes: a real one, perturbed, or raw bytes of any length.
fn descriptor(c: &mut Cursor, r: &mut Reached) {
    let real = KvLayout {
        version: pagedattn::gpu::KV_LAYOUT_VERSION,
        library: [0, 1, 0],
        dtype: KvDtype::ALL[c.byte() as usize % KvDtype::ALL.len()],
        block_size: 16,
        num_kv_heads: 2,
        head_dim: 64,
        layer_group: 0,
        layers: 0..3,
        parts: [4096, 0, 4096, 0],
        layer_state: [c.byte(); 32],
    };
    let mut b = real.to_bytes().to_vec();
    match c.byte() % 4 {
        0 => {}
        1 => {
            let i = c.byte() as usize % b.len();
            b[i] = c.byte();
        }
        2 => b.truncate(c.byte() as usize % (KV_LAYOUT_BYTES + 1)),
        _ => {
            let n = c.byte() as usize % (KV_LAYOUT_BYTES + 4);
            b = (0..n).map(|_| c.byte()).collect();
        }
    }
    match KvLayout::from_bytes(&b) {
        Ok(l) => {
            // What was read is what was written, both ways.
            assert_eq!(b.len(), KV_LAYOUT_BYTES);
            assert_eq!(
                &l.to_bytes()[..],
                &b[..],
                "a descriptor reads back as it was"
            );
            assert_eq!(KvLayout::from_bytes(&l.to_bytes()).as_ref(), Ok(&l));
            r.descriptor_ok += 1;
        }
        Err(e) => {
            assert!(b.len() != KV_LAYOUT_BYTES || !e.to_string().is_empty());
            r.descriptor_err += 1;
        }
    }
}

/// f32 values a byte can pick: ordinary ones, the limits, and what no write
/// stores.
fn value(c: &mut Cursor) -> f32 {
    match c.byte() % 10 {
        0 => f32::NAN,
        1 => f32::INFINITY,
        2 => -f32::INFINITY,
        3 => KV_MAX,
        4 => f32::from_bits(KV_MAX.to_bits() + 1),
        5 => -KV_MAX,
        6 => 65504.0,
        7 => 65520.0,
        _ => (c.byte() as f32 - 128.0) / 8.0,
    }
}

/// Two bytes of `v` in `dtype`'s 16-bit encoding.
fn half_bytes(dtype: KvDtype, v: f32) -> [u8; 2] {
    match dtype {
        KvDtype::F16 => half::f16::from_f32(v).to_le_bytes(),
        _ => half::bf16::from_f32(v).to_le_bytes(),
    }
}

/// The contract of an import payload, stated independently: block-major,
/// each block's layers in order, each layer's K data, K side, V data, V
/// side; data values of f32/f16/bf16 pools finite and at most `KV_MAX` in
/// magnitude; int8 row scales (bf16, the low half of each K side word; V:
/// two a word, one when blocks hold one token) finite and at most
/// `KV_MAX / 64`; int8 values and fp8 bytes anything.
fn payload_valid(
    cfg: &KvCacheConfig,
    layers: u32,
    blocks: u64,
    parts: [usize; 4],
    b: &[u8],
) -> bool {
    let f32s = |s: &[u8]| {
        s.chunks_exact(4)
            .map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect::<Vec<_>>()
    };
    let f16s = |s: &[u8]| {
        s.chunks_exact(2)
            .map(|w| half::f16::from_le_bytes([w[0], w[1]]).to_f32())
            .collect::<Vec<_>>()
    };
    let bf16s = |s: &[u8]| {
        s.chunks_exact(2)
            .map(|w| half::bf16::from_le_bytes([w[0], w[1]]).to_f32())
            .collect::<Vec<_>>()
    };
    let ok = |v: &[f32], lim: f32| v.iter().all(|x| x.abs() <= lim);
    let per_layer: usize = parts.iter().sum();
    let mut at = 0;
    for _ in 0..blocks {
        for _ in 0..layers {
            for (p, &len) in parts.iter().enumerate() {
                let s = &b[at..at + len];
                at += len;
                let fine = match (cfg.dtype, p) {
                    (KvDtype::F32, 0 | 2) => ok(&f32s(s), KV_MAX),
                    (KvDtype::F16, 0 | 2) => ok(&f16s(s), KV_MAX),
                    (KvDtype::Bf16, 0 | 2) => ok(&bf16s(s), KV_MAX),
                    (KvDtype::Int8, 1) => s
                        .chunks_exact(4)
                        .all(|w| ok(&bf16s(&w[..2]), KV_MAX / 64.0)),
                    (KvDtype::Int8, 3) if cfg.block_size >= 2 => ok(&bf16s(s), KV_MAX / 64.0),
                    (KvDtype::Int8, 3) => s
                        .chunks_exact(4)
                        .all(|w| ok(&bf16s(&w[..2]), KV_MAX / 64.0)),
                    _ => true,
                };
                if !fine {
                    return false;
                }
            }
        }
    }
    debug_assert_eq!(at, per_layer * layers as usize * blocks as usize);
    true
}

/// A payload for a small pool: good values, some replaced by what the
/// input picks, and sometimes the wrong length or layer range.
fn payload(c: &mut Cursor, r: &mut Reached) {
    let dtype = KvDtype::ALL[c.byte() as usize % KvDtype::ALL.len()];
    let cfg = KvCacheConfig::new(
        8,
        [1, 2, 4][c.byte() as usize % 3],
        [1, 2][c.byte() as usize % 2],
        [4, 8][c.byte() as usize % 2],
    )
    .with_layers(1 + c.byte() as u32 % 3)
    .with_dtype(dtype);
    let first = c.byte() as u32 % cfg.num_layers;
    let end = first + 1 + c.byte() as u32 % (cfg.num_layers - first);
    let blocks = 1 + c.byte() as u64 % 3;
    // The part sizes, as the pool lays a block out.
    let rows = (cfg.num_kv_heads * cfg.block_size) as usize;
    let data = rows * cfg.head_dim as usize * dtype.bytes() as usize;
    let side = |is_k| cfg.side_words_per_block(is_k) as usize * 4;
    let parts = [data, side(true), data, side(false)];
    let layers = end - first;
    let len = parts.iter().sum::<usize>() * layers as usize * blocks as usize;
    // Good bytes: zeros are a good value, and a scale of zero, everywhere.
    let mut b = vec![0u8; len];
    for _ in 0..c.byte() % 4 {
        if len == 0 {
            break;
        }
        let v = value(c);
        let at = (c.byte() as usize * 61 + c.byte() as usize) % len;
        match dtype {
            KvDtype::F32 => {
                let at = at / 4 * 4;
                b[at..at + 4].copy_from_slice(&v.to_le_bytes());
            }
            _ => {
                let at = at / 2 * 2;
                b[at..at + 2].copy_from_slice(&half_bytes(dtype, v));
            }
        }
    }
    let (mut range, mut bytes) = (first..end, b.clone());
    match c.byte() % 8 {
        0 => {
            bytes.pop();
        }
        1 => bytes.push(c.byte()),
        2 => range = first..cfg.num_layers + 1,
        _ => {}
    }
    let shape_ok = bytes.len() == len && range.end <= cfg.num_layers;
    let got = check_import_payload(&cfg, range, blocks, &bytes);
    match got {
        Ok(()) => {
            assert!(
                shape_ok && payload_valid(&cfg, layers, blocks, parts, &bytes),
                "accepted a bad payload"
            );
            r.payload_ok += 1;
        }
        Err(pagedattn::gpu::GpuError::Transfer(pagedattn::gpu::TransferError::Value {
            ..
        })) => {
            assert!(
                shape_ok && !payload_valid(&cfg, layers, blocks, parts, &bytes),
                "refused a good payload"
            );
            r.payload_bad_value += 1;
        }
        Err(e) => {
            assert!(!shape_ok, "refused a payload of the right shape: {e}");
            r.payload_err += 1;
        }
    }
}

/// A copy list over a small pool.
fn copies(c: &mut Cursor, r: &mut Reached) {
    let nb = 1 + c.byte() as u32 % 12;
    let n = c.byte() as usize % 6;
    let block = |c: &mut Cursor| match c.byte() % 6 {
        0 => u32::MAX,
        1 => nb,
        _ => c.byte() as u32 % nb,
    };
    let list: Vec<[u32; 2]> = (0..n).map(|_| [block(c), block(c)]).collect();
    let outside = list.iter().flatten().any(|&b| b >= nb);
    let dsts: Vec<u32> = list.iter().map(|p| p[1]).collect();
    let race = (0..dsts.len())
        .any(|i| dsts[i + 1..].contains(&dsts[i]) || list.iter().any(|p| p[0] == dsts[i]));
    match check_copies(nb, &list) {
        Ok(()) => {
            assert!(!outside && !race, "{list:?} over {nb} blocks accepted");
            r.copies_ok += 1;
        }
        Err(e) if e.to_string().contains("would race") => {
            assert!(!outside && race, "{list:?}: {e}");
            r.copies_race += 1;
        }
        Err(e) => {
            assert!(
                outside && e.to_string().contains("outside the pool"),
                "{list:?}: {e}"
            );
            r.copies_outside += 1;
        }
    }
}
