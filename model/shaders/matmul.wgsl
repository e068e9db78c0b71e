// out[r][c] = sum_k a[r][k] * W[c][k]: a [m][lda] f32 activations, W a
// weight matrix of rows of k elements in one of quant.wgsl's formats.
//
// One invocation per output column c (a weight row) and tile of R
// activation rows (R = 1, 4, 8 or 16): it dequantizes each 32-element block of
// its weight row once, four elements at a time, and applies it to the R
// rows, so a step reads its weights once per tile of R rows. Accumulators
// are vec4s (four rows of the tile each), never arrays, so they stay in
// registers. Accumulation in f32.
//
// Every invocation needs the tile's rows of the current block. How they
// are shared is the staging file appended after this one, which also
// declares the entry point `main` (calling `run` below) and defines
// `stage`, `unstage` and `row`:
//   matmul_tile.wgsl:     through workgroup memory (every adapter);
//   matmul_subgroup.wgsl: through subgroup shuffles (subgroups of 8+ lanes).
// The engine's `MatmulStaging` picks one.
//
// mode 0: out = acc; mode 1: out += acc (the residual);
// mode 2 (gated FFN): W holds the n_out gate rows, then the n_out up rows;
//         out = silu(gate) * up; mode 3: the same with gelu_tanh(gate).
// The Rust side prepends FMT, BLOCK_WORDS and R, and appends the staging
// and matmul_out.wgsl.

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

// The tile's rows r0..r0+3 at vec4 column j.
struct T4 {
    a: vec4<f32>,
    b: vec4<f32>,
    c: vec4<f32>,
    d: vec4<f32>,
}

fn rows4(r0: u32, j: u32) -> T4 {
    return T4(row(r0, j), row(r0 + 1u, j), row(r0 + 2u, j), row(r0 + 3u, j));
}

fn dots(wv: vec4<f32>, t: T4) -> vec4<f32> {
    return vec4<f32>(dot(wv, t.a), dot(wv, t.b), dot(wv, t.c), dot(wv, t.d));
}

struct Acc {
    a: vec4<f32>, // rows 0-3 of the tile (row 0 only when R == 1)
    b: vec4<f32>, // rows 4-7 (R >= 8)
    c: vec4<f32>, // rows 8-11 (R == 16)
    d: vec4<f32>, // rows 12-15 (R == 16)
}

// Two weight vec4s (of two rows) against the tile: each tile load serves both.
fn accumulate(acc: ptr<function, Acc>, acc2: ptr<function, Acc>, wv: vec4<f32>, wv2: vec4<f32>, j: u32) {
    if R == 1u {
        let t = row(0u, j);
        (*acc).a.x += dot(wv, t);
        (*acc2).a.x += dot(wv2, t);
    } else {
        let t = rows4(0u, j);
        (*acc).a += dots(wv, t);
        (*acc2).a += dots(wv2, t);
        if R >= 8u {
            let t = rows4(4u, j);
            (*acc).b += dots(wv, t);
            (*acc2).b += dots(wv2, t);
        }
        if R == 16u {
            let t = rows4(8u, j);
            (*acc).c += dots(wv, t);
            (*acc2).c += dots(wv2, t);
            let u = rows4(12u, j);
            (*acc).d += dots(wv, u);
            (*acc2).d += dots(wv2, u);
        }
    }
}

// Vec4 q (0..8) of block kb of weight row c.
fn wvec(c: u32, kb: u32, nb: u32, q: u32) -> vec4<f32> {
    return block_vec4((c * nb + kb) * BLOCK_WORDS, q);
}

// Block kb of weight rows c and c2 against the tile.
fn block(acc: ptr<function, Acc>, acc2: ptr<function, Acc>, c: u32, c2: u32, kb: u32, nb: u32) {
    accumulate(acc, acc2, wvec(c, kb, nb, 0u), wvec(c2, kb, nb, 0u), 0u);
    accumulate(acc, acc2, wvec(c, kb, nb, 1u), wvec(c2, kb, nb, 1u), 1u);
    accumulate(acc, acc2, wvec(c, kb, nb, 2u), wvec(c2, kb, nb, 2u), 2u);
    accumulate(acc, acc2, wvec(c, kb, nb, 3u), wvec(c2, kb, nb, 3u), 3u);
    accumulate(acc, acc2, wvec(c, kb, nb, 4u), wvec(c2, kb, nb, 4u), 4u);
    accumulate(acc, acc2, wvec(c, kb, nb, 5u), wvec(c2, kb, nb, 5u), 5u);
    accumulate(acc, acc2, wvec(c, kb, nb, 6u), wvec(c2, kb, nb, 6u), 6u);
    accumulate(acc, acc2, wvec(c, kb, nb, 7u), wvec(c2, kb, nb, 7u), 7u);
}

// `store(row, c, g, u)`: matmul_out.wgsl, appended.

// Rows r0..r0+n of the tile (n = 1 or 4) from one accumulator.
fn store4(r0: u32, c: u32, g: vec4<f32>, u: vec4<f32>, n: u32) {
    store(r0, c, g.x, u.x);
    if n == 4u {
        store(r0 + 1u, c, g.y, u.y);
        store(r0 + 2u, c, g.z, u.z);
        store(r0 + 3u, c, g.w, u.w);
    }
}

// The body of the entry point, which the staging file declares (with the
// builtins its staging reads): workgroup wid, invocation lid of it, lane sid
// of its subgroup (0 without subgroups).
fn run(wid: vec3<u32>, lid: vec3<u32>, sid: u32) {
    let gated = p.mode >= 2u;
    // Gated: columns c of the gate and of the up rows; else columns c and
    // c + 64 of a workgroup's 128.
    var c = wid.x * WG + lid.x;
    var c2 = c + p.n_out;
    if !gated {
        c = wid.x * 2u * WG + lid.x;
        c2 = c + WG;
    }
    let live = c < p.n_out;
    let live2 = gated || c2 < p.n_out;
    let t0 = wid.y * R;
    let nb = p.k / 32u;
    let z = vec4<f32>(0.0);
    var acc = Acc(z, z, z, z);
    var acc2 = Acc(z, z, z, z);
    // Columns past the matrix read its last row, their sums never stored:
    // every invocation runs the loop (the subgroup staging needs them all).
    let cr = min(c, p.n_out - 1u);
    let cr2 = select(cr, c2, live2);
    for (var kb = 0u; kb < nb; kb++) {
        stage(t0, kb, lid.x, sid);
        block(&acc, &acc2, cr, cr2, kb, nb);
        unstage();
    }
    if !live {
        return;
    }
    let n = select(4u, 1u, R == 1u);
    if gated {
        store4(t0, c, acc.a, acc2.a, n);
    } else {
        store4(t0, c, acc.a, z, n);
        if live2 {
            store4(t0, c2, acc2.a, z, n);
        }
    }
    if R >= 8u {
        if gated {
            store4(t0 + 4u, c, acc.b, acc2.b, 4u);
        } else {
            store4(t0 + 4u, c, acc.b, z, 4u);
            if live2 {
                store4(t0 + 4u, c2, acc2.b, z, 4u);
            }
        }
    }
    if R == 16u {
        if gated {
            store4(t0 + 8u, c, acc.c, acc2.c, 4u);
            store4(t0 + 12u, c, acc.d, acc2.d, 4u);
        } else {
            store4(t0 + 8u, c, acc.c, z, 4u);
            store4(t0 + 12u, c, acc.d, z, 4u);
            if live2 {
                store4(t0 + 8u, c2, acc2.c, z, 4u);
                store4(t0 + 12u, c2, acc2.d, z, 4u);
            }
        }
    }
}
