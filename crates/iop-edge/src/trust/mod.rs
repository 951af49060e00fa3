//! What the edge trusts and issues on the node link, and where it keeps it: the state
//! directory with the edge's CA ([`ca`]), the join tokens ([`join`]) and the revocations
//! ([`revocation`]), and the node listener's TLS setup ([`node_tls`]).
//!
//! [`TrustStore`] is the one owner of that state at run time: every change is written to
//! the state directory (0600 files, atomic replace) before it is answered, so what an
//! admin was told holds across a restart. With a shared store (`store.url`) the CA, the
//! join tokens and the revocations are the fleet's, kept there ([`shared`]): a join token's uses count across all edges and a
//! revocation on one edge reaches every other within a second. The CA and the
//! revocations this edge learnt are mirrored into the state directory, so it restarts and
//! refuses what it must while the store is down.

pub mod ca;
pub mod files;
pub mod node_tls;
pub mod random;
pub mod shared;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use iop_proto::trust::{JoinToken, Pin};
use parking_lot::Mutex;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};

use crate::join::{JoinError, JoinTokenRecord, JoinTokens};
use crate::revocation::{RevocationRecord, Revocations};
use crate::store::Store;
use crate::store::trust as store_trust;
use ca::{EdgeCa, IssuedCert, StateError};
use files::read_optional;
use iop_proto::private_file::write_private;
pub use random::random_bytes;

pub const JOIN_TOKENS_FILE: &str = "join-tokens.json";
pub const REVOCATIONS_FILE: &str = "revocations.json";

pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// How a node connection reached the edge.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Link {
    /// Plain TCP (`node_tls.mode: insecure_plaintext`).
    #[default]
    Plaintext,
    /// TLS, with the client certificate the node presented, if any (already verified
    /// against the trusted client CA by the handshake).
    Tls { client: Option<ClientCert> },
}

impl Link {
    pub fn client_cert(&self) -> Option<&ClientCert> {
        match self {
            Link::Tls { client } => client.as_ref(),
            Link::Plaintext => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Link::Plaintext => "plaintext",
            Link::Tls { .. } => "tls",
        }
    }
}

/// What the edge reads from a verified client certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCert {
    /// The subject's common name: the node id.
    pub common_name: Option<String>,
    pub not_before_secs: i64,
    pub not_after_secs: i64,
}

impl ClientCert {
    pub fn parse(der: &[u8]) -> Result<Self, String> {
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| format!("unparsable client certificate: {e}"))?;
        let common_name = cert
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .map(String::from);
        Ok(ClientCert {
            common_name,
            not_before_secs: cert.validity().not_before.timestamp(),
            not_after_secs: cert.validity().not_after.timestamp(),
        })
    }
}

/// A state change that could not be saved (so it did not happen).
#[derive(Debug, thiserror::Error)]
#[error("cannot save {file}: {source}")]
pub struct PersistError {
    pub file: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// A state change that could not be saved, to a file or to the store (so it did not
/// happen).
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error(transparent)]
    File(#[from] PersistError),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

/// Why a join token was not redeemed.
#[derive(Debug, thiserror::Error)]
pub enum RedeemError {
    #[error(transparent)]
    Refused(#[from] JoinError),
    #[error(transparent)]
    Save(#[from] SaveError),
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct JoinTokensFile {
    join_tokens: Vec<JoinTokenRecord>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RevocationsFile {
    revocations: Vec<RevocationRecord>,
}

/// The edge's trust state: its CA (when it runs its own), join tokens and revocations.
#[derive(Debug)]
pub struct TrustStore {
    dir: PathBuf,
    ca: Option<EdgeCa>,
    join: Mutex<JoinTokens>,
    revocations: Mutex<Revocations>,
    /// The fleet's store, which then holds the join tokens and the revocations.
    shared: Option<Arc<Store>>,
}

impl TrustStore {
    /// Opens the state directory; with `own_ca` loads the edge's CA, creating it on the
    /// first start (an empty or missing directory) and never after.
    pub fn open(dir: &Path, own_ca: bool) -> Result<TrustStore, StateError> {
        let ca = if own_ca {
            let (ca, created) = EdgeCa::load_or_create(dir)?;
            if created {
                tracing::info!(state_dir = %dir.display(), pin = %ca.pin(), "created the edge CA (first start)");
            }
            Some(ca)
        } else {
            files::ensure_private_dir(dir).map_err(|source| StateError::Io {
                dir: dir.to_path_buf(),
                source,
            })?;
            None
        };
        let join: JoinTokensFile = load_json(&dir.join(JOIN_TOKENS_FILE))?;
        let revocations: RevocationsFile = load_json(&dir.join(REVOCATIONS_FILE))?;
        Ok(TrustStore {
            dir: dir.to_path_buf(),
            ca,
            join: Mutex::new(JoinTokens::from_records(join.join_tokens)),
            revocations: Mutex::new(Revocations::from_records(revocations.revocations)),
            shared: None,
        })
    }

    /// Opens the state directory of an edge in a fleet: `ca` is the fleet's (already
    /// mirrored into `dir`), join tokens and revocations live in `store`. The revocations
    /// mirrored in `dir` hold until the store's are read.
    pub fn open_shared(
        dir: &Path,
        ca: Option<EdgeCa>,
        store: Arc<Store>,
    ) -> Result<TrustStore, StateError> {
        files::ensure_private_dir(dir).map_err(|source| StateError::Io {
            dir: dir.to_path_buf(),
            source,
        })?;
        let revocations: RevocationsFile = load_json(&dir.join(REVOCATIONS_FILE))?;
        Ok(TrustStore {
            dir: dir.to_path_buf(),
            ca,
            join: Mutex::new(JoinTokens::default()),
            revocations: Mutex::new(Revocations::from_records(revocations.revocations)),
            shared: Some(store),
        })
    }

    /// The fleet's store, when this edge is in one.
    pub fn shared(&self) -> Option<&Arc<Store>> {
        self.shared.as_ref()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn ca(&self) -> Option<&EdgeCa> {
        self.ca.as_ref()
    }

    /// The pin of the edge's own CA.
    pub fn pin(&self) -> Option<Pin> {
        self.ca.as_ref().map(EdgeCa::pin)
    }

    fn save_join(&self, tokens: &JoinTokens) -> Result<(), PersistError> {
        let file = JoinTokensFile {
            join_tokens: tokens.records().to_vec(),
        };
        save_json(&self.dir.join(JOIN_TOKENS_FILE), &file)
    }

    fn save_revocations(&self, revocations: &Revocations) -> Result<(), PersistError> {
        let file = RevocationsFile {
            revocations: revocations.records().to_vec(),
        };
        save_json(&self.dir.join(REVOCATIONS_FILE), &file)
    }

    /// Creates a join token for `node_id`: good for `uses` registrations until `ttl` from
    /// `now`. The returned token holds the only copy of the secret.
    pub async fn create_join_token(
        &self,
        node_id: &str,
        ttl: Duration,
        uses: u32,
        now: SystemTime,
    ) -> Result<(JoinToken, JoinTokenRecord), SaveError> {
        let mut id = [0u8; 8];
        let mut secret = [0u8; 32];
        random_bytes(&mut id);
        random_bytes(&mut secret);
        let token = JoinToken {
            id: hex::encode(id),
            secret: URL_SAFE_NO_PAD.encode(secret),
        };
        let ttl_ms = ttl.as_millis() as u64;
        if let Some(store) = &self.shared {
            let record = JoinTokens::default()
                .create(node_id, &token, ttl_ms, uses, unix_ms(now))
                .clone();
            store_trust::insert_join_token(store, &record)
                .await
                .map_err(SaveError::Store)?;
            return Ok((token, record));
        }
        let mut tokens = self.join.lock();
        tokens.prune(unix_ms(now));
        let record = tokens
            .create(node_id, &token, ttl_ms, uses, unix_ms(now))
            .clone();
        if let Err(e) = self.save_join(&tokens) {
            tokens.remove(&token.id);
            return Err(e.into());
        }
        Ok((token, record))
    }

    pub async fn join_tokens(&self) -> Result<Vec<JoinTokenRecord>, SaveError> {
        match &self.shared {
            Some(store) => store_trust::join_tokens(store)
                .await
                .map_err(SaveError::Store),
            None => Ok(self.join.lock().records().to_vec()),
        }
    }

    pub async fn delete_join_token(&self, id: &str) -> Result<bool, SaveError> {
        if let Some(store) = &self.shared {
            return store_trust::delete_join_token(store, id)
                .await
                .map_err(SaveError::Store);
        }
        let mut tokens = self.join.lock();
        let removed = tokens.remove(id);
        if removed {
            self.save_join(&tokens)?;
        }
        Ok(removed)
    }

    /// Redeems one use of `token`; the use is saved before the node id is returned.
    pub async fn redeem(&self, token: &JoinToken, now: SystemTime) -> Result<String, RedeemError> {
        if let Some(store) = &self.shared {
            return store_trust::redeem(store, token, unix_ms(now))
                .await
                .map_err(|e| RedeemError::Save(SaveError::Store(e)))?
                .map_err(RedeemError::Refused);
        }
        let mut tokens = self.join.lock();
        let node_id = tokens.redeem(token, unix_ms(now))?;
        if let Err(e) = self.save_join(&tokens) {
            tokens.refund(&token.id);
            return Err(SaveError::File(e).into());
        }
        Ok(node_id)
    }

    /// Gives back a use whose registration failed afterwards.
    pub async fn refund(&self, token: &JoinToken) {
        if let Some(store) = &self.shared {
            if let Err(error) = store_trust::refund(store, &token.id).await {
                tracing::warn!(%error, "could not give back a join token use");
            }
            return;
        }
        let mut tokens = self.join.lock();
        tokens.refund(&token.id);
        if let Err(e) = self.save_join(&tokens) {
            tracing::warn!(error = %e, "could not save a refunded join token use");
        }
    }

    /// Revokes every credential `node_id` holds now (certificates valid from before now,
    /// its static token `token_hash`) and deletes its join tokens; returns how many. In a
    /// fleet the revocation is the store's, and every edge learns it.
    pub async fn revoke(
        &self,
        node_id: &str,
        token_hash: Option<[u8; 32]>,
        now: SystemTime,
    ) -> Result<usize, SaveError> {
        let record = RevocationRecord {
            node_id: node_id.to_string(),
            revoked_unix_ms: unix_ms(now),
            token_sha256: token_hash.map(hex::encode),
        };
        if let Some(store) = &self.shared {
            let removed = store_trust::revoke(store, &record)
                .await
                .map_err(SaveError::Store)?;
            self.learn_revocations(vec![record]);
            return Ok(removed);
        }
        {
            let mut revocations = self.revocations.lock();
            revocations.add(record);
            if let Err(e) = self.save_revocations(&revocations) {
                *revocations = Revocations::from_records(
                    revocations.records()[..revocations.records().len() - 1].to_vec(),
                );
                return Err(e.into());
            }
        }
        let mut tokens = self.join.lock();
        let removed = tokens.remove_node(node_id);
        if removed > 0 {
            self.save_join(&tokens)?;
        }
        Ok(removed)
    }

    /// Takes in revocations the fleet recorded (each edge reads them from the store);
    /// returns the nodes of those it did not know, after mirroring them to the state
    /// directory (a failure to mirror is logged: they are in force either way).
    pub fn learn_revocations(&self, records: Vec<RevocationRecord>) -> Vec<String> {
        let mut revocations = self.revocations.lock();
        let mut news = Vec::new();
        for record in records {
            if !revocations.records().contains(&record) {
                news.push(record.node_id.clone());
                revocations.add(record);
            }
        }
        if !news.is_empty()
            && let Err(e) = self.save_revocations(&revocations)
        {
            tracing::warn!(error = %e, "could not mirror the fleet's revocations to the state directory");
        }
        news
    }

    pub fn cert_revoked(&self, node_id: &str, not_before_secs: i64) -> bool {
        self.revocations
            .lock()
            .cert_revoked(node_id, not_before_secs)
    }

    pub fn token_revoked(&self, node_id: &str, token_hash: &[u8; 32]) -> bool {
        self.revocations.lock().token_revoked(node_id, token_hash)
    }

    /// Issues `node_id` a credential for the key in `csr_der`, valid for `lifetime`. It
    /// starts after the node's last revocation, so a revocation never catches it.
    pub fn issue(
        &self,
        node_id: &str,
        csr_der: &[u8],
        lifetime: Duration,
        now: SystemTime,
    ) -> Result<IssuedCert, String> {
        let ca = self.ca.as_ref().ok_or_else(|| {
            "this edge does not run its own CA (node_tls.mode is not auto): join tokens cannot be used".to_string()
        })?;
        let mut not_before = UNIX_EPOCH + Duration::from_secs(ca::unix_secs(now).max(0) as u64);
        if let Some(cutoff) = self.revocations.lock().cutoff_secs(node_id)
            && ca::unix_secs(not_before) <= cutoff
        {
            not_before = UNIX_EPOCH + Duration::from_secs(cutoff as u64 + 1);
        }
        ca.issue_node_cert(node_id, csr_der, not_before, lifetime)
    }
}

fn load_json<T: serde::de::DeserializeOwned + Default>(path: &Path) -> Result<T, StateError> {
    let bytes = read_optional(path).map_err(|e| StateError::File {
        file: path.to_path_buf(),
        message: format!("cannot be read: {e}"),
    })?;
    let Some(bytes) = bytes else {
        return Ok(T::default());
    };
    serde_json::from_slice(&bytes).map_err(|e| StateError::File {
        file: path.to_path_buf(),
        message: format!(
            "is not valid edge state ({e}): restore it from a backup, or move it away to start without it"
        ),
    })
}

fn save_json<T: Serialize>(path: &Path, value: &T) -> Result<(), PersistError> {
    let mut bytes = serde_json::to_vec_pretty(value).expect("serializable state");
    bytes.push(b'\n');
    write_private(path, &bytes).map_err(|source| PersistError {
        file: path.to_path_buf(),
        source,
    })
}

/// Reads a PEM certificate chain and private key (operator-supplied files).
pub fn load_pem_identity(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), String> {
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(|e| format!("{}: {e}", cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no PEM certificate in it", cert.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
    Ok((chain, key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn join_tokens_and_revocations_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let now = SystemTime::now();
        let store = TrustStore::open(dir.path(), true).unwrap();
        let pin = store.pin().unwrap();
        let (token, _) = store
            .create_join_token("gpu", Duration::from_secs(60), 1, now)
            .await
            .unwrap();
        let (other, _) = store
            .create_join_token("laptop", Duration::from_secs(60), 1, now)
            .await
            .unwrap();
        assert_eq!(store.redeem(&token, now).await.unwrap(), "gpu");
        store.revoke("laptop", Some([1; 32]), now).await.unwrap();
        drop(store);

        let store = TrustStore::open(dir.path(), true).unwrap();
        assert_eq!(store.pin(), Some(pin));
        assert!(matches!(
            store.redeem(&token, now).await,
            Err(RedeemError::Refused(JoinError::UsedUp { .. }))
        ));
        assert!(
            matches!(
                store.redeem(&other, now).await,
                Err(RedeemError::Refused(JoinError::Unknown))
            ),
            "revoking a node deletes its join tokens"
        );
        assert!(store.token_revoked("laptop", &[1; 32]));
        assert!(store.cert_revoked("laptop", ca::unix_secs(now)));
        let json = std::fs::read_to_string(dir.path().join(JOIN_TOKENS_FILE)).unwrap();
        assert!(!json.contains(&token.secret), "secrets are stored hashed");
    }

    #[tokio::test]
    async fn a_credential_issued_after_a_revocation_is_not_caught_by_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = TrustStore::open(dir.path(), true).unwrap();
        let now = SystemTime::now();
        store.revoke("gpu", None, now).await.unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let csr = rcgen::CertificateParams::default()
            .serialize_request(&key)
            .unwrap();
        let issued = store
            .issue("gpu", csr.der(), Duration::from_secs(3600), now)
            .unwrap();
        let cert = ClientCert::parse(&issued.der).unwrap();
        assert_eq!(cert.common_name.as_deref(), Some("gpu"));
        assert!(!store.cert_revoked("gpu", cert.not_before_secs));
    }
}
