//#import mla_constants R4 V4 BLOCK_SIZE HG LANES WG TILE_ROWS QN AN (generated from the shape: src/gpu/mla.rs)
//#import saturate      kv_sat KV_MAX F16_MAX (shared/saturate.wgsl)
//#import kv            KV4 kv_load kv_store (shared/kv_<pool dtype>.wgsl)
//#import act           ACT4 act_load act_store (shared/act_<activation dtype>.wgsl)
//#import out           OUT4 out_load out_store (shared/out_<activation dtype>.wgsl)
//#import mla_common    MlaParams NEG INVALID (mla/common.wgsl)
// Copy-on-write inside one layer's latent pool: block dst becomes a copy of
// block src for each (src, dst) pair. A kernel, because WebGPU forbids a
// buffer-to-buffer copy within one buffer. The host refuses a list where a
// destination is also a source or is written twice, so no thread reads what
// another writes. One thread per KV4.

@group(0) @binding(0) var<uniform> params: MlaParams;
@group(0) @binding(1) var<storage, read> copies: array<vec2<u32>>;
@group(0) @binding(2) var<storage, read_write> pool: array<KV4>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    let per = BLOCK_SIZE * R4;
    if i >= params.count * per || i / per >= arrayLength(&copies) {
        return;
    }
    let pair = copies[i / per];
    if pair.x >= params.num_blocks || pair.y >= params.num_blocks {
        return;
    }
    let e = i % per;
    pool[pair.y * per + e] = pool[pair.x * per + e];
}
