//! What the handlers share: the engine's state and its command channel,
//! and the count of requests the server holds.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::engine::{Command, Shared};
use crate::ApiError;

/// What every handler holds.
pub struct App {
    pub shared: Arc<Shared>,
    pub commands: mpsc::UnboundedSender<Command>,
}

/// Counts `k` requests in, or refuses them with 429 when the server holds
/// its limit already.
pub fn admit(app: &App, k: usize) -> Result<(), ApiError> {
    let cfg = &app.shared.cfg;
    let limit = cfg.max_seqs + cfg.max_queue;
    let before = app.shared.in_flight.fetch_add(k, Ordering::SeqCst);
    if before + k > limit {
        app.shared.in_flight.fetch_sub(k, Ordering::SeqCst);
        return Err(ApiError::queue_full(before, limit));
    }
    Ok(())
}
