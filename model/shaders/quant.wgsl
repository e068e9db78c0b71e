// Weight formats the engine keeps on the GPU, one block = 32 consecutive
// elements of a weight row (GGUF's block layout, read in place):
//   FMT_Q4_1 (0): 5 words: [d | m] as two f16 (d low), then 16 bytes of
//                 nibbles; element j < 16 is the low nibble of byte j,
//                 element 16 + j its high nibble; value = d * q + m.
//   FMT_Q8_0 (1): 9 words: the f32 scale d (GGUF's f16, widened at load,
//                 exactly), then 32 signed bytes; value = d * q.
//   FMT_F32  (2): 32 words of f32.
// The Rust side prepends `const FMT: u32 = ..;` and `const BLOCK_WORDS: u32 = ..;`.

const FMT_Q4_1: u32 = 0u;
const FMT_Q8_0: u32 = 1u;
const FMT_F32: u32 = 2u;

fn nibbles_lo(w: u32) -> vec4<f32> {
    return vec4<f32>(f32(w & 15u), f32((w >> 8u) & 15u), f32((w >> 16u) & 15u), f32((w >> 24u) & 15u));
}

fn nibbles_hi(w: u32) -> vec4<f32> {
    return vec4<f32>(f32((w >> 4u) & 15u), f32((w >> 12u) & 15u), f32((w >> 20u) & 15u), f32(w >> 28u));
}

fn bytes_signed(w: u32) -> vec4<f32> {
    let s = bitcast<i32>(w);
    return vec4<f32>(
        f32(extractBits(s, 0u, 8u)),
        f32(extractBits(s, 8u, 8u)),
        f32(extractBits(s, 16u, 8u)),
        f32(extractBits(s, 24u, 8u)),
    );
}
