//! Authentication of HTTP requests: the bearer key (on the Anthropic Messages route also
//! an `x-api-key` header) becomes the request's [`Caller`] (an extension the handlers
//! read), wrong keys are throttled per source address (429 with `Retry-After`, and one
//! summary line per period instead of a line per guess), and the admin-only routes refuse
//! client keys with 403.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Request, State};

use super::client_addr::ClientAddr;
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::Response;

use crate::auth::Caller;
use crate::canonical::ApiError;
use crate::service::Edge;
use crate::surfaces::ErrorShape;

/// How often wrong API keys are summed up in the log.
pub const FAILURE_SUMMARY_PERIOD: Duration = Duration::from_secs(60);

/// Sets the request's [`Caller`]: anonymous on an edge without keys, else the key the
/// `Authorization: Bearer` header names — on Anthropic's routes also `x-api-key`, as its
/// clients send it — (401 without one or with a wrong one; 429 while the source address
/// is throttled for earlier wrong keys). Errors are in the shape of the API the request
/// is for.
pub async fn authenticate(
    State(edge): State<Arc<Edge>>,
    mut request: Request,
    next: Next,
) -> Response {
    let shape = super::error::shape_of(request.uri().path());
    let from = match shape {
        ErrorShape::Anthropic => KeyHeaders::BearerOrXApiKey,
        _ => KeyHeaders::Bearer,
    };
    match identify(&edge, &mut request, from) {
        Ok(()) => next.run(request).await,
        Err(e) => super::error::response(shape, e),
    }
}

/// Where a route reads the API key from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyHeaders {
    Bearer,
    BearerOrXApiKey,
}

/// Authenticates `request` and sets its [`Caller`].
fn identify(edge: &Edge, request: &mut Request, from: KeyHeaders) -> Result<(), ApiError> {
    let keys = edge.keys.table();
    if keys.is_empty() {
        request.extensions_mut().insert(Caller::anonymous());
        return Ok(());
    }
    let presented = match from {
        KeyHeaders::Bearer => bearer(request.headers()),
        KeyHeaders::BearerOrXApiKey => {
            bearer(request.headers()).or_else(|| x_api_key(request.headers()))
        }
    };
    let Some(presented) = presented else {
        let how = match from {
            KeyHeaders::Bearer => "`Authorization: Bearer <key>`",
            KeyHeaders::BearerOrXApiKey => "`x-api-key: <key>` or `Authorization: Bearer <key>`",
        };
        return Err(ApiError::unauthorized(format!(
            "missing API key: send it as {how}"
        )));
    };
    // The client's address: behind a trusted proxy, the one it forwarded for.
    let source = match request.extensions().get::<ClientAddr>() {
        Some(client) => Some(throttle_key(client.0)),
        None => request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| throttle_key(c.0.ip())),
    };
    if let Some(source) = source
        && let Err(wait) = edge.keys.failures().check(source, Instant::now())
    {
        return Err(throttled(wait));
    }
    match keys.find(presented) {
        Some(key) => {
            if let Some(source) = source {
                edge.keys.failures().success(source);
            }
            request.extensions_mut().insert(Caller::with_key(key));
            Ok(())
        }
        None => {
            if let Some(source) = source {
                edge.keys.failures().failure(source, Instant::now());
            }
            Err(ApiError::unauthorized("incorrect API key provided"))
        }
    }
}

/// Lets only admin callers through (behind [`authenticate`]).
pub async fn require_admin(request: Request, next: Next) -> Response {
    match request.extensions().get::<Caller>() {
        Some(caller) if caller.is_admin() => next.run(request).await,
        _ => {
            let path = request.uri().path();
            let e = ApiError::forbidden(format!(
                "{path} needs an admin API key; this key's role is client"
            ));
            super::error::response(super::error::shape_of(path), e)
        }
    }
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, key) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| key.trim())
        .filter(|k| !k.is_empty())
}

/// The key of an `x-api-key` header (trimmed; empty counts as none).
fn x_api_key(headers: &HeaderMap) -> Option<&str> {
    let key = headers.get("x-api-key")?.to_str().ok()?.trim();
    (!key.is_empty()).then_some(key)
}

/// The address a source is throttled under: IPv4 addresses as they are, IPv6 by their /64
/// (one host usually holds a whole /64).
pub fn throttle_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut segments = v6.segments();
                segments[4..].fill(0);
                IpAddr::V6(segments.into())
            }
        },
    }
}

fn throttled(wait: Duration) -> ApiError {
    let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
    ApiError::of(
        iop_proto::ErrorCode::TooManyFailedAttempts,
        format!("too many wrong API keys from your address; retry in {secs} s"),
    )
    .with_retry_after(secs)
}

/// Logs the wrong API keys of each period in one line, until the edge shuts down.
pub async fn summarize_failures(edge: Arc<Edge>) {
    let mut every = tokio::time::interval(FAILURE_SUMMARY_PERIOD);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    loop {
        tokio::select! {
            _ = edge.shutdown_token().cancelled() => return,
            _ = every.tick() => {}
        }
        let summary = edge.keys.failures().take_summary();
        if summary.failures == 0 {
            continue;
        }
        let (top, top_failures) = summary
            .top
            .map(|(ip, n)| (ip.to_string(), n))
            .unwrap_or_default();
        tracing::warn!(
            failures = summary.failures,
            addresses = summary.addresses,
            top,
            top_failures,
            "wrong API keys in the last {}s (each source address is slowed down)",
            FAILURE_SUMMARY_PERIOD.as_secs()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_keys_are_read_case_insensitively_and_trimmed() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, v.parse().unwrap());
            bearer(&h).map(String::from)
        };
        assert_eq!(with("Bearer abc").as_deref(), Some("abc"));
        assert_eq!(with("bearer  abc ").as_deref(), Some("abc"));
        assert_eq!(with("BEARER abc").as_deref(), Some("abc"));
        assert_eq!(with("Basic abc"), None);
        assert_eq!(with("Bearer "), None);
        assert_eq!(bearer(&HeaderMap::new()), None);
        let mut h = HeaderMap::new();
        h.insert("x-api-key", " sk-abc ".parse().unwrap());
        assert_eq!(x_api_key(&h), Some("sk-abc"));
        h.insert("x-api-key", "".parse().unwrap());
        assert_eq!(x_api_key(&h), None);
    }

    #[test]
    fn ipv6_sources_are_throttled_by_their_64() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::2".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(throttle_key(a), throttle_key(b));
        assert_ne!(throttle_key(a), throttle_key(c));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(throttle_key(mapped), "10.0.0.1".parse::<IpAddr>().unwrap());
        let v4: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(throttle_key(v4), v4);
    }

    #[test]
    fn a_throttled_answer_says_when_to_retry() {
        let e = throttled(Duration::from_millis(1500));
        assert_eq!(e.status, 429);
        assert_eq!(e.retry_after, Some(2));
        assert_eq!(throttled(Duration::from_millis(10)).retry_after, Some(1));
    }
}
