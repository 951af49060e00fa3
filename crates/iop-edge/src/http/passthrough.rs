//! Writes a provider tunnel's frames to the client: the provider's status, its end-to-end
//! headers, and its body bytes untouched, chunk by chunk as they arrive (SSE included).
//!
//! The head is checked first ([`head`]): a status or headers a client should never see
//! become a 502. An error before the response head becomes an OpenAI error with a status
//! saying where it failed; an error after the body began ends an SSE stream with an error
//! event on its own event boundary ([`sse`]: an incomplete provider event is held back
//! and dropped), and aborts any other body (the client sees a truncated response, never a
//! wrong one).

pub mod event_ids;
pub mod head;
pub mod response_id;
pub mod sse;

use axum::body::{Body, Bytes};
use axum::http::{HeaderName, HeaderValue};
use axum::response::Response;
use futures::stream;
use iop_proto::pb;

use crate::canonical::ApiError;
use crate::service::tunnel::{TunnelHead, TunnelItem, TunnelStream};
use crate::surfaces::Surface;
use event_ids::{EventIds, ResumePoint};
use iop_proto::ErrorCode;
use response_id::ResponseRename;
use sse::EventBoundary;

/// Names a resumable answer (`{node}.{stream}`): a client that cannot read the events'
/// ids resumes with `Last-Event-ID: {this}.{events it received}`.
pub const RESUME_HEADER: HeaderName = HeaderName::from_static("x-iop-resume");

/// Most body bytes already arrived that are merged into one write to the client.
const MAX_MERGE: usize = 256 * 1024;

/// Checks the provider's response head (which the dispatcher waited for), then streams
/// the body; an event stream that fails mid-body ends with `surface`'s error event. An
/// event stream's events carry ids when the edge keeps answers resumable; a client's
/// resume (`resumed`) leaves out the events it has. A background response's events name
/// it `response_id`.
pub fn respond_head(
    provider_head: TunnelHead,
    mut tunnel: TunnelStream,
    surface: Surface,
    resumed: Option<ResumePoint>,
    response_id: Option<&str>,
) -> Result<Response, ApiError> {
    let head = head::relay_head(
        provider_head.status,
        &provider_head.headers,
        tunnel.relays_set_cookie(),
    )
    .map_err(|message| {
        tracing::warn!(node_id = tunnel.core.node_id(), request_id = tunnel.core.id.as_str(), %message, "provider response refused");
        // Dropping the unfinished tunnel cancels it on the node.
        tunnel.fail(ErrorCode::BadUpstreamResponse);
        ApiError::of(ErrorCode::BadUpstreamResponse, message)
    })?;
    let events = head.is_sse && head.content_length.is_none();
    let (ids, resume_header) = event_ids(&tunnel, events, resumed);
    if ids.is_some() && tunnel.core.resume_grace.is_none() {
        tunnel.core.resume_grace = Some(tunnel.core.edge.config().dispatch.resume_grace());
    }
    let state = BodyState {
        tunnel,
        is_sse: head.is_sse,
        events: events.then(EventBoundary::default),
        ids,
        rename: response_id.filter(|_| events).map(ResponseRename::new),
        remaining: head.content_length,
        failed: None,
        surface,
    };
    let body = body_stream(state);
    let mut response = Response::new(Body::from_stream(body));
    *response.status_mut() = head.status;
    *response.headers_mut() = head.headers;
    if let Some(value) = resume_header {
        response.headers_mut().insert(RESUME_HEADER, value);
    }
    // A provider's error answer names its reason, as the edge's own errors do.
    if let Some(reason) = ErrorCode::from_provider_status(head.status.as_u16()) {
        response.headers_mut().insert(
            super::error::ERROR_HEADER,
            axum::http::HeaderValue::from_static(reason.as_str()),
        );
    }
    Ok(response)
}

/// The body's bytes: the provider's, merged as they arrive, cut on event boundaries and
/// stamped with ids for an event stream, ended as [`BodyState`] says.
fn body_stream(
    state: BodyState,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    stream::unfold(Some(state), |state| async move {
        let mut state = state?;
        if let Some(message) = state.failed.take() {
            return Some((Err(std::io::Error::other(message)), None));
        }
        let first = match state.tunnel.next().await {
            Some(TunnelItem::Body(bytes)) => bytes,
            Some(TunnelItem::Error(e)) => return state.fail(Bytes::new(), e),
            Some(TunnelItem::End) | None => return state.end(Bytes::new()),
            // Status and headers come once, before the body.
            Some(_) => return Some((Ok(Bytes::new()), Some(state))),
        };
        let mut bytes = first;
        if let Some(remaining) = state.remaining.as_mut() {
            *remaining = remaining.saturating_sub(bytes.len() as u64);
            if *remaining == 0 {
                // The client stops reading at Content-Length: take the rest of the
                // tunnel (usage, end) now so nothing after the body is lost.
                while let Some(item) = state.tunnel.next().await {
                    if matches!(item, TunnelItem::End | TunnelItem::Error(_)) {
                        break;
                    }
                }
                return Some((Ok(bytes), None));
            }
            return Some((Ok(bytes), Some(state)));
        }
        // Relay what already arrived in one write (up to MAX_MERGE: a node racing the
        // merge must not grow it without end).
        let mut merged: Option<bytes::BytesMut> = None;
        let mut ending = None;
        while merged.as_ref().map_or(bytes.len(), |m| m.len()) < MAX_MERGE
            && let Some(item) = state.tunnel.next_ready()
        {
            match item {
                TunnelItem::Body(more) => merged
                    .get_or_insert_with(|| bytes::BytesMut::from(&bytes[..]))
                    .extend_from_slice(&more),
                other => {
                    ending = Some(other);
                    break;
                }
            }
        }
        if let Some(m) = merged {
            bytes = m.freeze();
        }
        if let Some(events) = state.events.as_mut() {
            bytes = events.push(bytes);
            if events.mid_event() {
                // An oversized event went out in parts: ids would land inside it.
                state.ids = None;
            }
            if let Some(rename) = state.rename.as_mut() {
                bytes = rename.apply(bytes);
            }
            if let Some(ids) = state.ids.as_mut() {
                bytes = ids.stamp(&bytes);
            }
        }
        match ending {
            Some(TunnelItem::End) => state.end(bytes),
            Some(TunnelItem::Error(e)) => state.fail(bytes, e),
            _ => Some((Ok(bytes), Some(state))),
        }
    })
}

/// The ids of a resumable event stream's events and the answer's name for a resume
/// (`{node}.{stream}`), when the answer is resumable.
fn event_ids(
    tunnel: &TunnelStream,
    events: bool,
    resumed: Option<ResumePoint>,
) -> (Option<EventIds>, Option<HeaderValue>) {
    let answer = match resumed {
        Some(point) => Some((point.node, point.stream, point.after)),
        None => {
            let node = tunnel.core.node_id();
            let resumable = tunnel.core.edge.config().dispatch.resume_keep_sec > 0
                && node.bytes().all(|b| b.is_ascii_graphic());
            (events && resumable).then(|| (node.to_string(), tunnel.core.id.clone(), 0))
        }
    };
    let ids = answer
        .as_ref()
        .map(|(node, stream, after)| EventIds::resuming(node, stream, *after));
    let header = answer
        .and_then(|(node, stream, _)| HeaderValue::from_str(&format!("{node}.{stream}")).ok());
    (ids, header)
}

struct BodyState {
    tunnel: TunnelStream,
    is_sse: bool,
    /// Event boundaries of an event stream without a Content-Length.
    events: Option<EventBoundary>,
    /// The events' ids, when the answer is resumable.
    ids: Option<EventIds>,
    /// A background response's id in its events.
    rename: Option<ResponseRename>,
    /// Body bytes still expected when the provider sent a Content-Length.
    remaining: Option<u64>,
    /// A failure to report after the bytes before it went out.
    failed: Option<String>,
    /// The API whose error event ends a failed event stream.
    surface: Surface,
}

type BodyStep = Option<(Result<Bytes, std::io::Error>, Option<BodyState>)>;

impl BodyState {
    /// Ends the body normally after `bytes` and whatever the event stream held back (the
    /// provider's bytes go out as they are).
    fn end(mut self, bytes: Bytes) -> BodyStep {
        let mut held = self
            .events
            .as_mut()
            .map(EventBoundary::take_held)
            .unwrap_or_default();
        if let Some(ids) = self.ids.as_mut() {
            held = ids.stamp(&held);
        }
        let out = if held.is_empty() {
            bytes
        } else {
            let mut out = bytes::BytesMut::from(&bytes[..]);
            out.extend_from_slice(&held);
            out.freeze()
        };
        (!out.is_empty()).then_some((Ok(out), None))
    }

    /// Ends the body after `bytes`: an SSE error event for event streams, an aborted
    /// body (the client sees a truncated response) otherwise.
    fn fail(mut self, bytes: Bytes, e: pb::TunnelError) -> BodyStep {
        tracing::warn!(request_id = self.tunnel.core.id.as_str(), code = e.error_code().as_str(), message = %e.message, "tunnel failed mid-body");
        let event = self
            .surface
            .native_stream_error(&ApiError::from_tunnel_error(&e))
            .filter(|_| self.is_sse);
        if let Some(event) = event {
            let mut out = bytes::BytesMut::from(&bytes[..]);
            if let Some(events) = self.events.as_mut() {
                if events.discard_held() {
                    tracing::debug!(
                        request_id = self.tunnel.core.id.as_str(),
                        "incomplete provider event dropped before the error event"
                    );
                }
                if events.mid_event() {
                    // An oversized fragment already went out: end it so the error event is
                    // at least an event of its own.
                    out.extend_from_slice(b"\n\n");
                }
            }
            out.extend_from_slice(&event);
            return Some((Ok(out.freeze()), None));
        }
        if bytes.is_empty() {
            return Some((Err(std::io::Error::other(e.message)), None));
        }
        self.failed = Some(e.message);
        Some((Ok(bytes), Some(self)))
    }
}
