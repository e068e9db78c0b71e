//! The trust guarantees under adversarial use, on a real adapter: device
//! loss (also from another thread mid-call), errors landing on the call
//! that caused them, windows near `u32::MAX`, a cache the kernels were not
//! built for, sizes that overflow, and
//! adapters that end long loops early. Every randomized input has a fixed
//! seed per test (`PAGEDATTN_SEED` overrides; failures print it); outputs
//! are poisoned (NaN) by the library before each run; f32 tolerance 1e-5.

use crate::common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::*;
use pagedattn::blocks::{BatchView, BlockManager, BlockManagerConfig};
use pagedattn::gpu::{
    AttnOptions, DecodeTables, Gpu, GpuError, KvCache, KvCacheConfig, KvDtype, PagedAttention,
    ShapeError, Split,
};
use pagedattn::reference::{self, rel_l2, AttnParams};
use pagedattn::rng::SplitMix64;

const TOL: f64 = 1e-5;

/// A pool with random K/V for sequences of `lens`, its host mirror, and the
/// kernels for `num_heads` query heads.
struct Rig {
    cache: KvCache,
    attn: PagedAttention,
    host: HostPool,
    view: BatchView,
    num_heads: u32,
    head_dim: u32,
}

fn rig(gpu: &Gpu, rng: &mut SplitMix64, lens: &[usize], kvh: u32, group: u32, hd: u32) -> Rig {
    let bs = 16;
    let nb = blocks_for(lens, bs, 3);
    let (_m, _ids, view) = shuffled_batch(rng, nb, bs, lens);
    let cfg = KvCacheConfig::new(nb, bs, kvh, hd);
    let cache = KvCache::new(gpu, cfg).unwrap();
    let row = (kvh * hd) as usize;
    let ntok = view.slot_mapping.len();
    let k = rng.signed_vec(ntok * row);
    let v = rng.signed_vec(ntok * row);
    cache.write_kv(gpu, 0, &k, &v, &view.slot_mapping).unwrap();
    let mut host = HostPool::new(nb as usize, kvh as usize, bs as usize, hd as usize);
    host.write(&view.slot_mapping, &k, &v, Stored::from(KvDtype::F32));
    let attn = PagedAttention::new(gpu, &cache, kvh * group, &Default::default()).unwrap();
    Rig {
        cache,
        attn,
        host,
        view,
        num_heads: kvh * group,
        head_dim: hd,
    }
}

impl Rig {
    fn params(&self, o: &AttnOptions) -> AttnParams {
        let mut p = AttnParams::new(self.num_heads as usize, self.head_dim as usize);
        p.sliding_window = o.sliding_window;
        p.soft_cap = o.soft_cap;
        p.alibi_slopes = o.alibi_slopes.clone();
        if let Some(s) = o.scale {
            p.scale = s;
        }
        p
    }

    fn decode(&self, gpu: &Gpu, q: &[f32], o: &AttnOptions) -> Result<f64, GpuError> {
        let v = &self.view;
        let got = self.attn.decode(
            gpu,
            &self.cache,
            0,
            q,
            &v.kv_indptr,
            &v.kv_indices,
            &v.seq_lens,
            o,
        )?;
        let want = reference::decode(
            &self.host.view(),
            &self.params(o),
            q,
            &v.kv_indptr,
            &v.kv_indices,
            &v.seq_lens,
        );
        Ok(rel_l2(&got, &want))
    }

    /// Prefill of the newest `nq` positions of every sequence.
    fn prefill(
        &self,
        gpu: &Gpu,
        rng: &mut SplitMix64,
        nq: u32,
        o: &AttnOptions,
    ) -> Result<f64, GpuError> {
        let v = &self.view;
        let qo: Vec<u32> = (0..=v.seq_lens.len() as u32).map(|i| i * nq).collect();
        let q = rng.signed_vec((qo[qo.len() - 1] * self.num_heads * self.head_dim) as usize);
        let got = self.attn.prefill(
            gpu,
            &self.cache,
            0,
            &q,
            &qo,
            &v.kv_indptr,
            &v.kv_indices,
            &v.seq_lens,
            o,
        )?;
        let want = reference::prefill(
            &self.host.view(),
            &self.params(o),
            &q,
            &qo,
            &v.kv_indptr,
            &v.kv_indices,
            &v.seq_lens,
        );
        Ok(rel_l2(&got, &want))
    }

    fn q(&self, rng: &mut SplitMix64) -> Vec<f32> {
        rng.signed_vec(self.view.seq_lens.len() * (self.num_heads * self.head_dim) as usize)
    }
}

fn is_device(r: &Result<impl Sized, GpuError>) -> bool {
    matches!(r, Err(GpuError::Device(_)))
}

/// `device.destroy()` with no wait in between: every call sees the loss at
/// once (`is_lost`, host calls, encoder calls, constructors, buffer helpers).
#[test]
fn device_loss_is_seen_by_every_call() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("device loss, every call"));
    let r = rig(&gpu, &mut rng, &[40, 17], 2, 2, 64);
    let q = r.q(&mut rng);
    assert!(r.decode(&gpu, &q, &AttnOptions::default()).unwrap() < TOL);
    let qb = gpu.storage_init("q", &q).unwrap();
    let out = gpu.storage("out", (q.len() * 4) as u64).unwrap();
    let opts = AttnOptions::default();
    let (mut aplan, mut wplan) = (r.attn.plan(), r.cache.plan());
    let tables = DecodeTables::from_view(&r.view);
    r.attn
        .plan_decode(&gpu, &mut aplan, &tables, std::slice::from_ref(&opts))
        .unwrap();
    r.cache
        .plan_write(&gpu, &mut wplan, &[3], &[[0, 1]])
        .unwrap();

    gpu.device.destroy();
    assert!(gpu.is_lost(), "is_lost right after destroy");
    let row = 2 * 64;
    let k = rng.signed_vec(row);
    let v = &r.view;
    let calls: Vec<(&str, bool)> = vec![
        (
            "write_kv",
            is_device(&r.cache.write_kv(&gpu, 0, &k, &k, &[3])),
        ),
        (
            "copy_blocks",
            is_device(&r.cache.copy_blocks(&gpu, &[[0, 1]])),
        ),
        (
            "decode",
            is_device(&decode_view(&r.attn, &gpu, &r.cache, &q, v, &opts)),
        ),
        ("prefill", is_device(&r.prefill(&gpu, &mut rng, 1, &opts))),
        ("read_layer", is_device(&r.cache.read_layer(&gpu, 0))),
        (
            "KvCache::new",
            is_device(&KvCache::new(&gpu, *r.cache.config())),
        ),
        (
            "PagedAttention::new",
            is_device(&PagedAttention::new(&gpu, &r.cache, 4, &Default::default())),
        ),
        ("storage", is_device(&gpu.storage("x", 64))),
        ("storage_init", is_device(&gpu.storage_init("x", &[1u32]))),
        ("uniform", is_device(&gpu.uniform("x", &[0u32; 4]))),
        ("read", is_device(&gpu.read::<f32>(&out, 16))),
        (
            "plan_decode",
            is_device(&r.attn.plan_decode(
                &gpu,
                &mut r.attn.plan(),
                &tables,
                std::slice::from_ref(&opts),
            )),
        ),
        (
            "plan_write",
            is_device(&r.cache.plan_write(&gpu, &mut r.cache.plan(), &[3], &[])),
        ),
        ("wait", is_device(&gpu.wait())),
        ("take_error", is_device(&gpu.take_error())),
        ("scoped_blocking", is_device(&gpu.scoped_blocking(|| ()))),
    ];
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    let (qr, outr) = (
        qb.as_entire_buffer_binding(),
        out.as_entire_buffer_binding(),
    );
    let enc_calls = [
        (
            "run",
            is_device(
                &r.attn
                    .run(&gpu, &mut enc, &mut aplan, &r.cache, 0, 0, &qr, &outr),
            ),
        ),
        (
            "run_write_kv",
            is_device(
                &r.cache
                    .run_write_kv(&gpu, &mut enc, &mut wplan, 0, &qr, &qr),
            ),
        ),
        (
            "run_copy_blocks",
            is_device(&r.cache.run_copy_blocks(&gpu, &mut enc, &mut wplan)),
        ),
    ];
    let failed: Vec<&str> = calls
        .iter()
        .chain(enc_calls.iter())
        .filter(|(_, ok)| !ok)
        .map(|(n, _)| *n)
        .collect();
    assert!(
        failed.is_empty(),
        "not GpuError::Device after loss: {failed:?}"
    );
}

/// The device destroyed while three threads are mid-call: no thread panics,
/// every call returns `Ok` or `GpuError::Device`, and from then on every
/// call is `GpuError::Device`.
#[test]
fn device_loss_while_threads_are_busy() {
    let Some(gpu) = gpu() else { return };
    let gpu = Arc::new(gpu);
    let mut rng = SplitMix64::new(seed("device loss, threads"));
    let r = Arc::new(rig(&gpu, &mut rng, &[300, 64, 9], 2, 4, 64));
    let start = Arc::new(Barrier::new(4));
    let mut handles = Vec::new();
    for t in 0..3u64 {
        let (gpu, r, start) = (gpu.clone(), r.clone(), start.clone());
        let mut rng = SplitMix64::new(rng.next_u64() ^ t);
        handles.push(std::thread::spawn(
            move || -> Result<(usize, usize), String> {
                start.wait();
                let (mut ok, mut lost) = (0, 0);
                for i in 0..400 {
                    let q = r.q(&mut rng);
                    let v = &r.view;
                    let res: Result<(), GpuError> = match (t + i) % 4 {
                        0 => decode_view(&r.attn, &gpu, &r.cache, &q, v, &Default::default())
                            .map(|_| ()),
                        1 => r
                            .cache
                            .write_kv(&gpu, 0, &q[..128], &q[..128], &[v.slot_mapping[0]]),
                        2 => r
                            .cache
                            .copy_blocks(&gpu, &[])
                            .and(r.cache.read_layer(&gpu, 0).map(|_| ())),
                        _ => r
                            .prefill(&gpu, &mut rng, 2, &Default::default())
                            .map(|_| ()),
                    };
                    match res {
                        Ok(()) => ok += 1,
                        Err(GpuError::Device(_)) => lost += 1,
                        Err(e) => return Err(format!("thread {t}, call {i}: {e}")),
                    }
                    if lost > 3 {
                        break;
                    }
                }
                Ok((ok, lost))
            },
        ));
    }
    start.wait();
    std::thread::sleep(Duration::from_millis(150));
    gpu.device.destroy();
    for (t, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok((ok, lost))) => {
                eprintln!("thread {t}: {ok} calls ok before the loss, {lost} saw it")
            }
            Ok(Err(e)) => panic!("{e}"),
            Err(_) => panic!("thread {t} panicked"),
        }
    }
    assert!(gpu.is_lost());
    let q = r.q(&mut rng);
    let v = &r.view;
    let d = decode_view(&r.attn, &gpu, &r.cache, &q, v, &Default::default());
    assert!(is_device(&d), "{d:?}");
}

/// Thread A records a misuse of wgpu itself (a copy from a buffer without
/// COPY_SRC usage) and submits it; thread B's valid decode, run right after,
/// still returns `Ok` with the right answer; A's own `wait()` reports A's
/// error, once.
#[test]
fn errors_land_on_the_call_that_caused_them() {
    let Some(gpu) = gpu() else { return };
    let gpu = Arc::new(gpu);
    let mut rng = SplitMix64::new(seed("errors land on their call"));
    let r = Arc::new(rig(&gpu, &mut rng, &[50, 20], 2, 2, 64));
    let q = r.q(&mut rng);
    let (misused, checked) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
    let a = {
        let (gpu, r, misused, checked, q) = (
            gpu.clone(),
            r.clone(),
            misused.clone(),
            checked.clone(),
            q.clone(),
        );
        std::thread::spawn(move || {
            let _ = &r;
            let wrong = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("no COPY_SRC usage"),
                size: (q.len() * 4) as u64,
                usage: wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let qb = gpu.storage_init("q", &q).unwrap();
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(&wrong, 0, &qb, 0, 16);
            gpu.queue.submit([enc.finish()]);
            misused.wait();
            checked.wait();
            let first = gpu.wait();
            let second = gpu.wait();
            (first, second)
        })
    };
    misused.wait();
    let err = r.decode(&gpu, &q, &AttnOptions::default());
    checked.wait();
    let (first, second) = a.join().unwrap();
    assert!(matches!(err, Ok(e) if e < TOL), "B's valid decode: {err:?}");
    assert!(
        matches!(first, Err(GpuError::Validation(_))),
        "A's wait: {first:?}"
    );
    assert!(second.is_ok(), "reported once: {second:?}");
}

/// Sliding windows near `u32::MAX` are exact (no `tok + window` wrap), for
/// decode unsplit and split, and for prefill.
#[test]
fn windows_near_u32_max_are_exact() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("windows near u32::MAX"));
    let r = rig(&gpu, &mut rng, &[20, 100, 3], 2, 2, 64);
    for w in [u32::MAX, u32::MAX - 18, u32::MAX - 19, 1 << 31, 100, 19, 1] {
        for split in [Split::Never, Split::Tokens(64)] {
            let o = AttnOptions {
                sliding_window: Some(w),
                split,
                ..Default::default()
            };
            let q = r.q(&mut rng);
            let e = r.decode(&gpu, &q, &o).unwrap();
            assert!(e < TOL, "decode window {w} {split:?}: rel L2 {e:.3e}");
        }
        let o = AttnOptions {
            sliding_window: Some(w),
            ..Default::default()
        };
        let e = r.prefill(&gpu, &mut rng, 3, &o).unwrap();
        assert!(e < TOL, "prefill window {w}: rel L2 {e:.3e}");
    }
}

/// A `PagedAttention` refuses a cache of another shape than the one it was
/// built for, on the host path and at `run`, before anything runs.
#[test]
fn attention_checks_the_cache_it_is_given() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("attention checks its cache"));
    let big = rig(&gpu, &mut rng, &[600], 2, 2, 128);
    let small = rig(&gpu, &mut rng, &[40], 2, 2, 64);
    let q = big.q(&mut rng);
    let v = &big.view;
    let r = decode_view(&big.attn, &gpu, &small.cache, &q, v, &Default::default());
    match r {
        Err(e @ GpuError::Shape(ShapeError::OtherCache { .. })) => {
            assert!(e.to_string().contains("built for"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    let qb = gpu.storage_init("q", &q).unwrap();
    let out = gpu.storage("out", (q.len() * 4) as u64).unwrap();
    let mut plan = big.attn.plan();
    big.attn
        .plan_decode(
            &gpu,
            &mut plan,
            &DecodeTables::from_view(v),
            &[AttnOptions::default()],
        )
        .unwrap();
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    let r = big.attn.run(
        &gpu,
        &mut enc,
        &mut plan,
        &small.cache,
        0,
        0,
        &qb.as_entire_buffer_binding(),
        &out.as_entire_buffer_binding(),
    );
    assert!(
        matches!(r, Err(GpuError::Shape(ShapeError::OtherCache { .. }))),
        "{r:?}"
    );
    // The same shape (another cache of it) is fine.
    assert!(big.decode(&gpu, &q, &AttnOptions::default()).unwrap() < TOL);
    assert!(gpu.take_error().is_ok());
}

/// Shapes whose sizes overflow `u32` (or would allocate without bound) are
/// refused with an error, in debug and release: no division by zero, no
/// overflow panic, no abort.
#[test]
fn cache_shapes_that_overflow_are_refused() {
    let Some(gpu) = gpu() else { return };
    let base = KvCacheConfig::new(4, 16, 1, 64);
    for (what, cfg) in [
        (
            "elements per block a multiple of 2^32",
            KvCacheConfig {
                block_size: 256,
                num_kv_heads: 65536,
                head_dim: 256,
                ..base
            },
        ),
        (
            "a million KV heads",
            KvCacheConfig {
                num_kv_heads: 1_000_000,
                ..base
            },
        ),
        (
            "u32::MAX layers",
            KvCacheConfig {
                num_layers: u32::MAX,
                ..base
            },
        ),
        (
            "u32::MAX blocks",
            KvCacheConfig {
                num_blocks: u32::MAX,
                ..base
            },
        ),
        (
            "65535 KV heads x 256 x 256",
            KvCacheConfig {
                block_size: 256,
                num_kv_heads: 65535,
                head_dim: 256,
                ..base
            },
        ),
    ] {
        match KvCache::new(&gpu, cfg) {
            Err(e @ (GpuError::Pool(_) | GpuError::Shape(_) | GpuError::CacheTooLarge { .. })) => {
                eprintln!("{what}: {e}")
            }
            other => panic!("{what}: {:?}", other.map(|_| ())),
        }
    }
    assert!(gpu.take_error().is_ok());
}

/// `storage` and `read` check their sizes: no 0-byte buffer for `u64::MAX`,
/// no empty `Ok` for a read past the buffer.
#[test]
fn buffer_sizes_are_checked() {
    let Some(gpu) = gpu() else { return };
    assert!(matches!(
        gpu.storage("huge", u64::MAX),
        Err(GpuError::DeviceLimit {
            limit: "max_buffer_size",
            ..
        })
    ));
    let b = gpu.storage_init("data", &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    assert_eq!(gpu.read::<f32>(&b, 16).unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    for bytes in [u64::MAX, b.size() + 4] {
        match gpu.read::<f32>(&b, bytes) {
            Err(e @ GpuError::ReadPastEnd { .. }) => {
                assert!(e.to_string().contains("read of"), "{e}")
            }
            other => panic!("read of {bytes}: {other:?}"),
        }
    }
    assert!(gpu.take_error().is_ok());
}

/// On an adapter that ends long loops early (llvmpipe), the library never
/// hands the kernels a pass they cannot finish: a pass at the bound is
/// exact, an unsplit one past it is refused with the reason, and
/// `Split::Auto` stays under it (split-K decode, split-KV prefill). Elsewhere, the same long passes run and are exact.
#[test]
fn passes_an_adapter_cannot_finish_are_refused() {
    let needs = Needs::none().except(
        "the loop-cap bound",
        Adapter::NoLoopCap,
        "this adapter does not end long loops early: there is no cap to refuse at",
    );
    let Some(gpu) = gpu_for(&needs) else { return };
    let mut rng = SplitMix64::new(seed("loop cap"));
    // (kv heads, group, head_dim): the bound depends on head_dim; the group
    // sets the rows each pass scores.
    for (kvh, group, hd) in [
        (1, 1, 64),
        (1, 16, 64),
        (1, 8, 128),
        (1, 1, 256),
        (1, 4, 256),
    ] {
        if needs.skips(&gpu, "the loop-cap bound") {
            return;
        }
        let cap = gpu
            .max_tokens_per_pass(hd)
            .expect("an adapter that caps loops has a cap");
        let r = rig(&gpu, &mut rng, &[cap as usize + 1], kvh, group, hd);
        let q = r.q(&mut rng);
        let never = AttnOptions {
            split: Split::Never,
            ..Default::default()
        };
        match r.decode(&gpu, &q, &never) {
            Err(e @ GpuError::PassTooLong { .. }) => {
                assert!(e.to_string().contains("65535"), "{e}")
            }
            other => panic!("unsplit decode past the bound: {other:?}"),
        }
        let e = r.decode(&gpu, &q, &AttnOptions::default()).unwrap();
        assert!(
            e < TOL,
            "auto split over {} tokens, hd {hd} g{group}: {e:.3e}",
            cap + 1
        );
        // Prefill past the bound: refused unsplit, split-KV (and exact)
        // under Split::Auto.
        match r.prefill(&gpu, &mut rng, 2, &never) {
            Err(
                e @ GpuError::PassTooLong {
                    what: "prefill", ..
                },
            ) => {
                assert!(e.to_string().contains("prefill"), "{e}")
            }
            other => panic!("unsplit prefill past the bound: {other:?}"),
        }
        let e = r
            .prefill(&gpu, &mut rng, 2, &AttnOptions::default())
            .unwrap();
        assert!(
            e < TOL,
            "split-KV prefill over {} tokens, hd {hd} g{group}: {e:.3e}",
            cap + 1
        );
        // At the bound: exact, unsplit decode and prefill alike.
        let r = rig(&gpu, &mut rng, &[cap as usize], kvh, group, hd);
        let q = r.q(&mut rng);
        let e = r.decode(&gpu, &q, &never).unwrap();
        eprintln!("unsplit decode of {cap} tokens, hd {hd} group {group}: {e:.3e}");
        assert!(
            e < TOL,
            "unsplit decode of {cap} tokens, hd {hd} g{group}: {e:.3e}"
        );
        let nq = r.attn.prefill_qtile();
        let e = r
            .prefill(&gpu, &mut rng, nq, &AttnOptions::default())
            .unwrap();
        eprintln!("prefill over {cap} tokens, hd {hd} group {group}: {e:.3e}");
        assert!(
            e < TOL,
            "prefill over {cap} tokens, hd {hd} g{group}: {e:.3e}"
        );
    }
}

/// A prompt whose last block is already cached still computes a token:
/// not part of this suite; see tests/blocks.rs. Here: the prefix cache's
/// collision-resistance reaches the GPU, i.e. two tenants' equal prompts in
/// different salts get different blocks and their own K/V.
#[test]
fn salted_prompts_keep_their_own_kv() {
    let Some(gpu) = gpu() else { return };
    let mut rng = SplitMix64::new(seed("salted prompts"));
    let mut m =
        BlockManager::new(BlockManagerConfig::new(16, 4).with_prefix_caching(true)).unwrap();
    let prompt: Vec<u32> = (0..9).collect();
    let a = m.add_sequence_salted(&prompt, b"tenant a").unwrap();
    let va = m.batch_view(&[a]).unwrap();
    let b = m.add_sequence_salted(&prompt, b"tenant b").unwrap();
    let vb = m.batch_view(&[b]).unwrap();
    assert!(
        va.kv_indices.iter().all(|x| !vb.kv_indices.contains(x)),
        "{va:?} {vb:?}"
    );
    let cache = KvCache::new(&gpu, KvCacheConfig::new(16, 4, 1, 8)).unwrap();
    let ka = rng.signed_vec(9 * 8);
    let kb = rng.signed_vec(9 * 8);
    cache.write_kv(&gpu, 0, &ka, &ka, &va.slot_mapping).unwrap();
    cache.write_kv(&gpu, 0, &kb, &kb, &vb.slot_mapping).unwrap();
    let (k, _) = cache.read_layer(&gpu, 0).unwrap();
    for (slots, want) in [(&va.slot_mapping, &ka), (&vb.slot_mapping, &kb)] {
        for (t, &s) in slots.iter().enumerate() {
            assert_eq!(&k[s as usize * 8..][..8], &want[t * 8..][..8], "token {t}");
        }
    }
}

/// Devices with small limits get a typed refusal that names the limit, from
/// `KvCache::new` and `PagedAttention::new`, before anything is created:
/// WebGPU's downlevel defaults (4 storage buffers per stage), 32
/// invocations per workgroup, and too little workgroup memory for the
/// head_dim. (They got `Validation` errors before.)
#[test]
fn small_devices_get_typed_refusals() {
    let inst = wgpu::Instance::new({
        let mut d = wgpu::InstanceDescriptor::new_without_display_handle();
        d.backends = common::backends().unwrap();
        d
    });
    let Ok(adapter) = pollster::block_on(inst.request_adapter(&Default::default())) else {
        gpu();
        return;
    };
    let full = adapter.limits();
    let cfg = KvCacheConfig::new(4, 16, 2, 64);
    let open = |limits: wgpu::Limits| {
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            required_limits: limits,
            ..Default::default()
        }))
        .unwrap();
        (device, queue)
    };
    let cases: [(wgpu::Limits, &str, u64, u64); 3] = [
        (
            wgpu::Limits {
                max_storage_buffers_per_shader_stage: 4,
                ..full.clone()
            },
            "max_storage_buffers_per_shader_stage",
            5,
            4,
        ),
        (
            wgpu::Limits {
                max_compute_invocations_per_workgroup: 32,
                max_compute_workgroup_size_x: 32,
                max_compute_workgroup_size_y: 32,
                max_compute_workgroup_size_z: 32,
                ..full.clone()
            },
            "max_compute_invocations_per_workgroup",
            64,
            32,
        ),
        (
            wgpu::Limits::downlevel_defaults().using_resolution(full.clone()),
            "max_storage_buffers_per_shader_stage",
            5,
            4,
        ),
    ];
    for (limits, limit, needed, available) in cases {
        let (device, queue) = open(limits);
        let gpu = Gpu::from_device(&device, &queue);
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        match KvCache::new(&gpu, cfg) {
            Err(GpuError::DeviceLimit {
                limit: l,
                needed: n,
                available: a,
            }) => assert_eq!((l, n, a), (limit, needed, available)),
            Err(e) => panic!("{limit}: {e}"),
            Ok(_) => panic!("{limit}: accepted"),
        }
        assert!(
            pollster::block_on(scope.pop()).is_none(),
            "nothing was created"
        );
    }
    // Six storage buffers for attention, five for the cache: a device of
    // five makes the cache and refuses the attention.
    let (device, queue) = open(wgpu::Limits {
        max_storage_buffers_per_shader_stage: 5,
        ..full.clone()
    });
    let gpu = Gpu::from_device(&device, &queue);
    let cache = KvCache::new(&gpu, cfg).unwrap();
    match PagedAttention::new(&gpu, &cache, 4, &Default::default()) {
        Err(GpuError::DeviceLimit {
            limit,
            needed,
            available,
        }) => {
            assert_eq!(
                (limit, needed, available),
                ("max_storage_buffers_per_shader_stage", 6, 5)
            )
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted"),
    }
    // Workgroup memory too small for the smallest tile of head_dim 256.
    let (device, queue) = open(wgpu::Limits {
        max_compute_workgroup_storage_size: 1024,
        ..full.clone()
    });
    let gpu = Gpu::from_device(&device, &queue);
    let cache = KvCache::new(
        &gpu,
        KvCacheConfig {
            head_dim: 256,
            ..cfg
        },
    )
    .unwrap();
    match PagedAttention::new(&gpu, &cache, 4, &Default::default()) {
        Err(GpuError::DeviceLimit {
            limit,
            needed,
            available,
        }) => {
            assert_eq!(limit, "max_compute_workgroup_storage_size");
            assert!(
                needed > available && available == 1024,
                "{needed} {available}"
            );
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted"),
    }
}
