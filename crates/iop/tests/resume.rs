//! Streams a client can resume: a relayed event stream's events carry ids, and a client
//! that lost its stream sends its request again with `Last-Event-ID` — to any edge of the
//! fleet — and gets exactly the rest of the answer, which is not run again. Real
//! processes: two edges sharing a PostgreSQL store, one node linked to both, the mock
//! OpenAI-compatible provider (which counts the requests it executed).

mod common;

use common::postgres::{Postgres, SECRET_KEY};
use common::*;
use futures::StreamExt;
use serde_json::{Value, json};

const TOKEN: &str = "token-n1-0123456789";
/// Streams cut by the edge's death.
const CLIENTS: usize = 8;

fn config(url: &str, id: &str, mock: &MockProc) -> String {
    format!(
        r#"
store: {{url: "{url}", edge_id: {id}}}
nodes:
  - id: n1
    token: {TOKEN}
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{base}", capacity: {{normal: 16}}, max_concurrency: 16}}
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
        let mut request = client().post(url).json(&body());
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

#[tokio::test]
async fn clients_whose_edge_was_killed_resume_through_another_and_nothing_runs_twice() {
    let Some(pg) = Postgres::start("resuming through another edge") else {
        return;
    };
    // 40 tokens 25 ms apart: an answer takes about a second.
    let mock = start_mock(&["--tokens", "40", "--token-delay-ms", "25"]).await;
    let env = [("IOP_STORE_SECRET_KEY", SECRET_KEY)];
    let (dir_a, dir_b) = (tempdir(), tempdir());
    let (nodes_a, http_a) = (free_addr(), free_addr());
    let mut a = start_edge_full(
        dir_a.path(),
        &config(&pg.url(), "edge-a", &mock),
        &nodes_a,
        &http_a,
        &env,
    )
    .await;
    let b = start_edge_full(
        dir_b.path(),
        &config(&pg.url(), "edge-b", &mock),
        &free_addr(),
        &free_addr(),
        &env,
    )
    .await;
    let node_dir = tempdir();
    let _node = start_node("n1", node_dir.path(), &nodes_a, TOKEN, "");
    wait_ready(&a, "n1").await;
    wait_ready(&b, "n1").await;

    // An uncut answer, for reference.
    let (status, reader) = Reader::open(&b.url("/v1/chat/completions"), None).await;
    assert_eq!(status, 200);
    let whole = reader.rest().await;
    let reference = tokens(&whole);
    assert!(reference.len() >= 40, "{whole:?}");
    assert!(
        whole.iter().all(|e| e.id.is_some()),
        "every event carries an id: {whole:?}"
    );
    assert_eq!(whole.last().unwrap().data, "[DONE]");

    // Clients stream through edge A; once each has a few events, A is killed.
    let url_a = a.url("/v1/chat/completions");
    let (got_tx, mut got_rx) = tokio::sync::mpsc::channel(CLIENTS);
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        let (url, got_tx) = (url_a.clone(), got_tx.clone());
        clients.push(tokio::spawn(async move {
            let (status, mut reader) = Reader::open(&url, None).await;
            assert_eq!(status, 200);
            let mut seen = Vec::new();
            while seen.len() < 3 + i {
                seen.push(reader.next().await.expect("events before the kill"));
            }
            got_tx.send(()).await.unwrap();
            // Then whatever comes until the stream breaks.
            seen.extend(reader.rest().await);
            seen
        }));
    }
    for _ in 0..CLIENTS {
        got_rx.recv().await.unwrap();
    }
    a.proc.kill9();
    let mut cut = Vec::new();
    for client in clients {
        cut.push(client.await.unwrap());
    }
    assert!(
        cut.iter()
            .all(|seen| seen.last().is_some_and(|e| e.data != "[DONE]")),
        "every stream broke off when its edge died"
    );

    // Each resumes through edge B with the id of the last event it has.
    let url_b = b.url("/v1/chat/completions");
    let mut resumed = Vec::new();
    for seen in &cut {
        let last = seen
            .last()
            .unwrap()
            .id
            .clone()
            .expect("the event has an id");
        let url = url_b.clone();
        resumed.push(tokio::spawn(async move {
            let (status, reader) = Reader::open(&url, Some(&last)).await;
            (status, reader.rest().await)
        }));
    }
    for (seen, rest) in cut.iter().zip(resumed) {
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

    // An id this fleet did not give is a new request; one for an answer the node does not
    // have is refused in the API's error shape.
    let (status, reader) = Reader::open(&url_b, Some("42")).await;
    assert_eq!(status, 200);
    assert_eq!(tokens(&reader.rest().await), reference);
    let unknown = format!("n1.{}.3", "0".repeat(32));
    let response = client()
        .post(&url_b)
        .header("last-event-id", unknown)
        .json(&body())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    let error: Value = response.json().await.unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cannot be resumed"),
        "{error}"
    );
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
