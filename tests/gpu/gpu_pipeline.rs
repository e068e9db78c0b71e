//! End-to-end paths on a real adapter: copy-on-write across forked branches,
//! and corrupt block tables (defined, bounds-safe result). The engine's
//! plan/run path over its own buffers is `embed`'s.

use crate::common;

use common::*;
use pagedattn::blocks::{BlockManager, BlockManagerConfig};
use pagedattn::gpu::{
    AttentionConfig, AttnOptions, DecodeTables, Gpu, Kernel, KvCache, KvCacheConfig, KvDtype,
    PagedAttention, ShaderChecks,
};
use pagedattn::reference::{self, rel_l2, AttnParams};
use pagedattn::rng::SplitMix64;

const KVH: u32 = 2;
const HEADS: u32 = 8;
const HD: u32 = 64;

fn cache(gpu: &Gpu, layers: u32, num_blocks: u32, bs: u32, dtype: KvDtype) -> KvCache {
    let cfg = KvCacheConfig::new(num_blocks, bs, KVH, HD)
        .with_layers(layers)
        .with_dtype(dtype);
    KvCache::new(gpu, cfg).unwrap()
}

/// Fork a sequence mid-block, let the branches diverge over several steps
/// (copy_blocks before write_kv each step), and check that each branch's
/// decode equals a from-scratch run of that branch alone, on a fresh pool.
#[test]
fn copy_on_write_branches_match_from_scratch() {
    let Some(gpu) = gpu() else { return };
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let s = seed("cow");
        let mut rng = SplitMix64::new(s);
        let bs = 16;
        let row = (KVH * HD) as usize;
        let mut m = BlockManager::new(BlockManagerConfig::new(64, bs)).unwrap();
        m.scramble_free_list(rng.next_u64());
        let kv = cache(&gpu, 1, 64, bs, dtype);
        let attn = PagedAttention::new(&gpu, &kv, HEADS, &Default::default()).unwrap();

        // Prompt of 37 tokens: the last block is partly filled, so the first
        // write of each branch after the fork must copy it.
        let parent = m.add_sequence(&[1; 37]).unwrap();
        let view = m.batch_view(&[parent]).unwrap();
        let prompt_k = rng.signed_vec(37 * row);
        let prompt_v = rng.signed_vec(37 * row);
        kv.write_kv(&gpu, 0, &prompt_k, &prompt_v, &view.slot_mapping)
            .unwrap();
        let child = m.fork(parent).unwrap();
        let branches = [parent, child];
        // Each branch's own token history (K, V rows), for the from-scratch run.
        let mut hist: Vec<(Vec<f32>, Vec<f32>)> = vec![(prompt_k.clone(), prompt_v.clone()); 2];
        let mut copies = 0;
        let mut last_out = Vec::new();
        let mut last_q = Vec::new();
        for _step in 0..20 {
            for &b in &branches {
                m.append(b, &[rng.below(100) as u32]).unwrap();
            }
            let view = m.batch_view(&branches).unwrap();
            copies += view.copies.len();
            kv.copy_blocks(&gpu, &view.copies).unwrap();
            let k = rng.signed_vec(2 * row);
            let v = rng.signed_vec(2 * row);
            kv.write_kv(&gpu, 0, &k, &v, &view.slot_mapping).unwrap();
            for i in 0..2 {
                hist[i].0.extend_from_slice(&k[i * row..(i + 1) * row]);
                hist[i].1.extend_from_slice(&v[i * row..(i + 1) * row]);
            }
            last_q = rng.signed_vec(2 * (HEADS * HD) as usize);
            last_out =
                decode_view(&attn, &gpu, &kv, &last_q, &view, &AttnOptions::default()).unwrap();
        }
        assert_eq!(
            copies, 1,
            "exactly one copy-on-write: the shared partial block"
        );
        assert!(
            m.stats().shared >= 2,
            "the two full prompt blocks stay shared"
        );

        // From scratch: each branch alone on a fresh pool.
        let per = (HEADS * HD) as usize;
        for (i, (hk, hv)) in hist.iter().enumerate() {
            let n = hk.len() / row;
            let mut fm = BlockManager::new(BlockManagerConfig::new(8, bs)).unwrap();
            let id = fm.add_sequence(&vec![0; n]).unwrap();
            let fv = fm.batch_view(&[id]).unwrap();
            let fresh = cache(&gpu, 1, 8, bs, dtype);
            fresh.write_kv(&gpu, 0, hk, hv, &fv.slot_mapping).unwrap();
            let q = &last_q[i * per..(i + 1) * per];
            let alone = attn_for(&gpu, &fresh)
                .decode(
                    &gpu,
                    &fresh,
                    0,
                    q,
                    &fv.kv_indptr,
                    &fv.kv_indices,
                    &fv.seq_lens,
                    &AttnOptions::default(),
                )
                .unwrap();
            let shared_run = &last_out[i * per..(i + 1) * per];
            let mut host = HostPool::new(8, KVH as usize, bs as usize, HD as usize);
            host.write(&fv.slot_mapping, hk, hv, Stored::from(dtype));
            let want = reference::decode(
                &host.view(),
                &AttnParams::new(HEADS as usize, HD as usize),
                q,
                &fv.kv_indptr,
                &fv.kv_indices,
                &fv.seq_lens,
            );
            let e_ref = rel_l2(shared_run, &want);
            let alone64: Vec<f64> = alone.iter().map(|&x| x as f64).collect();
            let e_scratch = rel_l2(shared_run, &alone64);
            eprintln!("{dtype:?} branch {i}: vs reference {e_ref:.2e}, vs from-scratch GPU run {e_scratch:.2e}");
            assert!(
                e_ref < 1e-5 && e_scratch < 1e-5,
                "branch {i}: {e_ref:.2e} / {e_scratch:.2e} (seed {s})"
            );
        }
    }
}

fn attn_for(gpu: &Gpu, kv: &KvCache) -> PagedAttention {
    PagedAttention::new(gpu, kv, HEADS, &Default::default()).unwrap()
}

/// Table entries outside the pool, and a CSR range past kv_indices, through
/// the unchecked plan (`plan_decode_unchecked`, a test hook past the host
/// check): the kernel skips those tokens (the reference
/// does the same), reads nothing out of bounds, and writes finite values; a
/// sequence with no readable token gets zeros.
#[test]
fn corrupt_tables_are_skipped_not_read() {
    let Some(gpu) = gpu() else { return };
    // Every kernel, built with wgpu's runtime checks and trusted (without
    // them, the native default): the kernels' own tests of each table
    // entry must hold either way, and the host refuses the same tables
    // before any dispatch.
    for kernel in Kernel::ALL {
        for checks in [ShaderChecks::Checked, ShaderChecks::Trusted] {
            corrupt_tables_case(&gpu, kernel, checks);
        }
    }
}

fn corrupt_tables_case(gpu: &Gpu, kernel: Kernel, checks: ShaderChecks) {
    let gpu = gpu.clone();
    let s = seed("corrupt tables");
    let mut rng = SplitMix64::new(s);
    let (bs, nb) = (16u32, 6u32);
    let kv = cache(&gpu, 1, nb, bs, KvDtype::F32);
    let config = AttentionConfig::new().kernel(kernel).shader_checks(checks);
    let attn = PagedAttention::new(&gpu, &kv, HEADS, &config).unwrap();
    let slots: Vec<u32> = (0..nb * bs).collect();
    let row = (KVH * HD) as usize;
    let (k, v) = (
        rng.signed_vec(slots.len() * row),
        rng.signed_vec(slots.len() * row),
    );
    kv.write_kv(&gpu, 0, &k, &v, &slots).unwrap();
    let mut host = HostPool::new(nb as usize, KVH as usize, bs as usize, HD as usize);
    host.write(&slots, &k, &v, Stored::from(KvDtype::F32));
    // seq 0: a block id past the pool in the middle and u32::MAX at the end;
    // seq 1: repeated block ids; seq 2: only bad ids (all masked -> zeros);
    // seq 3: its CSR range runs past the end of kv_indices.
    let kv_indices = vec![2, nb, 4, u32::MAX, 1, 1, 1, nb + 7, u32::MAX, 5];
    let kv_indptr = vec![0, 4, 7, 9, 14];
    let seq_lens = vec![60, 40, 20, 70];
    let n = seq_lens.len();
    let qlen = n * (HEADS * HD) as usize;
    let q = rng.signed_vec(qlen);
    let mut plan = attn.plan();
    let t = DecodeTables {
        kv_indptr: &kv_indptr,
        kv_indices: &kv_indices,
        seq_lens: &seq_lens,
    };
    attn.plan_decode_unchecked(&gpu, &mut plan, &t, &[AttnOptions::default()])
        .unwrap();
    let qb = gpu.storage_init("q", &q).unwrap();
    let out = gpu.storage("out", (qlen * 4) as u64).unwrap();
    gpu.queue
        .write_buffer(&out, 0, bytemuck::cast_slice(&vec![f32::NAN; qlen]));
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    let (qr, outr) = (
        qb.as_entire_buffer_binding(),
        out.as_entire_buffer_binding(),
    );
    attn.run(&gpu, &mut enc, &mut plan, &kv, 0, 0, &qr, &outr)
        .unwrap();
    gpu.queue.submit([enc.finish()]);
    let got: Vec<f32> = gpu.read(&out, (qlen * 4) as u64).unwrap();
    let want = reference::decode(
        &host.view(),
        &AttnParams::new(HEADS as usize, HD as usize),
        &q,
        &kv_indptr,
        &kv_indices,
        &seq_lens,
    );
    let e = rel_l2(&got, &want);
    eprintln!("corrupt tables [{kernel}, {checks:?}]: rel L2 {e:.2e}");
    assert!(e < 1e-5, "[{kernel}, {checks:?}] {e:.2e} (seed {s})");
    let per = (HEADS * HD) as usize;
    assert!(
        got[2 * per..3 * per].iter().all(|&x| x == 0.0),
        "[{kernel}, {checks:?}] a sequence with no readable token writes zeros"
    );
    // The checked host path refuses the same tables.
    let err = attn
        .decode(
            &gpu,
            &kv,
            0,
            &q,
            &kv_indptr,
            &kv_indices,
            &seq_lens,
            &AttnOptions::default(),
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("kv_indptr") || err.to_string().contains("outside the pool"),
        "{err}"
    );
}

/// Sliding window with the blocks outside it released by the block manager:
/// the tables then hold RELEASED entries, and decode still equals the
/// reference with the window (and the result before the release).
#[test]
fn sliding_window_after_releasing_old_blocks() {
    let Some(gpu) = gpu() else { return };
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let s = seed("window release");
        let mut rng = SplitMix64::new(s);
        let (bs, lens, window) = (16u32, [300usize, 47, 5], 40u32);
        let nb = blocks_for(&lens, bs, 4);
        let (mut m, ids, view) = shuffled_batch(&mut rng, nb, bs, &lens);
        let kv = cache(&gpu, 1, nb, bs, dtype);
        let attn = PagedAttention::new(&gpu, &kv, HEADS, &Default::default()).unwrap();
        let row = (KVH * HD) as usize;
        let n = view.slot_mapping.len();
        let (k, v) = (rng.signed_vec(n * row), rng.signed_vec(n * row));
        kv.write_kv(&gpu, 0, &k, &v, &view.slot_mapping).unwrap();
        let mut host = HostPool::new(nb as usize, KVH as usize, bs as usize, HD as usize);
        host.write(&view.slot_mapping, &k, &v, Stored::from(dtype));
        let q = rng.signed_vec(lens.len() * (HEADS * HD) as usize);
        let opts = AttnOptions {
            sliding_window: Some(window),
            ..Default::default()
        };
        let before = decode_view(&attn, &gpu, &kv, &q, &view, &opts).unwrap();
        let free0 = m.stats().free;
        let released: usize = ids
            .iter()
            .map(|&id| m.release_outside_window(id, window as usize).unwrap())
            .sum();
        assert_eq!(
            released,
            (300 - 40) / 16,
            "the long sequence drops its old blocks"
        );
        assert_eq!(m.stats().free, free0 + released);
        let after_view = m.batch_view(&ids).unwrap();
        let after = decode_view(&attn, &gpu, &kv, &q, &after_view, &opts).unwrap();
        let mut p = AttnParams::new(HEADS as usize, HD as usize);
        p.sliding_window = Some(window);
        let want = reference::decode(
            &host.view(),
            &p,
            &q,
            &after_view.kv_indptr,
            &after_view.kv_indices,
            &after_view.seq_lens,
        );
        let e = rel_l2(&after, &want);
        let same = before.iter().zip(&after).all(|(a, b)| a == b);
        eprintln!("{dtype:?}: released {released} blocks, rel L2 {e:.2e}, identical to before release: {same}");
        assert!(e < 1e-5, "{e:.2e} (seed {s})");
        assert!(
            same,
            "releasing blocks outside the window must not change the output"
        );
    }
}

/// StreamingLLM through the block manager: a 6000-token sequence keeps its
/// 4 sink tokens and a 256-token window, and the blocks between are
/// released (counted: the pool gets them back). The table keeps its length
/// (the released middle is `RELEASED`), so positions stay right: decode on
/// every kernel, unsplit and split-K, is bit-identical before and after the
/// release and matches the f64 reference; a prefill chunk appended after
/// the release matches it too.
#[test]
fn streaming_llm_releases_the_middle_blocks() {
    use pagedattn::blocks::RELEASED;
    use pagedattn::gpu::{Kernel, Split};
    let Some(gpu) = gpu() else { return };
    let s = seed("streaming llm");
    let mut rng = SplitMix64::new(s);
    let (bs, sinks, window) = (16u32, 4u32, 256u32);
    let lens = [6000usize, 40];
    let chunk = 24usize;
    let nb = blocks_for(&lens, bs, 4);
    let (mut m, ids, view) = shuffled_batch(&mut rng, nb, bs, &lens);
    let kv = cache(&gpu, 1, nb, bs, KvDtype::F16);
    let row = (KVH * HD) as usize;
    let n = view.slot_mapping.len();
    let (k, v) = (rng.signed_vec(n * row), rng.signed_vec(n * row));
    kv.write_kv(&gpu, 0, &k, &v, &view.slot_mapping).unwrap();
    let mut host = HostPool::new(nb as usize, KVH as usize, bs as usize, HD as usize);
    host.write(&view.slot_mapping, &k, &v, Stored::F16);
    let q = rng.signed_vec(lens.len() * (HEADS * HD) as usize);
    let base = AttnOptions {
        sliding_window: Some(window),
        sink_tokens: Some(sinks),
        ..Default::default()
    };
    let variants = [Split::Never, Split::Tokens(64)].map(|split| AttnOptions {
        split,
        ..base.clone()
    });
    let mut before = Vec::new();
    for kernel in Kernel::ALL {
        let attn = PagedAttention::new(
            &gpu,
            &kv,
            HEADS,
            &pagedattn::gpu::AttentionConfig::new().kernel(kernel),
        )
        .unwrap();
        for o in &variants {
            before.push(decode_view(&attn, &gpu, &kv, &q, &view, o).unwrap());
        }
    }

    let free0 = m.stats().free;
    let released = m
        .release_outside_sinks_and_window(ids[0], sinks as usize, window as usize)
        .unwrap();
    // Blocks wholly before the window: (6000 - 256) / 16 = 359; the first
    // holds the sink tokens and stays.
    assert_eq!(released, 358, "the middle blocks are released");
    assert_eq!(m.release_outside_window(ids[1], window as usize), Ok(0));
    assert_eq!(m.stats().free, free0 + released, "the pool gets them back");
    let after_view = m.batch_view(&ids).unwrap();
    assert_eq!(
        after_view.kv_indptr, view.kv_indptr,
        "the tables keep their length"
    );
    let gone = after_view
        .kv_indices
        .iter()
        .filter(|&&b| b == RELEASED)
        .count();
    assert_eq!(gone, released);
    assert_ne!(after_view.kv_indices[0], RELEASED, "the sink block stays");
    let p = ref_params(HEADS, HD, &base);
    let want = reference::decode(
        &host.view(),
        &p,
        &q,
        &after_view.kv_indptr,
        &after_view.kv_indices,
        &after_view.seq_lens,
    );
    let mut i = 0;
    for kernel in Kernel::ALL {
        let attn = PagedAttention::new(
            &gpu,
            &kv,
            HEADS,
            &pagedattn::gpu::AttentionConfig::new().kernel(kernel),
        )
        .unwrap();
        for o in &variants {
            let after = decode_view(&attn, &gpu, &kv, &q, &after_view, o).unwrap();
            let e = rel_l2(&after, &want);
            eprintln!(
                "[{kernel}, {:?}]: {released} of {} blocks released, rel L2 {e:.2e}",
                o.split,
                lens[0].div_ceil(bs as usize)
            );
            assert!(e < 1e-5, "[{kernel}, {:?}] {e:.2e} (seed {s})", o.split);
            assert!(
                after == before[i],
                "[{kernel}, {:?}] releasing the middle blocks changed the output",
                o.split
            );
            i += 1;
        }
    }

    // A chunk appended after the release: its rows see the sinks and their
    // windows, at the right positions.
    let toks: Vec<u32> = (0..chunk).map(|_| rng.below(32000) as u32).collect();
    m.append(ids[0], &toks).unwrap();
    let cv = m.batch_view(&ids[..1]).unwrap();
    assert_eq!(cv.slot_mapping.len(), chunk);
    let (k, v) = (rng.signed_vec(chunk * row), rng.signed_vec(chunk * row));
    kv.write_kv(&gpu, 0, &k, &v, &cv.slot_mapping).unwrap();
    host.write(&cv.slot_mapping, &k, &v, Stored::F16);
    let q = rng.signed_vec(chunk * (HEADS * HD) as usize);
    let qo = [0, chunk as u32];
    let want = reference::prefill(
        &host.view(),
        &p,
        &q,
        &qo,
        &cv.kv_indptr,
        &cv.kv_indices,
        &cv.seq_lens,
    );
    let attn = PagedAttention::new(&gpu, &kv, HEADS, &Default::default()).unwrap();
    for o in [&base, &variants[1]] {
        let out = attn
            .prefill(
                &gpu,
                &kv,
                0,
                &q,
                &qo,
                &cv.kv_indptr,
                &cv.kv_indices,
                &cv.seq_lens,
                o,
            )
            .unwrap();
        let e = rel_l2(&out, &want);
        eprintln!(
            "prefill chunk after the release, {:?}: rel L2 {e:.2e}",
            o.split
        );
        assert!(e < 1e-5, "prefill {:?}: {e:.2e} (seed {s})", o.split);
    }
}
