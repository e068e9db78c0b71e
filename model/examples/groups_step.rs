//! Times a decode step of a hybrid model (Gemma 3) with a pool per layer
//! group, whose window groups hold only their windows' blocks, against one
//! pool of every layer: the same sequences (`STEP_B` of `STEP_CTX` tokens,
//! past the window), the K/V left as the pools hold it (the cost does not
//! depend on the values), best of `STEP_N` steps per round, the two
//! alternating for `STEP_ROUNDS` rounds in one process. With and without
//! the logits (the LM head over 262,144 tokens dominates a Gemma step on a
//! CPU adapter). `STEP_MODEL`: the GGUF (default: Gemma 3 270M's). Not a
//! test: figures for benches/NOTES.md.

use std::time::Instant;

use pagedattn::blocks::HybridManager;
use pagedattn_model::engine::{EngineConfig, Model, StepInput};
use pagedattn_model::generate::open_device;

fn env(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (b, ctx, n, rounds) = (
        env("STEP_B", 1),
        env("STEP_CTX", 1024),
        env("STEP_N", 5),
        env("STEP_ROUNDS", 3),
    );
    let path = std::env::var_os("STEP_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "models/gemma-3-270m-q4_k_m.gguf".into());
    let l = pagedattn_model::load::load(&path)?;
    let (device, queue, adapter) = open_device(wgpu::Backends::all())?;
    let cfg = EngineConfig {
        num_blocks: 512,
        max_rows: b.max(1),
        max_logit_rows: b.max(1),
        ..EngineConfig::default()
    };
    let mut model = Model::new(&device, &queue, &l.weights, cfg)?;
    // Best step time (with logits, without), per mode: [groups, one pool].
    let mut best = [[f64::INFINITY; 2]; 2];
    let mut held = [0usize; 2];
    for round in 0..rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for mode in order {
            model.set_layer_groups(mode == 0, None)?;
            let layout = model.kv_layout().clone();
            let pools = vec![512; layout.groups().len()];
            let mut m = HybridManager::new(layout.clone(), &pools, 16, false)?;
            let seqs: Vec<_> = (0..b)
                .map(|i| m.add_sequence(&vec![7 + i as u32; ctx]))
                .collect::<Result<_, _>>()?;
            // The prompts count as written; the window groups release.
            let _ = m.batch_view(&seqs)?;
            for s in &seqs {
                m.append(s, &[9])?;
            }
            let views = m.batch_view(&seqs)?;
            held[mode] = seqs
                .iter()
                .map(|s| {
                    m.blocks_held(s).map(|h| {
                        h.iter()
                            .zip(layout.groups())
                            .map(|(b, g)| b * g.layers.len())
                            .sum::<usize>()
                    })
                })
                .sum::<Result<usize, _>>()?;
            let more: Vec<_> = views[1..].iter().collect();
            let tok = vec![9u32; b];
            let pos = vec![ctx as u32; b];
            let rows: Vec<u32> = (0..b as u32).collect();
            for (k, logit_rows) in [&rows[..], &[]].into_iter().enumerate() {
                for _ in 0..n {
                    let t = Instant::now();
                    model.forward(&StepInput {
                        view: &views[0],
                        more: &more,
                        tokens: &tok,
                        positions: &pos,
                        logit_rows,
                    })?;
                    best[mode][k] = best[mode][k].min(t.elapsed().as_secs_f64());
                }
            }
        }
    }
    println!("{adapter}: decode at batch {b}, context {ctx}, best of {n} steps x {rounds} rounds");
    for (mode, name) in ["layer groups", "one pool"].iter().enumerate() {
        println!(
            "  {name:>12}: {:.1} ms a step, {:.1} ms without the logits; {} layer-blocks held",
            best[mode][0] * 1e3,
            best[mode][1] * 1e3,
            held[mode]
        );
    }
    println!(
        "  groups / one pool: {:.3} (with logits), {:.3} (without)",
        best[0][0] / best[1][0],
        best[0][1] / best[1][1]
    );
    Ok(())
}
