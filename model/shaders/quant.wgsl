// Weight formats the engine keeps on the GPU, one block = 32 consecutive
// elements of a weight row (GGUF's block layout, read in place):
//   FMT_Q4_1 (0): 5 words: [d | m] as two f16 (d low), then 16 bytes of
//                 nibbles; element j < 16 is the low nibble of byte j,
//                 element 16 + j its high nibble; value = d * q + m.
//   FMT_Q8_0 (1): 9 words: the f32 scale d (GGUF's f16, widened at load,
//                 exactly), then 32 signed bytes; value = d * q.
//   FMT_F32  (2): 32 words of f32.
//   FMT_Q4K  (3): 6 words: one 32-element sub-block of a Q4_K super-block:
//                 its scale and minimum as f32, then 16 bytes of nibbles in
//                 Q4_1's order; value = scale * q + min.
//   FMT_Q6K  (4): 10 words: the f32 scales of the two 16-element halves,
//                 then 32 signed bytes (the 6-bit values minus 32);
//                 value = scale[half] * q.
// (Q5_0 files load as FMT_Q8_0: src/weights.rs.)
// The Rust side prepends `const FMT: u32 = ..;` and `const BLOCK_WORDS: u32 = ..;`.

const FMT_Q4_1: u32 = 0u;
const FMT_Q8_0: u32 = 1u;
const FMT_F32: u32 = 2u;
const FMT_Q4K: u32 = 3u;
const FMT_Q6K: u32 = 4u;

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

