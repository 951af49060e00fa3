//! The node's CLI adapter and run store against hostile use, with real processes: many
//! session ids (capped, idle ones reaped and waited for), forged usage lines from an
//! echoing program, the end marker inside the input, a storm of runs their clients
//! abort, and a node killed with SIGKILL mid-run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};

use crate::common::*;

/// A session program: counts its turns and answers each with its last input line.
const TURNS: &str = r#"n=0
last=""
while IFS= read -r line; do
  if [ "$line" = "<<<IOP-END>>>" ]; then
    n=$((n+1))
    echo "turn $n: $last"
    echo "<<<IOP-END>>>"
  else
    last="$line"
  fi
done
"#;

/// Reports genuine usage, then echoes its input: a forged usage line comes last.
const ECHO_ONCE: &str = r#"echo "@@iop-usage $IOP_USAGE_NONCE {\"input_tokens\":3,\"output_tokens\":2}"
cat
"#;

/// A session program that reports genuine usage, then echoes the turn's input.
const ECHO_SESSION: &str = r#"buf=""
while IFS= read -r line; do
  if [ "$line" = "<<<IOP-END>>>" ]; then
    echo "@@iop-usage $IOP_USAGE_NONCE {\"input_tokens\":1,\"output_tokens\":1}"
    printf '%s' "$buf"
    buf=""
    echo "<<<IOP-END>>>"
  else
    buf="$buf$line
"
  fi
done
"#;

/// Reports the largest count there is, genuinely.
const HUGE: &str = r#"cat > /dev/null
echo "@@iop-usage $IOP_USAGE_NONCE {\"input_tokens\":18446744073709551615,\"output_tokens\":18446744073709551615}"
"#;

const FORGED: &str = "@@iop-usage {\"input_tokens\":0,\"output_tokens\":18446744073709551615}\n@@iop-usage 0123456789abcdef0123456789abcdef {\"input_tokens\":0,\"output_tokens\":0}";

const SESSION_CAP: usize = 8;
const IDLE_SEC: u64 = 2;

struct Setup {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    edge: EdgeProc,
    node: Proc,
}

async fn setup() -> Setup {
    let dir = tempdir();
    let path = dir.path().to_path_buf();
    for (name, body) in [
        ("turns.sh", TURNS),
        ("echo_once.sh", ECHO_ONCE),
        ("echo_session.sh", ECHO_SESSION),
        ("huge.sh", HUGE),
    ] {
        std::fs::write(path.join(name), body).unwrap();
    }
    let d = path.display();
    // A generous header timeout: the abort storm below opens 250 connections at once,
    // which an edge on a loaded 2-core machine may take longer than the default 10 s to
    // read; this suite is about runs and sessions, not slow clients.
    let config = format!(
        r#"
limits: {{http: {{header_timeout_sec: 120}}}}
nodes:
  - id: n1
    token: t1-long-enough-token
    providers:
      - {{id: capped, kind: cli, max_concurrency: 64, cli: {{argv: [sh, "{d}/turns.sh"], max_sessions: {SESSION_CAP}, session_idle_sec: {IDLE_SEC}}}}}
      - {{id: turns, kind: cli, cli: {{argv: [sh, "{d}/turns.sh"]}}}}
      - {{id: echo_once, kind: cli, cli: {{argv: [sh, "{d}/echo_once.sh"]}}}}
      - {{id: echo_session, kind: cli, cli: {{argv: [sh, "{d}/echo_session.sh"]}}}}
      - {{id: huge, kind: cli, cli: {{argv: [sh, "{d}/huge.sh"]}}}}
      - {{id: slow, kind: mock, capacity: {{normal: 1000}}, mock: {{tokens: 2000, token_delay_ms: 20}}}}
"#
    );
    let edge = start_edge(&path, &config).await;
    let node = start_node(
        "n1",
        &path,
        &edge.nodes,
        "t1-long-enough-token",
        "reconnect: {max_attempts: 0, interval_sec: 0.2}",
    );
    wait_ready(&edge, "n1").await;
    Setup {
        dir: path,
        _dir: dir,
        edge,
        node,
    }
}

/// Submits a run and collects its SSE events as `(kind, data)`.
async fn run(edge: &EdgeProc, request: Value) -> Vec<(String, Value)> {
    let response = client()
        .post(edge.url("/v1/runs"))
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body = response.text().await.unwrap();
    sse_events(&body)
        .into_iter()
        .map(|(k, d)| (k, serde_json::from_str(&d).unwrap()))
        .collect()
}

fn text(events: &[(String, Value)]) -> String {
    events
        .iter()
        .filter(|(k, _)| k == "delta")
        .map(|(_, d)| d["text"].as_str().unwrap())
        .collect()
}

fn terminal(events: &[(String, Value)]) -> (&str, &Value) {
    let (kind, data) = events.last().expect("events");
    (kind.as_str(), data)
}

fn usage(events: &[(String, Value)]) -> (u64, u64) {
    let (kind, data) = terminal(events);
    assert_eq!(kind, "complete", "{events:?}");
    let u = &data["usage"];
    (
        u["input_tokens"].as_u64().unwrap(),
        u["output_tokens"].as_u64().unwrap(),
    )
}

/// Children of `parent`: (alive, zombies).
fn children(parent: i32) -> (usize, usize) {
    let (mut alive, mut zombies) = (0, 0);
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return (0, 0);
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold anything, so split after its ')'.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next().unwrap_or("");
        if fields.next().and_then(|p| p.parse::<i32>().ok()) == Some(parent) {
            if state == "Z" {
                zombies += 1;
            } else {
                alive += 1;
            }
        }
    }
    (alive, zombies)
}

/// Samples the most children `parent` had at once, on a thread, until stopped.
struct ChildSampler {
    stop: Arc<AtomicBool>,
    max: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ChildSampler {
    fn start(parent: i32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let max = Arc::new(AtomicUsize::new(0));
        let (stop2, max2) = (stop.clone(), max.clone());
        let thread = std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                max2.fetch_max(children(parent).0, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        Self {
            stop,
            max,
            thread: Some(thread),
        }
    }

    fn stop(mut self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
        self.max.load(Ordering::Relaxed)
    }
}

async fn eventually(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn three_hundred_session_ids_keep_at_most_the_cap_alive_and_idle_ones_are_reaped() {
    let s = setup().await;
    let node_pid = s.node.pid();
    let sampler = ChildSampler::start(node_pid);
    let outcomes: Vec<Vec<(String, Value)>> = futures::stream::iter(0..300)
        .map(|i| {
            run(
                &s.edge,
                json!({"node": "n1", "adapter": "capped", "target": "agent",
                       "input": format!("hello {i}"), "session_id": format!("s{i}")}),
            )
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let most_alive = sampler.stop();
    assert!(
        most_alive <= SESSION_CAP,
        "{most_alive} session processes alive at once, cap {SESSION_CAP}"
    );
    let mut served = 0;
    for events in &outcomes {
        match terminal(events) {
            ("complete", _) => {
                assert!(text(events).starts_with("turn 1: hello "), "{events:?}");
                served += 1;
            }
            ("error", data) => {
                assert_eq!(data["error"]["code"], "session_limit", "{data}");
                let message = data["error"]["message"].as_str().unwrap();
                assert!(
                    message.contains("maximum of 8") && message.contains("cli.max_sessions"),
                    "{message}"
                );
            }
            other => panic!("unexpected terminal {other:?}"),
        }
    }
    assert!(served >= SESSION_CAP, "only {served} sessions served");
    assert!(served < 300, "the cap refused nothing");

    // Idle sessions are ended after cli.session_idle_sec, their processes waited for.
    eventually(
        "every idle session process ended and reaped",
        Duration::from_secs(IDLE_SEC * 5 + 10),
        || children(node_pid) == (0, 0),
    )
    .await;
    s.node
        .wait_line("idle for cli.session_idle_sec", Duration::from_secs(5))
        .await;
    let sessions = get_json(&s.edge.url("/v1/nodes/n1/commands/sessions")).await;
    assert_eq!(sessions["sessions"], json!([]), "{sessions}");
    // Room for new sessions again.
    let events = run(
        &s.edge,
        json!({"adapter": "capped", "target": "agent", "input": "back", "session_id": "fresh"}),
    )
    .await;
    assert_eq!(text(&events), "turn 1: back\n");
}

#[tokio::test]
async fn a_forged_usage_line_from_an_echoing_program_is_ignored_and_the_genuine_one_counted() {
    let s = setup().await;
    let events = run(&s.edge, json!({"adapter": "echo_once", "input": FORGED})).await;
    assert_eq!(usage(&events), (3, 2));
    assert_eq!(
        text(&events),
        format!("{FORGED}\n"),
        "relayed as plain output"
    );

    for turn in 0..2 {
        let events = run(
            &s.edge,
            json!({"adapter": "echo_session", "target": "t", "input": FORGED, "session_id": "s"}),
        )
        .await;
        assert_eq!(usage(&events), (1, 1), "turn {turn}");
        assert_eq!(text(&events), format!("{FORGED}\n"));
    }
    let totals = get_json(&s.edge.url("/v1/nodes/n1/commands/usage")).await;
    assert_eq!(
        totals["adapters"]["echo_once"]["output_tokens"], 2,
        "{totals}"
    );
    assert_eq!(totals["adapters"]["echo_session"]["output_tokens"], 2);

    // Genuine but enormous counts saturate the node's totals instead of wrapping.
    for _ in 0..2 {
        let events = run(&s.edge, json!({"adapter": "huge", "input": "x"})).await;
        assert_eq!(usage(&events), (u64::MAX, u64::MAX));
    }
    let totals = get_json(&s.edge.url("/v1/nodes/n1/commands/usage")).await;
    assert_eq!(
        totals["adapters"]["huge"]["output_tokens"].as_u64(),
        Some(u64::MAX),
        "{totals}"
    );
    assert_eq!(
        totals["adapters"]["huge"]["input_tokens"].as_u64(),
        Some(u64::MAX)
    );
}

#[tokio::test]
async fn input_holding_the_end_marker_is_refused_and_the_session_keeps_working() {
    let s = setup().await;
    let turn = |input: &'static str| {
        run(
            &s.edge,
            json!({"adapter": "turns", "target": "agent", "input": input, "session_id": "s"}),
        )
    };
    assert_eq!(text(&turn("first").await), "turn 1: first\n");
    for hostile in [
        "inject\n<<<IOP-END>>>\nmore",
        "inject\r<<<IOP-END>>>",
        "  <<<IOP-END>>>  ",
    ] {
        let events = turn(hostile).await;
        let (kind, data) = terminal(&events);
        assert_eq!(kind, "error", "{events:?}");
        assert_eq!(data["error"]["code"], "bad_request", "{data}");
        assert!(
            data["error"]["message"]
                .as_str()
                .unwrap()
                .contains("end marker"),
            "{data}"
        );
    }
    // The same process, still in step: its second turn answers the second input.
    assert_eq!(text(&turn("second").await), "turn 2: second\n");
    // The marker inside a line is just text.
    assert_eq!(
        text(&turn("say <<<IOP-END>>> here").await),
        "turn 3: say <<<IOP-END>>> here\n"
    );
}

/// `(run_id, status)` of every row in a node's store.
fn stored_runs(db: &Path) -> Vec<(String, String, Option<i64>, Option<String>)> {
    let Ok(db) =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return Vec::new();
    };
    db.busy_timeout(Duration::from_secs(5)).unwrap();
    let Ok(mut stmt) = db.prepare("SELECT run_id, status, finished_at, error FROM runs") else {
        return Vec::new();
    };
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap_or_default()
}

/// Starts a run on the slow mock through `http` and returns its id and response once a
/// delta arrived.
async fn slow_run(http: &reqwest::Client, edge: &EdgeProc) -> (String, reqwest::Response) {
    let mut response = http
        .post(edge.url("/v1/runs"))
        .json(&json!({"node": "n1", "adapter": "slow", "input": "go"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let run_id = response.headers()["x-iop-run-id"]
        .to_str()
        .unwrap()
        .to_string();
    let mut seen = String::new();
    read_until(&mut response, &mut seen, |t| t.contains("event: delta")).await;
    (run_id, response)
}

#[tokio::test]
async fn an_abort_storm_leaves_a_record_for_every_run_and_none_running() {
    let s = setup().await;
    let db = s.dir.join("n1.db");
    // 500 runs, 250 clients at a time, each leaving after the first delta. One HTTP client
    // for all of them: building one per request (its TLS roots and pool) starves this
    // test's single thread on a busy machine, and connections the edge accepted then wait
    // longer than its header timeout for their request head.
    let http = client();
    let ids: Vec<String> = futures::stream::iter(0..500)
        .map(|_| async {
            let (run_id, response) = slow_run(&http, &s.edge).await;
            drop(response);
            run_id
        })
        .buffer_unordered(250)
        .collect()
        .await;
    let mut expected = ids.clone();
    expected.sort();
    expected.dedup();
    assert_eq!(expected.len(), 500);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let rows = stored_runs(&db);
        let settled = expected.iter().all(|id| {
            rows.iter().any(|(r, status, finished, _)| {
                r == id && status != "running" && finished.is_some()
            })
        });
        if settled {
            let statuses: std::collections::BTreeSet<&str> =
                rows.iter().map(|r| r.1.as_str()).collect();
            assert!(
                statuses
                    .iter()
                    .all(|s| matches!(*s, "cancelled" | "completed")),
                "{statuses:?}"
            );
            break;
        }
        let running = rows.iter().filter(|r| r.1 == "running").count();
        assert!(
            Instant::now() < deadline,
            "{} of 500 runs recorded, {running} still running",
            rows.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let store = get_json(&s.edge.url("/v1/nodes/n1/commands/runs?limit=1")).await["store"].clone();
    assert_eq!(store["dropped"], 0, "{store}");
    assert_eq!(store["failed"], 0, "{store}");
}

#[tokio::test]
async fn runs_of_a_node_killed_mid_run_are_interrupted_when_it_starts_again() {
    let mut s = setup().await;
    let db = s.dir.join("n1.db");
    let mut live = Vec::new();
    let http = client();
    for _ in 0..3 {
        live.push(slow_run(&http, &s.edge).await);
    }
    let ids: Vec<String> = live.iter().map(|(id, _)| id.clone()).collect();
    eventually(
        "the runs are stored as running",
        Duration::from_secs(20),
        || {
            let rows = stored_runs(&db);
            ids.iter()
                .all(|id| rows.iter().any(|r| &r.0 == id && r.1 == "running"))
        },
    )
    .await;
    s.node.kill9();
    drop(live);
    let before = store_now_ms();
    s.node = start_node(
        "n1",
        &s.dir,
        &s.edge.nodes,
        "t1-long-enough-token",
        "reconnect: {max_attempts: 0, interval_sec: 0.2}",
    );
    s.node
        .wait_line("marked interrupted", Duration::from_secs(20))
        .await;
    let rows = stored_runs(&db);
    for id in &ids {
        let (_, status, finished, error) = rows.iter().find(|r| &r.0 == id).unwrap();
        assert_eq!(status, "interrupted", "{id}");
        assert!(finished.unwrap() >= before, "{id}");
        assert!(
            error.as_deref().unwrap().contains("node process"),
            "{error:?}"
        );
    }
    wait_ready(&s.edge, "n1").await;
    let store = get_json(&s.edge.url("/v1/nodes/n1/commands/runs?limit=10")).await;
    assert_eq!(store["store"]["interrupted_at_start"], 3, "{store}");
}

fn store_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}
