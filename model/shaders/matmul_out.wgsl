// The output of a matmul (matmul.wgsl, matmul_splitk.wgsl): row `row`,
// column `c` gets the sum `g` (and, gated, the up row's sum `u`) by
// p.mode: 0 writes, 1 adds (the residual), 2 silu(g) * u, 3 gelu_tanh(g) * u.

fn store(row: u32, c: u32, g: f32, u: f32) {
    if row >= p.m {
        return;
    }
    let o = row * p.ldo + c;
    if p.mode == 0u {
        out[o] = g;
    } else if p.mode == 1u {
        out[o] = out[o] + g;
    } else if p.mode == 2u {
        out[o] = g / (1.0 + exp(-g)) * u;
    } else {
        // GELU's tanh approximation (tanh has saturated well before 10).
        let t = tanh(clamp(0.7978845608028654 * (g + 0.044715 * g * g * g), -10.0, 10.0));
        out[o] = 0.5 * g * (1.0 + t) * u;
    }
}

