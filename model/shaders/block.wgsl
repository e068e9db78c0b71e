// The weight block reader of the kernels that read weights (matmul, embed):
// they declare the weights as `w: array<u32>` in one of quant.wgsl's formats.
// Elements 4q..4q+3 (q in 0..8) of the 32-element block at word `base` of w.
fn block_vec4(base: u32, q: u32) -> vec4<f32> {
    if FMT == FMT_Q4_1 {
        let dm = unpack2x16float(w[base]);
        let word = w[base + 1u + q % 4u];
        if q < 4u {
            return nibbles_lo(word) * dm.x + dm.y;
        }
        return nibbles_hi(word) * dm.x + dm.y;
    } else if FMT == FMT_Q8_0 {
        return bytes_signed(w[base + 1u + q]) * bitcast<f32>(w[base]);
    } else if FMT == FMT_Q4K {
        let scale = bitcast<f32>(w[base]);
        let mn = bitcast<f32>(w[base + 1u]);
        let word = w[base + 2u + q % 4u];
        if q < 4u {
            return nibbles_lo(word) * scale + mn;
        }
        return nibbles_hi(word) * scale + mn;
    } else if FMT == FMT_Q6K {
        return bytes_signed(w[base + 2u + q]) * bitcast<f32>(w[base + q / 4u]);
    }
    let o = base + 4u * q;
    return bitcast<vec4<f32>>(vec4<u32>(w[o], w[o + 1u], w[o + 2u], w[o + 3u]));
}
