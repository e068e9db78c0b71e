//! Weight matrices as the GGUF file holds them, and the words the GPU
//! keeps of them (`shaders/quant.wgsl`): every format is dequantized
//! inside the matmul, 32 elements (one GPU block) at a time, with f32
//! accumulation.
//!
//! | file type | GPU block (32 elements)                          | words |
//! |-----------|--------------------------------------------------|-------|
//! | Q4_1      | as the file: f16 scale and minimum, 16 bytes of nibbles | 5 |
//! | Q8_0      | the f16 scale widened to f32 (exactly), 32 i8    | 9     |
//! | Q5_0      | read as Q8_0: its 5-bit values minus 16 fit an i8 exactly, so Q, K and V of one layer stack whatever mix of Q5_0 and Q8_0 a file has | 9 |
//! | Q4_K      | one 32-element sub-block of a 256-element super-block: its scale `d * sc` and minimum `-dmin * m` as f32 (both exact), then its nibbles in Q4_1's order | 6 |
//! | Q6_K      | 32 elements of a super-block: the f32 scales `d * sc` of its two 16-element halves (exact), then the 6-bit values minus 32 as i8 | 10 |
//! | F32       | 32 f32                                           | 32    |
//!
//! Every conversion is exact: the GPU computes the same products the
//! reference dequantizer does (`scale * q + min`), in f32.

use crate::ModelError;

/// A weight matrix's format on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// 32 elements per block: f16 scale and minimum, 4-bit values.
    Q4_1,
    /// 32 elements per block: f16 scale, 8-bit signed values (Q5_0 files
    /// load as this).
    Q8_0,
    /// 256-element super-blocks: f16 scale and minimum, 6-bit scales and
    /// minimums per 32 elements, 4-bit values.
    Q4K,
    /// 256-element super-blocks: f16 scale, 8-bit scales per 16 elements,
    /// 6-bit values.
    Q6K,
    /// Plain f32.
    F32,
}

impl WeightFormat {
    /// Elements in one file block.
    pub fn block_elems(self) -> usize {
        match self {
            WeightFormat::Q4K | WeightFormat::Q6K => 256,
            _ => 32,
        }
    }

    /// File bytes of one block.
    pub fn gguf_block_bytes(self) -> usize {
        match self {
            WeightFormat::Q4_1 => 20,
            WeightFormat::Q8_0 => 34,
            WeightFormat::Q4K => 144,
            WeightFormat::Q6K => 210,
            WeightFormat::F32 => 128,
        }
    }

    /// u32 words of one 32-element GPU block (quant.wgsl).
    pub fn gpu_block_words(self) -> usize {
        match self {
            WeightFormat::Q4_1 => 5,
            WeightFormat::Q8_0 => 9,
            WeightFormat::Q4K => 6,
            WeightFormat::Q6K => 10,
            WeightFormat::F32 => 32,
        }
    }

    /// The format's id in quant.wgsl.
    pub(crate) fn shader_id(self) -> u32 {
        match self {
            WeightFormat::Q4_1 => 0,
            WeightFormat::Q8_0 => 1,
            WeightFormat::F32 => 2,
            WeightFormat::Q4K => 3,
            WeightFormat::Q6K => 4,
        }
    }
}

/// A weight matrix as the GGUF file holds it: `rows` rows (output
/// features) of `cols` elements, in `fmt`'s blocks, row after row.
#[derive(Clone, Debug)]
pub struct HostMatrix {
    pub fmt: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<u8>,
}

fn f16(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Q4_K's 6-bit scale and minimum of sub-block `j` (0..8) from its 12
/// packed bytes.
fn q4k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// One Q4_K super-block as 8 GPU sub-blocks: (scale, minimum, the 32
/// nibbles in order).
fn q4k_blocks(b: &[u8]) -> [(f32, f32, [u8; 32]); 8] {
    let (d, dmin) = (f16(&b[0..2]), f16(&b[2..4]));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    let mut out = [(0.0, 0.0, [0u8; 32]); 8];
    for (s, o) in out.iter_mut().enumerate() {
        let (sc, m) = q4k_scale_min(s, scales);
        let chunk = &qs[32 * (s / 2)..32 * (s / 2) + 32];
        let mut nib = [0u8; 32];
        for (e, n) in nib.iter_mut().enumerate() {
            *n = if s % 2 == 0 {
                chunk[e] & 0xf
            } else {
                chunk[e] >> 4
            };
        }
        *o = (d * f32::from(sc), -(dmin * f32::from(m)), nib);
    }
    out
}

/// One Q6_K super-block as 8 GPU blocks: (the scales of the two
/// 16-element halves, the values minus 32).
fn q6k_blocks(b: &[u8]) -> [([f32; 2], [i8; 32]); 8] {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16(&b[208..210]);
    let mut q = [0i8; 256];
    for n in 0..2 {
        let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
        for l in 0..32 {
            let y = &mut q[128 * n..];
            y[l] = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i8 - 32;
            y[l + 32] = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            y[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            y[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    let mut out = [([0.0; 2], [0i8; 32]); 8];
    for (t, o) in out.iter_mut().enumerate() {
        let s = |h: usize| d * f32::from(sc[2 * t + h] as i8);
        o.0 = [s(0), s(1)];
        o.1.copy_from_slice(&q[32 * t..32 * t + 32]);
    }
    out
}

impl HostMatrix {
    /// A matrix of GGUF type `ty` (`data` as the file holds it) in the
    /// engine's format: Q5_0 widened to Q8_0 (exactly); `None` for a type
    /// the engine does not read.
    pub fn from_gguf(
        ty: crate::gguf::GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Option<HostMatrix> {
        use crate::gguf::GgmlType as T;
        let (fmt, data) = match ty {
            T::Q4_1 => (WeightFormat::Q4_1, data.to_vec()),
            T::Q8_0 => (WeightFormat::Q8_0, data.to_vec()),
            T::Q4K => (WeightFormat::Q4K, data.to_vec()),
            T::Q6K => (WeightFormat::Q6K, data.to_vec()),
            T::F32 => (WeightFormat::F32, data.to_vec()),
            T::Q5_0 => (WeightFormat::Q8_0, q5_0_as_q8_0(data)?),
            _ => return None,
        };
        Some(HostMatrix {
            fmt,
            rows,
            cols,
            data,
        })
    }

    /// Checks the byte count against the shape.
    pub fn check(&self, name: &str) -> Result<(), ModelError> {
        let be = self.fmt.block_elems();
        let want = self.rows * (self.cols / be) * self.fmt.gguf_block_bytes();
        if !self.cols.is_multiple_of(be) || self.data.len() != want {
            return Err(ModelError::Shape(format!(
                "{name}: {} x {} {:?} needs {want} bytes (columns a multiple of {be}), found {}",
                self.rows,
                self.cols,
                self.fmt,
                self.data.len()
            )));
        }
        Ok(())
    }

    /// Rows of several matrices of one format and width, stacked (the fused
    /// projections), with `pad` zero rows after each part as asked.
    pub fn stack(name: &str, parts: &[(&HostMatrix, usize)]) -> Result<HostMatrix, ModelError> {
        let (first, _) = parts[0];
        let mut data = Vec::new();
        let mut rows = 0;
        for (m, pad) in parts {
            if m.fmt != first.fmt || m.cols != first.cols {
                return Err(ModelError::Shape(format!(
                    "{name}: fused parts must share format and width ({:?} x {} vs {:?} x {})",
                    first.fmt, first.cols, m.fmt, m.cols
                )));
            }
            data.extend_from_slice(&m.data);
            // A zero block is zero in every format (scales 0, minimum 0).
            data.resize(
                data.len() + pad * (m.cols / m.fmt.block_elems()) * m.fmt.gguf_block_bytes(),
                0,
            );
            rows += m.rows + pad;
        }
        Ok(HostMatrix {
            fmt: first.fmt,
            rows,
            cols: first.cols,
            data,
        })
    }

    /// Rows `lo..lo + n`.
    pub fn row_range(&self, lo: usize, n: usize) -> HostMatrix {
        let row = self.cols / self.fmt.block_elems() * self.fmt.gguf_block_bytes();
        HostMatrix {
            fmt: self.fmt,
            rows: n,
            cols: self.cols,
            data: self.data[lo * row..(lo + n) * row].to_vec(),
        }
    }

    /// The GPU words (quant.wgsl), 32-element blocks in row order.
    pub fn gpu_words(&self) -> Vec<u32> {
        let bb = self.fmt.gguf_block_bytes();
        let gpu_blocks = self.data.len() / bb * (self.fmt.block_elems() / 32);
        let mut out = Vec::with_capacity(gpu_blocks * self.fmt.gpu_block_words());
        let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let nibbles = |n: &[u8; 32]| -> [u32; 4] {
            let mut w = [0u32; 4];
            for j in 0..16 {
                w[j / 4] |= u32::from(n[j] | (n[j + 16] << 4)) << (8 * (j % 4));
            }
            w
        };
        let bytes = |q: &[i8]| -> Vec<u32> {
            q.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8]))
                .collect()
        };
        for blk in self.data.chunks_exact(bb) {
            match self.fmt {
                WeightFormat::Q4_1 | WeightFormat::F32 => {
                    out.extend(blk.chunks_exact(4).map(word));
                }
                WeightFormat::Q8_0 => {
                    out.push(f16(&blk[0..2]).to_bits());
                    out.extend(blk[2..].chunks_exact(4).map(word));
                }
                WeightFormat::Q4K => {
                    for (scale, min, nib) in q4k_blocks(blk) {
                        out.extend([scale.to_bits(), min.to_bits()]);
                        out.extend(nibbles(&nib));
                    }
                }
                WeightFormat::Q6K => {
                    for ([s0, s1], q) in q6k_blocks(blk) {
                        out.extend([s0.to_bits(), s1.to_bits()]);
                        out.extend(bytes(&q));
                    }
                }
            }
        }
        out
    }

    /// Row `r` dequantized (host side, for checks).
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        let bb = self.fmt.gguf_block_bytes();
        let nb = self.cols / self.fmt.block_elems();
        let row = &self.data[r * nb * bb..(r + 1) * nb * bb];
        let mut out = Vec::with_capacity(self.cols);
        for blk in row.chunks_exact(bb) {
            match self.fmt {
                WeightFormat::Q4_1 => {
                    let (d, m) = (f16(&blk[0..2]), f16(&blk[2..4]));
                    let qs = &blk[4..20];
                    out.extend(qs.iter().map(|&b| (b & 15) as f32 * d + m));
                    out.extend(qs.iter().map(|&b| (b >> 4) as f32 * d + m));
                }
                WeightFormat::Q8_0 => {
                    let d = f16(&blk[0..2]);
                    out.extend(blk[2..].iter().map(|&b| b as i8 as f32 * d));
                }
                WeightFormat::Q4K => {
                    for (scale, min, nib) in q4k_blocks(blk) {
                        out.extend(nib.iter().map(|&q| f32::from(q) * scale + min));
                    }
                }
                WeightFormat::Q6K => {
                    for (s, q) in q6k_blocks(blk) {
                        out.extend(q.iter().enumerate().map(|(e, &v)| s[e / 16] * f32::from(v)));
                    }
                }
                WeightFormat::F32 => {
                    out.extend(
                        blk.chunks_exact(4)
                            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                    );
                }
            }
        }
        out
    }
}

/// Q5_0 blocks (f16 scale, 32 high bits, 16 bytes of low nibbles; value =
/// d * (q - 16)) as Q8_0 blocks (f16 scale, 32 i8 of q - 16): the same
/// values. `None` when `data` is not whole blocks.
fn q5_0_as_q8_0(data: &[u8]) -> Option<Vec<u8>> {
    if !data.len().is_multiple_of(22) {
        return None;
    }
    let mut out = Vec::with_capacity(data.len() / 22 * 34);
    for b in data.chunks_exact(22) {
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22];
        out.extend_from_slice(&b[0..2]);
        let mut q = [0u8; 32];
        for j in 0..16 {
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            q[j] = (((qs[j] & 0xf) as u32 | h0) as i32 - 16) as i8 as u8;
            q[j + 16] = (((qs[j] >> 4) as u32 | h1) as i32 - 16) as i8 as u8;
        }
        out.extend_from_slice(&q);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Q5_0 block widened to Q8_0 gives the values ggml's Q5_0
    /// definition gives, element by element.
    #[test]
    fn q5_0_widens_exactly() {
        let mut b = vec![0u8; 22];
        b[0..2].copy_from_slice(&half::f16::from_f32(0.125).to_le_bytes());
        let qh: u32 = 0xA5C3_0F96;
        b[2..6].copy_from_slice(&qh.to_le_bytes());
        for j in 0..16 {
            b[6 + j] = (j as u8).wrapping_mul(37) ^ 0x5a;
        }
        let m = HostMatrix::from_gguf(crate::gguf::GgmlType::Q5_0, 1, 32, &b).unwrap();
        let got = m.row_f32(0);
        for j in 0..16 {
            let lo = (b[6 + j] & 0xf) as u32 | (((qh >> j) & 1) << 4);
            let hi = (b[6 + j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
            assert_eq!(got[j], 0.125 * (lo as f32 - 16.0), "element {j}");
            assert_eq!(
                got[j + 16],
                0.125 * (hi as f32 - 16.0),
                "element {}",
                j + 16
            );
        }
        assert!(q5_0_as_q8_0(&b[..21]).is_none());
    }
}
