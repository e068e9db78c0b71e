//! WGSL sources and their specialisation: the shapes kernels are compiled
//! at ([`ShaderShape`], [`MlaShape`], the pipeline cache's key) and the
//! composition every kernel shares.
//!
//! Each kernel is `shaders/<kernel>.wgsl`, with the shared structs of
//! `shaders/common.wgsl`. Shapes that set loop trip counts and workgroup
//! array sizes (head_dim, GQA group, block size, KV element type) are baked
//! in by a generated prelude, so loops have constant bounds the compiler can
//! unroll, and a pipeline exists per shape actually used. This file knows
//! no kernel in particular: what a kernel adds to [`compose`] (its
//! generated code, its pool view) comes from its module, through
//! `kernels::source`.

use super::dtype::{ActDtype, KvDtype};

/// The common structs and helpers.
pub const COMMON: &str = include_str!("../../shaders/common.wgsl");

/// Every kernel the library compiles, as a typed entry of [`REGISTRY`]:
/// code names a kernel by this, never by a string. Adding a kernel takes
/// its `.wgsl` file (whose `//#import` lines say what it uses), its module
/// (a decode kernel's in `kernels/`), a variant here and its line in
/// [`REGISTRY`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Shader {
    /// New tokens' K and V into their slots (plain pools).
    WriteKv,
    /// New tokens' K and V into their slots (quantized pools).
    WriteKvQ,
    /// A copy-on-write list (plain pools).
    CopyBlocks,
    /// A copy-on-write list (quantized pools).
    CopyBlocksQ,
    /// The tiled decode kernel, and prefill for every decode kernel.
    Attention,
    /// The lanes decode kernel.
    AttentionLanes,
    /// The stream decode kernel.
    AttentionStream,
    /// The serial decode kernel (software adapters).
    AttentionSerial,
    /// The cascade's segment pass on GPUs.
    AttentionRows,
    /// The split-K merge.
    Reduce,
    /// MLA decode and prefill.
    MlaDecode,
    /// MLA's split-K merge.
    MlaMerge,
    /// New latent rows into their slots.
    MlaWrite,
    /// MLA's copy-on-write list.
    MlaCopy,
}

/// Which shape a kernel is compiled at, which constants it imports, and
/// so which pipeline key it is cached by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// [`ShaderShape`], the `constants` import (`shaders/*.wgsl`).
    Attention,
    /// [`MlaShape`], the `mla_constants` import (`shaders/mla/*.wgsl`).
    Mla,
}

/// A kernel's entry: its name (the pipeline's label, its file's stem), its
/// file, its family and the pools it serves.
#[derive(Clone, Copy, Debug)]
pub struct ShaderEntry {
    /// The kernel.
    pub shader: Shader,
    /// Its name: the pipeline's label, and its file under `shaders/`.
    pub name: &'static str,
    /// Its file's text (`//#import` lines first).
    pub text: &'static str,
    /// Its shape and constants.
    pub family: Family,
    /// The pools it serves: `Some(true)` quantized only, `Some(false)`
    /// plain only, `None` every pool.
    pub quantized: Option<bool>,
}

macro_rules! entry {
    ($shader:ident, $name:literal, $file:literal, $family:ident, $q:expr) => {
        ShaderEntry {
            shader: Shader::$shader,
            name: $name,
            text: include_str!(concat!("../../shaders/", $file, ".wgsl")),
            family: Family::$family,
            quantized: $q,
        }
    };
}

/// Every kernel, in [`Shader`]'s order: one line each.
pub const REGISTRY: [ShaderEntry; 14] = [
    entry!(WriteKv, "write_kv", "write_kv", Attention, Some(false)),
    entry!(WriteKvQ, "write_kv_q", "write_kv_q", Attention, Some(true)),
    entry!(
        CopyBlocks,
        "copy_blocks",
        "copy_blocks",
        Attention,
        Some(false)
    ),
    entry!(
        CopyBlocksQ,
        "copy_blocks_q",
        "copy_blocks_q",
        Attention,
        Some(true)
    ),
    entry!(Attention, "attention", "attention", Attention, None),
    entry!(
        AttentionLanes,
        "attention_lanes",
        "attention_lanes",
        Attention,
        None
    ),
    entry!(
        AttentionStream,
        "attention_stream",
        "attention_stream",
        Attention,
        None
    ),
    entry!(
        AttentionSerial,
        "attention_serial",
        "attention_serial",
        Attention,
        None
    ),
    entry!(
        AttentionRows,
        "attention_rows",
        "attention_rows",
        Attention,
        None
    ),
    entry!(Reduce, "reduce", "reduce", Attention, None),
    entry!(MlaDecode, "mla_decode", "mla/decode", Mla, None),
    entry!(MlaMerge, "mla_merge", "mla/merge", Mla, None),
    entry!(MlaWrite, "mla_write", "mla/write", Mla, None),
    entry!(MlaCopy, "mla_copy", "mla/copy", Mla, None),
];

impl std::fmt::Display for Shader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Shader {
    /// Every kernel.
    pub const ALL: [Shader; 14] = {
        let mut all = [Shader::WriteKv; 14];
        let mut i = 0;
        while i < 14 {
            all[i] = REGISTRY[i].shader;
            i += 1;
        }
        all
    };

    /// Its entry.
    pub fn entry(self) -> &'static ShaderEntry {
        &REGISTRY[self as usize]
    }

    /// Its name: the pipeline's label (`mla_decode` for `mla/decode.wgsl`).
    pub fn name(self) -> &'static str {
        self.entry().name
    }

    /// Whether it is built for pools of `dtype`: the `_q` kernels for
    /// quantized pools only, their plain twins for the others.
    pub fn takes(self, dtype: KvDtype) -> bool {
        self.entry()
            .quantized
            .is_none_or(|q| q == dtype.quantized())
    }
}

/// The compile-time shape of a kernel instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShaderShape {
    /// Elements per head; a multiple of 4, at most 256.
    pub head_dim: u32,
    /// Query heads per KV head.
    pub group: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Element type of the pool.
    pub dtype: KvDtype,
    /// Queries per attention workgroup: 1 for decode, more for prefill.
    pub qtile: u32,
    /// Walk the block table (true), or assume each sequence's blocks are
    /// consecutive from its first one (the contiguous baseline).
    pub paged: bool,
    /// Activations read (Q in attention, new K/V in write_kv) are 16-bit,
    /// packed two per `u32` (the same bytes as an `f16` or `bf16` array),
    /// instead of f32.
    pub q_f16: bool,
    /// The output written (attention's unsplit output, reduce's output) is
    /// packed 16-bit instead of f32. Split-K partials stay f32.
    pub out_f16: bool,
    /// The 16-bit activations and outputs (`q_f16`, `out_f16`) are bfloat16
    /// instead of IEEE half.
    pub act_bf16: bool,
    /// Query heads of one GQA group served by one attention pass (a head
    /// tile); 0 means the whole group. A group larger than a pass can hold
    /// runs as `ceil(group / htile)` tiles, each re-reading the K/V rows.
    pub htile: u32,
    /// `attention_lanes`: lanes that share one token's row (each reads every
    /// `lpt`-th vec4 of it); a power of two dividing `head_dim / 4`.
    pub lpt: u32,
    /// `attention_lanes`: reduce across a token's lanes with subgroup
    /// shuffles (the device has `SUBGROUP` with subgroups of at least
    /// `lpt`), instead of workgroup memory and a barrier.
    pub subgroups: bool,
    /// `attention_stream`: tokens per lane group per step (1, 2 or 4); 0
    /// elsewhere, and where the kernel picks its default.
    pub unroll: u32,
    /// `attention_stream`: invocations per workgroup (64, 128 or 256); 0
    /// elsewhere, and where the kernel picks its default.
    pub workgroup: u32,
    /// Built with wgpu's shader runtime checks off (index clamping, loop
    /// bounding, integer division checks; `create_shader_module_trusted`),
    /// on native only: the host validates every table and argument before
    /// a dispatch, and the kernels keep their own `INVALID` tests. The WGSL
    /// text is the same either way.
    pub trusted: bool,
}

/// The compile-time shape of the MLA kernels: baked into the generated
/// prelude (see `MlaShape::prelude`, with the MLA kernels in `mla.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MlaShape {
    /// vec4s per latent row.
    pub row4: u32,
    /// vec4s of the latent part (the output).
    pub v4: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// The pool's element type.
    pub dtype: KvDtype,
    /// Query heads per workgroup.
    pub hg: u32,
    /// Latent rows per tile (a power of two).
    pub tile_rows: u32,
    /// What the kernel reads from the engine: queries (decode), new rows
    /// (write).
    pub act: ActDtype,
    /// What the kernel writes for the engine: the output (decode unsplit,
    /// merge); split-K partials are f32 (`out` F32 in that decode).
    pub out: ActDtype,
}

/// What a compiled pipeline is cached by, besides its kernel's name: the
/// shape of an attention-family kernel, or of an MLA kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum PipelineKey {
    /// `shaders/<kernel>.wgsl` at this shape.
    Attention(ShaderShape),
    /// `shaders/mla/<kernel>.wgsl` at this shape.
    Mla(MlaShape),
}

impl Default for ShaderShape {
    /// head_dim 128, group 1, block 16, f32, decode, paged, f32 activations.
    fn default() -> Self {
        Self {
            head_dim: 128,
            group: 1,
            block_size: 16,
            dtype: KvDtype::F32,
            qtile: 1,
            paged: true,
            q_f16: false,
            out_f16: false,
            act_bf16: false,
            htile: 0,
            lpt: 1,
            subgroups: false,
            unroll: 0,
            workgroup: 0,
            trusted: false,
        }
    }
}

impl ShaderShape {
    /// Query heads per attention pass (`htile`, or the whole group).
    pub fn head_tile(&self) -> u32 {
        if self.htile == 0 {
            self.group.max(1)
        } else {
            self.htile.min(self.group).max(1)
        }
    }

    /// Head tiles per KV head.
    pub fn head_tiles(&self) -> u32 {
        self.group.max(1).div_ceil(self.head_tile())
    }
}

/// The shared WGSL of `shaders/shared/`, composed into the kernels by
/// [`source`] (one file per piece: a reader finds each in one place, and
/// `cargo run --example shaders` writes every kernel as composed).
mod shared {
    /// `kv_sat`, `KV_MAX`, `F16_MAX`: stored values saturate.
    pub const SATURATE: &str = include_str!("../../shaders/shared/saturate.wgsl");
    /// The KV codecs: `KV4`, `kv_load`, `kv_store`, per pool dtype.
    pub const KV_F32: &str = include_str!("../../shaders/shared/kv_f32.wgsl");
    pub const KV_F16: &str = include_str!("../../shaders/shared/kv_f16.wgsl");
    pub const KV_BF16: &str = include_str!("../../shaders/shared/kv_bf16.wgsl");
    pub const KV_INT8: &str = include_str!("../../shaders/shared/kv_int8.wgsl");
    pub const KV_FP8: &str = include_str!("../../shaders/shared/kv_fp8.wgsl");
    /// Activations (`ACT4`) and outputs (`OUT4`), f32 or packed f16.
    pub const ACT_F32: &str = include_str!("../../shaders/shared/act_f32.wgsl");
    pub const ACT_F16: &str = include_str!("../../shaders/shared/act_f16.wgsl");
    pub const OUT_F32: &str = include_str!("../../shaders/shared/out_f32.wgsl");
    pub const OUT_F16: &str = include_str!("../../shaders/shared/out_f16.wgsl");
    pub const ACT_BF16: &str = include_str!("../../shaders/shared/act_bf16.wgsl");
    pub const OUT_BF16: &str = include_str!("../../shaders/shared/out_bf16.wgsl");
    /// `QV4`, `q_conv`, `k_dot`.
    pub const QDOT: &str = include_str!("../../shaders/shared/qdot.wgsl");
    /// The block-table walk every attention kernel shares.
    pub const TABLE_WALK: &str = include_str!("../../shaders/shared/table_walk.wgsl");
    /// Per-token K/V scales and K outlier residuals, per pool dtype.
    pub const SCALES_PLAIN: &str = include_str!("../../shaders/shared/scales_plain.wgsl");
    pub const SCALES_INT8: &str = include_str!("../../shaders/shared/scales_int8.wgsl");
    pub const SCALES_FP8: &str = include_str!("../../shaders/shared/scales_fp8.wgsl");
    pub const Q_RES: &str = include_str!("../../shaders/shared/q_res.wgsl");
    /// A quantized pool's u32 words, through the pools' own view.
    pub const POOL_WORDS: &str = include_str!("../../shaders/shared/pool_words.wgsl");
    pub const POOL_WORDS_WIDE: &str = include_str!("../../shaders/shared/pool_words_wide.wgsl");
}

/// Every shared file, by name (for the shader tests and the dump).
pub const SHARED: &[(&str, &str)] = &[
    ("saturate", shared::SATURATE),
    ("kv_f32", shared::KV_F32),
    ("kv_f16", shared::KV_F16),
    ("kv_bf16", shared::KV_BF16),
    ("kv_int8", shared::KV_INT8),
    ("kv_fp8", shared::KV_FP8),
    ("act_f32", shared::ACT_F32),
    ("act_f16", shared::ACT_F16),
    ("out_f32", shared::OUT_F32),
    ("out_f16", shared::OUT_F16),
    ("act_bf16", shared::ACT_BF16),
    ("out_bf16", shared::OUT_BF16),
    ("qdot", shared::QDOT),
    ("table_walk", shared::TABLE_WALK),
    ("scales_plain", shared::SCALES_PLAIN),
    ("scales_int8", shared::SCALES_INT8),
    ("scales_fp8", shared::SCALES_FP8),
    ("q_res", shared::Q_RES),
    ("pool_words", shared::POOL_WORDS),
    ("pool_words_wide", shared::POOL_WORDS_WIDE),
];

/// A file of `shaders/shared/` by name (without `.wgsl`).
pub(crate) fn shared_source(name: &str) -> Option<&'static str> {
    SHARED.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// The attention kernels' per-token K and V scales and K outlier channels
/// for a pool of `dtype` (`shaders/shared/scales_*.wgsl`, and `q_res.wgsl`
/// for the quantized pools).
fn scale_helpers(dtype: KvDtype) -> [&'static str; 2] {
    match dtype {
        KvDtype::F32 | KvDtype::F16 | KvDtype::Bf16 => [shared::SCALES_PLAIN, ""],
        KvDtype::Int8 => [shared::SCALES_INT8, shared::Q_RES],
        KvDtype::Fp8E4M3 => [shared::SCALES_FP8, shared::Q_RES],
    }
}

/// The shape's constants (the `constants` import): all the Rust side
/// writes for every kernel; what a kernel's module writes besides is its
/// `generated` import.
fn constants(s: &ShaderShape) -> String {
    let lpt = s.lpt.max(1);
    let vars = [
        ("head_dim4", s.head_dim as i64 / 4),
        ("group", s.group as i64),
        ("block_size", s.block_size as i64),
        ("qtile", s.qtile.max(1) as i64),
        ("paged", s.paged as i64),
        ("ht", s.head_tile() as i64),
        ("htiles", s.head_tiles() as i64),
        ("lpt", lpt as i64),
        ("jn", (s.head_dim / 4 / lpt).max(1) as i64),
        // Subgroup builtins need no `enable` in naga (wgpu's SUBGROUP
        // feature allows them; naga refuses the directive). Subgroups are
        // native-only in wgpu, so a browser never gets a subgroup shape.
        ("subgroups", s.subgroups as i64),
    ];
    super::template::expand(CONSTANTS_TEMPLATE, &vars).expect("the constants template expands")
}

/// The template of every kernel's `constants` import.
pub const CONSTANTS_TEMPLATE: &str = include_str!("../../shaders/templates/constants.wgsl");

/// The KV codec of a pool dtype (the `kv` import).
pub(crate) fn kv_codec(dtype: KvDtype) -> &'static str {
    match dtype {
        KvDtype::F32 => shared::KV_F32,
        KvDtype::F16 => shared::KV_F16,
        KvDtype::Bf16 => shared::KV_BF16,
        KvDtype::Int8 => shared::KV_INT8,
        KvDtype::Fp8E4M3 => shared::KV_FP8,
    }
}

/// The codec of what a kernel reads (`act`) or writes (`out`) for the
/// engine, in `act`'s dtype.
pub(crate) fn io_codec(out: bool, act: ActDtype) -> &'static str {
    match (out, act) {
        (false, ActDtype::F16) => shared::ACT_F16,
        (false, ActDtype::Bf16) => shared::ACT_BF16,
        (false, _) => shared::ACT_F32,
        (true, ActDtype::F16) => shared::OUT_F16,
        (true, ActDtype::Bf16) => shared::OUT_BF16,
        (true, _) => shared::OUT_F32,
    }
}

/// The activation dtype a `ShaderShape` reads (`q_f16`, `act_bf16`) or
/// writes (`out_f16`, `act_bf16`).
fn shape_act(sixteen: bool, bf16: bool) -> ActDtype {
    match (sixteen, bf16) {
        (false, _) => ActDtype::F32,
        (true, false) => ActDtype::F16,
        (true, true) => ActDtype::Bf16,
    }
}

/// The prelude of every kernel of `shaders/`: its `constants`, `saturate`,
/// `kv`, `qdot`, `act` and `out` imports as [`compose`] writes them (the
/// part of a composed kernel before `common.wgsl`).
pub fn prelude(s: &ShaderShape) -> String {
    let mut out = String::new();
    for name in ["constants", "saturate", "kv", "qdot", "act", "out"] {
        out += &part(name, s, 1, "").expect("a known import");
    }
    out + "\n"
}

/// What every import a kernel file may name gives it, and where from:
/// (name, the names it defines). A `.wgsl` file lists the imports it uses
/// at its top, one `//#import <name>  <what it gives>` line each, in the
/// order they are composed; a shared part lists what it uses the same way
/// (`tests/host/shaders.rs` checks that every kernel imports what its
/// parts use, and that each file's lines say what this table says).
pub const IMPORTS: &[(&str, &str)] = &[
    (
        "constants",
        "HEAD_DIM4 GROUP BLOCK_SIZE QTILE PAGED HT HTILES LPT JN SUBGROUPS",
    ),
    ("saturate", "kv_sat KV_MAX F16_MAX"),
    ("kv", "KV4 kv_load kv_store"),
    ("qdot", "QV4 q_conv k_dot"),
    ("act", "ACT4 act_load act_store"),
    ("out", "OUT4 out_load out_store"),
    (
        "common",
        "WriteKvParams CopyParams AttnParams NEG_INF INVALID K_OUTLIERS logit",
    ),
    ("table_walk", "the block-table walk"),
    ("pool_words", "a quantized pool's u32 words"),
    ("scales", "per-token K/V scales, K outlier residuals"),
    ("generated", "what the kernel's module writes"),
    (
        "mla_constants",
        "R4 V4 BLOCK_SIZE HG LANES WG TILE_ROWS QN AN",
    ),
    ("mla_common", "MlaParams NEG INVALID"),
];

/// The imports `src` names at its top (`//#import <name> ...` lines), in
/// order.
pub fn imports(src: &str) -> Vec<&str> {
    src.lines()
        .take_while(|l| l.starts_with("//#import "))
        .filter_map(|l| l["//#import ".len()..].split_whitespace().next())
        .collect()
}

/// `src` without its import lines: the text it adds to a kernel.
pub(crate) fn body(src: &str) -> &str {
    let mut rest = src;
    while rest.starts_with("//#import ") {
        rest = rest.split_once('\n').map_or("", |(_, r)| r);
    }
    rest
}

/// The text of import `name` for an attention-family kernel at `shape`
/// (`wide`: KV4s per pool load; `generated`: what the kernel's module
/// writes); `None` for a name that is not an attention-family import.
fn part(name: &str, shape: &ShaderShape, wide: u32, generated: &str) -> Option<String> {
    let quantized = shape.dtype.quantized();
    Some(match name {
        "constants" => constants(shape),
        "saturate" => body(shared::SATURATE).into(),
        "kv" => body(kv_codec(shape.dtype)).into(),
        "qdot" => body(shared::QDOT).into(),
        "act" => body(io_codec(false, shape_act(shape.q_f16, shape.act_bf16))).into(),
        "out" => body(io_codec(true, shape_act(shape.out_f16, shape.act_bf16))).into(),
        // The blank line ends the prelude.
        "common" => format!("\n{}\n", body(COMMON)),
        "table_walk" => body(shared::TABLE_WALK).into(),
        // Through the serial kernel's vec4<u32> view where it has one.
        "pool_words" if !quantized => String::new(),
        "pool_words" if wide == 4 => body(shared::POOL_WORDS_WIDE).into(),
        "pool_words" => body(shared::POOL_WORDS).into(),
        "scales" => {
            let [scales, q_res] = scale_helpers(shape.dtype);
            format!("{}{}", body(scales), body(q_res))
        }
        "generated" => generated.into(),
        _ => return None,
    })
}

/// The source of `kernel` (an attention-family entry of [`REGISTRY`]) at
/// `shape`: each import its file names, in its order (see [`IMPORTS`]),
/// then the file's own text. `wide` (KV4s per pool load, for
/// `pool_words`) and `generated` (the WGSL the kernel's module writes) come
/// from the kernels' modules ([`kernels::source`](super::kernels::source)).
/// `None` for an MLA kernel, an unknown import, or generated code the file
/// does not import.
pub fn compose(kernel: Shader, shape: &ShaderShape, wide: u32, generated: &str) -> Option<String> {
    if kernel.entry().family != Family::Attention {
        return None;
    }
    compose_file(kernel.entry().text, shape, wide, generated)
}

/// [`compose`] for any file's text: what a kernel outside the library (the
/// bench's streaming read) composes with.
pub fn compose_file(file: &str, shape: &ShaderShape, wide: u32, generated: &str) -> Option<String> {
    let names = imports(file);
    if !generated.is_empty() && !names.contains(&"generated") {
        return None;
    }
    let mut out = String::new();
    for name in names {
        out += &part(name, shape, wide, generated)?;
    }
    out += body(file);
    Some(out)
}

/// The head tile of at most `most` rows that splits `group` most evenly:
/// `ceil(group / tiles)` for the fewest tiles that respect `most`.
pub fn balanced_head_tile(group: u32, most: u32) -> u32 {
    let group = group.max(1);
    let tiles = group.div_ceil(most.max(1));
    group.div_ceil(tiles)
}
