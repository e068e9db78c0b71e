//#import mla_constants R4 V4 BLOCK_SIZE HG LANES WG TILE_ROWS QN AN (generated from the shape: src/gpu/mla.rs)
//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
//#import kv            KV4 kv_load kv_store (shared/kv_<pool dtype>.wgsl)
//#import act           ACT4 act_load act_store (shared/act_<activation dtype>.wgsl)
//#import out           OUT4 out_load out_store (shared/out_<activation dtype>.wgsl)
//#import mla_common    MlaParams NEG INVALID (mla/common.wgsl)
// Writes new tokens' latent rows (in the activation type, [row][R4], rows
// `stride` ACT4s apart) into one layer's latent pool at their slots
// (block * BLOCK_SIZE + offset), in the pool's dtype. One thread per KV4; a
// slot outside the pool (SKIP_WRITE among them) is skipped.

@group(0) @binding(0) var<uniform> params: MlaParams;
@group(0) @binding(1) var<storage, read> slots: array<u32>;
@group(0) @binding(2) var<storage, read> src: array<ACT4>;
@group(0) @binding(3) var<storage, read_write> pool: array<KV4>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    let row = i / R4;
    let at_src = row * params.stride + i % R4;
    if i >= params.count * R4 || at_src >= arrayLength(&src) || row >= arrayLength(&slots) {
        return;
    }
    let slot = slots[row];
    if slot >= params.num_blocks * BLOCK_SIZE {
        return;
    }
    let at = slot * R4 + i % R4;
    if at < arrayLength(&pool) {
        pool[at] = kv_store(act_load(src[at_src]));
    }
}
