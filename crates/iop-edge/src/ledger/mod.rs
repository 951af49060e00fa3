//! The durable usage ledger: every finished model-API request becomes one
//! [`UsageRecord`] in SQLite (`<state_dir>/usage.db`), for billing, dashboards and
//! per-key token budgets. Unlike the live event stream (`/admin/events`), nothing is lost
//! quietly: a record that cannot be queued is counted (`dropped_records`, in `/metrics`
//! and `/admin/status`) and logged in a rate-limited summary.
//!
//! - [`record`]: the record and the names of its fields;
//! - [`recorder`]: the per-request handle the HTTP surfaces and streams fill in, which
//!   hands the finished record to [`crate::service::Edge::record_request`];
//! - [`writer`]: the thread that commits records in batches; [`store`]: the file and its
//!   schema; [`query`]: summaries and raw records;
//! - [`live`]: the last minute per model group, in memory (each key's tokens today, for
//!   `tokens_per_day` limits, are [`crate::day_tokens`], loaded from here);
//! - [`ship`]: in a fleet, the records copied into the store, the local file as the spool.
//!
//! [`Ledger`] owns the writer: [`Ledger::push`] never blocks (a full queue counts a drop),
//! [`Ledger::close`] commits what is queued and stops.

pub mod live;
pub mod query;
pub mod record;
pub mod recorder;
pub mod ship;
pub mod store;
pub mod writer;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Sender, channel, sync_channel};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use rusqlite::Connection;

pub use record::{ClientApi, UsageRecord, unix_ms_now};
pub use recorder::RequestRecorder;
use writer::{Message, Writer};

/// Records queued for the writer at most; more are counted as dropped.
pub const QUEUE_RECORDS: usize = 65_536;
/// At most one log line about dropped records per this period.
pub const DROP_LOG_EVERY: Duration = Duration::from_secs(10);

/// Why the ledger could not start.
pub type LedgerError = store::StoreError;

/// The ledger of one edge: the writer's queue, its counters and a reader for queries.
pub struct Ledger {
    /// `None`: the ledger is off (`ledger.enabled: false`, or no state directory). The
    /// channel grows and shrinks with what it holds (an idle edge holds no buffer for it);
    /// `queued` bounds the records in it.
    queue: Option<Sender<Message>>,
    /// Records sent and not yet taken by the writer, at most `capacity`.
    queued: Arc<AtomicUsize>,
    capacity: usize,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The writer thread, unparked by a flush or close (records never wake it).
    writer_thread: Option<std::thread::Thread>,
    /// The connection queries use (run on blocking threads).
    reader: Option<Arc<Mutex<Connection>>>,
    path: Option<PathBuf>,
    /// Records lost: the queue was full or closed, or a commit failed.
    dropped: Counter,
    written: Counter,
    drop_log: Mutex<DropLog>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("path", &self.path)
            .field("dropped", &self.dropped.get())
            .finish_non_exhaustive()
    }
}

/// The rate-limited summary of dropped records.
#[derive(Debug, Default)]
struct DropLog {
    last: Option<Instant>,
    since_last: u64,
}

impl Ledger {
    /// A ledger that keeps nothing.
    pub fn disabled() -> Self {
        Self {
            queue: None,
            queued: Arc::default(),
            capacity: 0,
            writer: Mutex::new(None),
            writer_thread: None,
            reader: None,
            path: None,
            dropped: Counter::default(),
            written: Counter::default(),
            drop_log: Mutex::new(DropLog::default()),
        }
    }

    /// Opens `<dir>/usage.db` and starts the writer thread.
    pub fn open(dir: &Path, retention_days: u32) -> Result<Self, LedgerError> {
        Self::open_with_queue(dir, retention_days, QUEUE_RECORDS)
    }

    /// [`Ledger::open`] with a queue of `capacity` records.
    pub fn open_with_queue(
        dir: &Path,
        retention_days: u32,
        capacity: usize,
    ) -> Result<Self, LedgerError> {
        let path = dir.join(store::FILE_NAME);
        let conn = store::open_writer(&path)?;
        let reader = store::open_reader(&path)?;
        let (queue, rx) = channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let dropped = Counter::default();
        let written = Counter::default();
        let writer = Writer {
            conn,
            rx,
            queued: queued.clone(),
            retention_days,
            written: written.clone(),
            dropped: dropped.clone(),
        };
        let handle = std::thread::Builder::new()
            .name("iop-ledger".into())
            .spawn(move || writer.run())
            .map_err(|source| store::StoreError::Io {
                path: path.display().to_string(),
                source,
            })?;
        Ok(Self {
            queue: Some(queue),
            queued,
            capacity,
            writer_thread: Some(handle.thread().clone()),
            writer: Mutex::new(Some(handle)),
            reader: Some(Arc::new(Mutex::new(reader))),
            path: Some(path),
            dropped,
            written,
            drop_log: Mutex::new(DropLog::default()),
        })
    }

    pub fn is_enabled(&self) -> bool {
        self.queue.is_some()
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Records lost so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.get()
    }

    /// Records committed so far.
    pub fn written(&self) -> u64 {
        self.written.get()
    }

    /// The counters for `/metrics`.
    pub fn counters(&self) -> (Counter, Counter) {
        (self.written.clone(), self.dropped.clone())
    }

    /// Queues `record` for the writer without waiting. When the queue is full (or the
    /// ledger closed) the record is counted as dropped and a summary is logged at most
    /// every [`DROP_LOG_EVERY`]. Returns whether it was queued.
    pub fn push(&self, record: UsageRecord) -> bool {
        let Some(queue) = &self.queue else {
            return false;
        };
        let full = self.queued.fetch_add(1, Ordering::Relaxed) >= self.capacity;
        if full || queue.send(Message::Record(record)).is_err() {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            self.dropped.inc();
            self.log_drop(Instant::now());
            return false;
        }
        true
    }

    fn log_drop(&self, now: Instant) {
        let mut log = self.drop_log.lock();
        log.since_last += 1;
        if log
            .last
            .is_some_and(|last| now.duration_since(last) < DROP_LOG_EVERY)
        {
            return;
        }
        tracing::warn!(
            dropped = log.since_last,
            dropped_total = self.dropped.get(),
            "usage ledger falls behind: records dropped (its queue of {QUEUE_RECORDS} is full); they are missing from /admin/usage"
        );
        log.last = Some(now);
        log.since_last = 0;
    }

    /// Waits (on a blocking thread, at most `within`) until every record queued before
    /// this call is committed, so a query sees them. Returns whether it was.
    pub async fn flush(&self, within: Duration) -> bool {
        let Some(queue) = self.queue.clone() else {
            return true;
        };
        let writer = self.writer_thread.clone();
        let waited = tokio::task::spawn_blocking(move || {
            let (ack, done) = sync_channel(1);
            let deadline = Instant::now() + within;
            if queue.send(Message::Flush(ack)).is_err() {
                return false;
            }
            // A filling batch commits now instead of at its next tick.
            if let Some(writer) = &writer {
                writer.unpark();
            }
            done.recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .is_ok()
        })
        .await;
        waited.unwrap_or(false)
    }

    /// Commits what is queued and stops the writer (waiting at most `within`). Records
    /// pushed afterwards count as dropped.
    pub async fn close(&self, within: Duration) {
        let Some(queue) = self.queue.clone() else {
            return;
        };
        let Some(handle) = self.writer.lock().take() else {
            return;
        };
        let closed = tokio::task::spawn_blocking(move || {
            // The close comes behind the queued records.
            let _ = queue.send(Message::Close);
            handle.thread().unpark();
            handle.join().is_ok()
        });
        match tokio::time::timeout(within, closed).await {
            Ok(_) => tracing::info!(
                written = self.written(),
                dropped = self.dropped(),
                "usage ledger closed"
            ),
            Err(_) => tracing::warn!(
                "usage ledger: the writer did not finish within {}s; records still queued may be lost",
                within.as_secs()
            ),
        }
    }

    /// Input + output tokens per key of the records since `since_ms` (blocking: for the
    /// start, before requests flow). Empty when the ledger is off or cannot be read.
    pub fn tokens_since(&self, since_ms: i64) -> Vec<(String, u64)> {
        let Some(reader) = &self.reader else {
            return Vec::new();
        };
        query::tokens_by_key_since(&reader.lock(), since_ms).unwrap_or_else(|err| {
            tracing::error!(%err, "usage ledger: cannot read today's tokens per key; tokens_per_day limits start from zero");
            Vec::new()
        })
    }

    /// Runs `query` on the reader connection on a blocking thread.
    pub async fn read<T: Send + 'static>(
        &self,
        query: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, String> {
        match self.reader() {
            Some(reader) => reader.read(query).await,
            None => Err("the usage ledger is off (ledger.enabled: false)".into()),
        }
    }

    /// A handle on the reader connection that outlives this borrow (for a task).
    pub fn reader(&self) -> Option<LedgerReader> {
        self.reader.clone().map(LedgerReader)
    }
}

/// Reads the ledger from a task of its own.
#[derive(Clone)]
pub struct LedgerReader(Arc<Mutex<Connection>>);

impl LedgerReader {
    /// Runs `query` on the reader connection on a blocking thread.
    pub async fn read<T: Send + 'static>(
        &self,
        query: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, String> {
        let reader = self.0.clone();
        tokio::task::spawn_blocking(move || query(&reader.lock()).map_err(|e| e.to_string()))
            .await
            .map_err(|e| e.to_string())?
    }
}

#[cfg(test)]
mod tests;
