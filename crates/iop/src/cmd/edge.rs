//! `iop edge`: loads the edge config, listens for nodes and HTTP clients, runs until
//! SIGINT / SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;

use iop_edge::{EdgeConfig, EdgeServer};

use super::{EXIT_CONFIG, Failure};

#[derive(Debug, clap::Args)]
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
}

pub async fn run(args: Args) -> super::Result {
    let mut config =
        EdgeConfig::load(&args.config).map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
    if let Some(addr) = args.listen_nodes {
        config.listen.nodes = addr;
    }
    if let Some(addr) = args.listen_http {
        config.listen.http = addr;
    }
    let shutdown = crate::signals::shutdown_on_signal();
    let nodes = config.nodes.len();
    let groups = config.model_groups.len();
    let server = EdgeServer::start(config).await?;
    println!(
        "iop edge listening: nodes={} http={} ({nodes} nodes, {groups} model groups configured)",
        server.node_addr, server.http_addr
    );
    shutdown.cancelled().await;
    server.shutdown().await;
    Ok(())
}
