//! Passive ejection against a client that chooses its failures: a poison-pill request
//! (one the backend answers 500) sent over and over by one key must not take a provider
//! out of rotation for everyone else; a provider that fails for every key still goes.

use std::time::Duration;

use serde_json::{Value, json};

use crate::common::health::set_faults;
use crate::common::*;

const ALICE: &str = "alice-key-0123456789";
const MALLORY: &str = "mallory-key-012345678";

fn config(mock: &MockProc) -> String {
    let base = mock.openai_base();
    format!(
        r#"
auth:
  keys:
    - {{name: ops, role: admin, key: {TEST_API_KEY}}}
    - {{name: alice, role: client, key: {ALICE}}}
    - {{name: mallory, role: client, key: {MALLORY}}}
health: {{interval_sec: 3600}}
nodes:
  - {{id: n1, token: token-n1-0123456789, providers: [{{id: oa, kind: openai_compat, base_url: "{base}"}}]}}
  - {{id: n2, token: token-n2-0123456789, providers: [{{id: oa, kind: openai_compat, base_url: "{base}"}}]}}
model_groups:
  - {{name: m, members: [{{node: n1, provider: oa}}, {{node: n2, provider: oa}}]}}
"#
    )
}

async fn chat(edge: &EdgeProc, key: &str, prompt: &str) -> u16 {
    client()
        .post(edge.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": prompt}]}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

fn ejected(status: &Value) -> usize {
    ["n1", "n2"]
        .iter()
        .filter(|n| !provider_of(status, n, "oa")["ejected"].is_null())
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_pill_from_one_key_ejects_no_provider_that_serves_others() {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let edge = start_edge(dir.path(), &config(&mock)).await;
    let _n1 = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    let _n2 = start_node("n2", dir.path(), &edge.nodes, "token-n2-0123456789", "");
    wait_ready(&edge, "n1").await;
    wait_ready(&edge, "n2").await;

    // Forty requests the backend answers 500 from one key, while another key is served
    // as usual.
    for i in 0..60 {
        if i % 3 == 2 {
            assert_eq!(chat(&edge, ALICE, "hello").await, 200);
        } else {
            let status = chat(&edge, MALLORY, "mock:fail-500 please").await;
            assert!(status >= 500, "{status}");
        }
    }
    let s = status(&edge).await;
    assert_eq!(ejected(&s), 0, "{s}");
    // Then the same pill alone, twice the streak that would eject a provider failing
    // for everyone: still one key's doing.
    for _ in 0..12 {
        chat(&edge, MALLORY, "mock:fail-500 please").await;
    }
    let s = status(&edge).await;
    assert_eq!(ejected(&s), 0, "{s}");
    assert!(
        edge.proc.has_line("only for one key's requests"),
        "{}",
        edge.proc.log()
    );
    for _ in 0..4 {
        assert_eq!(chat(&edge, ALICE, "hello").await, 200);
    }

    // A backend that fails every key's requests is still taken out (one of two members at
    // most: half the group).
    set_faults(&mock, json!({"requests": true})).await;
    for i in 0..30 {
        let key = if i % 2 == 0 { ALICE } else { MALLORY };
        chat(&edge, key, "hello").await;
    }
    wait_status(&edge, Duration::from_secs(10), "one member ejected", |s| {
        ejected(s) == 1
    })
    .await;
    let s = status(&edge).await;
    assert_eq!(ejected(&s), 1, "never more than half of the group: {s}");
}
