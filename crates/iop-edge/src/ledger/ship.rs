//! The fleet's usage ledger: in a fleet (edges sharing a store) every edge copies its
//! records into the store's `iop_usage` table, so one query sees the whole fleet's use.
//! The local SQLite file is the spool: records are committed there first, as always, and
//! shipped from it in order, [`BATCH`] at a time, every [`EVERY`], with the store's
//! statements ([`crate::store::usage`]). A record is keyed by (edge, its local id) and
//! inserted with `ON CONFLICT DO NOTHING`, and where to go on from is read back from the
//! store (the highest id it holds for this edge) whenever the store was unreachable: a record is neither lost while the store is down nor counted
//! twice when a batch is sent again. [`summarize_fleet`] sums the fleet's records (what
//! `/admin/usage?scope=fleet` answers).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::LedgerReader;
use crate::store::Store;
use crate::store::StoreError;
use crate::store::usage::{UsageColumns, insert, shipped};

/// How often new records are shipped.
pub const EVERY: Duration = Duration::from_secs(1);
/// The most records one insert carries.
pub const BATCH: usize = 1000;

/// The local records after `after`, oldest first, at most [`BATCH`].
fn local_after(conn: &rusqlite::Connection, after: i64) -> rusqlite::Result<UsageColumns> {
    let mut statement = conn.prepare_cached(
        "SELECT id, time_ms, key, grp, node, provider, path, api, input_tokens,
                output_tokens, reasoning_tokens, cached_tokens, est_input_tokens,
                est_output_tokens, latency_ms, ttft_ms, outcome, status, attempts, routing
         FROM requests WHERE id > ?1 ORDER BY id LIMIT ?2",
    )?;
    let mut rows = statement.query(rusqlite::params![after, BATCH as i64])?;
    let mut c = UsageColumns::default();
    while let Some(row) = rows.next()? {
        c.id.push(row.get(0)?);
        c.time_ms.push(row.get(1)?);
        c.key.push(row.get(2)?);
        c.grp.push(row.get(3)?);
        c.node.push(row.get(4)?);
        c.provider.push(row.get(5)?);
        c.path.push(row.get(6)?);
        c.api.push(row.get(7)?);
        c.input_tokens.push(row.get(8)?);
        c.output_tokens.push(row.get(9)?);
        c.reasoning_tokens.push(row.get(10)?);
        c.cached_tokens.push(row.get(11)?);
        c.est_input_tokens.push(row.get(12)?);
        c.est_output_tokens.push(row.get(13)?);
        c.latency_ms.push(row.get(14)?);
        c.ttft_ms.push(row.get(15)?);
        c.outcome.push(row.get(16)?);
        c.status.push(row.get(17)?);
        c.attempts.push(row.get(18)?);
        c.routing.push(row.get(19)?);
    }
    Ok(c)
}

/// Ships this edge's records to the store until `shutdown` (and once more then).
pub async fn run(
    reader: LedgerReader,
    store: Arc<Store>,
    edge_id: String,
    shutdown: CancellationToken,
) {
    // Where to go on from: unknown until the store says (again, after a failure).
    let mut after: Option<i64> = None;
    let mut failing = false;
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let stopping = tokio::select! {
            _ = shutdown.cancelled() => true,
            _ = tick.tick() => false,
        };
        let shipped_now = ship_pending(&reader, &store, &edge_id, &mut after).await;
        match shipped_now {
            Ok(n) => {
                if failing {
                    tracing::info!(
                        records = n,
                        "usage ledger: the store answers again; records kept meanwhile are shipped"
                    );
                }
                failing = false;
            }
            Err(error) => {
                after = None;
                if !failing {
                    tracing::warn!(%error, "usage ledger: cannot ship records to the store; they wait in the local ledger");
                }
                failing = true;
            }
        }
        if stopping {
            return;
        }
    }
}

/// Ships every record after `after` (read from the store when unknown); how many.
async fn ship_pending(
    reader: &LedgerReader,
    store: &Store,
    edge_id: &str,
    after: &mut Option<i64>,
) -> Result<usize, String> {
    let mut total = 0;
    loop {
        let from = match *after {
            Some(id) => id,
            None => shipped(store, edge_id).await?,
        };
        *after = Some(from);
        let batch = reader.read(move |conn| local_after(conn, from)).await?;
        let Some(&last) = batch.id.last() else {
            return Ok(total);
        };
        insert(store, edge_id, &batch).await?;
        total += batch.id.len();
        *after = Some(last);
        if batch.id.len() < BATCH {
            return Ok(total);
        }
    }
}

/// Usage summed over the whole fleet's ledger in the store, as
/// [`super::query::summarize`] sums one edge's.
pub async fn summarize_fleet(
    store: &Store,
    filter: &super::query::Filter,
    bucket: super::query::Bucket,
    per: &[super::query::Per],
    max_rows: usize,
) -> Result<(Vec<super::query::UsageRow>, bool), StoreError> {
    use super::query::{Arg, Dialect, summary_row, summary_sql};
    let (sql, args) = summary_sql(
        "iop_usage",
        filter,
        bucket,
        per,
        max_rows,
        Dialect::Postgres,
    );
    let args: Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>> = args
        .into_iter()
        .map(|a| -> Box<dyn tokio_postgres::types::ToSql + Sync + Send> {
            match a {
                Arg::Integer(n) => Box::new(n),
                Arg::Text(t) => Box::new(t),
            }
        })
        .collect();
    let client = store.client().await?;
    let rows = client
        .query(
            &sql,
            &args
                .iter()
                .map(|a| a.as_ref() as &(dyn tokio_postgres::types::ToSql + Sync))
                .collect::<Vec<_>>(),
        )
        .await
        .map_err(|e| StoreError::statement("sum the fleet's usage", &e))?;
    let mut out = Vec::new();
    for row in &rows {
        let summed = summary_row(
            bucket,
            per,
            |i| row.try_get::<_, Option<i64>>(i),
            |i| row.try_get::<_, String>(i),
        )
        .map_err(|e| StoreError::statement("read the fleet's usage", &e))?;
        out.extend(summed);
    }
    let truncated = out.len() > max_rows;
    out.truncate(max_rows);
    Ok((out, truncated))
}
