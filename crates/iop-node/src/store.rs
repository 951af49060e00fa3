//! The node's local run store: one SQLite row per run (id, adapter, target, session id,
//! background flag, status, start/finish timestamps, error).
//!
//! A dedicated thread owns the connection and applies writes from a bounded queue, so no
//! write ever sits on the event relay path. When the queue is full or SQLite fails, the
//! failure is logged and the run goes on; the store is a record, not a dependency.

use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OpenFlags, params};
use serde::Serialize;

/// Writes queued before new ones are dropped (with a warning).
const STORE_QUEUE: usize = 4096;

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
";

/// How a run ended, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStatus {
    Running,
    Completed,
    Failed,
    Cancelled,
}

impl RunStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Completed => "completed",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
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
    Started(RunRecord),
    Finished {
        run_id: String,
        status: RunStatus,
        error: Option<String>,
        at_ms: i64,
    },
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
    source: rusqlite::Error,
}

/// Handle to the store's writer thread. Dropping the last handle lets the thread finish
/// the queued writes and exit.
#[derive(Debug, Clone)]
pub struct RunStore {
    tx: SyncSender<Op>,
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

impl RunStore {
    /// Opens (creating if needed) the database at `db`, a path or a `file:` URI.
    pub fn open(db: &str) -> Result<(Self, StoreThread), StoreError> {
        let err = |source| StoreError {
            db: db.to_string(),
            source,
        };
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_URI
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(db, flags).map_err(err)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(err)?;
        conn.execute_batch(SCHEMA).map_err(err)?;
        let (tx, rx) = mpsc::sync_channel(STORE_QUEUE);
        let handle = std::thread::Builder::new()
            .name("iop-run-store".into())
            .spawn(move || writer(conn, rx))
            .expect("spawn the run store thread");
        Ok((Self { tx }, StoreThread(Some(handle))))
    }

    fn submit(&self, op: Op) {
        match self.tx.try_send(op) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                tracing::warn!("run store queue full: a run record was dropped");
            }
            Err(TrySendError::Disconnected(_)) => {
                tracing::warn!("run store is closed: a run record was dropped");
            }
        }
    }

    pub fn started(
        &self,
        run_id: &str,
        adapter: &str,
        target: &str,
        session_id: &str,
        background: bool,
    ) {
        self.submit(Op::Started(RunRecord {
            run_id: run_id.to_string(),
            adapter: adapter.to_string(),
            target: target.to_string(),
            session_id: session_id.to_string(),
            background,
            status: RunStatus::Running.as_str().to_string(),
            started_at_ms: now_ms(),
            finished_at_ms: None,
            error: None,
        }));
    }

    pub fn finished(&self, run_id: &str, status: RunStatus, error: Option<String>) {
        self.submit(Op::Finished {
            run_id: run_id.to_string(),
            status,
            error,
            at_ms: now_ms(),
        });
    }

    /// The most recent runs, newest first.
    pub async fn recent(&self, limit: usize) -> Vec<RunRecord> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.submit(Op::Recent { limit, reply });
        rx.await.unwrap_or_default()
    }
}

fn writer(conn: Connection, rx: Receiver<Op>) {
    while let Ok(op) = rx.recv() {
        if let Err(err) = apply(&conn, op) {
            tracing::warn!(%err, "run store write failed");
        }
    }
}

fn apply(conn: &Connection, op: Op) -> rusqlite::Result<()> {
    match op {
        Op::Started(r) => {
            conn.execute(
                "INSERT OR REPLACE INTO runs (run_id, adapter, target, session_id, background, status, started_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                params![r.run_id, r.adapter, r.target, r.session_id, r.background, r.status, r.started_at_ms],
            )?;
        }
        Op::Finished {
            run_id,
            status,
            error,
            at_ms,
        } => {
            conn.execute(
                "UPDATE runs SET status = ?2, finished_at = ?3, error = ?4 WHERE run_id = ?1",
                params![run_id, status.as_str(), at_ms, error],
            )?;
        }
        Op::Recent { limit, reply } => {
            let mut stmt = conn.prepare(
                "SELECT run_id, adapter, target, session_id, background, status, started_at, finished_at, error
                 FROM runs ORDER BY started_at DESC, rowid DESC LIMIT ?1",
            )?;
            let rows = stmt
                .query_map(params![limit as i64], |row| {
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
                .collect::<rusqlite::Result<Vec<_>>>()?;
            let _ = reply.send(rows);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_row_per_run_with_its_final_status() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("runs.db");
        let (store, thread) = RunStore::open(db.to_str().unwrap()).unwrap();
        store.started("r1", "mock", "m", "", false);
        store.started("r2", "cli", "t", "s1", true);
        store.finished("r1", RunStatus::Completed, None);
        store.finished("r2", RunStatus::Failed, Some("exit 3".into()));
        let rows = store.recent(10).await;
        assert_eq!(rows.len(), 2);
        let r1 = rows.iter().find(|r| r.run_id == "r1").unwrap();
        assert_eq!(r1.status, "completed");
        assert!(r1.finished_at_ms.is_some());
        let r2 = rows.iter().find(|r| r.run_id == "r2").unwrap();
        assert_eq!(
            (r2.status.as_str(), r2.error.as_deref()),
            ("failed", Some("exit 3"))
        );
        assert!(r2.background);
        assert_eq!(r2.session_id, "s1");
        drop(store);
        thread.join();
    }

    #[tokio::test]
    async fn the_spec_default_uri_form_opens() {
        let dir = tempfile::tempdir().unwrap();
        let uri = format!(
            "file:{}?cache=shared&mode=rwc",
            dir.path().join("iop.db").display()
        );
        let (store, thread) = RunStore::open(&uri).unwrap();
        store.started("r", "mock", "m", "", false);
        assert_eq!(store.recent(1).await.len(), 1);
        drop(store);
        thread.join();
        assert!(dir.path().join("iop.db").exists());
    }

    #[test]
    fn an_unopenable_database_names_itself() {
        let err = RunStore::open("/nonexistent-dir/x/runs.db")
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent-dir/x/runs.db"), "{err}");
    }
}
