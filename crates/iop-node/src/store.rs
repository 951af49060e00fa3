//! The node's local run store: one SQLite row per run (id, adapter, target, session id,
//! background flag, status, start/finish timestamps, error).
//!
//! A dedicated thread owns the connection and applies writes from a bounded queue, so no
//! write ever sits on the event relay path. It takes everything queued (up to
//! [`MAX_BATCH`]) and writes it in one transaction, so a storm of runs costs one commit
//! per batch, not one per record. The queue holds [`STORE_QUEUE`] records, far more than
//! a storm queues while one batch commits; if it is full anyway (or SQLite fails), the
//! record is counted (`dropped`, `failed` in [`StoreStats`]) and a summary is logged at
//! most every [`REPORT_EVERY`] — the run goes on; the store is a record, not a dependency.
//!
//! Every write is an upsert of the whole row, so a finished record lands even when its
//! start was lost. On open, rows a previous process left `running` (it was killed or
//! crashed) become `interrupted`, with the time they were found and why. One database
//! belongs to one node process.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OpenFlags, params};
use serde::Serialize;

/// Records queued before new ones are dropped (and counted). Queued records are boxed: a
/// slot costs a pointer until it is used.
pub const STORE_QUEUE: usize = 65_536;
/// Records written per transaction at most.
pub const MAX_BATCH: usize = 2048;
/// Dropped or failed records are summarised in the log at most this often.
pub const REPORT_EVERY: Duration = Duration::from_secs(10);
/// The error stored on runs found `running` when the store opens.
pub const INTERRUPTED_REASON: &str = "interrupted: the node process running it ended before the run finished (found when the node started again)";

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS runs (
    run_id      TEXT PRIMARY KEY,
    adapter     TEXT NOT NULL,
    target      TEXT NOT NULL,
    session_id  TEXT NOT NULL DEFAULT '',
    background  INTEGER NOT NULL DEFAULT 0,
    status      TEXT NOT NULL,
    started_at  INTEGER NOT NULL,
    finished_at INTEGER,
    error       TEXT
);
CREATE INDEX IF NOT EXISTS runs_started_at ON runs(started_at);
CREATE INDEX IF NOT EXISTS runs_running ON runs(run_id) WHERE status = 'running';
";

const UPSERT: &str = "
INSERT INTO runs (run_id, adapter, target, session_id, background, status, started_at, finished_at, error)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
ON CONFLICT(run_id) DO UPDATE SET
    status = excluded.status, finished_at = excluded.finished_at, error = excluded.error";

/// How a run ended, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStatus {
    Running,
    Completed,
    Failed,
    Cancelled,
    /// Found `running` when the store opened: its process died under it.
    Interrupted,
}

impl RunStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Completed => "completed",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
            RunStatus::Interrupted => "interrupted",
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct RunRecord {
    pub run_id: String,
    pub adapter: String,
    pub target: String,
    pub session_id: String,
    pub background: bool,
    pub status: String,
    pub started_at_ms: i64,
    pub finished_at_ms: Option<i64>,
    pub error: Option<String>,
}

enum Op {
    Write(Box<RunRecord>),
    Recent {
        limit: usize,
        reply: tokio::sync::oneshot::Sender<Vec<RunRecord>>,
    },
}

#[derive(Debug, thiserror::Error)]
#[error("cannot open the run store {db}: {source}")]
pub struct StoreError {
    db: String,
    #[source]
    source: StoreCause,
}

/// What failed when the run store was opened.
#[derive(Debug, thiserror::Error)]
pub enum StoreCause {
    #[error(transparent)]
    Sqlite(#[from] rusqlite::Error),
    #[error("cannot create it with mode 0600: {0}")]
    File(#[from] std::io::Error),
}

/// What the store did since the node started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StoreStats {
    /// Records written.
    pub written: u64,
    /// Records not queued: the queue was full or the store closed.
    pub dropped: u64,
    /// Records SQLite refused.
    pub failed: u64,
    /// Transactions committed.
    pub batches: u64,
    /// Runs a previous process left `running`, marked `interrupted` at open.
    pub interrupted_at_start: u64,
}

#[derive(Debug, Default)]
struct Counters {
    written: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
    batches: AtomicU64,
    interrupted_at_start: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> StoreStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StoreStats {
            written: get(&self.written),
            dropped: get(&self.dropped),
            failed: get(&self.failed),
            batches: get(&self.batches),
            interrupted_at_start: get(&self.interrupted_at_start),
        }
    }
}

/// Handle to the store's writer thread. Dropping the last handle lets the thread finish
/// the queued writes and exit.
#[derive(Debug, Clone)]
pub struct RunStore {
    tx: SyncSender<Op>,
    counters: Arc<Counters>,
}

/// Owns the store's thread; join it at shutdown so queued writes land.
#[derive(Debug)]
pub struct StoreThread(Option<JoinHandle<()>>);

impl StoreThread {
    pub fn join(mut self) {
        if let Some(handle) = self.0.take() {
            let _ = handle.join();
        }
    }
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Creates the run store's file with mode 0600 if it is missing (SQLite gives its WAL and
/// shared-memory files the same mode) and tightens an existing one: it holds prompts and
/// answers. For a `file:` URI (the default) the file it names; an in-memory database is
/// left alone.
fn create_private(db: &str) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let Some(path) = file_of(db) else {
        return Ok(());
    };
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

/// The file `db` (a path or a `file:` URI) names, if it names one.
fn file_of(db: &str) -> Option<&str> {
    let Some(uri) = db.strip_prefix("file:") else {
        return (!db.is_empty() && db != ":memory:").then_some(db);
    };
    let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
    if query.split('&').any(|p| p == "mode=memory") {
        return None;
    }
    // file:///abs/path and file://localhost/abs/path name /abs/path.
    let path = match path.strip_prefix("//") {
        Some(rest) => &rest[rest.find('/')?..],
        None => path,
    };
    (!path.is_empty() && path != ":memory:" && !path.contains('%')).then_some(path)
}

impl RunStore {
    /// Opens (creating if needed) the database at `db`, a path or a `file:` URI, and marks
    /// the runs a previous process left `running` as `interrupted`.
    pub fn open(db: &str) -> Result<(Self, StoreThread), StoreError> {
        Self::open_with_queue(db, STORE_QUEUE)
    }

    fn open_with_queue(db: &str, queue: usize) -> Result<(Self, StoreThread), StoreError> {
        let err = |source: rusqlite::Error| StoreError {
            db: db.to_string(),
            source: source.into(),
        };
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_URI
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        create_private(db).map_err(|e| StoreError {
            db: db.to_string(),
            source: e.into(),
        })?;
        let conn = Connection::open_with_flags(db, flags).map_err(err)?;
        conn.busy_timeout(Duration::from_secs(5)).map_err(err)?;
        conn.execute_batch(SCHEMA).map_err(err)?;
        let interrupted = conn
            .execute(
                "UPDATE runs SET status = ?1, finished_at = ?2, error = ?3 WHERE status = 'running'",
                params![
                    RunStatus::Interrupted.as_str(),
                    now_ms(),
                    INTERRUPTED_REASON
                ],
            )
            .map_err(err)?;
        if interrupted > 0 {
            tracing::warn!(
                runs = interrupted,
                "runs a previous node process left running are marked interrupted"
            );
        }
        let counters = Arc::new(Counters::default());
        counters
            .interrupted_at_start
            .store(interrupted as u64, Ordering::Relaxed);
        let (tx, rx) = mpsc::sync_channel(queue);
        let thread_counters = counters.clone();
        let handle = std::thread::Builder::new()
            .name("iop-run-store".into())
            .spawn(move || Writer::new(conn, thread_counters).run(rx))
            .expect("spawn the run store thread");
        Ok((Self { tx, counters }, StoreThread(Some(handle))))
    }

    fn submit(&self, record: RunRecord) {
        if self.tx.try_send(Op::Write(Box::new(record))).is_err() {
            // Full or closed: counted here, summarised by the writer's report.
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records a run as started; keep the returned row for [`RunStore::finished`].
    pub fn started(
        &self,
        run_id: &str,
        adapter: &str,
        target: &str,
        session_id: &str,
        background: bool,
    ) -> RunRecord {
        let row = RunRecord {
            run_id: run_id.to_string(),
            adapter: adapter.to_string(),
            target: target.to_string(),
            session_id: session_id.to_string(),
            background,
            status: RunStatus::Running.as_str().to_string(),
            started_at_ms: now_ms(),
            finished_at_ms: None,
            error: None,
        };
        self.submit(row.clone());
        row
    }

    /// Records how a run ended: the whole row, so it lands even if its start was lost.
    pub fn finished(&self, mut row: RunRecord, status: RunStatus, error: Option<String>) {
        row.status = status.as_str().to_string();
        row.finished_at_ms = Some(now_ms());
        row.error = error;
        self.submit(row);
    }

    /// The most recent runs, newest first (empty if the store cannot answer).
    pub async fn recent(&self, limit: usize) -> Vec<RunRecord> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        match self.tx.try_send(Op::Recent { limit, reply }) {
            Ok(()) => rx.await.unwrap_or_default(),
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => Vec::new(),
        }
    }

    pub fn stats(&self) -> StoreStats {
        self.counters.snapshot()
    }
}

/// The writer thread: batches, one transaction each, and the periodic loss report.
struct Writer {
    conn: Connection,
    counters: Arc<Counters>,
    /// Losses already reported, and when.
    reported: (u64, u64),
    last_report: Option<Instant>,
    last_error: Option<String>,
}

impl Writer {
    fn new(conn: Connection, counters: Arc<Counters>) -> Self {
        Self {
            conn,
            counters,
            reported: (0, 0),
            last_report: None,
            last_error: None,
        }
    }

    fn run(mut self, rx: Receiver<Op>) {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        loop {
            match rx.recv_timeout(REPORT_EVERY) {
                Ok(op) => batch.push(op),
                Err(RecvTimeoutError::Timeout) => {
                    self.report(false);
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => break,
            }
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(op) => batch.push(op),
                    Err(_) => break,
                }
            }
            self.apply(&mut batch);
            self.report(false);
        }
        self.report(true);
    }

    /// Writes the batch's records in order, answering queries where they were queued.
    fn apply(&mut self, batch: &mut Vec<Op>) {
        let mut rows = Vec::new();
        for op in batch.drain(..) {
            match op {
                Op::Write(row) => rows.push(*row),
                Op::Recent { limit, reply } => {
                    self.write(&mut rows);
                    match recent(&self.conn, limit) {
                        Ok(found) => {
                            let _ = reply.send(found);
                        }
                        Err(e) => self.last_error = Some(e.to_string()),
                    }
                }
            }
        }
        self.write(&mut rows);
    }

    fn write(&mut self, rows: &mut Vec<RunRecord>) {
        if rows.is_empty() {
            return;
        }
        match write_batch(&mut self.conn, rows) {
            Ok(()) => {
                self.counters
                    .written
                    .fetch_add(rows.len() as u64, Ordering::Relaxed);
                self.counters.batches.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                // One bad record must not cost the batch: retry them one by one.
                self.last_error = Some(e.to_string());
                for row in rows.iter() {
                    match upsert(&self.conn, row) {
                        Ok(()) => self.counters.written.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            self.last_error = Some(e.to_string());
                            self.counters.failed.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                }
            }
        }
        rows.clear();
    }

    /// Logs what was lost since the last report: the first loss at once, then at most
    /// every [`REPORT_EVERY`]; `last` reports whatever is left.
    fn report(&mut self, last: bool) {
        let stats = self.counters.snapshot();
        let (dropped, failed) = (
            stats.dropped - self.reported.0,
            stats.failed - self.reported.1,
        );
        if dropped == 0 && failed == 0 {
            return;
        }
        let due = self
            .last_report
            .is_none_or(|at| at.elapsed() >= REPORT_EVERY);
        if !due && !last {
            return;
        }
        if failed > 0 {
            tracing::warn!(
                failed,
                total_failed = stats.failed,
                error = self.last_error.as_deref().unwrap_or(""),
                "run store write failed: records not written since the last report"
            );
        }
        if dropped > 0 {
            tracing::warn!(
                dropped,
                total_dropped = stats.dropped,
                queue = STORE_QUEUE,
                "run store queue full: records dropped since the last report"
            );
        }
        self.reported = (stats.dropped, stats.failed);
        self.last_report = Some(Instant::now());
    }
}

fn write_batch(conn: &mut Connection, rows: &[RunRecord]) -> rusqlite::Result<()> {
    let tx = conn.transaction()?;
    for row in rows {
        upsert(&tx, row)?;
    }
    tx.commit()
}

fn upsert(conn: &Connection, r: &RunRecord) -> rusqlite::Result<()> {
    conn.prepare_cached(UPSERT)?.execute(params![
        r.run_id,
        r.adapter,
        r.target,
        r.session_id,
        r.background,
        r.status,
        r.started_at_ms,
        r.finished_at_ms,
        r.error
    ])?;
    Ok(())
}

fn recent(conn: &Connection, limit: usize) -> rusqlite::Result<Vec<RunRecord>> {
    let mut stmt = conn.prepare_cached(
        "SELECT run_id, adapter, target, session_id, background, status, started_at, finished_at, error
         FROM runs ORDER BY started_at DESC, rowid DESC LIMIT ?1",
    )?;
    stmt.query_map(params![limit as i64], |row| {
        Ok(RunRecord {
            run_id: row.get(0)?,
            adapter: row.get(1)?,
            target: row.get(2)?,
            session_id: row.get(3)?,
            background: row.get(4)?,
            status: row.get(5)?,
            started_at_ms: row.get(6)?,
            finished_at_ms: row.get(7)?,
            error: row.get(8)?,
        })
    })?
    .collect()
}

#[cfg(test)]
mod tests;
