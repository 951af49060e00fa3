//! `POST /v1/messages/count_tokens`: Anthropic's token counter, which its SDKs and Claude
//! Code call before they send a conversation. The request is a Messages request without
//! `max_tokens`; the answer is `{"input_tokens": N}`.
//!
//! The count comes from the model group's own tokenizer where a member has one (see
//! `service::token_count`: a member that serves Messages counts the request itself,
//! llama-server and vLLM count the translated chat with `/tokenize`); otherwise it is the
//! edge's estimate of the translated prompt (the JSON of its messages and tools, four
//! bytes a token: what admission reserves for the request). `x-iop-token-count` says which:
//! `provider`, `tokenizer` or `estimated`. Errors are in Anthropic's shape.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Extension, Request, State};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

use super::body::JsonBody;
use super::error;
use crate::auth::Caller;
use crate::canonical::request::estimate_input_tokens;
use crate::canonical::{ApiError, ClientRequest};
use crate::service::Edge;
use crate::service::token_count::TokenCount;
use crate::surfaces::openai::requested_group;
use crate::surfaces::{ErrorShape, messages};

pub fn routes() -> Router<Arc<Edge>> {
    Router::new().route("/v1/messages/count_tokens", post(count_tokens))
}

async fn count_tokens(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    request: Request,
) -> Response {
    match count(&edge, &caller, request).await {
        Ok(TokenCount {
            input_tokens,
            counted_by,
        }) => {
            let mut response = axum::Json(json!({"input_tokens": input_tokens})).into_response();
            if let Ok(by) = HeaderValue::from_str(&counted_by) {
                response.headers_mut().insert("x-iop-token-count", by);
            }
            response
        }
        Err(e) => error::response(ErrorShape::Anthropic, e),
    }
}

async fn count(
    edge: &Arc<Edge>,
    caller: &Caller,
    request: Request,
) -> Result<TokenCount, ApiError> {
    let JsonBody(body) = JsonBody::read(request, edge, false).await?;
    let request = ClientRequest::parse(&body)?;
    let name = requested_group(&request)?;
    let group = edge.model_group_for(caller, &name, "GET /v1/models")?;
    let chat = messages::request::to_chat(&request)?;
    if let Some(count) = edge.count_tokens(&group, &request.to_map(), &chat).await {
        return Ok(count);
    }
    let chat = serde_json::to_vec(&Value::Object(chat)).expect("JSON values serialize");
    Ok(TokenCount {
        input_tokens: estimate_input_tokens(&ClientRequest::parse(&chat)?),
        counted_by: "estimated".into(),
    })
}
