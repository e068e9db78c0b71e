//! The host-slice calls: thin conveniences over plan/run for tests, tools
//! and engines that do not keep their own buffers. Each validates what it
//! is given, makes a one-step plan, records it, submits, and (attention)
//! reads the output back; an engine's step runs the same plans
//! ([`plan`](super::plan)) into its own encoder instead.

use super::attention::{AttnOptions, PagedAttention, Split};
use super::context::Gpu;
use super::error::{BatchError, GpuError, MlaError, PoolError};
use super::kv_cache::KvCache;
use super::mla::{MlaAttention, MlaCache};
use super::plan::{DecodeTables, MlaPlan, PrefillTables, StepTables};

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

/// Per-sequence tables as the CSR pair a plan takes.
fn csr(tables: &[&[u32]]) -> (Vec<u32>, Vec<u32>) {
    let mut indptr = Vec::with_capacity(tables.len() + 1);
    indptr.push(0u32);
    let mut indices = Vec::new();
    for t in tables {
        indices.extend_from_slice(t);
        indptr.push(indices.len().min(u32::MAX as usize) as u32);
    }
    (indptr, indices)
}

impl MlaAttention {
    /// Decode from host slices: sequence `i` sees its `lens[i]` tokens
    /// through `tables[i]`; `q` holds one f32 row per sequence. Returns one
    /// output row per sequence (heads x kv_lora_rank). A one-step plan
    /// ([`plan_decode`](Self::plan_decode), [`run`](Self::run)) made and
    /// dropped. Native only (blocks on readback).
    #[cfg(not(target_arch = "wasm32"))]
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        gpu: &Gpu,
        cache: &MlaCache,
        layer: u32,
        q: &[f32],
        tables: &[&[u32]],
        lens: &[u32],
        split: Split,
    ) -> Result<Vec<f32>, GpuError> {
        let _serial = gpu.serial();
        let mut plan = self.plan();
        self.plan_decode_slices(gpu, &mut plan, tables, lens, split)?;
        let out = self.submit(gpu, &mut plan, cache, layer, q)?;
        gpu.read(&out, out.size())
    }

    /// Prefill from host slices: sequence `i` has `starts[i]` tokens cached
    /// before its `new_tokens[i]` new ones (whose rows the pool already
    /// holds); `q` holds one f32 row per new token, by sequence, then
    /// position. Native only.
    #[cfg(not(target_arch = "wasm32"))]
    #[allow(clippy::too_many_arguments)]
    pub fn prefill(
        &self,
        gpu: &Gpu,
        cache: &MlaCache,
        layer: u32,
        q: &[f32],
        tables: &[&[u32]],
        starts: &[u32],
        new_tokens: &[u32],
        split: Split,
    ) -> Result<Vec<f32>, GpuError> {
        let _serial = gpu.serial();
        let mut plan = self.plan();
        self.plan_prefill_slices(gpu, &mut plan, tables, starts, new_tokens, split)?;
        let out = self.submit(gpu, &mut plan, cache, layer, q)?;
        gpu.read(&out, out.size())
    }

    /// [`plan_decode`](Self::plan_decode) from per-sequence tables.
    pub fn plan_decode_slices(
        &self,
        gpu: &Gpu,
        plan: &mut MlaPlan,
        tables: &[&[u32]],
        lens: &[u32],
        split: Split,
    ) -> Result<(), GpuError> {
        if lens.len() != tables.len() {
            return Err(MlaError::Len {
                what: "lens",
                got: lens.len() as u64,
                want: tables.len() as u64,
            }
            .into());
        }
        let (kv_indptr, kv_indices) = csr(tables);
        let t = DecodeTables {
            kv_indptr: &kv_indptr,
            kv_indices: &kv_indices,
            seq_lens: lens,
        };
        let opts = AttnOptions {
            split,
            ..Default::default()
        };
        self.plan_decode(gpu, plan, &t, std::slice::from_ref(&opts))
    }

    /// [`plan_prefill`](Self::plan_prefill) from per-sequence tables,
    /// cached lengths and new-token counts.
    pub fn plan_prefill_slices(
        &self,
        gpu: &Gpu,
        plan: &mut MlaPlan,
        tables: &[&[u32]],
        starts: &[u32],
        new_tokens: &[u32],
        split: Split,
    ) -> Result<(), GpuError> {
        for (what, v) in [("starts", starts), ("new_tokens", new_tokens)] {
            if v.len() != tables.len() {
                return Err(MlaError::Len {
                    what,
                    got: v.len() as u64,
                    want: tables.len() as u64,
                }
                .into());
            }
        }
        let (kv_indptr, kv_indices) = csr(tables);
        let mut qo_indptr = vec![0u32];
        let mut seq_lens = Vec::with_capacity(starts.len());
        for (&s, &n) in starts.iter().zip(new_tokens) {
            let (Some(len), Some(end)) = (
                s.checked_add(n),
                qo_indptr.last().and_then(|&e: &u32| e.checked_add(n)),
            ) else {
                return Err(MlaError::Queries {
                    count: u64::MAX,
                    limit: crate::gpu::mla::MLA_MAX_QUERIES,
                }
                .into());
            };
            seq_lens.push(len);
            qo_indptr.push(end);
        }
        let t = PrefillTables {
            kv_indptr: &kv_indptr,
            kv_indices: &kv_indices,
            seq_lens: &seq_lens,
            qo_indptr: &qo_indptr,
        };
        let opts = AttnOptions {
            split,
            ..Default::default()
        };
        self.plan_prefill(gpu, plan, &t, std::slice::from_ref(&opts))
    }

    /// Runs variant 0 of a planned batch on host slices without blocking
    /// (the browser's path): `q` holds the plan's f32 query rows; returns
    /// the output rows.
    pub async fn run_async(
        &self,
        gpu: &Gpu,
        plan: &mut MlaPlan,
        cache: &MlaCache,
        layer: u32,
        q: &[f32],
    ) -> Result<Vec<f32>, GpuError> {
        let out = self.submit(gpu, plan, cache, layer, q)?;
        gpu.read_async(&out, out.size()).await
    }

    /// Uploads `q`, records variant 0 of `plan` into a fresh output
    /// (poisoned, so a skipped write cannot pass) and submits.
    fn submit(
        &self,
        gpu: &Gpu,
        plan: &mut MlaPlan,
        cache: &MlaCache,
        layer: u32,
        q: &[f32],
    ) -> Result<wgpu::Buffer, GpuError> {
        let want = plan.num_queries() as u64 * self.q_row_elems();
        if q.len() as u64 != want {
            return Err(MlaError::Len {
                what: "q",
                got: q.len() as u64,
                want,
            }
            .into());
        }
        cache.layer_buffer(layer)?;
        gpu.scoped_try(|| {
            let floats = plan.num_queries() as u64 * self.out_row_elems();
            let q_buf = gpu.storage_init("mla q", q)?;
            let out = gpu.storage_init("mla out", &vec![f32::NAN; floats as usize])?;
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            self.run(
                gpu,
                &mut enc,
                plan,
                cache,
                layer,
                0,
                &q_buf.as_entire_buffer_binding(),
                &out.as_entire_buffer_binding(),
            )?;
            gpu.queue.submit([enc.finish()]);
            Ok(out)
        })
    }
}

impl MlaCache {
    /// Writes the f32 rows of new tokens (`rows`: `slots.len()` rows of
    /// [`row_elems`](super::MlaCacheConfig::row_elems) values, latent first)
    /// into `layer` at `slots`, and submits. Refused before anything is
    /// written: a layer or slot outside the pool, a slot named twice,
    /// `rows` of the wrong length.
    pub fn write(
        &self,
        gpu: &Gpu,
        layer: u32,
        slots: &[u32],
        rows: &[f32],
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        self.layer_buffer(layer)?;
        let want = slots.len() as u64 * self.config().row_elems() as u64;
        if rows.len() as u64 != want {
            return Err(MlaError::Len {
                what: "rows",
                got: rows.len() as u64,
                want,
            }
            .into());
        }
        let mut plan = self.plan();
        self.plan_write_step(gpu, &mut plan, slots, &[], false)?;
        if slots.is_empty() {
            return Ok(());
        }
        gpu.scoped_try(|| {
            let rb = gpu.storage_init("mla rows", rows)?;
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            self.run_write(
                gpu,
                &mut enc,
                &mut plan,
                layer,
                &rb.as_entire_buffer_binding(),
            )?;
            gpu.queue.submit([enc.finish()]);
            Ok(())
        })
    }

    /// Applies a copy-on-write list (`(src, dst)` blocks) in every layer,
    /// in one submit. Refused before anything is recorded: a block outside
    /// the pool, a destination named twice or also a source.
    pub fn copy_blocks(&self, gpu: &Gpu, copies: &[[u32; 2]]) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        let mut plan = self.plan();
        self.plan_write_step(gpu, &mut plan, &[], copies, false)?;
        if copies.is_empty() {
            return Ok(());
        }
        gpu.scoped_try(|| {
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            self.run_copy_blocks(gpu, &mut enc, &mut plan)?;
            gpu.queue.submit([enc.finish()]);
            Ok(())
        })
    }
}
