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
//! The decisions are pure functions ([`decide`], [`preflight`], [`response_headers`]);
//! [`super::front`] applies them to every request.

use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::response::Response;

use crate::config::CorsConfig;

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

/// What CORS does with one request.
#[derive(Debug)]
pub enum Decision {
    /// Nothing: CORS is off, the request has no `Origin`, or it comes from an origin that
    /// is not allowed (a preflight from one goes on to the routes, a 405 or 404).
    Nothing,
    /// A preflight from an allowed origin: answered 204 with these headers, before
    /// authentication.
    Preflight(HeaderMap),
    /// A request from an allowed origin: its response gets these headers.
    Decorate(HeaderMap),
}

/// What CORS does with a request of `method` with `headers`.
pub fn decide(cors: &CorsConfig, method: &Method, headers: &HeaderMap) -> Decision {
    if !cors.enabled() {
        return Decision::Nothing;
    }
    let Some(origin) = headers.get(header::ORIGIN).and_then(|o| o.to_str().ok()) else {
        return Decision::Nothing;
    };
    if method == Method::OPTIONS && headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD) {
        let requested = headers
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .and_then(|h| h.to_str().ok());
        return match preflight(cors, origin, requested) {
            Some(headers) => Decision::Preflight(headers),
            None => {
                tracing::debug!(%origin, "CORS preflight from an origin not in http.cors.allowed_origins");
                Decision::Nothing
            }
        };
    }
    match response_headers(cors, origin) {
        Some(headers) => Decision::Decorate(headers),
        None => Decision::Nothing,
    }
}

/// Adds CORS `headers` to a response (`Vary` next to any it has, the others replacing).
pub fn decorate(headers: HeaderMap, response: &mut Response) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cors(origins: &[&str]) -> CorsConfig {
        CorsConfig {
            allowed_origins: origins.iter().map(|s| s.to_string()).collect(),
            max_age_sec: 600,
        }
    }

    fn headers(pairs: &[(header::HeaderName, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(n, v)| (n.clone(), HeaderValue::from_static(v)))
            .collect()
    }

    #[test]
    fn preflights_are_answered_only_for_allowed_origins() {
        let c = cors(&["https://app.example"]);
        let preflight_from = |origin| {
            headers(&[
                (header::ORIGIN, origin),
                (header::ACCESS_CONTROL_REQUEST_METHOD, "POST"),
            ])
        };
        let get = |origin| headers(&[(header::ORIGIN, origin)]);
        assert!(matches!(
            decide(&c, &Method::OPTIONS, &preflight_from("https://app.example")),
            Decision::Preflight(_)
        ));
        assert!(matches!(
            decide(
                &c,
                &Method::OPTIONS,
                &preflight_from("https://evil.example")
            ),
            Decision::Nothing
        ));
        assert!(matches!(
            decide(&c, &Method::POST, &get("https://app.example")),
            Decision::Decorate(_)
        ));
        assert!(matches!(
            decide(&c, &Method::POST, &get("https://evil.example")),
            Decision::Nothing
        ));
        assert!(matches!(
            decide(&c, &Method::POST, &HeaderMap::new()),
            Decision::Nothing
        ));
        // CORS off: even an OPTIONS with an origin goes on to the routes.
        assert!(matches!(
            decide(
                &cors(&[]),
                &Method::OPTIONS,
                &preflight_from("https://app.example")
            ),
            Decision::Nothing
        ));
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
