//! The statements of the fleet's node trust: the CA row (its key sealed by [`super::seal`]),
//! the join tokens (a use is taken by one conditional update, so a token is good for its
//! uses across all edges together) and the revocations (each edge follows them: a
//! notification on [`REVOCATIONS_CHANNEL`] at once, and a poll every [`REVOCATION_POLL`] in
//! case one is lost). The pure rules are `iop_core::join` and `iop_core::revocation`; the
//! edge decides which CA it serves with.

use std::sync::Arc;
use std::time::Duration;

use iop_core::join::{JoinError, JoinTokenRecord, JoinTokens, KEEP_AFTER_EXPIRY_MS};
use iop_core::revocation::RevocationRecord;
use iop_proto::trust::JoinToken;
use tokio_postgres::Row;
use tokio_util::sync::CancellationToken;

use super::Store;
use super::error::StoreError;

/// Where a new revocation is announced (`NOTIFY`).
pub const REVOCATIONS_CHANNEL: &str = "iop_revocations";
/// How often an edge reads the revocations it may have missed a notification of.
pub const REVOCATION_POLL: Duration = Duration::from_secs(1);

/// The fleet's CA as the store keeps it: the certificate, the key sealed, and the check
/// of the secret key that sealed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealedCa {
    pub cert_pem: String,
    pub key_sealed: Vec<u8>,
    pub key_check: String,
}

/// The fleet's CA, if an edge gave it one.
pub async fn ca(store: &Store) -> Result<Option<SealedCa>, StoreError> {
    let client = store.client().await?;
    let row = client
        .query_opt(
            "SELECT cert_pem, key_sealed, key_check FROM iop_ca WHERE id = 1",
            &[],
        )
        .await
        .map_err(|e| StoreError::statement("read CA", &e))?;
    Ok(row.map(|row| SealedCa {
        cert_pem: row.get(0),
        key_sealed: row.get(1),
        key_check: row.get(2),
    }))
}

/// Offers `offered` as the fleet's CA: kept unless an edge gave the fleet one first.
/// Returns the fleet's CA as it stands after.
pub async fn offer_ca(store: &Store, offered: &SealedCa) -> Result<SealedCa, StoreError> {
    let client = store.client().await?;
    client
        .execute(
            "INSERT INTO iop_ca (id, cert_pem, key_sealed, key_check) VALUES (1, $1, $2, $3)
             ON CONFLICT (id) DO NOTHING",
            &[&offered.cert_pem, &offered.key_sealed, &offered.key_check],
        )
        .await
        .map_err(|e| StoreError::statement("write CA", &e))?;
    drop(client);
    ca(store)
        .await?
        .ok_or_else(|| StoreError::Unusable("store: the CA row vanished".into()))
}

fn join_record(row: &Row) -> JoinTokenRecord {
    JoinTokenRecord {
        id: row.get(0),
        node_id: row.get(1),
        secret_sha256: row.get(2),
        created_unix_ms: row.get::<_, i64>(3).max(0) as u64,
        expires_unix_ms: row.get::<_, i64>(4).max(0) as u64,
        max_uses: row.get::<_, i32>(5).max(0) as u32,
        uses_left: row.get::<_, i32>(6).max(0) as u32,
    }
}

const JOIN_COLUMNS: &str =
    "id, node_id, secret_sha256, created_unix_ms, expires_unix_ms, max_uses, uses_left";

/// Stores a new join token (and drops those long expired).
pub async fn insert_join_token(store: &Store, record: &JoinTokenRecord) -> Result<(), StoreError> {
    let client = store.client().await?;
    let prune_before = record.created_unix_ms as i64 - KEEP_AFTER_EXPIRY_MS as i64;
    client
        .execute(
            "DELETE FROM iop_join_tokens WHERE expires_unix_ms < $1",
            &[&prune_before],
        )
        .await
        .map_err(|e| StoreError::statement("prune join tokens", &e))?;
    client
        .execute(
            &format!(
                "INSERT INTO iop_join_tokens ({JOIN_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)"
            ),
            &[
                &record.id,
                &record.node_id,
                &record.secret_sha256,
                &(record.created_unix_ms as i64),
                &(record.expires_unix_ms as i64),
                &(record.max_uses as i32),
                &(record.uses_left as i32),
            ],
        )
        .await
        .map_err(|e| StoreError::statement("write join token", &e))?;
    Ok(())
}

pub async fn join_tokens(store: &Store) -> Result<Vec<JoinTokenRecord>, StoreError> {
    let client = store.client().await?;
    let rows = client
        .query(
            &format!("SELECT {JOIN_COLUMNS} FROM iop_join_tokens ORDER BY created_unix_ms, id"),
            &[],
        )
        .await
        .map_err(|e| StoreError::statement("read join tokens", &e))?;
    Ok(rows.iter().map(join_record).collect())
}

pub async fn delete_join_token(store: &Store, id: &str) -> Result<bool, StoreError> {
    let client = store.client().await?;
    let n = client
        .execute("DELETE FROM iop_join_tokens WHERE id = $1", &[&id])
        .await
        .map_err(|e| StoreError::statement("delete join token", &e))?;
    Ok(n > 0)
}

/// Checks `token` against the store's record and takes one use in one conditional
/// update: two edges redeeming the last use at once cannot both get it.
pub async fn redeem(
    store: &Store,
    token: &JoinToken,
    now_ms: u64,
) -> Result<Result<String, JoinError>, StoreError> {
    let client = store.client().await?;
    let row = client
        .query_opt(
            &format!("SELECT {JOIN_COLUMNS} FROM iop_join_tokens WHERE id = $1"),
            &[&token.id],
        )
        .await
        .map_err(|e| StoreError::statement("read join token", &e))?;
    let Some(row) = row else {
        return Ok(Err(JoinError::Unknown));
    };
    // The pure rules (secret, expiry, uses) on the record as read.
    let mut one = JoinTokens::from_records(vec![join_record(&row)]);
    let node_id = match one.redeem(token, now_ms) {
        Ok(node_id) => node_id,
        Err(refused) => return Ok(Err(refused)),
    };
    let taken = client
        .execute(
            "UPDATE iop_join_tokens SET uses_left = uses_left - 1
             WHERE id = $1 AND uses_left > 0 AND expires_unix_ms > $2",
            &[&token.id, &(now_ms as i64)],
        )
        .await
        .map_err(|e| StoreError::statement("take a join token use", &e))?;
    if taken == 0 {
        let max_uses = one.records()[0].max_uses;
        return Ok(Err(JoinError::UsedUp { node_id, max_uses }));
    }
    Ok(Ok(node_id))
}

/// Gives back a use whose registration failed after it was taken.
pub async fn refund(store: &Store, id: &str) -> Result<(), StoreError> {
    let client = store.client().await?;
    client
        .execute(
            "UPDATE iop_join_tokens SET uses_left = LEAST(uses_left + 1, max_uses) WHERE id = $1",
            &[&id],
        )
        .await
        .map_err(|e| StoreError::statement("refund a join token use", &e))?;
    Ok(())
}

/// Records a revocation, deletes the node's join tokens and tells every edge, in one
/// transaction; returns how many join tokens went.
pub async fn revoke(store: &Store, record: &RevocationRecord) -> Result<usize, StoreError> {
    let client = store.client().await?;
    let statement = "WITH revoked AS (
            INSERT INTO iop_revocations (node_id, revoked_unix_ms, token_sha256)
            VALUES ($1, $2, $3) RETURNING 1
        ), removed AS (
            DELETE FROM iop_join_tokens WHERE node_id = $1 RETURNING 1
        )
        SELECT (SELECT count(*) FROM removed), pg_notify($4, $1), (SELECT count(*) FROM revoked)";
    let row = client
        .query_one(
            statement,
            &[
                &record.node_id,
                &(record.revoked_unix_ms as i64),
                &record.token_sha256,
                &REVOCATIONS_CHANNEL,
            ],
        )
        .await
        .map_err(|e| StoreError::statement("write revocation", &e))?;
    Ok(row.get::<_, i64>(0).max(0) as usize)
}

/// The revocations recorded after `seq`, with their sequence numbers, oldest first.
pub async fn revocations_after(
    store: &Store,
    seq: i64,
) -> Result<Vec<(i64, RevocationRecord)>, StoreError> {
    let client = store.client().await?;
    let rows = client
        .query(
            "SELECT seq, node_id, revoked_unix_ms, token_sha256 FROM iop_revocations
             WHERE seq > $1 ORDER BY seq",
            &[&seq],
        )
        .await
        .map_err(|e| StoreError::statement("read revocations", &e))?;
    Ok(rows
        .iter()
        .map(|row| {
            (
                row.get(0),
                RevocationRecord {
                    node_id: row.get(1),
                    revoked_unix_ms: row.get::<_, i64>(2).max(0) as u64,
                    token_sha256: row.get(3),
                },
            )
        })
        .collect())
}

/// Follows the fleet's revocations until `shutdown`: hands every one not seen yet to
/// `learn` (all of them on the first read), when notified and at least every
/// [`REVOCATION_POLL`]. While the store is unreachable it keeps trying; what it learnt
/// stays in force.
pub async fn follow_revocations(
    store: Arc<Store>,
    learn: impl Fn(Vec<RevocationRecord>) + Send + 'static,
    shutdown: CancellationToken,
) {
    let mut seen: i64 = 0;
    let mut notified = store.listen(REVOCATIONS_CHANNEL, shutdown.clone());
    let mut poll = tokio::time::interval(REVOCATION_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = poll.tick() => {}
            Some(()) = notified.recv() => {}
        }
        match revocations_after(&store, seen).await {
            Ok(new) => {
                failing = false;
                if let Some((last, _)) = new.last() {
                    seen = *last;
                    learn(new.into_iter().map(|(_, r)| r).collect());
                }
            }
            Err(error) if !failing => {
                failing = true;
                tracing::warn!(%error, "cannot read the fleet's revocations; those known stay in force, retrying");
            }
            Err(_) => {}
        }
    }
}
