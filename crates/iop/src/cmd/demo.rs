//! `iop demo`: an edge, a node and a mock backend in one process on loopback, with two
//! models — `mock` (the node's built-in mock adapter, rendered by the edge) and
//! `mock-tunnel` (an OpenAI-compatible backend reached through the raw tunnel).
//!
//! The node link is the one users get: TLS under the edge's own CA (kept in a temporary
//! state directory for the demo's life), the node verifying the edge by its pin. The demo
//! prints a join line for a second node, `joiner`, another mock node.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use iop_edge::{EdgeConfig, EdgeServer};
use iop_mock::{MockConfig, MockServer};
use iop_node::config::ReconnectConfig;
use iop_node::store::RunStore;
use iop_node::tls::EdgeVerification;
use iop_node::{EdgeLink, EdgeTarget, NodeRuntime, Security, supervise};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Where the demo's OpenAI-compatible API listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    http: SocketAddr,
    /// Where the demo's edge listens for nodes (another `iop node` may join with the
    /// `--join` line printed at start).
    #[arg(long, default_value = "127.0.0.1:0")]
    nodes: SocketAddr,
    /// Tokens per answer.
    #[arg(long, default_value_t = 16)]
    tokens: u32,
    /// Delay before each token, in milliseconds (so streaming is visible).
    #[arg(long, default_value_t = 25)]
    token_delay_ms: u32,
    #[command(flatten)]
    pub runtime: crate::runtime::ThreadsArg,
}

// Over 100 lines: the demo's script, read top to bottom: a backend, an edge, a node, the
// requests it shows and what it prints between them.
pub async fn run(args: Args) -> super::Result {
    let backend = MockServer::start(
        "127.0.0.1:0".parse().expect("valid address"),
        MockConfig {
            tokens: args.tokens,
            token_delay: Duration::from_millis(args.token_delay_ms as u64),
            reasoning: false,
            ..MockConfig::default()
        },
    )
    .await?;
    let token = uuid_token();
    let state = std::env::temp_dir().join(format!("iop-demo-{}", std::process::id()));
    let _cleanup = RemoveOnDrop(state.clone());
    let yaml = format!(
        r#"
listen: {{nodes: "{nodes}", http: "{http}"}}
state_dir: "{state}"
nodes:
  - id: demo
    token: "{token}"
    providers:
      - id: mock
        kind: mock
        capacity: {{normal: 8, long: 2}}
        mock: {{tokens: {tokens}, token_delay_ms: {delay}}}
      - id: openai-mock
        kind: openai_compat
        base_url: "{base}"
        capacity: {{normal: 8, long: 2}}
  - id: joiner
    providers:
      - id: mock
        kind: mock
        capacity: {{normal: 8, long: 2}}
        mock: {{tokens: {tokens}, token_delay_ms: {delay}}}
model_groups:
  - name: mock
    members: [{{node: demo, provider: mock}}, {{node: joiner, provider: mock}}]
  - name: mock-tunnel
    members: [{{node: demo, provider: openai-mock, model: mock-model}}]
"#,
        nodes = args.nodes,
        http = args.http,
        tokens = args.tokens,
        delay = args.token_delay_ms,
        base = backend.openai_base(),
        state = state.display(),
    );
    let config = EdgeConfig::from_yaml(&yaml, "demo config")?;
    let server = EdgeServer::start(config).await?;
    let pin = server.node_pin.ok_or("the demo edge has no pin")?;
    let (store, store_thread) = RunStore::open("file:iop-demo?mode=memory&cache=shared")?;
    let runtime = NodeRuntime::new(Some(store));
    let shutdown = crate::signals::shutdown_on_signal();
    let node = tokio::spawn(supervise(
        runtime,
        EdgeTarget {
            link: Arc::new(EdgeLink::with_token(
                vec![server.node_addr.to_string()],
                Security::Tls(EdgeVerification::Pins(vec![pin])),
                token.clone(),
            )),
            max_frame_bytes: iop_proto::DEFAULT_MAX_FRAME_BYTES,
            fleet_edge: None,
        },
        ReconnectConfig {
            max_attempts: 0,
            interval_sec: 1.0,
        },
        shutdown.clone(),
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while server.edge.session("demo").is_none() {
        if tokio::time::Instant::now() > deadline {
            return Err("the demo node did not become ready within 10s".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let join = server
        .edge
        .create_join("joiner", Duration::from_secs(3600), 1, Vec::new())
        .await?;
    let http = server.http_addr;
    println!("iop demo is running: edge + node + mock backend, all on loopback.");
    println!("  OpenAI API:   http://{http}/v1");
    println!(
        "  Models:       mock (node's mock adapter), mock-tunnel (OpenAI-compatible backend via the raw tunnel)"
    );
    println!("  Status:       http://{http}/admin/status   Metrics: http://{http}/metrics");
    println!("  Node port:    {} (TLS, pin {pin})", server.node_addr);
    println!("Join a second node (one use, valid 1h):");
    println!(
        "  iop node --join '{}' --state-file {} --db {}",
        join.join,
        state.join("joiner-state.json").display(),
        state.join("joiner.db").display()
    );
    println!("Try:");
    println!(
        "  curl -N http://{http}/v1/chat/completions -H 'content-type: application/json' -d '{{\"model\":\"mock\",\"stream\":true,\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'"
    );
    println!("Press Ctrl-C to stop.");
    shutdown.cancelled().await;
    let _ = node.await;
    server.shutdown().await;
    store_thread.join();
    drop(backend);
    Ok(())
}

/// Removes the demo's state directory when the demo ends.
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn uuid_token() -> String {
    use std::time::{SystemTime, UNIX_EPOCH};
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("demo-{nanos:x}-{}", std::process::id())
}
