//! Provider pools with real processes: one lease account shared by aliases, FIFO waiting,
//! the long-context lane, queue bounds and timeouts, and waiters when their node dies.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

const CONFIG: &str = r#"
dispatch: {reattach_wait_sec: 1}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {id: shared, kind: mock, capacity: {normal: 1, long: 0}, mock: {tokens: 10, token_delay_ms: 40}}
      - {id: lanes, kind: mock, capacity: {normal: 1, long: 1}, mock: {tokens: 1000, token_delay_ms: 40}}
model_groups:
  - {name: alias-a, members: [{node: n1, provider: shared}]}
  - {name: alias-b, members: [{node: n1, provider: shared}]}
  - {name: lanes, long_context_tokens: 1000, members: [{node: n1, provider: lanes}]}
  - {name: tiny-queue, members: [{node: n1, provider: shared}], queue: {max_waiting: 1, timeout_sec: 1}}
"#;

async fn setup() -> (tempfile::TempDir, EdgeProc, Proc) {
    let dir = tempdir();
    let edge = start_edge(dir.path(), CONFIG).await;
    let node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    (dir, edge, node)
}

type Done = Arc<std::sync::Mutex<Vec<(&'static str, Instant, u16)>>>;

fn spawn_chat(
    edge: &Arc<EdgeProc>,
    done: &Done,
    name: &'static str,
    model: &'static str,
    content: String,
    extra: Value,
) {
    let (edge, done) = (edge.clone(), done.clone());
    tokio::spawn(async move {
        let (status, body) = chat_completion(&edge, model, &content, extra).await;
        assert!(status == 200 || status >= 400, "{body}");
        done.lock().unwrap().push((name, Instant::now(), status));
    });
}

async fn wait_done(done: &Done, n: usize) -> Vec<(&'static str, Instant, u16)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if done.lock().unwrap().len() >= n {
            return done.lock().unwrap().clone();
        }
        assert!(
            Instant::now() < deadline,
            "requests did not finish: {:?}",
            done.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn two_aliases_share_one_slot_and_waiters_run_in_order() {
    let (_dir, edge, _node) = setup().await;
    let edge = Arc::new(edge);
    let done: Done = Arc::default();
    spawn_chat(&edge, &done, "first", "alias-a", "one".into(), json!({}));
    wait_status(&edge, Duration::from_secs(5), "first in flight", |s| {
        provider_of(s, "n1", "shared")["in_flight"]["normal"] == 1
    })
    .await;
    spawn_chat(&edge, &done, "second", "alias-b", "two".into(), json!({}));
    wait_status(&edge, Duration::from_secs(5), "second waiting", |s| {
        group_of(s, "alias-b")["waiting"]["normal"] == 1
    })
    .await;
    spawn_chat(&edge, &done, "third", "alias-a", "three".into(), json!({}));
    wait_status(&edge, Duration::from_secs(5), "third waiting", |s| {
        group_of(s, "alias-a")["waiting"]["normal"] == 1
    })
    .await;
    // One runs, two wait: the shared account never goes over its capacity of 1.
    let snapshot = status(&edge).await;
    assert_eq!(
        provider_of(&snapshot, "n1", "shared")["in_flight"],
        json!({"normal": 1, "long": 0})
    );
    let finished = wait_done(&done, 3).await;
    let order: Vec<&str> = finished.iter().map(|(n, _, _)| *n).collect();
    assert_eq!(order, ["first", "second", "third"]);
    assert!(
        finished.iter().all(|(_, _, status)| *status == 200),
        "{finished:?}"
    );
    wait_idle(&edge).await;
    let snapshot = status(&edge).await;
    assert_eq!(snapshot["leases"]["acquired"], 3, "{snapshot}");
    let metrics = get_text(&edge.url("/metrics")).await;
    assert!(
        metrics
            .contains("iop_provider_in_flight{node=\"n1\",provider=\"shared\",lane=\"normal\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("iop_model_group_waiting{model_group=\"alias-a\",lane=\"normal\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("iop_queue_wait_seconds_count{model_group=\"alias-b\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics
            .contains("iop_requests_total{model_group=\"alias-a\",path=\"run\",outcome=\"ok\"} 2"),
        "{metrics}"
    );
}

/// A streaming chat completion to `model`, read until its first content: it holds its slot
/// until the returned response is dropped.
async fn held_stream(edge: &EdgeProc, model: &str, content: &str) -> reqwest::Response {
    let mut response = client()
        .post(edge.url("/v1/chat/completions"))
        .json(&json!({"model": model, "stream": true, "messages": [{"role": "user", "content": content}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut seen = String::new();
    read_until(&mut response, &mut seen, |s| s.contains("\"content\":\"")).await;
    response
}

#[tokio::test]
async fn a_long_request_waits_for_the_long_slot_while_normal_ones_flow() {
    let (_dir, edge, _node) = setup().await;
    let edge = Arc::new(edge);
    let long_prompt = "x".repeat(5000); // ~1250 estimated tokens: over the 1000 threshold
    // The first long request holds the long slot for as long as the test keeps it.
    let long_1 = held_stream(&edge, "lanes", &long_prompt).await;
    let s = status(&edge).await;
    assert_eq!(
        provider_of(&s, "n1", "lanes")["in_flight"]["long"],
        1,
        "{s}"
    );
    let long_2 = {
        let (edge, prompt) = (edge.clone(), long_prompt.clone());
        tokio::spawn(async move { held_stream(&edge, "lanes", &prompt).await })
    };
    wait_status(&edge, Duration::from_secs(5), "long waiter", |s| {
        group_of(s, "lanes")["waiting"]["long"] == 1
    })
    .await;
    // Normal requests are served meanwhile, one after the other through the normal slot.
    for _ in 0..2 {
        let (status, body) =
            chat_completion(&edge, "lanes", "short", json!({"max_tokens": 2})).await;
        assert_eq!(status, 200, "{body}");
        let s = common::status(&edge).await;
        assert_eq!(
            group_of(&s, "lanes")["waiting"]["long"],
            1,
            "the long request is still waiting: {s}"
        );
    }
    assert!(
        !long_2.is_finished(),
        "the second long request waits for the first"
    );
    drop(long_1);
    // The long slot passes to the waiter once the first request let it go.
    let long_2 = tokio::time::timeout(Duration::from_secs(20), long_2)
        .await
        .expect("the waiting long request got the slot")
        .unwrap();
    drop(long_2);
    wait_idle(&edge).await;
}

#[tokio::test]
async fn a_full_queue_is_429_and_a_long_wait_is_503() {
    let (_dir, edge, _node) = setup().await;
    let edge = Arc::new(edge);
    let done: Done = Arc::default();
    spawn_chat(&edge, &done, "running", "tiny-queue", "a".into(), json!({}));
    wait_status(&edge, Duration::from_secs(5), "running", |s| {
        provider_of(s, "n1", "shared")["in_flight"]["normal"] == 1
    })
    .await;
    spawn_chat(&edge, &done, "waiting", "tiny-queue", "b".into(), json!({}));
    wait_status(&edge, Duration::from_secs(5), "one waiting", |s| {
        group_of(s, "tiny-queue")["waiting"]["normal"] == 1
    })
    .await;
    let response = client()
        .post(edge.url("/v1/chat/completions"))
        .json(&json!({"model": "tiny-queue", "messages": [{"role": "user", "content": "c"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "1");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "queue_full");
    assert_eq!(body["error"]["type"], "rate_limit_error");
    // The waiter gets the slot after the ~400 ms run ahead of it: within its 1 s timeout.
    let finished = wait_done(&done, 2).await;
    assert!(finished.iter().all(|(_, _, s)| *s == 200), "{finished:?}");

    // Behind three 400 ms runs of an alias, a 1 s queue timeout expires: 503.
    spawn_chat(&edge, &done, "hog-1", "alias-a", "x".into(), json!({}));
    wait_status(&edge, Duration::from_secs(5), "hog running", |s| {
        provider_of(s, "n1", "shared")["in_flight"]["normal"] == 1
    })
    .await;
    spawn_chat(&edge, &done, "hog-2", "alias-a", "y".into(), json!({}));
    spawn_chat(&edge, &done, "hog-3", "alias-a", "z".into(), json!({}));
    wait_status(&edge, Duration::from_secs(5), "hogs waiting", |s| {
        group_of(s, "alias-a")["waiting"]["normal"] == 2
    })
    .await;
    let started = Instant::now();
    let (status, body) = chat_completion(&edge, "tiny-queue", "late", json!({})).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "timed out early: {:?}",
        started.elapsed()
    );
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["error"]["code"], "queue_timeout");
    let finished = wait_done(&done, 5).await;
    assert!(finished.iter().all(|(_, _, s)| *s == 200), "{finished:?}");
    wait_idle(&edge).await;
}

#[tokio::test]
async fn waiters_of_a_killed_node_end_unavailable_at_once_and_its_leases_return() {
    let (_dir, edge, mut node) = setup().await;
    let edge = Arc::new(edge);
    // A streaming request holds the only slot.
    let mut running = client()
        .post(edge.url("/v1/chat/completions"))
        .json(&json!({"model": "alias-a", "stream": true, "messages": [{"role": "user", "content": "hold"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(running.status(), 200);
    let done: Done = Arc::default();
    spawn_chat(&edge, &done, "w1", "alias-a", "w1".into(), json!({}));
    spawn_chat(&edge, &done, "w2", "alias-b", "w2".into(), json!({}));
    wait_status(&edge, Duration::from_secs(5), "two waiting", |s| {
        group_of(s, "alias-a")["waiting"]["normal"] == 1
            && group_of(s, "alias-b")["waiting"]["normal"] == 1
    })
    .await;
    let killed = Instant::now();
    node.kill9();
    // The running stream ends with an error event once the re-attach wait (1 s) passed.
    // (The bounds below only keep a broken edge from hanging the test: the stream's end
    // and the waiters' 503s come from the closed socket, far below the 30 s queue timeout.)
    let mut seen = String::new();
    read_to_end(&mut running, &mut seen, Duration::from_secs(10)).await;
    let last = sse_events(&seen).last().cloned().unwrap().1;
    assert!(last.contains("node_disconnected"), "{seen}");
    // The waiters end unavailable without waiting for their queue timeout (30 s).
    let finished = wait_done(&done, 2).await;
    for (name, at, status) in &finished {
        assert_eq!(*status, 503, "{name}");
        assert!(
            at.duration_since(killed) < Duration::from_secs(10),
            "{name} took {:?}",
            at.duration_since(killed)
        );
    }
    let s = common::status(&edge).await;
    assert!(all_idle(&s), "{s}");
    assert_eq!(s["leases"]["acquired"], 1);
    assert_eq!(provider_of(&s, "n1", "shared")["status"], "unavailable");
}
