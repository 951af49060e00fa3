//! How the node verifies the edge, and the TLS client setup it dials with.
//!
//! By pin (the default): the edge's certificate chain must contain a CA certificate whose
//! public key hashes to one of the pins, and the server certificate must chain to that CA
//! for server use. The host name is not checked: the pinned CA is the edge's own, and it
//! signs nothing but this edge's certificates. By CA file (`--edge-ca`): ordinary WebPKI
//! verification, host name included. Verification fails closed; the only way around it is
//! `insecure_skip_tls_verify`. A pin mismatch is recognised ([`is_pin_mismatch`]) so the
//! node can stop and say so instead of retrying.

use std::sync::Arc;

use iop_proto::trust::{EDGE_CERT_NAME, Pin};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::ParsedCertificate;
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, Error, OtherError, RootCertStore,
    SignatureScheme,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

/// How the node decides that it talks to its edge.
#[derive(Debug, Clone)]
pub enum EdgeVerification {
    /// Any of these CA pins.
    Pins(Vec<Pin>),
    /// These CA certificates, with host-name checking.
    CaFile(Vec<CertificateDer<'static>>),
    /// No verification at all (`insecure_skip_tls_verify`).
    InsecureSkipVerify,
}

/// The edge's chain held no CA with an accepted pin.
#[derive(Debug)]
pub struct PinMismatch {
    pub expected: Vec<Pin>,
    pub presented: Vec<Pin>,
}

impl std::fmt::Display for PinMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |pins: &[Pin]| {
            pins.iter()
                .map(Pin::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        write!(
            f,
            "the edge's certificate does not match the pin: expected {}, the edge presented {}",
            list(&self.expected),
            if self.presented.is_empty() {
                "no CA certificate".to_string()
            } else {
                list(&self.presented)
            }
        )
    }
}

impl std::error::Error for PinMismatch {}

/// The pin mismatch behind a failed handshake, if that is what failed.
pub fn is_pin_mismatch(err: &std::io::Error) -> Option<String> {
    let rustls_err = err.get_ref()?.downcast_ref::<Error>()?;
    match rustls_err {
        Error::InvalidCertificate(CertificateError::Other(OtherError(inner))) => {
            inner.downcast_ref::<PinMismatch>().map(ToString::to_string)
        }
        _ => None,
    }
}

/// The TLS alert the edge sent, if the connection ended with one.
pub fn received_alert(err: &std::io::Error) -> Option<rustls::AlertDescription> {
    match err.get_ref()?.downcast_ref::<Error>()? {
        Error::AlertReceived(alert) => Some(*alert),
        _ => None,
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The client config for dialing the edge, with the node's client certificate if it has
/// one. TLS 1.3 only.
pub fn client_config(
    verification: &EdgeVerification,
    client_cert: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> Result<Arc<ClientConfig>, String> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| format!("TLS setup: {e}"))?;
    let builder = match verification {
        EdgeVerification::CaFile(certs) => {
            let mut roots = RootCertStore::empty();
            for cert in certs {
                roots
                    .add(cert.clone())
                    .map_err(|e| format!("edge CA certificate: {e}"))?;
            }
            builder.with_root_certificates(roots)
        }
        EdgeVerification::Pins(pins) => {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(EdgeVerifier {
                    pins: Some(pins.clone()),
                    provider,
                }))
        }
        EdgeVerification::InsecureSkipVerify => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(EdgeVerifier {
                pins: None,
                provider,
            })),
    };
    let config = match client_cert {
        Some((chain, key)) => builder
            .with_client_auth_cert(chain, key)
            .map_err(|e| format!("the node's client certificate and key do not fit: {e}"))?,
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

/// The server name to send for `edge_addr` (`host:port`) under `verification`.
pub fn server_name(
    verification: &EdgeVerification,
    edge_addr: &str,
) -> Result<ServerName<'static>, String> {
    match verification {
        EdgeVerification::CaFile(_) => {
            let host = edge_addr
                .rsplit_once(':')
                .map_or(edge_addr, |(host, _)| host)
                .trim_start_matches('[')
                .trim_end_matches(']');
            ServerName::try_from(host.to_string())
                .map_err(|_| format!("{host:?} is not a host name the edge's certificate can name"))
        }
        _ => Ok(ServerName::try_from(EDGE_CERT_NAME).expect("valid DNS name")),
    }
}

/// Verifies the edge by the pin of its CA (the pinned key must sign the chain), or —
/// `pins: None`, `insecure_skip_tls_verify` only — accepts any certificate. Handshake
/// signatures are checked either way.
#[derive(Debug)]
struct EdgeVerifier {
    pins: Option<Vec<Pin>>,
    provider: Arc<CryptoProvider>,
}

fn pin_of(cert: &CertificateDer<'_>) -> Option<Pin> {
    Pin::of_certificate(cert).ok()
}

impl ServerCertVerifier for EdgeVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        let Some(pins) = &self.pins else {
            return Ok(ServerCertVerified::assertion());
        };
        let presented: Vec<(usize, Pin)> = intermediates
            .iter()
            .enumerate()
            .filter_map(|(i, c)| pin_of(c).map(|p| (i, p)))
            .collect();
        let Some(&(index, _)) = presented.iter().find(|(_, p)| pins.contains(p)) else {
            return Err(Error::InvalidCertificate(CertificateError::Other(
                OtherError(Arc::new(PinMismatch {
                    expected: pins.clone(),
                    presented: presented.into_iter().map(|(_, p)| p).collect(),
                })),
            )));
        };
        let mut roots = RootCertStore::empty();
        roots.add(intermediates[index].clone().into_owned())?;
        let others: Vec<CertificateDer<'_>> = intermediates
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != index)
            .map(|(_, c)| c.clone())
            .collect();
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &roots,
            &others,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    };

    use super::*;

    struct Ca {
        cert: CertificateDer<'static>,
        params: CertificateParams,
        key: KeyPair,
    }

    fn ca() -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, "ca");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap().der().clone();
        Ca { cert, params, key }
    }

    fn leaf(ca: &Ca, usage: ExtendedKeyUsagePurpose) -> CertificateDer<'static> {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["somewhere.example".to_string()]).unwrap();
        params.extended_key_usages = vec![usage];
        let issuer = Issuer::from_params(&ca.params, &ca.key);
        params.signed_by(&key, &issuer).unwrap().der().clone()
    }

    fn verify(pins: Vec<Pin>, chain: &[CertificateDer<'static>]) -> Result<(), Error> {
        let verifier = EdgeVerifier {
            pins: Some(pins),
            provider: provider(),
        };
        verifier
            .verify_server_cert(
                &chain[0],
                &chain[1..],
                &ServerName::try_from(EDGE_CERT_NAME).unwrap(),
                &[],
                UnixTime::now(),
            )
            .map(|_| ())
    }

    #[test]
    fn the_pinned_ca_admits_its_server_certificates_whatever_their_name() {
        let ca = ca();
        let pin = pin_of(&ca.cert).unwrap();
        let server = leaf(&ca, ExtendedKeyUsagePurpose::ServerAuth);
        verify(vec![pin], &[server.clone(), ca.cert.clone()]).unwrap();
        // One of several pins is enough (a CA rotation).
        let other = pin_of(&self::ca().cert).unwrap();
        verify(vec![other, pin], &[server, ca.cert.clone()]).unwrap();
    }

    #[test]
    fn another_ca_is_a_pin_mismatch() {
        let ca = ca();
        let server = leaf(&ca, ExtendedKeyUsagePurpose::ServerAuth);
        let wrong = pin_of(&self::ca().cert).unwrap();
        let err = verify(vec![wrong], &[server, ca.cert.clone()]).unwrap_err();
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, err);
        let message = is_pin_mismatch(&io).expect("recognised as a pin mismatch");
        assert!(message.contains("does not match the pin"), "{message}");
    }

    #[test]
    fn a_node_credential_cannot_pose_as_the_edge() {
        let ca = ca();
        let pin = pin_of(&ca.cert).unwrap();
        let client = leaf(&ca, ExtendedKeyUsagePurpose::ClientAuth);
        assert!(verify(vec![pin], &[client, ca.cert.clone()]).is_err());
        // Nor does a chain that leaves the CA out.
        let server = leaf(&ca, ExtendedKeyUsagePurpose::ServerAuth);
        assert!(verify(vec![pin], &[server]).is_err());
    }
}
