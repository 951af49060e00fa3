//! The heartbeat both sides run on a registered connection: a `Ping` every
//! [`HEARTBEAT_INTERVAL`], and the peer counted gone after [`HEARTBEAT_TIMEOUT`] without a
//! frame of any kind. A closed socket is noticed at once by the reader; this is the fallback
//! for a peer that goes silent (power loss, partition, a stopped process).

use std::time::Duration;

use tokio::time::{Instant, Interval, MissedTickBehavior};

use crate::pb;

/// Both sides send a `Ping` this often.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
/// A peer silent this long is gone.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct Heartbeat {
    ticker: Interval,
    nonce: u64,
    deadline: Instant,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Self::new()
    }
}

impl Heartbeat {
    pub fn new() -> Self {
        let mut ticker = tokio::time::interval(HEARTBEAT_INTERVAL);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Self {
            ticker,
            nonce: 0,
            deadline: Instant::now() + HEARTBEAT_TIMEOUT,
        }
    }

    /// Waits for the next ping to send.
    pub async fn ping(&mut self) -> pb::Ping {
        self.ticker.tick().await;
        self.nonce += 1;
        pb::Ping { nonce: self.nonce }
    }

    /// A frame arrived: the peer is alive.
    pub fn seen(&mut self) {
        self.deadline = Instant::now() + HEARTBEAT_TIMEOUT;
    }

    /// When the peer counts as gone unless a frame arrives first.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Why the connection ends when the deadline passes.
    pub fn timeout_reason(&self, peer: &str) -> String {
        format!(
            "heartbeat timeout: nothing from the {peer} for {}s",
            HEARTBEAT_TIMEOUT.as_secs()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn pings_come_every_interval_and_frames_push_the_deadline() {
        let mut hb = Heartbeat::new();
        let start = Instant::now();
        assert_eq!(hb.ping().await.nonce, 1); // the first tick is immediate
        assert_eq!(hb.ping().await.nonce, 2);
        assert_eq!(Instant::now() - start, HEARTBEAT_INTERVAL);
        assert_eq!(hb.deadline(), start + HEARTBEAT_TIMEOUT);
        tokio::time::advance(Duration::from_secs(1)).await;
        hb.seen();
        assert_eq!(hb.deadline(), Instant::now() + HEARTBEAT_TIMEOUT);
    }
}
