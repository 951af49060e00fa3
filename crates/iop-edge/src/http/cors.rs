//! CORS for web pages that call the API from a browser (`http.cors`): off unless origins
//! are configured. For an allowed origin a preflight (`OPTIONS` with
//! `Access-Control-Request-Method`) is answered 204 here, before authentication (browsers
//! send no credentials on preflights), and every other response gets
//! `Access-Control-Allow-Origin`, `Vary: Origin` and the exposed headers. A request from
//! any other origin gets no CORS header at all, and its preflight goes on to the routes
//! (a 405 or 404), so the browser refuses the call.
//!
//! Written here rather than taken from `tower-http`'s `CorsLayer`: that layer answers
//! every `OPTIONS` request itself (with 200, and with the allowed methods and headers even
//! for origins it refuses), and is built once, while the edge reloads its config.
//! The decisions are pure functions ([`preflight`], [`response_headers`]).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::config::CorsConfig;
use crate::service::Edge;

/// The methods the API serves.
pub const ALLOWED_METHODS: &str = "GET, POST, DELETE, OPTIONS";
/// Request headers allowed when a preflight does not list acceptable ones itself.
pub const DEFAULT_ALLOWED_HEADERS: &str =
    "authorization, content-type, x-request-id, traceparent, tracestate";
/// Response headers a page's script may read.
pub const EXPOSED_HEADERS: &str = "x-request-id, retry-after";
/// Longest `Access-Control-Request-Headers` echoed back.
const MAX_REQUESTED_HEADERS_LEN: usize = 2048;

/// The headers of a preflight answer for `origin`, or `None` if the origin is not allowed
/// (the preflight then gets no CORS answer).
pub fn preflight(
    cors: &CorsConfig,
    origin: &str,
    requested_headers: Option<&str>,
) -> Option<HeaderMap> {
    let mut headers = response_headers(cors, origin)?;
    headers.remove(header::ACCESS_CONTROL_EXPOSE_HEADERS);
    headers.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static(ALLOWED_METHODS),
    );
    // The headers the page asked for, when they are a plain list of header names.
    let allowed = requested_headers
        .filter(|h| is_header_list(h))
        .and_then(|h| HeaderValue::from_str(h).ok())
        .unwrap_or(HeaderValue::from_static(DEFAULT_ALLOWED_HEADERS));
    headers.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, allowed);
    headers.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from(cors.max_age_sec),
    );
    headers.append(
        header::VARY,
        HeaderValue::from_static("Access-Control-Request-Method, Access-Control-Request-Headers"),
    );
    Some(headers)
}

/// The CORS headers of an ordinary response to `origin`; `None` if it is not allowed.
pub fn response_headers(cors: &CorsConfig, origin: &str) -> Option<HeaderMap> {
    if !cors.enabled() || !cors.allows(origin) {
        return None;
    }
    let mut headers = HeaderMap::new();
    let allow = if cors.any_origin() {
        HeaderValue::from_static("*")
    } else {
        HeaderValue::from_str(origin).ok()?
    };
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
    headers.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static(EXPOSED_HEADERS),
    );
    headers.insert(header::VARY, HeaderValue::from_static("Origin"));
    Some(headers)
}

/// A comma-separated list of header names (tokens), of bounded length.
fn is_header_list(value: &str) -> bool {
    value.len() <= MAX_REQUESTED_HEADERS_LEN
        && value.split(',').all(|name| {
            let name = name.trim();
            !name.is_empty() && axum::http::HeaderName::from_bytes(name.as_bytes()).is_ok()
        })
}

/// Answers preflights from allowed origins and adds CORS headers to their responses.
pub async fn layer(State(edge): State<Arc<Edge>>, request: Request, next: Next) -> Response {
    let config = edge.config();
    let cors = &config.http.cors;
    if !cors.enabled() {
        return next.run(request).await;
    }
    let Some(origin) = request
        .headers()
        .get(header::ORIGIN)
        .and_then(|o| o.to_str().ok())
        .map(String::from)
    else {
        return next.run(request).await;
    };
    let is_preflight = request.method() == Method::OPTIONS
        && request
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if is_preflight {
        let requested = request
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .and_then(|h| h.to_str().ok());
        if let Some(headers) = preflight(cors, &origin, requested) {
            return (StatusCode::NO_CONTENT, headers).into_response();
        }
        tracing::debug!(%origin, "CORS preflight from an origin not in http.cors.allowed_origins");
        return next.run(request).await;
    }
    let mut response = next.run(request).await;
    if let Some(headers) = response_headers(cors, &origin) {
        let out = response.headers_mut();
        for (name, value) in headers {
            let name = name.expect("one value per name");
            if name == header::VARY {
                out.append(name, value);
            } else {
                out.insert(name, value);
            }
        }
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cors(origins: &[&str]) -> CorsConfig {
        CorsConfig {
            allowed_origins: origins.iter().map(|s| s.to_string()).collect(),
            max_age_sec: 600,
        }
    }

    #[test]
    fn an_allowed_origin_is_echoed_with_vary() {
        let c = cors(&["https://app.example"]);
        let h = response_headers(&c, "https://app.example").unwrap();
        assert_eq!(
            h[header::ACCESS_CONTROL_ALLOW_ORIGIN],
            "https://app.example"
        );
        assert_eq!(h[header::VARY], "Origin");
        assert!(
            h[header::ACCESS_CONTROL_EXPOSE_HEADERS]
                .to_str()
                .unwrap()
                .contains("x-request-id")
        );
        assert!(response_headers(&c, "https://evil.example").is_none());
        assert!(response_headers(&c, "null").is_none());
    }

    #[test]
    fn nothing_when_off_and_a_star_for_any_origin() {
        assert!(response_headers(&cors(&[]), "https://app.example").is_none());
        assert!(preflight(&cors(&[]), "https://app.example", None).is_none());
        let h = response_headers(&cors(&["*"]), "https://any.example").unwrap();
        assert_eq!(h[header::ACCESS_CONTROL_ALLOW_ORIGIN], "*");
    }

    #[test]
    fn preflights_list_methods_headers_and_max_age() {
        let c = cors(&["https://app.example"]);
        let h = preflight(
            &c,
            "https://app.example",
            Some("authorization, content-type"),
        )
        .unwrap();
        assert_eq!(h[header::ACCESS_CONTROL_ALLOW_METHODS], ALLOWED_METHODS);
        assert_eq!(
            h[header::ACCESS_CONTROL_ALLOW_HEADERS],
            "authorization, content-type"
        );
        assert_eq!(h[header::ACCESS_CONTROL_MAX_AGE], "600");
        assert!(h.get(header::ACCESS_CONTROL_EXPOSE_HEADERS).is_none());
        // A malformed request-headers list gets the default list instead of an echo.
        let h = preflight(&c, "https://app.example", Some("bad header\u{7f}")).unwrap();
        assert_eq!(
            h[header::ACCESS_CONTROL_ALLOW_HEADERS],
            DEFAULT_ALLOWED_HEADERS
        );
        assert!(preflight(&c, "https://evil.example", None).is_none());
    }
}
