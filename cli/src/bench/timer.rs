//! GPU timing: timestamp queries where the adapter has them, else wall time
//! around submit + wait. Warm-up first, then the median of repeated submits,
//! each of several runs back to back ([`per_submit`]).

use pagedattn::gpu::{Gpu, GpuError};

/// A first warm-up slower than this (milliseconds) means fewer repeats.
pub const SLOW_RUN_MS: f64 = 250.0;

/// Where the times come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum TimingSource {
    /// GPU timestamps written by empty passes around the measured work.
    Timestamps,
    /// Wall clock around submit and a blocking wait.
    WallClock,
}

/// Times command sequences on one device.
pub struct Timer<'a> {
    gpu: &'a Gpu,
    queries: Option<(wgpu::QuerySet, wgpu::Buffer)>,
    period_ns: f64,
    /// Warm-up runs before measuring.
    pub warmup: usize,
    /// Measured runs (the median is reported).
    pub runs: usize,
}

impl<'a> Timer<'a> {
    /// Uses timestamps if the device has them, unless `wall_clock` is set.
    pub fn new(gpu: &'a Gpu, wall_clock: bool) -> Self {
        let queries =
            (!wall_clock && gpu.features.contains(wgpu::Features::TIMESTAMP_QUERY)).then(|| {
                let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("bench timestamps"),
                    ty: wgpu::QueryType::Timestamp,
                    count: 2,
                });
                let buf = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("timestamps"),
                    size: 16,
                    usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                });
                (set, buf)
            });
        Self {
            gpu,
            period_ns: gpu.queue.get_timestamp_period() as f64,
            queries,
            warmup: 2,
            runs: 7,
        }
    }

    /// The source in use.
    pub fn source(&self) -> TimingSource {
        if self.queries.is_some() {
            TimingSource::Timestamps
        } else {
            TimingSource::WallClock
        }
    }

    fn marker(enc: &mut wgpu::CommandEncoder, set: &wgpu::QuerySet, index: u32) {
        // An empty pass whose only job is to write a timestamp.
        let (b, e) = if index == 0 {
            (Some(0), None)
        } else {
            (None, Some(1))
        };
        let _ = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("timestamp"),
            timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                query_set: set,
                beginning_of_pass_write_index: b,
                end_of_pass_write_index: e,
            }),
        });
    }

    /// One run of `record(run_index, encoder)`, in milliseconds.
    pub fn once(
        &self,
        run: usize,
        record: &mut dyn FnMut(usize, &mut wgpu::CommandEncoder),
    ) -> Result<f64, GpuError> {
        self.batch(run, 1, record)
    }

    /// `n` runs (`record(run * n + i)`, so inputs rotate) back to back in
    /// one submit between one pair of timestamps: milliseconds per run. The
    /// GPU never idles between them, as it would waiting on a readback.
    pub fn batch(
        &self,
        run: usize,
        n: usize,
        record: &mut dyn FnMut(usize, &mut wgpu::CommandEncoder),
    ) -> Result<f64, GpuError> {
        let n = n.max(1);
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        match &self.queries {
            Some((set, buf)) => {
                Self::marker(&mut enc, set, 0);
                for i in 0..n {
                    record(run * n + i, &mut enc);
                }
                Self::marker(&mut enc, set, 1);
                enc.resolve_query_set(set, 0..2, buf, 0);
                self.gpu.queue.submit([enc.finish()]);
                let t: Vec<u64> = self.gpu.read(buf, 16)?;
                Ok(t[1].saturating_sub(t[0]) as f64 * self.period_ns / 1e6 / n as f64)
            }
            None => {
                let t0 = std::time::Instant::now();
                for i in 0..n {
                    record(run * n + i, &mut enc);
                }
                self.gpu.queue.submit([enc.finish()]);
                self.gpu.wait()?;
                Ok(t0.elapsed().as_secs_f64() * 1e3 / n as f64)
            }
        }
    }

    /// Keeps the device busy with copies for at least `secs` seconds, so
    /// its clocks are up before anything is timed (an idle H200 reads 345
    /// of 1980 MHz).
    pub fn warm(&self, secs: f64) -> Result<(), GpuError> {
        let bytes = (256u64 << 20).min(self.gpu.limits.max_buffer_size / 2);
        let a = self.gpu.storage("warm-up a", bytes)?;
        let b = self.gpu.storage("warm-up b", bytes)?;
        let t0 = std::time::Instant::now();
        while t0.elapsed().as_secs_f64() < secs {
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            for _ in 0..8 {
                enc.copy_buffer_to_buffer(&a, 0, &b, 0, bytes);
                enc.copy_buffer_to_buffer(&b, 0, &a, 0, bytes);
            }
            self.gpu.queue.submit([enc.finish()]);
            self.gpu.wait()?;
        }
        Ok(())
    }

    /// Median milliseconds of `runs` submits after `warmup`, each of
    /// [`per_submit`] runs back to back. The closure gets the run index so
    /// it can rotate inputs. When the first warm-up takes longer than
    /// [`SLOW_RUN_MS`], 3 runs after that one warm-up are measured, so a
    /// software adapter finishes the grid in minutes.
    pub fn median(
        &self,
        mut record: impl FnMut(usize, &mut wgpu::CommandEncoder),
    ) -> Result<f64, GpuError> {
        let first = self.once(0, &mut record)?;
        let (warmup, runs) = if first > SLOW_RUN_MS {
            (1, self.runs.min(3))
        } else {
            (self.warmup.max(1), self.runs)
        };
        let n = per_submit(first);
        for i in 1..warmup {
            self.batch(i, n, &mut record)?;
        }
        let mut t = Vec::with_capacity(runs);
        for i in 0..runs {
            t.push(self.batch(warmup + i, n, &mut record)?);
        }
        t.sort_by(|a, b| a.total_cmp(b));
        Ok(t[t.len() / 2])
    }
}

/// Runs per submit for work whose first run took `first_ms`: 20 for work of
/// a few milliseconds or less (a GPU's decode step), so the device never
/// idles between timed runs; fewer for slow work, down to one past 100 ms
/// (a software adapter's), so the bench still finishes.
pub fn per_submit(first_ms: f64) -> usize {
    if first_ms <= 5.0 {
        20
    } else {
        ((100.0 / first_ms) as usize).clamp(1, 20)
    }
}
