//! A provider's model list is input like any other: an Ollama server listing thousands
//! of names, hostile ones among them (markup, control characters, path tricks, names of
//! kilobytes), renamed again and again, must leave the edge's groups capped and its
//! `/metrics` bounded, clean, and back to its size once the list is empty.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::routing::{delete, get};
use serde_json::{Value, json};

use crate::common::*;

/// An Ollama server whose `/api/tags` lists what the test sets.
async fn listing_server(names: Arc<Mutex<Vec<String>>>) -> String {
    let app = axum::Router::new()
        .route(
            "/api/version",
            get(|| async { Json(json!({"version": "0.9.0"})) }),
        )
        .route("/api/ps", get(|| async { Json(json!({"models": []})) }))
        .route(
            "/api/tags",
            get(move || {
                let names = names.lock().unwrap().clone();
                async move {
                    let models: Vec<Value> = names
                        .iter()
                        .map(|n| json!({"name": n, "model": n, "size": 1, "digest": "0"}))
                        .collect();
                    Json(json!({"models": models}))
                }
            }),
        )
        .route(
            "/api/delete",
            delete(|| async {
                (
                    axum::http::StatusCode::NOT_FOUND,
                    Json(json!({"error": "model not found"})),
                )
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

/// 2,000 names for round `round`: valid ones and the hostile kinds reported.
fn hostile_names(round: usize) -> Vec<String> {
    (0..2000)
        .map(|i| match i % 8 {
            0 => format!("<img src=x onerror=alert({round}{i})>"),
            1 => format!("m{round}-{i}\0nul"),
            2 => format!("m{round}-{i}\nnewline"),
            3 => format!("{}{round}{i}", "x".repeat(5000)),
            4 => format!("../../etc/passwd{round}{i}"),
            _ => format!("model-{round}-{i}:latest"),
        })
        .collect()
}

/// Asks the edge to look at its providers' models again (a fleet delete does, whatever
/// the targets answer) and returns the model groups it then serves.
async fn relist(edge: &EdgeProc) -> Vec<String> {
    let response = client()
        .delete(edge.url("/api/delete"))
        .bearer_auth(TEST_API_KEY)
        .json(&json!({"model": "nothing-here"}))
        .send()
        .await
        .unwrap();
    assert!(response.status().is_client_error(), "{}", response.status());
    let models: Value = client()
        .get(edge.url("/v1/models"))
        .bearer_auth(TEST_API_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_hostile_model_names_leave_groups_capped_and_metrics_clean() {
    let dir = tempdir();
    let names = Arc::new(Mutex::new(Vec::new()));
    let base = listing_server(names.clone()).await;
    let config = format!(
        r#"
auth:
  keys:
    - {{name: ops, role: admin, key: {TEST_API_KEY}}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: ol, kind: ollama, base_url: "{base}"}}
"#
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    assert!(relist(&edge).await.is_empty());
    let metrics = || async {
        let response = admin_get(&edge, "/metrics").await;
        assert_eq!(response.status(), 200);
        response.text().await.unwrap()
    };
    let baseline = metrics().await.len();
    let mut largest = 0;
    for round in 0..10 {
        *names.lock().unwrap() = hostile_names(round);
        let deadline = Instant::now() + Duration::from_secs(30);
        let groups = loop {
            let groups = relist(&edge).await;
            if groups
                .iter()
                .any(|g| g.starts_with(&format!("model-{round}-")))
            {
                break groups;
            }
            assert!(Instant::now() < deadline, "round {round}: {groups:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        // The provider's valid names, at most limits.models_per_provider (256) of them.
        assert!(
            groups.len() <= 256,
            "round {round}: {} groups",
            groups.len()
        );
        assert!(
            groups
                .iter()
                .all(|g| g.starts_with(&format!("model-{round}-")) && g.len() < 64),
            "round {round}: {groups:?}"
        );
        let text = metrics().await;
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "a control character in /metrics"
        );
        assert!(
            !text.contains("<img") && !text.contains("passwd"),
            "hostile names in /metrics"
        );
        largest = largest.max(text.len());
    }
    // The list empties: the groups go, and so do their series.
    names.lock().unwrap().clear();
    assert!(relist(&edge).await.is_empty());
    let after = metrics().await.len();
    eprintln!("/metrics: {baseline} bytes before, at most {largest} with the lists, {after} after");
    assert!(
        after < baseline + 4096,
        "/metrics grew from {baseline} to {after} bytes and stayed"
    );
}
