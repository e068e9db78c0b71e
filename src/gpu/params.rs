//! Uniform parameter structs, mirrored in shaders/common.wgsl (keep in sync;
//! `tests/host/shaders.rs` checks each size against naga's layout of the WGSL).

use bytemuck::{Pod, Zeroable};

/// Parameters of write_kv.wgsl.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Zeroable, Pod)]
pub struct WriteKvParams {
    pub num_tokens: u32,
    pub num_kv_heads: u32,
    pub num_slots: u32,
    /// vec4s from one token's K (and V) row to the next; 0: packed rows.
    pub kv_stride: u32,
}
const _: () = assert!(size_of::<WriteKvParams>() == 16);

/// Parameters of copy_blocks.wgsl.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Zeroable, Pod)]
pub struct CopyParams {
    pub num_copies: u32,
    pub num_blocks: u32,
    pub block_elems: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<CopyParams>() == 16);

/// Parameters of attention.wgsl (decode and prefill) and reduce.wgsl.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Zeroable, Pod)]
pub struct AttnParams {
    pub num_seqs: u32,
    pub num_heads: u32,
    pub num_kv_heads: u32,
    pub num_blocks: u32,
    pub scale: f32,
    pub soft_cap: f32,
    pub sliding_window: u32,
    pub alibi: u32,
    pub partition_tokens: u32,
    pub num_partitions: u32,
    pub lens_off: u32,
    pub indices_off: u32,
    pub indices_len: u32,
    pub slopes_off: u32,
    pub qo_off: u32,
    /// vec4s from one query's row of Q to the next; 0: packed rows.
    pub q_stride: u32,
    /// Cascade passes: offset of the (query row, position) pairs in the
    /// table (0: not a cascade pass).
    pub qmap_off: u32,
    /// Cascade passes: offset of each segment's partial slot.
    pub slot_off: u32,
    /// Offset of the per-head sink logits in the table (0: no sinks).
    pub sinks_off: u32,
    /// StreamingLLM: the first positions stay visible beside the sliding
    /// window (0: none; only set with a window).
    pub sink_tokens: u32,
}
const _: () = assert!(size_of::<AttnParams>() == 80);

/// Every param struct with its WGSL name and host size, for the layout test.
pub const PARAM_STRUCTS: &[(&str, usize)] = &[
    ("WriteKvParams", size_of::<WriteKvParams>()),
    ("CopyParams", size_of::<CopyParams>()),
    ("AttnParams", size_of::<AttnParams>()),
];
