//! The host test suite (no adapter needed): the block manager, the
//! scheduler, the f64 reference, the shaders' static checks, and the fuzz
//! corpora replayed on stable Rust. One binary; each module was a test
//! binary of its own and its tests keep their names under the module.

use pagedattn_test_support::{
    block_ops, calibration, common, gpu_args, scheduler_ops, transfer_args,
};

mod adversarial;
mod blocks;
mod blocks_props;
mod docs;
mod fuzz_corpus;
mod fuzz_corpus_gpu_args;
mod hybrid;
mod reference;
mod scheduler;
mod shaders;
