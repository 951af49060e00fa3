//! The heartbeat both sides run on a registered connection: a `Ping` every
//! [`HEARTBEAT_INTERVAL`], and the peer counted gone after [`HEARTBEAT_TIMEOUT`] without a
//! frame of any kind. A closed socket is noticed at once by the reader; this is the fallback
//! for a peer that goes silent (power loss, partition, a stopped process).
//!
//! Silence is judged by what the link received: when the deadline is noticed, a frame the
//! link already holds still counts ([`next_frame`]), so a process whose event
//! loop ran late does not drop a peer that kept talking.

use std::time::Duration;

use futures::{FutureExt, Stream, StreamExt};
use tokio::time::{Instant, Interval, MissedTickBehavior, timeout_at};

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

/// The next item of `frames` (`Some(None)` when they end), or `None` when the peer stayed
/// silent past `deadline`: only if nothing is waiting on the link when the deadline is
/// noticed.
pub async fn next_frame<S: Stream + Unpin>(
    deadline: Instant,
    frames: &mut S,
) -> Option<Option<S::Item>> {
    match timeout_at(deadline, frames.next()).await {
        Ok(frame) => Some(frame),
        Err(_) => frames.next().now_or_never(),
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

    #[tokio::test(start_paused = true)]
    async fn a_frame_waiting_when_the_deadline_is_noticed_still_counts() {
        let past = Instant::now() - Duration::from_secs(1);
        // A late loop: the deadline has passed, but the link holds a frame.
        let mut waiting = futures::stream::iter([7]);
        assert_eq!(next_frame(past, &mut waiting).await, Some(Some(7)));
        assert_eq!(next_frame(past, &mut waiting).await, Some(None));
        // Nothing on the link: the peer is gone once the deadline passes.
        let mut silent = futures::stream::pending::<u8>();
        let deadline = Instant::now() + HEARTBEAT_TIMEOUT;
        assert_eq!(next_frame(deadline, &mut silent).await, None);
        assert_eq!(Instant::now(), deadline);
    }
}
