//! A recording reverse proxy on loopback, between a real client program (a coding agent)
//! and an edge: it forwards every request unchanged and keeps what was asked and answered,
//! so a test can assert that every request the program made got a 2xx and what the model
//! answers held (a tool call, then the tool's result sent back).

use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::Response;

/// One exchange the proxy relayed.
#[derive(Debug, Clone)]
pub struct Exchange {
    pub method: String,
    pub path: String,
    pub status: u16,
    pub request: Bytes,
    pub response: Bytes,
}

impl Exchange {
    pub fn request_text(&self) -> String {
        String::from_utf8_lossy(&self.request).into_owned()
    }

    pub fn response_text(&self) -> String {
        String::from_utf8_lossy(&self.response).into_owned()
    }
}

impl std::fmt::Display for Exchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} -> {}", self.method, self.path, self.status)
    }
}

#[derive(Clone)]
struct Shared {
    upstream: String,
    client: reqwest::Client,
    log: Arc<Mutex<Vec<Exchange>>>,
}

/// The proxy; it stops when dropped.
pub struct Recorder {
    /// `http://127.0.0.1:<port>`: where the client program is pointed.
    pub url: String,
    log: Arc<Mutex<Vec<Exchange>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Recorder {
    /// A proxy to `upstream` (`http://host:port`).
    pub async fn start(upstream: &str) -> Recorder {
        let log = Arc::new(Mutex::new(Vec::new()));
        let shared = Shared {
            upstream: upstream.trim_end_matches('/').to_string(),
            client: super::client(),
            log: log.clone(),
        };
        let app = axum::Router::new().fallback(relay).with_state(shared);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Recorder { url, log, task }
    }

    /// Every exchange so far, in order.
    pub fn exchanges(&self) -> Vec<Exchange> {
        self.log.lock().unwrap().clone()
    }
}

/// Headers that belong to one hop.
const HOP: &[&str] = &[
    "host",
    "connection",
    "content-length",
    "transfer-encoding",
    "keep-alive",
    "accept-encoding",
];

async fn relay(State(shared): State<Shared>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let body = axum::body::to_bytes(body, 64 << 20)
        .await
        .unwrap_or_default();
    let mut upstream = shared
        .client
        .request(parts.method.clone(), format!("{}{path}", shared.upstream))
        .body(body.clone());
    for (name, value) in &parts.headers {
        if !HOP.contains(&name.as_str()) {
            upstream = upstream.header(name, value);
        }
    }
    let (status, headers, answer) = match upstream.send().await {
        Ok(r) => {
            let status = r.status();
            let headers = r.headers().clone();
            (status, headers, r.bytes().await.unwrap_or_default())
        }
        Err(e) => (
            axum::http::StatusCode::BAD_GATEWAY,
            axum::http::HeaderMap::new(),
            Bytes::from(format!("recorder: upstream failed: {e}")),
        ),
    };
    shared.log.lock().unwrap().push(Exchange {
        method: parts.method.to_string(),
        path,
        status: status.as_u16(),
        request: body,
        response: answer.clone(),
    });
    let mut response = Response::new(Body::from(answer));
    *response.status_mut() = status;
    for (name, value) in &headers {
        if !HOP.contains(&name.as_str()) {
            response.headers_mut().append(name, value.clone());
        }
    }
    response
}
