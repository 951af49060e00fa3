//! A client resumes a streamed answer: it sends its request again with the id of the
//! last event it received in `Last-Event-ID` (ids this fleet gave:
//! [`super::passthrough::event_ids`]). The answer is not run again: the node that holds
//! it — named in the id, linked to every edge — replays it from its start and goes on
//! with it if it still runs, and the events the client has are left out. Any edge of the
//! fleet serves the resume, so a client whose edge died resumes through another.
//!
//! Only the API key that asked may resume an answer; an answer the node no longer keeps
//! (`dispatch.resume_keep_sec` after its end), or one whose node is not linked to this
//! edge, answers with an error in the API's own shape. An id this fleet did not give is
//! ignored: the request is served as a new one.

use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use axum::response::Response;
use iop_proto::ErrorCode;

use super::passthrough::event_ids::{LAST_EVENT_ID, ResumePoint};
use super::{passthrough, request_id};
use crate::auth::Caller;
use crate::canonical::ApiError;
use crate::ledger::RequestRecorder;
use crate::service::Edge;
use crate::service::stream::{StreamLimits, StreamTerms};
use crate::service::tunnel::{ResumeMode, TunnelHead, TunnelItem, TunnelStream};
use crate::surfaces::Surface;

/// How long a background response goes on without a client at most.
pub const MAX_BACKGROUND: Duration = Duration::from_secs(24 * 3600);

/// The answer a request resumes, if it carries a `Last-Event-ID` this fleet gave and the
/// edge keeps answers resumable.
pub fn requested(edge: &Edge, surface: Surface, headers: &HeaderMap) -> Option<ResumePoint> {
    if matches!(surface, Surface::Ollama(_)) || edge.config().dispatch.resume_keep_sec == 0 {
        return None;
    }
    let id = headers.get(LAST_EVENT_ID)?.to_str().ok()?;
    ResumePoint::parse(id.trim())
}

/// Serves the rest of answer `point` to `caller`; a background response's (named
/// `background` by iop) goes on if this client leaves too.
pub async fn serve(
    edge: &Arc<Edge>,
    surface: Surface,
    caller: &Caller,
    headers: &HeaderMap,
    point: ResumePoint,
    recorder: &RequestRecorder,
    background: Option<&str>,
) -> Result<Response, ApiError> {
    tracing::info!(node_id = %point.node, stream_id = %point.stream, after = point.after, "a client resumes an answer");
    recorder.dispatched(&point.node, "", "tunnel");
    let (head, mut stream) = open(edge, caller, headers, &point, ResumeMode::Take).await?;
    stream.serve(recorder.clone());
    if background.is_some() {
        stream.core.background = true;
        stream.core.resume_grace = Some(MAX_BACKGROUND);
    }
    passthrough::respond_head(head, stream, surface, Some(point), background)
}

/// A look at answer `point` as the node keeps it now: its frames so far, then an end; the
/// answer stays where it is, and nothing is billed for the look.
pub async fn look(
    edge: &Arc<Edge>,
    caller: &Caller,
    headers: &HeaderMap,
    point: &ResumePoint,
) -> Result<TunnelStream, ApiError> {
    let (head, mut stream) = open(edge, caller, headers, point, ResumeMode::Peek).await?;
    stream.replay_head(head);
    Ok(stream)
}

/// Stops answer `point` (its client cancels it): done once the node says so.
pub async fn stop(
    edge: &Arc<Edge>,
    caller: &Caller,
    headers: &HeaderMap,
    point: &ResumePoint,
) -> Result<(), ApiError> {
    let mut stream = start(edge, caller, headers, point, ResumeMode::Stop).await?;
    loop {
        match stream.next().await {
            Some(TunnelItem::End) | None => return Ok(()),
            Some(TunnelItem::Error(e)) => return Err(not_kept(e)),
            Some(_) => {}
        }
    }
}

/// Asks the node that holds answer `point` for it (`mode`) and waits for its head.
async fn open(
    edge: &Arc<Edge>,
    caller: &Caller,
    headers: &HeaderMap,
    point: &ResumePoint,
    mode: ResumeMode,
) -> Result<(TunnelHead, TunnelStream), ApiError> {
    let mut stream = start(edge, caller, headers, point, mode).await?;
    let head = stream.head().await.map_err(not_kept)?;
    Ok((head, stream))
}

/// Sends the node that holds answer `point` what `mode` asks.
async fn start(
    edge: &Arc<Edge>,
    caller: &Caller,
    headers: &HeaderMap,
    point: &ResumePoint,
    mode: ResumeMode,
) -> Result<TunnelStream, ApiError> {
    let Some(session) = edge.session(&point.node) else {
        return Err(ApiError::of(
            ErrorCode::NotFound,
            format!(
                "this answer cannot be resumed here: node {:?}, which holds it, is not linked \
                 to this edge",
                point.node
            ),
        ));
    };
    let terms = StreamTerms {
        limits: StreamLimits {
            ack_timeout: edge.config().dispatch.ack_timeout(),
            ..Default::default()
        },
        ..Default::default()
    };
    edge.resume_tunnel(
        session,
        &point.stream,
        caller.owner().unwrap_or_default(),
        request_id::of(headers).to_string(),
        terms,
        mode,
    )
    .await
    .map_err(ApiError::from)
}

/// The error of an answer the node does not have (any longer, or not for this caller):
/// a `404`; other errors as they are.
fn not_kept(e: iop_proto::pb::TunnelError) -> ApiError {
    if e.error_code() == ErrorCode::NodeDisconnected {
        return ApiError::of(ErrorCode::NotFound, e.message);
    }
    ApiError::from_tunnel_error(&e)
}
