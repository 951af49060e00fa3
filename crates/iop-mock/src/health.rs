//! The endpoints health checks use — vLLM's `GET /health`, Ollama's `GET /api/version`
//! (OpenAI-compatible checks use `GET /v1/models`) — and switches a test flips to make
//! the mock fail and recover while it keeps running: `POST /mock/faults` with
//! `{"requests": true}` answers every chat, completion and Ollama request with 500, and
//! `{"health": true}` answers the health endpoints (and `/v1/models`) with 503; `false`
//! turns them off again. `GET /mock/faults` shows them.

use std::sync::atomic::{AtomicBool, Ordering};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{Mock, bad_request, parse};

/// Failures a test switched on.
#[derive(Debug, Default)]
pub struct Faults {
    requests: AtomicBool,
    health: AtomicBool,
}

impl Faults {
    /// Every generation request answers 500.
    pub fn requests_fail(&self) -> bool {
        self.requests.load(Ordering::SeqCst)
    }

    /// The health endpoints answer 503.
    pub fn health_fails(&self) -> bool {
        self.health.load(Ordering::SeqCst)
    }

    fn view(&self) -> Value {
        json!({"requests": self.requests_fail(), "health": self.health_fails()})
    }
}

fn unhealthy() -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        axum::Json(json!({"error": "mock provider unhealthy (/mock/faults)"})),
    )
        .into_response()
}

/// vLLM's liveness endpoint: 200 with an empty body.
pub(crate) async fn health(State(mock): State<Mock>) -> Response {
    if mock.faults.health_fails() {
        return unhealthy();
    }
    StatusCode::OK.into_response()
}

/// Ollama's version endpoint.
pub(crate) async fn version(State(mock): State<Mock>) -> Response {
    if mock.faults.health_fails() {
        return unhealthy();
    }
    axum::Json(json!({"version": "0.0.0-iop-mock"})).into_response()
}

/// `GET /v1/models`, failing with the health switch.
pub(crate) async fn models(State(mock): State<Mock>) -> Response {
    if mock.faults.health_fails() {
        return unhealthy();
    }
    super::openai::models().await
}

pub(crate) async fn show_faults(State(mock): State<Mock>) -> Response {
    axum::Json(mock.faults.view()).into_response()
}

pub(crate) async fn set_faults(State(mock): State<Mock>, body: Bytes) -> Response {
    let body = match parse(&body) {
        Ok(b) => b,
        Err(e) => return bad_request(e),
    };
    for (key, flag) in [
        ("requests", &mock.faults.requests),
        ("health", &mock.faults.health),
    ] {
        if let Some(on) = body.get(key).and_then(Value::as_bool) {
            flag.store(on, Ordering::SeqCst);
        }
    }
    axum::Json(mock.faults.view()).into_response()
}
