// out[r] = x[src(r)] / sqrt(mean(x[src(r)]^2) + eps) * weight, one
// workgroup per output row; src(r) = rows[r] when p.gather is set (the
// final norm runs only on the rows whose logits are needed), else r. With
// p.add set the result is added to out (Gemma 3's post-norms: the residual
// takes the normed attention or FFN output).

struct Params {
    m: u32,
    d: u32,
    eps: f32,
    gather: u32,
    add: u32,
    _a: u32,
    _b: u32,
    _c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read> rows: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

const WG: u32 = 64u;
var<workgroup> part: array<f32, WG>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let r = wid.x;
    if r >= p.m {
        return; // uniform per workgroup: no barrier is skipped by part of it
    }
    var src = r;
    if p.gather != 0u {
        src = rows[r];
    }
    let xo = src * p.d;
    var s = 0.0;
    for (var j = lid.x; j < p.d; j += WG) {
        let v = x[xo + j];
        s += v * v;
    }
    part[lid.x] = s;
    workgroupBarrier();
    for (var h = WG / 2u; h > 0u; h /= 2u) {
        if lid.x < h {
            part[lid.x] += part[lid.x + h];
        }
        workgroupBarrier();
    }
    let scale = 1.0 / sqrt(part[0] / f32(p.d) + p.eps);
    for (var j = lid.x; j < p.d; j += WG) {
        let y = x[xo + j] * scale * weight[j];
        if p.add != 0u {
            out[r * p.d + j] = out[r * p.d + j] + y;
        } else {
            out[r * p.d + j] = y;
        }
    }
}
