//! The GGUF container: header, metadata, tensor infos and the aligned data
//! section, read from a file held in memory.
//!
//! Layout (all little-endian): magic `"GGUF"`, `u32` version (2 or 3),
//! `u64` tensor count, `u64` metadata count, the metadata key/value pairs,
//! the tensor infos (name, `u32` dim count, `u64` dims with `ne0` -- the
//! innermost, contiguous dimension -- first, `u32` ggml type, `u64` offset
//! relative to the data section), padding up to `general.alignment`
//! (default 32), then the tensor data.
//!
//! Parsing is hardened: every count is checked against the bytes that
//! remain before anything is allocated from it, all arithmetic is checked,
//! and every tensor must lie, aligned and without overlapping another,
//! inside the file. Nothing here panics on any input; malformed files give
//! a [`GgufError`] that names the value and the limit it broke.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

/// The alignment of the data section and of tensor offsets when the file
/// does not set `general.alignment`.
pub const DEFAULT_ALIGNMENT: u32 = 32;

/// The most dimensions a ggml tensor has.
pub const MAX_DIMS: u32 = 4;

/// The deepest nesting of metadata arrays accepted (arrays of arrays ...).
pub const MAX_ARRAY_DEPTH: u32 = 16;

/// Everything that can go wrong reading a GGUF file or one of its values.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    #[error("cannot read GGUF file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("truncated GGUF: needed {need} bytes at offset {at}, but the file is {len} bytes")]
    Truncated { at: u64, need: u64, len: u64 },
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\" (47 47 55 46)")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {0} (supported: 2 and 3)")]
    UnsupportedVersion(u32),
    #[error("GGUF {what} count {count} at offset {at} cannot fit in the {remaining} bytes that remain (each needs at least {min_each} bytes)")]
    CountTooLarge {
        what: &'static str,
        count: u64,
        at: u64,
        remaining: u64,
        min_each: u64,
    },
    #[error("string at offset {at} is not valid UTF-8")]
    InvalidUtf8 { at: u64 },
    #[error("unknown metadata value type {ty} at offset {at} (known: 0..=12)")]
    UnknownValueType { ty: u32, at: u64 },
    #[error("invalid bool byte {value} at offset {at} (expected 0 or 1)")]
    InvalidBool { value: u8, at: u64 },
    #[error("metadata arrays nested deeper than {max} at offset {at}")]
    NestingTooDeep { at: u64, max: u32 },
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    #[error("tensor {name:?} has {n_dims} dimensions (at most {max})")]
    TooManyDims { name: String, n_dims: u32, max: u32 },
    #[error("tensor {name:?} dimensions {dims:?}: element count overflows (limit {limit})")]
    DimsOverflow {
        name: String,
        dims: Vec<u64>,
        limit: u64,
    },
    #[error("tensor {name:?} has unknown ggml type {ty}")]
    UnknownType { name: String, ty: u32 },
    #[error("tensor {name:?} of type {ty}: row length ne0 = {ne0} is not a multiple of the block size {block}")]
    NotBlockMultiple {
        name: String,
        ty: GgmlType,
        ne0: u64,
        block: u64,
    },
    #[error("general.alignment = {0} is not a power of two between 1 and 2^30")]
    BadAlignment(u64),
    #[error("tensor {name:?} offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned {
        name: String,
        offset: u64,
        alignment: u32,
    },
    #[error("tensor {name:?} data ends at byte {end} of the file, past its end ({len} bytes)")]
    TensorOutOfBounds { name: String, end: u64, len: u64 },
    #[error("tensors {first:?} (bytes {first_start}..{first_end} of the data section) and {second:?} (from byte {second_start}) overlap")]
    TensorOverlap {
        first: String,
        first_start: u64,
        first_end: u64,
        second: String,
        second_start: u64,
    },
    #[error("no tensor named {0:?}")]
    MissingTensor(String),
    #[error("no metadata key {0:?}")]
    MissingKey(String),
    #[error("metadata key {key:?} is {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("metadata key {key:?} value {value} is out of range for {target}")]
    OutOfRange {
        key: String,
        value: String,
        target: &'static str,
    },
    #[error("dequantisation of {ty} is not supported (supported: F32, Q8_0, Q4_1)")]
    UnsupportedDequant { ty: GgmlType },
    #[error("dequantising {ty}: {n} elements need {need} bytes, got {got} (and n must be a multiple of the block size {block})")]
    BadDequantLength {
        ty: GgmlType,
        n: usize,
        need: u64,
        got: usize,
        block: u64,
    },
    #[error("tensor {name:?} row {row} out of range ({rows} rows)")]
    RowOutOfRange { name: String, row: u64, rows: u64 },
}

/// A ggml tensor type, by its ggml type id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    IQ2XXS,
    IQ2XS,
    IQ3XXS,
    IQ1S,
    IQ4NL,
    IQ3S,
    IQ2S,
    IQ4XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    /// A type id this crate does not know (or one ggml has retired).
    Other(u32),
}

impl GgmlType {
    /// The type with ggml type id `id`.
    pub fn from_id(id: u32) -> GgmlType {
        use GgmlType::*;
        match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            16 => IQ2XXS,
            17 => IQ2XS,
            18 => IQ3XXS,
            19 => IQ1S,
            20 => IQ4NL,
            21 => IQ3S,
            22 => IQ2S,
            23 => IQ4XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1M,
            30 => BF16,
            34 => TQ1_0,
            35 => TQ2_0,
            39 => MXFP4,
            other => Other(other),
        }
    }

    /// The ggml type id.
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2K => 10,
            Q3K => 11,
            Q4K => 12,
            Q5K => 13,
            Q6K => 14,
            Q8K => 15,
            IQ2XXS => 16,
            IQ2XS => 17,
            IQ3XXS => 18,
            IQ1S => 19,
            IQ4NL => 20,
            IQ3S => 21,
            IQ2S => 22,
            IQ4XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
            Other(id) => id,
        }
    }

    /// `(elements per block, bytes per block)`, or `None` for
    /// [`GgmlType::Other`].
    pub fn block_layout(self) -> Option<(u64, u64)> {
        use GgmlType::*;
        Some(match self {
            F32 => (1, 4),
            F16 => (1, 2),
            BF16 => (1, 2),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2K => (256, 84),
            Q3K => (256, 110),
            Q4K => (256, 144),
            Q5K => (256, 176),
            Q6K => (256, 210),
            Q8K => (256, 292),
            IQ2XXS => (256, 66),
            IQ2XS => (256, 74),
            IQ3XXS => (256, 98),
            IQ1S => (256, 50),
            IQ4NL => (32, 18),
            IQ3S => (256, 110),
            IQ2S => (256, 82),
            IQ4XS => (256, 136),
            I8 => (1, 1),
            I16 => (1, 2),
            I32 => (1, 4),
            I64 => (1, 8),
            F64 => (1, 8),
            IQ1M => (256, 56),
            TQ1_0 => (256, 54),
            TQ2_0 => (256, 66),
            MXFP4 => (32, 17),
            Other(_) => return None,
        })
    }

    /// Elements per block (1 for plain types); `None` for `Other`.
    pub fn block_size(self) -> Option<u64> {
        self.block_layout().map(|(b, _)| b)
    }

    /// Bytes per block; `None` for `Other`.
    pub fn bytes_per_block(self) -> Option<u64> {
        self.block_layout().map(|(_, s)| s)
    }

    /// Whether [`dequant_row`] handles this type (F32, Q8_0, Q4_1).
    pub fn is_supported(self) -> bool {
        matches!(self, GgmlType::F32 | GgmlType::Q8_0 | GgmlType::Q4_1)
    }

    /// Bytes taken by `n` elements, `None` when `n` is not a whole number
    /// of blocks, the type is unknown, or the size overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let (block, size) = self.block_layout()?;
        if !n.is_multiple_of(block) {
            return None;
        }
        (n / block).checked_mul(size)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use GgmlType::*;
        let s = match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            IQ2XXS => "IQ2_XXS",
            IQ2XS => "IQ2_XS",
            IQ3XXS => "IQ3_XXS",
            IQ1S => "IQ1_S",
            IQ4NL => "IQ4_NL",
            IQ3S => "IQ3_S",
            IQ2S => "IQ2_S",
            IQ4XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
            Other(id) => return write!(f, "type#{id}"),
        };
        f.write_str(s)
    }
}

/// The type of a metadata value, by its GGUF id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    /// The value type with GGUF id `id`, if there is one.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The fewest bytes one value of this type takes in the file.
    fn min_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            String => 8,
            Array => 12,
        }
    }

    fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array, stored by element type.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Array {
    /// The element count.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn element_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::F32(_) => ValueType::F32,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F64(_) => ValueType::F64,
        }
    }
}

impl Value {
    /// The value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// A short description of the type, e.g. `u32` or `array of string`.
    pub fn type_name(&self) -> String {
        match self {
            Value::Array(a) => format!("array of {}", a.element_type().name()),
            v => v.value_type().name().to_string(),
        }
    }

    /// The value as an integer, when it is one.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }
}

/// One tensor's entry in the header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions, `ne0` (innermost, contiguous: the row length) first.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Element count (product of `dims`).
    pub n_elements: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Row length `ne0` (1 for a 0-dimensional tensor).
    pub fn ne0(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows: the product of every dimension after the first.
    pub fn n_rows(&self) -> u64 {
        self.dims
            .iter()
            .skip(1)
            .fold(1u64, |a, &d| a.saturating_mul(d))
    }

    /// Bytes in one row of `ne0` elements.
    pub fn row_bytes(&self) -> u64 {
        // Checked at parse time: ne0 is a block multiple and fits.
        self.ty.bytes_for(self.ne0()).unwrap_or(0)
    }
}

/// One tensor: its header entry and its bytes in the file.
#[derive(Debug, Clone, Copy)]
pub struct Tensor<'a> {
    pub info: &'a TensorInfo,
    pub data: &'a [u8],
}

impl<'a> Tensor<'a> {
    pub fn name(&self) -> &'a str {
        &self.info.name
    }

    pub fn dims(&self) -> &'a [u64] {
        &self.info.dims
    }

    pub fn ty(&self) -> GgmlType {
        self.info.ty
    }

    /// The bytes of row `row` (`ne0` elements).
    pub fn row_data(&self, row: u64) -> Result<&'a [u8], GgufError> {
        let rows = self.info.n_rows();
        if row >= rows {
            return Err(GgufError::RowOutOfRange {
                name: self.info.name.clone(),
                row,
                rows,
            });
        }
        let rb = self.info.row_bytes() as usize;
        let start = row as usize * rb;
        Ok(&self.data[start..start + rb])
    }

    /// Row `row` dequantised to f32 (F32, Q8_0 and Q4_1 only).
    pub fn dequant_row(&self, row: u64) -> Result<Vec<f32>, GgufError> {
        let data = self.row_data(row)?;
        let mut out = vec![0.0; self.info.ne0() as usize];
        dequant_row(self.info.ty, data, &mut out)?;
        Ok(out)
    }

    /// The whole tensor dequantised to f32 (F32, Q8_0 and Q4_1 only).
    pub fn to_f32(&self) -> Result<Vec<f32>, GgufError> {
        if !self.info.ty.is_supported() {
            return Err(GgufError::UnsupportedDequant { ty: self.info.ty });
        }
        let mut out = vec![0.0; self.info.n_elements as usize];
        dequant_row(self.info.ty, self.data, &mut out)?;
        Ok(out)
    }
}

/// Dequantises `out.len()` elements of type `ty` from `data` into `out`.
/// `out.len()` must be a whole number of blocks and `data` exactly their
/// size. Supported: F32, Q8_0 (f16 scale `d`, 32 × i8: `x = d·q`) and Q4_1
/// (f16 `d`, f16 `m`, 16 bytes of nibbles: low nibbles are elements 0..16,
/// high nibbles 16..32, `x = d·q + m`).
pub fn dequant_row(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), GgufError> {
    if !ty.is_supported() {
        return Err(GgufError::UnsupportedDequant { ty });
    }
    let (block, size) = ty.block_layout().unwrap_or((1, 1));
    let n = out.len();
    let need = ty.bytes_for(n as u64);
    if need != Some(data.len() as u64) {
        return Err(GgufError::BadDequantLength {
            ty,
            n,
            need: need.unwrap_or(u64::MAX),
            got: data.len(),
            block,
        });
    }
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out
                .chunks_exact_mut(32)
                .zip(data.chunks_exact(size as usize))
            {
                let d = f16(&b[0..2]);
                for (x, &q) in o.iter_mut().zip(&b[2..34]) {
                    *x = d * f32::from(q as i8);
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out
                .chunks_exact_mut(32)
                .zip(data.chunks_exact(size as usize))
            {
                let d = f16(&b[0..2]);
                let m = f16(&b[2..4]);
                let (lo, hi) = o.split_at_mut(16);
                for (j, &q) in b[4..20].iter().enumerate() {
                    lo[j] = d * f32::from(q & 0x0f) + m;
                    hi[j] = d * f32::from(q >> 4) + m;
                }
            }
        }
        _ => return Err(GgufError::UnsupportedDequant { ty }),
    }
    Ok(())
}

/// A parsed GGUF file, holding its bytes.
#[derive(Debug)]
pub struct Gguf {
    bytes: Vec<u8>,
    version: u32,
    alignment: u32,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

/// The file's alignment: `general.alignment` (a u32, a power of two up to
/// 2^30), or the default.
fn file_alignment(value: Option<&Value>) -> Result<u32, GgufError> {
    let a = match value {
        None => return Ok(DEFAULT_ALIGNMENT),
        Some(Value::U32(a)) => u64::from(*a),
        Some(other) => return Err(Gguf::wrong("general.alignment", "u32", other)),
    };
    if a == 0 || !a.is_power_of_two() || a > 1 << 30 {
        return Err(GgufError::BadAlignment(a));
    }
    Ok(a as u32)
}

/// Every tensor's bytes inside the file, and no two overlapping.
fn check_layout(tensors: &[TensorInfo], data_offset: u64, len: u64) -> Result<(), GgufError> {
    for t in tensors {
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.n_bytes));
        match end {
            Some(end) if end <= len => {}
            _ => {
                return Err(GgufError::TensorOutOfBounds {
                    name: t.name.clone(),
                    end: end.unwrap_or(u64::MAX),
                    len,
                })
            }
        }
    }

    // Sorted by offset, each tensor with data must start at or after
    // the furthest end seen so far (zero-sized tensors take no room).
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| (tensors[i].offset, tensors[i].n_bytes));
    let mut furthest: Option<usize> = None;
    for &i in &order {
        let t = &tensors[i];
        if t.n_bytes == 0 {
            continue;
        }
        if let Some(p) = furthest {
            let p = &tensors[p];
            // In bounds, so offset + n_bytes cannot overflow.
            let p_end = p.offset + p.n_bytes;
            if p_end > t.offset {
                return Err(GgufError::TensorOverlap {
                    first: p.name.clone(),
                    first_start: p.offset,
                    first_end: p_end,
                    second: t.name.clone(),
                    second_start: t.offset,
                });
            }
        }
        let t_end = t.offset + t.n_bytes;
        if furthest.is_none_or(|p| tensors[p].offset + tensors[p].n_bytes < t_end) {
            furthest = Some(i);
        }
    }
    Ok(())
}

/// A bounds-checked little-endian reader.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// One tensor info: its name, dims (at most MAX_DIMS, element count
    /// within i64), a known type whose blocks divide the first dim, and
    /// an offset on the file's alignment.
    fn tensor_info(&mut self, alignment: u32) -> Result<TensorInfo, GgufError> {
        let name = self.string()?;
        let n_dims = self.u32()?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                name,
                n_dims,
                max: MAX_DIMS,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64()?);
        }
        let ty_id = self.u32()?;
        let offset = self.u64()?;
        // Element counts stay within i64 as ggml requires.
        let limit = i64::MAX as u64;
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d).filter(|&n| n <= limit));
        let Some(n_elements) = n_elements else {
            return Err(GgufError::DimsOverflow { name, dims, limit });
        };
        let ty = GgmlType::from_id(ty_id);
        let Some((block, _)) = ty.block_layout() else {
            return Err(GgufError::UnknownType { name, ty: ty_id });
        };
        let ne0 = dims.first().copied().unwrap_or(1);
        if ne0 % block != 0 {
            return Err(GgufError::NotBlockMultiple {
                name,
                ty,
                ne0,
                block,
            });
        }
        let Some(n_bytes) = ty.bytes_for(n_elements) else {
            return Err(GgufError::DimsOverflow { name, dims, limit });
        };
        if offset % u64::from(alignment) != 0 {
            return Err(GgufError::Misaligned {
                name,
                offset,
                alignment,
            });
        }
        Ok(TensorInfo {
            name,
            dims,
            ty,
            offset,
            n_elements,
            n_bytes,
        })
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                at: self.pos as u64,
                need: n,
                len: self.bytes.len() as u64,
            });
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, GgufError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, GgufError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// Checks that `count` items of at least `min_each` bytes can fit in
    /// what remains, before anything is allocated for them.
    fn check_count(
        &self,
        what: &'static str,
        count: u64,
        min_each: u64,
        at: usize,
    ) -> Result<(), GgufError> {
        let fits = count
            .checked_mul(min_each)
            .is_some_and(|n| n <= self.remaining());
        if fits {
            Ok(())
        } else {
            Err(GgufError::CountTooLarge {
                what,
                count,
                at: at as u64,
                remaining: self.remaining(),
                min_each,
            })
        }
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let at = self.pos;
        let n = self.u64()?;
        let s = self.take(n)?;
        match std::str::from_utf8(s) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 { at: at as u64 }),
        }
    }

    fn value_type(&mut self) -> Result<ValueType, GgufError> {
        let at = self.pos as u64;
        let id = self.u32()?;
        ValueType::from_id(id).ok_or(GgufError::UnknownValueType { ty: id, at })
    }

    fn bool(&mut self) -> Result<bool, GgufError> {
        let at = self.pos as u64;
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(GgufError::InvalidBool { value, at }),
        }
    }

    fn value(&mut self, ty: ValueType, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.u8()?),
            ValueType::I8 => Value::I8(self.u8()? as i8),
            ValueType::U16 => Value::U16(self.u16()?),
            ValueType::I16 => Value::I16(self.u16()? as i16),
            ValueType::U32 => Value::U32(self.u32()?),
            ValueType::I32 => Value::I32(self.u32()? as i32),
            ValueType::F32 => Value::F32(f32::from_bits(self.u32()?)),
            ValueType::Bool => Value::Bool(self.bool()?),
            ValueType::String => Value::String(self.string()?),
            ValueType::Array => Value::Array(self.array_value(depth)?),
            ValueType::U64 => Value::U64(self.u64()?),
            ValueType::I64 => Value::I64(self.u64()? as i64),
            ValueType::F64 => Value::F64(f64::from_bits(self.u64()?)),
        })
    }

    fn array_value(&mut self, depth: u32) -> Result<Array, GgufError> {
        let at = self.pos;
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep {
                at: at as u64,
                max: MAX_ARRAY_DEPTH,
            });
        }
        let ety = self.value_type()?;
        let n = self.u64()?;
        self.check_count("array element", n, ety.min_size(), at)?;
        let n = n as usize;
        fn collect<T>(
            n: usize,
            mut f: impl FnMut() -> Result<T, GgufError>,
        ) -> Result<Vec<T>, GgufError> {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(f()?);
            }
            Ok(v)
        }
        Ok(match ety {
            ValueType::U8 => Array::U8(self.take(n as u64)?.to_vec()),
            ValueType::I8 => Array::I8(self.take(n as u64)?.iter().map(|&b| b as i8).collect()),
            ValueType::U16 => Array::U16(collect(n, || self.u16())?),
            ValueType::I16 => Array::I16(collect(n, || Ok(self.u16()? as i16))?),
            ValueType::U32 => Array::U32(collect(n, || self.u32())?),
            ValueType::I32 => Array::I32(collect(n, || Ok(self.u32()? as i32))?),
            ValueType::F32 => Array::F32(collect(n, || Ok(f32::from_bits(self.u32()?)))?),
            ValueType::Bool => Array::Bool(collect(n, || self.bool())?),
            ValueType::String => Array::String(collect(n, || self.string())?),
            ValueType::Array => Array::Array(collect(n, || self.array_value(depth + 1))?),
            ValueType::U64 => Array::U64(collect(n, || self.u64())?),
            ValueType::I64 => Array::I64(collect(n, || Ok(self.u64()? as i64))?),
            ValueType::F64 => Array::F64(collect(n, || Ok(f64::from_bits(self.u64()?)))?),
        })
    }
}

impl Gguf {
    /// Reads and parses the GGUF file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Gguf, GgufError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| GgufError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Gguf::parse(bytes)
    }

    /// Parses a whole GGUF file held in memory.
    pub fn parse(bytes: Vec<u8>) -> Result<Gguf, GgufError> {
        let mut r = Reader {
            bytes: &bytes,
            pos: 0,
        };
        let magic = r.array::<4>()?;
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = r.u32()?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        // A key/value pair takes at least 8 (key length) + 4 (type) + 1.
        r.check_count("metadata", n_kv, 13, 16)?;
        // A tensor info takes at least 8 (name length) + 4 + 4 + 8.
        r.check_count("tensor", n_tensors, 24, 16)?;

        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut meta_index = HashMap::with_capacity(n_kv as usize);
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.value_type()?;
            let value = r.value(ty, 0)?;
            if meta_index.contains_key(&key) {
                return Err(GgufError::DuplicateKey(key));
            }
            meta_index.insert(key.clone(), metadata.len());
            metadata.push((key, value));
        }

        let alignment =
            file_alignment(meta_index.get("general.alignment").map(|&i| &metadata[i].1))?;

        let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let t = r.tensor_info(alignment)?;
            if tensor_index.contains_key(&t.name) {
                return Err(GgufError::DuplicateTensor(t.name));
            }
            tensor_index.insert(t.name.clone(), tensors.len());
            tensors.push(t);
        }

        let header_end = r.pos as u64;
        let a = u64::from(alignment);
        // header_end < 2^63 and a <= 2^30: no overflow.
        let len = bytes.len() as u64;
        // A file without tensors may end before the padding (llama.cpp
        // reads such files): its empty data section starts at the end.
        // With tensors, the bounds check below refuses a short file. (The
        // gguf fuzz target found a header-only file whose data offset lay
        // past its end.)
        let data_offset =
            (header_end.div_ceil(a) * a).min(if tensors.is_empty() { len } else { u64::MAX });

        check_layout(&tensors, data_offset, len)?;

        Ok(Gguf {
            bytes,
            version,
            alignment,
            data_offset,
            metadata,
            meta_index,
            tensors,
            tensor_index,
        })
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of the data section and the tensor offsets.
    pub fn alignment(&self) -> u32 {
        self.alignment
    }

    /// Where the data section starts in the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The metadata pairs, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The tensor infos, in file order.
    pub fn tensor_infos(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The info of tensor `name`, if there is one.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// Tensor `name`: its info and its bytes.
    pub fn tensor(&self, name: &str) -> Result<Tensor<'_>, GgufError> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))?;
        // Checked in bounds at parse time.
        let start = (self.data_offset + info.offset) as usize;
        let data = &self.bytes[start..start + info.n_bytes as usize];
        Ok(Tensor { info, data })
    }

    /// The value of `key`, if there is one.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    fn wrong(key: &str, expected: &'static str, v: &Value) -> GgufError {
        GgufError::WrongType {
            key: key.to_string(),
            expected,
            found: v.type_name(),
        }
    }

    fn get_int(
        &self,
        key: &str,
        target: &'static str,
        min: i128,
        max: i128,
    ) -> Result<i128, GgufError> {
        let v = self.require(key)?;
        let i = v.as_i128().ok_or_else(|| Self::wrong(key, target, v))?;
        if i < min || i > max {
            return Err(GgufError::OutOfRange {
                key: key.to_string(),
                value: i.to_string(),
                target,
            });
        }
        Ok(i)
    }

    /// An integer value that fits a `u32` (stored as any integer type).
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        Ok(self.get_int(key, "u32", 0, u32::MAX.into())? as u32)
    }

    /// An integer value that fits a `u64` (stored as any integer type).
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        Ok(self.get_int(key, "u64", 0, u64::MAX.into())? as u64)
    }

    /// An integer value that fits an `i64` (stored as any integer type).
    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        Ok(self.get_int(key, "i64", i64::MIN.into(), i64::MAX.into())? as i64)
    }

    /// A float value (stored as f32 or f64).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        match self.require(key)? {
            Value::F32(f) => Ok(*f),
            Value::F64(f) => Ok(*f as f32),
            v => Err(Self::wrong(key, "f32", v)),
        }
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        match self.require(key)? {
            Value::Bool(b) => Ok(*b),
            v => Err(Self::wrong(key, "bool", v)),
        }
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            v => Err(Self::wrong(key, "string", v)),
        }
    }

    /// An array value of any element type.
    pub fn get_array(&self, key: &str) -> Result<&Array, GgufError> {
        match self.require(key)? {
            Value::Array(a) => Ok(a),
            v => Err(Self::wrong(key, "array", v)),
        }
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<&[String], GgufError> {
        match self.require(key)? {
            Value::Array(Array::String(v)) => Ok(v),
            v => Err(Self::wrong(key, "array of string", v)),
        }
    }

    /// An array of i32.
    pub fn get_i32_array(&self, key: &str) -> Result<&[i32], GgufError> {
        match self.require(key)? {
            Value::Array(Array::I32(v)) => Ok(v),
            v => Err(Self::wrong(key, "array of i32", v)),
        }
    }

    /// An array of f32.
    pub fn get_f32_array(&self, key: &str) -> Result<&[f32], GgufError> {
        match self.require(key)? {
            Value::Array(Array::F32(v)) => Ok(v),
            v => Err(Self::wrong(key, "array of f32", v)),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds GGUF files byte by byte for tests.
    #[derive(Default)]
    pub(crate) struct Builder {
        pub version: u32,
        pub kv: Vec<u8>,
        pub n_kv: u64,
        pub infos: Vec<u8>,
        pub n_tensors: u64,
        pub data: Vec<u8>,
        pub alignment: u64,
    }

    pub(crate) fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    impl Builder {
        pub fn new() -> Builder {
            Builder {
                version: 3,
                alignment: 32,
                ..Default::default()
            }
        }

        /// Adds a raw key/value: the value bytes are given already encoded.
        pub fn kv_raw(&mut self, key: &str, ty: u32, value: &[u8]) -> &mut Self {
            put_str(&mut self.kv, key);
            self.kv.extend_from_slice(&ty.to_le_bytes());
            self.kv.extend_from_slice(value);
            self.n_kv += 1;
            self
        }

        pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
            self.kv_raw(key, 4, &v.to_le_bytes())
        }

        pub fn kv_f32(&mut self, key: &str, v: f32) -> &mut Self {
            self.kv_raw(key, 6, &v.to_le_bytes())
        }

        pub fn kv_bool(&mut self, key: &str, v: bool) -> &mut Self {
            self.kv_raw(key, 7, &[v as u8])
        }

        pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
            let mut b = Vec::new();
            put_str(&mut b, v);
            self.kv_raw(key, 8, &b)
        }

        pub fn kv_str_array(&mut self, key: &str, v: &[&str]) -> &mut Self {
            let mut b = Vec::new();
            b.extend_from_slice(&8u32.to_le_bytes());
            b.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for s in v {
                put_str(&mut b, s);
            }
            self.kv_raw(key, 9, &b)
        }

        pub fn kv_i32_array(&mut self, key: &str, v: &[i32]) -> &mut Self {
            let mut b = Vec::new();
            b.extend_from_slice(&5u32.to_le_bytes());
            b.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for x in v {
                b.extend_from_slice(&x.to_le_bytes());
            }
            self.kv_raw(key, 9, &b)
        }

        /// Adds a tensor info with an explicit offset (no data written).
        pub fn tensor_info(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
            put_str(&mut self.infos, name);
            self.infos
                .extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                self.infos.extend_from_slice(&d.to_le_bytes());
            }
            self.infos.extend_from_slice(&ty.to_le_bytes());
            self.infos.extend_from_slice(&offset.to_le_bytes());
            self.n_tensors += 1;
            self
        }

        /// Adds a tensor and its data at the next aligned offset.
        pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: &[u8]) -> &mut Self {
            let a = self.alignment as usize;
            while !self.data.len().is_multiple_of(a) {
                self.data.push(0);
            }
            let off = self.data.len() as u64;
            self.data.extend_from_slice(data);
            self.tensor_info(name, dims, ty, off)
        }

        pub fn build(&self) -> Vec<u8> {
            let mut out = Vec::new();
            out.extend_from_slice(b"GGUF");
            out.extend_from_slice(&self.version.to_le_bytes());
            out.extend_from_slice(&self.n_tensors.to_le_bytes());
            out.extend_from_slice(&self.n_kv.to_le_bytes());
            out.extend_from_slice(&self.kv);
            out.extend_from_slice(&self.infos);
            let a = self.alignment as usize;
            while out.len() % a != 0 {
                out.push(0);
            }
            out.extend_from_slice(&self.data);
            out
        }
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn q8_0_block(d: f32, q: &[i8; 32]) -> Vec<u8> {
        let mut b = half::f16::from_f32(d).to_le_bytes().to_vec();
        b.extend(q.iter().map(|&x| x as u8));
        b
    }

    fn q4_1_block(d: f32, m: f32, q: &[u8; 32]) -> Vec<u8> {
        let mut b = half::f16::from_f32(d).to_le_bytes().to_vec();
        b.extend_from_slice(&half::f16::from_f32(m).to_le_bytes());
        for j in 0..16 {
            b.push(q[j] | (q[j + 16] << 4));
        }
        b
    }

    /// A small valid file with every value type and three tensor types.
    pub(crate) fn sample() -> Vec<u8> {
        let mut b = Builder::new();
        b.kv_str("general.architecture", "llama")
            .kv_raw("u8", 0, &[200])
            .kv_raw("i8", 1, &[0xff])
            .kv_raw("u16", 2, &513u16.to_le_bytes())
            .kv_raw("i16", 3, &(-2i16).to_le_bytes())
            .kv_u32("u32", 70000)
            .kv_raw("i32", 5, &(-5i32).to_le_bytes())
            .kv_f32("f32", 1.5)
            .kv_bool("bool", true)
            .kv_raw("u64", 10, &(1u64 << 40).to_le_bytes())
            .kv_raw("i64", 11, &(-7i64).to_le_bytes())
            .kv_raw("f64", 12, &2.25f64.to_le_bytes())
            .kv_str_array("strs", &["a", "bc", ""])
            .kv_i32_array("ints", &[1, -2, 3]);
        // Nested: array of 2 arrays of u8.
        let mut nested = Vec::new();
        nested.extend_from_slice(&9u32.to_le_bytes());
        nested.extend_from_slice(&2u64.to_le_bytes());
        for inner in [&[1u8, 2][..], &[3u8][..]] {
            nested.extend_from_slice(&0u32.to_le_bytes());
            nested.extend_from_slice(&(inner.len() as u64).to_le_bytes());
            nested.extend_from_slice(inner);
        }
        b.kv_raw("nested", 9, &nested);
        let w: Vec<f32> = (0..8).map(|i| i as f32 * 0.5).collect();
        b.tensor("norm", &[8], 0, &f32_bytes(&w));
        let mut q = [0i8; 32];
        for (i, x) in q.iter_mut().enumerate() {
            *x = i as i8 - 16;
        }
        let mut q8 = q8_0_block(0.5, &q);
        q8.extend(q8_0_block(-1.0, &q));
        b.tensor("emb", &[32, 2], 8, &q8);
        let mut n = [0u8; 32];
        for (i, x) in n.iter_mut().enumerate() {
            *x = (i % 16) as u8;
        }
        b.tensor("w", &[32, 1], 3, &q4_1_block(0.25, -1.0, &n));
        b.build()
    }

    #[test]
    fn round_trip() {
        let g = Gguf::parse(sample()).unwrap();
        assert_eq!(g.version(), 3);
        assert_eq!(g.alignment(), 32);
        assert_eq!(g.data_offset() % 32, 0);
        assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(g.get("u8"), Some(&Value::U8(200)));
        assert_eq!(g.get("i8"), Some(&Value::I8(-1)));
        assert_eq!(g.get("u16"), Some(&Value::U16(513)));
        assert_eq!(g.get("i16"), Some(&Value::I16(-2)));
        assert_eq!(g.get_u32("u32").unwrap(), 70000);
        assert_eq!(g.get_u32("u8").unwrap(), 200);
        assert_eq!(g.get_i64("i32").unwrap(), -5);
        assert_eq!(g.get_f32("f32").unwrap(), 1.5);
        assert!(g.get_bool("bool").unwrap());
        assert_eq!(g.get_u64("u64").unwrap(), 1 << 40);
        assert_eq!(g.get_i64("i64").unwrap(), -7);
        assert_eq!(g.get_f32("f64").unwrap(), 2.25);
        assert_eq!(g.get_str_array("strs").unwrap(), &["a", "bc", ""]);
        assert_eq!(g.get_i32_array("ints").unwrap(), &[1, -2, 3]);
        assert_eq!(
            g.get_array("nested").unwrap(),
            &Array::Array(vec![Array::U8(vec![1, 2]), Array::U8(vec![3])])
        );
        assert_eq!(g.metadata().len(), 15);

        let norm = g.tensor("norm").unwrap();
        assert_eq!(norm.ty(), GgmlType::F32);
        assert_eq!(norm.dims(), &[8]);
        assert_eq!(norm.to_f32().unwrap()[3], 1.5);

        let emb = g.tensor("emb").unwrap();
        assert_eq!(emb.ty(), GgmlType::Q8_0);
        assert_eq!(emb.info.n_rows(), 2);
        assert_eq!(emb.data.len(), 68);
        let r0 = emb.dequant_row(0).unwrap();
        let r1 = emb.dequant_row(1).unwrap();
        assert_eq!(r0[0], -8.0);
        assert_eq!(r0[31], 7.5);
        assert_eq!(r1[0], 16.0);
        assert!(matches!(
            emb.dequant_row(2),
            Err(GgufError::RowOutOfRange {
                row: 2,
                rows: 2,
                ..
            })
        ));

        let w = g.tensor("w").unwrap();
        assert_eq!(w.ty(), GgmlType::Q4_1);
        let r = w.dequant_row(0).unwrap();
        for (i, x) in r.iter().enumerate() {
            assert_eq!(*x, 0.25 * (i % 16) as f32 - 1.0, "element {i}");
        }
        assert!(matches!(g.tensor("nope"), Err(GgufError::MissingTensor(_))));
    }

    #[test]
    fn getter_errors() {
        let g = Gguf::parse(sample()).unwrap();
        assert!(matches!(g.get_u32("missing"), Err(GgufError::MissingKey(k)) if k == "missing"));
        let e = g.get_u32("general.architecture").unwrap_err();
        assert!(
            matches!(
                e,
                GgufError::WrongType {
                    expected: "u32",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("string"), "{e}");
        assert!(matches!(
            g.get_u32("i32"),
            Err(GgufError::OutOfRange { .. })
        ));
        assert!(matches!(
            g.get_u32("u64"),
            Err(GgufError::OutOfRange { .. })
        ));
        assert!(matches!(g.get_str("u32"), Err(GgufError::WrongType { .. })));
        assert!(matches!(
            g.get_str_array("ints"),
            Err(GgufError::WrongType { .. })
        ));
        assert!(matches!(
            g.get_i32_array("strs"),
            Err(GgufError::WrongType { .. })
        ));
        assert!(matches!(
            g.get_f32_array("strs"),
            Err(GgufError::WrongType { .. })
        ));
        assert!(matches!(g.get_f32("u32"), Err(GgufError::WrongType { .. })));
        assert!(matches!(g.get_bool("u8"), Err(GgufError::WrongType { .. })));
    }

    #[test]
    fn dequant_errors() {
        let mut out = vec![0.0; 32];
        assert!(matches!(
            dequant_row(GgmlType::Q4K, &[0; 144], &mut out),
            Err(GgufError::UnsupportedDequant { .. })
        ));
        assert!(matches!(
            dequant_row(GgmlType::Q4_1, &[0; 19], &mut out),
            Err(GgufError::BadDequantLength { .. })
        ));
        let mut out = vec![0.0; 31];
        assert!(matches!(
            dequant_row(GgmlType::Q8_0, &[0; 34], &mut out),
            Err(GgufError::BadDequantLength { .. })
        ));
    }

    #[test]
    fn types() {
        for id in 0..64 {
            let t = GgmlType::from_id(id);
            assert_eq!(t.id(), id);
            assert_eq!(GgmlType::from_id(t.id()), t);
        }
        assert_eq!(GgmlType::from_id(0), GgmlType::F32);
        assert_eq!(GgmlType::from_id(1), GgmlType::F16);
        assert_eq!(GgmlType::from_id(2), GgmlType::Q4_0);
        assert_eq!(GgmlType::from_id(3), GgmlType::Q4_1);
        assert_eq!(GgmlType::from_id(8), GgmlType::Q8_0);
        assert_eq!(GgmlType::from_id(30), GgmlType::BF16);
        assert_eq!(GgmlType::from_id(4), GgmlType::Other(4));
        assert_eq!(GgmlType::Q4_1.block_layout(), Some((32, 20)));
        assert_eq!(GgmlType::Q8_0.block_layout(), Some((32, 34)));
        assert_eq!(GgmlType::Q4_0.block_layout(), Some((32, 18)));
        assert_eq!(GgmlType::BF16.block_layout(), Some((1, 2)));
        assert_eq!(GgmlType::Other(4).block_layout(), None);
        assert_eq!(GgmlType::Q4K.to_string(), "Q4_K");
        assert_eq!(GgmlType::Other(99).to_string(), "type#99");
    }

    fn err(bytes: Vec<u8>) -> GgufError {
        Gguf::parse(bytes).expect_err("expected an error")
    }

    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&version.to_le_bytes());
        b.extend_from_slice(&n_tensors.to_le_bytes());
        b.extend_from_slice(&n_kv.to_le_bytes());
        b
    }

    #[test]
    fn header_errors() {
        assert!(matches!(
            err(vec![]),
            GgufError::Truncated {
                at: 0,
                need: 4,
                len: 0
            }
        ));
        assert!(matches!(
            err(b"GGUF\x03\0".to_vec()),
            GgufError::Truncated {
                at: 4,
                need: 4,
                len: 6
            }
        ));
        assert!(
            matches!(err(b"GGML\x03\0\0\0".to_vec()), GgufError::BadMagic { found } if &found == b"GGML")
        );
        assert!(matches!(
            err(header(1, 0, 0)),
            GgufError::UnsupportedVersion(1)
        ));
        assert!(matches!(
            err(header(4, 0, 0)),
            GgufError::UnsupportedVersion(4)
        ));
        assert!(matches!(
            err(header(3 << 24, 0, 0)),
            GgufError::UnsupportedVersion(_)
        ));
        // Version 2 and an empty file are fine.
        let g = Gguf::parse(header(2, 0, 0)).unwrap();
        assert_eq!(g.version(), 2);
        assert!(g.tensor_infos().is_empty());
    }

    #[test]
    fn absurd_counts() {
        let e = err(header(3, 1 << 60, 0));
        assert!(
            matches!(e, GgufError::CountTooLarge { what: "tensor", count, .. } if count == 1 << 60),
            "{e}"
        );
        assert!(e.to_string().contains("1152921504606846976"), "{e}");
        let e = err(header(3, 0, u64::MAX));
        assert!(
            matches!(
                e,
                GgufError::CountTooLarge {
                    what: "metadata",
                    ..
                }
            ),
            "{e}"
        );

        // A string length past the end of the file.
        let mut b = header(3, 0, 1);
        b.extend_from_slice(&(1u64 << 62).to_le_bytes());
        b.extend_from_slice(b"abcdefghijklmnop");
        assert!(matches!(err(b), GgufError::Truncated { need, .. } if need == 1 << 62));

        // An array element count past the end of the file.
        let mut v = Vec::new();
        v.extend_from_slice(&4u32.to_le_bytes());
        v.extend_from_slice(&(1u64 << 61).to_le_bytes());
        let mut b = Builder::new();
        b.kv_raw("a", 9, &v);
        let e = err(b.build());
        assert!(
            matches!(
                e,
                GgufError::CountTooLarge {
                    what: "array element",
                    ..
                }
            ),
            "{e}"
        );

        // Arrays of strings each claiming 2^63 bytes.
        let mut v = Vec::new();
        v.extend_from_slice(&8u32.to_le_bytes());
        v.extend_from_slice(&2u64.to_le_bytes());
        v.extend_from_slice(&(1u64 << 63).to_le_bytes());
        v.extend_from_slice(&(1u64 << 63).to_le_bytes());
        let mut b = Builder::new();
        b.kv_raw("a", 9, &v);
        assert!(matches!(err(b.build()), GgufError::Truncated { .. }));
    }

    #[test]
    fn value_errors() {
        let mut b = Builder::new();
        b.kv_raw("k", 13, &[0; 8]);
        assert!(matches!(
            err(b.build()),
            GgufError::UnknownValueType { ty: 13, .. }
        ));
        let mut b = Builder::new();
        b.kv_raw("k", 7, &[2]);
        assert!(matches!(
            err(b.build()),
            GgufError::InvalidBool { value: 2, .. }
        ));
        let mut b = Builder::new();
        b.kv_raw("k", 8, &[2, 0, 0, 0, 0, 0, 0, 0, 0xc3, 0x28]);
        assert!(matches!(err(b.build()), GgufError::InvalidUtf8 { .. }));
        let mut b = Builder::new();
        b.kv_u32("k", 1).kv_u32("k", 2);
        assert!(matches!(err(b.build()), GgufError::DuplicateKey(k) if k == "k"));

        // Nesting deeper than the limit.
        let mut v = Vec::new();
        for _ in 0..MAX_ARRAY_DEPTH + 5 {
            v.extend_from_slice(&9u32.to_le_bytes());
            v.extend_from_slice(&1u64.to_le_bytes());
        }
        v.extend_from_slice(&0u32.to_le_bytes());
        v.extend_from_slice(&0u64.to_le_bytes());
        let mut b = Builder::new();
        b.kv_raw("deep", 9, &v);
        assert!(matches!(err(b.build()), GgufError::NestingTooDeep { .. }));

        // Alignment.
        let mut b = Builder::new();
        b.kv_u32("general.alignment", 24);
        assert!(matches!(err(b.build()), GgufError::BadAlignment(24)));
        let mut b = Builder::new();
        b.kv_u32("general.alignment", 0);
        assert!(matches!(err(b.build()), GgufError::BadAlignment(0)));
        let mut b = Builder::new();
        b.kv_str("general.alignment", "32");
        assert!(matches!(err(b.build()), GgufError::WrongType { .. }));
        let mut b = Builder::new();
        b.alignment = 64;
        b.kv_u32("general.alignment", 64);
        b.tensor("t", &[4], 0, &[0; 16]);
        b.tensor("u", &[4], 0, &[0; 16]);
        let g = Gguf::parse(b.build()).unwrap();
        assert_eq!(g.alignment(), 64);
        assert_eq!(g.data_offset() % 64, 0);
        assert_eq!(g.tensor_info("u").unwrap().offset, 64);
    }

    #[test]
    fn tensor_errors() {
        let mut b = Builder::new();
        b.tensor_info("t", &[1, 1, 1, 1, 1], 0, 0);
        assert!(matches!(
            err(b.build()),
            GgufError::TooManyDims { n_dims: 5, .. }
        ));

        let mut b = Builder::new();
        b.tensor_info("t", &[1 << 32, 1 << 32], 0, 0);
        let e = err(b.build());
        assert!(
            matches!(&e, GgufError::DimsOverflow { name, .. } if name == "t"),
            "{e}"
        );
        // Element count fits but the byte size does not.
        let mut b = Builder::new();
        b.tensor_info("t", &[1 << 62], 0, 0);
        assert!(matches!(err(b.build()), GgufError::DimsOverflow { .. }));

        let mut b = Builder::new();
        b.tensor_info("t", &[32], 4, 0);
        assert!(matches!(
            err(b.build()),
            GgufError::UnknownType { ty: 4, .. }
        ));
        let mut b = Builder::new();
        b.tensor_info("t", &[32], 1000, 0);
        assert!(matches!(
            err(b.build()),
            GgufError::UnknownType { ty: 1000, .. }
        ));

        let mut b = Builder::new();
        b.tensor("t", &[48, 1], 3, &[0; 40]);
        let e = err(b.build());
        assert!(
            matches!(
                e,
                GgufError::NotBlockMultiple {
                    ne0: 48,
                    block: 32,
                    ..
                }
            ),
            "{e}"
        );

        let mut b = Builder::new();
        b.tensor("t", &[8], 0, &[0; 32]);
        b.tensor_info("u", &[8], 0, 16);
        assert!(matches!(
            err(b.build()),
            GgufError::Misaligned {
                offset: 16,
                alignment: 32,
                ..
            }
        ));

        let mut b = Builder::new();
        b.tensor("t", &[16], 0, &[0; 64]);
        b.tensor_info("u", &[8], 0, 32);
        let e = err(b.build());
        assert!(matches!(e, GgufError::TensorOverlap { .. }), "{e}");

        let mut b = Builder::new();
        b.tensor("t", &[16], 0, &[0; 64]);
        b.tensor_info("u", &[8], 0, 0);
        assert!(matches!(err(b.build()), GgufError::TensorOverlap { .. }));

        // A zero-sized tensor between two overlapping ones hides nothing.
        let mut b = Builder::new();
        b.tensor("t", &[32], 0, &[0; 128]);
        b.tensor_info("z", &[0], 0, 32);
        b.tensor_info("u", &[8], 0, 64);
        assert!(matches!(err(b.build()), GgufError::TensorOverlap { .. }));

        let mut b = Builder::new();
        b.tensor("t", &[8], 0, &[0; 16]);
        let e = err(b.build());
        assert!(
            matches!(&e, GgufError::TensorOutOfBounds { name, .. } if name == "t"),
            "{e}"
        );

        let mut b = Builder::new();
        b.tensor_info("t", &[8], 0, u64::MAX - 31);
        assert!(matches!(
            err(b.build()),
            GgufError::TensorOutOfBounds { .. }
        ));

        let mut b = Builder::new();
        b.tensor("t", &[8], 0, &[0; 32]);
        b.tensor("t", &[8], 0, &[0; 32]);
        assert!(matches!(err(b.build()), GgufError::DuplicateTensor(n) if n == "t"));

        // Zero-sized tensors may share an offset.
        let mut b = Builder::new();
        b.tensor_info("z", &[0], 0, 0);
        b.tensor("t", &[8], 0, &[0; 32]);
        let g = Gguf::parse(b.build()).unwrap();
        assert!(g.tensor("z").unwrap().data.is_empty());
    }

    /// xorshift64*, seeded: deterministic without a dependency.
    pub(crate) struct Rng(pub u64);
    impl Rng {
        pub fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        pub fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    #[test]
    fn truncation_never_panics() {
        let full = sample();
        assert!(Gguf::parse(full.clone()).is_ok());
        // Every length short of the last tensor's end is an error.
        let g = Gguf::parse(full.clone()).unwrap();
        let need = g
            .tensor_infos()
            .iter()
            .map(|t| g.data_offset() + t.offset + t.n_bytes)
            .max()
            .unwrap();
        for len in 0..full.len() {
            let r = Gguf::parse(full[..len].to_vec());
            assert_eq!(r.is_ok(), len as u64 >= need, "length {len}");
        }
    }

    #[test]
    fn corruption_never_panics() {
        let full = sample();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut ok = 0;
        // GGUF_FUZZ_CASES=N runs more.
        let cases: u64 = std::env::var("GGUF_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4000);
        for case in 0..cases {
            let mut b = full.clone();
            let flips = 1 + rng.below(4);
            for _ in 0..flips {
                // Mostly the header, where the structure is.
                let span = if case % 4 == 0 {
                    b.len()
                } else {
                    g_header_len(&full)
                };
                let i = rng.below(span as u64) as usize;
                match rng.below(3) {
                    0 => b[i] ^= 1 << rng.below(8),
                    1 => b[i] = rng.next() as u8,
                    _ => b[i] = [0x00, 0xff, 0x7f, 0x80][rng.below(4) as usize],
                }
            }
            if case % 7 == 0 {
                let cut = rng.below(b.len() as u64 + 1) as usize;
                b.truncate(cut);
            }
            if let Ok(g) = Gguf::parse(b) {
                ok += 1;
                // Whatever parsed must be usable without panics.
                for t in g.tensor_infos() {
                    let t = g.tensor(&t.name).unwrap();
                    if t.ty().is_supported() && t.info.n_rows() > 0 {
                        let _ = t.dequant_row(0);
                    }
                }
            }
        }
        // Some flips (inside values or the data) leave a valid file.
        assert!(ok > 0);
    }

    fn g_header_len(full: &[u8]) -> usize {
        Gguf::parse(full.to_vec()).unwrap().data_offset() as usize
    }
}
