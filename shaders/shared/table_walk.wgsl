// What every attention kernel reads the same way, for one sequence (or
// cascade segment): the packed table with its bounds, the span of the
// sequence's table entries and its length (cut to what the table holds and
// to 2^31, so no loop outruns the table), a token's pool row (INVALID when
// unreadable: past the table, or a block outside the pool), and decode's
// token range for a partition and a window. Composed into each attention
// kernel, whose `table` binding it reads.
fn table_at(i: u32) -> u32 {
    if i < arrayLength(&table) {
        return table[i];
    }
    return INVALID;
}
struct Span {
    ind_start: u32,
    ind_end: u32,
    len: u32,
    first_blk: u32,
}
fn seq_span(p: AttnParams, seq: u32) -> Span {
    let ind_end = min(table_at(seq + 1u), p.indices_len);
    let ind_start = min(table_at(seq), ind_end);
    let held = ind_end - ind_start;
    var len = min(table_at(p.lens_off + seq), 0x80000000u);
    if held <= 0xFFFFFFFFu / BLOCK_SIZE {
        len = min(len, held * BLOCK_SIZE);
    }
    return Span(ind_start, ind_end, len, table_at(p.indices_off + ind_start));
}
fn token_row(p: AttnParams, s: Span, kvh: u32, tok: u32) -> u32 {
    let j = s.ind_start + tok / BLOCK_SIZE;
    if tok >= s.len || j >= s.ind_end {
        return INVALID;
    }
    // PAGED == false: the contiguous twin used as the benchmark baseline;
    // the sequence's blocks follow its first one.
    var blk = s.first_blk + tok / BLOCK_SIZE;
    if PAGED {
        blk = table_at(p.indices_off + j);
    }
    if blk >= p.num_blocks {
        return INVALID;
    }
    return ((blk * p.num_kv_heads + kvh) * BLOCK_SIZE + tok % BLOCK_SIZE) * HEAD_DIM4;
}
// Decode: the tokens [begin, end) partition `part` walks; the query sits at
// len - 1 and sees the last `sliding_window` positions when one is set.
fn decode_range(p: AttnParams, len: u32, part: u32) -> vec2<u32> {
    let q_pos = max(len, 1u) - 1u;
    var t_begin = 0u;
    var t_end = len;
    if p.partition_tokens != 0u {
        t_begin = min(part * p.partition_tokens, t_end);
        t_end = min(t_begin + p.partition_tokens, t_end);
    }
    if p.sliding_window != 0u && q_pos + 1u > p.sliding_window {
        t_begin = max(t_begin, q_pos + 1u - p.sliding_window);
        t_end = max(t_end, t_begin);
    }
    return vec2<u32>(t_begin, t_end);
}
