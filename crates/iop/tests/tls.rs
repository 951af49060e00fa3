//! The encrypted, pinned edge–node link with real processes: one-line joining, restarts
//! that keep the pin, refused join tokens, fail-closed pin checks, no plaintext on the
//! wire, live revocation that survives a restart, mTLS with an operator CA, HTTPS with a
//! certificate re-read on SIGHUP, and the demo's join line.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use common::tls::*;
use common::*;
use nix::sys::signal::Signal;
use prost::Message;

const GPU: &str = r#"
nodes:
  - id: gpu
    providers:
      - {id: mock, kind: mock, capacity: {normal: 2}, mock: {tokens: 4, text: "ANSWER-MARKER words here"}}
  - id: tok
    token: static-token-SECRET-1234
    providers:
      - {id: mock, kind: mock, capacity: {normal: 2}, mock: {tokens: 4, text: "ANSWER-MARKER words here"}}
model_groups:
  - {name: m-gpu, members: [{node: gpu, provider: mock}]}
  - {name: m-tok, members: [{node: tok, provider: mock}]}
"#;

async fn exit_code(node: &mut Proc) -> Option<i32> {
    node.wait_exit(Duration::from_secs(20)).await.code()
}

#[tokio::test]
async fn a_node_joins_with_one_line_and_a_restart_of_both_keeps_the_pin() {
    let dir = tempdir();
    let mut edge = start_edge(dir.path(), GPU).await;
    let pin = edge.pin.clone().expect("the edge prints its pin");
    assert!(pin.starts_with("sha256:"), "{pin}");
    let printed = std::process::Command::new(IOP)
        .args([
            "edge",
            "--config",
            edge.config.to_str().unwrap(),
            "--print-pin",
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&printed.stdout).trim(), pin);

    let join = join_token(&edge, "gpu", &[]).await;
    assert!(
        join.contains(&pin),
        "the join string carries the pin: {join}"
    );
    let mut node = start_joining_node("gpu", dir.path(), &join, &[]);
    wait_ready(&edge, "gpu").await;
    let s = status(&edge).await;
    let gpu = node_status(&s, "gpu");
    assert_eq!(gpu["transport"], "tls", "{s}");
    assert_eq!(gpu["credential"], "join_token", "{s}");
    assert!(
        gpu["credential_expires_unix_ms"].as_u64().unwrap() > 0,
        "{s}"
    );
    let (ok, table, stderr) = iop_admin(&edge, &["status"]).await;
    assert!(ok, "{stderr}");
    let row = table
        .lines()
        .find(|l| l.starts_with("gpu") && l.contains("join_token"))
        .unwrap_or_else(|| panic!("no credential row for gpu:\n{table}"));
    assert!(row.contains("tls") && row.contains("in 36"), "{row}");
    let state = state_file(dir.path(), "gpu");
    let mode = std::fs::metadata(&state).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the node's state file is private");
    let (code, body) = chat_completion(&edge, "m-gpu", "hello", serde_json::json!({})).await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("ANSWER-MARKER"), "{body}");
    let ca_key = std::fs::read(dir.path().join("iop-edge-state/ca.key")).unwrap();

    // Restart both: same state directory, same ports.
    node.signal(Signal::SIGTERM);
    assert_eq!(exit_code(&mut node).await, Some(0));
    edge.proc.signal(Signal::SIGTERM);
    edge.proc.wait_exit(Duration::from_secs(10)).await;
    let (nodes, config) = (
        edge.nodes.clone(),
        std::fs::read_to_string(&edge.config).unwrap(),
    );
    drop(edge);
    let edge = start_edge_on(dir.path(), &config, &nodes, "127.0.0.1:0").await;
    assert_eq!(
        edge.pin.as_deref(),
        Some(pin.as_str()),
        "the CA was not regenerated"
    );
    assert_eq!(
        std::fs::read(dir.path().join("iop-edge-state/ca.key")).unwrap(),
        ca_key
    );
    // The same command line again: the join token is spent, the stored credential is used.
    let _node = start_joining_node("gpu", dir.path(), &join, &[]);
    wait_ready(&edge, "gpu").await;
    let s = status(&edge).await;
    assert_eq!(
        node_status(&s, "gpu")["credential"],
        "client_certificate",
        "{s}"
    );
    let (code, body) = chat_completion(&edge, "m-gpu", "hello again", serde_json::json!({})).await;
    assert_eq!(code, 200, "{body}");
}

#[tokio::test]
async fn a_used_up_or_expired_join_token_is_refused_and_the_node_says_why() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), GPU).await;
    let join = join_token(&edge, "gpu", &["--uses", "1"]).await;
    let _first = start_joining_node("first", dir.path(), &join, &[]);
    wait_ready(&edge, "gpu").await;
    let mut second = start_joining_node("second", dir.path(), &join, &[]);
    assert_eq!(exit_code(&mut second).await, Some(2), "{}", second.log());
    assert!(second.has_line("used up"), "{}", second.log());

    let expiring = join_token(&edge, "gpu", &["--ttl", "1s"]).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut late = start_joining_node("late", dir.path(), &expiring, &[]);
    assert_eq!(exit_code(&mut late).await, Some(2), "{}", late.log());
    assert!(late.has_line("expired"), "{}", late.log());
    assert!(
        !state_file(dir.path(), "late").exists(),
        "a refused join leaves no credential"
    );
}

#[tokio::test]
async fn a_wrong_pin_ends_the_node_before_it_sends_anything() {
    let fake = FakeTlsEdge::start().await;
    let dir = tempdir();
    let wrong = TestCa::new("not the impostor").pin();
    // A static token with a pin.
    let config = dir.path().join("node.yaml");
    std::fs::write(
        &config,
        format!(
            "edge: \"{}\"\ntoken: \"static-token-SECRET-1234\"\nedge_pin: \"{wrong}\"\ndb: \"{}\"\nstate_file: \"{}\"\n",
            fake.addr,
            dir.path().join("n.db").display(),
            dir.path().join("n.json").display()
        ),
    )
    .unwrap();
    let mut node = Proc::spawn("pinned", &["node", "--config", config.to_str().unwrap()]);
    assert_eq!(exit_code(&mut node).await, Some(2), "{}", node.log());
    assert!(
        node.has_line("the edge's certificate does not match the pin"),
        "{}",
        node.log()
    );
    // A join string with the wrong pin.
    let join = format!(
        "iop1:{}/{wrong}/0123456789abcdef.JOIN-SECRET-abcdefgh",
        fake.addr
    );
    let mut joiner = start_joining_node("joiner", dir.path(), &join, &[]);
    assert_eq!(exit_code(&mut joiner).await, Some(2), "{}", joiner.log());
    assert!(
        joiner.has_line("does not match the pin"),
        "{}",
        joiner.log()
    );
    assert!(!fake.raw().is_empty(), "the fake edge saw the handshakes");
    assert_eq!(fake.handshakes(), 0, "no handshake completed");
    assert!(fake.app_data().is_empty(), "nothing was sent inside TLS");
    for secret in ["static-token-SECRET-1234", "JOIN-SECRET-abcdefgh"] {
        assert!(
            !contains(&fake.raw(), secret.as_bytes()),
            "{secret} on the wire"
        );
    }
}

#[tokio::test]
async fn a_plaintext_register_request_is_closed_before_a_frame_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempdir();
    let edge = start_edge(dir.path(), GPU).await;
    let envelope: iop_proto::pb::Envelope = iop_proto::pb::RegisterRequest {
        token: "static-token-SECRET-1234".into(),
        ..Default::default()
    }
    .into();
    let body = envelope.encode_to_vec();
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    let mut socket = tokio::net::TcpStream::connect(&edge.nodes).await.unwrap();
    socket.write_all(&frame).await.unwrap();
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), socket.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "the edge closes the connection");
    edge.proc
        .wait_line("TLS handshake failed", Duration::from_secs(5))
        .await;
    let log = edge.proc.log();
    assert!(!log.contains("node registered"), "{log}");
    assert!(!log.contains("registration rejected"), "{log}");
    assert!(!log.contains("first frame"), "{log}");
    let s = status(&edge).await;
    assert_eq!(node_status(&s, "tok")["state"], "offline", "{s}");
}

#[tokio::test]
async fn a_relay_between_node_and_edge_records_no_token_credential_or_prompt() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), GPU).await;
    let relay = RecordingRelay::start(&edge.nodes).await;
    let _tok = start_node(
        "tok",
        dir.path(),
        &relay.addr,
        "static-token-SECRET-1234",
        "",
    );
    let join = join_token(&edge, "gpu", &["--edge", &relay.addr]).await;
    let mut gpu = start_joining_node("gpu", dir.path(), &join, &[]);
    wait_ready(&edge, "tok").await;
    wait_ready(&edge, "gpu").await;
    for model in ["m-tok", "m-gpu"] {
        let (code, body) = chat_completion(
            &edge,
            model,
            "PROMPT-MARKER-42 tell me",
            serde_json::json!({}),
        )
        .await;
        assert_eq!(code, 200, "{body}");
        assert!(body.contains("ANSWER-MARKER"), "{body}");
    }
    // Once more with the credential the join gave (a client certificate).
    gpu.signal(Signal::SIGTERM);
    assert_eq!(exit_code(&mut gpu).await, Some(0));
    let _gpu = start_joining_node("gpu", dir.path(), &join, &[]);
    wait_status(
        &edge,
        Duration::from_secs(20),
        "gpu back with its certificate",
        |s| {
            node_status(s, "gpu")["credential"] == "client_certificate"
                && node_status(s, "gpu")["ready"] == true
        },
    )
    .await;
    let (code, body) = chat_completion(
        &edge,
        "m-gpu",
        "PROMPT-MARKER-42 again",
        serde_json::json!({}),
    )
    .await;
    assert_eq!(code, 200, "{body}");

    let recorded = relay.recorded();
    assert!(recorded.len() > 1000, "the relay carried the traffic");
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state_file(dir.path(), "gpu")).unwrap()).unwrap();
    let cert_pem = state["certificate_pem"].as_str().unwrap();
    let cert_der: Vec<u8> = rustls_pki_types::pem::PemObject::from_pem_slice(cert_pem.as_bytes())
        .map(|c: rustls_pki_types::CertificateDer<'static>| c.to_vec())
        .unwrap();
    let join_secret = join.rsplit('.').next().unwrap();
    let secrets: [(&str, &[u8]); 6] = [
        ("the static token", b"static-token-SECRET-1234"),
        ("the join secret", join_secret.as_bytes()),
        ("the node certificate", &cert_der[cert_der.len() - 64..]),
        ("the prompt", b"PROMPT-MARKER-42"),
        ("the answer", b"ANSWER-MARKER"),
        ("the node id in a frame", b"\"gpu\""),
    ];
    for (what, bytes) in secrets {
        assert!(
            !contains(&recorded, bytes),
            "{what} crossed the relay in clear"
        );
    }
}

#[tokio::test]
async fn revoking_a_node_closes_its_session_at_once_and_survives_an_edge_restart() {
    let dir = tempdir();
    let mut edge = start_edge(dir.path(), GPU).await;
    let join = join_token(&edge, "gpu", &[]).await;
    let mut node = start_joining_node("gpu", dir.path(), &join, &[]);
    wait_ready(&edge, "gpu").await;
    let _tok = start_node(
        "tok",
        dir.path(),
        &edge.nodes,
        "static-token-SECRET-1234",
        "",
    );
    wait_ready(&edge, "tok").await;

    let started = std::time::Instant::now();
    let said = revoke(&edge, "gpu").await;
    assert!(said.contains("closed"), "{said}");
    let took = wait_status(&edge, Duration::from_secs(6), "gpu disconnected", |s| {
        node_status(s, "gpu")["connected"] == false
    })
    .await;
    assert!(took <= Duration::from_secs(6), "took {took:?}");
    assert_eq!(exit_code(&mut node).await, Some(2), "{}", node.log());
    assert!(node.has_line("revoked"), "{}", node.log());
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the node ended promptly"
    );
    // The other node is untouched.
    assert_eq!(node_status(&status(&edge).await, "tok")["ready"], true);

    // Its credential no longer registers.
    let mut again = start_joining_node("gpu", dir.path(), &join, &[]);
    assert_eq!(exit_code(&mut again).await, Some(2), "{}", again.log());
    assert!(again.has_line("revoked"), "{}", again.log());

    // Nor after an edge restart.
    edge.proc.signal(Signal::SIGTERM);
    edge.proc.wait_exit(Duration::from_secs(10)).await;
    let (nodes, config) = (
        edge.nodes.clone(),
        std::fs::read_to_string(&edge.config).unwrap(),
    );
    drop(edge);
    let edge = start_edge_on(dir.path(), &config, &nodes, "127.0.0.1:0").await;
    let mut after = start_joining_node("gpu", dir.path(), &join, &[]);
    assert_eq!(exit_code(&mut after).await, Some(2), "{}", after.log());
    assert!(after.has_line("revoked"), "{}", after.log());
    edge.proc.wait_line("revoked", Duration::from_secs(5)).await;

    // A new join token lets the node back in.
    let rejoin = join_token(&edge, "gpu", &[]).await;
    let _back = start_joining_node("gpu", dir.path(), &rejoin, &[]);
    wait_ready(&edge, "gpu").await;
}

/// Runs `iop <args> --url <edge>` with `key` as `IOP_API_KEY` (none: unset); returns
/// (success, stderr).
async fn iop_with_key(edge: &EdgeProc, args: &[&str], key: Option<&str>) -> (bool, String) {
    let mut command = tokio::process::Command::new(IOP);
    command
        .args(args)
        .args(["--url", &format!("http://{}", edge.http)])
        .env_remove("IOP_API_KEY");
    if let Some(key) = key {
        command.env("IOP_API_KEY", key);
    }
    let out = tokio::time::timeout(Duration::from_secs(20), command.output())
        .await
        .expect("the iop command finishes")
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn join_tokens_and_revocation_take_an_admin_key() {
    let dir = tempdir();
    let config = format!(
        "auth:\n  keys:\n    - {{name: ops, role: admin, key: {TEST_API_KEY}}}\n    - {{name: alice, role: client, key: alice-key-0123456789}}\n{GPU}"
    );
    let edge = start_edge(dir.path(), &config).await;
    for args in [
        &["join-token", "--node", "gpu"][..],
        &["join-token", "--list"][..],
        &["revoke", "gpu"][..],
        &["status"][..],
    ] {
        let (ok, stderr) = iop_with_key(&edge, args, Some("alice-key-0123456789")).await;
        assert!(
            !ok && stderr.contains("403"),
            "{args:?} with a client key: {stderr}"
        );
        let (ok, stderr) = iop_with_key(&edge, args, None).await;
        assert!(
            !ok && stderr.contains("401"),
            "{args:?} without a key: {stderr}"
        );
    }
    // The admin key (from the environment, as an operator would set it) does it all.
    let (ok, stderr) =
        iop_with_key(&edge, &["join-token", "--node", "gpu"], Some(TEST_API_KEY)).await;
    assert!(ok, "{stderr}");
    let join = join_token(&edge, "gpu", &[]).await;
    let _node = start_joining_node("gpu", dir.path(), &join, &[]);
    wait_ready(&edge, "gpu").await;
    let (ok, stderr) = iop_with_key(&edge, &["revoke", "gpu"], Some(TEST_API_KEY)).await;
    assert!(ok, "{stderr}");
    wait_status(&edge, Duration::from_secs(10), "gpu disconnected", |s| {
        node_status(s, "gpu")["connected"] == false
    })
    .await;
}

#[tokio::test]
async fn mtls_with_an_operator_ca_admits_its_certificates_and_refuses_others() {
    let dir = tempdir();
    let ca = TestCa::new("operator CA");
    let (server_cert, server_key) = ca.server_cert(&["iop-edge", "127.0.0.1"]);
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let chain = write("edge.pem", &format!("{server_cert}{}", ca.cert_pem));
    let key = write("edge.key", &server_key);
    let ca_file = write("ca.pem", &ca.cert_pem);
    let (good_cert, good_key) = ca.client_cert("gpu");
    let (good_cert, good_key) = (write("gpu.pem", &good_cert), write("gpu.key", &good_key));
    let other = TestCa::new("someone else's CA");
    let (bad_cert, bad_key) = other.client_cert("gpu");
    let (bad_cert, bad_key) = (write("bad.pem", &bad_cert), write("bad.key", &bad_key));
    let config = format!(
        "node_tls: {{mode: provided, cert: \"{chain}\", key: \"{key}\", client_ca: \"{ca_file}\"}}\n{GPU}"
    );
    let edge = start_edge(dir.path(), &config).await;
    assert_eq!(
        edge.pin.as_deref(),
        Some(ca.pin().as_str()),
        "the pin names the chain's CA"
    );

    let db = |n: &str| dir.path().join(n).display().to_string();
    let good = Proc::spawn(
        "good",
        &[
            "node",
            "--edge",
            &edge.nodes,
            "--edge-ca",
            &ca_file,
            "--client-cert",
            &good_cert,
            "--client-key",
            &good_key,
            "--db",
            &db("good.db"),
            "--state-file",
            &db("good.json"),
        ],
    );
    wait_ready(&edge, "gpu").await;
    let s = status(&edge).await;
    assert_eq!(
        node_status(&s, "gpu")["credential"],
        "client_certificate",
        "{s}"
    );
    drop(good);
    wait_status(&edge, Duration::from_secs(10), "gpu offline", |s| {
        node_status(s, "gpu")["connected"] == false
    })
    .await;

    let mut bad = Proc::spawn(
        "bad",
        &[
            "node",
            "--edge",
            &edge.nodes,
            "--edge-pin",
            &ca.pin(),
            "--client-cert",
            &bad_cert,
            "--client-key",
            &bad_key,
            "--db",
            &db("bad.db"),
            "--state-file",
            &db("bad.json"),
        ],
    );
    assert_eq!(exit_code(&mut bad).await, Some(2), "{}", bad.log());
    assert!(
        bad.has_line("refused this node's client certificate"),
        "{}",
        bad.log()
    );
    edge.proc
        .wait_line("TLS handshake failed", Duration::from_secs(5))
        .await;
    assert_eq!(node_status(&status(&edge).await, "gpu")["connected"], false);
}

/// Fetches `/healthz` over HTTPS trusting only `ca_pem`.
async fn https_healthz(addr: &str, ca_pem: &str) -> Result<u16, String> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .tls_certs_only([reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap()])
        .build()
        .unwrap();
    let port = addr.rsplit(':').next().unwrap();
    client
        .get(format!("https://localhost:{port}/healthz"))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| format!("{e:?}"))
}

#[tokio::test]
async fn https_serves_and_rereads_its_certificate_on_sighup() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempdir();
    let first = TestCa::new("first");
    let second = TestCa::new("second");
    let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
    let (cert, key) = first.server_cert(&["localhost"]);
    write("http.pem", &cert);
    write("http.key", &key);
    let config = format!("http_tls: {{cert: http.pem, key: http.key}}\n{GPU}");
    let edge = start_edge(dir.path(), &config).await;
    assert_eq!(https_healthz(&edge.http, &first.cert_pem).await, Ok(200));
    assert!(https_healthz(&edge.http, &second.cert_pem).await.is_err());

    let (cert, key) = second.server_cert(&["localhost"]);
    write("http.pem", &cert);
    write("http.key", &key);
    edge.proc.signal(Signal::SIGHUP);
    edge.proc
        .wait_line("config reloaded", Duration::from_secs(10))
        .await;
    assert_eq!(https_healthz(&edge.http, &second.cert_pem).await, Ok(200));
    assert!(https_healthz(&edge.http, &first.cert_pem).await.is_err());
}

#[tokio::test]
async fn https_handshakes_hold_a_connection_place_and_end_at_the_header_timeout() {
    use tokio::io::AsyncReadExt;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempdir();
    let ca = TestCa::new("https");
    let (cert, key) = ca.server_cert(&["localhost"]);
    std::fs::write(dir.path().join("http.pem"), cert).unwrap();
    std::fs::write(dir.path().join("http.key"), key).unwrap();
    let config = format!(
        "http_tls: {{cert: http.pem, key: http.key}}\nlimits:\n  http: {{header_timeout_sec: 3, max_connections: 4}}\n{GPU}"
    );
    let edge = start_edge(dir.path(), &config).await;
    // Four connections that never start their TLS handshake take every place...
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(tokio::net::TcpStream::connect(&edge.http).await.unwrap());
    }
    // ...so a fifth is closed at once, while they are still open.
    let mut fifth = tokio::net::TcpStream::connect(&edge.http).await.unwrap();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(10), fifth.read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "a connection over the cap is closed: {read:?}"
    );
    let still_open = silent
        .iter()
        .filter(|s| matches!(s.try_read(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock))
        .count();
    assert_eq!(
        still_open, 4,
        "the handshakes in progress hold their places"
    );
    // The handshakes end at the header timeout (3 s; allowed 15 s), and the places return.
    for mut stream in silent {
        let read = tokio::time::timeout(Duration::from_secs(15), stream.read(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "a silent TLS connection outlived the header timeout: {read:?}"
        );
    }
    assert_eq!(https_healthz(&edge.http, &ca.cert_pem).await, Ok(200));
}

#[tokio::test]
async fn the_demo_prints_a_join_line_that_works() {
    let tmp = tempdir();
    let demo = Proc::spawn_with_env(
        "demo",
        &["demo", "--http", "127.0.0.1:0", "--token-delay-ms", "1"],
        &[("TMPDIR", tmp.path().to_str().unwrap())],
    );
    let api = demo.wait_line("OpenAI API:", Duration::from_secs(20)).await;
    let base = api
        .split_whitespace()
        .last()
        .unwrap()
        .trim_end_matches("/v1")
        .to_string();
    let line = demo
        .wait_line("iop node --join", Duration::from_secs(5))
        .await;
    let args: Vec<String> = line
        .split_whitespace()
        .skip(1)
        .map(|a| a.trim_matches('\'').to_string())
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let _joiner = Proc::spawn("joiner", &args);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let s = get_json(&format!("{base}/admin/status")).await;
        if node_status(&s, "joiner")["ready"] == true {
            assert_eq!(node_status(&s, "demo")["transport"], "tls", "{s}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "joiner never ready: {s}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_ca_rotates_while_nodes_accept_both_pins() {
    let dir = tempdir();
    let edge = start_edge(dir.path(), GPU).await;
    let old_pin = edge.pin.clone().unwrap();
    let join = join_token(&edge, "gpu", &[]).await;
    let mut joined = start_joining_node("gpu", dir.path(), &join, &[]);
    wait_ready(&edge, "gpu").await;

    // The next CA, made beside the running edge (docs/trust.md).
    let next = dir.path().join("next-state");
    let out = std::process::Command::new(IOP)
        .args([
            "edge",
            "--config",
            edge.config.to_str().unwrap(),
            "--state-dir",
        ])
        .arg(&next)
        .arg("--print-pin")
        .output()
        .unwrap();
    let new_pin = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        new_pin.starts_with("sha256:") && new_pin != old_pin,
        "{new_pin}"
    );
    let state = dir.path().join("iop-edge-state");
    std::fs::copy(
        state.join("join-tokens.json"),
        next.join("join-tokens.json"),
    )
    .unwrap();
    std::fs::copy(state.join("ca.pem"), next.join("previous-ca.pem")).unwrap();

    // Nodes learn the new pin besides the old one, then the edge switches.
    joined.signal(Signal::SIGTERM);
    assert_eq!(exit_code(&mut joined).await, Some(0));
    let mut edge = edge;
    edge.proc.signal(Signal::SIGTERM);
    edge.proc.wait_exit(Duration::from_secs(10)).await;
    let (nodes, config) = (
        edge.nodes.clone(),
        std::fs::read_to_string(&edge.config).unwrap(),
    );
    drop(edge);
    let config = format!("state_dir: \"{}\"\n{config}", next.display());
    let edge = start_edge_on(dir.path(), &config, &nodes, "127.0.0.1:0").await;
    assert_eq!(edge.pin.as_deref(), Some(new_pin.as_str()));
    let _joined = start_joining_node("gpu", dir.path(), &join, &["--edge-pin", &new_pin]);
    let _tok = start_node(
        "tok",
        dir.path(),
        &edge.nodes,
        "static-token-SECRET-1234",
        "",
    );
    wait_ready(&edge, "gpu").await;
    wait_ready(&edge, "tok").await;
    let s = status(&edge).await;
    assert_eq!(
        node_status(&s, "gpu")["credential"],
        "client_certificate",
        "the old CA's credential is still accepted: {s}"
    );
}

#[tokio::test]
async fn a_plaintext_link_works_only_when_both_sides_say_insecure() {
    let dir = tempdir();
    let config = r#"
node_tls: {mode: insecure_plaintext}
nodes:
  - id: tok
    token: static-token-SECRET-1234
    providers:
      - {id: mock, kind: mock}
"#;
    let edge = start_edge(dir.path(), config).await;
    assert_eq!(edge.pin, None);
    assert!(edge.proc.has_line("node_tls=insecure_plaintext"));
    let _tok = start_node(
        "tok",
        dir.path(),
        &edge.nodes,
        "static-token-SECRET-1234",
        "",
    );
    wait_ready(&edge, "tok").await;
    assert_eq!(
        node_status(&status(&edge).await, "tok")["transport"],
        "plaintext"
    );
    // A TLS node does not talk to it.
    let mut tls_node = Proc::spawn(
        "tls-node",
        &[
            "node",
            "--edge",
            &edge.nodes,
            "--token",
            "static-token-SECRET-1234",
            "--edge-pin",
            &TestCa::new("x").pin(),
            "--db",
            &dir.path().join("t.db").display().to_string(),
            "--state-file",
            &dir.path().join("t.json").display().to_string(),
            "--config",
            &{
                let p = dir.path().join("t.yaml");
                std::fs::write(&p, "reconnect: {max_attempts: 1, interval_sec: 0.1}\n").unwrap();
                p.display().to_string()
            },
        ],
    );
    assert_ne!(
        exit_code(&mut tls_node).await,
        Some(0),
        "{}",
        tls_node.log()
    );
    assert!(tls_node.has_line("TLS handshake"), "{}", tls_node.log());
}
