//! `iop edge`: loads the edge config, listens for nodes and HTTP clients, reloads the
//! config on SIGHUP, runs until SIGINT / SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;

use iop_edge::{EdgeConfig, EdgeServer};
use tokio::signal::unix::{SignalKind, signal};

use super::{EXIT_CONFIG, Failure};

#[derive(Debug, clap::Args)]
#[command(after_help = "\
SIGHUP re-reads the config file and applies it without dropping connections (listen
addresses, max_frame_bytes, limits.max_body_bytes and limits.http's timeouts and connection
cap need a restart). Without auth.keys the edge serves loopback only unless the config says
auth.allow_anonymous: true. configs/edge.yaml documents every field.")]
pub struct Args {
    /// Edge config file (nodes, tokens, providers, model groups).
    #[arg(long, short, default_value = "configs/edge.yaml")]
    config: PathBuf,
    /// Listen for nodes here instead of the config's `listen.nodes`.
    #[arg(long, value_name = "ADDR")]
    listen_nodes: Option<SocketAddr>,
    /// Serve HTTP here instead of the config's `listen.http`.
    #[arg(long, value_name = "ADDR")]
    listen_http: Option<SocketAddr>,
    #[command(flatten)]
    pub runtime: crate::runtime::ThreadsArg,
}

impl Args {
    /// The config file with the command line's overrides.
    fn load(&self) -> Result<EdgeConfig, iop_edge::config::ConfigError> {
        let mut config = EdgeConfig::load(&self.config)?;
        if let Some(addr) = self.listen_nodes {
            config.listen.nodes = addr;
        }
        if let Some(addr) = self.listen_http {
            config.listen.http = addr;
        }
        config.check_http_exposure().map_err(|(path, message)| {
            iop_edge::config::ConfigError::Invalid {
                file: self.config.display().to_string(),
                path,
                message,
            }
        })?;
        Ok(config)
    }
}

pub async fn run(args: Args) -> super::Result {
    let config = args
        .load()
        .map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
    let shutdown = crate::signals::shutdown_on_signal();
    let mut hangup = signal(SignalKind::hangup())?;
    let nodes = config.nodes.len();
    let groups = config.model_groups.len();
    let server = EdgeServer::start(config).await?;
    println!(
        "iop edge listening: nodes={} http={} ({nodes} nodes, {groups} model groups configured)",
        server.node_addr, server.http_addr
    );
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = hangup.recv() => match args.load() {
                Ok(config) => {
                    let report = server.edge.reload(config);
                    if !report.needs_restart.is_empty() {
                        tracing::warn!(settings = ?report.needs_restart, "these settings change only on restart");
                    }
                }
                Err(err) => tracing::error!(%err, "config reload failed; the running config stays"),
            },
        }
    }
    server.shutdown().await;
    Ok(())
}
