// out[r][c] = sum_k a[r][k] * W[c][k] for a few rows (decode: R = 1, 4 or
// 8 rows a tile), shaped for a GPU's memory system: one workgroup per
// output column c, its 64 lanes splitting the weight row's k elements.
//
// matmul.wgsl gives each invocation its own weight row, so the lanes of a
// subgroup read rows k elements apart, each load a separate transaction.
// Here lane l takes the 8 elements 4j..4j+3 and 16+4j..16+4j+3 of block
// l / 4 (j = l % 4), and the workgroup's 64 lanes read 16 consecutive
// blocks a round: one contiguous stretch of the row per load, dequantized
// in registers (a Q4 block's nibble word serves both of a lane's vec4s).
// Each lane keeps a partial sum per row of the tile (and per up row when
// gated); the reduction file appended after this one sums them across
// the workgroup and declares the entry point `main`:
//   matmul_splitk_wg.wgsl: a tree in workgroup memory (every adapter);
//   matmul_splitk_sg.wgsl: subgroupAdd, then the subgroups' sums.
// The engine's `MatmulStaging` picks one, as for matmul.wgsl.
//
// Params, bindings and modes are matmul.wgsl's (the same bind groups run
// either kernel); `store` is matmul_out.wgsl's. The grid is (columns
// folded past 65535 into y, row tiles in z). Accumulation in f32.
//
// NORM fuses the RMSNorm before the matmul: a holds the residual rows x,
// and out = rsqrt(mean(x^2) + eps) * sum_k W[c][k] * x[k] * gamma[k].
// Every workgroup reads its rows whole anyway, so each lane also sums
// its elements' squares, reduced with the dots: the norm costs no pass
// and no extra read of x.

struct Params {
    m: u32,       // activation rows
    k: u32,       // elements per row (multiple of 32)
    n_out: u32,   // output columns
    mode: u32,
    lda: u32,     // a's row stride (floats, multiple of 4)
    ldo: u32,     // out's row stride (floats)
    eps: f32,     // the fused RMSNorm's epsilon (NORM only)
    _b: u32,
}

// The bindings: matmul_splitk_io.wgsl (matmul.wgsl's four), or, with the
// RMSNorm fused in front (NORM), matmul_splitk_norm_io.wgsl (a the raw
// residual rows, plus the norm's weight); prepended by the Rust side.

const WG: u32 = 64u;
// Sums a lane holds: the tile's R rows of column c, then of its up row,
// then (NORM) the rows' squares.
const SUMS: u32 = 3u * R;

// Every lane's sums, SUMS rows of WG: the reduction's scratch.
var<workgroup> red: array<f32, 1536>;

// The body of the entry point (the reduction file declares it): workgroup
// wid of a grid nwg wide, invocation lid, lane sid of a subgroup of sgs
// lanes (0 and 1 without subgroups).
fn run(wid: vec3<u32>, nwg: vec3<u32>, lid: u32, sid: u32, sgs: u32) {
    let c = wid.x + wid.y * nwg.x;
    // The whole workgroup leaves together (c is uniform): past the columns.
    if c >= p.n_out {
        return;
    }
    let gated = p.mode >= 2u;
    let t0 = wid.z * R;
    let nb = p.k / 32u;
    let lda4 = p.lda / 4u;
    let rows = min(R, p.m - min(t0, p.m));
    var s: array<f32, SUMS>;
    for (var u = lid; u < nb * 4u; u += WG) {
        let kb = u / 4u;
        let j = u % 4u;
        let base = (c * nb + kb) * BLOCK_WORDS;
        let w0 = block_vec4(base, j);
        let w1 = block_vec4(base, j + 4u);
        var g0 = vec4<f32>(0.0);
        var g1 = vec4<f32>(0.0);
        if gated {
            let up = ((c + p.n_out) * nb + kb) * BLOCK_WORDS;
            g0 = block_vec4(up, j);
            g1 = block_vec4(up, j + 4u);
        }
        for (var r = 0u; r < R; r++) {
            if r < rows {
                let ai = (t0 + r) * lda4 + kb * 8u + j;
                var x0 = a[ai];
                var x1 = a[ai + 4u];
                if NORM {
                    s[2u * R + r] += dot(x0, x0) + dot(x1, x1);
                    x0 *= gamma(kb * 8u + j);
                    x1 *= gamma(kb * 8u + j + 4u);
                }
                s[r] += dot(w0, x0) + dot(w1, x1);
                if gated {
                    s[R + r] += dot(g0, x0) + dot(g1, x1);
                }
            }
        }
    }
    // Reduced: the dots, the up rows' when gated, the squares with NORM
    // (the squares sit after the up rows' slots either way).
    var n = select(R, 2u * R, gated);
    if NORM {
        n = SUMS;
    }
    reduce(&s, n, lid, sid, sgs);
    // red[i * WG] holds sum i of the workgroup.
    if lid < rows {
        var scale = 1.0;
        if NORM {
            scale = inverseSqrt(red[(2u * R + lid) * WG] / f32(p.k) + p.eps);
        }
        store(t0 + lid, c, scale * red[lid * WG], scale * red[(R + lid) * WG]);
    }
}
