//! Headers between clients, the edge, the node and providers, with real processes: a
//! client's `x-request-id` comes back on every response, is in the edge's and the node's
//! logs and reaches the provider on every path (tunnel, run, Ollama native, translated);
//! W3C trace context and the configured `forward_headers` reach the provider and nothing
//! else does; a provider's `set-cookie` never reaches the client; CORS answers browsers
//! from allowed origins only.

mod common;

use std::time::Duration;

use common::ollama_api::start_node_env;
use common::*;
use reqwest::header::HeaderMap;
use serde_json::{Value, json};

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

struct Setup {
    _dir: tempfile::TempDir,
    mock: MockProc,
    edge: EdgeProc,
    node: Proc,
}

async fn setup() -> Setup {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let config = format!(
        r#"
auth:
  keys:
    - {{name: ops, role: admin, key: "{TEST_API_KEY}"}}
http:
  forward_headers: [x-tenant]
  cors:
    allowed_origins: ["https://app.example"]
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{a}"}}
      - {{id: ol, kind: ollama, base_url: "{o}"}}
model_groups:
  - {{name: tunnel, members: [{{node: n1, provider: oa, model: mock-model}}]}}
  - {{name: ollama, members: [{{node: n1, provider: ol, model: mock-model}}]}}
  - {{name: cookie-tunnel, members: [{{node: n1, provider: oa, model: set-cookie}}]}}
  - {{name: cookie-ollama, members: [{{node: n1, provider: ol, model: set-cookie}}]}}
"#,
        a = mock.openai_base(),
        o = mock.ollama_base(),
    );
    let edge = start_edge_env(dir.path(), &config, &[("RUST_LOG", "info,iop_edge=debug")]).await;
    let node = start_node_env(
        "n1",
        dir.path(),
        &edge.nodes,
        "token-n1-0123456789",
        &[("RUST_LOG", "info,iop_node=debug")],
    );
    wait_ready(&edge, "n1").await;
    Setup {
        _dir: dir,
        mock,
        edge,
        node,
    }
}

/// Sends `body` to `path` with the admin key and `headers`; the response's status,
/// headers and body.
async fn send(
    edge: &EdgeProc,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, HeaderMap, String) {
    let mut request = client()
        .post(edge.url(path))
        .bearer_auth(TEST_API_KEY)
        .json(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (status, headers, response.text().await.unwrap())
}

async fn last_headers(mock: &MockProc) -> Value {
    mock.stats().await["last_headers"].clone()
}

fn chat(model: &str) -> Value {
    json!({"model": model, "stream": false, "messages": [{"role": "user", "content": "hi"}]})
}

#[tokio::test]
async fn a_client_request_id_is_returned_logged_and_reaches_the_provider_on_every_path() {
    let s = setup().await;
    let paths = [
        ("/v1/chat/completions", "tunnel", "tunnel"),
        ("/v1/chat/completions", "ollama", "run"),
        ("/api/chat", "ollama", "ollama-native"),
        ("/api/chat", "tunnel", "translated"),
    ];
    for (i, (path, model, what)) in paths.into_iter().enumerate() {
        let id = format!("client-req-{i}-{what}");
        let (status, headers, body) = send(
            &s.edge,
            path,
            &chat(model),
            &[
                ("x-request-id", &id),
                ("traceparent", PARENT),
                ("tracestate", "vendor=abc"),
                ("x-tenant", "t-42"),
                ("x-other", "not forwarded"),
            ],
        )
        .await;
        assert_eq!(status, 200, "{what}: {body}");
        assert_eq!(headers["x-request-id"], id.as_str(), "{what}");
        let seen = last_headers(&s.mock).await;
        assert_eq!(seen["x-request-id"], id.as_str(), "{what}: {seen}");
        assert_eq!(seen["traceparent"], PARENT, "{what}: {seen}");
        assert_eq!(seen["tracestate"], "vendor=abc", "{what}: {seen}");
        assert_eq!(seen["x-tenant"], "t-42", "{what}: {seen}");
        assert!(seen.get("x-other").is_none(), "{what}: {seen}");
        s.edge
            .proc
            .wait_line(&format!("request_id={id}"), Duration::from_secs(10))
            .await;
        s.node
            .wait_line(&format!("request_id={id}"), Duration::from_secs(10))
            .await;
    }
}

#[tokio::test]
async fn unsafe_ids_are_replaced_and_bad_trace_context_stays_behind() {
    let s = setup().await;
    let (status, headers, _) = send(
        &s.edge,
        "/v1/chat/completions",
        &chat("tunnel"),
        &[
            ("x-request-id", "no spaces; allowed"),
            ("traceparent", "00-not-a-trace"),
            ("tracestate", "vendor=abc"),
        ],
    )
    .await;
    assert_eq!(status, 200);
    let id = headers["x-request-id"].to_str().unwrap().to_string();
    assert_ne!(id, "no spaces; allowed");
    assert_eq!(id.len(), 36, "a fresh UUID: {id}");
    let seen = last_headers(&s.mock).await;
    assert_eq!(seen["x-request-id"], id.as_str(), "{seen}");
    assert!(seen.get("traceparent").is_none(), "{seen}");
    assert!(seen.get("tracestate").is_none(), "{seen}");
}

#[tokio::test]
async fn every_response_carries_a_request_id_errors_included() {
    let s = setup().await;
    let mut ids = Vec::new();
    for (path, key) in [
        ("/healthz", None),
        ("/v1/models", None),
        ("/v1/models", Some(TEST_API_KEY)),
        ("/no/such/path", Some(TEST_API_KEY)),
        ("/api/tags", None),
    ] {
        let mut request = client().get(s.edge.url(path));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        let response = request.send().await.unwrap();
        let id = response
            .headers()
            .get("x-request-id")
            .unwrap_or_else(|| panic!("{path}: no x-request-id"))
            .to_str()
            .unwrap()
            .to_string();
        ids.push(id);
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 5, "each response its own id: {ids:?}");
    let response = client()
        .get(s.edge.url("/v1/models"))
        .header("x-request-id", "mine-1")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(response.headers()["x-request-id"], "mine-1");
}

#[tokio::test]
async fn a_providers_set_cookie_never_reaches_the_client() {
    let s = setup().await;
    // The provider does send one.
    let direct = client()
        .post(format!("{}/chat/completions", s.mock.openai_base()))
        .json(&chat("set-cookie"))
        .send()
        .await
        .unwrap();
    assert!(direct.headers().get("set-cookie").is_some());
    for (path, model) in [
        ("/v1/chat/completions", "cookie-tunnel"),
        ("/api/chat", "cookie-ollama"),
    ] {
        for stream in [false, true] {
            let mut body = chat(model);
            body["stream"] = json!(stream);
            let (status, headers, text) = send(&s.edge, path, &body, &[]).await;
            assert_eq!(status, 200, "{path}: {text}");
            assert!(
                headers.get("set-cookie").is_none(),
                "{path} stream={stream}: {headers:?}"
            );
        }
    }
}

#[tokio::test]
async fn cors_answers_allowed_origins_only() {
    let s = setup().await;
    let preflight = |origin: &'static str| {
        client()
            .request(reqwest::Method::OPTIONS, s.edge.url("/v1/chat/completions"))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization, content-type",
            )
            .send()
    };
    // Allowed: answered before authentication (a preflight has no credentials).
    let allowed = preflight("https://app.example").await.unwrap();
    assert_eq!(allowed.status(), 204);
    let h = allowed.headers();
    assert_eq!(h["access-control-allow-origin"], "https://app.example");
    assert!(
        h["access-control-allow-methods"]
            .to_str()
            .unwrap()
            .contains("POST")
    );
    assert_eq!(
        h["access-control-allow-headers"],
        "authorization, content-type"
    );
    assert!(h.get("access-control-max-age").is_some());
    assert!(h.get_all("vary").iter().any(|v| v == "Origin"));
    assert!(h.get("x-request-id").is_some());
    // Any other origin: no CORS header at all.
    let refused = preflight("https://evil.example").await.unwrap();
    assert_ne!(refused.status(), 204);
    assert!(
        !refused
            .headers()
            .keys()
            .any(|k| k.as_str().starts_with("access-control-")),
        "{:?}",
        refused.headers()
    );

    for (origin, expected) in [
        ("https://app.example", Some("https://app.example")),
        ("https://evil.example", None),
    ] {
        let response = client()
            .get(s.edge.url("/v1/models"))
            .bearer_auth(TEST_API_KEY)
            .header("origin", origin)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let h = response.headers();
        assert_eq!(
            h.get("access-control-allow-origin")
                .map(|v| v.to_str().unwrap()),
            expected,
            "{origin}"
        );
        if expected.is_some() {
            let exposed = h["access-control-expose-headers"].to_str().unwrap();
            assert!(exposed.contains("x-request-id"), "{exposed}");
        }
    }
}
