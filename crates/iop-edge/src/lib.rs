//! iop Edge: the public side. Accepts node connections (register → ready, heartbeats),
//! admits requests against per-provider capacity with a queue, and serves the
//! OpenAI-compatible API, the native runs API and the admin endpoints over HTTP.
//!
//! It composes the pure crates under the names it uses: the config (`iop-edge-config`,
//! as `config`), the core state machines (`iop-core`: `registry`, `lease`, `queue`,
//! `routing`, `health`, `ejection`, …) and the API codecs (`iop-api`: `canonical`,
//! `surfaces`, `codec`). `service` is the core's async shell, the single authority over
//! node lifecycle and the dispatcher of requests; `transport` and `http` only move bytes to
//! and from it.

// The client APIs' codecs, walled off in their own crate, under the names the edge uses.
pub(crate) use iop_api::{canonical, codec, surfaces};
// The core state machines, walled off in their own crate, under the names the edge uses.
pub use iop_core::routing;
pub(crate) use iop_core::{
    auth, day_tokens, ejection, health, join, key_limits, lease, queue, registry, retry_budget,
    revocation, throttle,
};
pub(crate) mod catalog;
/// The config file's types and validation: a crate of their own, read by every layer.
pub use iop_edge_config as config;
pub(crate) use iop_fleet::{fleet_limits, store};
pub(crate) mod drain;
pub(crate) mod events;
pub mod fdlimit;
pub(crate) mod http;
pub(crate) mod ledger;
pub(crate) mod local_models;
pub(crate) mod metrics;
pub(crate) mod payload;
pub(crate) mod pem;
pub(crate) mod service;
pub(crate) mod session;
pub(crate) mod status;
pub(crate) mod transport;
pub(crate) mod trust;

use std::net::SocketAddr;
use std::sync::Arc;

use iop_proto::trust::Pin;

pub use config::EdgeConfig;
use config::NodeTlsMode;
use http::tls::HttpTls;
pub use service::Edge;
use trust::TrustStore;
use trust::node_tls::NodeListenerTls;

/// Why the edge could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    State(#[from] trust::ca::StateError),
    #[error("{0}")]
    Tls(String),
    #[error("{0}")]
    Ledger(#[from] ledger::LedgerError),
    #[error("{0}")]
    Store(String),
}

/// Opens the state directory and sets up the node listener's TLS as a start would; with
/// a shared store (`store`), the CA is the fleet's and join tokens and revocations are
/// the store's.
pub async fn node_listener_tls(
    config: &EdgeConfig,
    store: Option<Arc<store::Store>>,
) -> Result<(Arc<TrustStore>, Option<NodeListenerTls>), StartError> {
    let state_dir = config.state_dir.as_deref().ok_or_else(|| {
        StartError::Tls(
            "state_dir is not set: the edge needs a directory for its CA and state".into(),
        )
    })?;
    let own_ca = config.node_tls.mode == NodeTlsMode::Auto;
    let trust = match store {
        None => TrustStore::open(state_dir, own_ca)?,
        Some(store) => {
            let ca = if own_ca {
                Some(fleet_ca(config, &store, state_dir).await?)
            } else {
                None
            };
            TrustStore::open_shared(state_dir, ca, store)?
        }
    };
    let trust = Arc::new(trust);
    let tls = NodeListenerTls::build(&config.node_tls, &trust).map_err(StartError::Tls)?;
    Ok((trust, tls))
}

/// The fleet's CA from the store; while the store cannot be reached, the copy in the
/// state directory from an earlier start (a first start needs the store).
async fn fleet_ca(
    config: &EdgeConfig,
    store: &store::Store,
    state_dir: &std::path::Path,
) -> Result<trust::ca::EdgeCa, StartError> {
    let key =
        config.store.secret_key.as_ref().ok_or_else(|| {
            StartError::Store("no store secret key (store.secret_key_file)".into())
        })?;
    let sealer = store::seal::Sealer::new(key);
    match store.client().await {
        Ok(_) => trust::shared::fleet_ca(store, &sealer, state_dir)
            .await
            .map_err(StartError::Store),
        Err(error) => {
            let mirrored = state_dir.join(trust::ca::CA_CERT).exists();
            if !mirrored {
                return Err(StartError::Store(format!(
                    "{error}: a first start in a fleet needs the store, for the fleet's CA"
                )));
            }
            tracing::warn!(%error, "the store does not answer: starting with the fleet CA kept in the state directory; join tokens and revocations wait for the store");
            let (ca, _) = trust::ca::EdgeCa::load_or_create(state_dir)?;
            Ok(ca)
        }
    }
}

/// The pin nodes verify this edge's node listener by (creating the CA on a first start;
/// in a fleet, the fleet's).
pub async fn node_listener_pin(config: &EdgeConfig) -> Result<Option<Pin>, StartError> {
    Ok(node_listener_tls(config, shared_store(config)?)
        .await?
        .1
        .and_then(|tls| tls.pin()))
}

/// The shared store the config names, not connected yet: over TLS when its URL says
/// `sslmode=require` or its host is another machine.
fn shared_store(config: &EdgeConfig) -> Result<Option<Arc<store::Store>>, StartError> {
    let Some(Ok(pg)) = config.store.connect_config() else {
        return Ok(None);
    };
    let tls = match pg.get_ssl_mode() {
        tokio_postgres::config::SslMode::Require => Some(
            store::tls::MakeRustls::new(store_ca(config)?)
                .map_err(|e| StartError::Store(e.to_string()))?,
        ),
        _ => None,
    };
    Ok(Some(store::Store::new(pg, tls)))
}

/// The certificates of `store.ca_file`, if one is given.
fn store_ca(
    config: &EdgeConfig,
) -> Result<Option<Vec<rustls_pki_types::CertificateDer<'static>>>, StartError> {
    let Some(path) = config.store.ca_file.as_deref() else {
        return Ok(None);
    };
    pem::load_pem_certs(path)
        .map(Some)
        .map_err(|e| StartError::Store(format!("store.ca_file {e}")))
}

/// Renews the node listener's server certificate while the edge runs (auto mode).
async fn renew_server_certificate(
    tls: Arc<NodeListenerTls>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let period = trust::node_tls::RENEW_CHECK;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {
                if let Err(err) = tls.renew_if_due(std::time::SystemTime::now()) {
                    tracing::error!(%err, "could not renew the node listener's server certificate; retrying later");
                }
            }
        }
    }
}

/// How long a shutdown waits for open responses before closing them.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a shutdown waits for the usage ledger to commit what is queued.
pub const LEDGER_CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// A started edge: its bound addresses and the tasks serving them.
pub struct EdgeServer {
    pub edge: Arc<Edge>,
    pub node_addr: SocketAddr,
    pub http_addr: SocketAddr,
    /// How the node listener is secured, and the pin nodes verify it by.
    pub node_tls: NodeTlsMode,
    pub node_pin: Option<Pin>,
    http_tls: Option<Arc<HttpTls>>,
    tasks: tokio::task::JoinSet<()>,
}

/// Binds `addr` for `what` with a deep accept queue: a full pool of unauthenticated node
/// connections leaves newcomers waiting there, in arrival order (`transport::gate`).
fn listen(addr: SocketAddr, what: &str) -> std::io::Result<tokio::net::TcpListener> {
    http::server::bind(addr).map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot listen for {what} on {addr}: {e}"))
    })
}

/// The usage ledger in the state directory, or none (`ledger.enabled: false`, or no state
/// directory).
fn open_ledger(config: &EdgeConfig) -> Result<ledger::Ledger, StartError> {
    match (&config.state_dir, config.ledger.enabled) {
        (Some(dir), true) => {
            let ledger = ledger::Ledger::open(dir, config.ledger.retention_days)?;
            tracing::info!(path = %dir.join(ledger::store::FILE_NAME).display(), retention_days = config.ledger.retention_days, "usage ledger open");
            Ok(ledger)
        }
        _ => {
            tracing::info!("usage ledger off (ledger.enabled: false)");
            Ok(ledger::Ledger::disabled())
        }
    }
}

/// Makes `edge` one of the fleet on `store`: its record and the fleet's live edges, the
/// ledger's shipping, the key limits counted across edges, and revocations learnt from
/// the others. `addrs`: its HTTP and node addresses.
async fn join_fleet(
    edge: &Arc<Edge>,
    store: Arc<store::Store>,
    trust: &Arc<TrustStore>,
    (http_addr, node_addr): (SocketAddr, SocketAddr),
    tasks: &mut tokio::task::JoinSet<()>,
) {
    let fleet = Arc::new(store::edges::Fleet::default());
    let _ = edge.fleet.set(fleet.clone());
    let me = store::edges::EdgeRecord::this_edge(
        edge.config().store.edge_id.clone(),
        edge.config().store.node_address.clone(),
        http_addr,
        node_addr,
    );
    if let Some(reader) = edge.telemetry.ledger().reader() {
        tasks.spawn(ledger::ship::run(
            reader,
            store.clone(),
            me.id.clone(),
            edge.shutdown_token().clone(),
        ));
    }
    let limits = fleet_limits::FleetLimits::new(store.clone(), me.id.clone(), fleet.clone());
    // Normally at once; else the task keeps trying and each edge keeps its share.
    let _ = limits.forget_earlier_run().await;
    edge.keys.share_with(limits.clone());
    tasks.spawn(limits.run(edge.shutdown_token().clone()));
    let (linked_edge, announcing_edge) = (edge.clone(), edge.clone());
    tasks.spawn(store::edges::run(
        store.clone(),
        me,
        move || linked_edge.nodes.ready_node_ids(),
        move |edges| announcing_edge.announce_fleet(edges),
        fleet,
        edge.shutdown_token().clone(),
    ));
    let (learning_edge, learning_trust) = (edge.clone(), trust.clone());
    tasks.spawn(store::trust::follow_revocations(
        store,
        move |records| {
            let news = learning_trust.learn_revocations(records);
            learning_edge.revoked_elsewhere(&news);
        },
        edge.shutdown_token().clone(),
    ));
}

impl EdgeServer {
    /// Opens the state directory, sets up TLS, binds both listeners (from the config) and
    /// starts serving. Refuses a non-loopback HTTP address without API keys unless the
    /// config allows anonymous access, and raises the process's soft open-files limit to
    /// its hard limit.
    pub async fn start(config: EdgeConfig) -> Result<Self, StartError> {
        config
            .check_http_exposure()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        match fdlimit::raise_open_files_limit() {
            Ok(limit) => tracing::info!(open_files = limit, "open-files limit"),
            Err(err) => tracing::warn!(%err, "cannot raise the open-files limit"),
        }
        let shared = shared_store(&config)?;
        let (trust, node_tls) = node_listener_tls(&config, shared.clone()).await?;
        let http_tls = match &config.http_tls {
            Some(tls) => Some(Arc::new(HttpTls::load(tls).map_err(StartError::Tls)?)),
            None => None,
        };
        let nodes = listen(config.listen.nodes, "nodes")?;
        let http = listen(config.listen.http, "HTTP")?;
        let node_addr = nodes.local_addr()?;
        let http_addr = http.local_addr()?;
        let mode = config.node_tls.mode;
        let node_pin = node_tls.as_ref().and_then(NodeListenerTls::pin);
        if mode == NodeTlsMode::InsecurePlaintext && !node_addr.ip().is_loopback() {
            tracing::warn!(nodes = %node_addr, "node_tls.mode is insecure_plaintext on a non-loopback address: node tokens, prompts and answers cross the network unencrypted and anyone on the path can take a node's identity");
        }
        let ledger = open_ledger(&config)?;
        let edge = Edge::with_ledger(config, Some(trust.clone()), ledger);
        let (written, dropped) = edge.telemetry.ledger().counters();
        edge.telemetry.metrics.register_ledger(written, dropped);
        edge.nodes.set_listener(node_addr);
        let mut tasks = tokio::task::JoinSet::new();
        let node_tls = node_tls.map(Arc::new);
        if let Some(tls) = node_tls.clone() {
            tasks.spawn(renew_server_certificate(tls, edge.shutdown_token().clone()));
        }
        tasks.spawn(transport::serve_nodes(edge.clone(), nodes, node_tls));
        let http_edge = edge.clone();
        let http_tls_task = http_tls.clone();
        tasks.spawn(async move {
            if let Err(err) = http::serve_http(http_edge, http, http_tls_task).await {
                tracing::error!(%err, "HTTP server failed");
            }
        });
        edge.tasks()
            .spawn(http::auth::summarize_failures(edge.clone()));
        edge.tasks()
            .spawn(service::permits::report_demand(edge.clone()));
        edge.tasks()
            .spawn(service::models::refresh_local_models(edge.clone()));
        if let Some(store) = shared {
            join_fleet(&edge, store, &trust, (http_addr, node_addr), &mut tasks).await;
        }
        tracing::info!(nodes = %node_addr, http = %http_addr, node_tls = mode.as_str(), pin = %node_pin.as_ref().map_or("none".to_string(), ToString::to_string), https = http_tls.is_some(), "edge listening");
        Ok(Self {
            edge,
            node_addr,
            http_addr,
            node_tls: mode,
            node_pin,
            http_tls,
            tasks,
        })
    }

    /// Whether the HTTP listener speaks TLS.
    pub fn https(&self) -> bool {
        self.http_tls.is_some()
    }

    /// Re-reads the HTTP certificate and key (SIGHUP); on failure the running ones stay.
    pub fn reload_http_tls(&self, config: &EdgeConfig) -> Result<(), String> {
        match (&self.http_tls, &config.http_tls) {
            (Some(tls), Some(files)) => tls.reload(files),
            _ => Ok(()),
        }
    }

    /// Drains the edge before a stop: from now on `/readyz` answers 503 and responses close
    /// their connections; in a fleet the edge leaves the list of live edges. New client
    /// requests are served for `shutdown.accept_grace_sec` more, then refused, while those
    /// in progress run on — until the last one ends, `shutdown.grace_sec` passes, or
    /// `stop_now` resolves (a second signal).
    pub async fn drain(&self, stop_now: impl std::future::Future<Output = ()>) {
        let shutdown = self.edge.config().shutdown;
        let grace = shutdown.grace();
        self.edge.drain.begin();
        if let Some(fleet) = self.edge.fleet.get() {
            fleet.retire(std::time::Duration::from_secs(3)).await;
        }
        let accept_grace = shutdown.accept_grace();
        tokio::pin!(stop_now);
        if !accept_grace.is_zero() {
            tracing::info!(
                accept_grace_sec = accept_grace.as_secs(),
                "draining: /readyz answers 503; still serving new requests meanwhile (shutdown.accept_grace_sec)"
            );
            tokio::select! {
                _ = tokio::time::sleep(accept_grace) => {}
                _ = &mut stop_now => {
                    self.edge.drain.refuse();
                    return;
                }
            }
        }
        self.edge.drain.refuse();
        let in_progress = self.edge.drain.in_progress();
        if in_progress == 0 || grace.is_zero() {
            return;
        }
        tracing::info!(
            requests = in_progress,
            grace_sec = grace.as_secs(),
            "draining: refusing new requests, waiting for those in progress (a second SIGINT or SIGTERM stops at once)"
        );
        tokio::select! {
            _ = self.edge.drain.until_idle() => tracing::info!("drained: no request in progress"),
            _ = tokio::time::sleep(grace) => tracing::warn!(
                requests = self.edge.drain.in_progress(),
                "requests still in progress after {}s (shutdown.grace_sec): closing them",
                grace.as_secs()
            ),
            _ = &mut stop_now => tracing::warn!(
                requests = self.edge.drain.in_progress(),
                "stopping at once (second signal): closing the requests in progress"
            ),
        }
    }

    /// Stops accepting, closes node connections and waits (a bounded time) for the servers
    /// and the responses still streaming to finish.
    pub async fn shutdown(mut self) {
        self.edge.shutdown_token().cancel();
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                "responses still open after {}s: closing them",
                SHUTDOWN_GRACE.as_secs()
            );
            self.tasks.abort_all();
            while self.tasks.join_next().await.is_some() {}
        }
        self.edge.tasks().close();
        let _ =
            tokio::time::timeout(std::time::Duration::from_secs(2), self.edge.tasks().wait()).await;
        // Every response has ended (or was closed): their records are queued.
        self.edge.telemetry.ledger().close(LEDGER_CLOSE_GRACE).await;
    }

    /// Waits until the servers stop (after a shutdown elsewhere, or a failure).
    pub async fn wait(&mut self) {
        while self.tasks.join_next().await.is_some() {}
    }
}
