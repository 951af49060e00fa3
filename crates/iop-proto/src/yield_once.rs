//! One scheduler round for the relay path: lets every task that is ready now run once
//! before the caller goes on, so that a frame writer or a tunnel can pick up what those
//! tasks produce and send it in the same write.
//!
//! `tokio::task::yield_now` also makes the runtime poll its I/O driver before the yielding
//! task runs again: one `epoll_wait` system call per yield. On the event loop the edge and
//! the node run by default (a current-thread runtime) the tasks already queued are all
//! this needs, so there the task simply requeues itself behind them. A multi-thread runtime
//! would poll a task that wakes itself again at once (its LIFO slot), so there this falls
//! back to `yield_now`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::runtime::{Handle, RuntimeFlavor};

/// Lets the tasks that are ready now run once, then resumes the caller.
pub async fn yield_once() {
    let current_thread = Handle::try_current()
        .is_ok_and(|handle| handle.runtime_flavor() == RuntimeFlavor::CurrentThread);
    if current_thread {
        Requeue { queued: false }.await
    } else {
        tokio::task::yield_now().await
    }
}

/// Pending once with its own waker woken, which puts the task at the back of the
/// current-thread runtime's run queue.
struct Requeue {
    queued: bool,
}

impl Future for Requeue {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.queued {
            return Poll::Ready(());
        }
        self.queued = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// The guarantee the relay relies on: a task that became ready before the yield has
    /// run by the time the caller resumes.
    async fn ready_task_runs_before_resume() {
        let ran = Arc::new(AtomicUsize::new(0));
        let other = ran.clone();
        let handle = tokio::spawn(async move {
            other.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(ran.load(Ordering::SeqCst), 0);
        yield_once().await;
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        handle.await.unwrap();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn on_a_current_thread_runtime() {
        ready_task_runs_before_resume().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn on_a_multi_thread_runtime_it_resumes() {
        tokio::time::timeout(std::time::Duration::from_secs(5), yield_once())
            .await
            .expect("yield_once resumes");
    }
}
