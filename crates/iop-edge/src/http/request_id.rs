//! `x-request-id`: every request gets one — the client's, when it is short and made of
//! safe characters, or a fresh UUID — and every response carries it back, errors
//! included. The request's tracing span carries it as `request_id`, so one grep follows
//! a request through the edge's log; it travels on to the node and the provider (see
//! [`super::forward`]).
//!
//! [`assign`] (called by [`super::front`] for every request) puts the id in force back
//! into the request's own `x-request-id` header, so a handler reads it ([`of`]) from the
//! headers it already has.

use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use tracing::Span;

pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest client-chosen request id accepted; a longer one is replaced.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// Whether a client's request id can be used as it is: 1 to [`MAX_REQUEST_ID_LEN`]
/// characters of letters, digits and `-_.:+/=@` (UUIDs, ULIDs, base64 and the usual
/// prefixed ids), so it is safe in log lines and headers.
pub fn is_valid(value: &[u8]) -> bool {
    !value.is_empty()
        && value.len() <= MAX_REQUEST_ID_LEN
        && value
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:+/=@".contains(b))
}

/// A fresh request id: a random (version 4) UUID, its bits from the thread-local CSPRNG
/// (`Uuid::new_v4` would ask the OS, a system call per request).
pub fn generate() -> String {
    uuid::Builder::from_random_bytes(rand::random())
        .into_uuid()
        .to_string()
}

/// The id for a request with these headers: the client's first `x-request-id` if it is
/// valid, else a fresh one.
pub fn choose(headers: &HeaderMap) -> String {
    headers
        .get(X_REQUEST_ID)
        .map(HeaderValue::as_bytes)
        .filter(|v| is_valid(v))
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(String::from)
        .unwrap_or_else(generate)
}

/// The id of a request that went through [`assign`] (its `x-request-id` header).
pub fn of(headers: &HeaderMap) -> &str {
    headers
        .get(X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

/// Sets the request's id in force in its `x-request-id` header. Returns the header value
/// for the response and the request's span.
pub fn assign(request: &mut Request) -> (HeaderValue, Span) {
    let id = choose(request.headers());
    let value = HeaderValue::from_str(&id).expect("request ids are header-safe");
    let headers = request.headers_mut();
    headers.remove(X_REQUEST_ID);
    headers.insert(X_REQUEST_ID, value.clone());
    let span = tracing::info_span!("http", request_id = %id);
    span.in_scope(|| {
        tracing::debug!(method = %request.method(), path = request.uri().path(), "request");
    });
    (value, span)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safe_ids_are_kept_and_others_replaced() {
        for good in [
            "abc",
            "0f8fad5b-d9cb-469f-a165-70867728950e",
            "req_01HZY:a.b+c/d=@x",
            &"a".repeat(MAX_REQUEST_ID_LEN),
        ] {
            assert!(is_valid(good.as_bytes()), "{good}");
        }
        for bad in [
            "",
            "has space",
            "new\nline",
            "quote\"",
            "semi;colon",
            "é",
            &"a".repeat(MAX_REQUEST_ID_LEN + 1),
        ] {
            assert!(!is_valid(bad.as_bytes()), "{bad:?}");
        }
    }

    #[test]
    fn generated_ids_are_distinct_version_4_uuids() {
        let a = uuid::Uuid::parse_str(&generate()).expect("a UUID");
        let b = uuid::Uuid::parse_str(&generate()).expect("a UUID");
        assert_eq!(a.get_version(), Some(uuid::Version::Random));
        assert_eq!(a.get_variant(), uuid::Variant::RFC4122);
        assert_ne!(a, b);
    }

    #[test]
    fn the_client_id_wins_when_valid() {
        let mut headers = HeaderMap::new();
        headers.insert(X_REQUEST_ID, HeaderValue::from_static("client-id-1"));
        assert_eq!(choose(&headers), "client-id-1");
        headers.insert(X_REQUEST_ID, HeaderValue::from_static("bad id"));
        let made = choose(&headers);
        assert_ne!(made, "bad id");
        assert!(is_valid(made.as_bytes()));
        assert_ne!(choose(&HeaderMap::new()), choose(&HeaderMap::new()));
    }
}
