// RMSNorm of every Q and K head in place in the fused QKV rows (Gemma 3's
// Q/K norms, before RoPE): head h of row r, of `hd` elements, becomes
// x / sqrt(mean(x^2) + eps) * weight, with the Q weight for the query
// heads and the K weight for the key heads. One workgroup per (row, head).

struct Params {
    m: u32,
    heads: u32,    // Q heads + K heads
    q_heads: u32,
    hd: u32,       // elements per head
    stride: u32,   // row stride (floats)
    k_off: u32,    // K's offset in a row (floats)
    eps: f32,
    _a: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// The Q weight (hd), then the K weight (hd).
@group(0) @binding(1) var<storage, read> weight: array<f32>;
@group(0) @binding(2) var<storage, read> unused: array<u32>;
@group(0) @binding(3) var<storage, read_write> qkv: array<f32>;

const WG: u32 = 64u;
var<workgroup> part: array<f32, WG>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let r = wid.x / p.heads;
    let h = wid.x % p.heads;
    if r >= p.m {
        return; // uniform per workgroup
    }
    var base = r * p.stride + h * p.hd;
    var wo = 0u;
    if h >= p.q_heads {
        base = r * p.stride + p.k_off + (h - p.q_heads) * p.hd;
        wo = p.hd;
    }
    var s = 0.0;
    for (var j = lid.x; j < p.hd; j += WG) {
        let v = qkv[base + j];
        s += v * v;
    }
    part[lid.x] = s;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k /= 2u) {
        if lid.x < k {
            part[lid.x] += part[lid.x + k];
        }
        workgroupBarrier();
    }
    let scale = 1.0 / sqrt(part[0] / f32(p.hd) + p.eps);
    for (var j = lid.x; j < p.hd; j += WG) {
        qkv[base + j] = qkv[base + j] * scale * weight[wo + j];
    }
}
