//! Fuzzes the GPU layer's host-side argument checks: each must never panic
//! and must accept exactly what an independent statement of its contract
//! accepts. See tests/common/gpu_args.rs for the input format.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/common/gpu_args.rs"]
mod gpu_args;

fuzz_target!(|data: &[u8]| {
    gpu_args::run(data);
});
