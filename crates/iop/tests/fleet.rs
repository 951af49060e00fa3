//! Edges sharing a PostgreSQL store (a real server, started by the test) are one fleet to
//! nodes: one join string from edge 1 links the node to every edge, each edge's status
//! says which edges the node is linked to, an edge started later is linked too, a join
//! token is good for its uses across all edges together, an edge that drains leaves the
//! list and the node's links, and a revocation on one edge closes the node's connections
//! to the others.

mod common;

use std::time::{Duration, Instant};

use common::postgres::{Postgres, SECRET_KEY};
use common::tls::{join_token, revoke, start_joining_node};
use common::*;
use serde_json::Value;

fn config(url: &str, id: &str, node_address: Option<&str>) -> String {
    let address = node_address
        .map(|a| format!(", node_address: \"{a}\""))
        .unwrap_or_default();
    format!(
        r#"
store: {{url: "{url}", edge_id: {id}{address}}}
nodes:
  - id: gpu
    providers:
      - {{id: m, kind: mock}}
  - id: spare
    providers:
      - {{id: m, kind: mock}}
model_groups:
  - {{name: mock, members: [{{node: gpu, provider: m}}]}}
"#
    )
}

async fn fleet_edge(dir: &std::path::Path, pg: &Postgres, id: &str) -> EdgeProc {
    fleet_edge_on(dir, pg, id, "127.0.0.1:0", None).await
}

async fn fleet_edge_on(
    dir: &std::path::Path,
    pg: &Postgres,
    id: &str,
    nodes: &str,
    node_address: Option<&str>,
) -> EdgeProc {
    start_edge_full(
        dir,
        &config(&pg.url(), id, node_address),
        nodes,
        "127.0.0.1:0",
        &[("IOP_STORE_SECRET_KEY", SECRET_KEY)],
    )
    .await
}

/// The edges `edge`'s status says `node` is linked to.
fn linked_edges(status: &Value, node: &str) -> Vec<String> {
    node_status(status, node)["edges"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e.as_str().map(String::from))
        .collect()
}

async fn wait_linked(edge: &EdgeProc, node: &str, edges: &[&str]) {
    wait_status(
        edge,
        Duration::from_secs(60),
        &format!("{node} linked to {edges:?}"),
        |s| linked_edges(s, node) == edges,
    )
    .await;
}

async fn wait_offline(edge: &EdgeProc, node: &str, within: Duration) -> Duration {
    wait_status(edge, within, &format!("{node} offline"), |s| {
        node_status(s, node)["ready"] != true
    })
    .await
}

#[tokio::test]
async fn one_join_links_a_node_to_every_edge_and_a_revocation_anywhere_cuts_it_everywhere() {
    let Some(pg) = Postgres::start("a fleet of edges") else {
        return;
    };
    let (d1, d2, d3, dn) = (tempdir(), tempdir(), tempdir(), tempdir());
    let e1 = fleet_edge(d1.path(), &pg, "edge-1").await;
    // Nodes reach edge 2 through a proxy the test can cut: its fleet address.
    let e2_nodes = free_addr();
    let proxy = CuttableProxy::start(&e2_nodes).await;
    let e2 = fleet_edge_on(d2.path(), &pg, "edge-2", &e2_nodes, Some(&proxy.addr)).await;
    assert_eq!(e1.pin, e2.pin, "one pin for the fleet");

    // The join string names edge 1 only; the node learns the others from it.
    let join = join_token(&e1, "gpu", &[]).await;
    let mut node = start_joining_node("gpu", dn.path(), &join, &[]);
    wait_ready(&e1, "gpu").await;
    wait_ready(&e2, "gpu").await;
    // An edge started later is linked too, with no word to the node.
    let mut e3 = fleet_edge(d3.path(), &pg, "edge-3").await;
    assert_eq!(e1.pin, e3.pin);
    let ready_on_new_edge = wait_ready(&e3, "gpu").await;
    eprintln!("the node was ready on the new edge {ready_on_new_edge:?} after its start");
    for edge in [&e1, &e2, &e3] {
        wait_linked(edge, "gpu", &["edge-1", "edge-2", "edge-3"]).await;
        let (status, _) = chat_completion(edge, "mock", "hi", serde_json::json!({})).await;
        assert_eq!(status, 200, "every edge serves through the node");
    }

    // A join token's uses count across the fleet: one use, redeemed on edge 1 by the
    // first node, is used up on edge 3 too.
    let spare = join_token(&e3, "spare", &[]).await;
    let first = start_joining_node("spare", dn.path(), &spare, &["--edge", &e1.nodes]);
    wait_ready(&e1, "spare").await;
    drop(first);
    let other = tempdir();
    let mut again = start_joining_node("spare", other.path(), &spare, &["--edge", &e3.nodes]);
    assert!(!again.wait_exit(Duration::from_secs(60)).await.success());
    assert!(again.log().contains("used up"), "{}", again.log());

    // An edge that drains leaves the fleet's list and the node lets its link go; started
    // again, it is linked again.
    e3.proc.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(e3.proc.wait_exit(Duration::from_secs(60)).await.success());
    wait_linked(&e1, "gpu", &["edge-1", "edge-2"]).await;
    node.wait_line(
        "link to an edge that left the fleet ended",
        Duration::from_secs(30),
    )
    .await;
    let e3 = fleet_edge(d3.path(), &pg, "edge-3").await;
    let ready_again = wait_ready(&e3, "gpu").await;
    eprintln!("the node was ready on the restarted edge {ready_again:?} after its start");
    wait_linked(&e1, "gpu", &["edge-1", "edge-2", "edge-3"]).await;

    // Revoked on edge 2 while the node's link to edge 2 is cut: only the fleet can tell
    // edges 1 and 3.
    proxy.cut();
    wait_offline(&e2, "gpu", Duration::from_secs(30)).await;
    let revoked = Instant::now();
    revoke(&e2, "gpu").await;
    let on_1 = wait_offline(&e1, "gpu", Duration::from_secs(10)).await;
    let on_3 = wait_offline(&e3, "gpu", Duration::from_secs(10)).await;
    let took = revoked.elapsed();
    eprintln!(
        "the revocation closed the node's links on edges 1 and 3 within {took:?} ({on_1:?}, {on_3:?})"
    );
    // At least one of them learned it from the fleet (the node's link to edge 2 is cut,
    // so nothing else could tell it); the other may instead see the node go, once the
    // node heard of its revocation from the first.
    let told: Vec<bool> = [&e1, &e3]
        .iter()
        .map(|edge| edge.proc.log().contains("node revoked on another edge"))
        .collect();
    assert!(
        told.contains(&true),
        "{}\n-----\n{}",
        e1.proc.log(),
        e3.proc.log()
    );
    // The issue's bound, well under the heartbeat's 5 s: the edges closed the links, not
    // a timeout (measured: tens of milliseconds, under 0.1 s with both cores busy).
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(!node.wait_exit(Duration::from_secs(30)).await.success());
    assert!(node.log().contains("revoked"), "{}", node.log());
}

#[tokio::test]
async fn a_second_edge_with_another_secret_key_is_refused_and_says_so() {
    let Some(pg) = Postgres::start("a wrong store secret key") else {
        return;
    };
    let d1 = tempdir();
    let _e1 = fleet_edge(d1.path(), &pg, "edge-1").await;
    let other_key = "ZmVkY2JhOTg3NjU0MzIxMGZlZGNiYTk4NzY1NDMyMTA=";
    let log = edge_failing_to_start(
        &config(&pg.url(), "edge-2", None),
        &[("IOP_STORE_SECRET_KEY", other_key)],
    )
    .await;
    assert!(log.contains("sealed with another secret key"), "{log}");
    assert!(!log.contains(other_key), "the key is never printed");
}

/// Edges of one store and the node `n1` that links to them all.
struct Edges {
    edges: Vec<EdgeProc>,
    _dirs: Vec<tempfile::TempDir>,
    _node: Proc,
}

/// Starts `edge-1`..`edge-3`, each with `config(id)`, and `n1` (static token, told of
/// edge 1 only); returns once `n1` is ready on all three.
async fn three_edges_and_n1(config: impl Fn(&str) -> String) -> Edges {
    edges_and_n1(3, config).await
}

/// Starts `edge-1`..`edge-<n>`, each with `config(id)`, and `n1` (static token, told of
/// edge 1 only); returns once `n1` is ready on all of them.
async fn edges_and_n1(n: usize, config: impl Fn(&str) -> String) -> Edges {
    let mut dirs = Vec::new();
    let mut edges = Vec::new();
    for i in 1..=n {
        let dir = tempdir();
        edges.push(
            start_edge_full(
                dir.path(),
                &config(&format!("edge-{i}")),
                "127.0.0.1:0",
                "127.0.0.1:0",
                &[("IOP_STORE_SECRET_KEY", SECRET_KEY)],
            )
            .await,
        );
        dirs.push(dir);
    }
    let node_dir = tempdir();
    let node = start_node(
        "n1",
        node_dir.path(),
        &edges[0].nodes,
        "token-n1-0123456789",
        "",
    );
    dirs.push(node_dir);
    for edge in &edges {
        wait_ready(edge, "n1").await;
    }
    Edges {
        edges,
        _dirs: dirs,
        _node: node,
    }
}

/// A fleet config whose one node `n1` (static token) serves `mock` from an
/// OpenAI-compatible provider at `base` with `max_concurrency: 2`.
fn narrow_config(url: &str, id: &str, base: &str) -> String {
    format!(
        r#"
store: {{url: "{url}", edge_id: {id}}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: p, kind: openai_compat, base_url: "{base}", capacity: {{normal: 4}}, max_concurrency: 2}}
model_groups:
  - {{name: mock, members: [{{node: n1, provider: p}}]}}
"#
    )
}

/// The permits `edge` holds for provider `p` of node `n1`.
async fn permits_of_p(edge: &EdgeProc) -> u64 {
    let s = status(edge).await;
    node_status(&s, "n1")["providers"][0]["permits"]
        .as_u64()
        .unwrap_or_else(|| panic!("no permits in {s}"))
}

#[tokio::test]
async fn a_provider_behind_three_edges_never_sees_more_than_its_limit_and_a_dead_edge_costs_only_its_own_requests()
 {
    let Some(pg) = Postgres::start("capacity across edges") else {
        return;
    };
    let mock = start_mock(&["--tokens", "8", "--token-delay-ms", "25"]).await;
    let mut fleet =
        three_edges_and_n1(|id| narrow_config(&pg.url(), id, &mock.openai_base())).await;
    let edges = &mut fleet.edges;

    // The node shares the provider's two slots among the edges (its permits).
    let mut total = 0;
    for edge in edges.iter() {
        total += permits_of_p(edge).await;
    }
    assert_eq!(
        total, 2,
        "the three edges hold the provider's two permits between them"
    );

    // A burst of twelve streams, four on each edge: the node moves its two permits to
    // where requests wait, so every one is served and the provider never has more than
    // two in flight.
    let burst = edges.iter().flat_map(|edge| {
        (0..4).map(move |i| async move {
            chat_completion(edge, "mock", &format!("burst {i}"), serde_json::json!({})).await
        })
    });
    let answers = futures::future::join_all(burst).await;
    let served = answers.iter().filter(|(status, _)| *status == 200).count();
    let stats = mock.stats().await;
    eprintln!("burst: {served} of 12 served; provider stats {stats}");
    assert!(stats["peak_in_flight"].as_u64().unwrap() <= 2, "{stats}");
    for (status, body) in &answers {
        assert_eq!(*status, 200, "{body}");
    }

    // Steady load on every edge; edge 3 is killed in the middle of it. Every request
    // sent to edges 1 and 2 is served.
    let load = |edge: &EdgeProc| {
        let url = edge.url("/v1/chat/completions");
        tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for i in 0..12 {
                let answer = client()
                    .post(&url)
                    .json(&serde_json::json!({"model": "mock", "messages": [{"role": "user", "content": format!("steady {i}")}]}))
                    .send()
                    .await;
                let status = match answer {
                    Ok(response) => response.status().as_u16(),
                    Err(_) => 0,
                };
                outcomes.push(status);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            outcomes
        })
    };
    let steady: Vec<_> = edges[..2].iter().map(load).collect();
    let doomed = load(&edges[2]);
    tokio::time::sleep(Duration::from_millis(400)).await;
    edges[2].proc.kill9();
    let killed = Instant::now();
    let lost = doomed.await.unwrap();
    eprintln!("requests to the killed edge: {lost:?}");
    for outcomes in steady {
        let outcomes = outcomes.await.unwrap();
        assert!(outcomes.iter().all(|s| *s == 200), "{outcomes:?}");
    }
    // The dead edge's permits come back to the living ones.
    loop {
        let held = permits_of_p(&edges[0]).await + permits_of_p(&edges[1]).await;
        if held == 2 {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "edges 1 and 2 hold {held} permits"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "the killed edge's permits were back {:?} after the kill",
        killed.elapsed()
    );
    // A stream cut by the edge's death frees its slot when the node closes the provider
    // connection; the provider notices the close only at its next write, so it may count
    // that stream beside the next one for a moment (one per stream cut).
    let stats = mock.stats().await;
    let cut = stats["aborted"].as_u64().unwrap();
    assert!(
        stats["peak_in_flight"].as_u64().unwrap() <= 2 + cut,
        "{stats}"
    );
}

const LIMITED: &str = "sk-limited-0123456789";
const SINGLE: &str = "sk-single-0123456789";
const BUDGET: &str = "sk-budget-0123456789";
const SPREAD: &str = "sk-spread-0123456789";

fn limits_config(url: &str, id: &str) -> String {
    format!(
        r#"
store: {{url: "{url}", edge_id: {id}}}
auth:
  keys:
    - {{name: ops, role: admin, key: {TEST_API_KEY}}}
    - {{name: limited, role: client, key: {LIMITED}, limits: {{requests_per_minute: 10}}}}
    - {{name: single, role: client, key: {SINGLE}, limits: {{max_concurrent: 2}}}}
    - {{name: budget, role: client, key: {BUDGET}, limits: {{tokens_per_day: 60, reserve_tokens: 8}}}}
    - {{name: spread, role: client, key: {SPREAD}, limits: {{requests_per_minute: 9}}}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: m, kind: mock, capacity: {{normal: 16}}, mock: {{tokens: 8, token_delay_ms: 100}}}}
model_groups:
  - {{name: mock, members: [{{node: n1, provider: m}}]}}
"#
    )
}

/// Sends one chat completion with `key` to `edge`; the status and the error code.
async fn keyed(edge: &EdgeProc, key: &str, stream: bool) -> (u16, String) {
    let response = client()
        .post(edge.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(
            &serde_json::json!({"model": "mock", "stream": stream, "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}]}),
        )
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let body = response.text().await.unwrap_or_default();
    let code = serde_json::from_str::<Value>(&body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(String::from))
        .unwrap_or_default();
    (status, code)
}

#[tokio::test]
async fn api_key_limits_hold_across_the_fleet() {
    let Some(pg) = Postgres::start("key limits across edges") else {
        return;
    };
    let fleet = three_edges_and_n1(|id| limits_config(&pg.url(), id)).await;
    let edges = &fleet.edges;

    // requests_per_minute: 10, thirty requests spread over three edges at once: ten pass.
    let all = (0..30).map(|i| keyed(&edges[i % 3], LIMITED, true));
    let answers = futures::future::join_all(all).await;
    let passed = answers.iter().filter(|(s, _)| *s == 200).count();
    assert_eq!(passed, 10, "{answers:?}");
    assert!(
        answers
            .iter()
            .all(|(s, c)| *s == 200 || (*s == 429 && c == "requests_per_minute_exceeded")),
        "{answers:?}"
    );

    // max_concurrent: 2 — two slow streams on edge 1 hold both places; edges 2 and 3
    // refuse a third, and take one once a place is back.
    let hold = |edge: &EdgeProc| {
        let url = edge.url("/v1/chat/completions");
        tokio::spawn(async move {
            let mut response = client()
                .post(url)
                .bearer_auth(SINGLE)
                .json(&serde_json::json!({"model": "mock", "stream": true,
                    "messages": [{"role": "user", "content": "hold"}]}))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            while let Ok(Some(_)) = response.chunk().await {}
        })
    };
    let first = hold(&edges[0]);
    let second = hold(&edges[0]);
    wait_status(&edges[0], Duration::from_secs(10), "two in flight", |s| {
        s["keys"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|k| k["name"] == "single" && k["in_flight"] == 2)
    })
    .await;
    for edge in &edges[1..] {
        let (status, code) = keyed(edge, SINGLE, false).await;
        assert_eq!((status, code.as_str()), (429, "max_concurrent_exceeded"));
    }
    first.await.unwrap();
    second.await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _) = keyed(&edges[2], SINGLE, false).await;
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the places never came back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // tokens_per_day: 60 — requests of about 13 tokens (5 in, 8 out), one edge after
    // another: the fleet stops the key near its budget, not each edge at its own.
    let mut served = 0;
    for i in 0..30 {
        let (status, code) = keyed(&edges[i % 3], BUDGET, false).await;
        if status == 200 {
            served += 1;
        } else {
            assert_eq!((status, code.as_str()), (429, "tokens_per_day_exceeded"));
        }
    }
    // What the key used, as each edge counted its own requests.
    let mut used = 0;
    for edge in edges {
        let s = status(edge).await;
        used += s["keys"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|k| k["name"] == "budget")
            .and_then(|k| k["tokens_today"].as_u64())
            .unwrap_or(0);
    }
    eprintln!("tokens_per_day 60: {served} requests served across the fleet, {used} tokens");
    // The fleet's bound: below the budget when the last request was admitted, plus that
    // request's tokens (each edge on its own would have served about three times more).
    let per_request = used / (served as u64).max(1);
    assert!(
        used < 60 + per_request,
        "{used} tokens in {served} requests"
    );
    assert!(served as u64 >= 60 / (per_request + 1), "{served}");

    // The store stops: the edges keep serving, each within its share of the limit
    // (9 requests per minute over three edges: 3 each).
    pg.stop();
    let all = (0..30).map(|i| keyed(&edges[i % 3], SPREAD, false));
    let answers = futures::future::join_all(all).await;
    let passed = answers.iter().filter(|(s, _)| *s == 200).count();
    assert_eq!(passed, 9, "{answers:?}");
    assert!(
        edges[0].proc.log().contains("each edge enforces its share"),
        "{}",
        edges[0].proc.log()
    );
}

const FOUR: &str = "sk-four-0123456789ab";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_concurrent_holds_exactly_across_two_hammered_edges() {
    let Some(pg) = Postgres::start("max_concurrent across two edges") else {
        return;
    };
    // Each request holds its place for about 100 ms at the provider, which counts how
    // many it serves at once.
    let mock = start_mock(&["--tokens", "5", "--token-delay-ms", "20"]).await;
    let base = mock.openai_base();
    let config = |id: &str| {
        format!(
            r#"
store: {{url: "{url}", edge_id: {id}}}
auth:
  keys:
    - {{name: ops, role: admin, key: {TEST_API_KEY}}}
    - {{name: four, role: client, key: {FOUR}, limits: {{max_concurrent: 4}}}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: p, kind: openai_compat, base_url: "{base}", capacity: {{normal: 32}}}}
model_groups:
  - {{name: mock, members: [{{node: n1, provider: p}}]}}
"#,
            url = pg.url()
        )
    };
    let fleet = edges_and_n1(2, config).await;
    let edges = &fleet.edges;
    // Twelve loops, six on each edge, for ten seconds (a refused one tries again at once).
    let mut loops = tokio::task::JoinSet::new();
    let end = Instant::now() + Duration::from_secs(10);
    for i in 0..12 {
        let url = edges[i % 2].url("/v1/chat/completions");
        loops.spawn(async move {
            let (mut ok, mut refused) = (0, 0);
            while Instant::now() < end {
                let response = client()
                    .post(&url)
                    .bearer_auth(FOUR)
                    .json(&serde_json::json!({"model": "mock", "max_tokens": 5,
                        "messages": [{"role": "user", "content": "hi"}]}))
                    .send()
                    .await
                    .unwrap();
                match response.status().as_u16() {
                    200 => ok += 1,
                    429 => refused += 1,
                    other => panic!("{other}: {}", response.text().await.unwrap_or_default()),
                }
                let _ = response.bytes().await;
            }
            (ok, refused)
        });
    }
    let (mut ok, mut refused) = (0, 0);
    while let Some(done) = loops.join_next().await {
        let (o, r) = done.unwrap();
        ok += o;
        refused += r;
    }
    let stats = mock.stats().await;
    eprintln!("max_concurrent 4 over two edges: {ok} served, {refused} refused, {stats}");
    assert!(ok >= 20, "{ok} served");
    // Exact while the store answers; an edge that found it too slow (a busy machine) used
    // its share on its own for a moment, which is the documented bound instead.
    if edges
        .iter()
        .any(|e| e.proc.has_line("each edge enforces its share"))
    {
        eprintln!("the store did not answer in time during the run: exactness not checked");
        return;
    }
    assert!(
        stats["peak_in_flight"].as_u64().unwrap() <= 4,
        "the provider saw more than the key's 4 at once: {stats}"
    );
}

fn mock_config(url: &str, id: &str) -> String {
    format!(
        r#"
store: {{url: "{url}", edge_id: {id}}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: m, kind: mock, capacity: {{normal: 8}}}}
model_groups:
  - {{name: mock, members: [{{node: n1, provider: m}}]}}
"#
    )
}

/// Waits (bounded) until the store's ledger holds `n` records.
async fn wait_shipped(pg: &Postgres, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let held: usize = pg.query("SELECT count(*) FROM iop_usage").parse().unwrap();
        if held == n {
            return;
        }
        assert!(
            held < n && Instant::now() < deadline,
            "the store's ledger holds {held} records, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn the_fleet_ledger_loses_nothing_while_the_store_is_down_for_30_seconds() {
    let Some(pg) = Postgres::start("the fleet's ledger") else {
        return;
    };
    let fleet = three_edges_and_n1(|id| mock_config(&pg.url(), id)).await;
    let send = |n: usize| {
        let edges = &fleet.edges;
        async move {
            for i in 0..n {
                let (status, body) =
                    chat_completion(&edges[i % 3], "mock", "count me", serde_json::json!({})).await;
                assert_eq!(status, 200, "{body}");
            }
        }
    };
    send(12).await;
    wait_shipped(&pg, 12).await;

    // The store stops for 30 s: requests keep flowing, their records wait on the edges.
    pg.stop();
    let stopped = Instant::now();
    send(18).await;
    tokio::time::sleep(Duration::from_secs(30).saturating_sub(stopped.elapsed())).await;
    pg.restart();
    wait_shipped(&pg, 30).await;
    // Each edge's records once: as many as each edge wrote to its own ledger.
    for (i, edge) in fleet.edges.iter().enumerate() {
        let local = status(edge).await["ledger"]["written_records"]
            .as_u64()
            .unwrap();
        let shipped = pg.query(&format!(
            "SELECT count(DISTINCT id) FROM iop_usage WHERE edge_id = 'edge-{}'",
            i + 1
        ));
        assert_eq!(shipped, local.to_string(), "edge-{}", i + 1);
    }
    // Every shipped record says how its member was picked.
    assert_eq!(
        pg.query("SELECT count(*) FROM iop_usage WHERE routing = ''"),
        "0"
    );
    assert!(
        fleet.edges[0]
            .proc
            .log()
            .contains("records kept meanwhile are shipped"),
        "{}",
        fleet.edges[0].proc.log()
    );
    // Any edge answers for the whole fleet; by default for itself.
    let fleet_usage = admin_get(&fleet.edges[1], "/admin/usage?scope=fleet&per=node")
        .await
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(fleet_usage["rows"][0]["requests"], 30, "{fleet_usage}");
    let own = admin_get(&fleet.edges[1], "/admin/usage?per=node")
        .await
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(own["rows"][0]["requests"], 10, "{own}");
}
