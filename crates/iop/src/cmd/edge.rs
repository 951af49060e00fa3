//! `iop edge`: loads the edge config, listens for nodes and HTTP clients, reloads the
//! config (and the HTTP certificate) on SIGHUP, runs until SIGINT / SIGTERM. `--print-pin`
//! prints the pin nodes verify the node listener by and exits.

use std::net::SocketAddr;
use std::path::PathBuf;

use iop_edge::{EdgeConfig, EdgeServer};
use tokio::signal::unix::{SignalKind, signal};

use super::{EXIT_CONFIG, Failure};

#[derive(Debug, clap::Args)]
#[command(after_help = "\
The node listener speaks TLS by default: on the first start the edge creates its own CA in
state_dir (default: iop-edge-state beside the config file) and prints its pin; nodes
verify the edge by that pin. Add nodes with `iop join-token --node ID` (prints a join
string for `iop node --join`), remove them with `iop revoke ID`.

SIGHUP re-reads the config file and applies it without dropping connections (listen
addresses, max_frame_bytes, limits.max_body_bytes, limits.http's timeouts and connection
cap, state_dir, node_tls, ledger and store need a restart); it also re-reads the http_tls
certificate and key. Every model-API request is recorded in state_dir/usage.db (the usage
ledger; `iop usage` reads it). SIGTERM or SIGINT drains the edge first: /readyz answers 503
and new requests are refused while those in progress finish, for at most shutdown.grace_sec
(30 s); a second signal stops it at once. Without auth.keys the edge serves loopback only
unless the config says auth.allow_anonymous: true.

Several edges sharing a PostgreSQL store (store.url or IOP_STORE_URL) are one fleet to
nodes: one CA and pin, join tokens and revocations shared, every node linked to every
edge. Give each the same config and the same secret key (store.secret_key_file or
IOP_STORE_SECRET_KEY: base64 of 32 random bytes); docs/ha.md.
configs/edge.yaml documents every field.")]
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
    /// Keep the CA, join tokens and revocations here instead of the config's `state_dir`.
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Print the pin nodes verify this edge by (creating the CA on a first start; in a
    /// fleet, the fleet's) and exit.
    #[arg(long)]
    print_pin: bool,
    /// Check the config (and the command line's overrides), print what would run, and
    /// exit: nothing is bound, created or written (a bad config exits 2 naming the field).
    #[arg(long, conflicts_with = "print_pin")]
    check: bool,
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
        if let Some(dir) = &self.state_dir {
            config.state_dir = Some(dir.clone());
        }
        config.check_http_exposure().map_err(|e| {
            iop_edge::config::ConfigError::invalid(&self.config.display().to_string(), e)
        })?;
        Ok(config)
    }
}

pub async fn run(args: Args) -> super::Result {
    let config = args
        .load()
        .map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
    if args.check {
        let providers: usize = config.nodes.iter().map(|n| n.providers.len()).sum();
        println!(
            "edge config ok: {}: would listen for nodes on {} ({}) and HTTP on {}; {} nodes, {} providers, {} model groups, {} API keys, {}; nothing was started or written",
            args.config.display(),
            config.listen.nodes,
            config.node_tls.mode.as_str(),
            config.listen.http,
            config.nodes.len(),
            providers,
            config.model_groups.len(),
            config.auth.keys.len(),
            if config.store.url.is_some() {
                "in a fleet (store)"
            } else {
                "alone (no store)"
            },
        );
        return Ok(());
    }
    if args.print_pin {
        return match iop_edge::node_listener_pin(&config).await {
            Ok(Some(pin)) => {
                println!("{pin}");
                Ok(())
            }
            Ok(None) => Err(Failure::new(
                EXIT_CONFIG,
                format!(
                    "the node listener has no pin (node_tls.mode {}{})",
                    config.node_tls.mode.as_str(),
                    if config.node_tls.mode == iop_edge::config::NodeTlsMode::Provided {
                        ", and node_tls.cert holds no CA certificate after the server's: nodes verify it with --edge-ca"
                    } else {
                        ""
                    }
                ),
            )),
            Err(e) => Err(Failure::new(EXIT_CONFIG, e.to_string())),
        };
    }
    let (shutdown, stop_now) = crate::signals::shutdown_and_stop_now();
    let mut hangup = signal(SignalKind::hangup())?;
    let nodes = config.nodes.len();
    let groups = config.model_groups.len();
    let server = EdgeServer::start(config).await.map_err(|e| match e {
        iop_edge::StartError::Io(e) => Failure::from(e),
        other => Failure::new(EXIT_CONFIG, other.to_string()),
    })?;
    let pin = server
        .node_pin
        .map_or_else(String::new, |pin| format!(" pin={pin}"));
    println!(
        "iop edge listening: nodes={} http={} node_tls={}{pin} https={} ({nodes} nodes, {groups} model groups configured)",
        server.node_addr,
        server.http_addr,
        server.node_tls.as_str(),
        server.https(),
    );
    if server.node_tls == iop_edge::config::NodeTlsMode::InsecurePlaintext {
        println!(
            "WARNING: node_tls.mode is insecure_plaintext: node tokens and prompts are not encrypted"
        );
    }
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = hangup.recv() => match args.load() {
                Ok(config) => {
                    if let Err(err) = server.reload_http_tls(&config) {
                        tracing::error!(%err, "http_tls: the certificate could not be re-read; the running one stays");
                    }
                    let report = server.edge.reload(config);
                    if !report.needs_restart.is_empty() {
                        tracing::warn!(settings = ?report.needs_restart, "these settings change only on restart");
                    }
                }
                Err(err) => tracing::error!(%err, "config reload failed; the running config stays"),
            },
        }
    }
    server.drain(stop_now.cancelled()).await;
    server.shutdown().await;
    Ok(())
}
