//! Planning and running a step's K/V writes and copy-on-write copies.

use super::binding::{bind_checked, check_binding, duplicate_slot, Grow, RangeKey};
use std::collections::HashMap;

use crate::gpu::compose::ShaderShape;
use crate::gpu::context::Gpu;
use crate::gpu::dtype::ActDtype;
use crate::gpu::error::{BatchError, GpuError, PlanMismatch, PoolError};
use crate::gpu::kv_cache::KvCache;
use crate::gpu::params;
use crate::gpu::pass::{bind_ranges, dispatch, grid_1d, pipeline};

#[derive(Clone, PartialEq, Eq, Hash)]
pub(super) struct WriteKey {
    pub(super) layer: u32,
    pub(super) act: ActDtype,
    pub(super) k: RangeKey,
    pub(super) v: RangeKey,
}

/// One step's pool-side work, planned by a [`KvCache`] or an
/// [`MlaCache`](crate::gpu::MlaCache): the new tokens' slots and the
/// copy-on-write list in reused buffers.
pub struct WritePlan {
    pub(super) owner: u64,
    /// Reused for the duplicate-slot check (no allocation per step).
    pub(super) scratch: Vec<u32>,
    pub(super) planned: bool,
    pub(super) num_tokens: u32,
    pub(super) num_copies: u32,
    pub(super) kv_stride: u32,
    pub(super) act: ActDtype,
    pub(super) write_pipe: Option<wgpu::ComputePipeline>,
    pub(super) slots: Grow,
    pub(super) copies: Grow,
    pub(super) write_params: Option<wgpu::Buffer>,
    pub(super) copy_params: Option<wgpu::Buffer>,
    pub(super) write_groups: HashMap<WriteKey, wgpu::BindGroup>,
    pub(super) copy_groups: Vec<wgpu::BindGroup>,
}

impl WritePlan {
    /// What every pool's run checks first: the device, the plan's pool
    /// (`owner`), a step planned into it.
    pub(super) fn check(&self, gpu: &Gpu, owner: u64) -> Result<(), GpuError> {
        gpu.alive()?;
        if self.owner != owner {
            return Err(GpuError::Plan(PlanMismatch::OtherCache));
        }
        if !self.planned {
            return Err(GpuError::Plan(PlanMismatch::NotPlanned));
        }
        Ok(())
    }

    /// A checked step into the plan, as every pool's `plan_write` ends:
    /// the slots and copies into the buffers it reuses (grown when too
    /// small, their bind groups dropped then), the write and copy uniforms
    /// (`write`, `copy`; made on first use), the counts.
    pub(super) fn upload<W: bytemuck::Pod, C: bytemuck::Pod>(
        &mut self,
        gpu: &Gpu,
        slots: &[u32],
        copies: &[[u32; 2]],
        write: &W,
        copy: &C,
    ) -> Result<(), GpuError> {
        if self
            .slots
            .ensure(gpu, "plan slots", slots.len() as u64 * 4)?
        {
            self.write_groups.clear();
        }
        if self
            .copies
            .ensure(gpu, "plan copies", copies.len() as u64 * 8)?
        {
            self.copy_groups.clear();
        }
        if !slots.is_empty() {
            gpu.queue
                .write_buffer(self.slots.get(), 0, bytemuck::cast_slice(slots));
        }
        if !copies.is_empty() {
            gpu.queue
                .write_buffer(self.copies.get(), 0, bytemuck::cast_slice(copies));
        }
        match &self.write_params {
            Some(b) => gpu.queue.write_buffer(b, 0, bytemuck::bytes_of(write)),
            None => self.write_params = Some(gpu.uniform("plan write params", write)?),
        }
        match &self.copy_params {
            Some(b) => gpu.queue.write_buffer(b, 0, bytemuck::bytes_of(copy)),
            None => self.copy_params = Some(gpu.uniform("plan copy params", copy)?),
        }
        self.num_tokens = slots.len() as u32;
        self.num_copies = copies.len() as u32;
        self.planned = true;
        Ok(())
    }

    /// An empty plan of the pool `owner` (a `KvCache` or an `MlaCache`).
    pub(super) fn empty(owner: u64) -> Self {
        WritePlan {
            owner,
            scratch: Vec::new(),
            planned: false,
            num_tokens: 0,
            num_copies: 0,
            kv_stride: 0,
            act: ActDtype::F32,
            write_pipe: None,
            slots: Grow::default(),
            copies: Grow::default(),
            write_params: None,
            copy_params: None,
            write_groups: HashMap::new(),
            copy_groups: Vec::new(),
        }
    }

    /// Elements from one token's K (and V) row to the next, for K and V
    /// read straight from a fused QKV output; `None`: packed rows
    /// (`num_kv_heads * head_dim` apart). A multiple of 4, at least that.
    /// Takes effect at the next `plan_write`.
    pub fn set_kv_stride(&mut self, floats: Option<u32>) {
        self.kv_stride = floats.unwrap_or(0);
        self.planned = false;
    }

    /// The element type of the new K and V rows (default f32; the pool keeps
    /// its own `KvDtype`). Takes effect at the next `plan_write`.
    pub fn set_activations(&mut self, act: ActDtype) {
        self.act = act;
        self.planned = false;
    }
}

impl KvCache {
    /// An empty plan for this cache's `write_kv` and `copy_blocks`.
    pub fn plan(&self) -> WritePlan {
        WritePlan::empty(self.id)
    }

    /// Compiles the K/V write pipeline for each of `acts` now (f32's is
    /// made with the cache), so that no step pays for a compile.
    pub fn warm_up(&self, gpu: &Gpu, acts: &[ActDtype]) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        for &act in acts {
            self.write_pipeline(gpu, act)?;
        }
        Ok(())
    }

    /// The K/V write pipeline of `act` activations.
    pub(super) fn write_pipeline(
        &self,
        gpu: &Gpu,
        act: ActDtype,
    ) -> Result<wgpu::ComputePipeline, GpuError> {
        Ok(match act {
            ActDtype::F32 => self.write_kv.clone(),
            ActDtype::F16 | ActDtype::Bf16 => pipeline(
                gpu,
                crate::gpu::kv_cache::write_kv_kernel(self.cfg.dtype),
                &ShaderShape {
                    head_dim: self.cfg.head_dim,
                    block_size: self.cfg.block_size,
                    dtype: self.cfg.dtype,
                    q_f16: true,
                    act_bf16: act == ActDtype::Bf16,
                    ..ShaderShape::default()
                },
            )?,
        })
    }

    /// Plans a step's writes and copies: `slots` of the new tokens (from the
    /// batch view) and the copy-on-write pairs, checked against the pool and
    /// uploaded into buffers the plan reuses.
    pub fn plan_write(
        &self,
        gpu: &Gpu,
        plan: &mut WritePlan,
        slots: &[u32],
        copies: &[[u32; 2]],
    ) -> Result<(), GpuError> {
        self.plan_write_step(gpu, plan, slots, copies, true)
    }

    /// [`plan_write`](Self::plan_write); `new_step: false` for the host
    /// calls' one-call plans (`write_kv`, `copy_blocks`), which write into
    /// the step under way and so leave its attention plans current.
    pub(in crate::gpu) fn plan_write_step(
        &self,
        gpu: &Gpu,
        plan: &mut WritePlan,
        slots: &[u32],
        copies: &[[u32; 2]],
        new_step: bool,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        if plan.owner != self.id {
            return Err(GpuError::Plan(PlanMismatch::OtherCache));
        }
        plan.planned = false;
        gpu.alive()?;
        self.check_write(plan, slots, copies)?;
        plan.write_pipe = Some(self.write_pipeline(gpu, plan.act)?);
        let wp = params::WriteKvParams {
            num_tokens: slots.len() as u32,
            num_kv_heads: self.cfg.num_kv_heads,
            num_slots: self.cfg.num_blocks * self.cfg.block_size,
            kv_stride: plan.kv_stride / 4,
        };
        let cp = params::CopyParams {
            num_copies: copies.len() as u32,
            num_blocks: self.cfg.num_blocks,
            block_elems: self.cfg.block_elems4(),
            _pad: 0,
        };
        plan.upload(gpu, slots, copies, &wp, &cp)?;
        // A new write step: attention plans of the last one are stale.
        if new_step {
            self.write_epoch
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// What `plan_write` checks: slots and copies in the pool, no slot
    /// twice, the K/V stride, and thread counts one dispatch indexes.
    pub(super) fn check_write(
        &self,
        plan: &mut WritePlan,
        slots: &[u32],
        copies: &[[u32; 2]],
    ) -> Result<(), GpuError> {
        let cap = self.cfg.num_blocks as u64 * self.cfg.block_size as u64;
        // SKIP_WRITE (u32::MAX): a token whose K/V is in the pool already
        // (a prompt cached to its end); the kernels skip it.
        if let Some(&s) = slots
            .iter()
            .find(|&&s| s as u64 >= cap && s != crate::blocks::SKIP_WRITE)
        {
            return Err(PoolError::SlotOutsidePool {
                slot: s,
                slots: cap,
            }
            .into());
        }
        check_copies(self.cfg.num_blocks, copies)?;
        // One step writes a slot at most once: the GPU writes a step's
        // tokens in parallel, so two writes of one slot would race.
        if let Some(s) = duplicate_slot(slots, &mut plan.scratch) {
            return Err(PoolError::SlotTwice { slot: s }.into());
        }
        let row4 = self.cfg.num_kv_heads * self.cfg.head_dim / 4;
        if plan.kv_stride != 0 && (!plan.kv_stride.is_multiple_of(4) || plan.kv_stride / 4 < row4) {
            return Err(BatchError::Stride {
                what: "K/V",
                stride: plan.kv_stride,
                row: row4 * 4,
            }
            .into());
        }
        for (what, count) in [
            (
                "write_kv threads",
                slots.len() as u64 * self.cfg.write_threads_per_token(),
            ),
            (
                "copy_blocks threads",
                copies.len() as u64 * self.cfg.copy_threads_per_block(),
            ),
        ] {
            if count > u32::MAX as u64 {
                return Err(PoolError::TooMany {
                    what,
                    count,
                    limit: u32::MAX as u64,
                }
                .into());
            }
        }
        Ok(())
    }

    pub(super) fn check_plan(&self, gpu: &Gpu, plan: &WritePlan) -> Result<(), GpuError> {
        plan.check(gpu, self.id)
    }

    /// Records the planned copy-on-write copies for every layer. Record it
    /// before the step's writes.
    pub fn run_copy_blocks(
        &self,
        gpu: &Gpu,
        enc: &mut wgpu::CommandEncoder,
        plan: &mut WritePlan,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        self.check_plan(gpu, plan)?;
        // Made on the first step, copies or not, so a later step's first
        // copy creates nothing.
        if plan.copy_groups.len() != self.layers.len() {
            plan.copy_groups.clear();
            for [k, v] in &self.layers {
                let params = plan.copy_params.as_ref().expect("planned");
                plan.copy_groups.push(bind_ranges(
                    gpu,
                    &self.copy_blocks,
                    &[
                        params.as_entire_buffer_binding(),
                        plan.copies.get().as_entire_buffer_binding(),
                        k.as_entire_buffer_binding(),
                        v.as_entire_buffer_binding(),
                    ],
                ));
            }
        }
        if plan.num_copies == 0 {
            return Ok(());
        }
        let (x, y) = grid_1d(plan.num_copies as u64 * self.cfg.copy_threads_per_block());
        for bg in &plan.copy_groups {
            dispatch(enc, "copy_blocks", &self.copy_blocks, bg, (x, y, 1));
        }
        Ok(())
    }

    /// Records one layer's `write_kv` of the planned tokens: `k` and `v`
    /// hold `[num_tokens][num_kv_heads][head_dim]` f32 (rows
    /// `set_kv_stride` apart). Bindings are checked before recording.
    pub fn run_write_kv(
        &self,
        gpu: &Gpu,
        enc: &mut wgpu::CommandEncoder,
        plan: &mut WritePlan,
        layer: u32,
        k: &wgpu::BufferBinding,
        v: &wgpu::BufferBinding,
    ) -> Result<(), GpuError> {
        let _serial = gpu.serial();
        self.check_plan(gpu, plan)?;
        let [kp, vp] = self.layer(layer)?;
        let n = plan.num_tokens as u64;
        let elem = plan.act.bytes();
        let row = self.cfg.num_kv_heads as u64 * self.cfg.head_dim as u64 * elem;
        let stride = if plan.kv_stride == 0 {
            row
        } else {
            plan.kv_stride as u64 * elem
        };
        let need = if n == 0 { 0 } else { (n - 1) * stride + row };
        check_binding(gpu, "k", k, need)?;
        check_binding(gpu, "v", v, need)?;
        if n == 0 {
            return Ok(());
        }
        if plan.write_groups.len() > 4096 {
            plan.write_groups.clear();
        }
        let key = WriteKey {
            layer,
            act: plan.act,
            k: RangeKey::of(k),
            v: RangeKey::of(v),
        };
        let params = plan.write_params.as_ref().expect("planned");
        let Some(pipe) = plan.write_pipe.as_ref() else {
            return Err(GpuError::Plan(PlanMismatch::NotPlanned));
        };
        let slots = plan.slots.get();
        if !plan.write_groups.contains_key(&key) {
            let made = {
                bind_checked(
                    gpu,
                    pipe,
                    &[
                        params.as_entire_buffer_binding(),
                        k.clone(),
                        v.clone(),
                        slots.as_entire_buffer_binding(),
                        kp.as_entire_buffer_binding(),
                        vp.as_entire_buffer_binding(),
                    ],
                )
            }?;
            plan.write_groups.insert(key.clone(), made);
        }
        let bg = &plan.write_groups[&key];
        let (x, y) = grid_1d(n * self.cfg.write_threads_per_token());
        dispatch(enc, "write_kv", pipe, bg, (x, y, 1));
        Ok(())
    }
}

/// Checks a copy-on-write list for a pool of `num_blocks` blocks: every
/// block inside the pool, and no two copies racing (a destination named
/// twice, or named as another copy's source; a self-copy included), since
/// the copies run in parallel. What `KvCache::copy_blocks` and
/// `plan_write` check before anything is recorded; needs no device.
pub fn check_copies(num_blocks: u32, copies: &[[u32; 2]]) -> Result<(), GpuError> {
    if let Some(c) = copies
        .iter()
        .find(|c| c[0] >= num_blocks || c[1] >= num_blocks)
    {
        return Err(PoolError::CopyOutsidePool {
            pair: *c,
            blocks: num_blocks,
        }
        .into());
    }
    if let Some(block) = racing_copy(copies) {
        return Err(PoolError::CopyRace { block }.into());
    }
    Ok(())
}

/// A block a copy list names as the destination of one copy and the
/// destination or source of another (a self-copy included): the copies
/// run in parallel, so such a list would tear the block. The block
/// manager never makes one.
pub(super) fn racing_copy(copies: &[[u32; 2]]) -> Option<u32> {
    if copies.is_empty() {
        return None;
    }
    let mut dst: Vec<u32> = copies.iter().map(|c| c[1]).collect();
    dst.sort_unstable();
    if let Some(w) = dst.windows(2).find(|w| w[0] == w[1]) {
        return Some(w[0]);
    }
    copies
        .iter()
        .find(|c| dst.binary_search(&c[0]).is_ok())
        .map(|c| c[0])
}

#[cfg(test)]
mod copy_tests {
    use super::racing_copy;

    #[test]
    pub(super) fn racing_copy_lists_are_found() {
        assert_eq!(racing_copy(&[]), None);
        assert_eq!(racing_copy(&[[1, 2], [3, 4], [5, 6]]), None);
        assert_eq!(
            racing_copy(&[[1, 3], [2, 3]]),
            Some(3),
            "two copies into one block"
        );
        assert_eq!(racing_copy(&[[1, 2], [2, 3]]), Some(2), "a chain");
        assert_eq!(racing_copy(&[[4, 5], [5, 4]]), Some(4), "a swap");
        assert_eq!(racing_copy(&[[7, 7]]), Some(7), "a self-copy");
        assert_eq!(
            racing_copy(&[[1, 9], [1, 8]]),
            None,
            "one source, two destinations"
        );
    }
}
