// out[r][c] = sum_k a[r][k] * W[c][k]: a [m][lda] f32 activations, W a
// weight matrix of n rows of k elements (quant.wgsl's formats), read once
// per tile of RT activation rows. One invocation per output column c (a
// weight row) and tile: it dequantizes each 32-element block of its row once
// and applies it to the RT rows, whose 32 values per block the workgroup
// stages in workgroup memory. Accumulation in f32.
//
// mode 0: out = acc; mode 1: out += acc (the residual);
// mode 2 (gated FFN): W holds the gate rows then the up rows (n_out each);
//         out = silu(gate) * up.
// The Rust side prepends FMT, BLOCK_WORDS and RT (rows per tile).

struct Params {
    m: u32,       // activation rows
    k: u32,       // elements per row (multiple of 32)
    n_out: u32,   // output columns
    mode: u32,
    lda: u32,     // a's row stride (floats)
    ldo: u32,     // out's row stride (floats)
    out_off: u32, // first output column in out's rows
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const WG: u32 = 64u;
var<workgroup> tile: array<vec4<f32>, RT * 8u>;

// Block kb of weight row c, as 8 vec4s.
fn load_block(c: u32, kb: u32, nb: u32) -> array<vec4<f32>, 8> {
    var v: array<vec4<f32>, 8>;
    let base = (c * nb + kb) * BLOCK_WORDS;
    if FMT == FMT_Q4_1 {
        let dm = unpack2x16float(w[base]);
        for (var q = 0u; q < 4u; q++) {
            let word = w[base + 1u + q];
            v[q] = nibbles_lo(word) * dm.x + dm.y;
            v[q + 4u] = nibbles_hi(word) * dm.x + dm.y;
        }
    } else if FMT == FMT_Q8_0 {
        let d = bitcast<f32>(w[base]);
        for (var q = 0u; q < 8u; q++) {
            v[q] = bytes_signed(w[base + 1u + q]) * d;
        }
    } else {
        for (var q = 0u; q < 8u; q++) {
            let o = base + 4u * q;
            v[q] = bitcast<vec4<f32>>(vec4<u32>(w[o], w[o + 1u], w[o + 2u], w[o + 3u]));
        }
    }
    return v;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let c = wid.x * WG + lid.x;
    let r0 = wid.y * RT;
    let nb = p.k / 32u;
    let live = c < p.n_out;
    let gated = p.mode == 2u;
    var acc: array<f32, RT>;
    var acc2: array<f32, RT>;
    for (var r = 0u; r < RT; r++) {
        acc[r] = 0.0;
        acc2[r] = 0.0;
    }
    for (var kb = 0u; kb < nb; kb++) {
        // Stage the tile's RT rows of this block: RT * 8 vec4s.
        for (var i = lid.x; i < RT * 8u; i += WG) {
            let r = r0 + i / 8u;
            var x = vec4<f32>(0.0);
            if r < p.m {
                let o = r * p.lda + kb * 32u + (i % 8u) * 4u;
                x = vec4<f32>(a[o], a[o + 1u], a[o + 2u], a[o + 3u]);
            }
            tile[i] = x;
        }
        workgroupBarrier();
        if live {
            let v = load_block(c, kb, nb);
            for (var r = 0u; r < RT; r++) {
                var s = 0.0;
                for (var q = 0u; q < 8u; q++) {
                    s += dot(v[q], tile[r * 8u + q]);
                }
                acc[r] += s;
            }
            if gated {
                let u = load_block(c + p.n_out, kb, nb);
                for (var r = 0u; r < RT; r++) {
                    var s = 0.0;
                    for (var q = 0u; q < 8u; q++) {
                        s += dot(u[q], tile[r * 8u + q]);
                    }
                    acc2[r] += s;
                }
            }
        }
        workgroupBarrier();
    }
    if !live {
        return;
    }
    for (var r = 0u; r < RT; r++) {
        let row = r0 + r;
        if row >= p.m {
            break;
        }
        let o = row * p.ldo + p.out_off + c;
        if p.mode == 0u {
            out[o] = acc[r];
        } else if p.mode == 1u {
            out[o] = out[o] + acc[r];
        } else {
            let g = acc[r];
            out[o] = g / (1.0 + exp(-g)) * acc2[r];
        }
    }
}
