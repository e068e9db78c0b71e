//! Shared by the GPU tests: adapter discovery and random paged batches.
#![allow(dead_code)]

use pagedattn::blocks::{BatchView, BlockManager, BlockManagerConfig, SeqId};
use pagedattn::gpu::Gpu;
use pagedattn::rng::SplitMix64;

/// The default adapter, or `None` (skip) when there is none and
/// `PAGEDATTN_REQUIRE_GPU` is not set. With it set, a missing adapter fails.
pub fn gpu() -> Option<Gpu> {
    match backends().and_then(Gpu::with_backends) {
        Ok(g) => {
            eprintln!("adapter: {}", g.describe());
            Some(g)
        }
        Err(e) => {
            if std::env::var("PAGEDATTN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("PAGEDATTN_REQUIRE_GPU=1 but no adapter: {e}");
            }
            eprintln!("skipped: no GPU adapter ({e})");
            None
        }
    }
}

/// The backends `PAGEDATTN_BACKEND` names (all when unset): the tests,
/// like the CLI, read it; the library reads no environment variable.
pub fn backends() -> Result<wgpu::Backends, pagedattn::gpu::GpuError> {
    match std::env::var("PAGEDATTN_BACKEND") {
        Ok(name) => pagedattn::gpu::parse_backends(&name),
        Err(_) => Ok(wgpu::Backends::all()),
    }
}

/// Whether this run checks every shape of a grid: on the primary backend
/// (none named, or Vulkan). On a secondary one (`PAGEDATTN_BACKEND=gl`,
/// which CI runs to check the backend, not the math again) the grids run a
/// stated subset that still reaches every kernel, dtype, option and split
/// mode; `PAGEDATTN_FULL_GRID=1` runs everything anywhere.
pub fn exhaustive() -> bool {
    if std::env::var("PAGEDATTN_FULL_GRID").is_ok_and(|v| v == "1") {
        return true;
    }
    backends().is_ok_and(|b| b == wgpu::Backends::all() || b == wgpu::Backends::VULKAN)
}

/// `full` on the primary backend; on a secondary one the entries at
/// `subset` (indices into `full`), saying so in the log.
pub fn grid<T: Clone>(what: &str, full: &[T], subset: &[usize]) -> Vec<T> {
    if exhaustive() {
        return full.to_vec();
    }
    eprintln!(
        "{what}: {} of {} shapes on this backend (PAGEDATTN_FULL_GRID=1 for all)",
        subset.len(),
        full.len()
    );
    subset.iter().map(|&i| full[i].clone()).collect()
}

/// An adapter property a GPU test may declare it cannot use, for a part
/// of the test (as wgpu's harness declares failure cases per backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adapter {
    /// A CPU adapter (lavapipe, llvmpipe, SwiftShader, WARP).
    Cpu,
    /// An adapter that does not end long loops early (every real GPU):
    /// there is no loop cap to test against.
    NoLoopCap,
    /// One backend.
    Backend(wgpu::Backend),
}

impl Adapter {
    fn is(self, gpu: &Gpu) -> bool {
        match self {
            Adapter::Cpu => gpu.info.device_type == wgpu::DeviceType::Cpu,
            Adapter::NoLoopCap => !gpu.caps_loops(),
            Adapter::Backend(b) => gpu.info.backend == b,
        }
    }
}

/// What a GPU test declares before it runs: the features it needs, and
/// the parts it cannot run where, with why. [`gpu_for`] finds the adapter
/// and refuses one without the features (a skip that says so, or a failure
/// under `PAGEDATTN_REQUIRE_GPU=1`); [`Needs::skips`] tells the test, at
/// the part in question, that it stops there on this adapter, and logs it.
#[derive(Clone, Debug, Default)]
pub struct Needs {
    /// Adapter features the test uses.
    pub features: wgpu::Features,
    /// The parts the test declares it cannot run, per adapter property.
    pub parts: Vec<(&'static str, Adapter, &'static str)>,
}

impl Needs {
    /// A test that needs no feature and runs whole everywhere.
    pub fn none() -> Self {
        Self::default()
    }

    /// Declares that `part` does not run where `adapter` holds, because `why`.
    pub fn except(mut self, part: &'static str, adapter: Adapter, why: &'static str) -> Self {
        self.parts.push((part, adapter, why));
        self
    }

    /// Whether `part` stops short on `gpu`, as declared; says so in the log.
    /// A part that was never declared panics (a test must declare its cases).
    pub fn skips(&self, gpu: &Gpu, part: &str) -> bool {
        let declared: Vec<_> = self.parts.iter().filter(|p| p.0 == part).collect();
        assert!(!declared.is_empty(), "part `{part}` was not declared");
        match declared.iter().find(|p| p.1.is(gpu)) {
            Some((_, adapter, why)) => {
                eprintln!(
                    "expected on {} ({adapter:?}): `{part}` does not run: {why}",
                    gpu.describe()
                );
                true
            }
            None => false,
        }
    }
}

/// The test's adapter ([`gpu`]) if it has every feature `needs` declares;
/// else `None`, said in the log, or a failure with `PAGEDATTN_REQUIRE_GPU=1`.
pub fn gpu_for(needs: &Needs) -> Option<Gpu> {
    let gpu = gpu()?;
    let missing = needs.features - gpu.features;
    if missing.is_empty() {
        return Some(gpu);
    }
    if std::env::var("PAGEDATTN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!(
            "{} lacks the features this test needs: {missing:?}",
            gpu.describe()
        );
    }
    eprintln!("skipped: {} lacks {missing:?}", gpu.describe());
    None
}

/// A seed: `PAGEDATTN_SEED` if set, else a fixed one derived from the
/// test's name (so every run is reproducible, and tests differ from each
/// other). Printed, and every failure message names it, so a failure can be
/// replayed; set `PAGEDATTN_SEED` to explore fresh inputs.
pub fn seed(test: &str) -> u64 {
    let s = std::env::var("PAGEDATTN_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            // FNV-1a: stable across Rust releases and platforms.
            test.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
            })
        });
    eprintln!("{test}: seed {s} (replay with PAGEDATTN_SEED={s})");
    s
}

/// Rounds through f16 the way the packed pool stores values.
pub fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// The pool mirror is the library's (`reference::HostPool`), so engines
/// can use it too.
#[allow(unused_imports)]
pub use pagedattn::reference::{HostPool, Stored};

/// Sequences of the given lengths, added to a manager whose free list is
/// scrambled, so physical blocks come in shuffled order.
pub fn shuffled_batch(
    rng: &mut SplitMix64,
    num_blocks: u32,
    block_size: u32,
    lens: &[usize],
) -> (BlockManager, Vec<SeqId>, BatchView) {
    let mut m = BlockManager::new(BlockManagerConfig::new(num_blocks, block_size)).unwrap();
    m.scramble_free_list(rng.next_u64());
    let ids: Vec<SeqId> = lens
        .iter()
        .map(|&l| {
            let prompt: Vec<u32> = (0..l).map(|_| rng.below(32000) as u32).collect();
            m.add_sequence(&prompt).unwrap()
        })
        .collect();
    let view = m.batch_view(&ids).unwrap();
    (m, ids, view)
}

/// Blocks needed by sequences of these lengths, plus slack.
pub fn blocks_for(lens: &[usize], block_size: u32, slack: u32) -> u32 {
    lens.iter()
        .map(|&l| l.div_ceil(block_size as usize) as u32)
        .sum::<u32>()
        + slack
}

/// Random K/V for a shuffled batch, written into a fresh one-layer pool
/// and into its host mirror (the reference's view of it).
pub struct FilledPool {
    /// The batch's tables and slots.
    pub view: BatchView,
    /// The pool on the GPU.
    pub cache: pagedattn::gpu::KvCache,
    /// The mirror, rounded as the pool stores.
    pub host: HostPool,
}

/// A [`FilledPool`] of sequences of `lens` in blocks of `block_size` (and
/// `slack` free ones), `kv_heads` x `head_dim`, stored as `dtype`.
pub fn filled_pool(
    gpu: &Gpu,
    rng: &mut SplitMix64,
    lens: &[usize],
    block_size: u32,
    slack: u32,
    (kv_heads, head_dim): (u32, u32),
    dtype: pagedattn::gpu::KvDtype,
) -> FilledPool {
    let nb = blocks_for(lens, block_size, slack);
    let (_m, _ids, view) = shuffled_batch(rng, nb, block_size, lens);
    let cfg =
        pagedattn::gpu::KvCacheConfig::new(nb, block_size, kv_heads, head_dim).with_dtype(dtype);
    let cache = pagedattn::gpu::KvCache::new(gpu, cfg).unwrap();
    let row = (kv_heads * head_dim) as usize;
    let ntok = view.slot_mapping.len();
    let (k, v) = (rng.signed_vec(ntok * row), rng.signed_vec(ntok * row));
    cache.write_kv(gpu, 0, &k, &v, &view.slot_mapping).unwrap();
    let mut host = HostPool::new(
        nb as usize,
        kv_heads as usize,
        block_size as usize,
        head_dim as usize,
    );
    host.write(&view.slot_mapping, &k, &v, Stored::from(dtype));
    FilledPool { view, cache, host }
}

/// The reference's parameters for `opts` over `num_heads` heads.
pub fn ref_params(
    num_heads: u32,
    head_dim: u32,
    opts: &pagedattn::gpu::AttnOptions,
) -> pagedattn::reference::AttnParams {
    let mut p = pagedattn::reference::AttnParams::new(num_heads as usize, head_dim as usize);
    p.scale = opts.scale.unwrap_or(p.scale);
    p.soft_cap = opts.soft_cap;
    p.sliding_window = opts.sliding_window;
    p.alibi_slopes = opts.alibi_slopes.clone();
    p.sinks = opts.sinks.clone();
    p.sink_tokens = opts.sink_tokens;
    p
}

/// Host decode of layer 0 over `view`'s tables.
pub fn decode_view(
    attn: &pagedattn::gpu::PagedAttention,
    gpu: &Gpu,
    cache: &pagedattn::gpu::KvCache,
    q: &[f32],
    view: &BatchView,
    opts: &pagedattn::gpu::AttnOptions,
) -> Result<Vec<f32>, pagedattn::gpu::GpuError> {
    attn.decode(
        gpu,
        cache,
        0,
        q,
        &view.kv_indptr,
        &view.kv_indices,
        &view.seq_lens,
        opts,
    )
}

/// The K and V buffers of `layer`, read back whole (tails included).
pub fn raw_layer(gpu: &Gpu, cache: &pagedattn::gpu::KvCache, layer: u32) -> [Vec<u8>; 2] {
    let [k, v] = cache.layer(layer).unwrap();
    let c = cache.config();
    [
        gpu.read(k, c.layer_bytes()).unwrap(),
        gpu.read(v, c.v_layer_bytes()).unwrap(),
    ]
}

/// The bytes of block `b` in a layer buffer read by [`raw_layer`]: its
/// data, then (quantized pools) its rows' side words.
pub fn block_bytes(cfg: &pagedattn::gpu::KvCacheConfig, buf: &[u8], b: u32, is_k: bool) -> Vec<u8> {
    let rows = (cfg.num_kv_heads * cfg.block_size) as usize;
    let data = rows * cfg.head_dim as usize * cfg.dtype.bytes() as usize;
    let mut out = buf[b as usize * data..(b as usize + 1) * data].to_vec();
    let side = cfg.side_words_per_block(is_k) as usize * 4;
    let at = cfg.data_words() as usize * 4 + b as usize * side;
    out.extend_from_slice(&buf[at..at + side]);
    out
}

/// The decode tolerance (relative L2 against the f64 reference) of a pool
/// of `d`, shared by the kernel suites and the CUDA parity check.
#[allow(dead_code)]
pub fn decode_tol(d: pagedattn::gpu::KvDtype) -> f64 {
    use pagedattn::gpu::KvDtype;
    match d {
        KvDtype::F32 => 1e-5,
        KvDtype::F16 => 2e-3,
        // The mirror holds the bf16-rounded values and the kernels widen
        // them exactly: only f32 accumulation differs.
        KvDtype::Bf16 => 1e-5,
        // The quantized pools' targets on unit-normal K/V (tests/gpu/quantized.rs
        // widens them for uncalibrated outlier keys).
        KvDtype::Int8 => 1e-2,
        KvDtype::Fp8E4M3 => 5e-2,
    }
}
