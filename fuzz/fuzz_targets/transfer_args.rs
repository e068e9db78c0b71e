//! Fuzzes what crosses into a pool from elsewhere: KV layout descriptors,
//! import payloads and copy-on-write lists, each against an independent
//! statement of its contract. See test-support/src/transfer_args.rs.
#![no_main]

use libfuzzer_sys::fuzz_target;

use pagedattn_test_support::transfer_args;

fuzz_target!(|data: &[u8]| {
    transfer_args::run(data);
});
