//! The `http:` section: how the HTTP API treats browsers and headers — which web origins
//! may call it from a page (`cors`), which further client headers reach providers
//! (`forward_headers`), and whether a provider's `set-cookie` reaches clients
//! (`relay_set_cookie`). Timeouts and sizes are `limits.http`, not here.
//!
//! Everything here is read per request, so a reload applies it at once.

use super::FieldError;
use serde::Deserialize;

/// Longest `cors.max_age_sec` (browsers cap it lower anyway).
pub const MAX_CORS_MAX_AGE_SEC: u32 = 86_400;
pub const DEFAULT_CORS_MAX_AGE_SEC: u32 = 600;
/// Most entries of `forward_headers`.
pub const MAX_FORWARD_HEADERS: usize = 64;

/// Headers `forward_headers` may not name: the ones that describe this hop, the ones the
/// edge sets itself, the client's credentials for iop, and those iop forwards anyway.
const NOT_FORWARDABLE: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "host",
    "content-length",
    "content-type",
    "accept",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
    "x-request-id",
    "traceparent",
    "tracestate",
];

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpApiConfig {
    /// Cross-origin requests from web pages; off unless origins are listed.
    #[serde(default)]
    pub cors: CorsConfig,
    /// Client request headers passed on to the provider (besides `x-request-id` and a
    /// valid `traceparent` / `tracestate`, which always are). Default: none.
    #[serde(default)]
    pub forward_headers: Vec<String>,
    /// Whether a provider's `set-cookie` headers reach the client. Default: dropped.
    #[serde(default)]
    pub relay_set_cookie: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CorsConfig {
    /// Origins (`https://app.example`, `http://localhost:3000`) whose pages may call the
    /// API, or `["*"]` for any. Empty: no CORS headers at all, preflights are not answered.
    #[serde(default)]
    pub allowed_origins: Vec<String>,
    /// How long a browser may cache a preflight answer.
    #[serde(default = "default_max_age")]
    pub max_age_sec: u32,
}

fn default_max_age() -> u32 {
    DEFAULT_CORS_MAX_AGE_SEC
}

impl Default for CorsConfig {
    fn default() -> Self {
        Self {
            allowed_origins: Vec::new(),
            max_age_sec: DEFAULT_CORS_MAX_AGE_SEC,
        }
    }
}

impl CorsConfig {
    /// Whether any origin may call the API (`["*"]`).
    pub fn any_origin(&self) -> bool {
        self.allowed_origins.iter().any(|o| o == "*")
    }

    /// Whether CORS is on.
    pub fn enabled(&self) -> bool {
        !self.allowed_origins.is_empty()
    }

    /// Whether `origin` (an `Origin` header value) is allowed. Scheme and host compare
    /// without regard to case, as browsers send them in lower case anyway.
    pub fn allows(&self, origin: &str) -> bool {
        self.any_origin()
            || self
                .allowed_origins
                .iter()
                .any(|o| o.eq_ignore_ascii_case(origin))
    }
}

impl HttpApiConfig {
    /// The field under `http` that is wrong and why.
    pub fn validate(&self) -> Result<(), FieldError> {
        let origins = &self.cors.allowed_origins;
        for (i, origin) in origins.iter().enumerate() {
            let at = format!("cors.allowed_origins[{i}]");
            if origin == "*" {
                if origins.len() > 1 {
                    return Err(FieldError::new(
                        at,
                        "\"*\" allows every origin: give it alone, or list origins".into(),
                    ));
                }
                continue;
            }
            check_origin(origin).map_err(|message| FieldError::new(at, message))?;
        }
        if self.cors.max_age_sec > MAX_CORS_MAX_AGE_SEC {
            return Err(FieldError::new(
                "cors.max_age_sec".into(),
                format!("must be at most {MAX_CORS_MAX_AGE_SEC} (a day)"),
            ));
        }
        if self.forward_headers.len() > MAX_FORWARD_HEADERS {
            return Err(FieldError::new(
                "forward_headers".into(),
                format!("at most {MAX_FORWARD_HEADERS} headers"),
            ));
        }
        for (i, name) in self.forward_headers.iter().enumerate() {
            let at = format!("forward_headers[{i}]");
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(FieldError::new(
                    at,
                    format!("{name:?} is not a header name"),
                ));
            }
            let lower = name.to_ascii_lowercase();
            if NOT_FORWARDABLE.contains(&lower.as_str()) {
                let why = match lower.as_str() {
                    "x-request-id" | "traceparent" | "tracestate" => {
                        "is always forwarded (when valid); leave it out"
                    }
                    "authorization" | "proxy-authorization" | "cookie" => {
                        "carries the client's credentials for this edge and is never forwarded"
                    }
                    _ => "describes this hop or is set by the edge, and cannot be forwarded",
                };
                return Err(FieldError::new(at, format!("{name:?} {why}")));
            }
        }
        Ok(())
    }
}

/// An origin as browsers send it: `scheme://host[:port]`, http or https, nothing after.
fn check_origin(origin: &str) -> Result<(), String> {
    let form = "must be an origin like \"https://app.example\" or \"http://localhost:3000\" \
                (scheme, host and optional port; no path, not even a trailing slash)";
    let Some((scheme, rest)) = origin.split_once("://") else {
        return Err(format!("{origin:?} {form}"));
    };
    if !matches!(scheme.to_ascii_lowercase().as_str(), "http" | "https")
        || rest.is_empty()
        || rest.contains(['/', '?', '#', '@', ' '])
    {
        return Err(format!("{origin:?} {form}"));
    }
    let authority: http::uri::Authority = rest.parse().map_err(|_| format!("{origin:?} {form}"))?;
    if authority.host().is_empty() {
        return Err(format!("{origin:?} {form}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(origins: &[&str], forward: &[&str]) -> Result<(), FieldError> {
        HttpApiConfig {
            cors: CorsConfig {
                allowed_origins: origins.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            },
            forward_headers: forward.iter().map(|s| s.to_string()).collect(),
            relay_set_cookie: false,
        }
        .validate()
    }

    #[test]
    fn origins_must_be_bare_origins() {
        for good in [
            "https://app.example",
            "http://localhost:3000",
            "HTTPS://App.Example",
            "http://[::1]:8080",
        ] {
            assert!(with(&[good], &[]).is_ok(), "{good}");
        }
        assert!(with(&["*"], &[]).is_ok());
        for bad in [
            "app.example",
            "https://app.example/",
            "https://app.example/path",
            "ftp://app.example",
            "https://",
            "https://user@app.example",
            "null",
        ] {
            let FieldError { path, message } = with(&[bad], &[]).unwrap_err();
            assert_eq!(path, "cors.allowed_origins[0]", "{bad}");
            assert!(message.contains("origin"), "{message}");
        }
        let path = with(&["https://a.example", "*"], &[]).unwrap_err().path;
        assert_eq!(path, "cors.allowed_origins[1]");
    }

    #[test]
    fn forwarded_headers_exclude_credentials_and_hop_headers() {
        assert!(with(&[], &["x-tenant", "OpenAI-Organization"]).is_ok());
        for bad in [
            "Authorization",
            "cookie",
            "host",
            "connection",
            "x-request-id",
        ] {
            let path = with(&[], &["x-ok", bad]).unwrap_err().path;
            assert_eq!(path, "forward_headers[1]", "{bad}");
        }
        assert!(with(&[], &["bad header"]).is_err());
    }

    #[test]
    fn origins_match_without_case() {
        let cors = CorsConfig {
            allowed_origins: vec!["https://App.example".into()],
            ..Default::default()
        };
        assert!(cors.allows("https://app.example"));
        assert!(!cors.allows("https://app.example:8443"));
        assert!(!cors.allows("https://evil.example"));
        assert!(!CorsConfig::default().enabled());
    }
}
