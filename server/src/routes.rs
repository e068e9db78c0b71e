//! The routes: a thin axum layer over the engine. Handlers authenticate,
//! check, hand jobs to the engine thread and shape its events as OpenAI
//! responses; they never block on the engine.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::api::Route;
use crate::app::App;
use crate::{generate, ApiError};

/// The server's routes.
pub fn router(app: Arc<App>) -> Router {
    let limit = app.shared.cfg.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(unknown_route)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(app)
}

/// The caller's tenant: from its bearer key when the server has a key
/// file, else the one tenant.
fn tenant(app: &App, headers: &HeaderMap) -> Result<String, ApiError> {
    let Some(keys) = &app.shared.cfg.api_keys else {
        return Ok("default".into());
    };
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| {
            ApiError::unauthorized("no API key: send the header `Authorization: Bearer KEY`")
        })?;
    let key = auth
        .strip_prefix("Bearer ")
        .ok_or_else(|| ApiError::unauthorized("the Authorization header must be `Bearer KEY`"))?;
    keys.tenant(key.trim())
        .map(str::to_string)
        .ok_or_else(|| ApiError::unauthorized("invalid API key"))
}

/// The body, or the 413 / 400 its rejection means.
fn body(app: &App, b: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    b.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(app.shared.cfg.max_body_bytes)
        } else {
            ApiError::invalid(format!("the body could not be read: {}", r.body_text()))
        }
    })
}

async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    run(app, Route::Completions, headers, b).await
}

async fn chat(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    run(app, Route::Chat, headers, b).await
}

async fn run(
    app: Arc<App>,
    route: Route,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let tenant = tenant(&app, &headers)?;
        let bytes = body(&app, b)?;
        generate::respond(app.clone(), route, &bytes, &tenant).await
    };
    result.await.unwrap_or_else(IntoResponse::into_response)
}

fn created() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = tenant(&app, &headers) {
        return e.into_response();
    }
    let s = &app.shared;
    let ctx = s.model.get().map(|m| m.context);
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.model_name,
            "object": "model",
            "created": created(),
            "owned_by": "pagedattn",
            "max_model_len": ctx,
        }]
    }))
    .into_response()
}

/// 200 once the model is loaded and warmed up; 503 while loading, after a
/// failed load, or while shutting down.
async fn health(State(app): State<Arc<App>>) -> Response {
    match app.shared.ready() {
        Ok(_) => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.shared.metrics.render(),
    )
        .into_response()
}

/// `{"prompt": "..."}` or `{"messages": [...]}` to token ids (vLLM's and
/// llama.cpp's `/tokenize`).
async fn tokenize(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let result = (|| {
        tenant(&app, &headers)?;
        let bytes = body(&app, b)?;
        let info = app.shared.ready()?;
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}")))?;
        let text = match (v.get("prompt"), v.get("messages")) {
            (Some(Value::String(p)), None) => p.clone(),
            (None, Some(m)) => {
                let msgs: Vec<crate::chat::Message> = serde_json::from_value(m.clone())
                    .map_err(|e| ApiError::param("messages", format!("messages: {e}")))?;
                crate::chat::render(&info.tokenizer, &msgs)?
            }
            _ => {
                return Err(ApiError::invalid(
                    "give either prompt (a string) or messages",
                ))
            }
        };
        let ids = info
            .tokenizer
            .encode_prompt(&text)
            .map_err(|e| ApiError::param("prompt", e.to_string()))?;
        Ok(Json(json!({
            "count": ids.len(),
            "max_model_len": info.context,
            "tokens": ids,
        })))
    })();
    result.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

/// `{"tokens": [...]}` to text.
async fn detokenize(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    b: Result<Bytes, BytesRejection>,
) -> Response {
    let result = (|| {
        tenant(&app, &headers)?;
        let bytes = body(&app, b)?;
        let info = app.shared.ready()?;
        #[derive(serde::Deserialize)]
        struct Req {
            tokens: Vec<u64>,
        }
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}")))?;
        let r: Req = serde_path_to_error::deserialize(v).map_err(|e| {
            let path = e.path().to_string();
            ApiError::param(&path, format!("{path}: {}", e.inner()))
        })?;
        if let Some(t) = r.tokens.iter().find(|&&t| t as usize >= info.vocab) {
            return Err(ApiError::param(
                "tokens",
                format!("token {t} outside the vocabulary of {}", info.vocab),
            ));
        }
        let ids: Vec<u32> = r.tokens.iter().map(|&t| t as u32).collect();
        Ok(Json(json!({ "prompt": info.tokenizer.decode(&ids) })))
    })();
    result.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

async fn unknown_route(uri: axum::http::Uri) -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "not_found_error",
        message: format!(
            "no route {}: this server has /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize",
            uri.path()
        ),
        param: None,
        retry_after: None,
    }
    .into_response()
}
