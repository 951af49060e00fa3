//! `iop node`: dials the edge and serves the backends the edge's config names, reconnecting
//! under the node's policy until SIGINT / SIGTERM, a fatal error, or an exhausted budget.

use std::path::PathBuf;
use std::sync::Arc;

use iop_node::link::{LinkOptions, from_config};
use iop_node::store::RunStore;
use iop_node::{EdgeTarget, NodeConfig, NodeExit, NodeRuntime, supervise};

use super::{EXIT_CONFIG, EXIT_EXHAUSTED, Failure};

#[derive(Debug, clap::Args)]
#[command(after_help = "\
Joining: on the edge, `iop join-token --node ID` prints a join string; on the node,
`iop node --join '<join string>'` is all it takes. The node verifies the edge by the pin in
the string, receives a credential (a client certificate, private key made here) and keeps
it in --state-file (0600); later starts need no flag (or the same --join, which is then
ignored).

Static tokens work too: --token with --edge-pin (the edge prints its pin at start) or
--edge-ca. The node fails closed: a certificate that does not match the pin ends it.

The node gets its providers from the edge at registration and reconnects by itself under
reconnect.max_attempts (default 10, 0 = unlimited) and reconnect.interval_sec (default 10).

Exit status: 0 after SIGINT/SIGTERM (runs are cancelled and their clients told), 2 for a
config or credential error (the edge does not know the token, the join token expired or
is used up, the node was revoked, the edge's certificate does not match the pin), 3 when
the retry budget runs out, 1 for anything else.")]
pub struct Args {
    /// Node config file (edge address, token, store, reconnect policy). Optional: flags
    /// and defaults cover everything.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The edge's node listener, host:port (overrides the config's `edge`).
    #[arg(long, value_name = "HOST:PORT")]
    edge: Option<String>,
    /// This node's token (overrides the config).
    #[arg(long, env = "IOP_NODE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Run store database: a path or a `file:` URI (overrides the config's `db`).
    #[arg(long)]
    db: Option<String>,
    /// Join an edge with a join string (`iop1:...`, from `iop join-token` on the edge).
    #[arg(
        long,
        env = "IOP_NODE_JOIN",
        hide_env_values = true,
        value_name = "JOIN_STRING"
    )]
    join: Option<String>,
    /// Trust the edge whose CA has this pin (`sha256:...`, printed by the edge at start).
    /// Repeat to accept several (while the edge's CA is rotated).
    #[arg(long = "edge-pin", value_name = "PIN")]
    edge_pin: Vec<String>,
    /// Verify the edge against these PEM CA certificates (host name checked) instead of a pin.
    #[arg(long, value_name = "FILE")]
    edge_ca: Option<PathBuf>,
    /// Where the node keeps the credential a join gives it (default iop-node-state.json).
    #[arg(long, value_name = "FILE")]
    state_file: Option<PathBuf>,
    /// mTLS: this node's PEM client certificate (CN = node id) from the operator's CA.
    #[arg(long, value_name = "FILE", requires = "client_key")]
    client_cert: Option<PathBuf>,
    /// mTLS: the client certificate's PEM private key.
    #[arg(long, value_name = "FILE", requires = "client_cert")]
    client_key: Option<PathBuf>,
    /// Do not verify the edge's certificate. Anyone on the path can then read the node's
    /// token and every prompt, and pose as the edge.
    #[arg(long)]
    insecure_skip_tls_verify: bool,
    /// Speak plain TCP (an edge with node_tls.mode insecure_plaintext): the token and every
    /// prompt cross the network readable by anyone on the path.
    #[arg(long)]
    insecure_plaintext: bool,
    /// Check the config and the command line, print what would run, and exit: nothing is
    /// dialled, created or written (a bad config exits 2 naming the field).
    #[arg(long)]
    check: bool,
    #[command(flatten)]
    pub runtime: crate::runtime::ThreadsArg,
}

pub async fn run(args: Args) -> super::Result {
    let config_error = |m: String| Failure::new(EXIT_CONFIG, m);
    let mut config = match &args.config {
        Some(path) => NodeConfig::load(path).map_err(|e| config_error(e.to_string()))?,
        None => NodeConfig::default(),
    };
    let explicit_edge = args
        .edge
        .clone()
        .or_else(|| (config.edge != iop_node::config::DEFAULT_EDGE).then(|| config.edge.clone()));
    if let Some(edge) = args.edge {
        config.edge = edge;
    }
    if let Some(db) = args.db {
        config.db = db;
    }
    config.edge_pin.extend(args.edge_pin);
    if let Some(ca) = args.edge_ca {
        config.edge_ca = Some(ca);
    }
    if let Some(path) = args.state_file {
        config.state_file = path;
    }
    if args.client_cert.is_some() {
        config.client_cert = args.client_cert;
        config.client_key = args.client_key;
    }
    config.insecure_skip_tls_verify |= args.insecure_skip_tls_verify;
    config.insecure_plaintext |= args.insecure_plaintext;
    config
        .validate()
        .map_err(|(path, message)| config_error(format!("{path}: {message}")))?;
    let token = match args.token {
        Some(t) => Some(t),
        None => config.resolve_token().map_err(config_error)?,
    };
    let link = from_config(
        &config,
        LinkOptions {
            join: args.join,
            token,
            edge: explicit_edge,
        },
    )
    .map_err(config_error)?;
    if args.check {
        println!(
            "node config ok: would dial {} ({}), {} credential, run store {}; nothing was started or written",
            link.edge_addr(),
            if config.insecure_plaintext {
                "plain TCP"
            } else {
                "TLS"
            },
            link.credential_kind(),
            config.db,
        );
        return Ok(());
    }
    if config.insecure_skip_tls_verify {
        tracing::warn!(
            "insecure_skip_tls_verify: the edge is not verified; anyone on the path can pose as it and read everything"
        );
    }
    let (store, store_thread) =
        RunStore::open(&config.db).map_err(|e| config_error(e.to_string()))?;
    let runtime = NodeRuntime::new(Some(store));
    let target = EdgeTarget {
        link: Arc::new(link),
        max_frame_bytes: config.max_frame_bytes,
        fleet_edge: None,
    };
    let shutdown = crate::signals::shutdown_on_signal();
    tracing::info!(edge = %target.link.edge_addr(), credential = target.link.credential_kind(), db = %config.db, "node starting");
    let result = supervise(runtime.clone(), target, config.reconnect, shutdown).await;
    drop(runtime);
    store_thread.join();
    match result {
        Ok(()) => Ok(()),
        Err(NodeExit::Fatal(message)) => Err(Failure::new(EXIT_CONFIG, message)),
        Err(e @ NodeExit::Exhausted { .. }) => Err(Failure::new(EXIT_EXHAUSTED, e.to_string())),
    }
}
