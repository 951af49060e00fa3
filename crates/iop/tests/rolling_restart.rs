//! A rolling restart of a fleet behind a real load balancer loses nothing: three edges
//! sharing a PostgreSQL store (a real server) behind HAProxy in TCP mode, health-checked
//! on `/readyz`; clients send a steady stream of requests (streamed and not) through
//! HAProxy while each edge in turn is stopped with SIGTERM and started again. Every
//! request is answered in full.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::haproxy::Haproxy;
use common::postgres::{Postgres, SECRET_KEY};
use common::*;
use nix::sys::signal::Signal;
use serde_json::json;

fn config(url: &str, id: &str) -> String {
    format!(
        r#"
store: {{url: "{url}", edge_id: {id}}}
shutdown: {{grace_sec: 30, accept_grace_sec: 2}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: m, kind: mock, capacity: {{normal: 16}}, mock: {{tokens: 8, token_delay_ms: 5}}}}
model_groups:
  - {{name: mock, members: [{{node: n1, provider: m}}]}}
"#
    )
}

struct Edge {
    dir: tempfile::TempDir,
    id: String,
    nodes: String,
    http: String,
    proc: EdgeProc,
}

async fn start(
    pg: &Postgres,
    dir: &std::path::Path,
    id: &str,
    nodes: &str,
    http: &str,
) -> EdgeProc {
    start_edge_full(
        dir,
        &config(&pg.url(), id),
        nodes,
        http,
        &[("IOP_STORE_SECRET_KEY", SECRET_KEY)],
    )
    .await
}

/// What the clients saw.
#[derive(Default)]
struct Tally {
    answered: AtomicUsize,
    failures: std::sync::Mutex<Vec<String>>,
}

/// One client: requests one after another through `url` until `stop`, alternating
/// streamed and whole answers; anything but a complete 200 is a failure.
async fn client_loop(url: String, stop: Arc<AtomicBool>, tally: Arc<Tally>, who: usize) {
    let http = client();
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let stream = i % 2 == 0;
        let body = json!({
            "model": "mock",
            "stream": stream,
            "messages": [{"role": "user", "content": format!("client {who} request {i}")}],
        });
        let outcome = match http.post(&url).json(&body).send().await {
            Err(e) => Err(format!("request {i}: {e}")),
            Ok(response) => {
                let status = response.status();
                match response.text().await {
                    Err(e) => Err(format!("request {i}: {status}, body cut: {e}")),
                    Ok(text) if status != 200 => Err(format!("request {i}: {status} {text}")),
                    Ok(text) if stream && !text.contains("data: [DONE]") => {
                        Err(format!("request {i}: stream without its end: {text}"))
                    }
                    Ok(_) => Ok(()),
                }
            }
        };
        match outcome {
            Ok(()) => {
                tally.answered.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tally.failures.lock().unwrap().push(e),
        }
    }
}

#[tokio::test]
async fn a_rolling_restart_behind_haproxy_fails_no_request() {
    let Some(pg) = Postgres::start("a rolling restart") else {
        return;
    };
    let mut edges = Vec::new();
    for i in 1..=3 {
        let dir = tempdir();
        let (id, nodes, http) = (format!("edge-{i}"), free_addr(), free_addr());
        let proc = start(&pg, dir.path(), &id, &nodes, &http).await;
        edges.push(Edge {
            dir,
            id,
            nodes,
            http,
            proc,
        });
    }
    let https: Vec<&str> = edges.iter().map(|e| e.http.as_str()).collect();
    let Some(lb) = Haproxy::start("a rolling restart", &https).await else {
        return;
    };
    let node_dir = tempdir();
    let _node = start_node(
        "n1",
        node_dir.path(),
        &edges[0].nodes,
        "token-n1-0123456789",
        "",
    );
    for edge in &edges {
        wait_ready(&edge.proc, "n1").await;
    }
    // HAProxy takes an edge in after two good checks.
    lb.wait_up(&["edge-1", "edge-2", "edge-3"]).await;

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let clients: Vec<_> = (0..4)
        .map(|who| {
            tokio::spawn(client_loop(
                lb.url("/v1/chat/completions"),
                stop.clone(),
                tally.clone(),
                who,
            ))
        })
        .collect();
    // The clients are under way before the first edge goes.
    while tally.answered.load(Ordering::Relaxed) < 20 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    for edge in &mut edges {
        let before = tally.answered.load(Ordering::Relaxed);
        edge.proc.proc.signal(Signal::SIGTERM);
        assert!(
            edge.proc
                .proc
                .wait_exit(Duration::from_secs(60))
                .await
                .success(),
            "{}",
            edge.proc.proc.log()
        );
        edge.proc = start(&pg, edge.dir.path(), &edge.id, &edge.nodes, &edge.http).await;
        wait_ready(&edge.proc, "n1").await;
        // Back in HAProxy's rotation (two good checks) before the next edge goes.
        lb.wait_up(&[edge.id.as_str()]).await;
        let during = tally.answered.load(Ordering::Relaxed) - before;
        eprintln!(
            "{} restarted; {during} requests answered meanwhile",
            edge.id
        );
        assert!(
            during > 0,
            "the clients were served while {} restarted",
            edge.id
        );
    }

    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await.unwrap();
    }
    let failures = tally.failures.lock().unwrap().clone();
    let answered = tally.answered.load(Ordering::Relaxed);
    eprintln!("{answered} requests answered, {} failed", failures.len());
    assert!(
        failures.is_empty(),
        "{} of {} requests failed: {failures:#?}\nhaproxy:\n{}",
        failures.len(),
        answered + failures.len(),
        lb.proc.log()
    );
    assert!(answered > 100, "only {answered} requests");
}
