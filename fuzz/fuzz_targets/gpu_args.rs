//! Fuzzes the GPU layer's host-side argument checks: each must never panic
//! and must accept exactly what an independent statement of its contract
//! accepts. See test-support/src/gpu_args.rs for the input format.
#![no_main]

use libfuzzer_sys::fuzz_target;

use pagedattn_test_support::gpu_args;

fuzz_target!(|data: &[u8]| {
    gpu_args::run(data);
});
