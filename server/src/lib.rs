//! `pagedattn serve`: an OpenAI-compatible server over the model engine.
//!
//! - [`config`]: what the server is started with, and the API-key file
//!   that maps bearer keys to tenants (each its own prefix-cache salt).
//! - `engine`: the one thread that owns the device, the model and the
//!   library `Scheduler`, stepping while there is work; handlers talk to
//!   it through channels, each request streaming back through its own.
//! - `routes` and `generate`: the HTTP layer (axum over hyper):
//!   `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`,
//!   `/metrics`, `/tokenize`, `/detokenize`; server-sent events for
//!   streams.
//! - `api` and `chat`: request bodies checked field by field, and the
//!   GGUF's chat template.
//!
//! A client that leaves has its request aborted before the next step; bad
//! input gets an OpenAI-shaped error naming the value and the limit, and
//! the server serves on.

mod api;
mod app;
mod chat;
pub mod config;
mod engine;
mod error;
mod fields;
mod generate;
mod metrics;
mod routes;
mod text;

use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

pub use config::{ApiKeys, ServeConfig};
pub use error::{ApiError, ServeError};

/// Serves on `listener` until `shutdown` resolves: loads the model on the
/// engine thread (`/health` answers 503 meanwhile), serves, then drains:
/// new requests get 503, requests in flight get `shutdown_timeout` to
/// finish before they are aborted. `ready(addr, adapter)` is called once
/// the model is loaded.
pub async fn serve(
    cfg: ServeConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()>,
    ready: impl FnOnce(SocketAddr, &str),
) -> Result<(), ServeError> {
    cfg.check()?;
    let addr = listener.local_addr()?;
    let timeout = cfg.shutdown_timeout;
    let shared = Arc::new(engine::Shared::new(cfg));
    let (commands, rx) = mpsc::unbounded_channel();
    let (loaded_tx, loaded_rx) = oneshot::channel();
    let engine = engine::spawn(shared.clone(), rx, loaded_tx)?;
    let app = Arc::new(app::App {
        shared: shared.clone(),
        commands,
    });
    let (grace_tx, grace_rx) = oneshot::channel::<()>();
    let http = tokio::spawn(
        axum::serve(listener, routes::router(app.clone()))
            .with_graceful_shutdown(async {
                let _ = grace_rx.await;
            })
            .into_future(),
    );
    tokio::pin!(shutdown);
    let loaded = tokio::select! {
        r = loaded_rx => Some(r),
        _ = &mut shutdown => None,
    };
    let result = match loaded {
        Some(Ok(Ok(()))) => {
            let adapter = shared.model.get().map_or("", |m| m.adapter.as_str());
            ready(addr, adapter);
            shutdown.await;
            Ok(())
        }
        Some(Ok(Err(why))) => Err(ServeError::Config(format!(
            "the model could not be loaded: {why}"
        ))),
        Some(Err(_)) => Err(ServeError::Config(
            "the engine thread ended while loading".into(),
        )),
        None => Ok(()),
    };
    // Drain: refuse new work, stop accepting, let what runs finish.
    shared.draining.store(true, Ordering::SeqCst);
    let _ = grace_tx.send(());
    let drained = tokio::time::timeout(timeout, async {
        while shared.in_flight.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    if drained.is_err() {
        let _ = app.commands.send(engine::Command::AbortAll(
            "the server is shutting down".into(),
        ));
    }
    // Streams end once their requests do; a connection still open after
    // that is cut.
    let http_abort = http.abort_handle();
    if tokio::time::timeout(Duration::from_secs(5), http)
        .await
        .is_err()
    {
        http_abort.abort();
    }
    drop(app);
    // The engine ends once every sender is gone and its work is done.
    let _ = tokio::task::spawn_blocking(move || engine.join()).await;
    result
}

/// Resolves at SIGINT or SIGTERM.
pub async fn signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// `pagedattn serve`: binds, serves until SIGINT or SIGTERM, exits.
pub fn run(cfg: ServeConfig) -> Result<(), ServeError> {
    cfg.check()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let addr = SocketAddr::new(cfg.host, cfg.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Bind { addr, source })?;
        let name = cfg.model_name();
        let bound = listener.local_addr()?;
        eprintln!("pagedattn serve: listening on http://{bound} (loading {name} ...)");
        serve(cfg, listener, signal(), |addr, adapter| {
            eprintln!("pagedattn serve: ready on http://{addr}: {name} on {adapter}");
        })
        .await?;
        eprintln!("pagedattn serve: stopped");
        Ok(())
    })
}

/// A server on its own thread and runtime (tests, benchmarks): started
/// with [`Handle::start`], stopped with [`Handle::stop`].
pub struct Handle {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), ServeError>>>,
}

impl Handle {
    /// Binds `cfg`'s host and port (port 0: any free one), then serves on
    /// a thread of its own; returns once the model is loaded.
    pub fn start(cfg: ServeConfig) -> Result<Self, ServeError> {
        cfg.check()?;
        let addr = SocketAddr::new(cfg.host, cfg.port);
        let std_listener = std::net::TcpListener::bind(addr)
            .map_err(|source| ServeError::Bind { addr, source })?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("pagedattn-serve".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(std_listener)?;
                    let stop = async {
                        let _ = stop_rx.await;
                    };
                    serve(cfg, listener, stop, |_, _| {
                        let _ = ready_tx.send(());
                    })
                    .await
                })
            })?;
        let mut h = Self {
            addr,
            stop: Some(stop_tx),
            thread: Some(thread),
        };
        if ready_rx.recv().is_err() {
            // The thread ended before the model was ready: its error.
            return Err(h.join().unwrap_or_else(|| {
                ServeError::Config("the server stopped before it was ready".into())
            }));
        }
        Ok(h)
    }

    /// Shuts the server down as SIGTERM would, and waits for it.
    pub fn stop(mut self) -> Result<(), ServeError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.join() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn join(&mut self) -> Option<ServeError> {
        let t = self.thread.take()?;
        match t.join() {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some(ServeError::Config("the server thread panicked".into())),
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = self.join();
    }
}
