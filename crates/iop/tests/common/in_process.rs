//! An edge, a node and a mock backend in the test's own process, on loopback: the
//! daemons' libraries composed as `iop demo` composes them (TLS node link under the edge's
//! own CA, the node verifying it by its pin), for behavioural tests that need no process
//! of their own. Starting one takes milliseconds; every wait is for an event (the node's
//! session appearing or going), bounded.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use iop_edge::{EdgeConfig, EdgeServer};
use iop_mock::{MockConfig, MockServer};
use iop_node::config::ReconnectConfig;
use iop_node::store::{RunStore, StoreThread};
use iop_node::tls::EdgeVerification;
use iop_node::{EdgeLink, EdgeTarget, NodeRuntime, Security, supervise};
use tokio_util::sync::CancellationToken;

/// The node every in-process fabric runs, and its token.
pub const NODE: &str = "n1";
const TOKEN: &str = "in-process-node-token-0123456789";

/// What the backend and the groups look like.
pub struct Fabric {
    /// The mock provider's capacity in the normal lane.
    pub capacity: u32,
    /// Whether `tunnel` waits this long for its member to come back.
    pub wait_for_reconnect_sec: u32,
    /// How long a request may wait in `tunnel`'s queue (`None`: the default).
    pub queue_timeout_sec: Option<u32>,
    /// More of the edge's config (top-level YAML, e.g. a `limits:` section).
    pub edge_yaml: String,
    /// The backend's answers.
    pub backend: MockConfig,
}

impl Default for Fabric {
    fn default() -> Self {
        Self {
            capacity: 4,
            wait_for_reconnect_sec: 0,
            queue_timeout_sec: None,
            edge_yaml: String::new(),
            backend: MockConfig {
                tokens: 4,
                token_delay: Duration::ZERO,
                ..MockConfig::default()
            },
        }
    }
}

/// A running edge + node + backend. Two groups: `tunnel` (the backend through the raw
/// tunnel) and `mock` (the node's built-in mock adapter, a run rendered by the edge).
pub struct InProcess {
    pub edge: EdgeServer,
    pub backend: MockServer,
    node: Option<RunningNode>,
    pin: iop_proto::trust::Pin,
    store: Option<(Arc<NodeRuntime>, StoreThread)>,
    _state: tempfile::TempDir,
}

struct RunningNode {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), iop_node::NodeExit>>,
}

impl InProcess {
    pub async fn start(fabric: Fabric) -> InProcess {
        let backend = MockServer::start("127.0.0.1:0".parse().unwrap(), fabric.backend)
            .await
            .expect("mock backend");
        let state = tempfile::tempdir().expect("state dir");
        let yaml = format!(
            r#"
listen: {{nodes: "127.0.0.1:0", http: "127.0.0.1:0"}}
state_dir: "{state}"
nodes:
  - id: {NODE}
    token: "{TOKEN}"
    providers:
      - id: backend
        kind: openai_compat
        base_url: "{base}"
        capacity: {{normal: {capacity}, long: 1}}
      - id: mock
        kind: mock
        capacity: {{normal: {capacity}, long: 1}}
        mock: {{tokens: 4, token_delay_ms: 0}}
model_groups:
  - name: tunnel
    members: [{{node: {NODE}, provider: backend, model: mock-model}}]
    queue: {{wait_for_reconnect_sec: {wait}{timeout}}}
  - name: mock
    members: [{{node: {NODE}, provider: mock}}]
{extra}
"#,
            state = state.path().display(),
            base = backend.openai_base(),
            capacity = fabric.capacity,
            wait = fabric.wait_for_reconnect_sec,
            timeout = fabric
                .queue_timeout_sec
                .map(|t| format!(", timeout_sec: {t}"))
                .unwrap_or_default(),
            extra = fabric.edge_yaml,
        );
        let config = EdgeConfig::from_yaml(&yaml, "in-process config").expect("config");
        let edge = EdgeServer::start(config).await.expect("edge starts");
        let pin = edge.node_pin.expect("the edge has a pin");
        // A shared in-memory database of its own (tests run side by side in one process).
        let db = format!(
            "file:iop-in-process-{}?mode=memory&cache=shared",
            state.path().file_name().unwrap().to_string_lossy()
        );
        let (store, store_thread) = RunStore::open(&db).expect("run store");
        let runtime = NodeRuntime::new(Some(store));
        let mut fabric = InProcess {
            edge,
            backend,
            node: None,
            pin,
            store: Some((runtime, store_thread)),
            _state: state,
        };
        fabric.start_node().await;
        fabric
    }

    /// The HTTP API's root, `http://addr`.
    pub fn http(&self) -> String {
        format!("http://{}", self.edge.http_addr)
    }

    pub fn http_addr(&self) -> SocketAddr {
        self.edge.http_addr
    }

    /// Starts the node (again) and waits until the edge holds its session.
    pub async fn start_node(&mut self) {
        assert!(self.node.is_none(), "the node runs already");
        let runtime = self.store.as_ref().expect("not stopped").0.clone();
        let stop = CancellationToken::new();
        let task = tokio::spawn(supervise(
            runtime,
            EdgeTarget {
                link: Arc::new(EdgeLink::with_token(
                    vec![self.edge.node_addr.to_string()],
                    Security::Tls(EdgeVerification::Pins(vec![self.pin])),
                    TOKEN.to_string(),
                )),
                max_frame_bytes: iop_proto::DEFAULT_MAX_FRAME_BYTES,
                fleet_edge: None,
            },
            ReconnectConfig {
                max_attempts: 0,
                interval_sec: 0.1,
            },
            stop.clone(),
        ));
        self.node = Some(RunningNode { stop, task });
        self.until(|edge| edge.session(NODE).is_some(), "the node's session")
            .await;
    }

    /// Stops the node (its connection closes) and waits until the edge saw it go.
    pub async fn stop_node(&mut self) {
        let node = self.node.take().expect("the node runs");
        node.stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(30), node.task)
            .await
            .expect("the node stops");
        self.until(
            |edge| edge.session(NODE).is_none(),
            "the node's session to end",
        )
        .await;
    }

    /// Waits (at most 30 s, a bound far above what it takes) until `ready` holds of the
    /// edge; polls every 5 ms.
    pub async fn until(&self, ready: impl Fn(&iop_edge::Edge) -> bool, what: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !ready(&self.edge.edge) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "waited 30 s for {what}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stops the node, the edge and the backend.
    pub async fn stop(mut self) {
        if let Some(node) = self.node.take() {
            node.stop.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(30), node.task).await;
        }
        self.edge.shutdown().await;
        if let Some((runtime, thread)) = self.store.take() {
            drop(runtime);
            thread.join();
        }
    }
}
