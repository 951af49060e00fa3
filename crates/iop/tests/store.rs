//! Edges sharing a PostgreSQL store (a real server, started by the test): each lists the
//! fleet's live edges in `/admin/status`; an edge that stops leaves the list; an edge
//! whose store goes down keeps serving and says why the store does not answer, and one
//! that restarts meanwhile comes up on the fleet CA kept in its state directory; a first
//! start needs the store.

mod common;

use std::time::Duration;

use common::postgres::{Postgres, SECRET_KEY};
use common::*;
use nix::sys::signal::Signal;
use serde_json::Value;

async fn start_fleet_edge(dir: &std::path::Path, url: &str, id: &str) -> EdgeProc {
    start_edge_env(
        dir,
        &config(url, id),
        &[("IOP_STORE_SECRET_KEY", SECRET_KEY)],
    )
    .await
}

fn config(url: &str, id: &str) -> String {
    format!(
        r#"
store: {{url: "{url}", edge_id: {id}}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: m, kind: mock}}
model_groups:
  - {{name: mock, members: [{{node: n1, provider: m}}]}}
"#
    )
}

/// The ids of the live edges `edge`'s status lists.
async fn fleet(edge: &EdgeProc) -> Vec<String> {
    let s = status(edge).await;
    s["edges"]
        .as_array()
        .map(|edges| {
            edges
                .iter()
                .filter_map(|e| e["id"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Waits (bounded) until `edge` lists exactly `ids`.
async fn wait_fleet(edge: &EdgeProc, ids: &[&str]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let live = fleet(edge).await;
        if live == ids {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the fleet never became {ids:?} (last {live:?}):\n{}",
            edge.proc.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn edges_sharing_a_store_list_each_other_and_one_that_stops_leaves() {
    let Some(pg) = Postgres::start("edges sharing a store") else {
        return;
    };
    let (d1, d2) = (tempdir(), tempdir());
    let e1 = start_fleet_edge(d1.path(), &pg.url(), "edge-1").await;
    let mut e2 = start_fleet_edge(d2.path(), &pg.url(), "edge-2").await;
    wait_fleet(&e1, &["edge-1", "edge-2"]).await;
    wait_fleet(&e2, &["edge-1", "edge-2"]).await;
    let s = status(&e1).await;
    let me = s["edges"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["this_edge"] == true)
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(me["id"], "edge-1", "{s}");
    assert_eq!(me["http"], e1.http, "{s}");
    assert!(
        !s.to_string().contains("postgres://"),
        "the URL never shows: {s}"
    );

    e2.proc.signal(Signal::SIGTERM);
    assert!(e2.proc.wait_exit(Duration::from_secs(60)).await.success());
    wait_fleet(&e1, &["edge-1"]).await;
    // An edge started again finds the schema in place and joins the fleet.
    let e2 = start_fleet_edge(d2.path(), &pg.url(), "edge-2").await;
    wait_fleet(&e2, &["edge-1", "edge-2"]).await;
    assert!(
        !e2.proc.log().contains("store unreachable"),
        "{}",
        e2.proc.log()
    );
}

#[tokio::test]
async fn an_edge_whose_store_is_down_keeps_serving_and_says_why() {
    let Some(pg) = Postgres::start("an edge whose store is down") else {
        return;
    };
    let url = pg.url();
    let dir = tempdir();
    // A first start needs the store: the fleet's CA is there.
    let refused = failed_start(&config("postgres://iop@127.0.0.1:1/iop", "edge-0")).await;
    assert!(
        refused.contains("a first start in a fleet needs the store"),
        "{refused}"
    );

    let mut edge = start_fleet_edge(dir.path(), &url, "edge-1").await;
    let pin = edge.pin.clone();
    wait_fleet(&edge, &["edge-1"]).await;
    pg.stop();
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let chat = || async {
        client()
            .post(edge.url("/v1/chat/completions"))
            .json(&serde_json::json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap()
            .status()
    };
    assert_eq!(chat().await, 200);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let s = status(&edge).await;
        if let Some(error) = s["store_error"].as_str() {
            assert!(error.contains("connect"), "{error}");
            assert!(!error.contains("postgres://"), "{error}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        edge.proc.log().contains("store unreachable"),
        "{}",
        edge.proc.log()
    );
    // Join tokens live in the store: none can be made while it is down, and the answer
    // says why.
    let (made, _, stderr) = common::tls::iop_admin(&edge, &["join-token", "--node", "n1"]).await;
    assert!(!made);
    assert!(
        stderr.contains("503") && stderr.contains("store"),
        "{stderr}"
    );

    // Restarted while the store is down: the fleet CA kept in the state directory.
    edge.proc.signal(Signal::SIGTERM);
    assert!(edge.proc.wait_exit(Duration::from_secs(60)).await.success());
    let edge = start_fleet_edge(dir.path(), &url, "edge-1").await;
    assert_eq!(edge.pin, pin, "the same pin");
    assert!(
        edge.proc
            .log()
            .contains("starting with the fleet CA kept in the state directory"),
        "{}",
        edge.proc.log()
    );
}

/// Starts `iop edge` with `config` and waits for it to exit; its log.
async fn failed_start(config: &str) -> String {
    edge_failing_to_start(config, &[("IOP_STORE_SECRET_KEY", SECRET_KEY)]).await
}

#[tokio::test]
async fn a_store_that_takes_only_tls_is_reached_over_tls_and_verified() {
    let Some(pg) = Postgres::start_tls("a store over TLS") else {
        return;
    };
    let ca = pg.ca_file.clone().unwrap();
    let url = format!("postgres://iop@127.0.0.1:{}/iop?sslmode=require", pg.port);
    let with_ca = |url: &str, ca: &std::path::Path| {
        config(url, "edge-1").replace(
            "edge_id: edge-1}",
            &format!("edge_id: edge-1, ca_file: \"{}\"}}", ca.display()),
        )
    };
    let dir = tempdir();
    let edge = start_edge_env(
        dir.path(),
        &with_ca(&url, &ca),
        &[("IOP_STORE_SECRET_KEY", SECRET_KEY)],
    )
    .await;
    wait_fleet(&edge, &["edge-1"]).await;

    // Without TLS the server refuses the edge, and the edge says why.
    let plain = failed_start(&config(&url.replace("?sslmode=require", ""), "edge-2")).await;
    assert!(
        plain.contains("a first start in a fleet needs the store"),
        "{plain}"
    );
    assert!(plain.contains("pg_hba.conf"), "{plain}");
    // A server whose certificate is not from the CA given is not trusted.
    let other = tempdir();
    let other_ca = other.path().join("ca.pem");
    std::fs::copy(dir.path().join("iop-edge-state/ca.pem"), &other_ca).unwrap();
    let untrusted = failed_start(&with_ca(&url, &other_ca)).await;
    assert!(
        untrusted.contains("cannot connect to the store"),
        "{untrusted}"
    );
    assert!(
        untrusted.to_lowercase().contains("certificate"),
        "{untrusted}"
    );
}

#[tokio::test]
async fn two_live_edges_never_share_an_id() {
    let Some(pg) = Postgres::start("two edges with one id") else {
        return;
    };
    let (d1, d2) = (tempdir(), tempdir());
    let first = start_fleet_edge(d1.path(), &pg.url(), "edge-1").await;
    wait_fleet(&first, &["edge-1"]).await;
    let second = start_fleet_edge(d2.path(), &pg.url(), "edge-1").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let s = status(&second).await;
        if let Some(error) = s["store_error"].as_str() {
            assert!(error.contains("held by another live edge"), "{error}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The first keeps its row: the second never took it over.
    let s = status(&first).await;
    assert!(s["store_error"].is_null(), "{s}");
    let me = &s["edges"][0];
    assert_eq!(me["http"], first.http, "{s}");
}
