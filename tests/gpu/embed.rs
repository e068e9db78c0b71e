//! Embedding, as an engine does it: the engine's own device, plan then run
//! with no allocation in steady state, the engine's buffers as ranges of
//! an arena (and K/V/Q read straight from a fused QKV output), misuse
//! refused before anything is recorded. Outputs are checked against the
//! f64 reference (f32 KV: relative L2 < 1e-5); seeds are fixed per test
//! (`PAGEDATTN_SEED` overrides).

use crate::common;

use std::num::NonZeroU64;
use std::sync::{Arc, Mutex};

use common::*;
use pagedattn::blocks::{BatchView, BlockManager, BlockManagerConfig, SeqId};
use pagedattn::gpu::{
    ActDtype, AttnOptions, DecodeTables, Gpu, GpuError, KvCache, KvCacheConfig, KvDtype,
    PagedAttention, PlanMismatch, PrefillTables,
};
use pagedattn::reference::{self, rel_l2, AttnParams};
use pagedattn::rng::SplitMix64;

const LAYERS: u32 = 32;
const KVH: u32 = 2;
const GROUP: u32 = 2;
const HEADS: u32 = KVH * GROUP;
const HD: u32 = 32;
const BS: u32 = 16;
const NB: u32 = 96;
const MAX_TOKENS: u64 = 128;
const TOL: f64 = 1e-5;

/// The engine side: its device, its arenas of activations. Inputs and
/// outputs live in two buffers: a dispatch may not read and write one
/// buffer, even at different ranges (WebGPU's usage rule).
struct Engine {
    gpu: Gpu,
    /// Per layer a Q slot and, unused, an out-sized slot, then K and V, of
    /// `MAX_TOKENS` rows each.
    arena: wgpu::Buffer,
    /// Per layer, at the same offsets as `arena`: the outputs.
    outs: wgpu::Buffer,
    slot: u64,
}

fn engine_device() -> Option<(wgpu::Device, wgpu::Queue)> {
    // The engine opens its device the way it likes; pagedattn borrows it.
    let inst = wgpu::Instance::new({
        let mut d = wgpu::InstanceDescriptor::new_without_display_handle();
        d.backends = common::backends().ok()?;
        d
    });
    let adapter = pollster::block_on(inst.request_adapter(&Default::default())).ok()?;
    let limits = adapter.limits();
    pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("engine"),
        required_features: wgpu::Features::empty(),
        required_limits: limits,
        ..Default::default()
    }))
    .ok()
}

fn engine() -> Option<Engine> {
    let Some((device, queue)) = engine_device() else {
        gpu()?; // fails under PAGEDATTN_REQUIRE_GPU, skips otherwise
        return None;
    };
    let gpu = Gpu::from_device(&device, &queue);
    eprintln!("engine device on {}", gpu.describe());
    let row = (HEADS * HD * 4) as u64;
    let slot = (MAX_TOKENS * row).next_multiple_of(256);
    let make = |label| {
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: slot * 4 * LAYERS as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    };
    let (arena, outs) = (make("engine arena"), make("engine outputs"));
    Some(Engine {
        gpu,
        arena,
        outs,
        slot,
    })
}

impl Engine {
    /// Range `which` (0 q, 1 out, 2 k, 3 v) of `layer`.
    fn range(&self, layer: u32, which: u64, bytes: u64) -> wgpu::BufferBinding<'_> {
        wgpu::BufferBinding {
            buffer: if which == 1 { &self.outs } else { &self.arena },
            offset: (layer as u64 * 4 + which) * self.slot,
            size: NonZeroU64::new(bytes.max(4)),
        }
    }
}

/// One step of a 32-layer stack: writes random K/V and Q for every layer
/// into the arena, plans, records everything in one encoder, one submit.
/// Returns the inputs written per layer (k, v, q).
struct Step {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    q: Vec<Vec<f32>>,
}

#[allow(clippy::too_many_arguments)]
fn record_step(
    e: &Engine,
    rng: &mut SplitMix64,
    cache: &KvCache,
    attn: &PagedAttention,
    wplan: &mut pagedattn::gpu::WritePlan,
    aplan: &mut pagedattn::gpu::AttentionPlan,
    view: &BatchView,
    prefill: bool,
    variants: &[AttnOptions],
) -> Result<Step, GpuError> {
    let gpu = &e.gpu;
    let ntok = view.slot_mapping.len();
    cache.plan_write(gpu, wplan, &view.slot_mapping, &view.copies)?;
    if prefill {
        attn.plan_prefill(gpu, aplan, &PrefillTables::from_view(view), variants)?;
    } else {
        attn.plan_decode(gpu, aplan, &DecodeTables::from_view(view), variants)?;
    }
    let nq = aplan.num_queries() as usize;
    let kv_row = (KVH * HD) as usize;
    let q_row = (HEADS * HD) as usize;
    let mut st = Step {
        k: vec![],
        v: vec![],
        q: vec![],
    };
    for l in 0..LAYERS {
        let (k, v, q) = (
            rng.signed_vec(ntok * kv_row),
            rng.signed_vec(ntok * kv_row),
            rng.signed_vec(nq * q_row),
        );
        let at = |w: u64| (l as u64 * 4 + w) * e.slot;
        gpu.queue
            .write_buffer(&e.arena, at(2), bytemuck::cast_slice(&k));
        gpu.queue
            .write_buffer(&e.arena, at(3), bytemuck::cast_slice(&v));
        gpu.queue
            .write_buffer(&e.arena, at(0), bytemuck::cast_slice(&q));
        st.k.push(k);
        st.v.push(v);
        st.q.push(q);
    }
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    cache.run_copy_blocks(gpu, &mut enc, wplan)?;
    // Fixed ranges (a slot of MAX_TOKENS rows), as an engine binds its
    // arena: the bind groups then do not depend on the batch size.
    let (kv_bytes, q_bytes) = (e.slot, e.slot);
    assert!(ntok as u64 <= MAX_TOKENS && nq as u64 <= MAX_TOKENS);
    for l in 0..LAYERS {
        cache.run_write_kv(
            gpu,
            &mut enc,
            wplan,
            l,
            &e.range(l, 2, kv_bytes),
            &e.range(l, 3, kv_bytes),
        )?;
        let variant = (l % variants.len() as u32) as usize;
        attn.run(
            gpu,
            &mut enc,
            aplan,
            cache,
            l,
            variant,
            &e.range(l, 0, q_bytes),
            &e.range(l, 1, q_bytes),
        )?;
    }
    gpu.queue.submit([enc.finish()]);
    Ok(st)
}

/// Checks every layer's output against the reference over host mirrors.
fn check_outputs(
    e: &Engine,
    hosts: &[HostPool],
    st: &Step,
    view: &BatchView,
    prefill: bool,
    variants: &[AttnOptions],
    what: &str,
    seed: u64,
) {
    let all: Vec<f32> = e.gpu.read(&e.outs, e.outs.size()).unwrap();
    let q_row = (HEADS * HD) as usize;
    for l in 0..LAYERS as usize {
        let o = &variants[l % variants.len()];
        let mut p = AttnParams::new(HEADS as usize, HD as usize);
        p.sliding_window = o.sliding_window;
        let qo: Vec<u32> = if prefill {
            view.new_indptr.clone()
        } else {
            (0..=view.seq_lens.len() as u32).collect()
        };
        let nq = qo[qo.len() - 1] as usize;
        let want = reference::prefill(
            &hosts[l].view(),
            &p,
            &st.q[l],
            &qo,
            &view.kv_indptr,
            &view.kv_indices,
            &view.seq_lens,
        );
        let at = ((l as u64 * 4 + 1) * e.slot / 4) as usize;
        let got = &all[at..at + nq * q_row];
        let err = rel_l2(got, &want);
        assert!(
            err < TOL,
            "{what}: layer {l}: rel L2 {err:.3e} (seed {seed})"
        );
    }
}

fn mirror_step(hosts: &mut [HostPool], st: &Step, view: &BatchView) {
    for (l, h) in hosts.iter_mut().enumerate() {
        for c in &view.copies {
            h.copy(c[0], c[1]);
        }
        h.write(
            &view.slot_mapping,
            &st.k[l],
            &st.v[l],
            Stored::from(KvDtype::F32),
        );
    }
}

/// The engine's device, borrowed: 32 layers, each step one encoder and one
/// submit; a prefill step, decode steps with parallel samples
/// (copy-on-write), a mixed step (a new prompt while others decode), full
/// and sliding-window layers. After the first step of each kind, no step
/// creates a buffer or a bind group; every layer's output matches the
/// reference.
#[test]
fn steady_state_steps_create_nothing() {
    let Some(e) = engine() else { return };
    let s = seed("embed steady state");
    let mut rng = SplitMix64::new(s);
    let gpu = &e.gpu;
    let cfg = KvCacheConfig::new(NB, BS, KVH, HD).with_layers(LAYERS);
    let cache = KvCache::new(gpu, cfg).unwrap();
    let attn = PagedAttention::new(gpu, &cache, HEADS, &Default::default()).unwrap();
    attn.warm_up(gpu, &[ActDtype::F32]).unwrap();
    let variants = [
        AttnOptions::default(),
        AttnOptions {
            sliding_window: Some(24),
            ..Default::default()
        },
    ];
    let mut hosts: Vec<HostPool> = (0..LAYERS)
        .map(|_| HostPool::new(NB as usize, KVH as usize, BS as usize, HD as usize))
        .collect();
    let mut m =
        BlockManager::new(BlockManagerConfig::new(NB, BS).with_prefix_caching(true)).unwrap();
    let mut wplan = cache.plan();
    let mut aplan = attn.plan();
    let prompt = |rng: &mut SplitMix64, n: usize| -> Vec<u32> {
        (0..n).map(|_| rng.below(1000) as u32).collect()
    };

    // Step 1: prefill of two prompts.
    let mut seqs: Vec<SeqId> = vec![
        m.add_sequence(&prompt(&mut rng, 37)).unwrap(),
        m.add_sequence(&prompt(&mut rng, 20)).unwrap(),
    ];
    let view = m.batch_view(&seqs).unwrap();
    let st = record_step(
        &e, &mut rng, &cache, &attn, &mut wplan, &mut aplan, &view, true, &variants,
    )
    .unwrap();
    mirror_step(&mut hosts, &st, &view);
    check_outputs(&e, &hosts, &st, &view, true, &variants, "prefill step", s);
    // Parallel samples: 2 forks of the first sequence.
    for _ in 0..2 {
        seqs.push(m.fork(seqs[0]).unwrap());
    }
    let mut baseline = None;
    let mut steady = 0;
    let mut copies = 0;
    for step in 2..=8 {
        let mixed = step == 6;
        if mixed {
            seqs.push(m.add_sequence(&prompt(&mut rng, 19)).unwrap());
        }
        let live: Vec<SeqId> = seqs.clone();
        for &id in &live {
            if m.pending_tokens(id).unwrap() == 0 {
                m.append(id, &[rng.below(1000) as u32]).unwrap();
            }
        }
        let view = m.batch_view(&live).unwrap();
        copies += view.copies.len();
        let before = gpu.counters();
        let st = record_step(
            &e, &mut rng, &cache, &attn, &mut wplan, &mut aplan, &view, mixed, &variants,
        )
        .unwrap();
        let after = gpu.counters();
        if step >= 3 {
            // The first decode step made the decode bind groups; the mixed
            // step reuses the prefill ones of step 1.
            assert_eq!(
                after.buffers, before.buffers,
                "step {step} (mixed: {mixed}) created buffers"
            );
            assert_eq!(
                after.bind_groups, before.bind_groups,
                "step {step} (mixed: {mixed}) created bind groups"
            );
            steady += 1;
        }
        if step == 2 {
            baseline = Some(after);
        }
        mirror_step(&mut hosts, &st, &view);
        check_outputs(
            &e,
            &hosts,
            &st,
            &view,
            mixed,
            &variants,
            &format!("step {step}"),
            s,
        );
    }
    assert!(copies > 0, "copy-on-write happened");
    eprintln!(
        "{steady} steady steps of {LAYERS} layers; objects after step 2: {:?}, at the end: {:?}",
        baseline.unwrap(),
        gpu.counters()
    );
    assert!(m.stats().shared > 0, "parallel samples share blocks");
}

/// Misuse of the engine's buffers is refused before anything is recorded:
/// no STORAGE usage, an unaligned offset, a range too small, a range past
/// the buffer, a plan of another kernel, and running before planning.
#[test]
fn engine_buffer_misuse_is_refused_before_recording() {
    let Some(e) = engine() else { return };
    let gpu = &e.gpu;
    let cfg = KvCacheConfig::new(8, BS, KVH, HD).with_layers(2);
    let cache = KvCache::new(gpu, cfg).unwrap();
    let attn = PagedAttention::new(gpu, &cache, HEADS, &Default::default()).unwrap();
    let other = PagedAttention::new(gpu, &cache, HEADS, &Default::default()).unwrap();
    let mut aplan = attn.plan();
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    let q_bytes = (2 * HEADS * HD * 4) as u64;
    let fine = e.range(0, 0, q_bytes);
    let invalid = |r: Result<(), GpuError>, what: &str, says: &str| match r {
        Err(
            e @ (GpuError::Batch(_)
            | GpuError::Pool(_)
            | GpuError::Plan(_)
            | GpuError::Binding { .. }),
        ) => {
            let m = e.to_string();
            assert!(m.contains(says), "{what}: {m}")
        }
        other => panic!("{what}: {other:?}"),
    };
    assert_eq!(
        attn.run(
            gpu,
            &mut enc,
            &mut aplan,
            &cache,
            0,
            0,
            &fine,
            &e.range(0, 1, q_bytes),
        ),
        Err(GpuError::Plan(PlanMismatch::NotPlanned)),
        "run before plan"
    );
    let tables = DecodeTables {
        kv_indptr: &[0, 1, 2],
        kv_indices: &[3, 5],
        seq_lens: &[9, 16],
    };
    attn.plan_decode(gpu, &mut aplan, &tables, &[AttnOptions::default()])
        .unwrap();
    let mut foreign = other.plan();
    assert_eq!(
        attn.plan_decode(gpu, &mut foreign, &tables, &[AttnOptions::default()]),
        Err(GpuError::Plan(PlanMismatch::OtherAttention)),
        "another kernel's plan"
    );
    let no_storage = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 4096,
        usage: wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let cases: Vec<(&str, wgpu::BufferBinding, &str)> = vec![
        (
            "no STORAGE usage",
            no_storage.as_entire_buffer_binding(),
            "STORAGE",
        ),
        (
            "unaligned offset",
            wgpu::BufferBinding {
                buffer: &e.arena,
                offset: 4,
                size: NonZeroU64::new(q_bytes),
            },
            "alignment",
        ),
        ("too small", e.range(0, 0, q_bytes / 2), "needs"),
        (
            "past the buffer",
            wgpu::BufferBinding {
                buffer: &e.arena,
                offset: e.arena.size() - 256,
                size: NonZeroU64::new(q_bytes),
            },
            "past",
        ),
    ];
    let fine_out = e.range(0, 1, q_bytes);
    for (what, b, says) in &cases {
        invalid(
            attn.run(gpu, &mut enc, &mut aplan, &cache, 0, 0, b, &fine_out),
            &format!("q {what}"),
            says,
        );
        invalid(
            attn.run(gpu, &mut enc, &mut aplan, &cache, 0, 0, &fine, b),
            &format!("out {what}"),
            says,
        );
    }
    // q and out in one buffer (different ranges): refused, as a dispatch may
    // not read and write one buffer.
    invalid(
        attn.run(
            gpu,
            &mut enc,
            &mut aplan,
            &cache,
            0,
            0,
            &fine,
            &e.range(1, 2, q_bytes),
        ),
        "q and out in one buffer",
        "one buffer",
    );
    invalid(
        attn.run(gpu, &mut enc, &mut aplan, &cache, 0, 1, &fine, &fine_out),
        "variant out of range",
        "variant",
    );
    let mut wplan = cache.plan();
    assert_eq!(
        cache.run_write_kv(gpu, &mut enc, &mut wplan, 0, &fine, &fine),
        Err(GpuError::Plan(PlanMismatch::NotPlanned)),
        "write before plan"
    );
    let epoch = cache.write_epoch();
    invalid(
        cache.plan_write(gpu, &mut wplan, &[8 * BS], &[]),
        "slot past the pool",
        "outside",
    );
    // The GPU writes a step's tokens in parallel: a slot named twice would
    // race, so it is refused (SKIP_WRITE may repeat: nothing is written).
    invalid(
        cache.plan_write(gpu, &mut wplan, &[3, 9, 4, 9], &[]),
        "a slot written twice",
        "slot 9 is written twice",
    );
    let skip = pagedattn::blocks::SKIP_WRITE;
    invalid(
        cache.write_kv(
            gpu,
            0,
            &[0.0; 2 * (KVH * HD) as usize],
            &[0.0; 2 * (KVH * HD) as usize],
            &[5, 5],
        ),
        "write_kv of a slot twice",
        "slot 5 is written twice",
    );
    assert_eq!(cache.write_epoch(), epoch, "refused plans start no step");
    cache
        .plan_write(gpu, &mut wplan, &[skip, 3, skip], &[])
        .unwrap();
    assert_eq!(cache.write_epoch(), epoch + 1);
    // Nothing was recorded: the encoder finishes and submits cleanly (the
    // scope covers both, so a half-recorded dispatch would show here).
    let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
    gpu.queue.submit([enc.finish()]);
    let err = pollster::block_on(scope.pop());
    assert!(err.is_none(), "{err:?}");
}

/// Q, K and V read straight from one fused QKV output (rows of
/// `(HEADS + 2 KVH) * HD` floats, K and V at their column offsets), through
/// the row strides of the plans; the result equals the reference.
#[test]
fn fused_qkv_rows_are_read_in_place() {
    let Some(e) = engine() else { return };
    let s = seed("fused qkv");
    let mut rng = SplitMix64::new(s);
    let gpu = &e.gpu;
    let cfg = KvCacheConfig::new(16, BS, KVH, HD);
    let cache = KvCache::new(gpu, cfg).unwrap();
    let attn = PagedAttention::new(gpu, &cache, HEADS, &Default::default()).unwrap();
    let mut m = BlockManager::new(BlockManagerConfig::new(16, BS)).unwrap();
    let ids = [
        m.add_sequence(&[1; 40]).unwrap(),
        m.add_sequence(&[2; 9]).unwrap(),
    ];
    let view = m.batch_view(&ids).unwrap();
    let ntok = view.slot_mapping.len();
    // Columns: [q: HEADS*HD | k: KVH*HD | v: KVH*HD]; K and V each start on
    // a 256-byte boundary within the row (HEADS*HD*4 = 512, KVH*HD*4 = 256).
    let width = ((HEADS + 2 * KVH) * HD) as usize;
    let qkv = rng.signed_vec(ntok * width);
    let buf = gpu.storage_init("fused qkv", &qkv).unwrap();
    let bytes = buf.size();
    let at = |off: u64| wgpu::BufferBinding {
        buffer: &buf,
        offset: off,
        size: NonZeroU64::new(bytes - off),
    };
    let mut wplan = cache.plan();
    wplan.set_kv_stride(Some(width as u32));
    cache
        .plan_write(gpu, &mut wplan, &view.slot_mapping, &[])
        .unwrap();
    let mut aplan = attn.plan();
    aplan.set_q_stride(Some(width as u32));
    attn.plan_prefill(
        gpu,
        &mut aplan,
        &PrefillTables::from_view(&view),
        &[AttnOptions::default()],
    )
    .unwrap();
    let out = gpu
        .storage("out", (ntok * (HEADS * HD) as usize * 4) as u64)
        .unwrap();
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    let (qo, ko, vo) = (
        0u64,
        (HEADS * HD * 4) as u64,
        ((HEADS + KVH) * HD * 4) as u64,
    );
    cache
        .run_write_kv(gpu, &mut enc, &mut wplan, 0, &at(ko), &at(vo))
        .unwrap();
    attn.run(
        gpu,
        &mut enc,
        &mut aplan,
        &cache,
        0,
        0,
        &at(qo),
        &out.as_entire_buffer_binding(),
    )
    .unwrap();
    gpu.queue.submit([enc.finish()]);
    let got: Vec<f32> = gpu.read(&out, out.size()).unwrap();
    // Host side: split the rows.
    let col =
        |t: usize, from: usize, n: usize| qkv[t * width + from..t * width + from + n].to_vec();
    let (qw, kw) = ((HEADS * HD) as usize, (KVH * HD) as usize);
    let q: Vec<f32> = (0..ntok).flat_map(|t| col(t, 0, qw)).collect();
    let k: Vec<f32> = (0..ntok).flat_map(|t| col(t, qw, kw)).collect();
    let v: Vec<f32> = (0..ntok).flat_map(|t| col(t, qw + kw, kw)).collect();
    let mut host = HostPool::new(16, KVH as usize, BS as usize, HD as usize);
    host.write(&view.slot_mapping, &k, &v, Stored::from(KvDtype::F32));
    let want = reference::prefill(
        &host.view(),
        &AttnParams::new(HEADS as usize, HD as usize),
        &q,
        &view.new_indptr,
        &view.kv_indptr,
        &view.kv_indices,
        &view.seq_lens,
    );
    let err = rel_l2(&got[..q.len()], &want);
    assert!(err < TOL, "fused QKV: rel L2 {err:.3e} (seed {s})");
}

/// `Gpu::from_device` installs nothing: an error raised outside any scope
/// reaches the engine's own handler, not the library.
#[test]
fn a_borrowed_device_keeps_its_handlers() {
    let Some((device, queue)) = engine_device() else {
        gpu();
        return;
    };
    let seen: Arc<Mutex<Vec<String>>> = Default::default();
    let s2 = seen.clone();
    device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
        s2.lock().unwrap().push(e.to_string())
    }));
    let gpu = Gpu::from_device(&device, &queue);
    assert_eq!(gpu.features, device.features(), "nothing enabled");
    let cache = KvCache::new(&gpu, KvCacheConfig::new(4, BS, 1, HD)).unwrap();
    cache
        .write_kv(
            &gpu,
            0,
            &vec![0.5; HD as usize],
            &vec![0.5; HD as usize],
            &[3],
        )
        .unwrap();
    // Outside any scope: the engine's handler sees it; the library's record is empty.
    let _too_big = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("engine's mistake"),
        size: gpu.limits.max_buffer_size + 4,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    assert_eq!(seen.lock().unwrap().len(), 1, "{:?}", seen.lock().unwrap());
    assert!(gpu.take_error().is_ok());
}

/// 16-bit activations in and out, f16 and bf16 (the bytes of `f16` or
/// `bf16` arrays, read and written as packed pairs: no `shader-f16`
/// needed): new K/V rows, Q and the output, for prefill, unsplit decode
/// and split-K decode, over f32 pools and pools of the activations' type.
/// Outputs are filled with NaN first. Against the reference over the
/// rounded inputs; tolerance 2e-3 for f16 (the output rounded once to an
/// 11-bit mantissa) and 8e-3 for bf16 (8 bits: half an ULP is 2^-9, about
/// 2e-3 per value, with room).
#[test]
fn f16_activations_in_and_out() {
    let Some(e) = engine() else { return };
    let s = seed("f16 activations");
    let mut rng = SplitMix64::new(s);
    let gpu = &e.gpu;
    for (act, dtype) in [
        (ActDtype::F16, KvDtype::F32),
        (ActDtype::F16, KvDtype::F16),
        (ActDtype::Bf16, KvDtype::F32),
        (ActDtype::Bf16, KvDtype::Bf16),
    ] {
        let bf = act == ActDtype::Bf16;
        let tol = if bf { 8e-3 } else { 2e-3 };
        let h16 = |v: &[f32]| -> Vec<u16> {
            v.iter()
                .map(|&x| {
                    if bf {
                        half::bf16::from_f32(x).to_bits()
                    } else {
                        half::f16::from_f32(x).to_bits()
                    }
                })
                .collect()
        };
        let back = |v: &[u16]| -> Vec<f32> {
            v.iter()
                .map(|&b| {
                    if bf {
                        half::bf16::from_bits(b).to_f32()
                    } else {
                        half::f16::from_bits(b).to_f32()
                    }
                })
                .collect()
        };
        {
            let cfg = KvCacheConfig::new(32, BS, KVH, HD).with_dtype(dtype);
            let cache = KvCache::new(gpu, cfg).unwrap();
            let attn = PagedAttention::new(gpu, &cache, HEADS, &Default::default()).unwrap();
            let mut host = HostPool::new(32, KVH as usize, BS as usize, HD as usize);
            let mut m = BlockManager::new(BlockManagerConfig::new(32, BS)).unwrap();
            let ids = [
                m.add_sequence(&[3; 300]).unwrap(),
                m.add_sequence(&[4; 40]).unwrap(),
            ];
            let (mut wplan, mut aplan) = (cache.plan(), attn.plan());
            wplan.set_activations(act);
            aplan.set_activations(act);
            let kv_row = (KVH * HD) as usize;
            let q_row = (HEADS * HD) as usize;
            for step in 0..2 {
                if step == 1 {
                    for &id in &ids {
                        m.append(id, &[5]).unwrap();
                    }
                }
                let view = m.batch_view(&ids).unwrap();
                let ntok = view.slot_mapping.len();
                let (k, v) = (
                    h16(&rng.signed_vec(ntok * kv_row)),
                    h16(&rng.signed_vec(ntok * kv_row)),
                );
                let kb = gpu.storage_init("k16", &k).unwrap();
                let vb = gpu.storage_init("v16", &v).unwrap();
                cache
                    .plan_write(gpu, &mut wplan, &view.slot_mapping, &view.copies)
                    .unwrap();
                host.write(
                    &view.slot_mapping,
                    &back(&k),
                    &back(&v),
                    Stored::from(dtype),
                );
                let variants = [
                    AttnOptions {
                        split: pagedattn::gpu::Split::Never,
                        ..Default::default()
                    },
                    AttnOptions {
                        split: pagedattn::gpu::Split::Tokens(64),
                        ..Default::default()
                    },
                ];
                let (qo, used): (Vec<u32>, &[AttnOptions]) = if step == 0 {
                    attn.plan_prefill(
                        gpu,
                        &mut aplan,
                        &PrefillTables::from_view(&view),
                        &variants[..1],
                    )
                    .unwrap();
                    (view.new_indptr.clone(), &variants[..1])
                } else {
                    attn.plan_decode(gpu, &mut aplan, &DecodeTables::from_view(&view), &variants)
                        .unwrap();
                    assert!(aplan.splits(), "the second variant splits");
                    ((0..=ids.len() as u32).collect(), &variants[..])
                };
                let nq = qo[qo.len() - 1] as usize;
                let q = h16(&rng.signed_vec(nq * q_row));
                let qb = gpu.storage_init("q16", &q).unwrap();
                // 0xffff is a NaN in both f16 and bf16.
                let outs: Vec<wgpu::Buffer> = (0..used.len())
                    .map(|_| {
                        gpu.storage_init("out16", &vec![0xffffu16; nq * q_row])
                            .unwrap()
                    })
                    .collect();
                let mut enc = gpu.device.create_command_encoder(&Default::default());
                cache
                    .run_write_kv(
                        gpu,
                        &mut enc,
                        &mut wplan,
                        0,
                        &kb.as_entire_buffer_binding(),
                        &vb.as_entire_buffer_binding(),
                    )
                    .unwrap();
                for (i, o) in outs.iter().enumerate() {
                    attn.run(
                        gpu,
                        &mut enc,
                        &mut aplan,
                        &cache,
                        0,
                        i,
                        &qb.as_entire_buffer_binding(),
                        &o.as_entire_buffer_binding(),
                    )
                    .unwrap();
                }
                gpu.queue.submit([enc.finish()]);
                let want = reference::prefill(
                    &host.view(),
                    &AttnParams::new(HEADS as usize, HD as usize),
                    &back(&q),
                    &qo,
                    &view.kv_indptr,
                    &view.kv_indices,
                    &view.seq_lens,
                );
                for (i, o) in outs.iter().enumerate() {
                    let got: Vec<u16> = gpu.read(o, (nq * q_row * 2) as u64).unwrap();
                    let err = rel_l2(&back(&got), &want);
                    eprintln!("{act:?} activations, {dtype:?} pool, step {step}, variant {i}: rel L2 {err:.3e}");
                    assert!(
                    err < tol,
                    "{act:?} activations, {dtype:?} pool, step {step}, variant {i}: rel L2 {err:.3e} >= {tol} (seed {s})"
                );
                }
            }
        }
    }
}

/// A buffer of another device of the same instance is refused on the call
/// (wgpu's validation, caught in the library's scope), not a panic or an
/// error raised later; the plan still works with the right buffers
/// afterwards. (A buffer of another *instance* cannot be told apart through
/// wgpu 30's API: see ARCHITECTURE.md.)
#[test]
fn a_buffer_of_another_device_is_refused() {
    let inst = wgpu::Instance::new({
        let mut d = wgpu::InstanceDescriptor::new_without_display_handle();
        d.backends = common::backends().unwrap();
        d
    });
    let Ok(adapter) = pollster::block_on(inst.request_adapter(&Default::default())) else {
        gpu();
        return;
    };
    let open = || {
        pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            required_limits: adapter.limits(),
            ..Default::default()
        }))
        .unwrap()
    };
    let ((device, queue), (other_device, _)) = (open(), open());
    let gpu = Gpu::from_device(&device, &queue);
    gpu.watch();
    let cfg = KvCacheConfig::new(8, BS, KVH, HD);
    let cache = KvCache::new(&gpu, cfg).unwrap();
    let attn = PagedAttention::new(&gpu, &cache, HEADS, &Default::default()).unwrap();
    let mut aplan = attn.plan();
    let tables = DecodeTables {
        kv_indptr: &[0, 1],
        kv_indices: &[3],
        seq_lens: &[9],
    };
    attn.plan_decode(&gpu, &mut aplan, &tables, &[AttnOptions::default()])
        .unwrap();
    let bytes = (HEADS * HD * 4) as u64;
    let buf = |d: &wgpu::Device| {
        d.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: bytes,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })
    };
    let (q, out, foreign) = (buf(&device), buf(&device), buf(&other_device));
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    let r = attn.run(
        &gpu,
        &mut enc,
        &mut aplan,
        &cache,
        0,
        0,
        &foreign.as_entire_buffer_binding(),
        &out.as_entire_buffer_binding(),
    );
    match r {
        Err(e @ GpuError::Binding { .. }) => assert!(e.to_string().contains("another"), "{e}"),
        other => panic!("{other:?}"),
    }
    attn.run(
        &gpu,
        &mut enc,
        &mut aplan,
        &cache,
        0,
        0,
        &q.as_entire_buffer_binding(),
        &out.as_entire_buffer_binding(),
    )
    .unwrap();
    gpu.queue.submit([enc.finish()]);
    assert!(
        gpu.wait().is_ok(),
        "nothing left for the uncaptured handler"
    );
}

/// A plan belongs to one step of one cache. Its first run binds it; a run
/// on another cache (whose pool its tables do not index), or after the
/// cache's next `plan_write` (the next step, with other rows), is refused
/// with a typed error and records nothing. Planned again, it runs on the
/// other cache and reads that cache's pool, not the first one's (the probe
/// got the first pool's output, rel. error 1.4 against the second's).
#[test]
fn a_plan_runs_only_on_its_cache_and_step() {
    let Some(e) = engine() else { return };
    let s = seed("plan binding");
    let mut rng = SplitMix64::new(s);
    let gpu = &e.gpu;
    let cfg = KvCacheConfig::new(8, BS, KVH, HD);
    let row = (KVH * HD) as usize;
    let slots: Vec<u32> = (0..20).collect();
    let mut pools = Vec::new();
    for _ in 0..2 {
        let cache = KvCache::new(gpu, cfg).unwrap();
        let (k, v) = (rng.signed_vec(20 * row), rng.signed_vec(20 * row));
        cache.write_kv(gpu, 0, &k, &v, &slots).unwrap();
        let mut host = HostPool::new(8, KVH as usize, BS as usize, HD as usize);
        host.write(&slots, &k, &v, Stored::from(KvDtype::F32));
        pools.push((cache, host));
    }
    let (a, b) = (&pools[0].0, &pools[1].0);
    let attn = PagedAttention::new(gpu, a, HEADS, &Default::default()).unwrap();
    let tables = DecodeTables {
        kv_indptr: &[0, 2],
        kv_indices: &[0, 1],
        seq_lens: &[20],
    };
    let q = rng.signed_vec((HEADS * HD) as usize);
    let q_bytes = (HEADS * HD * 4) as u64;
    gpu.queue
        .write_buffer(&e.arena, 0, bytemuck::cast_slice(&q));
    let (qb, ob) = (e.range(0, 0, q_bytes), e.range(0, 1, q_bytes));
    let want = |host: &HostPool| {
        reference::decode(
            &host.view(),
            &AttnParams::new(HEADS as usize, HD as usize),
            &q,
            tables.kv_indptr,
            tables.kv_indices,
            tables.seq_lens,
        )
    };
    let run_on = |plan: &mut pagedattn::gpu::AttentionPlan, cache: &KvCache| {
        gpu.queue.write_buffer(
            &e.outs,
            ob.offset,
            bytemuck::cast_slice(&vec![f32::NAN; (HEADS * HD) as usize]),
        );
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        let r = attn.run(gpu, &mut enc, plan, cache, 0, 0, &qb, &ob);
        gpu.queue.submit([enc.finish()]);
        let all: Vec<f32> = gpu.read(&e.outs, ob.offset + q_bytes).unwrap();
        (r, all[ob.offset as usize / 4..].to_vec())
    };
    let mut wplan = a.plan();
    let mut plan = attn.plan();
    a.plan_write(gpu, &mut wplan, &[], &[]).unwrap();
    attn.plan_decode(gpu, &mut plan, &tables, &[AttnOptions::default()])
        .unwrap();
    let (r, got) = run_on(&mut plan, a);
    r.unwrap();
    let err = rel_l2(&got, &want(&pools[0].1));
    assert!(err < TOL, "on its cache: rel L2 {err:.3e} (seed {s})");
    // The same step on the other cache: refused, nothing recorded (the
    // output stays poisoned).
    let (r, got) = run_on(&mut plan, b);
    assert_eq!(r, Err(GpuError::Plan(PlanMismatch::BoundToOtherCache)));
    assert!(got.iter().all(|x| x.is_nan()), "nothing ran");
    // Its cache's next step: the plan is stale.
    a.plan_write(gpu, &mut wplan, &[], &[]).unwrap();
    let (r, _) = run_on(&mut plan, a);
    match r {
        Err(GpuError::Plan(PlanMismatch::Stale { planned, current })) => {
            assert_eq!(current, planned + 1)
        }
        other => panic!("{other:?}"),
    }
    // Planned again, on the other cache: it reads that cache's pool.
    attn.plan_decode(gpu, &mut plan, &tables, &[AttnOptions::default()])
        .unwrap();
    let (r, got) = run_on(&mut plan, b);
    r.unwrap();
    let err = rel_l2(&got, &want(&pools[1].1));
    assert!(
        err < TOL,
        "re-planned on cache b: rel L2 {err:.3e} (seed {s})"
    );
    assert!(rel_l2(&got, &want(&pools[0].1)) > 0.1, "not cache a's pool");
}

/// Plan/run under random traffic, the GPU-side counterpart of the fuzz
/// targets (a seeded soak; `PAGEDATTN_SEED` overrides): random decode
/// tables (some corrupt), runs on either of two caches with good or bad
/// bindings, write plans with random slots (some repeated, past the pool
/// or `SKIP_WRITE`), and another kernel's plans. A model predicts each
/// call's outcome (accepted, or which refusal); every accepted run is
/// checked against the f64 reference over its own cache's pool, and every
/// refused one records nothing (its output stays poisoned).
#[test]
fn plan_run_soak_of_random_tables_bindings_and_caches() {
    let Some(e) = engine() else { return };
    let s = seed("plan run soak");
    let mut rng = SplitMix64::new(s);
    let gpu = &e.gpu;
    let nb = 8u32;
    let cfg = KvCacheConfig::new(nb, BS, KVH, HD);
    let row = (KVH * HD) as usize;
    let all: Vec<u32> = (0..nb * BS).collect();
    let mut caches = Vec::new();
    for _ in 0..2 {
        let cache = KvCache::new(gpu, cfg).unwrap();
        let (k, v) = (
            rng.signed_vec(all.len() * row),
            rng.signed_vec(all.len() * row),
        );
        cache.write_kv(gpu, 0, &k, &v, &all).unwrap();
        let mut host = HostPool::new(nb as usize, KVH as usize, BS as usize, HD as usize);
        host.write(&all, &k, &v, Stored::from(KvDtype::F32));
        let wplan = cache.plan();
        caches.push((cache, host, wplan));
    }
    let attn = PagedAttention::new(gpu, &caches[0].0, HEADS, &Default::default()).unwrap();
    let other = PagedAttention::new(gpu, &caches[0].0, HEADS, &Default::default()).unwrap();
    let mut foreign = other.plan();
    let mut plan = attn.plan();
    // The model: the planned tables, and the (cache, epoch) the plan is bound to.
    let mut planned: Option<(Vec<u32>, Vec<u32>, Vec<u32>)> = None;
    let mut bound: Option<(usize, u64)> = None;
    let q_row = (HEADS * HD) as usize;
    let q_bytes = 4 * q_row as u64 * 4;
    let mut reached = [0usize; 8];
    let poison = |bytes: u64| {
        gpu.queue.write_buffer(
            &e.outs,
            e.slot,
            bytemuck::cast_slice(&vec![f32::NAN; bytes as usize / 4]),
        );
    };
    for step in 0..400 {
        let what = format!("step {step} (seed {s})");
        match rng.below(6) {
            0 | 1 => {
                // Tables: 1 to 3 sequences, maybe corrupted.
                let n = rng.range(1, 4) as usize;
                let mut indptr = vec![0u32];
                let mut indices = Vec::new();
                let mut lens = Vec::new();
                for _ in 0..n {
                    let len = rng.range(1, 3 * BS as u64 + 1) as u32;
                    for _ in 0..len.div_ceil(BS) {
                        indices.push(rng.below(nb as u64) as u32);
                    }
                    indptr.push(indices.len() as u32);
                    lens.push(len);
                }
                let corrupt = rng.below(3) == 0;
                if corrupt {
                    match rng.below(3) {
                        0 => indices[0] = nb + rng.below(4) as u32,
                        1 => lens[0] = (indptr[1] - indptr[0]) * BS + 1,
                        _ => indptr[1] = indptr[n] + 1,
                    }
                }
                let t = DecodeTables {
                    kv_indptr: &indptr,
                    kv_indices: &indices,
                    seq_lens: &lens,
                };
                let r = attn.plan_decode(gpu, &mut plan, &t, &[AttnOptions::default()]);
                assert_eq!(
                    r.is_ok(),
                    !corrupt,
                    "{what}: tables {indptr:?} {indices:?} {lens:?}: {r:?}"
                );
                // Planning resets the plan, even when refused.
                bound = None;
                planned = r.ok().map(|()| (indptr, indices, lens));
                reached[corrupt as usize] += 1;
            }
            2 => {
                // A run on either cache, with good bindings.
                let c = rng.below(2) as usize;
                let (cache, host, _) = &caches[c];
                let q = rng.signed_vec(4 * q_row);
                gpu.queue
                    .write_buffer(&e.arena, 0, bytemuck::cast_slice(&q));
                poison(q_bytes);
                let (qb, ob) = (e.range(0, 0, q_bytes), e.range(0, 1, q_bytes));
                let mut enc = gpu.device.create_command_encoder(&Default::default());
                let r = attn.run(gpu, &mut enc, &mut plan, cache, 0, 0, &qb, &ob);
                gpu.queue.submit([enc.finish()]);
                let got: Vec<f32> =
                    gpu.read(&e.outs, e.slot + q_bytes).unwrap()[e.slot as usize / 4..].to_vec();
                let epoch = cache.write_epoch();
                let want_err = match (&planned, bound) {
                    (None, _) => Some(GpuError::Plan(PlanMismatch::NotPlanned)),
                    (Some(_), Some((bc, _))) if bc != c => {
                        Some(GpuError::Plan(PlanMismatch::BoundToOtherCache))
                    }
                    (Some(_), Some((_, be))) if be != epoch => {
                        Some(GpuError::Plan(PlanMismatch::Stale {
                            planned: be,
                            current: epoch,
                        }))
                    }
                    _ => None,
                };
                match (want_err, r) {
                    (Some(w), r) => {
                        assert_eq!(r, Err(w), "{what}");
                        assert!(
                            got.iter().all(|x| x.is_nan()),
                            "{what}: a refused run wrote"
                        );
                        reached[2] += 1;
                    }
                    (None, r) => {
                        r.unwrap_or_else(|e| panic!("{what}: {e}"));
                        bound = Some((c, epoch));
                        let (ip, ix, ln) = planned.as_ref().unwrap();
                        let nq = ln.len();
                        let want = reference::decode(
                            &host.view(),
                            &AttnParams::new(HEADS as usize, HD as usize),
                            &q[..nq * q_row],
                            ip,
                            ix,
                            ln,
                        );
                        let err = rel_l2(&got[..nq * q_row], &want);
                        assert!(err < TOL, "{what}: cache {c}: rel L2 {err:.3e}");
                        reached[3] += 1;
                    }
                }
            }
            3 => {
                // A bad binding: refused, nothing recorded, binding unchanged.
                let bad = [
                    e.range(0, 0, 8),
                    wgpu::BufferBinding {
                        buffer: &e.arena,
                        offset: 4,
                        size: NonZeroU64::new(q_bytes),
                    },
                ];
                let b = &bad[rng.below(2) as usize];
                poison(q_bytes);
                let mut enc = gpu.device.create_command_encoder(&Default::default());
                let r = if planned.is_some()
                    && bound.is_none_or(|(c, ep)| c == 0 && ep == caches[0].0.write_epoch())
                {
                    attn.run(
                        gpu,
                        &mut enc,
                        &mut plan,
                        &caches[0].0,
                        0,
                        0,
                        b,
                        &e.range(0, 1, q_bytes),
                    )
                } else {
                    Err(GpuError::Binding {
                        which: "not tried",
                        problem: pagedattn::gpu::BindingError::SameBuffer,
                    })
                };
                assert!(matches!(r, Err(GpuError::Binding { .. })), "{what}: {r:?}");
                gpu.queue.submit([enc.finish()]);
                reached[4] += 1;
            }
            4 => {
                // A write plan with random slots on either cache.
                let c = rng.below(2) as usize;
                let n = rng.range(0, 6) as usize;
                let mut slots: Vec<u32> =
                    (0..n).map(|_| rng.below((nb * BS) as u64) as u32).collect();
                match rng.below(4) {
                    0 if n > 0 => slots.push(slots[0]),
                    1 => slots.push(nb * BS + rng.below(9) as u32),
                    2 => slots.extend([pagedattn::blocks::SKIP_WRITE; 2]),
                    _ => {}
                }
                let mut sorted: Vec<u32> = slots
                    .iter()
                    .copied()
                    .filter(|&x| x != pagedattn::blocks::SKIP_WRITE)
                    .collect();
                sorted.sort_unstable();
                let valid =
                    sorted.windows(2).all(|w| w[0] != w[1]) && sorted.iter().all(|&x| x < nb * BS);
                let (cache, _, wplan) = &mut caches[c];
                let before = cache.write_epoch();
                let r = cache.plan_write(gpu, wplan, &slots, &[]);
                assert_eq!(r.is_ok(), valid, "{what}: slots {slots:?}: {r:?}");
                assert_eq!(cache.write_epoch(), before + valid as u64, "{what}");
                reached[5 + valid as usize] += 1;
            }
            _ => {
                let t = DecodeTables {
                    kv_indptr: &[0, 1],
                    kv_indices: &[0],
                    seq_lens: &[1],
                };
                let r = attn.plan_decode(gpu, &mut foreign, &t, &[AttnOptions::default()]);
                assert_eq!(
                    r,
                    Err(GpuError::Plan(PlanMismatch::OtherAttention)),
                    "{what}"
                );
                reached[7] += 1;
            }
        }
    }
    eprintln!("plan/run soak: {reached:?} (valid, corrupt tables, refused runs, checked runs, bad bindings, refused and accepted write plans, foreign plans)");
    assert!(reached.iter().all(|&n| n > 0), "{reached:?}");
}

/// `warm_up` compiles every pipeline a step can need for the activation
/// dtypes it is given: after it, planning writes, decode (split-K
/// included) and prefill with f16 and bf16 activations compiles nothing.
/// On a device of its own, so no other test's compiles count; the shape
/// (5 KV heads of 24) is this test's alone, so nothing was cached before.
#[test]
fn warm_up_compiles_what_16_bit_steps_need() {
    let Some(gpu) = crate::common::gpu() else {
        return;
    };
    let cfg = KvCacheConfig::new(16, 8, 5, 24).with_layers(1);
    let cache = KvCache::new(&gpu, cfg).unwrap();
    let attn = PagedAttention::new(&gpu, &cache, 10, &Default::default()).unwrap();
    let acts = [ActDtype::F16, ActDtype::Bf16];
    attn.warm_up(&gpu, &acts).unwrap();
    cache.warm_up(&gpu, &acts).unwrap();
    let before = gpu.counters().pipelines;
    let (mut wplan, mut aplan) = (cache.plan(), attn.plan());
    // Two sequences of 20 and 9 tokens, the newest 3 and 1 written now
    // (split-K at 64 tokens: one partition, but the split pipelines).
    let (indptr, indices, lens) = (vec![0u32, 3, 5], vec![0u32, 1, 2, 3, 4], vec![20u32, 9]);
    let qo = vec![0u32, 3, 4];
    let slots: Vec<u32> = vec![17, 18, 19, 32];
    for act in acts {
        wplan.set_activations(act);
        aplan.set_activations(act);
        cache.plan_write(&gpu, &mut wplan, &slots, &[]).unwrap();
        for split in [
            pagedattn::gpu::Split::Never,
            pagedattn::gpu::Split::Tokens(64),
        ] {
            let o = AttnOptions {
                split,
                ..Default::default()
            };
            let t = DecodeTables {
                kv_indptr: &indptr,
                kv_indices: &indices,
                seq_lens: &lens,
            };
            attn.plan_decode(&gpu, &mut aplan, &t, &[o]).unwrap();
        }
        let t = PrefillTables {
            qo_indptr: &qo,
            kv_indptr: &indptr,
            kv_indices: &indices,
            seq_lens: &lens,
        };
        attn.plan_prefill(&gpu, &mut aplan, &t, &[AttnOptions::default()])
            .unwrap();
    }
    assert_eq!(
        gpu.counters().pipelines,
        before,
        "a 16-bit step compiled a pipeline warm_up did not"
    );
}
