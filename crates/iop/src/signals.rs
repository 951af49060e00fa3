//! Turns SIGINT / SIGTERM into cancellation tokens the daemons shut down on: the first
//! signal asks for a stop (the edge drains first), a second one for a stop at once.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// A token cancelled on the first SIGINT or SIGTERM.
pub fn shutdown_on_signal() -> CancellationToken {
    shutdown_and_stop_now().0
}

/// Tokens cancelled on the first SIGINT or SIGTERM (shut down) and on the second (stop at
/// once).
pub fn shutdown_and_stop_now() -> (CancellationToken, CancellationToken) {
    let shutdown = CancellationToken::new();
    let stop_now = CancellationToken::new();
    let (first, second) = (shutdown.clone(), stop_now.clone());
    tokio::spawn(async move {
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            tracing::warn!("cannot install signal handlers");
            return;
        };
        for (token, what) in [(first, "shutting down"), (second, "stopping at once")] {
            let name = tokio::select! {
                _ = int.recv() => "SIGINT",
                _ = term.recv() => "SIGTERM",
            };
            tracing::info!(signal = name, "{what}");
            token.cancel();
        }
    });
    (shutdown, stop_now)
}
