//! Fuzzes the command line: the input is split into an argv (NUL or newline
//! separated words), parsed by the binary's own clap parser (cli/src/args.rs) and
//! checked; checked simulations run, cut down to a few small requests. No
//! adapter is needed. See cli/tests/fuzz_corpus_cli/cli_args.rs for the format and the
//! rules checked; cli/tests/fuzz_corpus_cli.rs replays corpus/cli_args/ on stable.
//! Run with the flag dictionary from the repository root:
//!   RUSTC_BOOTSTRAP=1 cargo fuzz run cli_args -- -dict=fuzz/cli_args.dict -max_total_time=600
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../cli/tests/fuzz_corpus_cli/cli_args.rs"]
mod cli_args;

fuzz_target!(|data: &[u8]| {
    cli_args::run(data);
});
