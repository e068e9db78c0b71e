//! Fuzzes the scheduler's whole API, forged, foreign and stale steps and handles included; see
//! test-support/src/scheduler_ops.rs for the input format and what is checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

use pagedattn_test_support::scheduler_ops;

fuzz_target!(|data: &[u8]| {
    scheduler_ops::run(data);
});
