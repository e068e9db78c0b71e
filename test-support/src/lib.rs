//! What pagedattn's test suites (`tests/gpu`, `tests/host`, the CLI's,
//! the model's) and its fuzz targets share, as one crate instead of files
//! included by path:
//!
//! - [`common`]: the adapter a GPU test runs on, found from what the test
//!   declares it needs ([`common::Needs`]), seeds, grids and random paged
//!   batches;
//! - [`harness`]: what the input harnesses share (counters declared with
//!   [`tally!`], corpus replay);
//! - the input harnesses of the fuzz targets, replayed on stable by the host
//!   tests: [`block_ops`], [`calibration`], [`gpu_args`], [`scheduler_ops`],
//!   [`transfer_args`].

#[macro_use]
pub mod harness;

pub mod block_ops;
pub mod calibration;
pub mod common;
pub mod gpu_args;
pub mod scheduler_ops;
pub mod transfer_args;
