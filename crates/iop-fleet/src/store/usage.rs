//! The fleet's usage records: every edge copies its ledger's records into `iop_usage`,
//! keyed by (edge, its local id) and inserted with `ON CONFLICT DO NOTHING`, so a batch
//! sent again is never counted twice, and where an edge goes on from is what the store
//! holds for it.

use super::Store;
use super::error::StoreError;

/// A batch of usage records, column by column (how one insert carries them), as the
/// store keeps them; `id` is each record's id in its edge's own ledger.
#[derive(Debug, Default)]
pub struct UsageColumns {
    pub id: Vec<i64>,
    pub time_ms: Vec<i64>,
    pub key: Vec<String>,
    pub grp: Vec<String>,
    pub node: Vec<String>,
    pub provider: Vec<String>,
    pub path: Vec<String>,
    pub api: Vec<String>,
    pub input_tokens: Vec<i64>,
    pub output_tokens: Vec<i64>,
    pub reasoning_tokens: Vec<i64>,
    pub cached_tokens: Vec<i64>,
    pub est_input_tokens: Vec<Option<i64>>,
    pub est_output_tokens: Vec<Option<i64>>,
    pub latency_ms: Vec<i64>,
    pub ttft_ms: Vec<Option<i64>>,
    pub outcome: Vec<String>,
    pub status: Vec<i64>,
    pub attempts: Vec<i64>,
    pub routing: Vec<String>,
}

/// The highest local id the store holds for `edge_id` (0: none).
pub async fn shipped(store: &Store, edge_id: &str) -> Result<i64, StoreError> {
    let client = store.client().await?;
    let row = client
        .query_one(
            "SELECT COALESCE(max(id), 0) FROM iop_usage WHERE edge_id = $1",
            &[&edge_id],
        )
        .await
        .map_err(|e| StoreError::statement("read shipped records", &e))?;
    Ok(row.get(0))
}

/// Inserts a batch; a record the store holds already is skipped.
pub async fn insert(store: &Store, edge_id: &str, c: &UsageColumns) -> Result<(), StoreError> {
    let client = store.client().await?;
    client
        .execute(
            "INSERT INTO iop_usage (edge_id, id, time_ms, key, grp, node, provider, path, api,
                 input_tokens, output_tokens, reasoning_tokens, cached_tokens,
                 est_input_tokens, est_output_tokens, latency_ms, ttft_ms, outcome, status,
                 attempts, routing)
             SELECT $1, * FROM UNNEST($2::BIGINT[], $3::BIGINT[], $4::TEXT[], $5::TEXT[],
                 $6::TEXT[], $7::TEXT[], $8::TEXT[], $9::TEXT[], $10::BIGINT[], $11::BIGINT[],
                 $12::BIGINT[], $13::BIGINT[], $14::BIGINT[], $15::BIGINT[], $16::BIGINT[],
                 $17::BIGINT[], $18::TEXT[], $19::BIGINT[], $20::BIGINT[], $21::TEXT[])
             ON CONFLICT (edge_id, id) DO NOTHING",
            &[
                &edge_id,
                &c.id,
                &c.time_ms,
                &c.key,
                &c.grp,
                &c.node,
                &c.provider,
                &c.path,
                &c.api,
                &c.input_tokens,
                &c.output_tokens,
                &c.reasoning_tokens,
                &c.cached_tokens,
                &c.est_input_tokens,
                &c.est_output_tokens,
                &c.latency_ms,
                &c.ttft_ms,
                &c.outcome,
                &c.status,
                &c.attempts,
                &c.routing,
            ],
        )
        .await
        .map_err(|e| StoreError::statement("ship records", &e))?;
    Ok(())
}
