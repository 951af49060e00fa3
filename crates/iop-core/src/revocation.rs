//! Node revocations: which credentials of which node an admin revoked, kept in the state
//! directory so they survive restarts.
//!
//! A revocation of node N at time T refuses every certificate of N whose validity starts
//! at or before T (so every credential issued so far, by the edge CA or an operator CA) and
//! N's static token as configured at T. A credential issued later (a new join token, a new
//! operator certificate, a changed token in the config) registers again. Pure state: the
//! caller passes times and persists [`Revocations::records`].

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RevocationRecord {
    pub node_id: String,
    pub revoked_unix_ms: u64,
    /// Hex SHA-256 of the static token the node had when it was revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_sha256: Option<String>,
}

#[derive(Debug, Default)]
pub struct Revocations {
    records: Vec<RevocationRecord>,
}

impl Revocations {
    pub fn from_records(records: Vec<RevocationRecord>) -> Self {
        Self { records }
    }

    pub fn records(&self) -> &[RevocationRecord] {
        &self.records
    }

    pub fn add(&mut self, record: RevocationRecord) {
        self.records.push(record);
    }

    /// The latest revocation time of a node, in whole seconds.
    pub fn cutoff_secs(&self, node_id: &str) -> Option<i64> {
        self.records
            .iter()
            .filter(|r| r.node_id == node_id)
            .map(|r| (r.revoked_unix_ms / 1000) as i64)
            .max()
    }

    /// Whether a certificate of `node_id` valid from `not_before_secs` is revoked.
    pub fn cert_revoked(&self, node_id: &str, not_before_secs: i64) -> bool {
        self.cutoff_secs(node_id)
            .is_some_and(|cutoff| not_before_secs <= cutoff)
    }

    /// Whether `node_id`'s static token (by hash) was revoked.
    pub fn token_revoked(&self, node_id: &str, token_hash: &[u8; 32]) -> bool {
        let hash = hex::encode(token_hash);
        self.records
            .iter()
            .any(|r| r.node_id == node_id && r.token_sha256.as_deref() == Some(hash.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Revocations {
        fn revoke(&mut self, node_id: &str, now_ms: u64, token_hash: Option<[u8; 32]>) {
            self.add(RevocationRecord {
                node_id: node_id.to_string(),
                revoked_unix_ms: now_ms,
                token_sha256: token_hash.map(hex::encode),
            });
        }
    }

    #[test]
    fn certificates_from_before_the_revocation_are_refused_later_ones_are_not() {
        let mut r = Revocations::default();
        assert!(!r.cert_revoked("gpu", 100));
        r.revoke("gpu", 200_500, None);
        assert!(r.cert_revoked("gpu", 100));
        assert!(r.cert_revoked("gpu", 200));
        assert!(!r.cert_revoked("gpu", 201));
        assert!(!r.cert_revoked("laptop", 100));
    }

    #[test]
    fn a_revoked_static_token_stays_refused_until_it_changes() {
        let mut r = Revocations::default();
        r.revoke("gpu", 1, Some([7; 32]));
        assert!(r.token_revoked("gpu", &[7; 32]));
        assert!(!r.token_revoked("gpu", &[8; 32]));
        assert!(!r.token_revoked("laptop", &[7; 32]));
    }
}
