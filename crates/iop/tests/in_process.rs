//! Behaviour through an edge, a node and a backend running in the test's own process
//! ([`common::in_process`]): the same libraries the daemons run, on real loopback
//! sockets, started in milliseconds. What needs a process of its own (signals, restarts,
//! the CLI) stays in the real-process suites.

mod common;

use std::time::Duration;

use common::in_process::{Fabric, InProcess};
use iop_mock::MockConfig;
use serde_json::{Value, json};

fn chat(model: &str, stream: bool) -> Value {
    json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "hello"}]})
}

/// Posts a chat to the edge at `http`; the status and body.
async fn post(http: String, body: Value) -> (u16, String) {
    let response = reqwest::Client::new()
        .post(format!("{http}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("the edge answers");
    let status = response.status().as_u16();
    (status, response.text().await.expect("a body"))
}

/// How many requests wait in `group`'s queue, from the status the edge serves.
async fn waiting(fabric: &InProcess, group: &str) -> u64 {
    let status: Value = reqwest::get(format!("{}/admin/status", fabric.http()))
        .await
        .expect("status")
        .json()
        .await
        .expect("status JSON");
    status["model_groups"]
        .as_array()
        .expect("groups")
        .iter()
        .find(|g| g["name"] == group)
        .map(|g| g["waiting"]["normal"].as_u64().unwrap_or(0))
        .expect("the group is listed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_paths_answer_whole_and_streamed() {
    let fabric = InProcess::start(Fabric::default()).await;
    for model in ["tunnel", "mock"] {
        let (status, body) = post(fabric.http(), chat(model, false)).await;
        assert_eq!(status, 200, "{model}: {body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(answer["object"], "chat.completion", "{model}: {body}");
        assert!(
            answer["usage"]["completion_tokens"].as_u64().unwrap() > 0,
            "{model}: {body}"
        );
        let (status, body) = post(fabric.http(), chat(model, true)).await;
        assert_eq!(status, 200, "{model}: {body}");
        assert!(body.contains("chat.completion.chunk"), "{model}: {body}");
        let body = common::without_event_ids(&body);
        assert!(body.trim_end().ends_with("data: [DONE]"), "{model}: {body}");
    }
    fabric.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_never_has_more_than_its_capacity_in_flight() {
    let fabric = InProcess::start(Fabric {
        capacity: 1,
        backend: MockConfig {
            tokens: 4,
            token_delay: Duration::from_millis(10),
            ..MockConfig::default()
        },
        ..Fabric::default()
    })
    .await;
    let requests = (0..6).map(|_| post(fabric.http(), chat("tunnel", true)));
    for (status, body) in futures::future::join_all(requests).await {
        assert_eq!(status, 200, "{body}");
    }
    let stats = fabric.backend.stats.snapshot();
    assert_eq!(stats.requests, 6);
    assert_eq!(stats.peak_in_flight, 1, "capacity 1: one at a time");
    fabric.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_without_a_node_answers_at_once_and_serves_again_when_it_returns() {
    let mut fabric = InProcess::start(Fabric::default()).await;
    fabric.stop_node().await;
    let (status, body) = post(fabric.http(), chat("tunnel", false)).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("offline"), "{body}");
    fabric.start_node().await;
    let (status, body) = post(fabric.http(), chat("tunnel", false)).await;
    assert_eq!(status, 200, "{body}");
    fabric.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_for_its_node_is_served_when_the_node_returns() {
    let mut fabric = InProcess::start(Fabric {
        wait_for_reconnect_sec: 60,
        ..Fabric::default()
    })
    .await;
    fabric.stop_node().await;
    let mut request = tokio::spawn(post(fabric.http(), chat("tunnel", false)));
    // The request is queued (the edge says so) before the node comes back.
    let queued = async {
        while waiting(&fabric, "tunnel").await == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::select! {
        answer = &mut request => panic!("answered before its node returned: {answer:?}"),
        () = queued => {}
    }
    fabric.start_node().await;
    let (status, body) = request.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(fabric.backend.stats.snapshot().requests, 1);
    fabric.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_recorded_under_its_node_and_adapter() {
    let fabric = InProcess::start(Fabric::default()).await;
    let run = |adapter: &str| {
        reqwest::Client::new()
            .post(format!("{}/v1/runs", fabric.http()))
            .json(&json!({"node": common::in_process::NODE, "adapter": adapter, "target": "m", "input": "hi"}))
            .send()
    };
    let ran = run("mock").await.unwrap();
    assert_eq!(ran.status(), 200);
    let events = ran.text().await.unwrap();
    assert!(events.contains("complete"), "{events}");
    // A run on an adapter the node does not have: its name is the client's, never stored.
    assert_eq!(run("nope-adapter").await.unwrap().status(), 404);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let records = loop {
        let body: Value = reqwest::get(format!("{}/admin/usage/records?limit=10", fabric.http()))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let records = body["records"].as_array().cloned().unwrap_or_default();
        if records.len() >= 2 {
            break records;
        }
        assert!(tokio::time::Instant::now() < deadline, "{body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let groups: Vec<&str> = records.iter().filter_map(|r| r["group"].as_str()).collect();
    assert!(groups.contains(&"n1/mock"), "{records:?}");
    assert!(
        groups.iter().any(|g| g.starts_with("(unknown) ")),
        "{records:?}"
    );
    assert!(
        !groups.iter().any(|g| g.contains("nope-adapter")),
        "{records:?}"
    );
    fabric.stop().await;
}
