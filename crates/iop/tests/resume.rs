//! Streams a client can resume: a relayed event stream's events carry ids, and a client
//! that lost its stream sends its request again with `Last-Event-ID` — to any edge of the
//! fleet — and gets exactly the rest of the answer, which is not run again. Real
//! processes: two edges sharing a PostgreSQL store, one node linked to both, the mock
//! OpenAI-compatible provider (which counts the requests it executed).

mod common;

use common::haproxy::Haproxy;
use common::postgres::{Postgres, SECRET_KEY};
use common::*;
use futures::StreamExt;
use serde_json::{Value, json};

const TOKEN: &str = "token-n1-0123456789";
/// Concurrent streams when an edge dies.
const CLIENTS: usize = 50;
const ALICE: &str = "sk-alice-0123456789abcdef";
const BOB: &str = "sk-bob-0123456789abcdef";

fn config(url: &str, id: &str, mock: &MockProc) -> String {
    format!(
        r#"
store: {{url: "{url}", edge_id: {id}}}
dispatch: {{reattach_wait_sec: 2}}
auth:
  keys:
    - {{name: ops, role: admin, key: {TEST_API_KEY}}}
    - {{name: alice, role: client, key: {ALICE}}}
    - {{name: bob, role: client, key: {BOB}}}
nodes:
  - id: n1
    token: {TOKEN}
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{base}", capacity: {{normal: 64}}, max_concurrency: 64}}
model_groups:
  - {{name: m, members: [{{node: n1, provider: oa, model: mock-model}}]}}
"#,
        base = mock.openai_base()
    )
}

/// One event of a stream: its id and its data.
#[derive(Debug, Clone)]
struct Event {
    id: Option<String>,
    data: String,
}

fn body() -> Value {
    json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "tell me"}]})
}

/// The text of the events' deltas, token by token.
fn tokens(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.data).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect()
}

/// Reads whole events off a response until it ends or breaks; `stop_after`: hands back
/// the response's reader after that many events instead (the rest is read by
/// [`read_rest`]).
struct Reader {
    stream: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buf: String,
}

impl Reader {
    async fn open(url: &str, last_event_id: Option<&str>) -> (u16, Reader) {
        let mut request = client().post(url).bearer_auth(ALICE).json(&body());
        if let Some(id) = last_event_id {
            request = request.header("last-event-id", id);
        }
        let response = request.send().await.expect("the edge answers");
        let status = response.status().as_u16();
        (
            status,
            Reader {
                stream: response.bytes_stream().boxed(),
                buf: String::new(),
            },
        )
    }

    /// The next whole event; `None` when the stream ended or broke.
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(at) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..at + 2).collect();
                let mut event = Event {
                    id: None,
                    data: String::new(),
                };
                for line in block.lines() {
                    if let Some(id) = line.strip_prefix("id: ") {
                        event.id = Some(id.to_string());
                    } else if let Some(data) = line.strip_prefix("data: ") {
                        event.data.push_str(data);
                    }
                }
                if event.id.is_none() && event.data.is_empty() {
                    continue;
                }
                return Some(event);
            }
            match self.stream.next().await {
                Some(Ok(bytes)) => self.buf.push_str(&String::from_utf8_lossy(&bytes)),
                _ => return None,
            }
        }
    }

    async fn rest(mut self) -> Vec<Event> {
        let mut events = Vec::new();
        while let Some(event) = self.next().await {
            events.push(event);
        }
        events
    }
}

/// Three edges sharing a store behind HAProxy; 50 clients stream through it; one edge is
/// killed (SIGKILL) while every stream is under way. The clients it cut resume through
/// the balancer with `Last-Event-ID` and get the rest of their answers, token for token;
/// one that does not resume is billed all the same, from its node's report. Nothing ran
/// twice, and the fleet's ledger holds exactly one record per request, with its tokens.
#[tokio::test]
async fn clients_whose_edge_was_killed_resume_through_another_and_nothing_runs_twice() {
    let test = "resuming through another edge";
    let Some(pg) = Postgres::start(test) else {
        return;
    };
    // 100 tokens 25 ms apart: an answer takes 2.5 s, so every stream is under way when
    // the edge is killed.
    let mock = start_mock(&["--tokens", "100", "--token-delay-ms", "25"]).await;
    let env = [("IOP_STORE_SECRET_KEY", SECRET_KEY)];
    let mut edges = Vec::new();
    let mut dirs = Vec::new();
    for i in 1..=3 {
        let dir = tempdir();
        let config = config(&pg.url(), &format!("edge-{i}"), &mock);
        edges.push(start_edge_full(dir.path(), &config, &free_addr(), &free_addr(), &env).await);
        dirs.push(dir);
    }
    let https: Vec<&str> = edges.iter().map(|e| e.http.as_str()).collect();
    let Some(lb) = Haproxy::start(test, &https).await else {
        return;
    };
    let node_dir = tempdir();
    let _node = start_node("n1", node_dir.path(), &edges[0].nodes, TOKEN, "");
    for edge in &edges {
        wait_ready(edge, "n1").await;
    }
    lb.wait_up(&["edge-1", "edge-2", "edge-3"]).await;

    // An uncut answer, for reference.
    let (status, reader) = Reader::open(&edges[1].url("/v1/chat/completions"), None).await;
    assert_eq!(status, 200);
    let whole = reader.rest().await;
    let reference = tokens(&whole);
    assert!(reference.len() >= 100, "{whole:?}");
    assert!(
        whole.iter().all(|e| e.id.is_some()),
        "every event carries an id: {whole:?}"
    );
    assert_eq!(whole.last().unwrap().data, "[DONE]");

    // Clients stream through the balancer; once each has a few events, edge-1 is killed.
    let url = lb.url("/v1/chat/completions");
    let (got_tx, mut got_rx) = tokio::sync::mpsc::channel(CLIENTS);
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        let (url, got_tx) = (url.clone(), got_tx.clone());
        clients.push(tokio::spawn(async move {
            let (status, mut reader) = Reader::open(&url, None).await;
            assert_eq!(status, 200);
            let mut seen = Vec::new();
            while seen.len() < 3 + i % 5 {
                seen.push(reader.next().await.expect("events before the kill"));
            }
            got_tx.send(()).await.unwrap();
            // Then whatever comes until the stream ends or breaks.
            seen.extend(reader.rest().await);
            seen
        }));
    }
    for _ in 0..CLIENTS {
        got_rx.recv().await.unwrap();
    }
    edges[0].proc.kill9();
    let mut cut = Vec::new();
    for client in clients {
        let seen = client.await.unwrap();
        if seen.last().is_some_and(|e| e.data == "[DONE]") {
            assert_eq!(tokens(&seen), reference, "an uncut stream is whole");
        } else {
            cut.push(seen);
        }
    }
    assert!(
        cut.len() >= 2,
        "the killed edge carried streams ({} cut)",
        cut.len()
    );

    // Each but one resumes through the balancer with the id of the last event it has.
    let mut resumed = Vec::new();
    for seen in &cut[1..] {
        let last = seen
            .last()
            .unwrap()
            .id
            .clone()
            .expect("the event has an id");
        let url = url.clone();
        resumed.push(tokio::spawn(async move {
            let (status, reader) = Reader::open(&url, Some(&last)).await;
            (status, reader.rest().await)
        }));
    }
    for (seen, rest) in cut[1..].iter().zip(resumed) {
        let (status, rest) = rest.await.unwrap();
        assert_eq!(status, 200, "{rest:?}");
        let mut all = seen.clone();
        all.extend(rest);
        assert_eq!(
            tokens(&all),
            reference,
            "the resumed answer is the whole answer, token for token"
        );
        assert_eq!(all.last().unwrap().data, "[DONE]");
        // Ids follow on: nothing left out, nothing twice.
        let positions: Vec<u64> = all
            .iter()
            .map(|e| {
                e.id.as_deref()
                    .unwrap()
                    .rsplit('.')
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap()
            })
            .collect();
        assert_eq!(positions, (1..=all.len() as u64).collect::<Vec<_>>());
    }
    let executed = mock.stats().await["requests"].as_u64().unwrap();
    assert_eq!(executed, 1 + CLIENTS as u64, "no answer ran twice");

    // The fleet's ledger: one record per request — the reference, the uncut, the resumed
    // and the one left on the dead edge (reported by its node once the wait passed) —
    // each with the answer's tokens.
    let live = &edges[1];
    let per_request = whole_usage(live).await;
    let fleet = wait_status_json(live, "/admin/usage?scope=fleet", |usage| {
        usage["rows"][0]["requests"] == 1 + CLIENTS as u64
    })
    .await;
    let row = &fleet["rows"][0];
    assert_eq!(
        row["output_tokens"],
        per_request * (1 + CLIENTS as u64),
        "{fleet}"
    );
    // The stream left on the dead edge is recorded as such by the edge its node told.
    let mut lost = Vec::new();
    for edge in &edges[1..] {
        let records =
            wait_status_json(edge, "/admin/usage/records?outcome=edge_lost", |_| true).await;
        lost.extend(records["records"].as_array().unwrap().clone());
    }
    assert_eq!(lost.len(), 1, "{lost:?}");
    assert_eq!(lost[0]["key"], "alice", "{lost:?}");
    assert_eq!(lost[0]["group"], "m", "{lost:?}");
    assert_eq!(lost[0]["output_tokens"], per_request, "{lost:?}");

    // An id this fleet did not give is a new request; one for an answer the node does not
    // have is refused in the API's error shape.
    let url_b = live.url("/v1/chat/completions");
    let (status, reader) = Reader::open(&url_b, Some("42")).await;
    assert_eq!(status, 200);
    assert_eq!(tokens(&reader.rest().await), reference);
    let unknown = format!("n1.{}.3", "0".repeat(32));
    let (status, error) = resume_as(&url_b, ALICE, &unknown).await;
    assert_eq!(status, 404);
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cannot be resumed"),
        "{error}"
    );
    // Someone else's key cannot resume an answer.
    let theirs = format!(
        "n1.{}.3",
        whole[0].id.as_deref().unwrap().split('.').nth(1).unwrap()
    );
    let (status, _) = resume_as(&url_b, BOB, &theirs).await;
    assert_eq!(status, 404, "another key's answer is not resumable");
    drop(dirs);
}

/// Resumes `last_event_id` at `url` with `key`: the status and the error it answered.
async fn resume_as(url: &str, key: &str, last_event_id: &str) -> (u16, Value) {
    let response = client()
        .post(url)
        .bearer_auth(key)
        .header("last-event-id", last_event_id)
        .json(&body())
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or_default())
}

/// The output tokens the provider reports for one answer (from the ledger's only record
/// of the reference request, on `edge`).
async fn whole_usage(edge: &EdgeProc) -> u64 {
    let records: Value = admin_get(edge, "/admin/usage/records?limit=1")
        .await
        .json()
        .await
        .unwrap();
    let tokens = records["records"][0]["output_tokens"].as_u64().unwrap_or(0);
    assert!(tokens > 0, "{records}");
    tokens
}

/// Polls an admin endpoint of `edge` until `done` says its answer is the one (30 s at
/// most).
async fn wait_status_json(edge: &EdgeProc, path: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let answer: Value = admin_get(edge, path).await.json().await.unwrap();
        if done(&answer) {
            return answer;
        }
        assert!(std::time::Instant::now() < deadline, "{path}: {answer}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// The official OpenAI Python SDK streams through a connection that is cut mid-stream and
/// resumes the way a client app would (`x-iop-resume` and the chunks it got, in
/// `Last-Event-ID`): its text is the whole answer, which ran once.
#[tokio::test]
async fn the_openai_sdk_resumes_a_stream_its_connection_lost() {
    let test = "the OpenAI Python SDK resuming a cut stream";
    let Some(python) = common::sdk::python(test, &["openai"]) else {
        return;
    };
    let mock = start_mock(&["--tokens", "40", "--token-delay-ms", "25"]).await;
    let dir = tempdir();
    let config = format!(
        r#"
dispatch: {{resume_grace_sec: 10}}
nodes:
  - id: n1
    token: {TOKEN}
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{base}", capacity: {{normal: 16}}}}
model_groups:
  - {{name: m, members: [{{node: n1, provider: oa, model: mock-model}}]}}
"#,
        base = mock.openai_base()
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, TOKEN, "");
    wait_ready(&edge, "n1").await;
    let (status, reader) = Reader::open(&edge.url("/v1/chat/completions"), None).await;
    assert_eq!(status, 200);
    let reference = tokens(&reader.rest().await).concat();

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/resume_check.py");
    let base = edge.url("");
    let stdout = common::sdk::run_check(&python, script, &[&base, "m"]).await;
    assert!(stdout.contains("cut after"), "{stdout}");
    assert!(stdout.contains(&format!("text:{reference}\n")), "{stdout}");
    let executed = mock.stats().await["requests"].as_u64().unwrap();
    assert_eq!(executed, 2, "the resumed answer did not run again");
}

/// A background Responses request (`background: true`) is answered at once with iop's id
/// and goes on without its client; it is then fetched as it stands and streamed from a
/// `starting_after` — it ran once.
#[tokio::test]
async fn a_background_response_is_fetched_and_streamed_from_a_sequence_number() {
    // 20 tokens 150 ms apart: an answer takes 3 s (a cancel lands mid-answer).
    let mock = start_mock(&["--tokens", "20", "--token-delay-ms", "150"]).await;
    let dir = tempdir();
    let config = format!(
        r#"
nodes:
  - id: n1
    token: {TOKEN}
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{base}", apis: [chat, responses]}}
model_groups:
  - {{name: m, members: [{{node: n1, provider: oa, model: mock-model}}]}}
  - {{name: translated, members: [{{node: n1, provider: plain, model: mock-model}}]}}
"#,
        base = mock.openai_base()
    )
    .replace(
        "      - {id: oa,",
        &format!(
            "      - {{id: plain, kind: openai_compat, base_url: \"{}\"}}\n      - {{id: oa,",
            mock.openai_base()
        ),
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, TOKEN, "");
    wait_ready(&edge, "n1").await;
    let http = client();
    let created = post_json(
        &edge.url("/v1/responses"),
        &json!({"model": "m", "input": "tell me", "background": true}),
    )
    .await;
    assert_eq!(created["status"], "queued", "{created}");
    assert_eq!(created["background"], true);
    let id = created["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("resp_"), "{id}");

    // Fetched until it is complete (the client that created it is gone).
    let url = edge.url(&format!("/v1/responses/{id}"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let done = loop {
        let now: Value = http.get(&url).send().await.unwrap().json().await.unwrap();
        assert_eq!(now["id"], id.as_str(), "{now}");
        if now["status"] == "completed" {
            break now;
        }
        assert!(
            ["queued", "in_progress"].contains(&now["status"].as_str().unwrap()),
            "{now}"
        );
        assert!(std::time::Instant::now() < deadline, "{now}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let text = done["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!text.is_empty(), "{done}");
    assert!(
        done["usage"]["output_tokens"].as_u64().unwrap() > 0,
        "{done}"
    );

    // Streamed from after sequence number 3: the events from 4 on, the text's rest.
    let body = http
        .get(format!("{url}?stream=true&starting_after=3"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events: Vec<Value> = sse_events(&body)
        .into_iter()
        .map(|(_, data)| serde_json::from_str(&data).unwrap())
        .collect();
    assert_eq!(events[0]["sequence_number"], 4, "{body}");
    assert_eq!(
        events.last().unwrap()["type"],
        "response.completed",
        "{body}"
    );
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert!(
        text.ends_with(&deltas) && !deltas.is_empty(),
        "{deltas:?} of {text:?}"
    );
    assert_eq!(mock.stats().await["requests"], 1, "it ran once");

    // The same with the official OpenAI Python SDK.
    if let Some(python) =
        common::sdk::python("a background response with the OpenAI SDK", &["openai"])
    {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/python/background_check.py"
        );
        let base = edge.url("/v1");
        let stdout = common::sdk::run_check(&python, script, &[&base, "m"]).await;
        assert!(stdout.contains(&format!("text:{text}\n")), "{stdout}");
        assert!(stdout.contains("first:4\n"), "{stdout}");
        assert!(stdout.contains("last:response.completed\n"), "{stdout}");
        assert!(stdout.contains(&format!("streamed:{text}\n")), "{stdout}");
    }

    // A background response cancelled by its client: its provider request is dropped,
    // and it says so from then on.
    let slow = post_json(
        &edge.url("/v1/responses"),
        &json!({"model": "m", "input": "tell me", "background": true}),
    )
    .await;
    let slow_id = slow["id"].as_str().unwrap();
    let slow_url = edge.url(&format!("/v1/responses/{slow_id}"));
    let cancelled = post_json(&format!("{slow_url}/cancel"), &json!({})).await;
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    assert_eq!(cancelled["id"], slow_id, "{cancelled}");
    mock.wait_aborted(1, std::time::Duration::from_secs(20))
        .await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let now: Value = http
            .get(&slow_url)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if now["status"] == "cancelled" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{now}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    // Not one of iop's ids; a group a translation serves.
    let missing = http
        .get(edge.url("/v1/responses/resp_nothing"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    for (body, what) in [(
        json!({"model": "translated", "input": "x", "background": true}),
        "members all serve",
    )] {
        let refused = http
            .post(edge.url("/v1/responses"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(refused.status(), 400);
        let error: Value = refused.json().await.unwrap();
        assert!(
            error["error"]["message"].as_str().unwrap().contains(what),
            "{error}"
        );
    }
}
