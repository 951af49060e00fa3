//! Turns SIGINT / SIGTERM into a cancellation token the daemons shut down on.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// A token cancelled on the first SIGINT or SIGTERM.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let trigger = token.clone();
    tokio::spawn(async move {
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            tracing::warn!("cannot install signal handlers");
            return;
        };
        let name = tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        };
        tracing::info!(signal = name, "shutting down");
        trigger.cancel();
    });
    token
}
