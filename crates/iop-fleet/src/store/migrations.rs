//! The store's schema, versioned: each migration runs once, in order, in one transaction
//! under an advisory lock, so edges starting together do not race. The version reached is
//! kept in `iop_schema`.

use tokio_postgres::Client;

use super::error::StoreError;

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
    // 3: API key limits held across the fleet: the requests of the last minute, what each
    // live edge has in flight and reserved per key, the tokens of each UTC day; one
    // function decides an admission under a per-key lock.
    "CREATE TABLE iop_key_requests (key TEXT NOT NULL, at TIMESTAMPTZ NOT NULL);
    CREATE INDEX iop_key_requests_key_at ON iop_key_requests (key, at);
    CREATE TABLE iop_key_inflight (
        key TEXT NOT NULL,
        edge_id TEXT NOT NULL,
        n INTEGER NOT NULL,
        reserved BIGINT NOT NULL,
        PRIMARY KEY (key, edge_id)
    );
    CREATE TABLE iop_key_tokens (
        key TEXT NOT NULL,
        day DATE NOT NULL,
        used BIGINT NOT NULL,
        PRIMARY KEY (key, day)
    );
    CREATE FUNCTION iop_key_admit(p_key TEXT, p_edge TEXT, p_rpm INTEGER, p_max INTEGER,
                                  p_budget BIGINT, p_reserve BIGINT, p_live_secs DOUBLE PRECISION)
    RETURNS TABLE (refused TEXT, retry_after_ms BIGINT) AS $$
    DECLARE
        t TIMESTAMPTZ;
        n_recent INTEGER;
        oldest TIMESTAMPTZ;
        n_flight BIGINT := 0;
        n_reserved BIGINT := 0;
        used_today BIGINT := 0;
    BEGIN
        PERFORM pg_advisory_xact_lock(hashtext('iop_key:' || p_key));
        t := clock_timestamp();
        IF p_max IS NOT NULL OR p_budget IS NOT NULL THEN
            SELECT COALESCE(sum(f.n), 0), COALESCE(sum(f.reserved), 0)
              INTO n_flight, n_reserved
              FROM iop_key_inflight f
              JOIN iop_edges e ON e.id = f.edge_id
                              AND e.seen > t - make_interval(secs => p_live_secs)
             WHERE f.key = p_key;
        END IF;
        IF p_max IS NOT NULL AND n_flight >= p_max THEN
            RETURN QUERY SELECT 'max_concurrent'::TEXT, 1000::BIGINT;
            RETURN;
        END IF;
        IF p_budget IS NOT NULL THEN
            SELECT COALESCE(max(used), 0) INTO used_today FROM iop_key_tokens
             WHERE key = p_key AND day = (t AT TIME ZONE 'UTC')::date;
            IF used_today + n_reserved >= p_budget THEN
                RETURN QUERY SELECT 'tokens_per_day'::TEXT,
                    (EXTRACT(EPOCH FROM (date_trunc('day', t AT TIME ZONE 'UTC')
                        + interval '1 day' - (t AT TIME ZONE 'UTC'))) * 1000)::BIGINT;
                RETURN;
            END IF;
        END IF;
        IF p_rpm IS NOT NULL THEN
            DELETE FROM iop_key_requests WHERE key = p_key AND at <= t - interval '60 seconds';
            SELECT count(*), min(r.at) INTO n_recent, oldest FROM (
                SELECT at FROM iop_key_requests WHERE key = p_key ORDER BY at DESC LIMIT p_rpm
            ) r;
            IF n_recent >= p_rpm THEN
                RETURN QUERY SELECT 'requests_per_minute'::TEXT,
                    GREATEST(0, EXTRACT(EPOCH FROM (oldest + interval '60 seconds' - t)) * 1000)::BIGINT;
                RETURN;
            END IF;
            INSERT INTO iop_key_requests (key, at) VALUES (p_key, t);
        END IF;
        IF p_max IS NOT NULL OR p_budget IS NOT NULL THEN
            INSERT INTO iop_key_inflight (key, edge_id, n, reserved)
            VALUES (p_key, p_edge, CASE WHEN p_max IS NULL THEN 0 ELSE 1 END,
                    CASE WHEN p_budget IS NULL THEN 0 ELSE COALESCE(p_reserve, 0) END)
            ON CONFLICT (key, edge_id) DO UPDATE
                SET n = iop_key_inflight.n + EXCLUDED.n,
                    reserved = iop_key_inflight.reserved + EXCLUDED.reserved;
        END IF;
        RETURN QUERY SELECT NULL::TEXT, 0::BIGINT;
    END
    $$ LANGUAGE plpgsql",
    // 4: the fleet's usage ledger: every edge's records, keyed by (edge, local id).
    "CREATE TABLE iop_usage (
        edge_id TEXT NOT NULL,
        id BIGINT NOT NULL,
        time_ms BIGINT NOT NULL,
        key TEXT NOT NULL,
        grp TEXT NOT NULL,
        node TEXT NOT NULL,
        provider TEXT NOT NULL,
        path TEXT NOT NULL,
        api TEXT NOT NULL,
        input_tokens BIGINT NOT NULL,
        output_tokens BIGINT NOT NULL,
        reasoning_tokens BIGINT NOT NULL,
        cached_tokens BIGINT NOT NULL,
        est_input_tokens BIGINT,
        est_output_tokens BIGINT,
        latency_ms BIGINT NOT NULL,
        ttft_ms BIGINT,
        outcome TEXT NOT NULL,
        status BIGINT NOT NULL,
        attempts BIGINT NOT NULL,
        PRIMARY KEY (edge_id, id)
    );
    CREATE INDEX iop_usage_time ON iop_usage (time_ms);
    CREATE INDEX iop_usage_key_time ON iop_usage (key, time_ms)",
    // 5: how each request's member was picked (`session/hit`, …; empty for older rows).
    "ALTER TABLE iop_usage ADD COLUMN routing TEXT NOT NULL DEFAULT ''",
    // 6: an edge gives places and reservations back by its running totals of what it
    // released (never by writing its count whole), under the admission's per-key lock; a
    // total sent twice takes off nothing the second time.
    "ALTER TABLE iop_key_inflight ADD COLUMN released_n BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE iop_key_inflight ADD COLUMN released_reserved BIGINT NOT NULL DEFAULT 0;
    CREATE FUNCTION iop_key_release(p_key TEXT, p_edge TEXT, p_places BIGINT,
                                    p_reserved BIGINT)
    RETURNS VOID AS $$
    BEGIN
        PERFORM pg_advisory_xact_lock(hashtext('iop_key:' || p_key));
        UPDATE iop_key_inflight
           SET n = GREATEST(n - GREATEST(p_places - released_n, 0), 0),
               reserved = GREATEST(reserved - GREATEST(p_reserved - released_reserved, 0), 0),
               released_n = GREATEST(released_n, p_places),
               released_reserved = GREATEST(released_reserved, p_reserved)
         WHERE key = p_key AND edge_id = p_edge;
    END
    $$ LANGUAGE plpgsql;
    -- The admission again, also refusing a prompt (p_input tokens, estimated) larger than
    -- what is left of the day's budget. The 7-argument one stays for edges not upgraded.
    CREATE FUNCTION iop_key_admit(p_key TEXT, p_edge TEXT, p_rpm INTEGER, p_max INTEGER,
                                  p_budget BIGINT, p_reserve BIGINT, p_live_secs DOUBLE PRECISION,
                                  p_input BIGINT)
    RETURNS TABLE (refused TEXT, retry_after_ms BIGINT) AS $$
    DECLARE
        t TIMESTAMPTZ;
        n_recent INTEGER;
        oldest TIMESTAMPTZ;
        n_flight BIGINT := 0;
        n_reserved BIGINT := 0;
        used_today BIGINT := 0;
    BEGIN
        PERFORM pg_advisory_xact_lock(hashtext('iop_key:' || p_key));
        t := clock_timestamp();
        IF p_max IS NOT NULL OR p_budget IS NOT NULL THEN
            SELECT COALESCE(sum(f.n), 0), COALESCE(sum(f.reserved), 0)
              INTO n_flight, n_reserved
              FROM iop_key_inflight f
              JOIN iop_edges e ON e.id = f.edge_id
                              AND e.seen > t - make_interval(secs => p_live_secs)
             WHERE f.key = p_key;
        END IF;
        IF p_max IS NOT NULL AND n_flight >= p_max THEN
            RETURN QUERY SELECT 'max_concurrent'::TEXT, 1000::BIGINT;
            RETURN;
        END IF;
        IF p_budget IS NOT NULL THEN
            SELECT COALESCE(max(used), 0) INTO used_today FROM iop_key_tokens
             WHERE key = p_key AND day = (t AT TIME ZONE 'UTC')::date;
            IF used_today + n_reserved >= p_budget
               OR COALESCE(p_input, 0) > p_budget - used_today - n_reserved THEN
                RETURN QUERY SELECT 'tokens_per_day'::TEXT,
                    (EXTRACT(EPOCH FROM (date_trunc('day', t AT TIME ZONE 'UTC')
                        + interval '1 day' - (t AT TIME ZONE 'UTC'))) * 1000)::BIGINT;
                RETURN;
            END IF;
        END IF;
        IF p_rpm IS NOT NULL THEN
            DELETE FROM iop_key_requests WHERE key = p_key AND at <= t - interval '60 seconds';
            SELECT count(*), min(r.at) INTO n_recent, oldest FROM (
                SELECT at FROM iop_key_requests WHERE key = p_key ORDER BY at DESC LIMIT p_rpm
            ) r;
            IF n_recent >= p_rpm THEN
                RETURN QUERY SELECT 'requests_per_minute'::TEXT,
                    GREATEST(0, EXTRACT(EPOCH FROM (oldest + interval '60 seconds' - t)) * 1000)::BIGINT;
                RETURN;
            END IF;
            INSERT INTO iop_key_requests (key, at) VALUES (p_key, t);
        END IF;
        IF p_max IS NOT NULL OR p_budget IS NOT NULL THEN
            INSERT INTO iop_key_inflight (key, edge_id, n, reserved)
            VALUES (p_key, p_edge, CASE WHEN p_max IS NULL THEN 0 ELSE 1 END,
                    CASE WHEN p_budget IS NULL THEN 0 ELSE COALESCE(p_reserve, 0) END)
            ON CONFLICT (key, edge_id) DO UPDATE
                SET n = iop_key_inflight.n + EXCLUDED.n,
                    reserved = iop_key_inflight.reserved + EXCLUDED.reserved;
        END IF;
        RETURN QUERY SELECT NULL::TEXT, 0::BIGINT;
    END
    $$ LANGUAGE plpgsql",
];

/// Brings the schema up to date; returns the version it is at.
pub async fn apply(client: &Client) -> Result<usize, StoreError> {
    let fail = |what: &str, e: tokio_postgres::Error| StoreError::statement(what, &e);
    // One transaction: the lock, the version table, every migration and the new version.
    client
        .batch_execute("BEGIN")
        .await
        .map_err(|e| fail("migration", e))?;
    let result = async {
        client
            .execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK])
            .await
            .map_err(|e| fail("migration lock", e))?;
        client
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS iop_schema (version INTEGER NOT NULL);
                 INSERT INTO iop_schema (version)
                     SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM iop_schema)",
            )
            .await
            .map_err(|e| fail("schema table", e))?;
        let row = client
            .query_one("SELECT version FROM iop_schema", &[])
            .await
            .map_err(|e| fail("schema version", e))?;
        let at = row.get::<_, i32>(0).max(0) as usize;
        if at > MIGRATIONS.len() {
            return Err(StoreError::Unusable(format!(
                "the store's schema is at version {at}, newer than this edge knows ({}): \
                 upgrade this edge",
                MIGRATIONS.len()
            )));
        }
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(at) {
            client
                .batch_execute(sql)
                .await
                .map_err(|e| fail(&format!("migration {}", i + 1), e))?;
        }
        client
            .execute(
                "UPDATE iop_schema SET version = $1",
                &[&(MIGRATIONS.len() as i32)],
            )
            .await
            .map_err(|e| fail("schema version", e))?;
        Ok(MIGRATIONS.len())
    }
    .await;
    let end = if result.is_ok() { "COMMIT" } else { "ROLLBACK" };
    client
        .batch_execute(end)
        .await
        .map_err(|e| fail("migration", e))?;
    result
}
