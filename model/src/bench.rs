//! `pagedattn bench --only model`: the real model's speed and memory on
//! the default adapter. Figures, not assertions: this runs where the
//! machine is what it is.

use std::time::Instant;

use pagedattn::gpu::KvDtype;
use serde::Serialize;

use crate::engine::{DecodeMatmul, EngineConfig, Model};
use crate::generate::open_device;
use crate::load::ModelSource;
use crate::sample::SamplingParams;
use crate::serve::{Decoding, Request, Server, ServerConfig};
use crate::ModelError;

/// Decode at one batch size.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeRow {
    pub batch: usize,
    pub tokens_per_s: f64,
    pub ms_per_step: f64,
    /// Share of a step spent in the attention kernels; `None` where no step
    /// of only decode rows reached the batch (the first requests finish
    /// while the last prompts are still prefilled).
    pub attention_share: Option<f64>,
    /// Dispatches of the run's last decode step (all `batch` rows), the
    /// model's and the library's: what a launch-bound GPU pays for.
    pub dispatches: usize,
    /// The matmul its decode steps ran: "tiled" or "split-k".
    pub matmul: String,
}

/// The decode step on this adapter with each matmul, in one run: what
/// the split-K matmul (the GPU's choice) costs or gains where the tiled
/// one is the default, and the dispatches each records.
#[derive(Clone, Debug, Serialize)]
pub struct MatmulRow {
    pub batch: usize,
    pub tiled_tokens_per_s: f64,
    pub splitk_tokens_per_s: f64,
    pub tiled_dispatches: usize,
    pub splitk_dispatches: usize,
}

/// Memory of one request that shares its prompt.
#[derive(Clone, Debug, Serialize)]
pub struct SharingRow {
    pub what: String,
    /// Peak pool blocks with sharing.
    pub blocks_shared: usize,
    /// The same sequences, each holding its own blocks.
    pub blocks_unshared: usize,
    pub saved: f64,
}

/// Decode of a hybrid model (layers in window and full groups) with a
/// pool per layer group, whose window groups give back what their windows
/// no longer read, against one pool that keeps every layer's blocks.
#[derive(Clone, Debug, Serialize)]
pub struct GroupsRow {
    pub batch: usize,
    /// Context at the first decode step (past the window).
    pub context: usize,
    /// Decode tokens/s, best of the rounds, with layer groups and with one
    /// pool (the rounds alternate, in one run).
    pub groups_tokens_per_s: f64,
    pub one_pool_tokens_per_s: f64,
    /// Layer-blocks held at the last step with layer groups, and what one
    /// pool held.
    pub groups_layer_blocks: usize,
    pub one_pool_layer_blocks: usize,
}

/// The model section of the bench.
#[derive(Clone, Debug, Serialize)]
pub struct ModelBench {
    /// The model file's name, or the synthetic model's description.
    pub model: String,
    pub adapter: String,
    pub prompt_tokens: usize,
    /// Context of the decode rows (tokens).
    pub decode_context: usize,
    pub prefill_tokens_per_s: f64,
    pub decode: Vec<DecodeRow>,
    pub sharing: Vec<SharingRow>,
    /// Tiled against split-K decode (empty with `quick`).
    pub matmuls: Vec<MatmulRow>,
    /// A hybrid model's layer groups against one pool (empty for a model
    /// whose layers attend alike).
    pub groups: Vec<GroupsRow>,
}

fn prompt(tok: &crate::tokenizer::Tokenizer, i: usize) -> Vec<u32> {
    let text = tok.chat_prompt(
        &format!("Write a long story about a lighthouse keeper number {i} who finds a map."),
        None,
    );
    tok.encode(&text, true)
}

/// Runs the section on the model `source` names (a file or a synthetic
/// model); `quick` measures fewer steps.
pub fn run(
    source: &ModelSource,
    quick: bool,
    backends: wgpu::Backends,
) -> Result<ModelBench, ModelError> {
    let l = source.load()?;
    let (device, queue, adapter) = open_device(backends)?;
    // Room for the batch of 64 at its context without preemption.
    let cfg = EngineConfig {
        num_blocks: 1024,
        kv_dtype: KvDtype::F16,
        max_rows: 256,
        max_logit_rows: 64,
        ..EngineConfig::default()
    };
    let mut model = Some(Model::new(&device, &queue, &l.weights, cfg)?);
    let name = source.describe();
    if model.as_ref().is_some_and(|m| m.num_groups() > 1) && only_groups() {
        let groups = groups_ab(model.take().expect("model"), &l.tokenizer, quick)?;
        return Ok(ModelBench {
            model: name,
            adapter,
            prompt_tokens: 0,
            decode_context: 0,
            prefill_tokens_per_s: 0.0,
            decode: Vec::new(),
            sharing: Vec::new(),
            matmuls: Vec::new(),
            groups,
        });
    }
    let scfg = ServerConfig {
        max_seqs: 64,
        max_batch_tokens: 256,
        ..ServerConfig::default()
    };
    let steps = if quick { 4 } else { 16 };

    // Prefill: one prompt, timed alone (after a warm-up request that
    // compiles every pipeline).
    let mut server = Server::new(model.take().expect("model"), scfg)?;
    server.add(Request::greedy(prompt(&l.tokenizer, 99), 2))?;
    server.run(&mut |_, _| {})?;
    let p = prompt(&l.tokenizer, 0);
    let prompt_tokens = p.len();
    server.add(Request::greedy(p, 1))?;
    let t = Instant::now();
    server.run(&mut |_, _| {})?;
    let prefill_tokens_per_s = prompt_tokens as f64 / t.elapsed().as_secs_f64();
    model = Some(server.into_model());

    // Decode: `batch` sequences of a context of `ctx` tokens (prompts cut
    // from one text, each its own, so nothing is shared).
    let ctx = if quick { 24 } else { 128 };
    let text: String = (0..64)
        .map(|i| format!("Chapter {i}. The keeper climbed the stairs and lit the lamp again. "))
        .collect();
    let long = l.tokenizer.encode(&text, false);
    let decode_run = |model: Model, batch: usize| -> Result<(DecodeRow, Model), ModelError> {
        let mut server = Server::new(model, scfg)?;
        server.profile = Some(batch);
        for i in 0..batch {
            let mut p = long[..ctx.min(long.len())].to_vec();
            p[0] = 100 + i as u32; // distinct prompts
            server.add(Request::greedy(p, steps + 1))?;
        }
        server.run(&mut |_, _| {})?;
        let st = server.stats;
        let model = server.into_model();
        let row = DecodeRow {
            batch,
            tokens_per_s: st.decode_tokens as f64 / st.decode_secs.max(1e-9),
            ms_per_step: st.decode_secs * 1e3 / (st.decode_tokens as f64 / batch as f64).max(1.0),
            attention_share: st.attention_share,
            dispatches: model.last_dispatches(),
            matmul: match model.matmul_for(batch) {
                DecodeMatmul::SplitK => "split-k".into(),
                _ => "tiled".into(),
            },
        };
        Ok((row, model))
    };
    let mut decode = Vec::new();
    for batch in [1usize, 8, 32, 64] {
        let (row, m) = decode_run(model.take().expect("model"), batch)?;
        decode.push(row);
        model = Some(m);
    }
    // The other decode matmul, at the batches it serves, in the same run.
    let mut matmuls = Vec::new();
    if !quick {
        let ours = model.as_ref().expect("model").matmul_for(1);
        let other = match ours {
            DecodeMatmul::SplitK => DecodeMatmul::Tiled,
            _ => DecodeMatmul::SplitK,
        };
        let ocfg = EngineConfig {
            decode_matmul: other,
            ..cfg
        };
        let mut alt = Some(Model::new(&device, &queue, &l.weights, ocfg)?);
        for batch in [1usize, 8] {
            let (a, m) = decode_run(model.take().expect("model"), batch)?;
            model = Some(m);
            let (b, m) = decode_run(alt.take().expect("model"), batch)?;
            alt = Some(m);
            let (t, k) = if ours == DecodeMatmul::SplitK {
                (b, a)
            } else {
                (a, b)
            };
            matmuls.push(MatmulRow {
                batch,
                tiled_tokens_per_s: t.tokens_per_s,
                splitk_tokens_per_s: k.tokens_per_s,
                tiled_dispatches: t.dispatches,
                splitk_dispatches: k.dispatches,
            });
        }
    }

    // Sharing: 4 beams and 4 samples of one prompt, pool blocks at their
    // peak against every sequence holding its own blocks.
    let mut sharing = Vec::new();
    let sample = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        min_p: 0.0,
        top_p: 0.95,
        seed: 1,
    };
    let gen = if quick { 24 } else { 96 };
    for (what, decoding) in [
        ("beam search, width 4", Decoding::Beam { width: 4 }),
        (
            "parallel sampling, n = 4",
            Decoding::Sample {
                params: sample,
                n: 4,
            },
        ),
    ] {
        let mut server = Server::new(
            model.take().expect("model"),
            ServerConfig {
                prefix_caching: false,
                ..scfg
            },
        )?;
        let id = server.add(Request {
            decoding,
            ..Request::greedy(prompt(&l.tokenizer, 7), gen)
        })?;
        let bs = server.sched.blocks().block_size() as usize;
        let (mut peak_shared, mut peak_unshared) = (0usize, 0usize);
        while server.has_work() {
            server.step(&mut |_, _| {})?;
            let Ok(seqs) = server.sched.sequences(id) else {
                continue;
            };
            let own: usize = seqs
                .iter()
                .filter_map(|&s| server.sched.blocks().seq_len(s).ok())
                .map(|n| n.div_ceil(bs))
                .sum();
            let used = server.sched.blocks().stats().used;
            if own > peak_unshared {
                peak_unshared = own;
            }
            peak_shared = peak_shared.max(used);
        }
        sharing.push(SharingRow {
            what: what.into(),
            blocks_shared: peak_shared,
            blocks_unshared: peak_unshared,
            saved: 1.0 - peak_shared as f64 / peak_unshared.max(1) as f64,
        });
        model = Some(server.into_model());
    }
    let groups = match model {
        Some(m) if m.num_groups() > 1 => groups_ab(m, &l.tokenizer, quick)?,
        _ => Vec::new(),
    };
    Ok(ModelBench {
        model: name,
        adapter,
        prompt_tokens,
        decode_context: ctx,
        prefill_tokens_per_s,
        decode,
        sharing,
        matmuls,
        groups,
    })
}

/// `PAGEDATTN_BENCH_GROUPS_ONLY=1`: of a hybrid model, only the layer
/// groups' A/B (the rest takes minutes on a CPU adapter).
fn only_groups() -> bool {
    std::env::var("PAGEDATTN_BENCH_GROUPS_ONLY").is_ok_and(|v| v == "1")
}

/// Decode past the window with layer groups and with one pool, in
/// alternating rounds on the same model (its pools rebuilt each time).
fn groups_ab(
    mut model: Model,
    tok: &crate::tokenizer::Tokenizer,
    quick: bool,
) -> Result<Vec<GroupsRow>, ModelError> {
    let window = model
        .kv_layout()
        .groups()
        .iter()
        .filter_map(|g| match g.kind {
            pagedattn::blocks::GroupKind::Window(w) => Some(w as usize),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let scfg = ServerConfig {
        max_seqs: 8,
        max_batch_tokens: 256,
        prefix_caching: false,
        ..ServerConfig::default()
    };
    let text: String = (0..200)
        .map(|i| format!("Chapter {i}. The keeper climbed the stairs and lit the lamp again. "))
        .collect();
    let long = tok.encode(&text, true);
    let ctx = (window + 48).min(long.len());
    let steps = if quick { 8 } else { 32 };
    let rounds = if quick { 1 } else { 3 };
    let mut rows = Vec::new();
    for batch in if quick { vec![1] } else { vec![1, 4] } {
        let (mut best, mut blocks) = ([0.0f64; 2], [0usize; 2]);
        for round in 0..rounds {
            // Alternating which goes first, so that an order effect cancels.
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for k in order {
                let on = k == 0;
                model.set_layer_groups(on, None)?;
                let mut server = Server::new(model, scfg)?;
                for i in 0..batch {
                    let mut p = long[..ctx].to_vec();
                    p[1] = 100 + i as u32; // distinct prompts
                    server.add(Request::greedy(p, steps + 1))?;
                }
                server.run(&mut |_, _| {})?;
                let st = server.stats;
                best[k] = best[k].max(st.decode_tokens as f64 / st.decode_secs.max(1e-9));
                blocks[k] = st.last_layer_blocks;
                model = server.into_model();
            }
        }
        rows.push(GroupsRow {
            batch,
            context: ctx,
            groups_tokens_per_s: best[0],
            one_pool_tokens_per_s: best[1],
            groups_layer_blocks: blocks[0],
            one_pool_layer_blocks: blocks[1],
        });
    }
    model.set_layer_groups(true, None)?;
    Ok(rows)
}

/// The section as text.
pub fn render(b: &ModelBench) -> String {
    let mut s = format!("\nmodel: {} (f16 KV) on {}\n", b.model, b.adapter);
    if b.decode.is_empty() {
        // Only the layer groups' comparison ran.
        return s + &render_groups(b);
    }
    s += &format!(
        " prefill ({} tokens): {:.1} tokens/s\n batch  tokens/s  ms/step  attention share  dispatches/step  matmul\n",
        b.prompt_tokens, b.prefill_tokens_per_s
    );
    s += &format!(" decode rows at a context of {} tokens\n", b.decode_context);
    for d in &b.decode {
        let share = match d.attention_share {
            Some(a) => format!("{:>14.1} %", a * 100.0),
            None => format!("{:>16}", "- (not timed)"),
        };
        s += &format!(
            " {:>5}  {:>8.1}  {:>7.1}  {share}  {:>15}  {}\n",
            d.batch, d.tokens_per_s, d.ms_per_step, d.dispatches, d.matmul
        );
    }
    if !b.matmuls.is_empty() {
        s +=
            " decode matmul, one run   tokens/s tiled  split-k  ratio  dispatches tiled  split-k\n";
        for r in &b.matmuls {
            s += &format!(
                " batch {:>3}                {:>14.1}  {:>7.1}  {:>5.2}  {:>16}  {:>7}\n",
                r.batch,
                r.tiled_tokens_per_s,
                r.splitk_tokens_per_s,
                r.splitk_tokens_per_s / r.tiled_tokens_per_s.max(1e-9),
                r.tiled_dispatches,
                r.splitk_dispatches
            );
        }
    }
    s += " sharing                    blocks (shared)  blocks (each its own)  saved\n";
    for r in &b.sharing {
        s += &format!(
            " {:<26} {:>15}  {:>21}  {:>4.1} %\n",
            r.what,
            r.blocks_shared,
            r.blocks_unshared,
            r.saved * 100.0
        );
    }
    s + &render_groups(b)
}

fn render_groups(b: &ModelBench) -> String {
    let mut s = String::new();
    if !b.groups.is_empty() {
        s += " layer groups (a window group's pool gives back what its window no longer reads) against one pool\n";
        s += " batch  context  tokens/s groups  tokens/s one pool  ratio  layer-blocks groups  one pool\n";
        for r in &b.groups {
            s += &format!(
                " {:>5}  {:>7}  {:>15.2}  {:>17.2}  {:>5.3}  {:>19}  {:>8}\n",
                r.batch,
                r.context,
                r.groups_tokens_per_s,
                r.one_pool_tokens_per_s,
                r.groups_tokens_per_s / r.one_pool_tokens_per_s.max(1e-9),
                r.groups_layer_blocks,
                r.one_pool_layer_blocks
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_untimed_attention_share_renders_as_such() {
        let row = |batch, share| DecodeRow {
            batch,
            tokens_per_s: 10.0,
            ms_per_step: 100.0,
            attention_share: share,
            dispatches: 200,
            matmul: "tiled".into(),
        };
        let b = ModelBench {
            model: "test.gguf".into(),
            groups: vec![],
            adapter: "test".into(),
            prompt_tokens: 4,
            decode_context: 24,
            prefill_tokens_per_s: 1.0,
            decode: vec![row(1, Some(0.25)), row(32, None)],
            matmuls: vec![],
            sharing: vec![],
        };
        let text = render(&b);
        assert!(text.contains("25.0 %"), "{text}");
        assert!(text.contains("- (not timed)"), "{text}");
        assert!(!text.contains("NaN"), "{text}");
    }
}
