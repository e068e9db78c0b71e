//! The paged KV pool in CUDA memory, laid out byte for byte as the wgpu pool
//! (`[num_blocks][num_kv_heads][block_size][head_dim]`, f32 or IEEE halves),
//! with the `write_kv` and `copy_blocks` kernels that maintain it.

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::{guarded, Cuda, CudaError, DriverResultExt, Shape};
use crate::gpu::{KvCacheConfig, KvDtype};

/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;

/// A launch of `threads` threads, one per element.
pub(crate) fn elementwise(threads: u64) -> Result<LaunchConfig, CudaError> {
    let blocks = threads.div_ceil(THREADS as u64).max(1);
    if blocks > i32::MAX as u64 {
        return Err(CudaError::InvalidArgument(format!(
            "{threads} elements in one launch is too many"
        )));
    }
    Ok(LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn bad_layer(layer: u32, num_layers: u32) -> CudaError {
    CudaError::InvalidArgument(format!(
        "layer {layer} out of range (cache has {num_layers})"
    ))
}

/// Per-layer K and V pools on a CUDA device.
pub struct CudaKvCache {
    cfg: KvCacheConfig,
    /// Raw bytes, so one type serves f32 and f16 pools.
    layers: Vec<[CudaSlice<u8>; 2]>,
    write_kv: CudaFunction,
    copy_blocks: CudaFunction,
}

impl CudaKvCache {
    /// Allocates a zeroed pool of the same shape rules as
    /// [`KvCache`](crate::gpu::KvCache).
    pub fn new(cuda: &Cuda, cfg: KvCacheConfig) -> Result<Self, CudaError> {
        cfg.validate()
            .map_err(|e| CudaError::InvalidArgument(e.to_string()))?;
        if !matches!(cfg.dtype, KvDtype::F32 | KvDtype::F16) {
            return Err(CudaError::Unsupported(format!(
                "the CUDA twin has no {} pools (f32 and f16 only)",
                cfg.dtype.name()
            )));
        }
        let module = cuda.module(Shape {
            head_dim: cfg.head_dim,
            group: 1,
            block_size: cfg.block_size,
            dtype: cfg.dtype,
        })?;
        guarded("allocating the KV pool", || {
            let write_kv = module.load_function("write_kv").during("write_kv")?;
            let copy_blocks = module.load_function("copy_blocks").during("copy_blocks")?;
            let bytes = cfg.layer_bytes() as usize;
            let mut layers = Vec::with_capacity(cfg.num_layers as usize);
            for _ in 0..cfg.num_layers {
                let k = cuda
                    .stream()
                    .alloc_zeros::<u8>(bytes)
                    .during("cuMemAlloc")?;
                let v = cuda
                    .stream()
                    .alloc_zeros::<u8>(bytes)
                    .during("cuMemAlloc")?;
                layers.push([k, v]);
            }
            Ok(Self {
                cfg,
                layers,
                write_kv,
                copy_blocks,
            })
        })
    }

    /// The shape.
    pub fn config(&self) -> &KvCacheConfig {
        &self.cfg
    }

    /// K and V pools of `layer`.
    pub(crate) fn layer(&self, layer: u32) -> Result<&[CudaSlice<u8>; 2], CudaError> {
        self.layers
            .get(layer as usize)
            .ok_or_else(|| bad_layer(layer, self.cfg.num_layers))
    }

    /// Writes new tokens' K and V (`[n][num_kv_heads][head_dim]` f32) into
    /// `slots` of `layer`, as [`KvCache::write_kv`](crate::gpu::KvCache::write_kv).
    pub fn write_kv(
        &mut self,
        cuda: &Cuda,
        layer: u32,
        k: &[f32],
        v: &[f32],
        slots: &[u32],
    ) -> Result<(), CudaError> {
        let c = self.cfg;
        let row = (c.num_kv_heads * c.head_dim) as usize;
        let n = slots.len();
        if k.len() != n * row || v.len() != n * row {
            return Err(CudaError::InvalidArgument(format!(
                "write_kv: {n} slots need K and V of {} floats each, got {} and {}",
                n * row,
                k.len(),
                v.len()
            )));
        }
        let num_slots = c.num_blocks as u64 * c.block_size as u64;
        if let Some(&s) = slots.iter().find(|&&s| s as u64 >= num_slots) {
            return Err(CudaError::InvalidArgument(format!(
                "slot {s} outside the pool of {num_slots} slots"
            )));
        }
        if num_slots > u32::MAX as u64 {
            return Err(CudaError::Unsupported(format!(
                "{num_slots} slots: slot ids are u32"
            )));
        }
        let function = self.write_kv.clone();
        let [kp, vp] = self
            .layers
            .get_mut(layer as usize)
            .ok_or_else(|| bad_layer(layer, c.num_layers))?;
        if n == 0 {
            return Ok(());
        }
        let cfg = elementwise(n as u64 * row as u64)?;
        guarded("write_kv", || {
            let s = cuda.stream();
            let kd = s.clone_htod(k).during("upload k")?;
            let vd = s.clone_htod(v).during("upload v")?;
            let sd = s.clone_htod(slots).during("upload slots")?;
            let (nt, nkv, ns) = (n as u32, c.num_kv_heads, num_slots as u32);
            let mut launch = s.launch_builder(&function);
            launch
                .arg(&kd)
                .arg(&vd)
                .arg(&sd)
                .arg(kp)
                .arg(vp)
                .arg(&nt)
                .arg(&nkv)
                .arg(&ns);
            // SAFETY: the argument list matches write_kv in kernels.cu; the
            // kernel skips slots outside the pool and reads n * row floats.
            unsafe { launch.launch(cfg) }.during("launch write_kv")?;
            Ok(())
        })
    }

    /// Applies a copy list `(src, dst)` to every layer, as
    /// [`KvCache::copy_blocks`](crate::gpu::KvCache::copy_blocks).
    pub fn copy_blocks(&mut self, cuda: &Cuda, copies: &[[u32; 2]]) -> Result<(), CudaError> {
        let nb = self.cfg.num_blocks;
        if let Some(c) = copies.iter().find(|c| c[0] >= nb || c[1] >= nb) {
            return Err(CudaError::InvalidArgument(format!(
                "copy {c:?} names a block outside the pool of {nb}"
            )));
        }
        if copies.is_empty() {
            return Ok(());
        }
        let block_elems =
            self.cfg.num_kv_heads as u64 * self.cfg.block_size as u64 * self.cfg.head_dim as u64;
        if block_elems > u32::MAX as u64 {
            return Err(CudaError::Unsupported(format!(
                "{block_elems} elements per block"
            )));
        }
        let cfg = elementwise(copies.len() as u64 * block_elems)?;
        let flat: Vec<u32> = copies.iter().flatten().copied().collect();
        let function = self.copy_blocks.clone();
        guarded("copy_blocks", || {
            let s = cuda.stream();
            let cd = s.clone_htod(&flat).during("upload copies")?;
            let (n, be) = (copies.len() as u32, block_elems as u32);
            for [kp, vp] in &mut self.layers {
                let mut launch = s.launch_builder(&function);
                launch.arg(&cd).arg(kp).arg(vp).arg(&n).arg(&nb).arg(&be);
                // SAFETY: matches copy_blocks in kernels.cu; pairs were
                // checked against the pool above.
                unsafe { launch.launch(cfg) }.during("launch copy_blocks")?;
            }
            Ok(())
        })
    }

    /// Reads one layer's K and V pools back as f32 (f16 pools are widened).
    pub fn read_layer(&self, cuda: &Cuda, layer: u32) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
        let [k, v] = self.layer(layer)?;
        let dtype = self.cfg.dtype;
        guarded("read_layer", || {
            let widen = |raw: Vec<u8>| -> Vec<f32> {
                match dtype {
                    KvDtype::F32 => bytemuck::pod_collect_to_vec(&raw),
                    KvDtype::F16 => raw
                        .chunks_exact(2)
                        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                    // Refused by `new`.
                    KvDtype::Bf16 | KvDtype::Int8 | KvDtype::Fp8E4M3 => Vec::new(),
                }
            };
            let s = cuda.stream();
            Ok((
                widen(s.clone_dtoh(k).during("download k")?),
                widen(s.clone_dtoh(v).during("download v")?),
            ))
        })
    }
}
