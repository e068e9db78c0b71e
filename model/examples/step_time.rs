//! Times the model's forward step on the default adapter: a prefill of
//! `P` rows, then decode steps at batch `B`, with and without the logits
//! (the final norm and the LM head: Gemma 3's covers 262,144 tokens) (env
//! `STEP_P`, `STEP_B`, `STEP_N` repetitions; `STEP_MATMUL` = `workgroup`
//! or `subgroup` picks the matmul's staging, else the engine's `Auto`;
//! `STEP_MODEL` another GGUF than SmolLM2's). For comparing kernel
//! variants with farm-bench or by eye; not a test.

use std::time::Instant;

use pagedattn::blocks::{BlockManager, BlockManagerConfig};
use pagedattn_model::config::default_model_path;
use pagedattn_model::engine::{EngineConfig, MatmulStaging, Model, StepInput};
use pagedattn_model::generate::open_device;

fn env(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (p, b, n) = (env("STEP_P", 64), env("STEP_B", 8), env("STEP_N", 3));
    let path = std::env::var_os("STEP_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(default_model_path);
    let l = pagedattn_model::load::load(&path)?;
    let (device, queue, adapter) = open_device(wgpu::Backends::all())?;
    let cfg = EngineConfig {
        num_blocks: 128,
        max_rows: p.max(b),
        max_logit_rows: b.max(1),
        matmul: match std::env::var("STEP_MATMUL").as_deref() {
            Ok("workgroup") => MatmulStaging::Workgroup,
            Ok("subgroup") => MatmulStaging::Subgroup,
            _ => MatmulStaging::Auto,
        },
        // One block manager drives every layer here.
        layer_groups: false,
        ..EngineConfig::default()
    };
    let mut model = Model::new(&device, &queue, &l.weights, cfg)?;
    let mut bm = BlockManager::new(BlockManagerConfig::new(128, 16))?;
    let time = |model: &mut Model,
                view: &pagedattn::blocks::BatchView,
                tokens: &[u32],
                pos: &[u32],
                rows: &[u32]| {
        let mut best = f64::INFINITY;
        for _ in 0..n {
            let t = Instant::now();
            model
                .forward(&StepInput {
                    view,
                    more: &[],
                    tokens,
                    positions: pos,
                    logit_rows: rows,
                })
                .expect("forward");
            best = best.min(t.elapsed().as_secs_f64());
        }
        best
    };
    // Prefill of one sequence of p rows.
    let toks: Vec<u32> = (0..p as u32).map(|i| 100 + i).collect();
    let id = bm.add_sequence(&toks)?;
    let view = bm.batch_view(&[id])?;
    let pos: Vec<u32> = (0..p as u32).collect();
    let tp = time(&mut model, &view, &toks, &pos, &[p as u32 - 1]);
    bm.free(id)?;
    // Decode at batch b, each sequence 32 tokens long.
    let ids: Vec<_> = (0..b)
        .map(|i| bm.add_sequence(&[7 + i as u32; 32]))
        .collect::<Result<_, _>>()?;
    let _ = bm.batch_view(&ids)?;
    for &i in &ids {
        bm.append(i, &[9])?;
    }
    let view = bm.batch_view(&ids)?;
    let tok = vec![9u32; b];
    let pos = vec![32u32; b];
    let rows: Vec<u32> = (0..b as u32).collect();
    let td = time(&mut model, &view, &tok, &pos, &rows);
    let tn = time(&mut model, &view, &tok, &pos, &[]);
    println!(
        "{adapter}: prefill {p} rows {:.1} ms ({:.1} tokens/s); decode batch {b} {:.1} ms ({:.1} tokens/s), of which the logits (final norm, LM head of {} tokens, readback) {:.1} ms",
        tp * 1e3,
        p as f64 / tp,
        td * 1e3,
        b as f64 / td,
        l.weights.shape.vocab,
        (td - tn) * 1e3
    );
    Ok(())
}
