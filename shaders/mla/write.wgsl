// Writes new tokens' latent rows (f32, [row][R4]) into one layer's latent
// pool at their slots (block * BLOCK_SIZE + offset), in the pool's dtype.
// One thread per KV4; a slot outside the pool is skipped (the host refuses
// it first).

@group(0) @binding(0) var<uniform> params: MlaParams;
@group(0) @binding(1) var<storage, read> slots: array<u32>;
@group(0) @binding(2) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> pool: array<KV4>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if i >= params.count * R4 || i >= arrayLength(&src) || i / R4 >= arrayLength(&slots) {
        return;
    }
    let slot = slots[i / R4];
    if slot >= params.num_blocks * BLOCK_SIZE {
        return;
    }
    let at = slot * R4 + i % R4;
    if at < arrayLength(&pool) {
        pool[at] = kv_store(src[i]);
    }
}
