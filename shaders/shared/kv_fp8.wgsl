// KV codec of fp8 pools: FP8 E4M3 by bit operations (no hardware fp8
// assumed): bias 7, subnormals at 2^-9, no infinities; encoding rounds to
// nearest even and saturates at +-448, NaN is stored as 0. A KV4 is four
// bytes in a u32; the scales are applied by the kernels.
alias KV4 = u32;
const KV_QUANT: u32 = 2u;
fn fp8_dec(b: u32) -> f32 {
    let mag = b & 0x7fu;
    let e = mag >> 3u;
    let m = f32(mag & 7u);
    let v = select((8.0 + m) * exp2(f32(e) - 10.0), m * 0.001953125, e == 0u);
    return select(v, -v, (b & 0x80u) != 0u);
}
// Decoding through f16: an E4M3 byte's exponent and mantissa, moved to
// bits 7..14 of an f16 (sign to bit 15), are the same number x 2^-8, normals
// and subnormals alike; two bytes per unpack2x16float.
fn fp8_pair(y: u32) -> vec2<f32> {
    let h = ((y & 0x007f007fu) << 7u) | ((y & 0x00800080u) << 8u);
    return unpack2x16float(h) * 256.0;
}
// Bytes 0 and 2, then 1 and 3 (fp8_pair reads bits 0..7 and 16..23).
fn kv_load(x: KV4) -> vec4<f32> {
    let a = fp8_pair(x);
    let b = fp8_pair(x >> 8u);
    return vec4<f32>(a.x, b.x, a.y, b.y);
}
fn fp8_enc(v: f32) -> u32 {
    let bits = bitcast<u32>(v);
    let sign = (bits >> 24u) & 0x80u;
    if (bits & 0x7fffffffu) > 0x7f800000u {
        return 0u;
    }
    let a = min(abs(v), 448.0);
    if a < 0.015625 {
        return sign | u32(round(a * 512.0));
    }
    var e = i32((bitcast<u32>(a) >> 23u) & 0xffu) - 127;
    var q = u32(round((a * exp2(f32(-e)) - 1.0) * 8.0));
    if q == 8u {
        q = 0u;
        e += 1;
    }
    return sign | (u32(e + 7) << 3u) | q;
}
fn fp8x4_enc(x: vec4<f32>) -> u32 {
    return fp8_enc(x.x) | (fp8_enc(x.y) << 8u) | (fp8_enc(x.z) << 16u) | (fp8_enc(x.w) << 24u);
}
fn kv_store(x: vec4<f32>) -> KV4 { return fp8x4_enc(x); }
