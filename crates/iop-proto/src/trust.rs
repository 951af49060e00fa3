//! The trust material both daemons exchange out of band: the pin that names an edge's CA
//! and the one-line join string an operator hands to a new node.
//!
//! A pin is `sha256:` and the SHA-256 of a CA certificate's DER SubjectPublicKeyInfo, in
//! unpadded base64url (hex is accepted when parsing). A join string is versioned:
//! `iop1:<host:port>[,<host:port>...]/sha256:<pin>/<token id>.<secret>`. Pure parsing and
//! formatting; no I/O.

use std::fmt;
use std::str::FromStr;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use sha2::{Digest, Sha256};

/// The name an edge's certificate for its node listener is issued for, whatever address
/// the node dials (the node verifies the edge by its CA's pin and this name).
pub const EDGE_CERT_NAME: &str = "iop-edge";

/// The SHA-256 of a CA's SubjectPublicKeyInfo: what a node trusts an edge by.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pin([u8; 32]);

/// A pin, join string or join token that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TrustParseError(String);

/// `der` as PEM text under `label` (`CERTIFICATE`): base64 in 64-character lines.
pub fn pem(label: &str, der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

impl Pin {
    /// The pin of a DER-encoded SubjectPublicKeyInfo.
    pub fn of_spki(spki_der: &[u8]) -> Self {
        Pin(Sha256::digest(spki_der).into())
    }

    /// The pin of a DER certificate's public key; an error says why it is not usable.
    #[cfg(feature = "io")]
    pub fn of_certificate(cert: &rustls_pki_types::CertificateDer<'_>) -> Result<Self, String> {
        let parsed = rustls::server::ParsedCertificate::try_from(cert)
            .map_err(|e| format!("not a usable certificate: {e}"))?;
        Ok(Pin::of_spki(parsed.subject_public_key_info().as_ref()))
    }

    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for Pin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", URL_SAFE_NO_PAD.encode(self.0))
    }
}

impl fmt::Debug for Pin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Pin {
    type Err = TrustParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            TrustParseError(format!(
                "{s:?} is not a pin: expected sha256: followed by 43 base64url or 64 hex characters"
            ))
        };
        let digest = s.trim().strip_prefix("sha256:").ok_or_else(bad)?;
        let mut bytes = [0u8; 32];
        if digest.len() == 64 {
            hex_decode(digest, &mut bytes).ok_or_else(bad)?;
        } else {
            let decoded = URL_SAFE_NO_PAD.decode(digest).map_err(|_| bad())?;
            bytes = decoded.try_into().map_err(|_| bad())?;
        }
        Ok(Pin(bytes))
    }
}

fn hex_decode(s: &str, out: &mut [u8; 32]) -> Option<()> {
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(s.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(())
}

/// The `<id>.<secret>` part of a join string. The id names the token record on the edge
/// (not secret); the secret is what the edge keeps only as a hash.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    pub id: String,
    pub secret: String,
}

impl JoinToken {
    pub fn parse(s: &str) -> Result<Self, TrustParseError> {
        let (id, secret) = s.trim().split_once('.').ok_or_else(|| {
            TrustParseError("a join token is <id>.<secret>; this one has no '.'".into())
        })?;
        let token_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
        if id.is_empty() || secret.is_empty() || !id.chars().all(token_char) {
            return Err(TrustParseError(
                "a join token is <id>.<secret> with both parts non-empty".into(),
            ));
        }
        if !secret.chars().all(token_char) {
            return Err(TrustParseError(
                "the join token's secret has characters a join token never has".into(),
            ));
        }
        Ok(JoinToken {
            id: id.to_string(),
            secret: secret.to_string(),
        })
    }
}

impl fmt::Display for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.id, self.secret)
    }
}

impl fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JoinToken({}.<redacted>)", self.id)
    }
}

/// Everything a node needs to join an edge, in one line.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinString {
    /// `host:port` of the edge's node listener, in the order to try.
    pub edges: Vec<String>,
    pub pin: Pin,
    pub token: JoinToken,
}

/// The only join string version this build reads and writes.
pub const JOIN_STRING_PREFIX: &str = "iop1:";

impl JoinString {
    pub fn parse(s: &str) -> Result<Self, TrustParseError> {
        let s = s.trim();
        let rest = s.strip_prefix(JOIN_STRING_PREFIX).ok_or_else(|| {
            if s.starts_with("iop") && s.contains(':') {
                TrustParseError(format!(
                    "join string version {:?} is not supported by this iop (it reads {JOIN_STRING_PREFIX})",
                    s.split(':').next().unwrap_or_default()
                ))
            } else {
                TrustParseError(format!(
                    "not a join string: it starts with {JOIN_STRING_PREFIX} (create one with `iop join-token`)"
                ))
            }
        })?;
        let parts: Vec<&str> = rest.split('/').collect();
        let [edges, pin, token] = parts[..] else {
            return Err(TrustParseError(
                "a join string is iop1:<edge host:port>/sha256:<pin>/<id>.<secret>".into(),
            ));
        };
        let edges: Vec<String> = edges
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(String::from)
            .collect();
        if edges.is_empty() || edges.iter().any(|e| !e.contains(':')) {
            return Err(TrustParseError(
                "the join string's edge addresses must be host:port".into(),
            ));
        }
        Ok(JoinString {
            edges,
            pin: pin.parse()?,
            token: JoinToken::parse(token)?,
        })
    }
}

impl fmt::Display for JoinString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{JOIN_STRING_PREFIX}{}/{}/{}",
            self.edges.join(","),
            self.pin,
            self.token
        )
    }
}

impl fmt::Debug for JoinString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "JoinString({}/{}/{:?})",
            self.edges.join(","),
            self.pin,
            self.token
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_round_trip_and_accept_hex() {
        let pin = Pin::of_spki(b"some key");
        let text = pin.to_string();
        assert!(
            text.starts_with("sha256:") && text.len() == 7 + 43,
            "{text}"
        );
        assert_eq!(text.parse::<Pin>().unwrap(), pin);
        let hex: String = pin.bytes().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(format!("sha256:{hex}").parse::<Pin>().unwrap(), pin);
        assert!("sha1:abc".parse::<Pin>().is_err());
        assert!("sha256:tooshort".parse::<Pin>().is_err());
    }

    #[test]
    fn join_strings_round_trip() {
        let join = JoinString {
            edges: vec!["edge.example.net:7700".into(), "[::1]:7700".into()],
            pin: Pin::of_spki(b"ca"),
            token: JoinToken {
                id: "0123abcd".into(),
                secret: "s3cr-et_x".into(),
            },
        };
        let text = join.to_string();
        assert!(text.starts_with("iop1:edge.example.net:7700,[::1]:7700/sha256:"));
        assert_eq!(JoinString::parse(&text).unwrap(), join);
        assert!(
            !format!("{join:?}").contains("s3cr"),
            "Debug must not show the secret"
        );
    }

    #[test]
    fn bad_join_strings_say_what_is_wrong() {
        let e = JoinString::parse("iop2:a:1/sha256:x/y.z").unwrap_err();
        assert!(e.to_string().contains("not supported"), "{e}");
        let e = JoinString::parse("hello").unwrap_err();
        assert!(e.to_string().contains("not a join string"), "{e}");
        let pin = Pin::of_spki(b"ca");
        let e = JoinString::parse(&format!("iop1:edge/{pin}/a.b")).unwrap_err();
        assert!(e.to_string().contains("host:port"), "{e}");
        let e = JoinString::parse(&format!("iop1:edge:1/{pin}/nodot")).unwrap_err();
        assert!(e.to_string().contains("<id>.<secret>"), "{e}");
    }
}
