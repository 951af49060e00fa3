//! `iop node`: dials the edge and serves the backends the edge's config names, reconnecting
//! under the node's policy until SIGINT / SIGTERM, a fatal error, or an exhausted budget.

use std::path::PathBuf;

use iop_node::store::RunStore;
use iop_node::{EdgeTarget, NodeConfig, NodeExit, NodeRuntime, supervise};

use super::{EXIT_CONFIG, EXIT_EXHAUSTED, Failure};

#[derive(Debug, clap::Args)]
#[command(after_help = "\
The node gets its providers from the edge at registration and reconnects by itself under
reconnect.max_attempts (default 10, 0 = unlimited) and reconnect.interval_sec (default 10).

Exit status: 0 after SIGINT/SIGTERM (runs are cancelled and their clients told), 2 for a
config or credential error (e.g. the edge does not know the token), 3 when the retry
budget runs out, 1 for anything else.")]
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
    #[command(flatten)]
    pub runtime: crate::runtime::ThreadsArg,
}

pub async fn run(args: Args) -> super::Result {
    let config_error = |m: String| Failure::new(EXIT_CONFIG, m);
    let mut config = match &args.config {
        Some(path) => NodeConfig::load(path).map_err(|e| config_error(e.to_string()))?,
        None => NodeConfig::default(),
    };
    if let Some(edge) = args.edge {
        config.edge = edge;
    }
    if let Some(db) = args.db {
        config.db = db;
    }
    config
        .validate()
        .map_err(|(path, message)| config_error(format!("{path}: {message}")))?;
    let token = match args.token {
        Some(t) => t,
        None => config.resolve_token().map_err(config_error)?.ok_or_else(|| {
            config_error("no node token: pass --token, set IOP_NODE_TOKEN, or give token/token_env in the config".into())
        })?,
    };
    let (store, store_thread) =
        RunStore::open(&config.db).map_err(|e| config_error(e.to_string()))?;
    let runtime = NodeRuntime::new(Some(store));
    let target = EdgeTarget {
        addr: config.edge.clone(),
        token,
        max_frame_bytes: config.max_frame_bytes,
    };
    let shutdown = crate::signals::shutdown_on_signal();
    tracing::info!(edge = %target.addr, db = %config.db, "node starting");
    let result = supervise(runtime.clone(), target, config.reconnect, shutdown).await;
    drop(runtime);
    store_thread.join();
    match result {
        Ok(()) => Ok(()),
        Err(NodeExit::Fatal(message)) => Err(Failure::new(EXIT_CONFIG, message)),
        Err(e @ NodeExit::Exhausted { .. }) => Err(Failure::new(EXIT_EXHAUSTED, e.to_string())),
    }
}
