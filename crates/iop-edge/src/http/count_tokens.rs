//! `POST /v1/messages/count_tokens`: Anthropic's token counter, which its SDKs and Claude
//! Code call before they send a conversation. The request is a Messages request without
//! `max_tokens`; the answer is `{"input_tokens": N}`.
//!
//! A count costs the fleet work (a tokenizer call on a provider), so it takes the path
//! of every model request: its body is read and decoded by the large-body reader (off the
//! event loop unless small, under the key's share of large bodies), it is admitted by the
//! key's allowlist and limits (`requests_per_minute`, `max_concurrent`; it reserves no
//! tokens and bills none), and it is recorded in the usage ledger with `api:
//! count_tokens`.
//!
//! The count comes from the model group's own tokenizer where a member has one (see
//! `service::token_count`: each member asked at most once, all within 5 s; a member that
//! serves Messages counts the request itself, llama-server and vLLM count the translated
//! chat with `/tokenize`); otherwise it is the edge's estimate of the translated prompt
//! (the JSON of its messages and tools, four bytes a token: what admission reserves for
//! the request). `x-iop-token-count` says which: `provider`, `tokenizer` or `estimated`.
//! Errors are in Anthropic's shape.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, Request, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

use super::decode::LargeBodies;
use super::error;
use crate::auth::Caller;
use crate::canonical::request::estimate_input_tokens;
use crate::canonical::{ApiError, ClientRequest};
use crate::ledger::{ClientApi, RequestRecorder};
use crate::service::Edge;
use crate::service::pipeline::{AdmitTarget, TokenEstimate};
use crate::service::token_count::{CountBodies, TokenCount};
use crate::surfaces::openai::requested_group;
use crate::surfaces::{ErrorShape, messages};

pub fn routes(large: Arc<LargeBodies>) -> Router<Arc<Edge>> {
    Router::new().route(
        "/v1/messages/count_tokens",
        post(
            move |State(edge): State<Arc<Edge>>,
                  Extension(caller): Extension<Caller>,
                  headers: HeaderMap,
                  request: Request| async move {
                count_tokens(edge, large, caller, headers, request).await
            },
        ),
    )
}

async fn count_tokens(
    edge: Arc<Edge>,
    large: Arc<LargeBodies>,
    caller: Caller,
    headers: HeaderMap,
    request: Request,
) -> Response {
    let recorder = edge.start_request(ClientApi::CountTokens, &caller);
    match count(&edge, &large, &caller, &headers, request, &recorder).await {
        Ok(TokenCount {
            input_tokens,
            counted_by,
        }) => {
            recorder.responded(200);
            let mut response = axum::Json(json!({"input_tokens": input_tokens})).into_response();
            if let Ok(by) = HeaderValue::from_str(&counted_by) {
                response.headers_mut().insert("x-iop-token-count", by);
            }
            response
        }
        Err(e) => {
            recorder.failed(e.reason, e.status.as_u16());
            error::response(ErrorShape::Anthropic, e)
        }
    }
}

/// What a count needs from the client's request, built off the event loop.
struct Decoded {
    /// The model group the client named.
    model: String,
    bodies: CountBodies,
    /// The edge's estimate of the translated prompt.
    estimate: u64,
}

async fn count(
    edge: &Arc<Edge>,
    large: &Arc<LargeBodies>,
    caller: &Caller,
    headers: &HeaderMap,
    request: Request,
    recorder: &RequestRecorder,
) -> Result<TokenCount, ApiError> {
    let key = caller.key_name().unwrap_or("");
    let body = large.read(edge, key, request, headers, false).await?;
    // The turn (a large body's place in its key's share) is held until the count ends.
    let (decoded, _turn) = large.work(body, key, decode).await?;
    let target = AdmitTarget::Model {
        name: &decoded.model,
        models_endpoint: "GET /v1/models",
    };
    // A count bills no tokens, so it reserves none.
    let estimate = TokenEstimate {
        input: 0,
        max_output: Some(0),
    };
    let group = edge.admit(caller, target, estimate, recorder).await?;
    if let Some(count) = edge.count_tokens(&group, &decoded.bodies, recorder).await {
        return Ok(count);
    }
    Ok(TokenCount {
        input_tokens: decoded.estimate,
        counted_by: "estimated".into(),
    })
}

/// Parses and translates a count request: the group it names, the request as a member
/// that serves Messages counts it and its chat translation (both without `model`, which
/// each member's own replaces), and the estimate.
fn decode(body: Bytes) -> Result<Decoded, ApiError> {
    let request = ClientRequest::parse(&body)?;
    let model = requested_group(&request)?;
    let mut chat = messages::request::to_chat(&request)?;
    chat.remove("model");
    let chat = Value::Object(chat).to_string();
    // The estimate reads only the prompt's fields, so the chat without `model` serves.
    let estimate = estimate_input_tokens(&ClientRequest::parse(chat.as_bytes())?);
    let mut messages = request.to_map();
    messages.remove("model");
    Ok(Decoded {
        model,
        bodies: CountBodies {
            messages: Value::Object(messages).to_string(),
            chat,
        },
        estimate,
    })
}
