//! The demo (the CLI's and the browser's) on a real adapter: bad settings
//! are refused with the layer's error instead of a panic, degenerate ones
//! run to the end, and a lost device is reported.

use pagedattn_test_support::common;

use common::gpu;
use pagedattn::gpu::GpuError;
use pagedattn_cli::demo::{Demo, DemoConfig, DemoError};

/// The demo refuses bad settings with the layer's error instead of panicking.
#[test]
fn gpu_demo_bad_settings() {
    let Some(gpu) = gpu() else { return };
    let bad = [
        DemoConfig {
            block_size: 12,
            ..Default::default()
        },
        DemoConfig {
            num_blocks: 0,
            ..Default::default()
        },
        DemoConfig {
            num_heads: 7,
            ..Default::default()
        },
        DemoConfig {
            head_dim: 66,
            ..Default::default()
        },
        DemoConfig {
            num_kv_heads: 0,
            ..Default::default()
        },
        DemoConfig {
            num_blocks: u32::MAX,
            ..Default::default()
        },
    ];
    for cfg in bad {
        let r = Demo::new(&gpu, cfg.clone());
        assert!(r.is_err(), "{cfg:?} accepted");
    }
    // Degenerate but valid: no requests, one sample, one-token limits.
    for cfg in [
        DemoConfig {
            requests: 0,
            ..Default::default()
        },
        DemoConfig {
            requests: 2,
            samples: 0,
            max_prompt: 0,
            max_output: 0,
            arrival_every: 0,
            ..Default::default()
        },
    ] {
        let mut d = Demo::new(&gpu, cfg.clone()).unwrap();
        let mut steps = 0;
        while !d.done() {
            pollster::block_on(d.step(&gpu)).unwrap();
            steps += 1;
            assert!(steps < 1000, "{cfg:?} never finished");
        }
        assert_eq!(d.manager().stats().free, d.manager().stats().total);
    }
}

/// After device loss the demo's constructor reports it.
#[test]
fn demo_after_device_loss() {
    let Some(gpu) = gpu() else { return };
    gpu.device.destroy();
    match Demo::new(&gpu, DemoConfig::default()) {
        Err(DemoError::Gpu(GpuError::Device(m))) => assert!(m.contains("lost"), "{m}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
}

/// A pool too small for the workload: the library scheduler preempts
/// (groups of samples by swapping to host memory and back), and every
/// decode still matches the f64 reference over the mirrored pool, swap
/// round trips included.
#[test]
fn gpu_demo_preempts_by_swap_and_stays_exact() {
    let Some(gpu) = gpu() else { return };
    let cfg = DemoConfig {
        requests: 6,
        samples: 3,
        num_blocks: 14,
        layers: 1,
        max_prompt: 60,
        max_output: 40,
        arrival_every: 1,
        dtype: pagedattn::gpu::KvDtype::F32,
        ..Default::default()
    };
    let mut d = Demo::new(&gpu, cfg).unwrap();
    let mut steps = 0;
    while !d.done() {
        let r = pollster::block_on(d.step(&gpu)).unwrap();
        assert!(r.max_rel_err < 1e-5, "step {steps}: {}", r.max_rel_err);
        steps += 1;
        assert!(steps < 2000, "never finished");
    }
    let st = d.scheduler().stats();
    eprintln!("{steps} steps, {st:?}");
    assert!(st.swapped_groups > 0 && st.blocks_swapped_in > 0, "{st:?}");
    assert_eq!(st.blocks_swapped_in, st.blocks_swapped_out);
    assert_eq!(st.finished, 6);
    assert_eq!(d.manager().stats().free, d.manager().stats().total);
}
