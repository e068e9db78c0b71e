//! The crate's one error type: every failure names the value and the limit.

use std::path::PathBuf;

/// Everything loading and serving the model reports instead of panicking.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The model file is not there.
    #[error("model file {path} not found: fetch it with `bash scripts/fetch-model.sh` (or pass --model PATH)")]
    Missing { path: PathBuf },
    /// The file could not be read.
    #[error("reading {path}: {reason}")]
    Io { path: PathBuf, reason: String },
    /// The GGUF container is malformed.
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    /// The model's configuration is not one this engine runs.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The tokenizer could not be built.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// A weight of the wrong shape or format.
    #[error("model shape: {0}")]
    Shape(String),
    /// A step the engine cannot run.
    #[error("step: {0}")]
    Step(String),
    /// A request or sampling parameter out of range.
    #[error("{0}")]
    Request(String),
    /// From pagedattn's GPU layer.
    #[error(transparent)]
    Gpu(#[from] pagedattn::gpu::GpuError),
    /// From pagedattn's scheduler.
    #[error(transparent)]
    Scheduler(#[from] pagedattn::blocks::SchedulerError),
    /// A step failed to run; the requests it could have touched were
    /// dropped (their blocks freed), and the server serves on.
    #[error("{source} (requests dropped: {})", list(aborted))]
    StepFailed {
        aborted: Vec<pagedattn::blocks::RequestId>,
        source: Box<ModelError>,
    },
    /// No adapter or device.
    #[error("device: {0}")]
    Device(String),
}

fn list(ids: &[pagedattn::blocks::RequestId]) -> String {
    let names: Vec<String> = ids.iter().map(|r| r.to_string()).collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}
