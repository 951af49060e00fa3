//! An HTTP provider endpoint: base URL, credentials, extra headers and the timeout for the
//! response head, over the node's shared connection pools. Also the mapping from transport
//! failures and provider statuses to error codes.
//!
//! Adapters use reqwest. The raw tunnel — the hot path — sends plain-HTTP requests over
//! connections its own task drives ([`super::plain`]); HTTPS providers go through reqwest
//! there too. Both send a request once more when a kept-alive connection closed under
//! it before any answer (the provider's idle timeout crossing the request).

use iop_proto::ErrorCode;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use http_body_util::Full;
use iop_proto::pb;
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};

use super::error::AdapterError;
use super::plain::{PlainError, PlainPool};

/// The node's HTTP client for adapters and HTTPS providers, shared by every provider (one
/// connection pool), and one that never reuses a connection, for a request sent again
/// after a pooled connection closed under it.
#[derive(Debug, Clone)]
pub struct HttpClients {
    pub reqwest: reqwest::Client,
    pub fresh: reqwest::Client,
}

/// A plain-HTTP provider's connections and where its API root sits on them.
#[derive(Debug, Clone)]
struct PlainEndpoint {
    pool: Arc<PlainPool>,
    /// The `Host` header: the base URL's authority.
    host: HeaderValue,
    /// The base URL's path, prefixed to every request path (`/v1`).
    path_prefix: String,
}

/// A provider response as the tunnel relays it.
pub struct RawResponse {
    pub status: u16,
    pub headers: Vec<pb::Header>,
    /// `content-type: text/event-stream`.
    pub sse: bool,
    /// The body is read by the task that polls it (plain HTTP): whatever already arrived
    /// is handed over at once, so a scheduler round never brings more.
    pub read_in_task: bool,
    pub body: BoxStream<'static, Result<Bytes, AdapterError>>,
}

/// How long a provider may take to answer a request that is not streamed with its
/// response head (it comes once the whole answer is generated), unless configured.
pub const DEFAULT_HEAD_TIMEOUT: Duration = Duration::from_secs(600);

/// How long a provider may take to answer a streamed request with its response head,
/// unless configured. Servers send it once the prompt is taken in at the latest (vLLM and
/// llama-server at once, Ollama with its first token, after loading the model and the
/// prompt): two minutes fit a cold model load and a long prompt's prefill, and a backend
/// that never answers gives its slot back after that.
pub const DEFAULT_STREAM_HEAD_TIMEOUT: Duration = Duration::from_secs(120);

/// The most a lookup's JSON answer ([`HttpProvider::json_lookup`]: a token count, a model
/// list) may hold; a provider that sends more is answered as a bad upstream response.
pub const MAX_LOOKUP_BYTES: usize = 4 << 20;

/// Which head timeout a request is under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadWait {
    /// The answer streams: the head comes before it is generated.
    Streamed,
    /// The head comes with the whole answer.
    Whole,
}

#[derive(Debug, Clone)]
pub struct HttpProvider {
    pub id: String,
    base_url: String,
    /// The base URL's `host:port`, kept out of messages that reach clients.
    authority: String,
    headers: HeaderMap,
    head_timeout: Duration,
    stream_head_timeout: Duration,
    client: reqwest::Client,
    /// Never reuses a connection: for sending a request again.
    fresh: reqwest::Client,
    /// Set for `http://` providers.
    plain: Option<PlainEndpoint>,
    /// Its token counts: places and the endpoints that count.
    pub tokenizer: std::sync::Arc<super::tokenizer::Tokenizer>,
}

impl HttpProvider {
    pub fn new(spec: &pb::ProviderSpec, clients: &HttpClients) -> Result<Self, String> {
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
            authority: parsed
                .authority()
                .map(|a| a.as_str().to_string())
                .unwrap_or_default(),
            base_url,
            headers,
            head_timeout: if spec.request_timeout_sec > 0 {
                Duration::from_secs(spec.request_timeout_sec as u64)
            } else {
                DEFAULT_HEAD_TIMEOUT
            },
            stream_head_timeout: if spec.stream_head_timeout_sec > 0 {
                Duration::from_secs(spec.stream_head_timeout_sec as u64)
            } else {
                DEFAULT_STREAM_HEAD_TIMEOUT
            },
            client: clients.reqwest.clone(),
            fresh: clients.fresh.clone(),
            plain: match parsed.scheme_str() {
                Some("http") => Some(PlainEndpoint::new(&parsed)?),
                _ => None,
            },
            tokenizer: Default::default(),
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

    /// A request to `path` below the server root (the base URL without its `/v1`), with
    /// the provider's headers and key: where llama-server and vLLM serve `/tokenize`.
    pub fn root_request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, format!("{}{path}", self.server_root()))
            .headers(self.headers.clone())
    }

    /// Adds `headers` (a run's `provider_headers`) to a request, except those the provider's
    /// own config sets and any that are not valid headers.
    pub fn with_headers(
        &self,
        mut request: reqwest::RequestBuilder,
        headers: &[pb::Header],
    ) -> reqwest::RequestBuilder {
        for h in headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(h.name.as_bytes()),
                HeaderValue::from_bytes(&h.value),
            ) && !self.headers.contains_key(&name)
            {
                request = request.header(name, value);
            }
        }
        request
    }

    /// How long the head of an `answer` may take.
    fn head_timeout(&self, answer: HeadWait) -> Duration {
        match answer {
            HeadWait::Streamed => self.stream_head_timeout,
            HeadWait::Whole => self.head_timeout,
        }
    }

    /// Sends a request and waits for the response head, up to the provider's timeout for
    /// its kind of `answer`.
    ///
    /// A request whose connection closed before any byte of the response came back (a
    /// kept-alive connection the provider's idle timeout closed as the request went out)
    /// is sent once more on a new connection, within the same time.
    pub async fn send(
        &self,
        request: reqwest::RequestBuilder,
        answer: HeadWait,
    ) -> Result<reqwest::Response, AdapterError> {
        let within = self.head_timeout(answer);
        let deadline = tokio::time::Instant::now() + within;
        let spare = request.try_clone();
        let err = match tokio::time::timeout_at(deadline, request.send()).await {
            Ok(Ok(response)) => return Ok(response),
            Ok(Err(err)) => err,
            Err(_) => return Err(self.head_timeout_error(within)),
        };
        let spare = spare.filter(|_| closed_unanswered(&err));
        let Some(Ok(spare)) = spare.map(reqwest::RequestBuilder::build) else {
            return Err(self.transport_error(&err));
        };
        tracing::debug!(provider = self.id.as_str(), error = %with_cause("request failed", &err),
            "the provider closed the connection under the request, unanswered; sending it once more on a new connection");
        // Not on another pooled connection: the provider may have closed those too.
        match tokio::time::timeout_at(deadline, self.fresh.execute(spare)).await {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(err)) => Err(self.transport_error(&err)),
            Err(_) => Err(self.head_timeout_error(within)),
        }
    }

    /// Sends a request and returns the response if the provider accepted it (2xx); any
    /// other status becomes an error with the provider's own message.
    pub async fn accepted(
        &self,
        request: reqwest::RequestBuilder,
        answer: HeadWait,
    ) -> Result<reqwest::Response, AdapterError> {
        let response = self.send(request, answer).await?;
        if response.status().is_success() {
            Ok(response)
        } else {
            Err(self.status_error(response).await)
        }
    }

    /// One raw request for the tunnel: `headers` are sent as given, except where the
    /// provider's own config sets a header of that name (the config wins), and the
    /// response comes back as status, headers and a byte stream.
    pub async fn exchange(
        &self,
        method: &str,
        path: &str,
        headers: impl Iterator<Item = (&str, &[u8])>,
        body: Bytes,
        answer: HeadWait,
    ) -> Result<RawResponse, AdapterError> {
        let within = self.head_timeout(answer);
        let method = http::Method::from_bytes(method.as_bytes()).unwrap_or(http::Method::POST);
        let Some(plain) = &self.plain else {
            let mut request = self.request(method, path);
            for (name, value) in headers {
                if let (Ok(name), Ok(value)) = (
                    HeaderName::from_bytes(name.as_bytes()),
                    HeaderValue::from_bytes(value),
                ) && !self.headers.contains_key(&name)
                {
                    request = request.header(name, value);
                }
            }
            let response = self.send(request.body(body), answer).await?;
            let (status, out_headers, sse) = head_of(response.status(), response.headers());
            let id = self.clone();
            let body = response
                .bytes_stream()
                .map(move |r| r.map_err(|e| id.transport_error(&e)))
                .boxed();
            return Ok(RawResponse {
                status,
                headers: out_headers,
                sse,
                read_in_task: false,
                body,
            });
        };
        let target = format!("{}{path}", plain.path_prefix);
        let uri: http::Uri = target.parse().map_err(|e| {
            AdapterError::new(
                ErrorCode::BadRequest,
                format!("provider {}: bad path {path:?}: {e}", self.id),
            )
        })?;
        let mut request = http::Request::builder().method(method).uri(uri);
        let map = request.headers_mut().expect("a fresh builder has headers");
        map.insert(http::header::HOST, plain.host.clone());
        map.extend(self.headers.iter().map(|(k, v)| (k.clone(), v.clone())));
        for (name, value) in headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_bytes(value),
            ) && !self.headers.contains_key(&name)
            {
                map.append(name, value);
            }
        }
        let request = request.body(Full::new(body)).map_err(|e| {
            AdapterError::new(ErrorCode::BadRequest, format!("provider {}: {e}", self.id))
        })?;
        let response = match tokio::time::timeout(within, plain.pool.send(request)).await {
            Ok(Ok(response)) => response,
            Ok(Err(err)) => {
                let (code, what) = plain_failure(&err);
                return Err(AdapterError::new(code, self.chain(&what, &err)));
            }
            Err(_) => return Err(self.head_timeout_error(within)),
        };
        let (status, out_headers, sse) = head_of(response.status(), response.headers());
        let id = self.id.clone();
        let body = response
            .into_body()
            .map(move |r| {
                r.map_err(|e: PlainError| {
                    AdapterError::new(ErrorCode::BrokenStream, format!("provider {id}: {e}"))
                })
            })
            .boxed();
        Ok(RawResponse {
            status,
            headers: out_headers,
            sse,
            read_in_task: true,
            body,
        })
    }

    fn head_timeout_error(&self, within: Duration) -> AdapterError {
        AdapterError::new(
            ErrorCode::ProviderTimeout,
            format!(
                "provider {} did not answer within {}s",
                self.id,
                within.as_secs()
            ),
        )
    }

    /// What went wrong, for the edge and its clients: `provider ID: what (cause)`, never the
    /// provider's URL or address (they are internal: any left in `what` are replaced). The
    /// whole error chain, URL included, is logged here on the node.
    fn chain(&self, what: &str, err: &dyn std::error::Error) -> String {
        let mut full = format!("provider {} at {}: {err}", self.id, self.base_url);
        let mut source = err.source();
        while let Some(inner) = source {
            full.push_str(&format!(": {inner}"));
            source = inner.source();
        }
        tracing::warn!(provider = %self.id, error = %full, "provider request failed");
        let mut what = what.replace(&self.base_url, "(provider)");
        if !self.authority.is_empty() {
            what = what.replace(&self.authority, "(provider)");
        }
        format!("provider {}: {what}", self.id)
    }

    /// Maps a failed request to an error that says what went wrong where.
    pub fn transport_error(&self, err: &reqwest::Error) -> AdapterError {
        let code = if err.is_timeout() {
            ErrorCode::ProviderTimeout
        } else if err.is_connect() {
            ErrorCode::ProviderUnreachable
        } else {
            ErrorCode::ProviderError
        };
        AdapterError::new(
            code,
            self.chain(&with_cause(reqwest_failure(err), err), err),
        )
    }

    /// The server root: the base URL without its `/v1` (where vLLM serves `/health`).
    pub fn server_root(&self) -> &str {
        self.base_url.strip_suffix("/v1").unwrap_or(&self.base_url)
    }

    /// A small lookup (a model list, a token count — not a generation): sends `request`
    /// and reads its 2xx JSON answer, all within `within`; `what` names it in errors.
    pub async fn json_lookup(
        &self,
        request: reqwest::RequestBuilder,
        within: Duration,
        what: &str,
    ) -> Result<serde_json::Value, AdapterError> {
        let exchange = async {
            let response = request.send().await.map_err(|e| self.transport_error(&e))?;
            if !response.status().is_success() {
                return Err(self.status_error(response).await);
            }
            let mut response = response;
            let mut body = Vec::new();
            while let Some(chunk) = response
                .chunk()
                .await
                .map_err(|e| self.transport_error(&e))?
            {
                if body.len() + chunk.len() > MAX_LOOKUP_BYTES {
                    return Err(AdapterError::new(
                        ErrorCode::BadUpstreamResponse,
                        format!(
                            "provider {}: {what} answered more than {} MiB",
                            self.id,
                            MAX_LOOKUP_BYTES >> 20
                        ),
                    ));
                }
                body.extend_from_slice(&chunk);
            }
            serde_json::from_slice::<serde_json::Value>(&body).map_err(|_| {
                AdapterError::new(
                    ErrorCode::BadUpstreamResponse,
                    format!("provider {}: {what} answered no JSON", self.id),
                )
            })
        };
        tokio::time::timeout(within, exchange)
            .await
            .unwrap_or_else(|_| {
                Err(AdapterError::new(
                    ErrorCode::ProviderTimeout,
                    format!("provider {}: {what} took over {within:?}", self.id),
                ))
            })
    }

    /// A health probe: `GET url` with the provider's headers must answer 2xx within
    /// `timeout`. The error names `label` (the probed path), never the URL.
    pub async fn probe_get(&self, url: &str, label: &str, timeout: Duration) -> Result<(), String> {
        let request = self
            .client
            .get(url)
            .headers(self.headers.clone())
            .timeout(timeout)
            .send();
        match tokio::time::timeout(timeout + Duration::from_millis(100), request).await {
            Ok(Ok(response)) if response.status().is_success() => Ok(()),
            Ok(Ok(response)) => Err(format!("GET {label}: HTTP {}", response.status())),
            Ok(Err(err)) => Err(format!(
                "GET {label}: {}",
                with_cause(reqwest_failure(&err), &err)
            )),
            Err(_) => Err(format!(
                "GET {label}: no answer within {}ms",
                timeout.as_millis()
            )),
        }
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
        let code =
            ErrorCode::from_provider_status(status.as_u16()).unwrap_or(ErrorCode::ProviderError);
        AdapterError::new(
            code,
            format!("provider {} returned {status}: {detail}", self.id),
        )
    }
}

/// What a reqwest failure was, in a few words.
fn reqwest_failure(err: &reqwest::Error) -> &'static str {
    if err.is_timeout() {
        "timed out"
    } else if err.is_connect() {
        "cannot connect"
    } else if err.is_body() || err.is_decode() {
        "the response body failed"
    } else {
        "request failed"
    }
}

/// The connection closed before any byte of the response came back: hyper's "connection
/// closed before message completed", or a request it cancelled as its connection went.
fn closed_unanswered(err: &reqwest::Error) -> bool {
    use std::error::Error;
    let mut source = err.source();
    while let Some(inner) = source {
        if let Some(hyper) = inner.downcast_ref::<hyper::Error>() {
            return hyper.is_incomplete_message() || hyper.is_canceled();
        }
        source = inner.source();
    }
    false
}

/// `what (root cause)` for a reqwest error: its own message names the URL, so only the
/// innermost error of its chain says why (`Connection refused (os error 111)`), unless
/// that one names a URL too.
fn with_cause(what: &str, err: &reqwest::Error) -> String {
    use std::error::Error;
    let mut innermost: Option<&dyn Error> = None;
    let mut source = err.source();
    while let Some(inner) = source {
        innermost = Some(inner);
        source = inner.source();
    }
    match innermost.map(|e| e.to_string()) {
        Some(cause) if !cause.is_empty() && !cause.contains("://") => format!("{what} ({cause})"),
        _ => what.to_string(),
    }
}

/// The code and the words (without the provider's address) for a failed plain exchange.
fn plain_failure(err: &PlainError) -> (ErrorCode, String) {
    match err {
        PlainError::Connect { source, .. } => (
            ErrorCode::ProviderUnreachable,
            format!("cannot connect ({source})"),
        ),
        PlainError::ConnectTimeout(_) => (
            ErrorCode::ProviderUnreachable,
            "cannot connect (timed out)".to_string(),
        ),
        PlainError::Http(e) => {
            use std::error::Error;
            let mut words = format!("request failed ({e}");
            let mut source = e.source();
            while let Some(inner) = source {
                words.push_str(&format!(": {inner}"));
                source = inner.source();
            }
            words.push(')');
            (ErrorCode::ProviderError, words)
        }
        PlainError::Closed => (ErrorCode::ProviderError, err.to_string()),
    }
}

impl PlainEndpoint {
    fn new(base: &http::Uri) -> Result<Self, String> {
        let authority = base
            .authority()
            .ok_or_else(|| format!("base_url {base} has no host"))?;
        let port = authority.port_u16().unwrap_or(80);
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|_| format!("base_url {base}: the host is not a valid header value"))?;
        Ok(Self {
            pool: PlainPool::new(format!("{}:{port}", authority.host())),
            host,
            path_prefix: base.path().trim_end_matches('/').to_string(),
        })
    }
}

/// Status, headers as wire headers, and whether the body is an event stream.
fn head_of(status: http::StatusCode, headers: &HeaderMap) -> (u16, Vec<pb::Header>, bool) {
    let sse = headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let out = headers
        .iter()
        .map(|(name, value)| pb::Header {
            name: name.as_str().to_string(),
            value: value.as_bytes().to_vec(),
        })
        .collect();
    (status.as_u16(), out, sse)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::closing_provider::{BODY, Closing, provider};

    async fn provider_at(addr: &str) -> HttpProvider {
        let spec = pb::ProviderSpec {
            id: "p".into(),
            base_url: format!("http://{addr}/v1"),
            ..Default::default()
        };
        HttpProvider::new(&spec, &crate::http_clients()).unwrap()
    }

    #[tokio::test]
    async fn a_request_a_kept_alive_connection_closed_under_is_sent_once_more() {
        let (addr, accepted) = provider(Closing::UnderTheNextRequest).await;
        let http = provider_at(&addr).await;
        for _ in 0..4 {
            let request = http
                .request(reqwest::Method::POST, "/chat/completions")
                .body("{}");
            let response =
                tokio::time::timeout(Duration::from_secs(5), http.send(request, HeadWait::Whole))
                    .await
                    .expect("answered")
                    .expect("sent once more on a fresh connection");
            assert_eq!(response.text().await.unwrap(), BODY);
        }
        // Every request after the first goes out on the connection the last one left,
        // which the provider closes under it unanswered: four answers, four connections.
        assert_eq!(accepted.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn a_lookup_answer_larger_than_the_cap_is_refused_without_reading_it_all() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        // Announces no length and sends JSON-looking bytes forever.
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut head = [0u8; 4096];
            let _ = socket.read(&mut head).await;
            let _ = socket
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n[")
                .await;
            let chunk = vec![b'1'; 64 * 1024];
            loop {
                if socket.write_all(&chunk).await.is_err() {
                    return;
                }
            }
        });
        let http = provider_at(&addr).await;
        let request = http.request(reqwest::Method::GET, "/models");
        let err = http
            .json_lookup(request, Duration::from_secs(60), "GET /v1/models")
            .await
            .unwrap_err();
        assert_eq!(err.code, ErrorCode::BadUpstreamResponse);
        assert!(err.message.contains("more than 4 MiB"), "{}", err.message);
    }

    #[tokio::test]
    async fn a_refused_connection_is_not_sent_again() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        let http = provider_at(&addr).await;
        let request = http
            .request(reqwest::Method::POST, "/chat/completions")
            .body("{}");
        let err = http.send(request, HeadWait::Whole).await.unwrap_err();
        assert_eq!(err.code, ErrorCode::ProviderUnreachable);
    }
}
