//! Writes a provider tunnel's frames to the client: the provider's status, its end-to-end
//! headers, and its body bytes untouched, chunk by chunk as they arrive (SSE included).
//!
//! An error before the response head becomes an OpenAI error with a status saying where
//! it failed; an error after the body began ends an SSE stream with an error event, and
//! aborts any other body (the client sees a truncated response, never a wrong one).

use axum::body::{Body, Bytes};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use futures::stream;
use iop_proto::pb;

use super::error::ApiError;
use crate::service::{TunnelItem, TunnelStream};

/// Connection-level headers that describe one hop, never forwarded.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Waits for the response head, then streams the body.
pub async fn respond(mut tunnel: TunnelStream) -> Result<Response, ApiError> {
    let mut status = None;
    let headers = loop {
        match tunnel.next().await {
            Some(TunnelItem::Status(s)) => status = Some(s),
            Some(TunnelItem::Headers(h)) => break h,
            Some(TunnelItem::Error(e)) => return Err(ApiError::upstream(&e.code, &e.message)),
            Some(TunnelItem::Body(_)) | Some(TunnelItem::End) | None => {
                return Err(ApiError::upstream(
                    "upstream_error",
                    "the provider response ended before its headers",
                ));
            }
        }
    };
    let status = status
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::BAD_GATEWAY);
    let mut builder = Response::builder().status(status);
    let mut is_sse = false;
    for h in &headers {
        let name = h.name.to_ascii_lowercase();
        if HOP_BY_HOP.contains(&name.as_str()) {
            continue;
        }
        if name == "content-type" && h.value.starts_with(b"text/event-stream") {
            is_sse = true;
        }
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&h.value),
        ) {
            builder = builder.header(name, value);
        }
    }
    let state = BodyState {
        tunnel,
        is_sse,
        remaining: content_length(&headers),
        failed: None,
    };
    let body = stream::unfold(Some(state), |state| async move {
        let mut state = state?;
        if let Some(message) = state.failed.take() {
            return Some((Err(std::io::Error::other(message)), None));
        }
        let first = match state.tunnel.next().await {
            Some(TunnelItem::Body(bytes)) => bytes,
            Some(TunnelItem::Error(e)) => return state.fail(Bytes::new(), e),
            Some(TunnelItem::End) | None => return None,
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
        // Relay what already arrived in one write.
        let mut merged: Option<bytes::BytesMut> = None;
        let mut ending = None;
        while let Some(item) = state.tunnel.next_ready() {
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
        match ending {
            Some(TunnelItem::End) => Some((Ok(bytes), None)),
            Some(TunnelItem::Error(e)) => state.fail(bytes, e),
            _ => Some((Ok(bytes), Some(state))),
        }
    });
    Ok(builder
        .body(Body::from_stream(body))
        .expect("status and validated headers build a response"))
}

struct BodyState {
    tunnel: TunnelStream,
    is_sse: bool,
    /// Body bytes still expected when the provider sent a Content-Length.
    remaining: Option<u64>,
    /// A failure to report after the bytes before it went out.
    failed: Option<String>,
}

type BodyStep = Option<(Result<Bytes, std::io::Error>, Option<BodyState>)>;

impl BodyState {
    /// Ends the body after `bytes`: an SSE error event for event streams, an aborted
    /// body (the client sees a truncated response) otherwise.
    fn fail(mut self, bytes: Bytes, e: pb::TunnelError) -> BodyStep {
        tracing::warn!(request_id = self.tunnel.request_id(), code = %e.code, message = %e.message, "tunnel failed mid-body");
        if self.is_sse {
            let mut out = bytes::BytesMut::from(&bytes[..]);
            out.extend_from_slice(&sse_error(&e));
            return Some((Ok(out.freeze()), None));
        }
        if bytes.is_empty() {
            return Some((Err(std::io::Error::other(e.message)), None));
        }
        self.failed = Some(e.message);
        Some((Ok(bytes), Some(self)))
    }
}

fn content_length(headers: &[pb::Header]) -> Option<u64> {
    headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .and_then(|h| std::str::from_utf8(&h.value).ok()?.trim().parse().ok())
}

fn sse_error(e: &pb::TunnelError) -> Bytes {
    let body = ApiError::upstream(&e.code, &e.message).body();
    Bytes::from(format!("data: {body}\n\n"))
}
