//! Fuzzes the block manager's whole API: the input is decoded into a
//! configuration and a sequence of calls (add with prefix caching, append,
//! fork, free, batch views, chunked steps, swap-out / swap-in, take
//! copies, evict, queries), each checked
//! against a model; see test-support/src/block_ops.rs for the format and the
//! invariants.
#![no_main]

use libfuzzer_sys::fuzz_target;

use pagedattn_test_support::block_ops;

fuzz_target!(|data: &[u8]| {
    block_ops::run(data);
});
