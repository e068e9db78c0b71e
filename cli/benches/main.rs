//! Criterion benchmarks: one module per group, listed below.

use criterion::criterion_main;

mod bookkeeping;
mod decode;

criterion_main!(bookkeeping::benches, decode::benches);
