//! The run store against real SQLite files: rows, batching, losses counted, and runs a
//! dead process left `running` marked `interrupted`.

use super::*;

fn open(dir: &tempfile::TempDir) -> (RunStore, StoreThread) {
    RunStore::open(dir.path().join("runs.db").to_str().unwrap()).unwrap()
}

fn rows_in(dir: &tempfile::TempDir) -> Vec<(String, String, Option<i64>, Option<String>)> {
    let db = Connection::open(dir.path().join("runs.db")).unwrap();
    let mut stmt = db
        .prepare("SELECT run_id, status, finished_at, error FROM runs ORDER BY run_id")
        .unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap()
}

#[test]
fn the_store_and_its_journal_are_private_to_the_node() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("runs.db");
    // An existing file readable by others is tightened too.
    std::fs::write(&path, b"").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (store, thread) = open(&dir);
    store.started("r1", "mock", "m", "", false);
    drop(store);
    thread.join();
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let entry = entry.unwrap();
        let mode = entry.metadata().unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", entry.path().display());
    }
}

#[test]
fn the_file_a_uri_names_is_made_private() {
    assert_eq!(file_of("runs.db"), Some("runs.db"));
    assert_eq!(file_of("file:iop.db?cache=shared&mode=rwc"), Some("iop.db"));
    assert_eq!(
        file_of("file:///var/lib/iop/runs.db"),
        Some("/var/lib/iop/runs.db")
    );
    assert_eq!(file_of("file://localhost/x.db"), Some("/x.db"));
    assert_eq!(file_of("file:x?mode=memory&cache=shared"), None);
    assert_eq!(file_of(":memory:"), None);
    assert_eq!(file_of("file::memory:"), None);
}

#[tokio::test]
async fn one_row_per_run_with_its_final_status() {
    let dir = tempfile::tempdir().unwrap();
    let (store, thread) = open(&dir);
    let r1 = store.started("r1", "mock", "m", "", false);
    let r2 = store.started("r2", "cli", "t", "s1", true);
    store.finished(r1, RunStatus::Completed, None);
    store.finished(r2, RunStatus::Failed, Some("exit 3".into()));
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
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.path().join("iop.db"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn an_unopenable_database_names_itself() {
    let err = RunStore::open("/nonexistent-dir/x/runs.db")
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent-dir/x/runs.db"), "{err}");
}

#[test]
fn a_finished_record_lands_even_when_its_start_was_lost() {
    let dir = tempfile::tempdir().unwrap();
    let (store, thread) = open(&dir);
    let row = RunRecord {
        run_id: "r".into(),
        adapter: "mock".into(),
        target: "m".into(),
        session_id: String::new(),
        background: false,
        status: "running".into(),
        started_at_ms: 5,
        finished_at_ms: None,
        error: None,
    };
    store.finished(row, RunStatus::Cancelled, Some("client left".into()));
    drop(store);
    thread.join();
    let rows = rows_in(&dir);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].1, "cancelled");
    assert!(rows[0].2.is_some());
}

/// Holds the database's write lock from another connection until dropped: the writer
/// thread waits on its first transaction while records pile up in the queue.
struct WriteLock(Connection);

impl WriteLock {
    fn take(dir: &tempfile::TempDir) -> Self {
        let db = Connection::open(dir.path().join("runs.db")).unwrap();
        db.execute_batch("BEGIN EXCLUSIVE").unwrap();
        Self(db)
    }
}

impl Drop for WriteLock {
    fn drop(&mut self) {
        self.0.execute_batch("COMMIT").unwrap();
    }
}

#[test]
fn a_storm_is_written_in_a_few_transactions_and_nothing_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let (store, thread) = open(&dir);
    let runs = 5_000;
    {
        let _lock = WriteLock::take(&dir);
        for i in 0..runs {
            let row = store.started(&format!("r{i:05}"), "mock", "m", "", false);
            store.finished(row, RunStatus::Cancelled, Some("client left".into()));
        }
    }
    let counters = store.counters.clone();
    drop(store);
    thread.join();
    let stats = counters.snapshot();
    let records = 2 * runs as u64;
    assert_eq!((stats.dropped, stats.failed), (0, 0), "{stats:?}");
    assert_eq!(stats.written, records);
    // Everything queued while the first transaction waited: full batches from then on.
    assert!(
        stats.batches <= 2 + records / MAX_BATCH as u64,
        "{} transactions for {records} records",
        stats.batches
    );
    let rows = rows_in(&dir);
    assert_eq!(rows.len(), runs);
    assert!(rows.iter().all(|r| r.1 == "cancelled" && r.2.is_some()));
}

#[test]
fn a_full_queue_counts_what_it_drops() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("runs.db");
    let (store, thread) = RunStore::open_with_queue(path.to_str().unwrap(), 8).unwrap();
    {
        let _lock = WriteLock::take(&dir);
        for i in 0..100 {
            store.started(&format!("r{i}"), "mock", "m", "", false);
        }
    }
    let counters = store.counters.clone();
    drop(store);
    thread.join();
    let stats = counters.snapshot();
    assert!(stats.dropped > 0, "{stats:?}");
    assert_eq!(stats.written + stats.dropped, 100, "{stats:?}");
    assert_eq!(rows_in(&dir).len() as u64, stats.written);
}

#[test]
fn runs_left_running_by_a_dead_process_become_interrupted_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let (store, thread) = open(&dir);
    store.started("left", "cli", "t", "s", false);
    let done = store.started("done", "mock", "m", "", false);
    store.finished(done, RunStatus::Completed, None);
    assert_eq!(store.stats().interrupted_at_start, 0);
    // The process "dies": its writes landed, the run never finished.
    drop(store);
    thread.join();
    let before = now_ms();
    let (store, thread) = open(&dir);
    assert_eq!(store.stats().interrupted_at_start, 1);
    drop(store);
    thread.join();
    let rows = rows_in(&dir);
    let (_, status, finished, error) = rows.iter().find(|r| r.0 == "left").unwrap();
    assert_eq!(status, "interrupted");
    assert!(finished.unwrap() >= before);
    assert_eq!(error.as_deref(), Some(INTERRUPTED_REASON));
    let done = rows.iter().find(|r| r.0 == "done").unwrap();
    assert_eq!(done.1, "completed");
    // A third start finds nothing more to mark.
    let (store, thread) = open(&dir);
    assert_eq!(store.stats().interrupted_at_start, 0);
    drop(store);
    thread.join();
}
