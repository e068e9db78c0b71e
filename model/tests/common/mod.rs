//! Shared fixtures of the model tests: the reference fixture, the loaded
//! model (once per process) and a GPU model reused across tests (tests
//! take it in turn: one adapter, one pool).

#![allow(dead_code)]

use std::sync::{Mutex, MutexGuard, OnceLock};

use pagedattn::blocks::RequestId;
use pagedattn_model::config::model_path_or_skip;
use pagedattn_model::engine::{EngineConfig, Model};
use pagedattn_model::generate::open_device;
use pagedattn_model::load::{load, Loaded};
use pagedattn_model::serve::{Completion, Request, Server, ServerConfig};
use serde::Deserialize;

#[derive(Deserialize, Clone, Debug)]
pub struct Greedy {
    pub user: String,
    pub prompt_ids: Vec<u32>,
    pub tokens: Vec<u32>,
    pub top5: Vec<Vec<(u32, f64)>>,
    pub margins: Vec<f64>,
}

#[derive(Deserialize, Clone, Debug)]
pub struct BeamOut {
    pub tokens: Vec<u32>,
    pub score: f64,
}

#[derive(Deserialize, Clone, Debug)]
pub struct Beam {
    pub user: String,
    pub prompt_ids: Vec<u32>,
    pub width: usize,
    pub steps: usize,
    pub beams: Vec<BeamOut>,
    pub min_gap: f64,
}

#[derive(Deserialize, Clone, Debug)]
pub struct Sample {
    pub user: String,
    pub prompt_ids: Vec<u32>,
    pub n: usize,
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: u64,
    pub branches: Vec<Vec<u32>>,
    pub min_boundary: f64,
}

#[derive(Deserialize, Clone, Debug)]
pub struct Fixture {
    pub greedy: Vec<Greedy>,
    pub beam: Vec<Beam>,
    pub sample: Vec<Sample>,
}

pub fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixture/reference.json");
        let text = std::fs::read_to_string(path).expect("the committed reference fixture");
        serde_json::from_str(&text).expect("fixture parses")
    })
}

/// The model on the host, once per process; `None` when it is missing and
/// not required (the test then skips, saying so).
pub fn loaded(test: &str) -> Option<&'static Loaded> {
    static L: OnceLock<Option<Loaded>> = OnceLock::new();
    let path = model_path_or_skip(test)?;
    L.get_or_init(|| Some(load(&path).expect("the model loads")))
        .as_ref()
}

/// The pool the shared model is made with.
pub const POOL_BLOCKS: u32 = 160;
pub const MAX_ROWS: usize = 256;
pub const MAX_SEQS: usize = 16;

/// The backends `PAGEDATTN_BACKEND` names (all when unset): the tests read
/// the environment, the model crate does not.
pub fn backends() -> wgpu::Backends {
    match std::env::var("PAGEDATTN_BACKEND") {
        Ok(name) => {
            pagedattn::gpu::parse_backends(&name).expect("PAGEDATTN_BACKEND names a backend")
        }
        Err(_) => wgpu::Backends::all(),
    }
}

/// The GPU model shared by a test binary's tests (f32 pool, default kernel).
pub fn model(test: &str) -> Option<MutexGuard<'static, Option<Model>>> {
    static M: OnceLock<Mutex<Option<Model>>> = OnceLock::new();
    let l = loaded(test)?;
    let m = M.get_or_init(|| {
        let (device, queue, _) =
            open_device(backends()).expect("an adapter (PAGEDATTN_REQUIRE_GPU)");
        let cfg = EngineConfig {
            num_blocks: POOL_BLOCKS,
            max_rows: MAX_ROWS,
            max_logit_rows: MAX_SEQS,
            ..EngineConfig::default()
        };
        Mutex::new(Some(
            Model::new(&device, &queue, &l.weights, cfg).expect("model"),
        ))
    });
    Some(m.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Serves `requests` on the shared model with `cfg`, checks that no block
/// leaked, and gives the model back. Returns the completions in request
/// order and the server's stats.
pub fn serve(
    slot: &mut Option<Model>,
    cfg: ServerConfig,
    requests: Vec<Request>,
) -> (Vec<Completion>, pagedattn_model::serve::ServeStats, u64) {
    let model = slot.take().expect("the shared model");
    let mut server = Server::new(model, cfg).expect("server");
    let ids: Vec<RequestId> = requests
        .into_iter()
        .map(|r| server.add(r).expect("request"))
        .collect();
    let result = server.run(&mut |_, _| {});
    let hits = server.sched.blocks().prefix_hit_tokens();
    let st = server.sched.blocks().stats();
    let stats = server.stats;
    *slot = Some(server.into_model());
    let mut done = result.expect("serving");
    assert_eq!(st.free + st.evictable, st.total, "blocks leaked: {st:?}");
    done.sort_by_key(|c| ids.iter().position(|i| *i == c.request));
    (done, stats, hits)
}
