// x[r][j] = E[ids[r]][j]: the embedding rows of the step's tokens, read in
// the table's own format (quant.wgsl). One invocation per 4 elements.
// Token ids were checked against the vocabulary on the host.

struct Params {
    m: u32,     // rows
    d: u32,     // d_model (multiple of 32)
    vocab: u32,
    _pad: u32,
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
    let tok = min(ids[r], p.vocab - 1u);
    let nb = p.d / 32u;
    let kb = j4 / 8u;
    let q = j4 % 8u;
    let base = (tok * nb + kb) * BLOCK_WORDS;
    var v: vec4<f32>;
    if FMT == FMT_Q4_1 {
        let dm = unpack2x16float(w[base]);
        let word = w[base + 1u + (q % 4u)];
        if q < 4u {
            v = nibbles_lo(word) * dm.x + dm.y;
        } else {
            v = nibbles_hi(word) * dm.x + dm.y;
        }
    } else if FMT == FMT_Q8_0 {
        v = bytes_signed(w[base + 1u + q]) * bitcast<f32>(w[base]);
    } else {
        let o = base + 4u * q;
        v = bitcast<vec4<f32>>(vec4<u32>(w[o], w[o + 1u], w[o + 2u], w[o + 3u]));
    }
    x[i] = v;
}
