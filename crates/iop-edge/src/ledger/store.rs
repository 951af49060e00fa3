//! The ledger's SQLite file (`<state_dir>/usage.db`, mode 0600, WAL): its schema, the
//! batched insert the writer thread uses, and retention (deleting rows older than the
//! configured number of days, a bounded chunk at a time so readers are never held up).

use std::path::Path;

use rusqlite::{Connection, OpenFlags, params};

use super::record::UsageRecord;

/// The ledger's file name in the state directory.
pub const FILE_NAME: &str = "usage.db";

/// Schema version (`PRAGMA user_version`): 2 added the estimated token columns, 3 how
/// the member was picked (`routing`).
const SCHEMA_VERSION: i64 = 3;

/// Rows deleted per statement when pruning.
const PRUNE_CHUNK: i64 = 10_000;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    time_ms INTEGER NOT NULL,
    key TEXT NOT NULL,
    grp TEXT NOT NULL,
    node TEXT NOT NULL,
    provider TEXT NOT NULL,
    path TEXT NOT NULL,
    api TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    est_input_tokens INTEGER,
    est_output_tokens INTEGER,
    latency_ms INTEGER NOT NULL,
    ttft_ms INTEGER,
    outcome TEXT NOT NULL,
    status INTEGER NOT NULL,
    attempts INTEGER NOT NULL,
    routing TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS requests_time ON requests (time_ms);
CREATE INDEX IF NOT EXISTS requests_key_time ON requests (key, time_ms);
";

/// Why the ledger could not be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("usage ledger {path}: {source}")]
    Sqlite {
        path: String,
        #[source]
        source: rusqlite::Error,
    },
    #[error("usage ledger {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "usage ledger {path}: schema version {found} is newer than this edge knows ({SCHEMA_VERSION}); use a newer iop or move the file away"
    )]
    NewerSchema { path: String, found: i64 },
}

/// Creates the file with mode 0600 if it is missing (SQLite gives its WAL and shared-memory
/// files the same mode), and tightens an existing one.
fn create_private(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

/// Opens (creating) the ledger for writing: WAL, the schema, `synchronous=NORMAL` (a
/// commit survives a crash of the edge; a power loss may lose the last batches).
pub fn open_writer(path: &Path) -> Result<Connection, StoreError> {
    let shown = path.display().to_string();
    create_private(path).map_err(|source| StoreError::Io {
        path: shown.clone(),
        source,
    })?;
    let sqlite = |source| StoreError::Sqlite {
        path: shown.clone(),
        source,
    };
    let conn = Connection::open(path).map_err(sqlite)?;
    conn.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(sqlite)?;
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(sqlite)?;
    conn.pragma_update(None, "synchronous", "NORMAL")
        .map_err(sqlite)?;
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |row| row.get(0))
        .map_err(sqlite)?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::NewerSchema {
            path: shown,
            found: version,
        });
    }
    // The upgrade, the schema and the new version in one transaction: an edge stopped
    // half way leaves the file as it was, to be upgraded at the next start.
    let mut upgrade = String::from("BEGIN;");
    if version == 1 {
        // A version 1 file: the estimates are absent from its rows (they were never made).
        upgrade.push_str(
            "ALTER TABLE requests ADD COLUMN est_input_tokens INTEGER;
             ALTER TABLE requests ADD COLUMN est_output_tokens INTEGER;",
        );
    }
    if (1..3).contains(&version) {
        // Rows written before version 3 say nothing of how their member was picked.
        upgrade.push_str("ALTER TABLE requests ADD COLUMN routing TEXT NOT NULL DEFAULT '';");
    }
    upgrade.push_str(SCHEMA);
    upgrade.push_str(&format!("PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"));
    conn.execute_batch(&upgrade).map_err(sqlite)?;
    Ok(conn)
}

/// Opens the ledger for queries (read-only; WAL lets it read while the writer commits).
pub fn open_reader(path: &Path) -> Result<Connection, StoreError> {
    let sqlite = |source| StoreError::Sqlite {
        path: path.display().to_string(),
        source,
    };
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(sqlite)?;
    conn.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(sqlite)?;
    Ok(conn)
}

/// Writes `records` in one transaction.
pub fn insert(conn: &mut Connection, records: &[UsageRecord]) -> rusqlite::Result<()> {
    let tx = conn.transaction()?;
    {
        let mut insert = tx.prepare_cached(
            "INSERT INTO requests (time_ms, key, grp, node, provider, path, api, input_tokens, \
             output_tokens, reasoning_tokens, cached_tokens, est_input_tokens, est_output_tokens, \
             latency_ms, ttft_ms, outcome, status, attempts, routing) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, \
             ?19)",
        )?;
        for r in records {
            insert.execute(params![
                r.time_ms,
                r.key,
                r.group,
                r.node,
                r.provider,
                r.path,
                r.api,
                clamp(r.input_tokens),
                clamp(r.output_tokens),
                clamp(r.reasoning_tokens),
                clamp(r.cached_tokens),
                r.est_input_tokens.map(clamp),
                r.est_output_tokens.map(clamp),
                clamp(r.latency_ms),
                r.ttft_ms.map(clamp),
                r.outcome,
                r.status,
                r.attempts,
                r.routing,
            ])?;
        }
    }
    tx.commit()
}

/// SQLite integers are signed 64-bit.
fn clamp(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Deletes the rows older than `before_ms`, in chunks; returns how many went.
pub fn prune(conn: &Connection, before_ms: i64) -> rusqlite::Result<u64> {
    let mut deleted = 0u64;
    loop {
        let n = conn.execute(
            "DELETE FROM requests WHERE id IN \
             (SELECT id FROM requests WHERE time_ms < ?1 LIMIT ?2)",
            params![before_ms, PRUNE_CHUNK],
        )?;
        deleted += n as u64;
        if (n as i64) < PRUNE_CHUNK {
            return Ok(deleted);
        }
    }
}
