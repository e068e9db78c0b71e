// Rotary position embedding in place over the fused QKV rows: for each row
// r and each Q and K head, pairs (2i, 2i + 1) rotate by the angle of
// position pos[r] and frequency i (GGUF's llama layout: the converter
// permuted Q/K so that adjacent elements pair). cos/sin come from a table
// [max_pos][head_dim / 2] of vec2 (cos, sin) computed on the host.

struct Params {
    m: u32,
    heads: u32,    // Q heads + K heads rotated (from the row's start)
    half: u32,     // head_dim / 2
    stride: u32,   // row stride (floats)
    max_pos: u32,
    _a: u32,
    _b: u32,
    _c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> pos: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> qkv: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let per_row = p.heads * p.half;
    if i >= p.m * per_row {
        return;
    }
    let r = i / per_row;
    let hi = i % per_row;
    let h = hi / p.half;
    let j = hi % p.half;
    let cs = table[min(pos[r], p.max_pos - 1u) * p.half + j];
    let o = r * p.stride + (h * p.half + j) * 2u;
    let x0 = qkv[o];
    let x1 = qkv[o + 1u];
    qkv[o] = x0 * cs.x - x1 * cs.y;
    qkv[o + 1u] = x0 * cs.y + x1 * cs.x;
}
