//! The demo (the CLI's and the browser's) on a real adapter: bad settings
//! are refused with the layer's error instead of a panic, degenerate ones
//! run to the end, and a lost device is reported.

#[path = "../../tests/common/mod.rs"]
mod common;

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
