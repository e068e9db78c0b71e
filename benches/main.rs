//! Criterion benchmarks: one module per group, listed below.

use criterion::criterion_main;

mod bookkeeping;

criterion_main!(bookkeeping::benches);
