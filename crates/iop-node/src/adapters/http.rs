//! An HTTP provider endpoint: base URL, credentials, extra headers and the timeout for the
//! response head, over the node's shared connection pool. Also the mapping from transport
//! failures and provider statuses to error codes.

use std::time::Duration;

use iop_proto::pb;
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};

use super::AdapterError;

/// How long a provider may take to answer with a response head, unless configured.
pub const DEFAULT_HEAD_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Clone)]
pub struct HttpProvider {
    pub id: String,
    base_url: String,
    headers: HeaderMap,
    head_timeout: Duration,
    client: reqwest::Client,
}

impl HttpProvider {
    pub fn new(spec: &pb::ProviderSpec, client: &reqwest::Client) -> Result<Self, String> {
        let base_url = spec.base_url.trim_end_matches('/').to_string();
        let parsed: http::Uri = base_url
            .parse()
            .map_err(|e| format!("base_url {base_url:?} is not a URL: {e}"))?;
        if !matches!(parsed.scheme_str(), Some("http" | "https")) {
            return Err(format!("base_url {base_url:?} must be http:// or https://"));
        }
        let mut headers = HeaderMap::new();
        for (name, value) in &spec.headers {
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("headers: {name:?} is not a header name"))?;
            let value = HeaderValue::from_str(value)
                .map_err(|_| format!("headers: the value of {name} is not a valid header value"))?;
            headers.insert(name, value);
        }
        let key = if !spec.api_key_env.is_empty() {
            Some(std::env::var(&spec.api_key_env).map_err(|_| {
                format!(
                    "api_key_env: environment variable {} is not set on this node",
                    spec.api_key_env
                )
            })?)
        } else if !spec.api_key.is_empty() {
            Some(spec.api_key.clone())
        } else {
            None
        };
        if let Some(key) = key {
            let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
                .map_err(|_| "api key: not a valid header value".to_string())?;
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
        }
        Ok(Self {
            id: spec.id.clone(),
            base_url,
            headers,
            head_timeout: if spec.request_timeout_sec > 0 {
                Duration::from_secs(spec.request_timeout_sec as u64)
            } else {
                DEFAULT_HEAD_TIMEOUT
            },
            client: client.clone(),
        })
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base_url, path)
    }

    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// A request to `path` below the base URL, with the provider's headers and key.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, self.url(path))
            .headers(self.headers.clone())
    }

    /// Sends a request and waits for the response head, up to the provider's timeout.
    pub async fn send(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, AdapterError> {
        match tokio::time::timeout(self.head_timeout, request.send()).await {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(err)) => Err(self.transport_error(&err)),
            Err(_) => Err(AdapterError::new(
                "provider_timeout",
                format!(
                    "provider {} did not answer within {}s",
                    self.id,
                    self.head_timeout.as_secs()
                ),
            )),
        }
    }

    /// Maps a failed request to an error that says what went wrong where.
    pub fn transport_error(&self, err: &reqwest::Error) -> AdapterError {
        let code = if err.is_timeout() {
            "provider_timeout"
        } else if err.is_connect() {
            "provider_unreachable"
        } else {
            "provider_error"
        };
        let mut message = format!("provider {} at {}: {err}", self.id, self.base_url);
        let mut source = std::error::Error::source(err);
        while let Some(inner) = source {
            message.push_str(&format!(": {inner}"));
            source = inner.source();
        }
        AdapterError::new(code, message)
    }

    /// An error for a non-success status, with the provider's own message if it gave one.
    pub async fn status_error(&self, response: reqwest::Response) -> AdapterError {
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        let detail = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| {
                v.pointer("/error/message")
                    .or_else(|| v.get("error"))
                    .and_then(|m| m.as_str().map(String::from))
            })
            .unwrap_or_else(|| body.chars().take(300).collect());
        let code = match status.as_u16() {
            400 | 422 => "bad_request",
            401 | 403 => "provider_auth",
            404 => "unknown_target",
            429 => "capacity",
            _ => "provider_error",
        };
        AdapterError::new(
            code,
            format!("provider {} returned {status}: {detail}", self.id),
        )
    }
}
