//! Errors: what a request gets back (OpenAI's shape, with the status
//! code), and what stops the server from starting.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// An error answered to one request, as OpenAI's API shapes it:
/// `{"error": {"message", "type", "param", "code"}}`. The message names
/// the value and the limit it breaks.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `rate_limit_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault, where there is one.
    pub param: Option<String>,
    /// Seconds for a `Retry-After` header (429 and 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            retry_after: None,
        }
    }

    /// 400: a value out of range, a wrong type, malformed JSON.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the field at fault.
    pub fn param(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.to_string()),
            ..Self::invalid(message)
        }
    }

    /// 401: a missing or unknown API key.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
    }

    /// 404: a model the server does not serve.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            param: Some("model".into()),
            ..Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
        }
    }

    /// 413: a body over the size limit.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is over the limit of {limit} bytes (--max-body-bytes)"),
        )
    }

    /// 429 with `Retry-After`: the queue is full.
    pub fn queue_full(in_flight: usize, limit: usize) -> Self {
        Self {
            retry_after: Some(1),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!(
                    "the server holds {in_flight} requests, its limit (--max-seqs + --max-queue = {limit}); retry later"
                ),
            )
        }
    }

    /// 503 with `Retry-After`: loading, or shutting down.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                message,
            )
        }
    }

    /// 500: the engine failed the request.
    pub fn server(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// What stops `pagedattn serve` from starting or running.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// A flag or file that is not usable; names the value and the limit.
    #[error("{0}")]
    Config(String),
    /// The address could not be bound.
    #[error("could not listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    /// The model could not be loaded or the engine could not start.
    #[error(transparent)]
    Model(#[from] pagedattn_model::ModelError),
    /// I/O of the server itself.
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}
