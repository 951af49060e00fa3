//! The async runtime a subcommand runs on, and the `--threads` option of the daemons.
//!
//! The edge, the node and the demo run on one event-loop thread unless told otherwise.
//! Relaying a request hands work between a few tasks (HTTP connection, frame writer,
//! tunnel); on one thread each hand-off is a push onto a local queue, where a thread pool
//! pays for cross-thread wake-ups. One thread relays many thousands of requests a second
//! (BENCHMARKS.md), and leaves the other cores to the backend next to the node. An edge
//! that needs more than one core takes `--threads N`. The tools (mock provider, bench,
//! status) use a thread pool on every core.

use tokio::runtime::{Builder, Runtime};

/// The daemons' runtime option.
#[derive(Debug, Clone, clap::Args)]
pub struct ThreadsArg {
    /// Event-loop threads. 1 (the default) runs everything on one thread, the fastest relay
    /// per request; more spreads the work over that many cores, for heavy load.
    #[arg(
        long,
        env = "IOP_THREADS",
        default_value_t = 1,
        value_parser = clap::value_parser!(u16).range(1..=1024),
    )]
    pub threads: u16,
}

/// A current-thread runtime for `Some(1)`, a pool of `n` workers for `Some(n)`, and a pool
/// on every core for `None`.
pub fn build(threads: Option<u16>) -> std::io::Result<Runtime> {
    match threads {
        Some(1) => Builder::new_current_thread().enable_all().build(),
        Some(n) => Builder::new_multi_thread()
            .worker_threads(n as usize)
            .enable_all()
            .build(),
        None => Builder::new_multi_thread().enable_all().build(),
    }
}
