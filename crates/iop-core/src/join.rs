//! Join tokens: one-line, expiring, use-counted secrets an admin creates for a configured
//! node id. Redeeming one (on the node's first connection) yields the node id the edge then
//! issues a credential for.
//!
//! Pure state, no I/O and no clock: callers pass `now` and persist [`JoinTokens::records`].
//! Only the SHA-256 of each secret is kept, compared in constant time; the secret is
//! checked before anything about the token is revealed, so a caller without it learns
//! only "unknown".

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use iop_proto::trust::JoinToken;

/// How long used-up and expired records are kept (so a node is told "used up" or
/// "expired" rather than "unknown") before they are dropped.
pub const KEEP_AFTER_EXPIRY_MS: u64 = 7 * 86_400_000;

/// One join token as stored in the state directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinTokenRecord {
    pub id: String,
    pub node_id: String,
    /// Hex SHA-256 of the secret.
    pub secret_sha256: String,
    pub created_unix_ms: u64,
    pub expires_unix_ms: u64,
    pub max_uses: u32,
    pub uses_left: u32,
}

/// Why a join token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JoinError {
    #[error("unknown join token (never created, deleted, revoked, or a wrong secret)")]
    Unknown,
    #[error(
        "the join token for node {node_id} expired; create a new one with `iop join-token --node {node_id}`"
    )]
    Expired { node_id: String },
    #[error(
        "the join token for node {node_id} is used up ({max_uses} use(s)); create a new one with `iop join-token --node {node_id}`"
    )]
    UsedUp { node_id: String, max_uses: u32 },
}

#[derive(Debug, Default)]
pub struct JoinTokens {
    records: Vec<JoinTokenRecord>,
}

fn secret_hash(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

impl JoinTokens {
    pub fn from_records(records: Vec<JoinTokenRecord>) -> Self {
        Self { records }
    }

    pub fn records(&self) -> &[JoinTokenRecord] {
        &self.records
    }

    /// Adds a token for `node_id` with the given id and secret (random, from the caller).
    pub fn create(
        &mut self,
        node_id: &str,
        token: &JoinToken,
        ttl_ms: u64,
        uses: u32,
        now_ms: u64,
    ) -> &JoinTokenRecord {
        self.records.push(JoinTokenRecord {
            id: token.id.clone(),
            node_id: node_id.to_string(),
            secret_sha256: hex::encode(secret_hash(&token.secret)),
            created_unix_ms: now_ms,
            expires_unix_ms: now_ms.saturating_add(ttl_ms),
            max_uses: uses,
            uses_left: uses,
        });
        self.records.last().expect("just pushed")
    }

    /// Checks `token` and takes one use; returns the node id it was made for.
    pub fn redeem(&mut self, token: &JoinToken, now_ms: u64) -> Result<String, JoinError> {
        let presented = secret_hash(&token.secret);
        let Some(record) = self.records.iter_mut().find(|r| r.id == token.id) else {
            return Err(JoinError::Unknown);
        };
        let mut stored = [0u8; 32];
        if hex::decode_to_slice(&record.secret_sha256, &mut stored).is_err()
            || !bool::from(stored.ct_eq(&presented))
        {
            return Err(JoinError::Unknown);
        }
        if now_ms >= record.expires_unix_ms {
            return Err(JoinError::Expired {
                node_id: record.node_id.clone(),
            });
        }
        if record.uses_left == 0 {
            return Err(JoinError::UsedUp {
                node_id: record.node_id.clone(),
                max_uses: record.max_uses,
            });
        }
        record.uses_left -= 1;
        Ok(record.node_id.clone())
    }

    /// Gives back the use a redemption took (the registration failed after it).
    pub fn refund(&mut self, id: &str) {
        if let Some(record) = self.records.iter_mut().find(|r| r.id == id) {
            record.uses_left = (record.uses_left + 1).min(record.max_uses);
        }
    }

    /// Deletes one token; whether it existed.
    pub fn remove(&mut self, id: &str) -> bool {
        let before = self.records.len();
        self.records.retain(|r| r.id != id);
        self.records.len() != before
    }

    /// Deletes every token of a node (it was revoked); how many.
    pub fn remove_node(&mut self, node_id: &str) -> usize {
        let before = self.records.len();
        self.records.retain(|r| r.node_id != node_id);
        before - self.records.len()
    }

    /// Drops records expired more than [`KEEP_AFTER_EXPIRY_MS`] ago; whether any went.
    pub fn prune(&mut self, now_ms: u64) -> bool {
        let before = self.records.len();
        self.records
            .retain(|r| r.expires_unix_ms.saturating_add(KEEP_AFTER_EXPIRY_MS) > now_ms);
        self.records.len() != before
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(id: &str, secret: &str) -> JoinToken {
        JoinToken {
            id: id.into(),
            secret: secret.into(),
        }
    }

    #[test]
    fn a_token_is_good_for_its_uses_and_until_its_expiry() {
        let mut t = JoinTokens::default();
        t.create("gpu", &token("a", "s"), 1000, 2, 0);
        assert_eq!(t.redeem(&token("a", "s"), 10), Ok("gpu".into()));
        assert_eq!(t.redeem(&token("a", "s"), 20), Ok("gpu".into()));
        assert_eq!(
            t.redeem(&token("a", "s"), 30),
            Err(JoinError::UsedUp {
                node_id: "gpu".into(),
                max_uses: 2
            })
        );
        t.create("gpu", &token("b", "s"), 1000, 1, 0);
        assert_eq!(
            t.redeem(&token("b", "s"), 1000),
            Err(JoinError::Expired {
                node_id: "gpu".into()
            })
        );
    }

    #[test]
    fn a_wrong_secret_reveals_nothing() {
        let mut t = JoinTokens::default();
        t.create("gpu", &token("a", "right"), 1000, 0, 0);
        // Used up and expired alike: without the secret the answer is "unknown".
        assert_eq!(
            t.redeem(&token("a", "wrong"), 5000),
            Err(JoinError::Unknown)
        );
        assert_eq!(t.redeem(&token("zz", "right"), 0), Err(JoinError::Unknown));
    }

    #[test]
    fn refunds_removal_and_pruning() {
        let mut t = JoinTokens::default();
        t.create("gpu", &token("a", "s"), 1000, 1, 0);
        t.redeem(&token("a", "s"), 1).unwrap();
        t.refund("a");
        assert_eq!(t.redeem(&token("a", "s"), 2), Ok("gpu".into()));
        t.refund("a");
        t.refund("a");
        assert_eq!(
            t.records()[0].uses_left,
            1,
            "a refund never exceeds max_uses"
        );
        t.create("laptop", &token("b", "s"), 1000, 1, 0);
        assert_eq!(t.remove_node("gpu"), 1);
        assert!(!t.prune(1000 + KEEP_AFTER_EXPIRY_MS - 1));
        assert!(t.prune(1000 + KEEP_AFTER_EXPIRY_MS));
        assert!(t.records().is_empty());
        assert!(!t.remove("b"));
    }

    #[test]
    fn records_keep_only_the_hash_of_the_secret() {
        let mut t = JoinTokens::default();
        let record = t
            .create("gpu", &token("a", "the-secret"), 1000, 1, 0)
            .clone();
        let json = serde_json::to_string(&record).unwrap();
        assert!(!json.contains("the-secret"), "{json}");
    }
}
