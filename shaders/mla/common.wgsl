// What the MLA kernels share (after the generated prelude and the pool's KV
// codec): the uniform block and the pool row of a token.
//
// A latent pool holds, per layer, one row per token: the compressed KV
// (KV_LORA_RANK values, the first V4 KV4s) followed by the decoupled RoPE
// key (the rest of the R4 KV4s). Rows are laid out [block][row in block][R4].
struct MlaParams {
    // Query rows (decode: one per sequence; prefill: one per new token).
    num_queries: u32,
    // Query heads.
    num_heads: u32,
    // Blocks in the pool (a table entry at or past it is unreadable).
    num_blocks: u32,
    // u32s per sequence's table row in `tables`.
    table_stride: u32,
    // Split-K partitions per query (1: the output is written directly).
    parts: u32,
    // Tokens per partition.
    part_tokens: u32,
    // The softmax scale, applied to the query once.
    scale: f32,
    // write: rows to write; copy: (src, dst) pairs.
    count: u32,
    // ACT4s from one query row (decode) or new row (write) to the next.
    stride: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

const NEG: f32 = -0x1.fffffep+127f;
const INVALID: u32 = 0xffffffffu;
