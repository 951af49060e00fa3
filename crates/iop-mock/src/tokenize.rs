//! vLLM's `POST /tokenize`, as a counting backend for token counts: a chat request
//! (`messages`, with `tools`) or a `prompt` is counted at four bytes a token of its JSON
//! text, after a short pause (so counts at once overlap, as on a real server), and
//! answered as vLLM does: `{"count": N, "max_model_len": M, "tokens": [...]}`. Every
//! call is counted in `/mock/stats` (`tokenize_requests`, `peak_tokenize_in_flight`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::Mock;

/// How long a count takes.
const COUNT_PAUSE: Duration = Duration::from_millis(20);
/// The context window it reports.
const MAX_MODEL_LEN: u64 = 32_768;

pub(crate) async fn tokenize(State(mock): State<Mock>, body: Bytes) -> Response {
    let stats = &mock.stats;
    stats.tokenize_requests.fetch_add(1, Ordering::SeqCst);
    let now = stats.tokenize_in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    stats
        .peak_tokenize_in_flight
        .fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(COUNT_PAUSE).await;
    stats.tokenize_in_flight.fetch_sub(1, Ordering::SeqCst);
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        let error = json!({"object": "error", "message": "the body is not JSON", "type": "BadRequestError", "code": 400});
        return (StatusCode::BAD_REQUEST, Json(error)).into_response();
    };
    let counted = match (request.get("messages"), request.get("prompt")) {
        (Some(messages), _) => {
            messages.to_string().len() + request.get("tools").map_or(0, |t| t.to_string().len())
        }
        (None, Some(Value::String(prompt))) => prompt.len(),
        _ => {
            let error = json!({"object": "error", "message": "either `messages` or `prompt` is required", "type": "BadRequestError", "code": 400});
            return (StatusCode::BAD_REQUEST, Json(error)).into_response();
        }
    };
    let count = counted.div_ceil(4) as u64;
    Json(json!({
        "count": count,
        "max_model_len": MAX_MODEL_LEN,
        "tokens": (0..count.min(MAX_MODEL_LEN)).map(|i| i % 32_000).collect::<Vec<u64>>(),
        "token_strs": null,
    }))
    .into_response()
}
