//! A one-member group in front of a backend that lets go of its kept-alive connections, as
//! servers with short idle timeouts do: every request succeeds. The backend (a raw HTTP/1.1
//! server here) either closes each connection right after its one response, without
//! saying so, or keeps it and closes it unanswered when the next request arrives on it —
//! the race a client loses when the server's idle timeout crosses its request. Both an
//! OpenAI-compatible member (the raw tunnel's plain pool, and the Messages translation on
//! top of it) and an Ollama member (runs over reqwest) are driven through it.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// How the backend ends its connections.
#[derive(Clone, Copy, Debug)]
enum Closing {
    /// Right after its one response, without `connection: close`.
    AfterEachResponse,
    /// When a second request arrives on the connection, without answering it.
    UnderTheNextRequest,
}

const CHAT: &str = r#"{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;
const OLLAMA: &str = r#"{"model":"m","created_at":"2026-01-01T00:00:00Z","message":{"role":"assistant","content":"hello there"},"done":true,"done_reason":"stop","prompt_eval_count":3,"eval_count":2}"#;

/// The head of a request in `buf`, and where its body ends, once all of it arrived.
fn complete_request(buf: &[u8]) -> Option<(String, usize)> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    let length = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    (buf.len() >= end + length).then_some((head, end + length))
}

/// A backend answering chat (`CHAT`) and Ollama (`OLLAMA`, for `/api/…`) requests, and
/// anything else (health probes) with `{}`; counts connections.
async fn backend(closing: Closing) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut served = 0;
                loop {
                    let mut chunk = [0u8; 8192];
                    match socket.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                    while let Some((head, len)) = complete_request(&buf) {
                        buf.drain(..len);
                        served += 1;
                        if served == 2 && matches!(closing, Closing::UnderTheNextRequest) {
                            return;
                        }
                        let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
                        let body = if path.ends_with("/chat/completions") {
                            CHAT
                        } else if path.starts_with("/api/chat") {
                            OLLAMA
                        } else {
                            "{}"
                        };
                        let response = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if socket.write_all(response.as_bytes()).await.is_err() {
                            return;
                        }
                        if matches!(closing, Closing::AfterEachResponse) {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, accepted)
}

async fn survives(closing: Closing) {
    let (addr, accepted) = backend(closing).await;
    let dir = tempdir();
    let config = format!(
        r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: compat, kind: openai_compat, base_url: "http://{addr}/v1", health: {{interval_sec: 30}}}}
      - {{id: ollama, kind: ollama, base_url: "http://{addr}", health: {{interval_sec: 30}}}}
model_groups:
  - {{name: compat, members: [{{node: n1, provider: compat, model: m}}]}}
  - {{name: ollama, members: [{{node: n1, provider: ollama, model: m}}]}}
"#
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let http = client();
    let chat = json!({"model": "compat", "messages": [{"role": "user", "content": "hi"}]});
    let messages = json!({"model": "compat", "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}]});
    let ollama = json!({"model": "ollama", "messages": [{"role": "user", "content": "hi"}]});
    for i in 0..6 {
        for (path, body) in [
            ("/v1/chat/completions", &chat),
            ("/v1/messages", &messages),
            ("/v1/chat/completions", &ollama),
        ] {
            let response = http.post(edge.url(path)).json(body).send().await.unwrap();
            let status = response.status();
            let text = response.text().await.unwrap();
            assert_eq!(
                status,
                200,
                "{closing:?}, round {i}, {path} ({}): {text}\n{}",
                body["model"],
                edge.proc.log()
            );
            assert!(text.contains("hello there"), "{text}");
        }
    }
    assert!(
        accepted.load(Ordering::SeqCst) >= 18,
        "every request took a connection of its own"
    );
}

#[tokio::test]
async fn a_backend_that_closes_each_connection_after_its_response_loses_no_request() {
    survives(Closing::AfterEachResponse).await;
}

#[tokio::test]
async fn a_backend_that_closes_a_kept_connection_under_the_next_request_loses_no_request() {
    survives(Closing::UnderTheNextRequest).await;
}
