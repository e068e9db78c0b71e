//#import constants     HEAD_DIM4 GROUP BLOCK_SIZE QTILE PAGED HT HTILES LPT JN SUBGROUPS (generated from the shape: src/gpu/compose.rs)
//#import common        WriteKvParams CopyParams AttnParams NEG_INF INVALID K_OUTLIERS logit ... (common.wgsl)
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
// The keys a walk visits: indices [begin, end) of a run whose index i is
// position i below `sinks` and position i + skip from there on. Without
// sink tokens sinks = skip = 0 and an index is its position.
struct Keys {
    begin: u32,
    end: u32,
    sinks: u32,
    skip: u32,
}
fn key_at(r: Keys, i: u32) -> u32 {
    return select(i + r.skip, i, i < r.sinks);
}
// StreamingLLM: positions [0, sink_tokens) beside the window's [first, end),
// as one run (no position twice: the sinks stop at `first`), partitioned
// over the run when split. The blocks between may have been released.
fn sink_keys(p: AttnParams, first: u32, end: u32, part: u32) -> Keys {
    let k = min(p.sink_tokens, first);
    let n = k + (max(end, first) - first);
    var b = 0u;
    var e = n;
    if p.partition_tokens != 0u {
        b = min(part * p.partition_tokens, n);
        e = min(b + p.partition_tokens, n);
    }
    return Keys(b, e, k, first - k);
}
// Decode: the keys partition `part` walks; the query sits at len - 1 and
// sees the last `sliding_window` positions when one is set (and the first
// `sink_tokens` beside them).
fn decode_range(p: AttnParams, len: u32, part: u32) -> Keys {
    let q_pos = max(len, 1u) - 1u;
    let windowed = p.sliding_window != 0u && q_pos + 1u > p.sliding_window;
    if windowed && p.sink_tokens != 0u {
        return sink_keys(p, q_pos + 1u - p.sliding_window, len, part);
    }
    var t_begin = 0u;
    var t_end = len;
    if p.partition_tokens != 0u {
        t_begin = min(part * p.partition_tokens, t_end);
        t_end = min(t_begin + p.partition_tokens, t_end);
    }
    if windowed {
        t_begin = max(t_begin, q_pos + 1u - p.sliding_window);
        t_end = max(t_end, t_begin);
    }
    return Keys(t_begin, t_end, 0u, 0u);
}
