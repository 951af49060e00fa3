//! The node's side of per-stream flow control: each run or tunnel may have at most its
//! granted window of data frames (deltas, body chunks) un-acknowledged by the edge. The
//! edge returns credit with `StreamCredit` as its client consumes them, so a slow client
//! slows its own provider stream and nothing else.

use foldhash::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Credit windows of the streams open on one connection.
#[derive(Debug, Default)]
pub struct StreamCredits {
    windows: Mutex<HashMap<String, Arc<Semaphore>>>,
}

impl StreamCredits {
    /// Opens a stream's window; dropping the returned [`Credit`] closes it.
    pub fn open(self: &Arc<Self>, stream_id: &str, initial: u32) -> Credit {
        let window = if initial == 0 {
            iop_proto::STREAM_WINDOW
        } else {
            initial
        };
        let semaphore = Arc::new(Semaphore::new(window as usize));
        self.windows
            .lock()
            .insert(stream_id.to_string(), semaphore.clone());
        Credit {
            credits: self.clone(),
            stream_id: stream_id.to_string(),
            semaphore,
        }
    }

    /// The edge returned `frames` of credit for a stream (unknown streams are ignored:
    /// they ended meanwhile).
    pub fn grant(&self, stream_id: &str, frames: u32) {
        if let Some(semaphore) = self.windows.lock().get(stream_id) {
            semaphore.add_permits(frames as usize);
        }
    }
}

/// One stream's window.
#[derive(Debug)]
pub struct Credit {
    credits: Arc<StreamCredits>,
    stream_id: String,
    semaphore: Arc<Semaphore>,
}

impl Credit {
    /// Takes one frame of credit, waiting for the edge if the window is used up. `false`
    /// if `cancel` fired first.
    pub async fn take(&self, cancel: &CancellationToken) -> bool {
        tokio::select! {
            permit = self.semaphore.acquire() => match permit {
                Ok(permit) => {
                    permit.forget();
                    true
                }
                Err(_) => false,
            },
            _ = cancel.cancelled() => false,
        }
    }
}

impl Drop for Credit {
    fn drop(&mut self) {
        self.credits.windows.lock().remove(&self.stream_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn the_window_bounds_frames_in_flight_until_credit_returns() {
        let credits = Arc::new(StreamCredits::default());
        let credit = credits.open("s", 2);
        let cancel = CancellationToken::new();
        assert!(credit.take(&cancel).await);
        assert!(credit.take(&cancel).await);
        let third = tokio::time::timeout(Duration::from_millis(50), credit.take(&cancel)).await;
        assert!(third.is_err(), "a third frame must wait for credit");
        credits.grant("s", 1);
        assert!(
            tokio::time::timeout(Duration::from_secs(1), credit.take(&cancel))
                .await
                .unwrap()
        );
    }

    #[tokio::test]
    async fn cancel_releases_a_waiting_stream() {
        let credits = Arc::new(StreamCredits::default());
        let credit = credits.open("s", 1);
        let cancel = CancellationToken::new();
        assert!(credit.take(&cancel).await);
        cancel.cancel();
        assert!(!credit.take(&cancel).await);
    }

    #[test]
    fn closed_streams_forget_their_window() {
        let credits = Arc::new(StreamCredits::default());
        drop(credits.open("s", 1));
        credits.grant("s", 5);
        assert!(credits.windows.lock().is_empty());
    }
}
