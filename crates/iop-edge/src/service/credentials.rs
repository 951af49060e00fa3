//! Who a registering node is, and the admin operations on node credentials.
//!
//! A node proves its identity in one of three ways, tried in this order: a client
//! certificate the TLS handshake verified (its CN is the node id: a joined node's
//! credential from the edge CA, or an operator's mTLS certificate), a join token (redeemed
//! once; the node gets a credential issued for the key in its certificate signing
//! request), or the static token of its config record. Revocations are checked for each.
//! Creating join tokens and revoking nodes (the admin endpoints) live here too, next to
//! the checks they feed.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use iop_proto::pb;
use iop_proto::trust::{JoinString, JoinToken};
use serde::Serialize;

use super::nodes::{ConnectionControl, LinkEntry, LinkProof};
use super::{Edge, Registered, Rejection};
use crate::config::hash_token;
use crate::join::{JoinError, JoinTokenRecord};
use crate::registry::Generation;
pub use crate::status::LinkStatus;
use crate::trust::{Link, RedeemError, SaveError, TrustStore, unix_ms};

/// Longest node-sent label (version, host name) the status keeps.
const MAX_LABEL_CHARS: usize = 64;

/// A label the node sent, as the status shows it: control characters dropped, at most
/// [`MAX_LABEL_CHARS`] characters (the node is not trusted to keep it short or clean).
fn bounded_label(label: &str) -> String {
    label
        .chars()
        .filter(|c| !c.is_control())
        .take(MAX_LABEL_CHARS)
        .collect()
}

enum Proof {
    Certificate,
    JoinToken(JoinToken),
    StaticToken,
}

struct Identity {
    node_id: String,
    proof: Proof,
    expires_unix_ms: Option<u64>,
}

/// Why an admin operation on credentials failed.
#[derive(Debug, thiserror::Error)]
pub enum CredentialAdminError {
    #[error("no node {0:?} in the edge config")]
    NoSuchNode(String),
    #[error("this edge has no state directory")]
    NoState,
    #[error(
        "join tokens need the edge's own CA (node_tls.mode auto); this edge runs node_tls.mode {0}"
    )]
    NoCa(&'static str),
    #[error(
        "no address for nodes to dial: the node listener is on {0}; set node_tls.advertise in the edge config (host:port nodes reach) or pass the addresses"
    )]
    NoAddress(SocketAddr),
    #[error("{0}")]
    BadRequest(String),
    #[error(transparent)]
    Save(#[from] SaveError),
}

/// A join token just created: the join string holds the only copy of its secret.
#[derive(Debug)]
pub struct CreatedJoin {
    pub join: JoinString,
    pub record: JoinTokenRecord,
}

/// What a revocation did.
#[derive(Debug, Clone, Serialize)]
pub struct RevokeReport {
    pub node: String,
    pub revoked_unix_ms: u64,
    /// Whether a live connection of the node was closed.
    pub session_closed: bool,
    pub join_tokens_removed: usize,
}

impl Edge {
    pub fn trust(&self) -> Option<&std::sync::Arc<TrustStore>> {
        self.trust.as_ref()
    }

    pub(super) async fn authenticate_and_claim(
        &self,
        request: &pb::RegisterRequest,
        link: &Link,
        generation: Generation,
        control: ConnectionControl,
    ) -> Result<Registered, Rejection> {
        let now = SystemTime::now();
        let identity = self.identify(request, link, now).await?;
        let node_id = identity.node_id.clone();
        let refund = async |proof: &Proof| {
            if let (Proof::JoinToken(token), Some(trust)) = (proof, &self.trust) {
                trust.refund(token).await;
            }
        };
        let mut registered = match self.claim(&node_id, generation) {
            Ok(registered) => registered,
            Err(rejection) => {
                refund(&identity.proof).await;
                return Err(rejection);
            }
        };
        let mut proof = match (&identity.proof, link.client_cert()) {
            (Proof::Certificate, Some(cert)) => LinkProof::Certificate {
                not_before_secs: cert.not_before_secs,
            },
            (Proof::StaticToken, _) => LinkProof::Token {
                hash: hash_token(&request.token),
            },
            _ => LinkProof::Joined,
        };
        let mut expires = identity.expires_unix_ms;
        let credential = match &identity.proof {
            Proof::Certificate => "client_certificate",
            Proof::StaticToken => "static_token",
            Proof::JoinToken(_) => {
                let trust = self
                    .trust
                    .as_ref()
                    .expect("identify checked the trust store");
                let days = self.config().node_tls.credential_days as u64;
                let lifetime = Duration::from_secs(days * 86_400);
                match trust.issue(&node_id, &request.credential_csr, lifetime, now) {
                    Ok(cert) => {
                        expires = Some(cert.not_after_unix_ms);
                        if let Ok(parsed) = crate::trust::ClientCert::parse(&cert.der) {
                            proof = LinkProof::Certificate {
                                not_before_secs: parsed.not_before_secs,
                            };
                        }
                        registered.credential = Some(pb::NodeCredential {
                            certificate_der: cert.der.to_vec(),
                            expires_unix_ms: cert.not_after_unix_ms,
                        });
                        tracing::info!(
                            node_id,
                            expires_unix_ms = cert.not_after_unix_ms,
                            "join token redeemed: node credential issued"
                        );
                    }
                    Err(message) => {
                        self.nodes.unclaim(&node_id, generation);
                        refund(&identity.proof).await;
                        return Err(Rejection::Credential(message));
                    }
                }
                "join_token"
            }
        };
        self.nodes.set_link(
            node_id,
            LinkEntry {
                generation,
                status: LinkStatus {
                    transport: link.name(),
                    credential,
                    credential_expires_unix_ms: expires,
                    version: bounded_label(&request.node_version),
                    hostname: bounded_label(&request.hostname),
                },
                control,
                proof,
            },
        );
        Ok(registered)
    }

    async fn identify(
        &self,
        request: &pb::RegisterRequest,
        link: &Link,
        now: SystemTime,
    ) -> Result<Identity, Rejection> {
        let config = self.config();
        let configured = |id: &str| config.nodes.iter().any(|n| n.id == id);
        if let Some(cert) = link.client_cert() {
            let node_id = cert.common_name.clone().ok_or_else(|| {
                Rejection::Credential(
                    "the client certificate has no common name (CN): the CN names the node".into(),
                )
            })?;
            if !configured(&node_id) {
                return Err(Rejection::UnknownNode { node_id });
            }
            if self
                .trust
                .as_ref()
                .is_some_and(|t| t.cert_revoked(&node_id, cert.not_before_secs))
            {
                return Err(Rejection::Revoked { node_id });
            }
            return Ok(Identity {
                node_id,
                proof: Proof::Certificate,
                expires_unix_ms: Some(cert.not_after_secs.max(0) as u64 * 1000),
            });
        }
        if !request.join_token.is_empty() {
            let trust = self.trust.as_ref().filter(|t| t.ca().is_some()).ok_or_else(|| {
                Rejection::Credential(format!(
                    "this edge cannot take join tokens (node_tls.mode {}): it issues no credentials",
                    config.node_tls.mode.as_str()
                ))
            })?;
            if request.credential_csr.is_empty() {
                return Err(Rejection::Protocol(
                    "a join_token needs a credential_csr".into(),
                ));
            }
            let token = JoinToken::parse(&request.join_token)
                .map_err(|_| Rejection::JoinToken(JoinError::Unknown))?;
            let node_id = trust.redeem(&token, now).await.map_err(|e| match e {
                RedeemError::Refused(e) => Rejection::JoinToken(e),
                RedeemError::Save(e) => Rejection::Unavailable(e.to_string()),
            })?;
            if !configured(&node_id) {
                trust.refund(&token).await;
                return Err(Rejection::UnknownNode { node_id });
            }
            return Ok(Identity {
                node_id,
                proof: Proof::JoinToken(token),
                expires_unix_ms: None,
            });
        }
        let node_id = self
            .nodes
            .authenticate(&request.token)
            .ok_or(Rejection::UnknownToken)?;
        if self
            .trust
            .as_ref()
            .is_some_and(|t| t.token_revoked(&node_id, &hash_token(&request.token)))
        {
            return Err(Rejection::Revoked { node_id });
        }
        Ok(Identity {
            node_id,
            proof: Proof::StaticToken,
            expires_unix_ms: None,
        })
    }

    /// Creates a join token for `node_id` and the join string that carries it. `edges`
    /// (host:port) default to `node_tls.advertise`, then to the listener's own address.
    pub async fn create_join(
        &self,
        node_id: &str,
        ttl: Duration,
        uses: u32,
        edges: Vec<String>,
    ) -> Result<CreatedJoin, CredentialAdminError> {
        let config = self.config();
        if !config.nodes.iter().any(|n| n.id == node_id) {
            return Err(CredentialAdminError::NoSuchNode(node_id.to_string()));
        }
        if uses == 0 {
            return Err(CredentialAdminError::BadRequest(
                "uses must be at least 1".into(),
            ));
        }
        if ttl.is_zero() {
            return Err(CredentialAdminError::BadRequest(
                "the time to live must be positive".into(),
            ));
        }
        let trust = self.trust.as_ref().ok_or(CredentialAdminError::NoState)?;
        let pin = trust
            .pin()
            .ok_or(CredentialAdminError::NoCa(config.node_tls.mode.as_str()))?;
        let edges = if !edges.is_empty() {
            edges
        } else if !config.node_tls.advertise.is_empty() {
            config.node_tls.advertise.clone()
        } else {
            let listener = self.nodes.listener().ok_or(CredentialAdminError::NoState)?;
            if listener.ip().is_unspecified() {
                return Err(CredentialAdminError::NoAddress(listener));
            }
            vec![listener.to_string()]
        };
        if let Some(bad) = edges
            .iter()
            .find(|e| e.trim().is_empty() || !e.contains(':') || e.contains('/') || e.contains(','))
        {
            return Err(CredentialAdminError::BadRequest(format!(
                "edge address {bad:?} must be host:port"
            )));
        }
        let (token, record) = trust
            .create_join_token(node_id, ttl, uses, SystemTime::now())
            .await?;
        tracing::info!(node_id, token_id = %record.id, uses, ttl_sec = ttl.as_secs(), "join token created");
        Ok(CreatedJoin {
            join: JoinString { edges, pin, token },
            record,
        })
    }

    /// Revokes every credential `node_id` holds now and closes its live connection (the
    /// node is told it was revoked). Survives restarts; in a fleet every edge learns it
    /// and closes the node's connection to it ([`Edge::revoked_elsewhere`]).
    pub async fn revoke(&self, node_id: &str) -> Result<RevokeReport, CredentialAdminError> {
        let config = self.config();
        let node = config
            .nodes
            .iter()
            .find(|n| n.id == node_id)
            .ok_or_else(|| CredentialAdminError::NoSuchNode(node_id.to_string()))?;
        let trust = self.trust.as_ref().ok_or(CredentialAdminError::NoState)?;
        let now = SystemTime::now();
        let removed = trust.revoke(node_id, node.token_hash(), now).await?;
        let session_closed = self.close_if_revoked(node_id);
        tracing::warn!(
            node_id,
            session_closed,
            join_tokens_removed = removed,
            "node revoked"
        );
        Ok(RevokeReport {
            node: node_id.to_string(),
            revoked_unix_ms: unix_ms(now),
            session_closed,
            join_tokens_removed: removed,
        })
    }

    /// Another edge of the fleet revoked these nodes: their connections to this edge
    /// that the revocations cover are closed.
    pub fn revoked_elsewhere(&self, node_ids: &[String]) {
        for node_id in node_ids {
            if self.close_if_revoked(node_id) {
                tracing::warn!(
                    node_id,
                    "node revoked on another edge of the fleet: its connection here is closed"
                );
            }
        }
    }

    /// Closes `node_id`'s live connection if the credential it registered with is
    /// revoked now (telling the node so); whether it did.
    fn close_if_revoked(&self, node_id: &str) -> bool {
        let Some(trust) = &self.trust else {
            return false;
        };
        let entry = self
            .nodes
            .take_link_if(node_id, |entry| match &entry.proof {
                LinkProof::Certificate { not_before_secs } => {
                    trust.cert_revoked(node_id, *not_before_secs)
                }
                LinkProof::Token { hash } => trust.token_revoked(node_id, hash),
                LinkProof::Joined => true,
            });
        let Some(entry) = entry else {
            return false;
        };
        let rejection = Rejection::Revoked {
            node_id: node_id.to_string(),
        };
        entry.control.outbound.try_send(pb::RegisterResponse {
            accepted: false,
            reject_reason: rejection.wire_reason() as i32,
            reason: rejection.to_string(),
            node_id: node_id.to_string(),
            ..Default::default()
        });
        entry.control.kick.cancel();
        self.connection_lost(node_id, entry.generation, "node credentials revoked");
        true
    }
}
