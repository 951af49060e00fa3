//! Streams kept alive while they wait (`limits.http.stream_keepalive_sec`): a streamed
//! request queued behind a busy provider gets SSE comments until its answer begins, so a
//! load balancer that cuts silent connections (HAProxy with short idle timeouts here)
//! leaves it alone; a failure after the stream began arrives as the API's error event;
//! the official SDKs (OpenAI's and Anthropic's for Python, OpenAI's for Node) read through
//! the comments. Edge, node and backend run in the test's
//! process ([`common::in_process`]); HAProxy and the SDKs are real processes.

mod common;

use std::time::Duration;

use common::haproxy::Haproxy;
use common::in_process::{Fabric, InProcess};
use iop_mock::MockConfig;
use serde_json::{Value, json};

/// One slot, answers of 8 tokens 600 ms apart: a request behind a busy one waits ~4.8 s
/// in silence, then streams with gaps of 600 ms.
fn busy_fabric(keepalive_sec: u64, queue_timeout_sec: Option<u32>) -> Fabric {
    Fabric {
        capacity: 1,
        queue_timeout_sec,
        edge_yaml: format!("limits:\n  http:\n    stream_keepalive_sec: {keepalive_sec}\n"),
        backend: MockConfig {
            tokens: 8,
            token_delay: Duration::from_millis(600),
            ..MockConfig::default()
        },
        ..Fabric::default()
    }
}

fn chat() -> Value {
    json!({"model": "tunnel", "stream": true, "messages": [{"role": "user", "content": "hi"}]})
}

/// Streams a chat from `url`: the status and the whole body, or the error that cut it.
async fn stream_chat(url: String) -> Result<(u16, String), String> {
    let response = reqwest::Client::new()
        .post(url)
        .json(&chat())
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = response.text().await.map_err(|e| e.to_string())?;
    Ok((status, body))
}

/// The text of a streamed chat completion's body.
fn streamed_text(body: &str) -> String {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect()
}

/// Occupies the one slot with a streamed request sent straight to the edge; returns once
/// the backend has it.
async fn occupy(fabric: &InProcess) -> tokio::task::JoinHandle<Result<(u16, String), String>> {
    let before = fabric.backend.stats.snapshot().requests;
    let busy = tokio::spawn(stream_chat(format!(
        "{}/v1/chat/completions",
        fabric.http()
    )));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while fabric.backend.stats.snapshot().requests == before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the backend never got the request"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    busy
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_stream_outlives_a_load_balancers_idle_cut() {
    let test = "a_queued_stream_outlives_a_load_balancers_idle_cut";
    for keepalive in [1, 0] {
        let fabric = InProcess::start(busy_fabric(keepalive, None)).await;
        let edge = fabric.http_addr().to_string();
        let Some(lb) = Haproxy::start_with_idle_timeout(test, &[edge.as_str()], "3s").await else {
            return;
        };
        lb.wait_up(&["edge-1"]).await;
        let busy = occupy(&fabric).await;
        let queued = stream_chat(lb.url("/v1/chat/completions")).await;
        let (status, _) = busy.await.unwrap().expect("the busy request");
        assert_eq!(status, 200);
        if keepalive > 0 {
            let (status, body) = queued.expect("kept alive through the idle cut");
            assert_eq!(status, 200, "{body}");
            assert!(body.starts_with(": keepalive\n\n"), "{body}");
            let body = common::without_event_ids(&body);
            assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
            assert!(!streamed_text(&body).is_empty(), "{body}");
        } else {
            // Without keepalives the same wait is cut: what this test relies on.
            let whole = queued.is_ok_and(|(status, body)| {
                status == 200 && body.trim_end().ends_with("data: [DONE]")
            });
            assert!(!whole, "a silent 4.8 s wait passed a 3 s idle cut");
        }
        fabric.stop().await;
    }
}

/// The figures users meet, unscaled: a streamed request queued 150 s behind a busy
/// provider, through HAProxy with the 60 s idle timeout (`timeout client` / `timeout
/// server`) common in front of web services, with the edge's default keepalive (15 s):
/// it completes. (Takes about three minutes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_queued_150_s_passes_a_60_s_idle_timeout() {
    let test = "a_stream_queued_150_s_passes_a_60_s_idle_timeout";
    let fabric = InProcess::start(Fabric {
        capacity: 1,
        queue_timeout_sec: Some(600),
        // The busy answer: 10 tokens 15 s apart (its own gaps stay under the cut).
        backend: MockConfig {
            tokens: 10,
            token_delay: Duration::from_secs(15),
            ..MockConfig::default()
        },
        ..Fabric::default()
    })
    .await;
    let edge = fabric.http_addr().to_string();
    let Some(lb) = Haproxy::start_with_idle_timeout(test, &[edge.as_str()], "60s").await else {
        return;
    };
    lb.wait_up(&["edge-1"]).await;
    let busy = occupy(&fabric).await;
    let mut body = chat();
    body["max_tokens"] = json!(1);
    let response = reqwest::Client::new()
        .post(lb.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("answered through the balancer");
    assert_eq!(response.status(), 200);
    let text = response
        .text()
        .await
        .expect("kept alive through the idle cut");
    let (status, _) = busy.await.unwrap().expect("the busy request");
    assert_eq!(status, 200);
    let keepalives = text.matches(": keepalive\n\n").count();
    assert!(
        keepalives >= 9,
        "waited about 150 s with a comment every 15 s: {text}"
    );
    let text = common::without_event_ids(&text);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(!streamed_text(&text).is_empty(), "{text}");
    fabric.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_after_the_stream_began_is_the_apis_error_event() {
    let fabric = InProcess::start(busy_fabric(1, Some(2))).await;
    let busy = occupy(&fabric).await;
    // Queued behind the busy request: kept alive after 1 s, out of the queue at 2 s.
    let (status, body) = stream_chat(format!("{}/v1/chat/completions", fabric.http()))
        .await
        .expect("a response");
    assert_eq!(status, 200, "the stream had begun: {body}");
    assert!(body.starts_with(": keepalive\n\n"), "{body}");
    let last = body
        .trim_end()
        .lines()
        .last()
        .and_then(|l| l.strip_prefix("data: "))
        .and_then(|d| serde_json::from_str::<Value>(d).ok())
        .unwrap_or_else(|| panic!("ends with an event: {body}"));
    assert_eq!(last["error"]["code"], "queue_timeout", "{body}");
    assert!(!body.contains("[DONE]"), "{body}");
    let (status, _) = busy.await.unwrap().expect("the busy request");
    assert_eq!(status, 200);
    fabric.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdks_read_through_the_keepalives() {
    let test = "the_official_sdks_read_through_the_keepalives";
    let Some(python) = common::sdk::python(test, &["openai", "anthropic"]) else {
        return;
    };
    let fabric = InProcess::start(busy_fabric(1, None)).await;
    // What a request that does not wait answers.
    let (_, plain) = stream_chat(format!("{}/v1/chat/completions", fabric.http()))
        .await
        .unwrap();
    let expected = streamed_text(&plain);
    let busy = occupy(&fabric).await;
    // Both SDK requests wait (one behind the busy request, the other behind both).
    let script = r#"
import sys, threading, openai, anthropic
base = sys.argv[1]
out = {}
def chat():
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    s = c.chat.completions.create(model="tunnel", stream=True,
                                  messages=[{"role": "user", "content": "hi"}])
    out["openai"] = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
def messages():
    a = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    with a.messages.stream(model="tunnel", max_tokens=64,
                           messages=[{"role": "user", "content": "hi"}]) as s:
        out["anthropic"] = "".join(s.text_stream)
threads = [threading.Thread(target=f) for f in (chat, messages)]
for t in threads: t.start()
for t in threads: t.join()
print("openai:" + out.get("openai", "<none>"))
print("anthropic:" + out.get("anthropic", "<none>"))
print("ok")
"#;
    let stdout = common::sdk::run_check(&python, "-c", &[script, &fabric.http()]).await;
    assert!(stdout.contains(&format!("openai:{expected}\n")), "{stdout}");
    assert!(
        stdout.contains(&format!("anthropic:{expected}\n")),
        "{stdout}"
    );
    busy.await.unwrap().expect("the busy request");
    // The OpenAI Node SDK, queued behind another busy request.
    if let Some(dir) = common::sdk::node_sdk(test) {
        let busy = occupy(&fabric).await;
        let script = dir.join("openai_waiting_check.mjs");
        let base = format!("{}/v1", fabric.http());
        let stdout =
            common::sdk::run_check("node", script.to_str().unwrap(), &[&base, "tunnel"]).await;
        assert!(
            stdout.contains(&format!("openai-node:{expected}\n")),
            "{stdout}"
        );
        busy.await.unwrap().expect("the busy request");
    }
    fabric.stop().await;
}
