//! The GPU test suite: one binary, so the suites link once and share one
//! process (and Mesa's shader cache warms once for all of them). Each module
//! was a test binary of its own; its tests keep their names under the
//! module (`gpu_decode::edge_lengths_f32`).
//!
//! Every GPU test takes its adapter from `common::gpu()`: the default
//! adapter of the backends `PAGEDATTN_BACKEND` names (the tests read it,
//! the library does not). Without one a test says `skipped`, unless
//! `PAGEDATTN_REQUIRE_GPU=1`, which makes it fail. Run one backend's suite
//! with `PAGEDATTN_BACKEND=gl cargo test --test gpu`, and a part of it by
//! module: `cargo test --test gpu -- gpu_decode:: cascade::`.

use pagedattn_test_support::common;
#[path = "../../examples/engine.rs"]
mod engine;

mod adversarial_gpu;
mod bad_input;
mod cascade;
mod embed;
mod engine_example;
mod gpu_decode;
mod gpu_pipeline;
mod gpu_prefill;
mod hybrid;
mod mla;
mod mla_engine;
mod model_shapes;
mod quantized;
mod remote_prefix;
mod swap;
mod transfer;
