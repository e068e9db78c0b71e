// out[r][c] = sum_k a[r][k] * W[c][k]: a [m][lda] f32 activations, W a
// weight matrix of rows of k elements in one of quant.wgsl's formats.
//
// One invocation per output column c (a weight row) and tile of R
// activation rows (R = 1, 4, 8 or 16): it dequantizes each 32-element block of
// its weight row once, four elements at a time, and applies it to the R
// rows, so a step reads its weights once per tile of R rows. The tile's
// rows of the current block are staged in workgroup memory. Accumulators
// are vec4s (four rows of the tile each), never arrays, so they stay in
// registers. Accumulation in f32.
//
// mode 0: out = acc; mode 1: out += acc (the residual);
// mode 2 (gated FFN): W holds the n_out gate rows, then the n_out up rows;
//         out = silu(gate) * up.
// The Rust side prepends FMT, BLOCK_WORDS and R.

struct Params {
    m: u32,       // activation rows
    k: u32,       // elements per row (multiple of 32)
    n_out: u32,   // output columns
    mode: u32,
    lda: u32,     // a's row stride (floats, multiple of 4)
    ldo: u32,     // out's row stride (floats)
    _a: u32,
    _b: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const WG: u32 = 64u;

// The tile's R rows of the current block: R x 8 vec4s (rows past m are 0).
var<workgroup> tile: array<vec4<f32>, R * 8u>;

fn dots4(wv: vec4<f32>, r0: u32, j: u32) -> vec4<f32> {
    return vec4<f32>(
        dot(wv, tile[r0 * 8u + j]),
        dot(wv, tile[(r0 + 1u) * 8u + j]),
        dot(wv, tile[(r0 + 2u) * 8u + j]),
        dot(wv, tile[(r0 + 3u) * 8u + j]),
    );
}

struct Acc {
    a: vec4<f32>, // rows 0-3 of the tile (row 0 only when R == 1)
    b: vec4<f32>, // rows 4-7 (R >= 8)
    c: vec4<f32>, // rows 8-11 (R == 16)
    d: vec4<f32>, // rows 12-15 (R == 16)
}

fn accumulate(acc: ptr<function, Acc>, wv: vec4<f32>, j: u32) {
    if R == 1u {
        (*acc).a.x += dot(wv, tile[j]);
    } else {
        (*acc).a += dots4(wv, 0u, j);
        if R >= 8u {
            (*acc).b += dots4(wv, 4u, j);
        }
        if R == 16u {
            (*acc).c += dots4(wv, 8u, j);
            (*acc).d += dots4(wv, 12u, j);
        }
    }
}

// Weight row c's block kb against the tile.
fn block(acc: ptr<function, Acc>, c: u32, kb: u32, nb: u32) {
    let base = (c * nb + kb) * BLOCK_WORDS;
    if FMT == FMT_Q4_1 {
        let dm = unpack2x16float(w[base]);
        let w0 = w[base + 1u];
        let w1 = w[base + 2u];
        let w2 = w[base + 3u];
        let w3 = w[base + 4u];
        accumulate(acc, nibbles_lo(w0) * dm.x + dm.y, 0u);
        accumulate(acc, nibbles_lo(w1) * dm.x + dm.y, 1u);
        accumulate(acc, nibbles_lo(w2) * dm.x + dm.y, 2u);
        accumulate(acc, nibbles_lo(w3) * dm.x + dm.y, 3u);
        accumulate(acc, nibbles_hi(w0) * dm.x + dm.y, 4u);
        accumulate(acc, nibbles_hi(w1) * dm.x + dm.y, 5u);
        accumulate(acc, nibbles_hi(w2) * dm.x + dm.y, 6u);
        accumulate(acc, nibbles_hi(w3) * dm.x + dm.y, 7u);
    } else if FMT == FMT_Q8_0 {
        let d = bitcast<f32>(w[base]);
        for (var q = 0u; q < 8u; q++) {
            accumulate(acc, bytes_signed(w[base + 1u + q]) * d, q);
        }
    } else {
        for (var q = 0u; q < 8u; q++) {
            let o = base + 4u * q;
            let wv = bitcast<vec4<f32>>(vec4<u32>(w[o], w[o + 1u], w[o + 2u], w[o + 3u]));
            accumulate(acc, wv, q);
        }
    }
}

fn store(row: u32, c: u32, g: f32, u: f32) {
    if row >= p.m {
        return;
    }
    let o = row * p.ldo + c;
    if p.mode == 0u {
        out[o] = g;
    } else if p.mode == 1u {
        out[o] = out[o] + g;
    } else {
        out[o] = g / (1.0 + exp(-g)) * u;
    }
}

// Rows r0..r0+n of the tile (n = 1 or 4) from one accumulator.
fn store4(r0: u32, c: u32, g: vec4<f32>, u: vec4<f32>, n: u32) {
    store(r0, c, g.x, u.x);
    if n == 4u {
        store(r0 + 1u, c, g.y, u.y);
        store(r0 + 2u, c, g.z, u.z);
        store(r0 + 3u, c, g.w, u.w);
    }
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let c = wid.x * WG + lid.x;
    let live = c < p.n_out;
    let t0 = wid.y * R;
    let nb = p.k / 32u;
    let gated = p.mode == 2u;
    let z = vec4<f32>(0.0);
    var acc = Acc(z, z, z, z);
    var up = Acc(z, z, z, z);
    for (var kb = 0u; kb < nb; kb++) {
        for (var i = lid.x; i < R * 8u; i += WG) {
            let r = t0 + i / 8u;
            var x = vec4<f32>(0.0);
            if r < p.m {
                x = a[r * (p.lda / 4u) + kb * 8u + i % 8u];
            }
            tile[i] = x;
        }
        workgroupBarrier();
        if live {
            block(&acc, c, kb, nb);
            if gated {
                block(&up, c + p.n_out, kb, nb);
            }
        }
        workgroupBarrier();
    }
    if !live {
        return;
    }
    store4(t0, c, acc.a, up.a, select(4u, 1u, R == 1u));
    if R >= 8u {
        store4(t0 + 4u, c, acc.b, up.b, 4u);
    }
    if R == 16u {
        store4(t0 + 8u, c, acc.c, up.c, 4u);
        store4(t0 + 12u, c, acc.d, up.d, 4u);
    }
}
