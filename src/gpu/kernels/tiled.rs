//! `attention.wgsl`: a workgroup of 64 per (sequence, KV head, head tile);
//! one thread scores one token over tiles of 64 tokens, V is accumulated
//! per vec4 column. Fits WebGPU's defaults on every shape. Also the chunked
//! prefill kernel (QTILE queries per workgroup) and the cascade's segment
//! pass where no other fits.

use super::spec::DecodeKernel;
use crate::gpu::compose::{balanced_head_tile, Shader, ShaderShape};
use crate::gpu::context::Gpu;

/// Most query rows the tiled kernel keeps per pass (per-thread registers).
const TILED_MAX_ROWS: u32 = 16;

pub(in crate::gpu) struct Tiled;

impl DecodeKernel for Tiled {
    fn shader(&self) -> Shader {
        Shader::Attention
    }
    fn shape(&self, _gpu: &Gpu, base: ShaderShape, limit: u32) -> Option<ShaderShape> {
        let mut most = TILED_MAX_ROWS;
        loop {
            let s = ShaderShape {
                htile: balanced_head_tile(base.group, most),
                ..base
            };
            if workgroup_bytes(&s) <= limit {
                return Some(s);
            }
            if most == 1 {
                return None;
            }
            most /= 2;
        }
    }
    fn workgroup_bytes(&self, s: &ShaderShape) -> u32 {
        workgroup_bytes(s)
    }
    // One token per thread per tile of 64: the tiled kernel's own cap.
    fn iterations_per_token(&self, _s: &ShaderShape) -> u32 {
        0
    }
    fn split_target(&self) -> (u64, u32) {
        (256, 512)
    }
}

/// Bytes of workgroup memory attention.wgsl uses for `shape`.
pub fn workgroup_bytes(s: &ShaderShape) -> u32 {
    let (rows, d4, tile, wg) = (s.head_tile() * s.qtile.max(1), s.head_dim / 4, 64, 64);
    let segs = (wg / rows).max(1);
    16 * rows * d4 + 2 * (4 * rows * tile + 4 * tile) + 4 * rows * segs + 24 * rows + 20 * wg
}

/// Queries per prefill workgroup for `shape` (its `qtile` ignored): the most
/// query rows (queries x group heads, up to 16) whose workgroup memory fits
/// `limit` bytes; at least 1.
pub fn prefill_qtile(shape: &ShaderShape, limit: u32) -> u32 {
    let most = (16 / shape.head_tile()).max(1);
    // Largest power of two not above `most`.
    let mut qt = 1 << (31 - most.leading_zeros());
    while qt > 1
        && workgroup_bytes(&ShaderShape {
            qtile: qt,
            ..*shape
        }) > limit
    {
        qt /= 2;
    }
    qt
}
