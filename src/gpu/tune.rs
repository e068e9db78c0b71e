//! The autotuner: times every eligible decode kernel on synthetic data for
//! one (adapter, driver, shape) and keeps the fastest. Its results belong
//! to the caller's [`Tuner`] (and the tune file the caller names), never to
//! a process-wide table: building a [`PagedAttention`] with
//! [`new`](PagedAttention::new) is not changed by any tuning.

use super::attention::{AttnOptions, PagedAttention};
use super::compose::ShaderShape;
use super::context::Gpu;
use super::dtype::KvDtype;
use super::error::GpuError;
use super::kernel::Kernel;
use super::kv_cache::{KvCache, KvCacheConfig};
use super::plan::{AttentionPlan, DecodeTables};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What [`Tuner::tune`] measured.
#[derive(Clone, Debug, PartialEq)]
pub struct TuneReport {
    /// Adapter, driver and shape the result is kept under.
    pub key: String,
    /// The fastest variant (or the kept choice).
    pub chosen: Kernel,
    /// Median microseconds of one synthetic decode per variant timed; empty
    /// when the choice was already kept.
    pub micros: Vec<(Kernel, f64)>,
    /// The synthetic batch: (sequences, tokens each).
    pub batch: (u32, u32),
    /// Whether the choice was already kept (nothing was timed).
    pub cached: bool,
}

/// Sequences of the synthetic batch.
const TUNE_SEQS: u32 = 8;
/// Bytes of K+V the synthetic batch reads, at most.
const TUNE_BYTES: u64 = 24 << 20;

/// Largest tune file read: a few hundred lines of `key=kernel`. A longer
/// one is not a tune file.
const TUNE_FILE_MAX_BYTES: u64 = 1 << 20;

/// The tuner's choices per (adapter, driver, shape), in memory and, when
/// the caller names one, in a tune file of `key=kernel` lines that later
/// processes read. An engine keeps one and builds its attention through
/// [`attention`](Self::attention); nothing else reads its choices.
#[derive(Debug, Default)]
pub struct Tuner {
    choices: Mutex<HashMap<String, Kernel>>,
    file: Option<PathBuf>,
}

impl Tuner {
    /// A tuner that keeps its choices in memory only.
    pub fn new() -> Self {
        Self::default()
    }

    /// A tuner that also reads and writes the tune file at `path` (a
    /// failure to read or write it is ignored: the file is a cache).
    pub fn with_file(path: impl Into<PathBuf>) -> Self {
        Self {
            choices: Mutex::default(),
            file: Some(path.into()),
        }
    }

    /// The tune file, if any.
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Kernel>> {
        self.choices.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The kept choice for `key`: this tuner's, else its file's.
    fn choice(&self, key: &str) -> Option<Kernel> {
        let mut map = self.lock();
        if let Some(k) = map.get(key) {
            return Some(*k);
        }
        let text = read_tune_file(self.file.as_deref()?)?;
        let k = text.lines().find_map(|line| {
            let (k, v) = line.rsplit_once('=')?;
            (k == key).then(|| Kernel::from_name(v)).flatten()
        })?;
        map.insert(key.to_string(), k);
        Some(k)
    }

    /// The kept choice for `num_heads` query heads over a cache shaped like
    /// `cache` on `gpu`, where that kernel can run the shape there.
    pub fn kept(&self, gpu: &Gpu, cache: &KvCache, num_heads: u32) -> Option<Kernel> {
        let c = cache.config();
        if num_heads == 0 || c.num_kv_heads == 0 || !num_heads.is_multiple_of(c.num_kv_heads) {
            return None;
        }
        let base = PagedAttention::base_shape(c, num_heads, true);
        let key = tune_key(gpu, &base, num_heads, c.num_kv_heads);
        self.choice(&key)
            .filter(|k| PagedAttention::eligible_kernels(gpu, cache, num_heads).contains(k))
    }

    /// Keeps `k` for `key`, in memory and in the tune file if named.
    fn remember(&self, key: &str, k: Kernel) {
        self.lock().insert(key.to_string(), k);
        if let Some(path) = &self.file {
            // Only a regular file (or none yet) is written: opening a FIFO
            // to write would block.
            if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
                return;
            }
            let old = read_tune_file(path).unwrap_or_default();
            let mut lines: Vec<String> = old
                .lines()
                .filter(|l| l.rsplit_once('=').is_some_and(|(lk, _)| lk != key))
                .map(String::from)
                .collect();
            lines.push(format!("{key}={}", k.name()));
            let _ = std::fs::write(path, lines.join("\n") + "\n");
        }
    }

    /// Times every variant that can run `num_heads` query heads over a
    /// cache shaped like `cache` on `gpu`, interleaved, on a synthetic batch
    /// in a scratch pool (the caller's pool is not touched), within about
    /// `budget` after the compiles, and keeps the fastest for this adapter,
    /// driver and shape. A choice this tuner (or its file) already keeps is
    /// returned without timing unless `retime`.
    pub fn tune(
        &self,
        gpu: &Gpu,
        cache: &KvCache,
        num_heads: u32,
        budget: Duration,
        retime: bool,
    ) -> Result<TuneReport, GpuError> {
        let c = *cache.config();
        let eligible = PagedAttention::eligible_kernels(gpu, cache, num_heads);
        if eligible.is_empty() {
            return Err(super::error::ShapeError::NoKernel {
                heads: num_heads,
                kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
            }
            .into());
        }
        let base = PagedAttention::base_shape(&c, num_heads, true);
        let key = tune_key(gpu, &base, num_heads, c.num_kv_heads);
        let per_token = 2 * c.num_kv_heads as u64 * c.head_dim as u64 * c.dtype.bytes();
        let tokens = (TUNE_BYTES / (TUNE_SEQS as u64 * per_token)).clamp(64, 2048) as u32;
        let batch = (TUNE_SEQS, tokens);
        if !retime {
            // A cached kernel that cannot run this shape here (a tune file
            // edited, or from another build) is not a choice: time again.
            if let Some(k) = self.choice(&key).filter(|k| eligible.contains(k)) {
                return Ok(TuneReport {
                    key,
                    chosen: k,
                    micros: Vec::new(),
                    batch,
                    cached: true,
                });
            }
        }
        let blocks_per_seq = tokens.div_ceil(c.block_size);
        // Random K/V and queries: the timing must not see a constant input.
        let mut rng = crate::rng::SplitMix64::new(0x7475_6e65);
        let scratch = random_scratch(gpu, &c, TUNE_SEQS * blocks_per_seq, &mut rng)?;
        let q: Vec<f32> = (0..(TUNE_SEQS * num_heads * c.head_dim))
            .map(|_| rng.next_signed())
            .collect();
        let qb = gpu.storage_init("tune q", &q)?;
        let out = gpu.storage("tune out", q.len() as u64 * 4)?;
        // Sequences in shuffled blocks, as a paged pool holds them.
        let mut ids: Vec<u32> = (0..TUNE_SEQS * blocks_per_seq).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let indptr: Vec<u32> = (0..=TUNE_SEQS).map(|s| s * blocks_per_seq).collect();
        let lens = vec![tokens; TUNE_SEQS as usize];
        let tables = DecodeTables {
            kv_indptr: &indptr,
            kv_indices: &ids,
            seq_lens: &lens,
        };
        let mut runs = Vec::new();
        for &kern in &eligible {
            let attn = PagedAttention::new(
                gpu,
                &scratch,
                num_heads,
                &crate::gpu::AttentionConfig::new().kernel(kern),
            )?;
            let mut plan = attn.plan();
            attn.plan_decode(gpu, &mut plan, &tables, &[AttnOptions::default()])?;
            runs.push((kern, attn, plan, Vec::<f64>::new()));
        }
        let time = |attn: &PagedAttention, plan: &mut AttentionPlan| -> Result<f64, GpuError> {
            let t0 = Instant::now();
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            attn.run(
                gpu,
                &mut enc,
                plan,
                &scratch,
                0,
                0,
                &qb.as_entire_buffer_binding(),
                &out.as_entire_buffer_binding(),
            )?;
            gpu.queue.submit([enc.finish()]);
            gpu.wait()?;
            Ok(t0.elapsed().as_secs_f64() * 1e6)
        };
        // Warm-up: first dispatches pay for lazy driver work.
        for (_, attn, plan, _) in runs.iter_mut() {
            time(attn, plan)?;
        }
        let start = Instant::now();
        let mut rounds = 0;
        while rounds < 3 || (start.elapsed() < budget && rounds < 15) {
            for (_, attn, plan, t) in runs.iter_mut() {
                t.push(time(attn, plan)?);
            }
            rounds += 1;
            if start.elapsed() > budget * 2 {
                break;
            }
        }
        let micros: Vec<(Kernel, f64)> = runs
            .iter_mut()
            .map(|(k, _, _, t)| {
                t.sort_by(f64::total_cmp);
                (*k, t[t.len() / 2])
            })
            .collect();
        let chosen = micros
            .iter()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|m| m.0)
            .unwrap_or(eligible[0]);
        self.remember(&key, chosen);
        Ok(TuneReport {
            key,
            chosen,
            micros,
            batch,
            cached: false,
        })
    }

    /// [`tune`](Self::tune) (once per adapter, driver and shape, within
    /// about 1.5 s) and then the attention with the chosen kernel: the
    /// engine's constructor. The report's `chosen` is what runs.
    pub fn attention(
        &self,
        gpu: &Gpu,
        cache: &KvCache,
        num_heads: u32,
    ) -> Result<(PagedAttention, TuneReport), GpuError> {
        let report = self.tune(gpu, cache, num_heads, Duration::from_millis(1500), false)?;
        let attn = PagedAttention::new(
            gpu,
            cache,
            num_heads,
            &crate::gpu::AttentionConfig::new().kernel(report.chosen),
        )?;
        Ok((attn, report))
    }
}

/// The tune file's text, if `path` names a regular file of at most
/// [`TUNE_FILE_MAX_BYTES`] (a FIFO, a device such as `/dev/zero`, a
/// directory or a huge file is ignored: reading it could block or never
/// end), read through a bounded reader.
fn read_tune_file(path: &Path) -> Option<String> {
    use std::io::Read;
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_file() || meta.len() > TUNE_FILE_MAX_BYTES {
        return None;
    }
    let file = std::fs::File::open(path).ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = String::new();
    file.take(TUNE_FILE_MAX_BYTES)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

/// A one-layer pool shaped like `c` with `num_blocks` blocks of random K/V
/// (quantized pools: random bytes with scales of 1 and no outlier channels).
fn random_scratch(
    gpu: &Gpu,
    c: &KvCacheConfig,
    num_blocks: u32,
    rng: &mut crate::rng::SplitMix64,
) -> Result<KvCache, GpuError> {
    let scratch = KvCache::new(
        gpu,
        KvCacheConfig {
            num_layers: 1,
            num_blocks,
            ..*c
        },
    )?;
    let [k, v] = scratch.layer(0)?;
    let elems = (k.size() / 4) as usize;
    let words: Vec<u32> = (0..elems)
        .map(|_| match c.dtype {
            KvDtype::F32 => rng.next_signed().to_bits(),
            KvDtype::F16 => {
                let a = half::f16::from_f32(rng.next_signed()).to_bits() as u32;
                let b = half::f16::from_f32(rng.next_signed()).to_bits() as u32;
                a | b << 16
            }
            KvDtype::Bf16 => {
                let a = half::bf16::from_f32(rng.next_signed()).to_bits() as u32;
                let b = half::bf16::from_f32(rng.next_signed()).to_bits() as u32;
                a | b << 16
            }
            // Four random bytes; E4M3's NaN pattern avoided.
            _ => (rng.next_u64() as u32) & 0x7777_7777,
        })
        .collect();
    let mut words = words;
    let mut v_words = words[..(v.size() / 4) as usize].to_vec();
    if c.dtype.quantized() {
        // Scales of 1 after the data, no outlier channels.
        let at = scratch.config().data_words() as usize;
        let init = scratch.config().side_and_tail_init(true);
        words[at..at + init.len()].copy_from_slice(&init);
        let init = scratch.config().side_and_tail_init(false);
        v_words[at..at + init.len()].copy_from_slice(&init);
    }
    gpu.queue.write_buffer(k, 0, bytemuck::cast_slice(&words));
    gpu.queue.write_buffer(v, 0, bytemuck::cast_slice(&v_words));
    Ok(scratch)
}

/// The key of one tuning result: adapter, driver and shape.
fn tune_key(gpu: &Gpu, s: &ShaderShape, num_heads: u32, num_kv_heads: u32) -> String {
    format!(
        "{}|{}|{:?}|{}x{}|d{}|b{}|{:?}",
        gpu.info.name,
        gpu.info.driver_info,
        gpu.info.backend,
        num_heads,
        num_kv_heads,
        s.head_dim,
        s.block_size,
        s.dtype
    )
    .replace(['\n', '='], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tune file is read only when it is a regular file of bounded
    /// size: a FIFO (which blocked `PagedAttention::new` forever), a device
    /// (`/dev/zero` took 9 s), a directory or an oversized file are ignored
    /// at once; a regular file is read.
    #[test]
    fn the_tune_file_is_read_only_when_regular_and_bounded() {
        let dir = std::env::temp_dir().join(format!("pagedattn-tune-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let _ = std::fs::remove_file(&fifo);
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        let start = std::time::Instant::now();
        if made.is_ok_and(|s| s.success()) {
            assert_eq!(read_tune_file(&fifo), None);
        }
        assert_eq!(read_tune_file(std::path::Path::new("/dev/zero")), None);
        assert_eq!(read_tune_file(&dir), None);
        let big = dir.join("big");
        std::fs::write(&big, vec![b'x'; TUNE_FILE_MAX_BYTES as usize + 1]).unwrap();
        assert_eq!(read_tune_file(&big), None);
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
        let ok = dir.join("ok");
        let text = "a|b=tiled\n".repeat(10);
        std::fs::write(&ok, &text).unwrap();
        assert_eq!(read_tune_file(&ok).as_deref(), Some(text.as_str()));
        assert_eq!(read_tune_file(&dir.join("missing")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn small_device() -> Option<(wgpu::Device, wgpu::Queue)> {
        let Ok(full) = Gpu::new() else {
            assert!(
                std::env::var_os("PAGEDATTN_REQUIRE_GPU").is_none(),
                "no adapter"
            );
            return None;
        };
        // The same adapter with 4 KiB of workgroup memory: `lanes` cannot
        // run head_dim 256 there, `serial` (no workgroup memory) can.
        let inst = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
        let adapter = pollster::block_on(inst.request_adapter(&Default::default()))
            .expect("an adapter: Gpu::new just found one");
        let limits = wgpu::Limits {
            max_compute_workgroup_storage_size: 4096,
            ..adapter.limits()
        };
        let dev = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            required_limits: limits,
            ..Default::default()
        }))
        .unwrap();
        drop(full);
        Some(dev)
    }

    /// A kept choice the shape cannot run on the device is not taken: the
    /// tuner times again and reports what runs (a probe's tune file had
    /// named a kernel `tuned()` reported while `tiled` ran). Tuning belongs
    /// to its tuner: `new` and another tuner are not changed by it.
    #[test]
    fn an_ineligible_kept_kernel_is_not_reported_or_run_and_tuning_is_not_global() {
        let Some((device, queue)) = small_device() else {
            return;
        };
        let gpu = Gpu::from_device(&device, &queue);
        let cfg = KvCacheConfig::new(4, 16, 1, 256);
        let cache = KvCache::new(&gpu, cfg).unwrap();
        let heads = 8;
        let eligible = PagedAttention::eligible_kernels(&gpu, &cache, heads);
        assert!(!eligible.contains(&Kernel::Lanes), "{eligible:?}");
        let base = PagedAttention::base_shape(&cfg, heads, true);
        let key = tune_key(&gpu, &base, heads, cfg.num_kv_heads);
        let dir = std::env::temp_dir().join(format!("pagedattn-tuner-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("tune");
        std::fs::write(&file, format!("{key}=lanes\n")).unwrap();
        let tuner = Tuner::with_file(&file);
        assert_eq!(tuner.choice(&key), Some(Kernel::Lanes), "the file is read");
        let (attn, report) = tuner.attention(&gpu, &cache, heads).unwrap();
        assert_eq!(report.chosen, attn.kernel());
        assert!(!report.cached, "the ineligible kept choice was timed again");
        assert!(eligible.contains(&report.chosen));
        // The file now holds what was measured, and a new tuner on it reads that.
        let again = Tuner::with_file(&file);
        assert_eq!(again.choice(&key), Some(report.chosen));
        // Nothing global: a fresh tuner without the file keeps nothing, and
        // `new` takes the adapter's default whatever was tuned.
        assert_eq!(Tuner::new().choice(&key), None);
        let plain = PagedAttention::new(&gpu, &cache, heads, &Default::default()).unwrap();
        assert_eq!(plain.kernel(), crate::gpu::kernels::default_kernel(&gpu));
        // A tuner remembers in memory: asked again it times nothing.
        let (_, second) = tuner.attention(&gpu, &cache, heads).unwrap();
        assert!(second.cached && second.micros.is_empty());
        assert_eq!(second.chosen, report.chosen);
        assert_eq!(tuner.kept(&gpu, &cache, heads), Some(report.chosen));
        assert_eq!(Tuner::new().kept(&gpu, &cache, heads), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
