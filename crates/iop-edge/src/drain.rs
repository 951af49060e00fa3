//! Draining before a stop: once [`Drain::begin`] is called (on SIGTERM) `/readyz` answers
//! 503 so a load balancer moves traffic elsewhere, and every response asks its client to
//! close the connection (so none stays pinned to this edge). New client requests are
//! still served until [`Drain::refuse`] (after `shutdown.accept_grace_sec`), then get a
//! 503 saying so, while the requests in progress run to their end; [`Drain::until_idle`]
//! resolves when the last one has. Only the client APIs count: probes, the admin API,
//! the status page and the event stream never hold a drain up.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::sync::Notify;

#[derive(Debug, Default)]
pub struct Drain {
    draining: AtomicBool,
    refusing: AtomicBool,
    in_progress: AtomicUsize,
    idle: Notify,
}

/// A client request in progress: held until its response body has ended.
#[derive(Debug)]
pub struct InProgress(Arc<Drain>);

impl Drop for InProgress {
    fn drop(&mut self) {
        if self.0.in_progress.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Whether a request to `path` is a client request a drain waits for.
pub fn counts(path: &str) -> bool {
    path.starts_with("/v1/") || path.starts_with("/api/")
}

/// Whether a client request would start work, and is refused while draining: everything
/// but ending work already running (cancelling a run, ending a session).
pub fn starts_work(method: &http::Method, path: &str) -> bool {
    !(method == http::Method::DELETE || path.ends_with("/cancel"))
}

impl Drain {
    /// The drain starts: `/readyz` answers 503, connections are closed after their
    /// response; new requests are still served.
    pub fn begin(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// From now on new requests are refused.
    pub fn refuse(&self) {
        self.begin();
        self.refusing.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub fn is_refusing(&self) -> bool {
        self.refusing.load(Ordering::Acquire)
    }

    /// Counts a request until the returned guard drops.
    pub fn started(self: &Arc<Self>) -> InProgress {
        self.in_progress.fetch_add(1, Ordering::AcqRel);
        InProgress(self.clone())
    }

    pub fn in_progress(&self) -> usize {
        self.in_progress.load(Ordering::Acquire)
    }

    /// Resolves once no request is in progress.
    pub async fn until_idle(&self) {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.in_progress() == 0 {
                return;
            }
            idle.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_drain_waits_for_the_last_request_in_progress() {
        let drain = Arc::new(Drain::default());
        let first = drain.started();
        let second = drain.started();
        drain.begin();
        assert!(drain.is_draining() && !drain.is_refusing());
        drain.refuse();
        assert!(drain.is_refusing());
        let waiter = tokio::spawn({
            let drain = drain.clone();
            async move { drain.until_idle().await }
        });
        drop(first);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!waiter.is_finished(), "one request is still in progress");
        drop(second);
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("idle once the last request ended")
            .unwrap();
        // Idle already: resolves at once.
        drain.until_idle().await;
    }

    #[test]
    fn only_client_requests_count() {
        for path in [
            "/v1/chat/completions",
            "/v1/runs",
            "/api/chat",
            "/v1/models",
        ] {
            assert!(counts(path), "{path}");
        }
        assert!(starts_work(&http::Method::POST, "/v1/chat/completions"));
        assert!(!starts_work(&http::Method::POST, "/v1/runs/r1/cancel"));
        assert!(!starts_work(&http::Method::DELETE, "/v1/sessions/n/a/t/s"));
        for path in [
            "/readyz",
            "/healthz",
            "/admin/events",
            "/metrics",
            "/ui",
            "/",
        ] {
            assert!(!counts(path), "{path}");
        }
    }
}
