//! Whether the edge accepts connections, checked cheaply between reconnect attempts: a
//! TCP connect, closed at once, every [`PROBE_EVERY`] (jittered, so nodes behind one
//! address do not all arrive in the same instant). A probe is not an attempt: it sends
//! nothing and counts against no budget.

use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::{Instant, sleep, timeout};

/// How often the edge is probed, on average.
pub const PROBE_EVERY: Duration = Duration::from_millis(250);

/// How long one probe may take to connect.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Resolves as soon as `edge` accepts a TCP connection, or when `within` has passed,
/// whichever comes first. The first probe comes after one jittered period too: an edge
/// that is going away closes its connections before its listener, and a connection
/// accepted in between would only be reset.
pub async fn until_reachable(edge: String, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let pause = jittered(PROBE_EVERY, rand::random::<f64>());
        sleep(pause.min(deadline.saturating_duration_since(Instant::now()))).await;
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        if let Ok(Ok(_)) = timeout(PROBE_TIMEOUT.min(left), TcpStream::connect(&edge)).await {
            return;
        }
    }
}

/// `every`, spread over half to one and a half times it by `unit` (in 0..1).
fn jittered(every: Duration, unit: f64) -> Duration {
    every.mul_f64(0.5 + unit.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_spread_around_their_period() {
        assert_eq!(jittered(PROBE_EVERY, 0.0), Duration::from_millis(125));
        assert_eq!(jittered(PROBE_EVERY, 0.5), PROBE_EVERY);
        assert_eq!(jittered(PROBE_EVERY, 1.0), Duration::from_millis(375));
    }

    #[tokio::test]
    async fn a_listening_edge_is_reachable_at_once_and_a_closed_one_only_when_it_opens() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let started = Instant::now();
        until_reachable(addr.to_string(), Duration::from_secs(30)).await;
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(listener);

        // Closed: probed until it listens again.
        let reopen = tokio::spawn(async move {
            sleep(Duration::from_millis(600)).await;
            tokio::net::TcpListener::bind(addr).await.unwrap()
        });
        let started = Instant::now();
        until_reachable(addr.to_string(), Duration::from_secs(30)).await;
        let _listener = reopen.await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(500));
        assert!(started.elapsed() < Duration::from_secs(20));

        // Never listening: the interval bounds the wait.
        drop(_listener);
        let started = Instant::now();
        until_reachable(addr.to_string(), Duration::from_millis(400)).await;
        assert!(started.elapsed() >= Duration::from_millis(390));
    }
}
