//! iop Edge: the public side. Accepts node connections (register → ready, heartbeats),
//! admits requests against per-provider capacity with a queue, and serves the
//! OpenAI-compatible API, the native runs API and the admin endpoints over HTTP.
//!
//! Pure state machines (`registry`, `lease`, `queue`, `retry_budget`) hold no I/O;
//! `service` is their async shell, the single authority over node lifecycle and the
//! dispatcher of requests; `transport` and `http` only move bytes to and from it.

pub mod auth;
pub mod config;
pub mod events;
pub mod fdlimit;
pub mod http;
pub mod lease;
pub mod metrics;
pub mod payload;
pub mod queue;
pub mod registry;
pub mod retry_budget;
pub mod service;
pub mod session;
pub mod status;
pub mod throttle;
pub mod transport;

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;

pub use config::EdgeConfig;
pub use service::Edge;

/// How long a shutdown waits for open responses before closing them.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// A started edge: its bound addresses and the tasks serving them.
pub struct EdgeServer {
    pub edge: Arc<Edge>,
    pub node_addr: SocketAddr,
    pub http_addr: SocketAddr,
    tasks: tokio::task::JoinSet<()>,
}

impl EdgeServer {
    /// Binds both listeners (from the config) and starts serving. Refuses a non-loopback
    /// HTTP address without API keys unless the config allows anonymous access, and
    /// raises the process's soft open-files limit to its hard limit.
    pub async fn start(config: EdgeConfig) -> std::io::Result<Self> {
        config.check_http_exposure().map_err(|(path, message)| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{path}: {message}"),
            )
        })?;
        match fdlimit::raise_open_files_limit() {
            Ok(limit) => tracing::info!(open_files = limit, "open-files limit"),
            Err(err) => tracing::warn!(%err, "cannot raise the open-files limit"),
        }
        let nodes = TcpListener::bind(config.listen.nodes).await.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot listen for nodes on {}: {e}", config.listen.nodes),
            )
        })?;
        let http = http::server::bind(config.listen.http).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot listen for HTTP on {}: {e}", config.listen.http),
            )
        })?;
        let node_addr = nodes.local_addr()?;
        let http_addr = http.local_addr()?;
        let edge = Edge::new(config);
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(transport::serve_nodes(edge.clone(), nodes));
        let http_edge = edge.clone();
        tasks.spawn(async move {
            if let Err(err) = http::serve_http(http_edge, http).await {
                tracing::error!(%err, "HTTP server failed");
            }
        });
        edge.tasks()
            .spawn(http::auth::summarize_failures(edge.clone()));
        tracing::info!(nodes = %node_addr, http = %http_addr, "edge listening");
        Ok(Self {
            edge,
            node_addr,
            http_addr,
            tasks,
        })
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
    }

    /// Waits until the servers stop (after a shutdown elsewhere, or a failure).
    pub async fn wait(&mut self) {
        while self.tasks.join_next().await.is_some() {}
    }
}
