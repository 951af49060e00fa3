//! The store's schema, versioned: each migration runs once, in order, in one transaction
//! under an advisory lock, so edges starting together do not race. The version reached is
//! kept in `iop_schema`.

use tokio_postgres::Client;

/// Serializes migrations across edges (`pg_advisory_xact_lock`).
const LOCK: i64 = 0x696f_7073_746f_7265; // "iopstore"

/// The migrations, version 1 first. Never edit one that shipped: add the next.
const MIGRATIONS: &[&str] = &[
    // 1: the edges of the fleet, each refreshing its row while it runs.
    "CREATE TABLE iop_edges (
        id TEXT PRIMARY KEY,
        http TEXT NOT NULL,
        nodes TEXT NOT NULL,
        version TEXT NOT NULL,
        started_unix_ms BIGINT NOT NULL,
        seen TIMESTAMPTZ NOT NULL
    )",
    // 2: node trust shared by the fleet (the CA, join tokens, revocations), and what each
    // edge tells the others: the address nodes dial it at and the nodes linked to it.
    "CREATE TABLE iop_ca (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        cert_pem TEXT NOT NULL,
        key_sealed BYTEA NOT NULL,
        key_check TEXT NOT NULL,
        created TIMESTAMPTZ NOT NULL DEFAULT now()
    );
    CREATE TABLE iop_join_tokens (
        id TEXT PRIMARY KEY,
        node_id TEXT NOT NULL,
        secret_sha256 TEXT NOT NULL,
        created_unix_ms BIGINT NOT NULL,
        expires_unix_ms BIGINT NOT NULL,
        max_uses INTEGER NOT NULL,
        uses_left INTEGER NOT NULL CHECK (uses_left >= 0)
    );
    CREATE INDEX iop_join_tokens_node ON iop_join_tokens (node_id);
    CREATE TABLE iop_revocations (
        seq BIGSERIAL PRIMARY KEY,
        node_id TEXT NOT NULL,
        revoked_unix_ms BIGINT NOT NULL,
        token_sha256 TEXT
    );
    ALTER TABLE iop_edges ADD COLUMN node_address TEXT NOT NULL DEFAULT '';
    ALTER TABLE iop_edges ADD COLUMN linked TEXT[] NOT NULL DEFAULT '{}'",
];

/// Brings the schema up to date; returns the version it is at.
pub async fn apply(client: &Client) -> Result<usize, String> {
    let fail = |what: &str, e: tokio_postgres::Error| format!("{what}: {}", super::reason(&e));
    // One transaction: the lock, the version table, every migration and the new version.
    client
        .batch_execute("BEGIN")
        .await
        .map_err(|e| fail("store migration", e))?;
    let result = async {
        client
            .execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK])
            .await
            .map_err(|e| fail("store migration lock", e))?;
        client
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS iop_schema (version INTEGER NOT NULL);
                 INSERT INTO iop_schema (version)
                     SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM iop_schema)",
            )
            .await
            .map_err(|e| fail("store schema table", e))?;
        let row = client
            .query_one("SELECT version FROM iop_schema", &[])
            .await
            .map_err(|e| fail("store schema version", e))?;
        let at = row.get::<_, i32>(0).max(0) as usize;
        if at > MIGRATIONS.len() {
            return Err(format!(
                "the store's schema is at version {at}, newer than this edge knows ({}): \
                 upgrade this edge",
                MIGRATIONS.len()
            ));
        }
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(at) {
            client
                .batch_execute(sql)
                .await
                .map_err(|e| fail(&format!("store migration {}", i + 1), e))?;
        }
        client
            .execute(
                "UPDATE iop_schema SET version = $1",
                &[&(MIGRATIONS.len() as i32)],
            )
            .await
            .map_err(|e| fail("store schema version", e))?;
        Ok(MIGRATIONS.len())
    }
    .await;
    let end = if result.is_ok() { "COMMIT" } else { "ROLLBACK" };
    client
        .batch_execute(end)
        .await
        .map_err(|e| fail("store migration", e))?;
    result
}
