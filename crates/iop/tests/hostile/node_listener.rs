//! The node listener and what nodes send, attacked over the TLS the listener speaks by
//! default: anonymous peers announcing huge frames after a TLS handshake, idling before or
//! after one, or guessing tokens, join tokens and client certificates; a peer that
//! registers and never becomes ready; a node relaying impossible heads or flooding a
//! stream; a provider that dies mid-event.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use iop_proto::pb::{self, envelope::Message, provider_tunnel_frame::Frame};
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use iop_proto::Outbound;

use crate::common::node_wire::{
    FakeNode, RssPeak, connect_from, header, register_once, tls_connect_from,
};
use crate::common::tls::{TestCa, raw_tls_handshake_with_cert};
use crate::common::*;

const TOKEN: &str = "token-n1-0123456789";
const MIB: u64 = 1024 * 1024;

/// The value of one metric series in a Prometheus text exposition (0 when absent).
fn metric(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0)
}

async fn refusals(edge: &EdgeProc, reason: &str) -> u64 {
    let text = get_text(&edge.url("/metrics")).await;
    metric(
        &text,
        &format!("iop_node_connections_refused_total{{reason=\"{reason}\"}}"),
    )
}

/// Reads until the peer closes the connection; false if it is still open after `within`.
async fn closed_by_peer(stream: &mut (impl AsyncRead + Unpin), within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => continue,
            }
        }
    })
    .await
    .is_ok()
}

/// Completes a TLS handshake, announces a 16 MiB frame as the first thing on the
/// connection, sends up to 1 MiB of it, and returns whether the edge closed the connection.
async fn announce_huge_frame(addr: String) -> bool {
    let Ok(mut stream) = tls_connect_from("127.0.0.1", &addr).await else {
        return false;
    };
    let chunk = vec![0u8; 64 * 1024];
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        if stream
            .write_all(&(16u32 << 20).to_be_bytes())
            .await
            .is_err()
        {
            return;
        }
        for _ in 0..16 {
            if stream.write_all(&chunk).await.is_err() || stream.flush().await.is_err() {
                return;
            }
        }
    })
    .await;
    closed_by_peer(&mut stream, Duration::from_secs(15)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_huge_first_frames_cost_no_memory_and_real_traffic_goes_on() {
    let dir = tempdir();
    // Caps high enough that every attacker gets in and completes its TLS handshake: the
    // first-frame cap alone must hold.
    let config = format!(
        r#"
limits:
  nodes: {{max_unauthenticated: 1000, max_unauthenticated_per_address: 1000}}
nodes:
  - id: n1
    token: {TOKEN}
    providers:
      - {{id: mock, kind: mock, mock: {{tokens: 100, token_delay_ms: 20}}}}
model_groups:
  - {{name: m, members: [{{node: n1, provider: mock}}]}}
"#
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, TOKEN, "");
    wait_ready(&edge, "n1").await;
    let (status, _) = chat_completion(&edge, "m", "warm up", json!({})).await;
    assert_eq!(status, 200);
    let baseline = crate::common::node_wire::rss_bytes(edge.proc.pid());
    let peak = RssPeak::start(edge.proc.pid());

    let mut stream = client()
        .post(edge.url("/v1/chat/completions"))
        .json(
            &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let mut attackers = tokio::task::JoinSet::new();
    for _ in 0..200 {
        attackers.spawn(announce_huge_frame(edge.nodes.clone()));
    }
    let mut closed = 0;
    while let Some(result) = attackers.join_next().await {
        closed += result.unwrap() as u32;
    }
    assert_eq!(
        closed, 200,
        "every attacker connection is closed by the edge"
    );
    let mut seen = String::new();
    read_to_end(&mut stream, &mut seen, Duration::from_secs(20)).await;
    assert!(
        seen.trim_end().ends_with("data: [DONE]"),
        "the concurrent stream completes: {seen}"
    );

    let grew = peak.peak().saturating_sub(baseline);
    assert!(grew < 64 * MIB, "edge RSS grew by {} MiB", grew / MIB);
    let s = status_of(&edge).await;
    assert_eq!(node_status(&s, "n1")["ready"], true, "{s}");
    assert!(
        !edge.proc.has_line("node disconnected"),
        "{}",
        edge.proc.log()
    );
    assert_eq!(refusals(&edge, "oversized_first_frame").await, 200);
    assert_eq!(refusals(&edge, "tls_handshake_failed").await, 0);
    let lines = edge
        .proc
        .log()
        .lines()
        .filter(|l| l.contains("first frame"))
        .count();
    assert!(lines < 5, "{lines} log lines about bad first frames");
}

async fn status_of(edge: &EdgeProc) -> Value {
    crate::common::status(edge).await
}

#[tokio::test]
async fn unregistered_connections_are_capped_a_full_pool_displaces_silent_ones_first_and_idlers_time_out()
 {
    let dir = tempdir();
    let config = format!(
        r#"
limits:
  nodes: {{tls_handshake_timeout_sec: 2, register_timeout_sec: 5, max_unauthenticated: 24, max_unauthenticated_per_address: 16, summary_interval_sec: 1}}
nodes:
  - id: n1
    token: {TOKEN}
    providers:
      - {{id: mock, kind: mock}}
"#
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, TOKEN, "");
    wait_ready(&edge, "n1").await;

    // 20 connections from one address that finish their TLS handshake and then say nothing
    // (the pool of 24 has room: all get in), then 20 from another that never send a byte:
    // 4 fill the pool, and each of the 16 more takes the place of the oldest silent one
    // (a silent connection goes first; the handshaken ones keep theirs). Every idler
    // times out in the end: the handshaken at the registration deadline, the silent at
    // the handshake deadline.
    let mut registered_late = Vec::new();
    let mut over_cap = 0;
    for _ in 0..20 {
        match tls_connect_from("127.0.0.3", &edge.nodes).await {
            Ok(stream) => registered_late.push(stream),
            Err(_) => over_cap += 1,
        }
    }
    let mut silent = Vec::new();
    for _ in 0..20 {
        silent.push(connect_from("127.0.0.4", &edge.nodes).await.unwrap());
    }
    let mut closing = tokio::task::JoinSet::new();
    for mut stream in registered_late {
        closing.spawn(async move { closed_by_peer(&mut stream, Duration::from_secs(20)).await });
    }
    for mut stream in silent {
        closing.spawn(async move { closed_by_peer(&mut stream, Duration::from_secs(20)).await });
    }
    while let Some(closed) = closing.join_next().await {
        assert!(closed.unwrap(), "an idle connection was never closed");
    }
    assert_eq!(over_cap, 0, "the pool had room for every handshake");
    assert_eq!(refusals(&edge, "evicted").await, 16);
    assert_eq!(refusals(&edge, "unauthenticated_cap").await, 0);
    assert_eq!(refusals(&edge, "address_cap").await, 0);
    assert_eq!(refusals(&edge, "register_timeout").await, 20);
    assert_eq!(refusals(&edge, "tls_handshake_timeout").await, 4);
    edge.proc
        .wait_line("node listener, last", Duration::from_secs(5))
        .await;
    let log = edge.proc.log();
    let lines = log
        .lines()
        .filter(|l| {
            l.contains("closed at once")
                || l.contains("RegisterRequest within")
                || l.contains("TLS handshake not finished")
        })
        .count();
    // One line for the first of each kind per summary interval, not one per connection.
    assert!(
        lines < 10,
        "{lines} lines about refused connections:\n{log}"
    );
    // The registered node never noticed.
    let s = status_of(&edge).await;
    assert_eq!(node_status(&s, "n1")["ready"], true, "{s}");
}

/// The retry time a THROTTLED answer names, in seconds.
fn retry_after(reason: &str) -> f64 {
    reason
        .split("retry in ")
        .nth(1)
        .and_then(|r| r.trim_end_matches('s').parse().ok())
        .unwrap_or_else(|| panic!("no retry time in {reason:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_bad_tokens_from_one_address_are_throttled_and_summarized() {
    let dir = tempdir();
    let config = format!(
        r#"
limits:
  nodes: {{summary_interval_sec: 5}}
nodes:
  - id: n1
    token: {TOKEN}
    providers:
      - {{id: mock, kind: mock}}
"#
    );
    let edge = start_edge(dir.path(), &config).await;
    let guesser = "127.0.0.2";
    let mut unknown = 0;
    let mut throttled = Vec::new();
    // The retry time of the first throttled answer after each bad token.
    let mut waits_after_failures = Vec::new();
    let mut after_failure = false;
    for i in 0..1000 {
        let token = format!("guess-{i:016}");
        let answer = register_once(guesser, &edge.nodes, &token)
            .await
            .expect("the edge answers every registration");
        assert!(!answer.accepted);
        match answer.reject_reason() {
            pb::RegisterRejectReason::UnknownToken => {
                unknown += 1;
                after_failure = true;
            }
            pb::RegisterRejectReason::Throttled => {
                let wait = retry_after(&answer.reason);
                if std::mem::take(&mut after_failure) {
                    waits_after_failures.push(wait);
                }
                throttled.push(wait);
            }
            other => panic!("unexpected answer {other:?}: {}", answer.reason),
        }
    }
    assert!(unknown >= 1, "the first guess is checked");
    assert!(
        unknown < 20,
        "{unknown} guesses were checked: not throttled"
    );
    assert_eq!(unknown + throttled.len(), 1000);

    // Once the wait is over one more guess is checked, and the next wait is longer.
    let last_wait = throttled.last().copied().unwrap_or(0.0);
    tokio::time::sleep(Duration::from_secs_f64(last_wait + 0.2)).await;
    for _ in 0..50 {
        let answer = register_once(guesser, &edge.nodes, "guess-after-the-wait")
            .await
            .unwrap();
        if answer.reject_reason() == pb::RegisterRejectReason::Throttled {
            waits_after_failures.push(retry_after(&answer.reason));
            break;
        }
    }
    let first = waits_after_failures[0];
    let last = *waits_after_failures.last().unwrap();
    assert!(
        waits_after_failures.len() >= 2 && last > first,
        "the delays grow: {waits_after_failures:?}"
    );

    let summary = edge
        .proc
        .wait_line(
            "from 1 address, most from 127.0.0.2",
            Duration::from_secs(15),
        )
        .await;
    assert!(summary.contains("bad node credential"), "{summary}");
    let log = edge.proc.log();
    let lines = log
        .lines()
        .filter(|l| {
            l.contains("node token")
                || l.contains("node credential")
                || l.contains("registration rejected")
                || l.contains("registration refused")
        })
        .count();
    assert!(lines < 20, "{lines} log lines about bad tokens:\n{log}");
    assert!(refusals(&edge, "throttled").await >= 900);

    // A node on another address is not held back by the guesser.
    let _node = start_node("n1", dir.path(), &edge.nodes, TOKEN, "");
    wait_ready(&edge, "n1").await;
}

/// Sends one RegisterRequest carrying a join token on a fresh TLS connection from
/// `source` and returns the answer.
async fn join_once(source: &str, addr: &str, join_token: &str) -> pb::RegisterResponse {
    join_with(source, addr, join_token, vec![0x30; 16])
        .await
        .expect("the edge answers a join")
}

/// Sends one join (with `csr`, perhaps empty) on a fresh TLS connection from `source`;
/// the edge's answer, if it gave one.
async fn join_with(
    source: &str,
    addr: &str,
    join_token: &str,
    csr: Vec<u8>,
) -> Option<pb::RegisterResponse> {
    let stream = tls_connect_from(source, addr).await.ok()?;
    let (mut reader, outbound, writer) =
        iop_proto::split_stream(stream, iop_proto::DEFAULT_MAX_FRAME_BYTES);
    let writer = tokio::spawn(writer.run());
    let request = pb::RegisterRequest {
        join_token: join_token.to_string(),
        credential_csr: csr,
        node_version: "test".into(),
        hostname: "attacker".into(),
        ..Default::default()
    };
    outbound.send(request).await.ok()?;
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        use futures::StreamExt;
        match reader.next().await {
            Some(Ok(pb::Envelope {
                message: Some(Message::RegisterResponse(r)),
            })) => Some(*r),
            _ => None,
        }
    })
    .await
    .ok()
    .flatten();
    writer.abort();
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guessed_join_tokens_and_untrusted_client_certificates_are_throttled_too() {
    let dir = tempdir();
    let config = format!(
        r#"
limits:
  nodes: {{summary_interval_sec: 5}}
nodes:
  - id: n1
    token: {TOKEN}
    providers:
      - {{id: mock, kind: mock}}
"#
    );
    let edge = start_edge(dir.path(), &config).await;

    // Join-token guesses from one address are refused, then throttled.
    let mut refused = 0;
    let mut throttled = false;
    for i in 0..50 {
        let answer = join_once(
            "127.0.0.5",
            &edge.nodes,
            &format!("{i:016x}.guessed-secret"),
        )
        .await;
        assert!(!answer.accepted);
        match answer.reject_reason() {
            pb::RegisterRejectReason::UnknownToken => refused += 1,
            pb::RegisterRejectReason::Throttled => {
                throttled = true;
                break;
            }
            other => panic!("unexpected answer {other:?}: {}", answer.reason),
        }
    }
    assert!(
        throttled && refused >= 1,
        "join-token guesses were not throttled ({refused} refused)"
    );

    // Client certificates from a CA the edge does not trust fail the handshake and count
    // as bad credentials of their address...
    let stranger = TestCa::new("stranger");
    let (cert, key) = stranger.client_cert("n1");
    let before = refusals(&edge, "bad_credential").await;
    for _ in 0..6 {
        let tcp = connect_from("127.0.0.6", &edge.nodes).await.unwrap();
        // TLS 1.3: the client finishes its side first; the edge refuses afterwards.
        if let Ok(mut tls) = raw_tls_handshake_with_cert(tcp, &cert, &key).await {
            assert!(closed_by_peer(&mut tls, Duration::from_secs(10)).await);
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while refusals(&edge, "bad_credential").await < before + 6 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the refused certificates were not counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // ...so that address now waits even with the right token (6 failures: 8 s).
    let answer = register_once("127.0.0.6", &edge.nodes, TOKEN)
        .await
        .unwrap();
    assert_eq!(
        answer.reject_reason(),
        pb::RegisterRejectReason::Throttled,
        "{}",
        answer.reason
    );
    // Counted in the listener's summary, not a line each.
    edge.proc
        .wait_line("bad node credential", Duration::from_secs(20))
        .await;
    let lines = edge
        .proc
        .log()
        .lines()
        .filter(|l| l.contains("registration rejected") || l.contains("client certificate refused"))
        .count();
    assert!(lines < 6, "{lines} log lines about refused credentials");

    // A node on another address is not held back.
    let _node = start_node("n1", dir.path(), &edge.nodes, TOKEN, "");
    wait_ready(&edge, "n1").await;
}

#[tokio::test]
async fn a_connection_that_registers_and_never_sends_ready_loses_its_claim() {
    let dir = tempdir();
    let config = format!(
        r#"
limits:
  nodes: {{ready_timeout_sec: 1}}
nodes:
  - id: n1
    token: {TOKEN}
    providers:
      - {{id: mock, kind: mock}}
"#
    );
    let edge = start_edge(dir.path(), &config).await;
    // It answers the edge's pings, so only the ready deadline can end it.
    let (mut squatter, answer) = FakeNode::register("127.0.0.1", &edge.nodes, TOKEN).await;
    assert!(answer.accepted, "{}", answer.reason);
    let s = status_of(&edge).await;
    assert_eq!(node_status(&s, "n1")["state"], "registering", "{s}");

    let _node = start_node(
        "n1",
        dir.path(),
        &edge.nodes,
        TOKEN,
        "reconnect: {max_attempts: 0, interval_sec: 0.3}",
    );
    assert!(
        squatter.wait_closed(Duration::from_secs(10)).await,
        "the edge closes a connection that never sends ready"
    );
    edge.proc
        .wait_line(
            "no accepted NodeReadyRequest within 1s",
            Duration::from_secs(5),
        )
        .await;
    wait_ready(&edge, "n1").await;
}

/// What the fake relay node does with a request, chosen by the request's message.
async fn relay(outbound: Outbound, request: pb::ProviderTunnelRequest) {
    let body: Value = serde_json::from_slice(&request.body).unwrap();
    let behaviour = body["messages"][0]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    let json_headers = || {
        Frame::Headers(pb::TunnelHeaders {
            headers: vec![header("content-type", "application/json")],
        })
    };
    let mut frames: Vec<Frame> = match behaviour.as_str() {
        "status-999" => vec![
            Frame::Status(999),
            json_headers(),
            Frame::Body(b"{}".to_vec().into()),
        ],
        "status-101" => vec![
            Frame::Status(101),
            Frame::Headers(pb::TunnelHeaders {
                headers: vec![header("upgrade", "websocket")],
            }),
        ],
        "headers-10000" => vec![
            Frame::Status(200),
            Frame::Headers(pb::TunnelHeaders {
                headers: (0..10_000)
                    .map(|i| header(&format!("x-h-{i}"), "v"))
                    .collect(),
            }),
            Frame::Body(b"{}".to_vec().into()),
        ],
        "flood" => {
            // 64 frames of 2 MiB, without waiting for credit or for the client.
            let mut frames = vec![
                Frame::Status(200),
                Frame::Headers(pb::TunnelHeaders {
                    headers: vec![header("content-type", "application/octet-stream")],
                }),
            ];
            let chunk = bytes::Bytes::from(vec![b'x'; 2 * 1024 * 1024]);
            for _ in 0..64 {
                frames.push(Frame::Body(chunk.clone()));
            }
            frames
        }
        _ => vec![
            Frame::Status(200),
            json_headers(),
            Frame::Body(br#"{"ok":true}"#.to_vec().into()),
        ],
    };
    frames.push(Frame::End(pb::TunnelEnd {}));
    for frame in frames {
        let sent = outbound
            .send(pb::ProviderTunnelFrame {
                request_id: request.request_id.clone(),
                frame: Some(frame),
            })
            .await;
        if sent.is_err() {
            return;
        }
    }
}

/// A fake node serving the `relay` model group; returns the cancels it receives.
async fn fake_relay_node(edge: &EdgeProc) -> Arc<Mutex<Vec<pb::CancelRequest>>> {
    let (mut node, answer) =
        FakeNode::register("127.0.0.1", &edge.nodes, "token-fake-0123456789").await;
    assert!(answer.accepted, "{}", answer.reason);
    node.ready().await;
    let cancels = Arc::new(Mutex::new(Vec::new()));
    let seen = cancels.clone();
    tokio::spawn(async move {
        while let Some(message) = node.next(Duration::from_secs(3600)).await {
            match message {
                Message::ProviderTunnelRequest(request) => {
                    tokio::spawn(relay(node.outbound.clone(), *request));
                }
                Message::CancelRequest(cancel) => seen.lock().unwrap().push(*cancel),
                _ => {}
            }
        }
    });
    cancels
}

fn relay_config(limits: &str) -> String {
    format!(
        r#"
limits:
  nodes: {{{limits}}}
nodes:
  - id: fake
    token: token-fake-0123456789
    providers:
      - {{id: oa, kind: openai_compat, base_url: "http://127.0.0.1:9/v1", capacity: {{normal: 8}}}}
model_groups:
  - {{name: relay, members: [{{node: fake, provider: oa}}]}}
"#
    )
}

#[tokio::test]
async fn impossible_heads_from_a_node_become_502_and_the_tunnel_is_cancelled() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), &relay_config("")).await;
    let cancels = fake_relay_node(&edge).await;
    wait_ready(&edge, "fake").await;
    for (behaviour, says) in [
        ("status-999", "status 999"),
        ("status-101", "status 101"),
        ("headers-10000", "10000 headers"),
    ] {
        let (status, body) = chat_completion(&edge, "relay", behaviour, json!({})).await;
        assert_eq!(status, 502, "{behaviour}: {body}");
        let error: Value = serde_json::from_str(&body).unwrap();
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{behaviour}: {body}");
    }
    let (status, body) = chat_completion(&edge, "relay", "ok", json!({})).await;
    assert_eq!((status, body.as_str()), (200, r#"{"ok":true}"#));
    // The refused tunnels were cancelled on the node.
    wait_for(Duration::from_secs(10), "three tunnel cancels", || {
        cancels.lock().unwrap().len() >= 3
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_overrunning_a_streams_byte_budget_has_that_stream_cut_alone() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), &relay_config("stream_buffer_bytes: 65536")).await;
    let cancels = fake_relay_node(&edge).await;
    wait_ready(&edge, "fake").await;
    let (status, _) = chat_completion(&edge, "relay", "ok", json!({})).await;
    assert_eq!(status, 200);
    let baseline = crate::common::node_wire::rss_bytes(edge.proc.pid());
    let peak = RssPeak::start(edge.proc.pid());

    // A client that takes the head and never reads the body.
    let stalled = client()
        .post(edge.url("/v1/chat/completions"))
        .json(&json!({"model": "relay", "messages": [{"role": "user", "content": "flood"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(stalled.status(), 200);
    wait_for(Duration::from_secs(20), "the flooded stream cut", || {
        cancels
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.reason.contains("byte budget"))
    })
    .await;
    // Another stream on the same node is served.
    let (status, body) = chat_completion(&edge, "relay", "ok", json!({})).await;
    assert_eq!((status, body.as_str()), (200, r#"{"ok":true}"#));
    let grew = peak.peak().saturating_sub(baseline);
    assert!(grew < 64 * MIB, "edge RSS grew by {} MiB", grew / MIB);
    edge.proc
        .wait_line("stream cut", Duration::from_secs(5))
        .await;
    let s = status_of(&edge).await;
    assert_eq!(node_status(&s, "fake")["ready"], true, "{s}");
    drop(stalled);
}

/// Polls `done` until it holds; panics after `within`.
async fn wait_for(within: Duration, what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_torn_provider_event_ends_with_a_well_formed_error_event() {
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let config = format!(
        r#"
nodes:
  - id: n1
    token: {TOKEN}
    providers:
      - {{id: oa, kind: openai_compat, base_url: "{}"}}
model_groups:
  - {{name: torn, members: [{{node: n1, provider: oa, model: torn-mid-stream}}]}}
"#,
        mock.openai_base()
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, TOKEN, "");
    wait_ready(&edge, "n1").await;
    let mut response = client()
        .post(edge.url("/v1/chat/completions"))
        .json(&json!({"model": "torn", "messages": [{"role": "user", "content": "hi"}], "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = String::new();
    read_to_end(&mut response, &mut body, Duration::from_secs(20)).await;
    assert!(
        body.ends_with("\n\n"),
        "the stream ends on an event boundary: {body:?}"
    );
    // The provider's events carry their ids (for resuming); the error event has none.
    assert!(body.contains("\nid: n1."), "{body}");
    let body = without_event_ids(&body);
    let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert!(events.len() >= 2, "{body}");
    for event in &events {
        let data = event
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not one data line: {event:?} in {body:?}"));
        assert!(!data.contains('\n'), "one line per event: {event:?}");
        serde_json::from_str::<Value>(data)
            .unwrap_or_else(|e| panic!("event {event:?} is not JSON ({e}); body: {body:?}"));
    }
    let last: Value = serde_json::from_str(&events.last().unwrap()["data: ".len()..]).unwrap();
    assert!(last["error"]["message"].is_string(), "{last}");
    assert!(
        events[..events.len() - 1]
            .iter()
            .all(|e| e.contains("chat.completion.chunk"))
    );

    if let Some(python) = python_with_openai() {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/python/torn_stream_check.py"
        );
        let out = tokio::time::timeout(
            Duration::from_secs(60),
            tokio::process::Command::new(&python)
                .arg(script)
                .arg(edge.url("/v1"))
                .arg("torn")
                .output(),
        )
        .await
        .expect("the SDK check finishes within 60s")
        .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.trim_end().ends_with("ok"),
            "SDK check failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The Python with the `openai` SDK (`IOP_PYTHON`, else python3), or None when it has no
/// SDK (an error when `IOP_REQUIRE_PYTHON_SDK` is set).
fn python_with_openai() -> Option<String> {
    let python = std::env::var("IOP_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_sdk = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if has_sdk {
        return Some(python);
    }
    assert!(
        std::env::var("IOP_REQUIRE_PYTHON_SDK").is_err(),
        "IOP_REQUIRE_PYTHON_SDK is set but {python} cannot import openai"
    );
    eprintln!("SDK part skipped: {python} has no `openai` package (scripts/test.sh installs it)");
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_joins_without_a_csr_cost_a_few_log_lines() {
    let dir = tempdir();
    let config = format!(
        r#"
limits:
  nodes: {{summary_interval_sec: 5}}
nodes:
  - id: n1
    token: {TOKEN}
    providers:
      - {{id: mock, kind: mock}}
"#
    );
    let edge = start_edge(dir.path(), &config).await;
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let addr = edge.nodes.clone();
        workers.spawn(async move {
            let mut answered = 0;
            for _ in 0..1250 {
                let join = join_with("127.0.0.2", &addr, "iopjoin-0123456789abcdef", Vec::new());
                answered += join.await.is_some() as u32;
            }
            answered
        });
    }
    let mut answered = 0;
    while let Some(n) = workers.join_next().await {
        answered += n.unwrap();
    }
    assert!(answered > 9_000, "only {answered} of 10000 answered");
    // A node elsewhere is not held back.
    let _node = start_node("n1", dir.path(), &edge.nodes, TOKEN, "");
    wait_ready(&edge, "n1").await;
    let log = edge.proc.log();
    let warnings = log.lines().filter(|l| l.contains("WARN")).count();
    assert!(warnings < 20, "{warnings} warnings:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_client_certificate_is_never_held_back_by_its_addresss_guesses() {
    let dir = tempdir();
    let ca = TestCa::new("operator CA");
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let (server_cert, server_key) = ca.server_cert(&["iop-edge", "127.0.0.1"]);
    let chain = write("edge.pem", &format!("{server_cert}{}", ca.cert_pem));
    let key = write("edge.key", &server_key);
    let ca_file = write("ca.pem", &ca.cert_pem);
    let config = format!(
        r#"
node_tls: {{mode: provided, cert: "{chain}", key: "{key}", client_ca: "{ca_file}"}}
nodes:
  - id: gpu
    providers:
      - {{id: mock, kind: mock}}
"#
    );
    let edge = start_edge(dir.path(), &config).await;
    // Someone at the node's address guesses tokens until the address is throttled.
    let mut throttled = false;
    for i in 0..50 {
        let answer = register_once("127.0.0.7", &edge.nodes, &format!("guess-{i:016}"))
            .await
            .unwrap();
        if answer.reject_reason() == pb::RegisterRejectReason::Throttled {
            throttled = true;
            break;
        }
    }
    assert!(throttled, "the guesses were never throttled");
    // The node's certificate, verified by the handshake, gets in from that address at once.
    let (cert, key) = ca.client_cert("gpu");
    let tcp = connect_from("127.0.0.7", &edge.nodes).await.unwrap();
    let tls = raw_tls_handshake_with_cert(tcp, &cert, &key).await.unwrap();
    let (mut reader, outbound, writer) =
        iop_proto::split_stream(tls, iop_proto::DEFAULT_MAX_FRAME_BYTES);
    let writer = tokio::spawn(writer.run());
    outbound
        .send(pb::RegisterRequest {
            node_version: "test".into(),
            hostname: "gpu".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        use futures::StreamExt;
        match reader.next().await {
            Some(Ok(pb::Envelope {
                message: Some(Message::RegisterResponse(r)),
            })) => *r,
            other => panic!("expected a register response, got {other:?}"),
        }
    })
    .await
    .unwrap();
    assert!(answer.accepted, "{}", answer.reason);
    assert_eq!(answer.node_id, "gpu");
    writer.abort();
}
