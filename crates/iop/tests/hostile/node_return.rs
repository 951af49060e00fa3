//! Nodes come straight back: after an edge restart (one node, and a hundred behind one
//! address), through a long outage, and while anonymous peers from many addresses keep the
//! listener's unauthenticated pool full. The reconnect policy stays the specification's
//! (interval 10 s, attempts counted); only the waiting inside it is shorter.

use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::AsyncReadExt;

use crate::common::node_wire::connect_from;
use crate::common::*;

/// An edge config with nodes `n1`..`n{count}`, each with the built-in mock adapter.
fn config(count: usize) -> String {
    let mut nodes = String::new();
    for i in 1..=count {
        nodes.push_str(&format!(
            "  - {{id: n{i}, token: token-n{i}-0123456789, providers: [{{id: mock, kind: mock}}]}}\n"
        ));
    }
    format!(
        "nodes:\n{nodes}model_groups:\n  - {{name: m, members: [{{node: n1, provider: mock}}]}}\n"
    )
}

/// Restarts `edge` on its own ports; returns when the new one listens.
async fn restart(edge: &mut EdgeProc, dir: &std::path::Path) -> Instant {
    let (nodes, http) = (edge.nodes.clone(), edge.http.clone());
    let config = std::fs::read_to_string(&edge.config).unwrap();
    edge.proc.kill9();
    let restarted = Instant::now();
    *edge = start_edge_on(dir, &config, &nodes, &http).await;
    restarted
}

/// Waits until every node of `ids` is ready; how long that took from `since`.
async fn all_ready(edge: &EdgeProc, count: usize, since: Instant, within: Duration) -> Duration {
    wait_status(edge, within, &format!("{count} nodes ready"), |s| {
        s["nodes"]
            .as_array()
            .is_some_and(|n| n.iter().filter(|n| n["ready"] == true).count() == count)
    })
    .await;
    since.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_is_back_long_before_its_interval_after_an_edge_restart() {
    let dir = tempdir();
    let mut edge = start_edge(dir.path(), &config(1)).await;
    // The specification's default policy: 10 attempts, 10 s apart.
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let restarted = restart(&mut edge, dir.path()).await;
    let took = all_ready(&edge, 1, restarted, Duration::from_secs(30)).await;
    eprintln!("one node ready {took:?} after the edge restarted");
    assert!(
        took < Duration::from_secs(5),
        "ready {took:?} after the restart (interval 10 s)"
    );
    let (code, body) = chat_completion(&edge, "m", "hi", json!({})).await;
    assert_eq!(code, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_nodes_behind_one_address_are_back_soon_after_an_edge_restart() {
    const NODES: usize = 100;
    let dir = tempdir();
    let mut edge = start_edge(dir.path(), &config(NODES)).await;
    // A long interval, so a node that waited one out would show.
    let policy = "reconnect: {interval_sec: 30}";
    let nodes: Vec<Proc> = (1..=NODES)
        .map(|i| {
            let token = format!("token-n{i}-0123456789");
            start_node(&format!("n{i}"), dir.path(), &edge.nodes, &token, policy)
        })
        .collect();
    all_ready(&edge, NODES, Instant::now(), Duration::from_secs(120)).await;
    let restarted = restart(&mut edge, dir.path()).await;
    let took = all_ready(&edge, NODES, restarted, Duration::from_secs(60)).await;
    eprintln!("{NODES} nodes from one address ready {took:?} after the edge restarted");
    assert!(
        took < Duration::from_secs(15),
        "all ready {took:?} after the restart (interval 30 s)"
    );
    for node in &nodes {
        assert!(!node.has_line("giving up"), "{}", node.log());
    }
}

/// The outage in reconnect intervals: 60, six times what the default budget of 10 attempts
/// would outlive, and twice the 30 intervals of a five-minute outage at the default 10 s.
/// The interval is 0.5 s so that it passes in 30 s of real time.
const OUTAGE_INTERVALS: u32 = 60;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_unlimited_attempts_a_node_outlives_an_outage_of_sixty_intervals() {
    let interval = Duration::from_millis(500);
    let dir = tempdir();
    let mut edge = start_edge(dir.path(), &config(1)).await;
    let node = start_node(
        "n1",
        dir.path(),
        &edge.nodes,
        "token-n1-0123456789",
        &format!(
            "reconnect: {{max_attempts: 0, interval_sec: {}}}",
            interval.as_secs_f64()
        ),
    );
    wait_ready(&edge, "n1").await;
    let (nodes, http) = (edge.nodes.clone(), edge.http.clone());
    let config = std::fs::read_to_string(&edge.config).unwrap();
    edge.proc.kill9();
    tokio::time::sleep(interval * OUTAGE_INTERVALS).await;
    let back = Instant::now();
    edge = start_edge_on(dir.path(), &config, &nodes, &http).await;
    let took = all_ready(&edge, 1, back, Duration::from_secs(30)).await;
    assert!(
        took < Duration::from_secs(5),
        "ready {took:?} after the edge returned"
    );
    let attempts = node.log().matches("connection attempt failed").count() as u32;
    eprintln!(
        "after an outage of {OUTAGE_INTERVALS} intervals: {attempts} attempts, the node ready \
         {took:?} after the edge"
    );
    // One attempt per interval while the edge was away, not one per probe; fewer on a
    // busy machine, where an attempt and its wait take longer than the interval.
    assert!(
        (OUTAGE_INTERVALS / 3..=OUTAGE_INTERVALS + OUTAGE_INTERVALS / 3).contains(&attempts),
        "{attempts} attempts in {OUTAGE_INTERVALS} intervals"
    );
    assert!(!node.has_line("giving up"), "{}", node.log());
}

/// Keeps one idle connection from `source` open, re-opening it as soon as the edge closes
/// it, until the test ends.
async fn hold_idle(source: String, edge: String) {
    let mut buf = [0u8; 64];
    loop {
        match connect_from(&source, &edge).await {
            Ok(mut stream) => {
                while let Ok(n) = stream.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                }
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_from_twenty_addresses_keep_no_node_out() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), &config(1)).await;
    let mut attack = tokio::task::JoinSet::new();
    // 20 addresses × 16 connections: more than the 256 places for unauthenticated
    // connections, every one re-opened as soon as it is closed.
    for a in 2..22 {
        for _ in 0..16 {
            attack.spawn(hold_idle(format!("127.0.0.{a}"), edge.nodes.clone()));
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = Instant::now();
    let mut node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    let took = wait_ready(&edge, "n1").await;
    eprintln!("node ready {took:?} into a full unauthenticated pool");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // Restarted while the attack goes on, it is back as fast.
    node.kill9();
    wait_status(&edge, Duration::from_secs(20), "n1 gone", |s| {
        node_status(s, "n1")["ready"] != true
    })
    .await;
    let restarted = Instant::now();
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    assert!(
        restarted.elapsed() < Duration::from_secs(5),
        "{:?}",
        restarted.elapsed()
    );
    let (code, body) = chat_completion(&edge, "m", "hi", json!({})).await;
    assert_eq!(code, 200, "{body}");
    attack.abort_all();
    let metrics = get_text(&edge.url("/metrics")).await;
    assert!(
        metrics.contains("iop_node_connections_refused_total{reason=\"evicted\"}"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_idle_connection_from_each_of_four_hundred_addresses_keeps_no_node_out() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), &config(1)).await;
    let mut attack = tokio::task::JoinSet::new();
    // 400 addresses (more than the pool's 256 places), one connection each that never
    // sends a byte, re-opened as soon as it is closed: no address holds more than another.
    for a in 0..400 {
        attack.spawn(hold_idle(
            format!("127.1.{}.{}", a / 200, a % 200 + 1),
            edge.nodes.clone(),
        ));
    }
    // The pool is full within moments (400 connects on loopback).
    tokio::time::sleep(Duration::from_secs(2)).await;
    for round in 0..2 {
        let started = Instant::now();
        let mut node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
        wait_ready(&edge, "n1").await;
        let took = started.elapsed();
        eprintln!("round {round}: node ready {took:?} among 400 idle addresses");
        assert!(took < Duration::from_secs(5), "ready after {took:?}");
        let (code, body) = chat_completion(&edge, "m", "hi", json!({})).await;
        assert_eq!(code, 200, "{body}");
        node.kill9();
        wait_status(&edge, Duration::from_secs(20), "n1 gone", |s| {
            node_status(s, "n1")["ready"] != true
        })
        .await;
    }
    attack.abort_all();
}
