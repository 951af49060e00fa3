//! The edge's own certificate authority, kept in the state directory: created on the first
//! start, never replaced by the edge. It signs the node listener's server certificate
//! (renewed under the same CA whenever it is missing, near its end, or for other names)
//! and the client certificates nodes receive as their credential when they join.
//!
//! The CA's pin (SHA-256 of its SubjectPublicKeyInfo) is what nodes trust, so a missing or
//! unreadable CA key after the first start is an error that says how to recover, never a
//! reason to make a new one.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use iop_proto::trust::Pin;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, PublicKeyData,
    SerialNumber,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, CertificateSigningRequestDer, PrivateKeyDer};
use time::OffsetDateTime;

use super::files::{is_empty_dir, read_optional};
use iop_proto::private_file::write_private;
// The DNS name every server certificate of the node listener carries, besides the
// configured ones.
use iop_proto::trust::EDGE_CERT_NAME;

pub const CA_CERT: &str = "ca.pem";
pub const CA_KEY: &str = "ca.key";
pub const SERVER_CERT: &str = "server.pem";
pub const SERVER_KEY: &str = "server.key";

/// How long the CA is valid.
const CA_LIFETIME: Duration = Duration::from_secs(20 * 365 * 86_400);
/// How long a server certificate is valid; it is renewed at start when less than
/// [`SERVER_RENEW_BEFORE`] is left.
const SERVER_LIFETIME: Duration = Duration::from_secs(397 * 86_400);
pub const SERVER_RENEW_BEFORE: Duration = Duration::from_secs(30 * 86_400);
/// Certificates the node verifies start this much in the past, for nodes whose clock lags.
const BACKDATE: Duration = Duration::from_secs(3600);

/// Why the state directory's CA or server certificate cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state directory {dir}: {source}")]
    Io {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: {message}")]
    File { file: PathBuf, message: String },
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
}

/// A node credential the CA issued.
#[derive(Debug, Clone)]
pub struct IssuedCert {
    pub der: CertificateDer<'static>,
    pub not_after_unix_ms: u64,
}

/// The server certificate chain and key the node listener presents.
#[derive(Debug)]
pub struct ServerIdentity {
    /// `[server certificate, CA certificate]`.
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    /// Whether it was issued now (missing, near its end, other names, other CA).
    pub renewed: bool,
}

pub struct EdgeCa {
    cert: CertificateDer<'static>,
    key: KeyPair,
    pin: Pin,
}

impl std::fmt::Debug for EdgeCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeCa").field("pin", &self.pin).finish()
    }
}

/// Random certificate serial: 16 bytes, positive.
fn serial() -> SerialNumber {
    let mut bytes = [0u8; 16];
    super::random::random_bytes(&mut bytes);
    bytes[0] &= 0x7f;
    bytes[0] |= 0x01;
    SerialNumber::from_slice(&bytes)
}

fn datetime(t: SystemTime) -> OffsetDateTime {
    OffsetDateTime::from(t)
}

fn file_error(file: &Path, message: impl Into<String>) -> StateError {
    StateError::File {
        file: file.to_path_buf(),
        message: message.into(),
    }
}

impl EdgeCa {
    /// Loads the CA from `dir`, creating it (and `dir`) only when `dir` is missing or
    /// empty: a first start. Returns whether it was created.
    pub fn load_or_create(dir: &Path) -> Result<(EdgeCa, bool), StateError> {
        let io = |source| StateError::Io {
            dir: dir.to_path_buf(),
            source,
        };
        let first_start = is_empty_dir(dir).map_err(io)?;
        super::files::ensure_private_dir(dir).map_err(io)?;
        let cert_path = dir.join(CA_CERT);
        let key_path = dir.join(CA_KEY);
        let unreadable = |file: &Path, e: std::io::Error| {
            file_error(
                file,
                format!(
                    "cannot be read ({e}). Restore it from a backup or fix its permissions: the edge never replaces its CA by itself, because every node trusts it by its pin"
                ),
            )
        };
        let cert = read_optional(&cert_path).map_err(|e| unreadable(&cert_path, e))?;
        let key = read_optional(&key_path).map_err(|e| unreadable(&key_path, e))?;
        match (cert, key) {
            (None, None) if first_start => Ok((Self::create(dir)?, true)),
            (None, None) => Err(file_error(
                &dir.join(CA_KEY),
                format!(
                    "missing, and so is {CA_CERT}, but {} holds other edge state: restore ca.pem and ca.key from a backup. To start over with a new CA, move the directory away and restart; every node must then join again (new pin)",
                    dir.display()
                ),
            )),
            (Some(_), None) => Err(file_error(
                &key_path,
                format!(
                    "missing while {CA_CERT} exists: restore the CA key from a backup. The edge never makes a new CA by itself, because every node trusts the current one by its pin; to start over, move the state directory away (every node must join again)"
                ),
            )),
            (None, Some(_)) => Err(file_error(
                &cert_path,
                format!("missing while {CA_KEY} exists: restore the CA certificate from a backup"),
            )),
            (Some(cert_pem), Some(key_pem)) => {
                let cert = CertificateDer::from_pem_slice(&cert_pem)
                    .map_err(|e| file_error(&cert_path, format!("not a PEM certificate: {e}")))?;
                let key_text = String::from_utf8(key_pem)
                    .map_err(|_| file_error(&key_path, "not a PEM private key"))?;
                let key = KeyPair::from_pem(&key_text)
                    .map_err(|e| file_error(&key_path, format!("not a usable private key: {e}")))?;
                let pin = Pin::of_certificate(&cert).map_err(|m| file_error(&cert_path, m))?;
                if Pin::of_spki(&key.subject_public_key_info()) != pin {
                    return Err(file_error(
                        &key_path,
                        format!(
                            "does not belong to {CA_CERT}: restore the matching pair from a backup"
                        ),
                    ));
                }
                Ok((EdgeCa { cert, key, pin }, false))
            }
        }
    }

    fn create(dir: &Path) -> Result<EdgeCa, StateError> {
        let ca = Self::generate()?;
        ca.save(dir)?;
        Ok(ca)
    }

    /// Writes the CA into `dir` (0600 files): a fleet's CA is kept there too, so the edge
    /// restarts with it while the store is down.
    pub fn save(&self, dir: &Path) -> Result<(), StateError> {
        let io = |source| StateError::Io {
            dir: dir.to_path_buf(),
            source,
        };
        super::files::ensure_private_dir(dir).map_err(io)?;
        let (cert_pem, key_pem) = self.to_pem();
        write_private(&dir.join(CA_KEY), key_pem.as_bytes()).map_err(io)?;
        write_private(&dir.join(CA_CERT), cert_pem.as_bytes()).map_err(io)?;
        Ok(())
    }

    /// The certificate and private key, PEM.
    pub fn to_pem(&self) -> (String, String) {
        (
            iop_proto::trust::pem("CERTIFICATE", self.cert.as_ref()),
            self.key.serialize_pem(),
        )
    }

    /// A CA from its PEM certificate and key (as [`EdgeCa::to_pem`] wrote them).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<EdgeCa, String> {
        let cert = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| format!("not a PEM certificate: {e}"))?;
        let key =
            KeyPair::from_pem(key_pem).map_err(|e| format!("not a usable private key: {e}"))?;
        let pin = Pin::of_certificate(&cert)?;
        if Pin::of_spki(&key.subject_public_key_info()) != pin {
            return Err("the key does not belong to the certificate".into());
        }
        Ok(EdgeCa { cert, key, pin })
    }

    /// A new CA, kept nowhere yet.
    pub fn generate() -> Result<EdgeCa, StateError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        let mut id = [0u8; 4];
        super::random::random_bytes(&mut id);
        let mut name = DistinguishedName::new();
        name.push(DnType::OrganizationName, "iop");
        name.push(
            DnType::CommonName,
            format!("iop edge CA {}", hex::encode(id)),
        );
        params.distinguished_name = name;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = SystemTime::now();
        params.not_before = datetime(now - BACKDATE);
        params.not_after = datetime(now + CA_LIFETIME);
        params.serial_number = Some(serial());
        let cert = params.self_signed(&key)?;
        let cert = cert.der().clone();
        let pin = Pin::of_certificate(&cert).map_err(|m| file_error(Path::new(CA_CERT), m))?;
        Ok(EdgeCa { cert, key, pin })
    }

    pub fn pin(&self) -> Pin {
        self.pin
    }

    pub fn cert(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    fn issuer(&self) -> Result<Issuer<'static, &KeyPair>, rcgen::Error> {
        Issuer::from_ca_cert_der(&self.cert, &self.key)
    }

    /// The server certificate in `dir`, issued anew under this CA when it is missing,
    /// unreadable, from another CA, for other names, or within [`SERVER_RENEW_BEFORE`] of
    /// its end. The certificate names `iop-edge` and `names` (DNS names or IPs).
    pub fn server_identity(
        &self,
        dir: &Path,
        names: &[String],
        now: SystemTime,
    ) -> Result<ServerIdentity, StateError> {
        let mut wanted: Vec<String> = vec![EDGE_CERT_NAME.to_string()];
        wanted.extend(names.iter().cloned());
        let cert_path = dir.join(SERVER_CERT);
        let key_path = dir.join(SERVER_KEY);
        if let Some(identity) = self.current_server(&cert_path, &key_path, &wanted, now) {
            return Ok(identity);
        }
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(wanted)?;
        let mut name = DistinguishedName::new();
        name.push(DnType::OrganizationName, "iop");
        name.push(DnType::CommonName, EDGE_CERT_NAME);
        params.distinguished_name = name;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.not_before = datetime(now - BACKDATE);
        params.not_after = datetime(now + SERVER_LIFETIME);
        params.serial_number = Some(serial());
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &self.issuer()?)?;
        let io = |source| StateError::Io {
            dir: dir.to_path_buf(),
            source,
        };
        write_private(&key_path, key.serialize_pem().as_bytes()).map_err(io)?;
        write_private(&cert_path, cert.pem().as_bytes()).map_err(io)?;
        Ok(ServerIdentity {
            chain: vec![cert.der().clone(), self.cert.clone()],
            key: PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            renewed: true,
        })
    }

    /// The stored server certificate when it is still good for `wanted` names at `now`.
    fn current_server(
        &self,
        cert_path: &Path,
        key_path: &Path,
        wanted: &[String],
        now: SystemTime,
    ) -> Option<ServerIdentity> {
        let cert = CertificateDer::from_pem_file(cert_path).ok()?;
        let key = PrivateKeyDer::from_pem_file(key_path).ok()?;
        let (_, parsed) = x509_parser::parse_x509_certificate(&cert).ok()?;
        let (_, ca) = x509_parser::parse_x509_certificate(&self.cert).ok()?;
        if parsed.verify_signature(Some(ca.public_key())).is_err() {
            tracing::warn!(file = %cert_path.display(), "server certificate is not from this CA: issuing a new one");
            return None;
        }
        let not_after = parsed.validity().not_after.timestamp();
        let renew_at = unix_secs(now + SERVER_RENEW_BEFORE);
        if not_after <= renew_at {
            tracing::info!(file = %cert_path.display(), "server certificate near its end: renewing it under the same CA");
            return None;
        }
        let mut names: Vec<String> = parsed
            .subject_alternative_name()
            .ok()
            .flatten()
            .map(|san| {
                san.value
                    .general_names
                    .iter()
                    .map(|n| match n {
                        x509_parser::extensions::GeneralName::DNSName(d) => d.to_string(),
                        x509_parser::extensions::GeneralName::IPAddress(ip) => ip_text(ip),
                        other => format!("{other:?}"),
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut want: Vec<String> = wanted
            .iter()
            .map(|n| match n.parse::<std::net::IpAddr>() {
                Ok(ip) => ip.to_string(),
                Err(_) => n.clone(),
            })
            .collect();
        names.sort();
        want.sort();
        want.dedup();
        names.dedup();
        if names != want {
            tracing::info!(file = %cert_path.display(), "node_tls.names changed: issuing a new server certificate");
            return None;
        }
        Some(ServerIdentity {
            chain: vec![cert, self.cert.clone()],
            key,
            renewed: false,
        })
    }

    /// Issues a node credential for the key in `csr_der`: a client-auth certificate named
    /// `node_id`, valid from `not_before` for `lifetime`. The request's own subject and
    /// extensions are ignored.
    pub fn issue_node_cert(
        &self,
        node_id: &str,
        csr_der: &[u8],
        not_before: SystemTime,
        lifetime: Duration,
    ) -> Result<IssuedCert, String> {
        let csr =
            CertificateSigningRequestParams::from_der(&CertificateSigningRequestDer::from(csr_der))
                .map_err(|e| format!("bad certificate signing request: {e}"))?;
        let mut request = csr;
        let mut name = DistinguishedName::new();
        name.push(DnType::OrganizationName, "iop node");
        name.push(DnType::CommonName, node_id);
        let not_after = not_before + lifetime;
        let mut params = CertificateParams::default();
        params.distinguished_name = name;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.not_before = datetime(not_before);
        params.not_after = datetime(not_after);
        params.serial_number = Some(serial());
        params.use_authority_key_identifier_extension = true;
        request.params = params;
        let issuer = self
            .issuer()
            .map_err(|e| format!("the edge CA cannot sign: {e}"))?;
        let cert = request
            .signed_by(&issuer)
            .map_err(|e| format!("cannot issue the node certificate: {e}"))?;
        Ok(IssuedCert {
            der: cert.der().clone(),
            not_after_unix_ms: unix_secs(not_after) as u64 * 1000,
        })
    }
}

fn ip_text(bytes: &[u8]) -> String {
    match bytes.len() {
        4 => std::net::IpAddr::from(<[u8; 4]>::try_from(bytes).expect("4 bytes")).to_string(),
        16 => std::net::IpAddr::from(<[u8; 16]>::try_from(bytes).expect("16 bytes")).to_string(),
        _ => hex::encode(bytes),
    }
}

pub fn unix_secs(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_is_created_once_and_reloaded_with_the_same_pin() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let (ca, created) = EdgeCa::load_or_create(&state).unwrap();
        assert!(created);
        let (again, created) = EdgeCa::load_or_create(&state).unwrap();
        assert!(!created);
        assert_eq!(ca.pin(), again.pin());
    }

    #[test]
    fn a_missing_ca_key_after_the_first_start_is_an_error_not_a_new_ca() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        EdgeCa::load_or_create(&state).unwrap();
        std::fs::remove_file(state.join(CA_KEY)).unwrap();
        let err = EdgeCa::load_or_create(&state).unwrap_err().to_string();
        assert!(err.contains("ca.key") && err.contains("backup"), "{err}");
        // Both gone while other state remains: still an error.
        std::fs::remove_file(state.join(CA_CERT)).unwrap();
        std::fs::write(state.join("join-tokens.json"), "[]").unwrap();
        let err = EdgeCa::load_or_create(&state).unwrap_err().to_string();
        assert!(err.contains("move the directory away"), "{err}");
    }

    #[test]
    fn the_server_certificate_is_kept_renewed_and_reissued_for_new_names() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, _) = EdgeCa::load_or_create(dir.path()).unwrap();
        let now = SystemTime::now();
        let first = ca.server_identity(dir.path(), &[], now).unwrap();
        assert!(first.renewed);
        assert_eq!(Pin::of_certificate(&first.chain[1]).unwrap(), ca.pin());
        let same = ca.server_identity(dir.path(), &[], now).unwrap();
        assert!(!same.renewed);
        assert_eq!(same.chain[0], first.chain[0]);
        let later = now + SERVER_LIFETIME - Duration::from_secs(86_400);
        assert!(ca.server_identity(dir.path(), &[], later).unwrap().renewed);
        let named = ca
            .server_identity(
                dir.path(),
                &["edge.example.net".into(), "10.0.0.1".into()],
                later,
            )
            .unwrap();
        assert!(named.renewed);
        let kept = ca
            .server_identity(
                dir.path(),
                &["10.0.0.1".into(), "edge.example.net".into()],
                later,
            )
            .unwrap();
        assert!(!kept.renewed);
    }

    #[test]
    fn node_certificates_name_the_node_whatever_the_request_says() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, _) = EdgeCa::load_or_create(dir.path()).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["evil.example".to_string()]).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "someone-else");
        let csr = params.serialize_request(&key).unwrap();
        let issued = ca
            .issue_node_cert(
                "gpu-box",
                csr.der(),
                SystemTime::now(),
                Duration::from_secs(86_400),
            )
            .unwrap();
        let (_, cert) = x509_parser::parse_x509_certificate(&issued.der).unwrap();
        let cn: Vec<_> = cert
            .subject()
            .iter_common_name()
            .map(|c| c.as_str().unwrap().to_string())
            .collect();
        assert_eq!(cn, ["gpu-box"]);
        assert!(cert.subject_alternative_name().unwrap().is_none());
        assert!(
            ca.issue_node_cert("x", b"garbage", SystemTime::now(), Duration::from_secs(1))
                .is_err()
        );
    }
}
