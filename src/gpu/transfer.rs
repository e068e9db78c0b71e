//! Blocks exported to bytes and imported from them: between pools of the
//! same layout in other processes or on other machines (a shared prefix
//! store, disaggregated prefill), generalised from swap.
//!
//! An export takes any list of pool blocks and a range of layers, and
//! writes them into bytes the caller owns (so a transport may register
//! them), block after block: a block's bytes are consecutive, so each may
//! be stored on its own (keyed by its chain hash). With them goes a
//! [`KvLayout`], a versioned descriptor of what the bytes mean; an import
//! whose descriptor does not match the destination pool is refused, never
//! misread. Quantized blocks travel with their side words (int8 row
//! scales, outlier residuals); the per-layer state they are read with (fp8
//! scales, int8 K smoothing, outlier channels) does not travel, but its
//! SHA-256 does: an import into a pool whose layers were calibrated
//! differently is refused.
//!
//! Each direction is one submit of `copy_buffer_to_buffer` commands (runs
//! of consecutive pool blocks go as one copy per layer and part).

use std::ops::Range;

use sha2::{Digest, Sha256};

use super::context::Gpu;
use super::dtype::KvDtype;
use super::error::{GpuError, TransferError};
use super::kv_cache::{KvCache, KvCacheConfig, KV_MAX};
use super::swap::{block_ranges, runs, MAX_SWAP_BYTES};

/// The version of the byte layout [`KvLayout`] describes; an import of
/// another version is refused.
pub const KV_LAYOUT_VERSION: u32 = 1;

/// Bytes of a [`KvLayout`] as [`KvLayout::to_bytes`] writes it.
pub const KV_LAYOUT_BYTES: usize = 108;

const MAGIC: [u8; 8] = *b"PAGEDKV\0";

/// What exported blocks hold and how: the pool's shape, the layers, the
/// bytes of each part of a block, and a digest of the layers' state. A
/// block's bytes are, for each layer of `layers` in order: K data, K side
/// words, V data, V side words ([`KvCacheConfig`](super::KvCacheConfig) documents each part's
/// layout; the side parts are empty unless the pool is quantized). Written
/// and read as [`KV_LAYOUT_BYTES`] little-endian bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// [`KV_LAYOUT_VERSION`] of the exporter.
    pub version: u32,
    /// The exporting library's version (major, minor, patch): for the
    /// record; what must match is the version and the shape.
    pub library: [u16; 3],
    /// Element type.
    pub dtype: KvDtype,
    /// Tokens per block.
    pub block_size: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// The layer group of a hybrid model whose pool the blocks come from
    /// (`KvCacheConfig::layer_group`; 0 for a model whose layers share one
    /// pool). `layers` count within the group.
    pub layer_group: u16,
    /// The layers the bytes hold.
    pub layers: Range<u32>,
    /// Bytes of one block's K data, K side words, V data and V side words
    /// in one layer.
    pub parts: [u64; 4],
    /// SHA-256 of the layers' per-layer state (the K buffers' tails: fp8
    /// scales, int8 smoothing, outlier channels; empty for f32, f16, bf16).
    pub layer_state: [u8; 32],
}

/// A stable code per dtype in the descriptor (not the enum's order).
fn dtype_code(d: KvDtype) -> u32 {
    match d {
        KvDtype::F32 => 1,
        KvDtype::F16 => 2,
        KvDtype::Bf16 => 3,
        KvDtype::Int8 => 4,
        KvDtype::Fp8E4M3 => 5,
    }
}

fn library_version() -> [u16; 3] {
    let mut v = [0u16; 3];
    for (slot, part) in v.iter_mut().zip(env!("CARGO_PKG_VERSION").split('.')) {
        *slot = part.parse().unwrap_or(0);
    }
    v
}

impl KvLayout {
    /// Bytes of one exported block: every part of every layer.
    pub fn block_bytes(&self) -> u64 {
        let per_layer = self.parts.iter().fold(0u64, |a, &p| a.saturating_add(p));
        per_layer.saturating_mul(self.layers.end.saturating_sub(self.layers.start) as u64)
    }

    /// The descriptor as [`KV_LAYOUT_BYTES`] little-endian bytes.
    pub fn to_bytes(&self) -> [u8; KV_LAYOUT_BYTES] {
        let mut out = [0u8; KV_LAYOUT_BYTES];
        let mut at = 0;
        let mut put = |b: &[u8]| {
            out[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        };
        put(&MAGIC);
        put(&self.version.to_le_bytes());
        for v in self.library {
            put(&v.to_le_bytes());
        }
        put(&self.layer_group.to_le_bytes());
        for w in [
            dtype_code(self.dtype),
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.layers.start,
            self.layers.end,
        ] {
            put(&w.to_le_bytes());
        }
        for p in self.parts {
            put(&p.to_le_bytes());
        }
        put(&self.layer_state);
        out
    }

    /// Reads a descriptor [`to_bytes`](Self::to_bytes) wrote; refuses bytes
    /// that are not one (wrong length or magic, another version, an
    /// unknown dtype, an empty or reversed layer range), so that what it
    /// accepts reads back byte for byte. Bytes 18..20, reserved (zero)
    /// before layer groups, hold the group: a single pool's descriptor is
    /// unchanged, and a reader from before refuses another group's.
    pub fn from_bytes(b: &[u8]) -> Result<KvLayout, TransferError> {
        if b.len() != KV_LAYOUT_BYTES {
            return Err(TransferError::Descriptor("not 108 bytes long"));
        }
        if b[..8] != MAGIC {
            return Err(TransferError::Descriptor("no pagedattn KV layout magic"));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or([0; 4]));
        let u16_at = |i: usize| u16::from_le_bytes(b[i..i + 2].try_into().unwrap_or([0; 2]));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        let version = u32_at(8);
        if version != KV_LAYOUT_VERSION {
            return Err(TransferError::Version {
                got: version,
                want: KV_LAYOUT_VERSION,
            });
        }
        let code = u32_at(20);
        let dtype = KvDtype::ALL
            .into_iter()
            .find(|&d| dtype_code(d) == code)
            .ok_or(TransferError::Descriptor("unknown dtype"))?;
        let (first, end) = (u32_at(36), u32_at(40));
        if first >= end {
            return Err(TransferError::Descriptor("empty layer range"));
        }
        let mut layer_state = [0u8; 32];
        layer_state.copy_from_slice(&b[76..108]);
        Ok(KvLayout {
            version,
            library: [u16_at(12), u16_at(14), u16_at(16)],
            layer_group: u16_at(18),
            dtype,
            block_size: u32_at(24),
            num_kv_heads: u32_at(28),
            head_dim: u32_at(32),
            layers: first..end,
            parts: [u64_at(44), u64_at(52), u64_at(60), u64_at(68)],
            layer_state,
        })
    }

    /// Refuses a descriptor that does not describe `layers` of a pool of
    /// `cfg` with this layer state: the first field that differs, with
    /// both values.
    fn check_matches(&self, want: &KvLayout) -> Result<(), TransferError> {
        let mismatch = |field, got: u64, want: u64| TransferError::Mismatch { field, got, want };
        if self.version != want.version {
            return Err(TransferError::Version {
                got: self.version,
                want: want.version,
            });
        }
        let fields: [(&'static str, u64, u64); 7] = [
            (
                "layer_group",
                self.layer_group as u64,
                want.layer_group as u64,
            ),
            (
                "dtype",
                dtype_code(self.dtype) as u64,
                dtype_code(want.dtype) as u64,
            ),
            ("block_size", self.block_size as u64, want.block_size as u64),
            (
                "num_kv_heads",
                self.num_kv_heads as u64,
                want.num_kv_heads as u64,
            ),
            ("head_dim", self.head_dim as u64, want.head_dim as u64),
            (
                "layers.start",
                self.layers.start as u64,
                want.layers.start as u64,
            ),
            ("layers.end", self.layers.end as u64, want.layers.end as u64),
        ];
        for (f, g, w) in fields {
            if g != w {
                return Err(mismatch(f, g, w));
            }
        }
        let names = [
            "K data bytes",
            "K side bytes",
            "V data bytes",
            "V side bytes",
        ];
        for ((f, g), w) in names.into_iter().zip(self.parts).zip(want.parts) {
            if g != w {
                return Err(mismatch(f, g, w));
            }
        }
        if self.layer_state != want.layer_state {
            return Err(TransferError::LayerState);
        }
        Ok(())
    }
}

/// Where each part of each block lies in the staging planes
/// (`[layer][K data, K side, V data, V side][block]`) and in the
/// block-major bytes: `(plane offset, block-major offset, length)`.
fn plane_map(parts: &[u64; 4], layers: u32, n: u64) -> Vec<(usize, usize, usize)> {
    let per_layer: u64 = parts.iter().sum();
    let bb = per_layer * layers as u64;
    let mut out = Vec::new();
    for li in 0..layers as u64 {
        let mut plane = li * per_layer * n;
        let mut within = li * per_layer;
        for &len in parts {
            for i in 0..n {
                out.push((
                    (plane + i * len) as usize,
                    (i * bb + within) as usize,
                    len as usize,
                ));
            }
            plane += len * n;
            within += len;
        }
    }
    out
}

/// Checks an import's payload for a pool of `cfg`, needing no device: the
/// layer range inside the pool, `bytes` the length `blocks` blocks of
/// `layers` take (block-major, as `export_blocks` writes them), and every
/// value one a pool write could store (see [`KvCache::import_blocks`]).
pub fn check_import_payload(
    cfg: &KvCacheConfig,
    layers: Range<u32>,
    blocks: u64,
    bytes: &[u8],
) -> Result<(), GpuError> {
    cfg.validate()?;
    if layers.start >= layers.end || layers.end > cfg.num_layers {
        return Err(TransferError::Layers {
            first: layers.start,
            end: layers.end,
            layers: cfg.num_layers,
        }
        .into());
    }
    let p = |is_k| block_ranges(cfg, 0, is_k);
    let ([(_, kd), (_, ks)], [(_, vd), (_, vs)]) = (p(true), p(false));
    let parts = [kd, ks, vd, vs];
    let want = parts
        .iter()
        .sum::<u64>()
        .saturating_mul((layers.end - layers.start) as u64)
        .saturating_mul(blocks);
    if bytes.len() as u64 != want {
        return Err(TransferError::Bytes {
            got: bytes.len() as u64,
            want,
        }
        .into());
    }
    check_payload(cfg, &parts, layers, blocks, bytes)
}

/// Checks an import's values against what pool writes store: f32, f16 and
/// bf16 values finite and at most `KV_MAX` in magnitude, int8 row scales
/// (bf16) finite and at most `KV_MAX / 64` (127 times one stays finite);
/// int8 values and fp8 bytes are any bytes (the kernels read every fp8
/// pattern as a finite value).
fn check_payload(
    cfg: &KvCacheConfig,
    parts: &[u64; 4],
    layers: std::ops::Range<u32>,
    n: u64,
    bytes: &[u8],
) -> Result<(), GpuError> {
    use KvDtype as D;
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    let bf16 = |b: &[u8]| half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
    let f32v = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let scale_limit = KV_MAX / 64.0;
    let n = n.max(1) as usize;
    for (k, (_, at, len)) in plane_map(parts, layers.end - layers.start, n as u64)
        .into_iter()
        .enumerate()
    {
        let (part, index) = ((k / n) % 4, (k % n) as u64);
        let layer = layers.start + (k / (4 * n)) as u32;
        let seg = &bytes[at..at + len];
        let what = ["K value", "K row scale", "V value", "V row scale"][part];
        // (values, their limit) of this part, or nothing to check.
        let values: Vec<f32> = match (cfg.dtype, part) {
            (D::F32, 0 | 2) => seg.chunks_exact(4).map(f32v).collect(),
            (D::F16, 0 | 2) => seg.chunks_exact(2).map(f16).collect(),
            (D::Bf16, 0 | 2) => seg.chunks_exact(2).map(bf16).collect(),
            // K side: the row's bf16 scale in each word's low half.
            (D::Int8, 1) => seg.chunks_exact(4).map(|w| bf16(&w[..2])).collect(),
            // V side: two rows' scales a word (one when blocks hold one token).
            (D::Int8, 3) if cfg.block_size >= 2 => seg.chunks_exact(2).map(bf16).collect(),
            (D::Int8, 3) => seg.chunks_exact(4).map(|w| bf16(&w[..2])).collect(),
            _ => continue,
        };
        let limit = if part % 2 == 1 { scale_limit } else { KV_MAX };
        if let Some(&value) = values.iter().find(|v| !(v.abs() <= limit)) {
            return Err(TransferError::Value {
                index,
                layer,
                what,
                value_bits: value.to_bits(),
                limit_bits: limit.to_bits(),
            }
            .into());
        }
    }
    Ok(())
}

impl KvCache {
    /// Records the copies between the pool's `blocks` of `layers` and the
    /// staging planes (see [`plane_map`]), pool to staging or (`into_pool`)
    /// back; runs of consecutive blocks go as one copy per layer and part.
    fn copy_planes(
        &self,
        enc: &mut wgpu::CommandEncoder,
        layers: &Range<u32>,
        blocks: &[u32],
        parts: &[u64; 4],
        staging: &wgpu::Buffer,
        into_pool: bool,
    ) -> Result<(), GpuError> {
        let cfg = self.config();
        let n = blocks.len() as u64;
        let per_layer: u64 = parts.iter().sum();
        let runs = runs(blocks);
        for (li, l) in layers.clone().enumerate() {
            let bufs = self.layer(l)?;
            let mut plane = li as u64 * per_layer * n;
            for (kv, buf) in bufs.iter().enumerate() {
                for pi in 0..2 {
                    let len = parts[kv * 2 + pi];
                    for &(i, r) in &runs {
                        let (off, _) = block_ranges(cfg, blocks[i], kv == 0)[pi];
                        let at = plane + i as u64 * len;
                        if len == 0 {
                            continue;
                        }
                        if into_pool {
                            enc.copy_buffer_to_buffer(staging, at, buf, off, len * r as u64);
                        } else {
                            enc.copy_buffer_to_buffer(buf, off, staging, at, len * r as u64);
                        }
                    }
                    plane += len * n;
                }
            }
        }
        Ok(())
    }

    /// The descriptor of `layers` of this pool with the given layer-state
    /// digest.
    fn layout_with(&self, layers: Range<u32>, layer_state: [u8; 32]) -> KvLayout {
        let c = self.config();
        let p = |is_k| block_ranges(c, 0, is_k);
        let ([(_, kd), (_, ks)], [(_, vd), (_, vs)]) = (p(true), p(false));
        KvLayout {
            version: KV_LAYOUT_VERSION,
            library: library_version(),
            dtype: c.dtype,
            block_size: c.block_size,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            layer_group: c.layer_group,
            layers,
            parts: [kd, ks, vd, vs],
            layer_state,
        }
    }

    fn check_layers(&self, layers: &Range<u32>) -> Result<(), TransferError> {
        let n = self.config().num_layers;
        if layers.start >= layers.end || layers.end > n {
            return Err(TransferError::Layers {
                first: layers.start,
                end: layers.end,
                layers: n,
            });
        }
        Ok(())
    }

    fn check_blocks(&self, blocks: &[u32], distinct: bool) -> Result<(), TransferError> {
        let nb = self.config().num_blocks;
        let mut seen = std::collections::HashSet::new();
        for &b in blocks {
            if b >= nb {
                return Err(TransferError::Block { block: b, pool: nb });
            }
            if distinct && !seen.insert(b) {
                return Err(TransferError::BlockTwice { block: b });
            }
        }
        Ok(())
    }

    /// Records copies of the layers' K tails into `staging` at `at`;
    /// returns the bytes they take.
    fn copy_tails(
        &self,
        enc: &mut wgpu::CommandEncoder,
        layers: &Range<u32>,
        staging: &wgpu::Buffer,
        at: u64,
    ) -> Result<u64, GpuError> {
        let c = self.config();
        let t = c.tail_bytes();
        if t == 0 {
            return Ok(0);
        }
        for (i, l) in layers.clone().enumerate() {
            let k = &self.layer(l)?[0];
            enc.copy_buffer_to_buffer(k, c.tail_offset(), staging, at + i as u64 * t, t);
        }
        Ok(t * (layers.end - layers.start) as u64)
    }

    /// Bytes an export of `blocks` blocks of `layers` writes (what `out`
    /// of [`export_blocks`](Self::export_blocks) must hold).
    pub fn export_bytes(&self, blocks: usize, layers: Range<u32>) -> Result<u64, GpuError> {
        self.check_layers(&layers)?;
        let b = self.layout_with(layers, [0; 32]).block_bytes();
        let bytes = b.saturating_mul(blocks as u64);
        if bytes > MAX_SWAP_BYTES {
            return Err(TransferError::TooLarge {
                bytes,
                limit: MAX_SWAP_BYTES,
            }
            .into());
        }
        Ok(bytes)
    }

    /// The descriptor of `layers` of this pool, as an export of them would
    /// carry it (its layer state read back from the GPU). Native only.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn kv_layout(&self, gpu: &Gpu, layers: Range<u32>) -> Result<KvLayout, GpuError> {
        let _serial = gpu.serial();
        pollster::block_on(self.kv_layout_async(gpu, layers))
    }

    /// [`kv_layout`](Self::kv_layout) without blocking the thread.
    pub async fn kv_layout_async(
        &self,
        gpu: &Gpu,
        layers: Range<u32>,
    ) -> Result<KvLayout, GpuError> {
        gpu.alive()?;
        self.check_layers(&layers)?;
        let tails = self.config().tail_bytes() * (layers.end - layers.start) as u64;
        let mut state = Sha256::new();
        if tails > 0 {
            let staging = gpu.staging("kv layout staging", tails)?;
            gpu.scoped_try(|| {
                let mut enc = gpu.device.create_command_encoder(&Default::default());
                self.copy_tails(&mut enc, &layers, &staging, 0)?;
                gpu.queue.submit([enc.finish()]);
                Ok(())
            })?;
            let bytes: Vec<u8> = gpu.map_read(&staging, tails).await?;
            state.update(&bytes);
        }
        Ok(self.layout_with(layers, state.finalize().into()))
    }

    /// Copies `blocks` (any pool blocks, in any order, repeats allowed) of
    /// `layers` into `out`, block after block (see [`KvLayout`]), and
    /// returns the descriptor that goes with them. `out` must hold
    /// [`export_bytes`](Self::export_bytes) bytes. One submit, one
    /// readback. Native only.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn export_blocks(
        &self,
        gpu: &Gpu,
        blocks: &[u32],
        layers: Range<u32>,
        out: &mut [u8],
    ) -> Result<KvLayout, GpuError> {
        let _serial = gpu.serial();
        pollster::block_on(self.export_blocks_async(gpu, blocks, layers, out))
    }

    /// [`export_blocks`](Self::export_blocks) without blocking the thread.
    pub async fn export_blocks_async(
        &self,
        gpu: &Gpu,
        blocks: &[u32],
        layers: Range<u32>,
        out: &mut [u8],
    ) -> Result<KvLayout, GpuError> {
        gpu.alive()?;
        let want = self.export_bytes(blocks.len(), layers.clone())?;
        self.check_blocks(blocks, false)?;
        if out.len() as u64 != want {
            return Err(TransferError::Bytes {
                got: out.len() as u64,
                want,
            }
            .into());
        }
        let cfg = *self.config();
        let n = blocks.len() as u64;
        let tails = cfg.tail_bytes() * (layers.end - layers.start) as u64;
        let total = want + tails;
        if total == 0 {
            return Ok(self.layout_with(layers, Sha256::new().finalize().into()));
        }
        // Staging: [layer][K data, K side, V data, V side][block] planes,
        // then the layers' tails.
        let staging = gpu.staging("export staging", total)?;
        let parts = self.layout_with(layers.clone(), [0; 32]).parts;
        gpu.scoped_try(|| {
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            self.copy_planes(&mut enc, &layers, blocks, &parts, &staging, false)?;
            self.copy_tails(&mut enc, &layers, &staging, want)?;
            gpu.queue.submit([enc.finish()]);
            Ok(())
        })?;
        let bytes: Vec<u8> = gpu.map_read(&staging, total).await?;
        // Planes to block-major.
        for (plane, block, len) in plane_map(&parts, layers.end - layers.start, n) {
            out[block..block + len].copy_from_slice(&bytes[plane..plane + len]);
        }
        let mut state = Sha256::new();
        state.update(&bytes[want as usize..]);
        Ok(self.layout_with(layers, state.finalize().into()))
    }

    /// Writes exported blocks into `blocks` of this pool (distinct, any
    /// ids: not those they were exported from). `layout` must describe
    /// this pool's shape and the layers' state exactly, and `bytes` hold
    /// `blocks.len()` blocks of it; anything else is refused before
    /// anything is written. Native only.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn import_blocks(
        &self,
        gpu: &Gpu,
        layout: &KvLayout,
        bytes: &[u8],
        blocks: &[u32],
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        pollster::block_on(self.import_blocks_async(gpu, layout, bytes, blocks))
    }

    /// [`import_blocks`](Self::import_blocks) without blocking the thread.
    pub async fn import_blocks_async(
        &self,
        gpu: &Gpu,
        layout: &KvLayout,
        bytes: &[u8],
        blocks: &[u32],
    ) -> Result<(), GpuError> {
        gpu.alive()?;
        self.check_layers(&layout.layers)?;
        let mine = self.kv_layout_async(gpu, layout.layers.clone()).await?;
        layout.check_matches(&mine)?;
        let want = self.export_bytes(blocks.len(), layout.layers.clone())?;
        if bytes.len() as u64 != want {
            return Err(TransferError::Bytes {
                got: bytes.len() as u64,
                want,
            }
            .into());
        }
        self.check_blocks(blocks, true)?;
        if want == 0 {
            return Ok(());
        }
        let layers = layout.layers.clone();
        let n = blocks.len() as u64;
        let parts = mine.parts;
        // An import is a pool write from elsewhere: it must store only what
        // a write stores, or nothing.
        check_payload(self.config(), &parts, layers.clone(), n, bytes)?;
        // Block-major to the planes export uses.
        let mut planes = vec![0u8; want as usize];
        for (plane, block, len) in plane_map(&parts, layers.end - layers.start, n) {
            planes[plane..plane + len].copy_from_slice(&bytes[block..block + len]);
        }
        gpu.scoped_try(|| {
            let staging = gpu.storage_init("import staging", &planes)?;
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            self.copy_planes(&mut enc, &layers, blocks, &parts, &staging, true)?;
            gpu.queue.submit([enc.finish()]);
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_version_is_the_crate_version() {
        let v = library_version();
        assert_eq!(
            format!("{}.{}.{}", v[0], v[1], v[2]),
            env!("CARGO_PKG_VERSION")
        );
    }
}
