//! The fleet's API key limits in the store ([`crate::fleet_limits::KeyStore`]):
//! admissions by `iop_key_admit`, releases by `iop_key_release` (both under the key's
//! advisory lock, see [`super::migrations`]), the day's tokens by an upsert that adds, and
//! an edge's rows cleared when it starts.

use crate::config::KeyLimitsConfig;
use crate::fleet_limits::{KeyStore, Released, StoreError, StoreRefusal};
use crate::store::Store;
use crate::store::edges::LIVE_WITHIN;

fn failed(what: &str, e: &tokio_postgres::Error) -> StoreError {
    StoreError(format!("store ({what}): {}", super::reason(e)))
}

#[async_trait::async_trait]
impl KeyStore for Store {
    async fn admit(
        &self,
        key: &str,
        edge: &str,
        limits: &KeyLimitsConfig,
        reserve: u64,
        input: u64,
    ) -> Result<Option<StoreRefusal>, StoreError> {
        let client = self.client().await.map_err(StoreError)?;
        let rpm = limits.requests_per_minute.map(|n| n as i32);
        let max = limits.max_concurrent.map(|n| n as i32);
        let budget = limits.tokens_per_day.map(|n| n.min(i64::MAX as u64) as i64);
        let reserve = reserve.min(i64::MAX as u64) as i64;
        let input = input.min(i64::MAX as u64) as i64;
        let live = LIVE_WITHIN.as_secs_f64();
        let row = client
            .query_one(
                "SELECT refused, retry_after_ms FROM iop_key_admit($1, $2, $3, $4, $5, $6, $7, $8)",
                &[&key, &edge, &rpm, &max, &budget, &reserve, &live, &input],
            )
            .await
            .map_err(|e| failed("key limits", &e))?;
        let refused: Option<String> = row.get(0);
        match refused {
            None => Ok(None),
            Some(name) => StoreRefusal::parse(&name, row.get::<_, i64>(1)).map(Some),
        }
    }

    async fn release(&self, key: &str, edge: &str, released: Released) -> Result<(), StoreError> {
        let client = self.client().await.map_err(StoreError)?;
        client
            .execute(
                "SELECT iop_key_release($1, $2, $3, $4)",
                &[&key, &edge, &released.places, &released.reserved],
            )
            .await
            .map_err(|e| failed("key release", &e))?;
        Ok(())
    }

    async fn add_tokens(&self, key: &str, day: i64, tokens: u64) -> Result<(), StoreError> {
        let client = self.client().await.map_err(StoreError)?;
        client
            .execute(
                "INSERT INTO iop_key_tokens (key, day, used)
                 VALUES ($1, DATE '1970-01-01' + $2::INTEGER, $3)
                 ON CONFLICT (key, day) DO UPDATE SET used = iop_key_tokens.used + $3",
                &[&key, &(day as i32), &(tokens.min(i64::MAX as u64) as i64)],
            )
            .await
            .map_err(|e| failed("key tokens", &e))?;
        Ok(())
    }

    async fn clear_edge(&self, edge: &str) -> Result<(), StoreError> {
        let client = self.client().await.map_err(StoreError)?;
        client
            .execute("DELETE FROM iop_key_inflight WHERE edge_id = $1", &[&edge])
            .await
            .map_err(|e| failed("key places", &e))?;
        Ok(())
    }
}
