//! Fuzzes the GGUF loader, the llama configuration and the tokenizer on
//! hostile files (raw bytes, or edits of a small valid model); see
//! model/tests/tokenizer/gguf_ops.rs for the input format and what is checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../model/tests/tokenizer/gguf_ops.rs"]
mod gguf_ops;

fuzz_target!(|data: &[u8]| {
    gguf_ops::run(data);
});
