// Rotary position embedding in place over the fused QKV rows: for each row
// r and each Q and K head, pairs rotate by the angle of position pos[r] and
// frequency i: (2i, 2i + 1) with style 0 (GGUF's llama layout: the
// converter permuted Q/K so that adjacent elements pair), (i, i + half)
// with style 1 (NeoX; Gemma). cos/sin come from a table
// [max_pos][head_dim / 2] of vec2 (cos, sin) computed on the host.

struct Params {
    m: u32,
    heads: u32,    // Q heads + K heads rotated (from the row's start)
    half: u32,     // head_dim / 2
    stride: u32,   // row stride (floats)
    max_pos: u32,
    style: u32,
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
    var o0 = r * p.stride + (h * p.half + j) * 2u;
    var o1 = o0 + 1u;
    if p.style == 1u {
        o0 = r * p.stride + h * p.half * 2u + j;
        o1 = o0 + p.half;
    }
    let x0 = qkv[o0];
    let x1 = qkv[o1];
    qkv[o0] = x0 * cs.x - x1 * cs.y;
    qkv[o1] = x0 * cs.y + x1 * cs.x;
}
