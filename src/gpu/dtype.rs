//! Element types: of the pool ([`KvDtype`]) and of the activations an
//! engine hands over and receives ([`ActDtype`]). The layer below
//! everything: shapes, errors and kernels name them.

/// Element type of the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 32-bit floats.
    F32,
    /// IEEE half floats packed two per `u32` (read with `unpack2x16float`,
    /// so no `shader-f16` feature is needed).
    F16,
    /// bfloat16 (an f32's high 16 bits: f32's range, 8 bits of mantissa),
    /// packed two per `u32`: read by a shift, written rounded to nearest
    /// (ties to even) on the GPU. The native dtype of most checkpoints.
    Bf16,
    /// Symmetric int8, four per `u32`, with one scale per (token, KV head)
    /// in the row's side word after the layer's blocks: `write_kv`
    /// quantizes on the GPU (scale = the row's largest |x|, rounded up to
    /// bf16, / 127; round to nearest), the kernels dequantize as they read.
    /// K may be smoothed per channel ([`KvCache::set_k_smoothing`](super::KvCache::set_k_smoothing)) and up
    /// to [`K_OUTLIERS`](super::K_OUTLIERS) channels per KV head kept to about 12 bits
    /// ([`KvCache::set_k_outlier_channels`](super::KvCache::set_k_outlier_channels)). Needs no `shader-f16` or int8
    /// feature (`pack4x8snorm` / `unpack4x8snorm`).
    Int8,
    /// FP8 E4M3 (bias 7, no infinities, max 448), four per `u32`, with one
    /// f32 scale per (layer, KV head) set by the engine
    /// ([`KvCache::set_fp8_scales`](super::KvCache::set_fp8_scales); 1.0 until then), and up to
    /// [`K_OUTLIERS`](super::K_OUTLIERS) K channels per KV head kept to 7 mantissa bits
    /// ([`KvCache::set_k_outlier_channels`](super::KvCache::set_k_outlier_channels)). Encoded and decoded
    /// with bit operations; values past +-448 x scale saturate, non-finite
    /// inputs are stored as 0: never NaN.
    Fp8E4M3,
}

/// How a host mirror ([`HostPool`](crate::reference::HostPool)) stores a
/// value written to a pool of this dtype: f16 rounded, as the packed pool
/// holds it; the quantized pools' exact inputs (their rounding is what
/// their tolerances bound).
impl From<KvDtype> for crate::reference::Stored {
    fn from(d: KvDtype) -> Self {
        match d {
            KvDtype::F16 => crate::reference::Stored::F16,
            KvDtype::Bf16 => crate::reference::Stored::Bf16,
            KvDtype::F32 | KvDtype::Int8 | KvDtype::Fp8E4M3 => crate::reference::Stored::Exact,
        }
    }
}

impl KvDtype {
    /// Every dtype, in the order the CLI and the bench list them.
    pub const ALL: [KvDtype; 5] = [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Bf16,
        KvDtype::Int8,
        KvDtype::Fp8E4M3,
    ];

    /// The dtype of a [`name`](Self::name).
    pub fn from_name(name: &str) -> Option<KvDtype> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bytes per element (scales not included).
    pub fn bytes(self) -> u64 {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::Int8 | KvDtype::Fp8E4M3 => 1,
        }
    }

    /// Whether values are stored quantized with scales.
    pub fn quantized(self) -> bool {
        matches!(self, KvDtype::Int8 | KvDtype::Fp8E4M3)
    }

    /// The name used by the command line and the bench.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Int8 => "int8",
            KvDtype::Fp8E4M3 => "fp8",
        }
    }
}

/// Element type of the activations an engine hands over (Q, new K/V) and
/// receives (attention output).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ActDtype {
    /// 32-bit floats.
    #[default]
    F32,
    /// IEEE half floats: the bytes of an `f16` array. Read and written as
    /// pairs packed in `u32` (`unpack2x16float`), so no `shader-f16`
    /// feature is needed; accumulation stays f32.
    F16,
    /// bfloat16 (most checkpoints' native type): the bytes of a `bf16`
    /// array, packed two per `u32`, widened by a shift and written
    /// rounded to nearest (ties to even); accumulation stays f32.
    Bf16,
}

impl ActDtype {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            ActDtype::F32 => 4,
            ActDtype::F16 | ActDtype::Bf16 => 2,
        }
    }

    /// The lowercase name (`f32`, `f16`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            ActDtype::F32 => "f32",
            ActDtype::F16 => "f16",
            ActDtype::Bf16 => "bf16",
        }
    }
}
