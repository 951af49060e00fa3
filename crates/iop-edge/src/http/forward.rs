//! The client headers that travel to the provider: the request's `x-request-id` always;
//! W3C trace context (`traceparent`, and `tracestate` with it) when the `traceparent` is
//! well-formed; and the headers `http.forward_headers` names. Nothing else the client
//! sent reaches a provider (its API key for this edge least of all).
//!
//! Pure: headers in, wire headers out.

use axum::http::HeaderMap;
use iop_proto::pb;

use super::request_id::X_REQUEST_ID;
use crate::config::HttpApiConfig;

/// Longest `tracestate` forwarded (the W3C limit vendors must propagate); a longer one is
/// dropped whole.
pub const MAX_TRACESTATE_LEN: usize = 512;
/// Most list members of a forwarded `tracestate`.
pub const MAX_TRACESTATE_MEMBERS: usize = 32;

/// The headers for the provider request of a client request with `headers`.
pub fn provider_headers(headers: &HeaderMap, config: &HttpApiConfig) -> Vec<pb::Header> {
    let mut out = Vec::with_capacity(3 + config.forward_headers.len());
    let mut push = |name: &str, value: &[u8]| {
        out.push(pb::Header {
            name: name.to_string(),
            value: value.to_vec(),
        })
    };
    if let Some(id) = headers.get(X_REQUEST_ID) {
        push("x-request-id", id.as_bytes());
    }
    let mut parents = headers.get_all("traceparent").iter();
    if let (Some(parent), None) = (parents.next(), parents.next())
        && is_valid_traceparent(parent.as_bytes())
    {
        push("traceparent", parent.as_bytes());
        if let Some(state) = tracestate(headers) {
            push("tracestate", state.as_bytes());
        }
    }
    for name in &config.forward_headers {
        for value in headers.get_all(name.as_str()) {
            push(&name.to_ascii_lowercase(), value.as_bytes());
        }
    }
    out
}

/// A W3C `traceparent`: `version-traceid-parentid-flags` in lower-case hex, the trace and
/// parent ids not all zeros, version `ff` invalid. A version above `00` may carry more
/// fields after a dash (read as version 00, as the spec says).
pub fn is_valid_traceparent(value: &[u8]) -> bool {
    const LEN: usize = 55;
    if value.len() < LEN || (value.len() > LEN && value[LEN] != b'-') {
        return false;
    }
    let hex = |s: &[u8]| s.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    let nonzero = |s: &[u8]| s.iter().any(|b| *b != b'0');
    let (version, trace, parent, flags) =
        (&value[0..2], &value[3..35], &value[36..52], &value[53..55]);
    [value[2], value[35], value[52]] == [b'-'; 3]
        && hex(version)
        && version != b"ff"
        && (version != b"00" || value.len() == LEN)
        && hex(trace)
        && nonzero(trace)
        && hex(parent)
        && nonzero(parent)
        && hex(flags)
}

/// The request's `tracestate` (several headers join with commas), if it is printable
/// ASCII within [`MAX_TRACESTATE_LEN`] bytes and [`MAX_TRACESTATE_MEMBERS`] members.
fn tracestate(headers: &HeaderMap) -> Option<String> {
    let mut joined = String::new();
    for value in headers.get_all("tracestate") {
        let text = value.to_str().ok()?;
        if !text.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
            return None;
        }
        if !joined.is_empty() {
            joined.push(',');
        }
        joined.push_str(text);
    }
    let members = joined.split(',').filter(|m| !m.trim().is_empty()).count();
    (!joined.is_empty() && joined.len() <= MAX_TRACESTATE_LEN && members <= MAX_TRACESTATE_MEMBERS)
        .then_some(joined)
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn names(headers: &[pb::Header]) -> Vec<(String, String)> {
        headers
            .iter()
            .map(|h| (h.name.clone(), String::from_utf8(h.value.clone()).unwrap()))
            .collect()
    }

    #[test]
    fn traceparents_follow_the_w3c_format() {
        assert!(is_valid_traceparent(PARENT.as_bytes()));
        // A later version with more fields.
        assert!(is_valid_traceparent(
            b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"
        ));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ] {
            assert!(!is_valid_traceparent(bad.as_bytes()), "{bad}");
        }
    }

    #[test]
    fn only_the_request_id_trace_context_and_the_allowlist_travel() {
        let mut h = HeaderMap::new();
        h.insert("x-request-id", HeaderValue::from_static("rid-1"));
        h.insert("traceparent", HeaderValue::from_static(PARENT));
        h.append("tracestate", HeaderValue::from_static("a=1"));
        h.append("tracestate", HeaderValue::from_static("b=2"));
        h.insert("authorization", HeaderValue::from_static("Bearer secret"));
        h.insert("x-tenant", HeaderValue::from_static("t1"));
        h.insert("x-other", HeaderValue::from_static("no"));
        let config = HttpApiConfig {
            forward_headers: vec!["X-Tenant".into()],
            ..Default::default()
        };
        assert_eq!(
            names(&provider_headers(&h, &config)),
            [
                ("x-request-id".into(), "rid-1".into()),
                ("traceparent".into(), PARENT.into()),
                ("tracestate".into(), "a=1,b=2".into()),
                ("x-tenant".into(), "t1".into()),
            ]
        );
    }

    #[test]
    fn a_bad_traceparent_takes_its_tracestate_with_it() {
        let mut h = HeaderMap::new();
        h.insert("traceparent", HeaderValue::from_static("00-bad"));
        h.insert("tracestate", HeaderValue::from_static("a=1"));
        assert!(provider_headers(&h, &HttpApiConfig::default()).is_empty());
        // Two traceparents are invalid too.
        let mut h = HeaderMap::new();
        h.append("traceparent", HeaderValue::from_static(PARENT));
        h.append("traceparent", HeaderValue::from_static(PARENT));
        assert!(provider_headers(&h, &HttpApiConfig::default()).is_empty());
    }

    #[test]
    fn an_oversized_tracestate_is_dropped() {
        let mut h = HeaderMap::new();
        h.insert("traceparent", HeaderValue::from_static(PARENT));
        let long = "k=".to_string() + &"v".repeat(MAX_TRACESTATE_LEN);
        h.insert("tracestate", HeaderValue::from_str(&long).unwrap());
        let sent = names(&provider_headers(&h, &HttpApiConfig::default()));
        assert_eq!(sent, [("traceparent".into(), PARENT.into())]);
        let many = (0..=MAX_TRACESTATE_MEMBERS)
            .map(|i| format!("k{i}=v"))
            .collect::<Vec<_>>()
            .join(",");
        h.insert("tracestate", HeaderValue::from_str(&many).unwrap());
        assert_eq!(provider_headers(&h, &HttpApiConfig::default()).len(), 1);
    }
}
