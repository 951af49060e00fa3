//! Background Responses: `POST /v1/responses` with `background: true` is answered as soon
//! as its provider has it — a response object with `status: "queued"` and an id of iop's
//! own — and goes on without its client: the edge reads the answer to its end (and bills
//! it) while the node keeps it ([`super::resume`]). `GET /v1/responses/{id}` answers the
//! response object as it stands (in progress, or complete with its output and usage);
//! `GET /v1/responses/{id}?stream=true` streams its events from the start, or after
//! `starting_after` (a `sequence_number`), and the answer goes on if that client leaves
//! too. Through any edge of the fleet, for as long as the node keeps the answer
//! (`dispatch.resume_keep_sec` after its end); only the API key that created it may read
//! it.
//!
//! With `stream: true` it streams at once, its events naming it by iop's id, and goes on
//! if the client leaves. Served for groups whose members all serve the Responses API
//! themselves (their answer is relayed as the provider streams it): the provider gets the
//! request streamed and not in the background. `POST /v1/responses/{id}/cancel` stops
//! one.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{Extension, Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use eventsource_stream::{EventStreamError, Eventsource};
use futures::StreamExt;
use iop_proto::ErrorCode;
use serde_json::{Value, json};

use super::error;
use super::passthrough::event_ids::ResumePoint;
use super::resume;
use crate::auth::Caller;
use crate::canonical::{ApiError, Decoded};
use crate::config::ProviderApi;
use crate::ledger::ClientApi;
use crate::service::answer::{BodyError, bounded_body};
use crate::service::tunnel::{TunnelHead, TunnelStream};
use crate::service::{Edge, provider_of};
use crate::surfaces::Surface;

/// Whether `decoded` is a background Responses request this edge serves; an error for one
/// it cannot.
pub fn requested(edge: &Edge, surface: Surface, decoded: &Decoded) -> Result<bool, ApiError> {
    if surface != Surface::Responses
        || decoded.native.request.get::<bool>("background") != Some(true)
    {
        return Ok(false);
    }
    let refuse = |message: String| {
        Err(ApiError::bad_request("unsupported_parameter", message).with_param("background"))
    };
    let config = edge.config();
    if config.dispatch.resume_keep_sec == 0 {
        return refuse(
            "background responses are off on this edge (dispatch.resume_keep_sec: 0)".into(),
        );
    }
    let native = config
        .model_groups
        .iter()
        .find(|g| g.name == decoded.model)
        .is_some_and(|group| {
            group.members.iter().all(|m| {
                provider_of(&config, &m.node, &m.provider)
                    .is_some_and(|p| p.serves(ProviderApi::Responses))
            })
        });
    if !native {
        return refuse(format!(
            "background responses need a model group whose members all serve the Responses \
             API themselves (`apis: [responses]`); {:?} has one that does not",
            decoded.model
        ));
    }
    Ok(true)
}

/// The id of the background response that is stream `stream` on node `node`.
pub fn response_id(node: &str, stream: &str) -> String {
    format!(
        "resp_{}",
        URL_SAFE_NO_PAD.encode(format!("{node}.{stream}"))
    )
}

/// Where background response `id` is (its node and stream), if it is one of iop's.
fn answer_of(id: &str) -> Option<ResumePoint> {
    let decoded = URL_SAFE_NO_PAD.decode(id.strip_prefix("resp_")?).ok()?;
    ResumePoint::parse(&format!("{}.0", String::from_utf8(decoded).ok()?))
}

/// The answer to a background request whose provider took it: streamed (`streamed`) with
/// its events naming it by iop's id, or its response object, `queued`; either way it goes
/// on to its end without a client. A provider's refusal (a status that is not 2xx) is
/// relayed as it is.
pub fn started(
    head: TunnelHead,
    mut stream: TunnelStream,
    group: &str,
    streamed: bool,
) -> Result<Response, ApiError> {
    let respond = super::passthrough::respond_head;
    if !(200..300).contains(&head.status) {
        return respond(head, stream, Surface::Responses, None, None);
    }
    let id = response_id(stream.core.node_id(), &stream.core.id);
    tracing::info!(node_id = stream.core.node_id(), stream_id = %stream.core.id, response_id = %id, "background response started");
    stream.core.background = true;
    stream.core.resume_grace = Some(resume::MAX_BACKGROUND);
    if streamed {
        return respond(head, stream, Surface::Responses, None, Some(&id));
    }
    // Dropped: the stream goes on, read to its end by the edge (`StreamCore::abandon`).
    drop(stream);
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(axum::Json(json!({
        "id": id,
        "object": "response",
        "created_at": created,
        "status": "queued",
        "background": true,
        "model": group,
        "output": [],
        "error": null,
        "incomplete_details": null,
        "parallel_tool_calls": true,
        "tool_choice": "auto",
        "tools": [],
        "usage": null,
    }))
    .into_response())
}

#[derive(Debug, serde::Deserialize)]
pub struct RetrieveParams {
    #[serde(default)]
    stream: bool,
    starting_after: Option<u64>,
}

/// `GET /v1/responses/{id}`.
pub async fn retrieve(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    Query(params): Query<RetrieveParams>,
    headers: HeaderMap,
) -> Response {
    let recorder = edge.start_request(ClientApi::Responses, &caller);
    let answer = match answer_of(&id) {
        None => Err(not_found(&id)),
        Some(point) if params.stream => {
            // Events are counted from 1; sequence numbers from 0.
            let after = params.starting_after.map_or(0, |n| n.saturating_add(1));
            let point = ResumePoint { after, ..point };
            resume::serve(
                &edge,
                Surface::Responses,
                &caller,
                &headers,
                point,
                &recorder,
                Some(&id),
            )
            .await
        }
        Some(point) => look(&edge, &caller, &headers, &id, point)
            .await
            .map(|object| axum::Json(object).into_response()),
    };
    match answer {
        Ok(response) => {
            recorder.responded(response.status().as_u16());
            response
        }
        Err(e) => {
            recorder.failed(e.reason, e.status.as_u16());
            error::response(Surface::Responses.error_shape(), e)
        }
    }
}

/// `POST /v1/responses/{id}/cancel`: stops a background response (its provider request
/// is dropped) and answers it as it stands, `cancelled` unless it had ended already.
pub async fn cancel(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let answer = async {
        let point = answer_of(&id).ok_or_else(|| not_found(&id))?;
        resume::stop(&edge, &caller, &headers, &point).await?;
        tracing::info!(node_id = %point.node, stream_id = %point.stream, response_id = %id, "background response cancelled by its client");
        let mut object = look(&edge, &caller, &headers, &id, point).await?;
        if !has_ended(&object) {
            object["status"] = json!("cancelled");
        }
        Ok::<_, ApiError>(object)
    };
    match answer.await {
        Ok(object) => axum::Json(object).into_response(),
        Err(e) => error::response(Surface::Responses.error_shape(), e),
    }
}

/// Whether a response object's status is a final one.
fn has_ended(object: &Value) -> bool {
    ["completed", "failed", "incomplete", "cancelled"]
        .contains(&object["status"].as_str().unwrap_or_default())
}

fn not_found(id: &str) -> ApiError {
    ApiError::of(
        ErrorCode::NotFound,
        format!(
            "no background response {id:?} is kept: it is not one of this fleet's, or its answer is no longer kept"
        ),
    )
}

/// The response object of background response `id` as it stands: the last one its events
/// carried (`response.created`, `response.in_progress`, `response.completed`, …), with
/// iop's id.
async fn look(
    edge: &Arc<Edge>,
    caller: &Caller,
    headers: &HeaderMap,
    id: &str,
    point: ResumePoint,
) -> Result<Value, ApiError> {
    let stream = resume::look(edge, caller, headers, &point).await?;
    let mut events = std::pin::pin!(bounded_body(stream).eventsource());
    let mut latest = None;
    let mut failed = None;
    while let Some(event) = events.next().await {
        match event {
            Ok(event) => {
                let mut data = serde_json::from_str::<Value>(&event.data).unwrap_or_default();
                if let Some(response) = data.get_mut("response") {
                    latest = Some(response.take());
                }
            }
            // The answer ended in an error (it was cancelled, or its provider failed).
            Err(EventStreamError::Transport(BodyError::Tunnel(e))) => {
                failed = Some(e);
                break;
            }
            // An event too large to read: the answer as it stood before it.
            Err(_) => break,
        }
    }
    let mut latest = latest.ok_or_else(|| not_found(id))?;
    latest["id"] = json!(id);
    latest["background"] = json!(true);
    if let Some(e) = failed.filter(|_| !has_ended(&latest)) {
        if e.error_code() == ErrorCode::Cancelled {
            latest["status"] = json!("cancelled");
        } else {
            latest["status"] = json!("failed");
            latest["error"] = json!({"code": e.error_code().as_str(), "message": e.message});
        }
    }
    Ok(latest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_id_names_its_node_and_stream() {
        let stream = "0123456789abcdef0123456789abcdef";
        let id = response_id("gpu.box-1", stream);
        assert!(id.starts_with("resp_"));
        let point = answer_of(&id).unwrap();
        assert_eq!(
            (point.node.as_str(), point.stream.as_str()),
            ("gpu.box-1", stream)
        );
        for other in ["resp_", "resp_!!", "chatcmpl-1", "resp_Z3B1"] {
            assert!(answer_of(other).is_none(), "{other}");
        }
    }
}
