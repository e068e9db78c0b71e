//! What every plan shares: buffers it grows and reuses, and bindings
//! checked (usage, alignment, size) before a bind group is made and kept.

use std::collections::HashMap;

use crate::gpu::context::Gpu;
use crate::gpu::error::{BindingError, GpuError};
use crate::gpu::pass::bind_ranges;

/// The first slot written twice in `slots` (`SKIP_WRITE` aside), found by
/// sorting a copy in `scratch`.
pub(crate) fn duplicate_slot(slots: &[u32], scratch: &mut Vec<u32>) -> Option<u32> {
    if slots.len() < 2 {
        return None;
    }
    scratch.clear();
    scratch.extend(
        slots
            .iter()
            .copied()
            .filter(|&s| s != crate::blocks::SKIP_WRITE),
    );
    scratch.sort_unstable();
    scratch.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}

/// A buffer the library owns and reuses, reallocated (to twice what is
/// needed) only when too small.
#[derive(Default)]
pub(super) struct Grow {
    pub(super) buf: Option<wgpu::Buffer>,
}

impl Grow {
    /// Makes room for `bytes`; true when the buffer was (re)allocated.
    pub(super) fn ensure(&mut self, gpu: &Gpu, label: &str, bytes: u64) -> Result<bool, GpuError> {
        let bytes = bytes.max(4096);
        if self.buf.as_ref().is_some_and(|b| b.size() >= bytes) {
            return Ok(false);
        }
        let want = bytes
            .saturating_mul(2)
            .min(gpu.max_binding_bytes())
            .max(bytes);
        self.buf = Some(gpu.storage(label, want)?);
        Ok(true)
    }

    pub(super) fn get(&self) -> &wgpu::Buffer {
        self.buf.as_ref().expect("ensured before use")
    }
}

/// A buffer range as a cache key: which buffer, where, how much.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(super) struct RangeKey(wgpu::Buffer, u64, Option<u64>);

impl RangeKey {
    pub(super) fn of(b: &wgpu::BufferBinding) -> Self {
        Self(b.buffer.clone(), b.offset, b.size.map(|s| s.get()))
    }
}

/// A bind group of an engine's buffer ranges, made in an error scope so
/// that a buffer wgpu refuses (one from another device or instance, say)
/// is an error on this call, not a panic or an error for someone else.
pub(super) fn bind_checked(
    gpu: &Gpu,
    pipeline: &wgpu::ComputePipeline,
    bindings: &[wgpu::BufferBinding],
) -> Result<wgpu::BindGroup, GpuError> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            gpu.scoped_blocking(|| bind_ranges(gpu, pipeline, bindings))
        }));
        match made {
            Ok(Ok(bg)) => Ok(bg),
            Ok(Err(GpuError::Validation(m))) => Err(GpuError::Binding {
                which: "bindings",
                problem: BindingError::Refused(m),
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(GpuError::Binding {
                which: "bindings",
                problem: BindingError::Unresolved,
            }),
        }
    }
    #[cfg(target_arch = "wasm32")]
    {
        Ok(bind_ranges(gpu, pipeline, bindings))
    }
}

/// Bytes a binding covers.
pub(super) fn binding_bytes(b: &wgpu::BufferBinding) -> u64 {
    match b.size {
        Some(s) => s.get(),
        None => b.buffer.size().saturating_sub(b.offset),
    }
}

/// Checks an engine buffer range before anything is recorded: STORAGE
/// usage, an offset the device can bind, inside the buffer, and at least
/// `need` bytes.
pub(super) fn check_binding(
    gpu: &Gpu,
    what: &'static str,
    b: &wgpu::BufferBinding,
    need: u64,
) -> Result<(), GpuError> {
    let bad = |problem| {
        Err(GpuError::Binding {
            which: what,
            problem,
        })
    };
    if !b.buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
        return bad(BindingError::NotStorage {
            usage: format!("{:?}", b.buffer.usage()),
        });
    }
    let align = gpu.limits.min_storage_buffer_offset_alignment as u64;
    if !b.offset.is_multiple_of(align) {
        return bad(BindingError::Misaligned {
            offset: b.offset,
            align,
        });
    }
    let end = b.offset.checked_add(binding_bytes(b));
    if end.is_none_or(|e| e > b.buffer.size()) || b.offset > b.buffer.size() {
        return bad(BindingError::PastEnd {
            offset: b.offset,
            size: binding_bytes(b),
            buffer: b.buffer.size(),
        });
    }
    if binding_bytes(b) < need {
        return bad(BindingError::TooSmall {
            bound: binding_bytes(b),
            needed: need,
        });
    }
    if binding_bytes(b) > gpu.max_binding_bytes() {
        return bad(BindingError::OverLimit {
            bound: binding_bytes(b),
            limit: gpu.max_binding_bytes(),
        });
    }
    Ok(())
}

/// The bind group of `key`, made (checked) on first use and kept.
pub(super) fn cached_group<'g, K: std::hash::Hash + Eq>(
    groups: &'g mut HashMap<K, wgpu::BindGroup>,
    key: K,
    gpu: &Gpu,
    pipe: &wgpu::ComputePipeline,
    entries: &[wgpu::BufferBinding],
) -> Result<&'g wgpu::BindGroup, GpuError> {
    use std::collections::hash_map::Entry;
    match groups.entry(key) {
        Entry::Occupied(e) => Ok(e.into_mut()),
        Entry::Vacant(e) => Ok(e.insert(bind_checked(gpu, pipe, entries)?)),
    }
}
