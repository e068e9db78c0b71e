// x[r][j] = E[ids[r]][j] * scale: the embedding rows of the step's tokens,
// read in the table's own format (quant.wgsl). One invocation per 4
// elements. The table may come in row chunks (one binding each holds at
// most the device's binding size): this dispatch holds rows lo..lo + n and
// writes only the step's rows whose token is one of them. Token ids were
// checked against the vocabulary on the host.

struct Params {
    m: u32,     // rows
    d: u32,     // d_model (multiple of 32)
    lo: u32,    // the chunk's first table row
    scale: f32, // the embedding's factor (Gemma: sqrt(d_model))
    n: u32,     // the chunk's rows
    _a: u32,
    _b: u32,
    _c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read_write> x: array<vec4<f32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let d4 = p.d / 4u;
    let i = gid.x;
    if i >= p.m * d4 {
        return;
    }
    let r = i / d4;
    let j4 = i % d4;
    let id = ids[r];
    if id < p.lo || id - p.lo >= p.n {
        return;
    }
    let tok = id - p.lo;
    let nb = p.d / 32u;
    let kb = j4 / 8u;
    let q = j4 % 8u;
    let base = (tok * nb + kb) * BLOCK_WORDS;
    x[i] = block_vec4(base, q) * p.scale;
}
