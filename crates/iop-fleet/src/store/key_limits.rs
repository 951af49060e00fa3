//! The fleet's API key limits in the store: what they need of it ([`KeyStore`], which
//! `crate::fleet_limits` decides with) and PostgreSQL's implementation:
//! admissions by `iop_key_admit`, releases by `iop_key_release` (both under the key's
//! advisory lock, see [`super::migrations`]), the day's tokens by an upsert that adds, and
//! an edge's rows cleared when it starts.

use crate::config::KeyLimitsConfig;
use crate::store::Store;
pub use crate::store::StoreError;
use crate::store::edges::LIVE_WITHIN;

/// Which limit the store refused a request for, and when to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreRefusal {
    RequestsPerMinute { retry_after_ms: i64 },
    MaxConcurrent { retry_after_ms: i64 },
    TokensPerDay { retry_after_ms: i64 },
}

impl StoreRefusal {
    /// The refusal the store named `name`; an unknown name is an error (a store newer than
    /// this edge), never taken for another limit.
    pub fn parse(name: &str, retry_after_ms: i64) -> Result<Self, StoreError> {
        match name {
            "requests_per_minute" => Ok(Self::RequestsPerMinute { retry_after_ms }),
            "max_concurrent" => Ok(Self::MaxConcurrent { retry_after_ms }),
            "tokens_per_day" => Ok(Self::TokensPerDay { retry_after_ms }),
            other => Err(StoreError::Unusable(format!(
                "the store refused for a limit this edge does not know: {other:?}"
            ))),
        }
    }
}

/// What a released key holds back to the store: this edge's running totals of the places
/// and tokens its requests of the key gave back since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Released {
    pub places: i64,
    pub reserved: i64,
}

/// The fleet's store, as the key limits use it.
#[async_trait::async_trait]
pub trait KeyStore: Send + Sync + std::fmt::Debug {
    /// Decides a request of `key` under `limits` reserving `reserve` tokens and, when
    /// admitted, adds it to `edge`'s row: `None` admitted, else the refusal.
    /// A request whose prompt alone (`input` tokens) is more than what is left of a
    /// `tokens_per_day` budget is refused too.
    async fn admit(
        &self,
        key: &str,
        edge: &str,
        limits: &KeyLimitsConfig,
        reserve: u64,
        input: u64,
    ) -> Result<Option<StoreRefusal>, StoreError>;
    /// Takes off `edge`'s row of `key` what `released` (running totals) holds beyond what
    /// was taken off already.
    async fn release(&self, key: &str, edge: &str, released: Released) -> Result<(), StoreError>;
    /// Adds `tokens` used by `key` on UTC day `day` (days since the epoch).
    async fn add_tokens(&self, key: &str, day: i64, tokens: u64) -> Result<(), StoreError>;
    /// Clears what an earlier run of `edge` held.
    async fn clear_edge(&self, edge: &str) -> Result<(), StoreError>;
}

impl Store {
    /// Runs one statement of the key limits (`what` names it in errors).
    async fn key_statement(
        &self,
        what: &str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .execute(sql, params)
            .await
            .map_err(|e| StoreError::statement(what, &e))?;
        Ok(())
    }
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
        let client = self.client().await?;
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
            .map_err(|e| StoreError::statement("key limits", &e))?;
        let refused: Option<String> = row.get(0);
        match refused {
            None => Ok(None),
            Some(name) => StoreRefusal::parse(&name, row.get::<_, i64>(1)).map(Some),
        }
    }

    async fn release(&self, key: &str, edge: &str, released: Released) -> Result<(), StoreError> {
        self.key_statement(
            "key release",
            "SELECT iop_key_release($1, $2, $3, $4)",
            &[&key, &edge, &released.places, &released.reserved],
        )
        .await
    }

    async fn add_tokens(&self, key: &str, day: i64, tokens: u64) -> Result<(), StoreError> {
        self.key_statement(
            "key tokens",
            "INSERT INTO iop_key_tokens (key, day, used)
             VALUES ($1, DATE '1970-01-01' + $2::INTEGER, $3)
             ON CONFLICT (key, day) DO UPDATE SET used = iop_key_tokens.used + $3",
            &[&key, &(day as i32), &(tokens.min(i64::MAX as u64) as i64)],
        )
        .await
    }

    async fn clear_edge(&self, edge: &str) -> Result<(), StoreError> {
        self.key_statement(
            "key places",
            "DELETE FROM iop_key_inflight WHERE edge_id = $1",
            &[&edge],
        )
        .await
    }
}
