//! The host-slice calls: thin conveniences over plan/run for tests, tools
//! and engines that do not keep their own buffers. Each validates what it
//! is given, makes a one-step plan, records it, submits, and (attention)
//! reads the output back; an engine's step runs the same plans
//! ([`plan`](super::plan)) into its own encoder instead.

use super::attention::{AttnOptions, PagedAttention};
use super::context::Gpu;
use super::error::{BatchError, GpuError, PoolError};
use super::kv_cache::KvCache;
use super::plan::StepTables;

impl PagedAttention {
    /// Prefill from host slices: validates, runs, returns
    /// `[num_queries][num_heads][head_dim]`. A one-step plan
    /// ([`plan_prefill`](Self::plan_prefill), [`run`](Self::run)) made and
    /// dropped. Native only (blocks on readback).
    #[cfg(not(target_arch = "wasm32"))]
    #[allow(clippy::too_many_arguments)]
    pub fn prefill(
        &self,
        gpu: &Gpu,
        cache: &KvCache,
        layer: u32,
        q: &[f32],
        qo_indptr: &[u32],
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        opts: &AttnOptions,
    ) -> Result<Vec<f32>, GpuError> {
        let _serial = gpu.serial();
        let t = StepTables {
            kv_indptr,
            kv_indices,
            seq_lens,
            qo_indptr: Some(qo_indptr),
        };
        let (out, bytes) = gpu.scoped_try(|| self.one_step(gpu, cache, layer, q, &t, opts))?;
        gpu.read(&out, bytes)
    }

    /// Decode from host slices: validates everything, runs, returns
    /// `[num_seqs][num_heads][head_dim]`. Native only (blocks on readback).
    #[cfg(not(target_arch = "wasm32"))]
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        gpu: &Gpu,
        cache: &KvCache,
        layer: u32,
        q: &[f32],
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        opts: &AttnOptions,
    ) -> Result<Vec<f32>, GpuError> {
        let _serial = gpu.serial();
        let (out, bytes) = gpu.scoped_try(|| {
            self.one_step(
                gpu,
                cache,
                layer,
                q,
                &StepTables::decode(kv_indptr, kv_indices, seq_lens),
                opts,
            )
        })?;
        gpu.read(&out, bytes)
    }

    /// Async twin of [`decode`](Self::decode) (the browser path).
    #[allow(clippy::too_many_arguments)]
    pub async fn decode_async(
        &self,
        gpu: &Gpu,
        cache: &KvCache,
        layer: u32,
        q: &[f32],
        kv_indptr: &[u32],
        kv_indices: &[u32],
        seq_lens: &[u32],
        opts: &AttnOptions,
    ) -> Result<Vec<f32>, GpuError> {
        let (out, bytes) = gpu
            .scoped(|| {
                let t = StepTables::decode(kv_indptr, kv_indices, seq_lens);
                self.one_step(gpu, cache, layer, q, &t, opts)
            })
            .await??;
        gpu.read_async(&out, bytes).await
    }

    /// The host calls' one-step plan: checks `q` against the tables,
    /// poisons a fresh output (so a kernel that skips a write cannot pass),
    /// plans, records and submits; returns the output and its bytes.
    fn one_step(
        &self,
        gpu: &Gpu,
        cache: &KvCache,
        layer: u32,
        q: &[f32],
        t: &StepTables,
        opts: &AttnOptions,
    ) -> Result<(wgpu::Buffer, u64), GpuError> {
        self.check_cache(gpu, cache)?;
        cache.layer(layer)?;
        let mut plan = self.plan();
        self.plan_any(gpu, &mut plan, t, std::slice::from_ref(opts), true)?;
        let nq = plan.num_queries() as usize;
        let row = self.num_heads as usize * self.head_dim as usize;
        if nq.checked_mul(row) != Some(q.len()) {
            return Err(BatchError::QLength {
                floats: q.len() as u64,
                queries: nq as u64,
                heads: self.num_heads,
                head_dim: self.head_dim,
            }
            .into());
        }
        let bytes = (q.len() * 4) as u64;
        let out = gpu.storage("attention out", bytes.max(16))?;
        gpu.queue.write_buffer(
            &out,
            0,
            bytemuck::cast_slice(&vec![f32::NAN; q.len().max(4)]),
        );
        if nq == 0 {
            return Ok((out, 0));
        }
        let qb = gpu.storage_init("q", q)?;
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        self.run(
            gpu,
            &mut enc,
            &mut plan,
            cache,
            layer,
            0,
            &qb.as_entire_buffer_binding(),
            &out.as_entire_buffer_binding(),
        )?;
        gpu.queue.submit([enc.finish()]);
        Ok((out, bytes))
    }
}

impl KvCache {
    /// Writes new tokens' K and V (host slices, `[n][num_kv_heads][head_dim]`)
    /// into `slots` of `layer`, and submits.
    pub fn write_kv(
        &self,
        gpu: &Gpu,
        layer: u32,
        k: &[f32],
        v: &[f32],
        slots: &[u32],
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        self.layer(layer)?;
        let row = self.cfg.num_kv_heads as usize * self.cfg.head_dim as usize;
        let n = slots.len();
        let want = n.checked_mul(row);
        if want != Some(k.len()) || want != Some(v.len()) {
            return Err(PoolError::KvLength {
                slots: n as u64,
                need: n as u128 * row as u128,
                k: k.len() as u64,
                v: v.len() as u64,
            }
            .into());
        }
        if n > u32::MAX as usize {
            return Err(PoolError::TooMany {
                what: "write_kv tokens",
                count: n as u64,
                limit: u32::MAX as u64,
            }
            .into());
        }
        if n == 0 {
            // Still checked like any write (the layer above), but no step.
            return Ok(());
        }
        gpu.scoped_try(|| {
            let mut plan = self.plan();
            self.plan_write_step(gpu, &mut plan, slots, &[], false)?;
            let kb = gpu.storage_init("k_new", k)?;
            let vb = gpu.storage_init("v_new", v)?;
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            self.run_write_kv(
                gpu,
                &mut enc,
                &mut plan,
                layer,
                &kb.as_entire_buffer_binding(),
                &vb.as_entire_buffer_binding(),
            )?;
            gpu.queue.submit([enc.finish()]);
            Ok(())
        })
    }

    /// Applies a copy list `(src, dst)` to every layer in one submit.
    pub fn copy_blocks(&self, gpu: &Gpu, copies: &[[u32; 2]]) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        gpu.alive()?;
        if copies.is_empty() {
            return Ok(());
        }
        gpu.scoped_try(|| {
            let mut plan = self.plan();
            self.plan_write_step(gpu, &mut plan, &[], copies, false)?;
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            self.run_copy_blocks(gpu, &mut enc, &mut plan)?;
            gpu.queue.submit([enc.finish()]);
            Ok(())
        })
    }
}
