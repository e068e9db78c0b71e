//! The report as text: one table per section.

use super::*;

/// The report as the table the CLI prints.
pub fn render(r: &BenchReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "adapter: {}   timing: {:?}", r.adapter, r.timing);
    let _ = writeln!(
        s,
        "decode shape: {} q heads / {} kv heads, head_dim {}, block {}; copy_buffer_to_buffer {:.2} GB/s (read + written); rated {}",
        r.shape[0], r.shape[1], r.shape[2], r.shape[3], r.memcpy_gbs,
        r.rated_gbs.map_or("unknown".into(), |g| format!("{g:.0} GB/s"))
    );
    render_decode(&mut s, r);
    render_dtypes_cascade(&mut s, r);
    for k in &r.skipped {
        let _ = writeln!(s, " skipped: {k}");
    }
    render_split(&mut s, r);
    render_host(&mut s, r);
    s
}

/// The decode grid, its kernels side by side, and the tuner's picks.
pub(crate) fn render_decode(s: &mut String, r: &BenchReport) {
    use std::fmt::Write;
    let _ = writeln!(s, "\n dtype  batch  context   paged ms  identity ms  contig ms  paged/contig  eff GB/s  stream GB/s  eff/stream  eff/rated  SM MHz");
    for d in &r.decode {
        let _ = writeln!(
            s,
            " {:<5}  {:>5}  {:>7}  {:>9.3}  {:>11.3}  {:>9.3}  {:>12.3}  {:>8.2}  {:>11.2}  {:>10.2}  {:>9}  {:>6}",
            d.dtype, d.batch, d.context, d.paged_ms, d.identity_ms, d.contiguous_ms, d.paged_over_contiguous, d.effective_gbs, d.stream_gbs, d.bandwidth_ratio,
            d.of_rated.map_or("-".into(), |x| format!("{x:.2}")),
            d.sm_mhz.map_or("-".into(), |m| m.to_string())
        );
    }
    let _ = writeln!(
        s,
        "\n decode kernels, same cells, interleaved (Split::Auto, shuffled blocks); * = tuner's pick"
    );
    for d in &r.decode {
        let cells: Vec<String> = d
            .variants
            .iter()
            .map(|v| {
                format!(
                    "{}{} {:.3} ms ({:.2} GB/s, {:.0}% of stream)",
                    if v.kernel == d.kernel { "*" } else { " " },
                    v.kernel,
                    v.ms,
                    v.effective_gbs,
                    100.0 * v.bandwidth_ratio
                )
            })
            .collect();
        let _ = writeln!(
            s,
            " {:<5}  {:>5}  {:>7}  {}",
            d.dtype,
            d.batch,
            d.context,
            cells.join("  ")
        );
    }
    for t in &r.tuner {
        let m: Vec<String> = t
            .micros
            .iter()
            .map(|(k, us)| format!("{k} {:.0} us", us))
            .collect();
        let _ = writeln!(
            s,
            " tuner ({}, {} x {} tokens): picked {}; {}",
            t.dtype,
            t.batch.0,
            t.batch.1,
            t.chosen,
            m.join(", ")
        );
    }
}

/// A table: its header line, then one line per row; nothing when there
/// are no rows.
pub(crate) fn table<T>(s: &mut String, header: &str, rows: &[T], line: impl Fn(&T) -> String) {
    if rows.is_empty() {
        return;
    }
    s.push_str(header);
    s.push('\n');
    for r in rows {
        s.push_str(&line(r));
        s.push('\n');
    }
}

/// Decode per KV dtype, and the cascade against plain decode.
pub(crate) fn render_dtypes_cascade(s: &mut String, r: &BenchReport) {
    table(
        s,
        "\n KV dtype  batch  context  kernel      ms    K+V MB  block/f16  time/f16",
        &r.dtypes,
        |d| {
            format!(
                " {:<8}  {:>5}  {:>7}  {:<8}  {:>8.3}  {:>7.1}  {:>9.3}  {:>8.2}",
                d.dtype,
                d.batch,
                d.context,
                d.kernel,
                d.ms,
                d.kv_bytes as f64 / 1e6,
                d.block_bytes_over_f16,
                d.time_over_f16
            )
        },
    );
    table(
        s,
        "\n cascade (f16): n  prompt  private  kernel    plain ms  cascade ms  plain/cascade  K/V bytes cascade/plain  Auto picks",
        &r.cascade,
        |c| {
            format!(
                "  {:>13}  {:>6}  {:>7.0}  {:<8}  {:>8.3}  {:>10.3}  {:>13.2}  {:>24.3}  {}",
                c.n,
                c.prompt,
                c.private_mean,
                c.kernel,
                c.plain_ms,
                c.cascade_ms,
                c.speedup,
                c.cascade_bytes as f64 / c.plain_bytes.max(1) as f64,
                if c.auto_uses { "cascade" } else { "plain" }
            )
        },
    );
}

/// Split-KV against one pass per sequence.
pub(crate) fn render_split(s: &mut String, r: &BenchReport) {
    use std::fmt::Write;
    let _ = writeln!(
        s,
        "\n split (f16)  kernel  batch  context   whole ms   auto ms  whole/auto  auto picks"
    );
    for d in &r.split {
        let _ = writeln!(
            s,
            "              {:<6}  {:>5}  {:>7}  {:>9}  {:>8.3}  {:>10}  {}",
            d.kernel,
            d.batch,
            d.context,
            d.whole_ms
                .map_or("(capped)".to_string(), |w| format!("{w:.3}")),
            d.split_ms,
            d.speedup.map_or("-".to_string(), |x| format!("{x:.2}")),
            if d.auto_partition == 0 {
                "whole".to_string()
            } else {
                format!("split {}", d.auto_partition)
            }
        );
    }
}

/// The host side, the copies, swap, transfers, MLA and the scheduler.
pub(crate) fn render_host(s: &mut String, r: &BenchReport) {
    use std::fmt::Write;
    // Sections left out by --only have figures of 0: not printed.
    if r.host_us_per_seq > 0.0 {
        let _ = writeln!(
            s,
            "\nhost bookkeeping at batch 256: {:.3} us per sequence per step ({:.3} with prefix caching)",
            r.host_us_per_seq, r.host_us_per_seq_prefix_cache
        );
        let h = &r.host_step;
        let _ = writeln!(
            s,
            "plan + record a {}-layer decode step at batch {} (context {}): {:.0} us; {} buffers and {} bind groups created per steady step",
            h.layers, h.batch, h.context, h.us_per_step, h.buffers_created, h.bind_groups_created
        );
    }
    if r.write_kv_tokens_per_s > 0.0 {
        let _ = writeln!(
            s,
            "write_kv: {:.0} tokens/s ({:.2} GB/s)",
            r.write_kv_tokens_per_s, r.write_kv_gbs
        );
        let _ = writeln!(
            s,
            "copy_blocks: {:.0} blocks/s ({:.2} GB/s)",
            r.copy_blocks_per_s, r.copy_blocks_gbs
        );
    }
    if r.swap_out_gbs > 0.0 {
        let _ = writeln!(
            s,
            "swap (128 scattered blocks, 4 layers, wall clock): out {:.2} GB/s, in {:.2} GB/s (copy_buffer_to_buffer {:.2} GB/s)",
            r.swap_out_gbs, r.swap_in_gbs, r.memcpy_gbs
        );
    }
    if r.export_gbs > 0.0 {
        let _ = writeln!(
            s,
            "export / import (128 scattered blocks, 4 layers, wall clock): export {:.2} GB/s, import {:.2} GB/s",
            r.export_gbs, r.import_gbs
        );
        let _ = writeln!(
            s,
            "time to first token, attention path (4 layers, {} prompt tokens, {} from a remote prefix): cold {:.1} ms, remote hit {:.1} ms ({:.2}x)",
            r.ttft_tokens.0,
            r.ttft_tokens.1,
            r.ttft_cold_ms,
            r.ttft_remote_hit_ms,
            r.ttft_cold_ms / r.ttft_remote_hit_ms
        );
    }
    if let Some(m) = &r.mla {
        let _ = writeln!(
            s,
            "MLA decode (16 heads, bf16 latent 512+64, batch {}, {} tokens, {} partition(s)) {:.3} ms vs GQA ({HEADS}/{KV_HEADS} heads x {HEAD_DIM}, bf16, {} tokens) {:.3} ms over the same {:.1} MB: MLA/GQA {:.2}x ({:.2} vs {:.2} GB/s)",
            m.batch,
            m.mla_context,
            m.mla_partitions,
            m.mla_ms,
            m.gqa_context,
            m.gqa_ms,
            m.bytes as f64 / 1e6,
            m.mla_ms / m.gqa_ms,
            m.bytes as f64 / m.mla_ms / 1e6,
            m.bytes as f64 / m.gqa_ms / 1e6,
        );
    }
    if r.scheduler_us_per_seq > 0.0 {
        let _ = writeln!(
            s,
            "scheduler (schedule + commit) at batch 256: {:.2} us per sequence per step",
            r.scheduler_us_per_seq
        );
    }
    let (hybrid, full) = r.hybrid_us_per_seq;
    if hybrid > 0.0 {
        let _ = writeln!(
            s,
            "Gemma 3 layer groups (window 512 released, full) at batch 256: {hybrid:.2} us per sequence per step; one full group: {full:.2} ({:.2}x)",
            hybrid / full
        );
    }
}
