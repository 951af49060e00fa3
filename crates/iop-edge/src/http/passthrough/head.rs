//! The response head a node relays from its provider, checked before it reaches the
//! client: a final status in 200–599 (a 1xx or anything outside 100–599 is refused), at
//! most [`MAX_HEADERS`] headers of at most [`MAX_HEADER_BYTES`] in all, and no hop-by-hop
//! headers (those of RFC 9110 §7.6.1 and any the provider's `Connection` header names),
//! and no `set-cookie` unless `http.relay_set_cookie` says so (a provider's cookies are
//! for the node's session with it, not for the edge's clients, and would be set for the
//! edge's domain). Invalid header names or values are dropped. A refused head becomes a 502 for the
//! client; the node's answer is not trusted further than a provider's would be.

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use iop_proto::pb;

/// Most headers relayed from one response.
pub const MAX_HEADERS: usize = 128;
/// Most bytes of header names and values relayed from one response.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

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

/// A head fit to send to the client.
#[derive(Debug)]
pub struct RelayHead {
    pub status: StatusCode,
    pub headers: HeaderMap,
    /// `Content-Type: text/event-stream`.
    pub is_sse: bool,
    /// The provider's `Content-Length`, if it sent a valid one.
    pub content_length: Option<u64>,
}

/// Checks and filters the head; the error says what was wrong, for a 502.
/// `keep_set_cookie` relays the provider's `set-cookie` headers.
pub fn relay_head(
    status: u32,
    headers: &[pb::Header],
    keep_set_cookie: bool,
) -> Result<RelayHead, String> {
    if !(200..=599).contains(&status) {
        return Err(format!(
            "the provider answered with status {status}, which cannot be relayed \
             (a final status between 200 and 599 is required)"
        ));
    }
    let status = StatusCode::from_u16(status as u16).expect("checked range");
    if headers.len() > MAX_HEADERS {
        return Err(format!(
            "the provider answered with {} headers, over the {MAX_HEADERS}-header limit",
            headers.len()
        ));
    }
    let size: usize = headers.iter().map(|h| h.name.len() + h.value.len()).sum();
    if size > MAX_HEADER_BYTES {
        return Err(format!(
            "the provider answered with {size} bytes of headers, over the \
             {MAX_HEADER_BYTES}-byte limit"
        ));
    }
    // Headers the provider's Connection header declares hop-by-hop.
    let named: Vec<String> = headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("connection"))
        .filter_map(|h| std::str::from_utf8(&h.value).ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect();
    let mut out = HeaderMap::with_capacity(headers.len());
    let mut is_sse = false;
    let mut content_length = None;
    for h in headers {
        let name = h.name.to_ascii_lowercase();
        if HOP_BY_HOP.contains(&name.as_str())
            || named.contains(&name)
            || (!keep_set_cookie && name == "set-cookie")
        {
            continue;
        }
        let (Ok(header), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&h.value),
        ) else {
            continue;
        };
        if header == axum::http::header::CONTENT_TYPE && h.value.starts_with(b"text/event-stream") {
            is_sse = true;
        }
        if header == axum::http::header::CONTENT_LENGTH {
            let parsed = std::str::from_utf8(&h.value)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok());
            match parsed {
                // One valid length, stated once: anything else is not relayed as a length.
                Some(n) if content_length.is_none() => content_length = Some(n),
                _ => {
                    return Err("the provider answered with an invalid or repeated \
                                Content-Length"
                        .into());
                }
            }
        }
        out.append(header, value);
    }
    Ok(RelayHead {
        status,
        headers: out,
        is_sse,
        content_length,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(name: &str, value: &str) -> pb::Header {
        pb::Header {
            name: name.into(),
            value: value.as_bytes().to_vec(),
        }
    }

    #[test]
    fn a_normal_head_passes_with_its_end_to_end_headers() {
        let head = relay_head(
            200,
            &[
                h("Content-Type", "text/event-stream"),
                h("X-Request-Id", "abc"),
                h("Transfer-Encoding", "chunked"),
                h("Connection", "keep-alive, X-Secret"),
                h("X-Secret", "hop"),
                h("Keep-Alive", "timeout=5"),
            ],
            false,
        )
        .unwrap();
        assert_eq!(head.status, StatusCode::OK);
        assert!(head.is_sse);
        assert_eq!(head.headers.len(), 2, "{:?}", head.headers);
        assert_eq!(head.headers["x-request-id"], "abc");
    }

    #[test]
    fn statuses_outside_the_final_range_are_refused() {
        for status in [0, 99, 100, 101, 199, 600, 999, 65_736, u32::MAX] {
            assert!(relay_head(status, &[], false).is_err(), "{status}");
        }
        for status in [200, 204, 404, 429, 500, 599] {
            assert!(relay_head(status, &[], false).is_ok(), "{status}");
        }
    }

    #[test]
    fn too_many_or_too_large_headers_are_refused() {
        let many: Vec<_> = (0..MAX_HEADERS + 1)
            .map(|i| h(&format!("x-{i}"), "v"))
            .collect();
        assert!(
            relay_head(200, &many, false)
                .unwrap_err()
                .contains("headers")
        );
        assert!(relay_head(200, &many[..MAX_HEADERS], false).is_ok());
        let big = [h("x-big", &"v".repeat(MAX_HEADER_BYTES))];
        assert!(
            relay_head(200, &big, false)
                .unwrap_err()
                .contains("bytes of headers")
        );
    }

    #[test]
    fn content_length_is_read_and_must_be_sane() {
        let head = relay_head(200, &[h("Content-Length", "12")], false).unwrap();
        assert_eq!(head.content_length, Some(12));
        assert!(relay_head(200, &[h("Content-Length", "-1")], false).is_err());
        assert!(
            relay_head(
                200,
                &[h("Content-Length", "1"), h("content-length", "2")],
                false
            )
            .is_err()
        );
    }

    #[test]
    fn set_cookie_is_dropped_unless_configured() {
        let headers = [
            h("Set-Cookie", "session=abc"),
            h("content-type", "application/json"),
        ];
        let head = relay_head(200, &headers, false).unwrap();
        assert!(head.headers.get("set-cookie").is_none());
        assert_eq!(head.headers.len(), 1);
        let head = relay_head(200, &headers, true).unwrap();
        assert_eq!(head.headers["set-cookie"], "session=abc");
    }

    #[test]
    fn invalid_names_and_values_are_dropped() {
        let head = relay_head(200, &[h("bad name", "v"), h("x-ok", "bad\nvalue")], false).unwrap();
        assert!(head.headers.is_empty());
    }
}
