//! The host test suite (no adapter needed): the block manager, the
//! scheduler, the f64 reference, the shaders' static checks, and the fuzz
//! corpora replayed on stable Rust. One binary; each module was a test
//! binary of its own and its tests keep their names under the module.

#[path = "../common/block_ops.rs"]
mod block_ops;
#[path = "../common/calibration.rs"]
mod calibration;
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/gpu_args.rs"]
mod gpu_args;
#[path = "../common/scheduler_ops.rs"]
mod scheduler_ops;
#[path = "../common/transfer_args.rs"]
mod transfer_args;

mod adversarial;
mod blocks;
mod blocks_props;
mod docs;
mod fuzz_corpus;
mod fuzz_corpus_gpu_args;
mod reference;
mod scheduler;
mod shaders;
