//! Sealing the store's secrets with the operator's key (`store.secret_key`): AES-256-GCM,
//! a fresh random nonce per seal, and what the secret is bound in as associated data (a
//! sealed CA key cannot be passed off as anything else). The store keeps a check value
//! derived from the key, so an edge given another key is told so instead of failing to
//! open a seal.

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use sha2::{Digest, Sha256};

use super::error::StoreError;
use crate::config::store::StoreSecretKey;

/// Seals and opens with one key.
pub struct Sealer {
    key: LessSafeKey,
    check: String,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("check", &self.check)
            .finish()
    }
}

impl Sealer {
    pub fn new(key: &StoreSecretKey) -> Self {
        let unbound = UnboundKey::new(&AES_256_GCM, &key.0).expect("a 32-byte AES-256 key");
        let mut check = Sha256::new();
        check.update(b"iop store secret key check\0");
        check.update(key.0);
        Sealer {
            key: LessSafeKey::new(unbound),
            check: hex::encode(&check.finalize()[..8]),
        }
    }

    /// A value that tells keys apart without revealing them (8 bytes of a hash, hex).
    pub fn check(&self) -> &str {
        &self.check
    }

    /// `nonce || ciphertext || tag` of `secret`, bound to `what`.
    pub fn seal(&self, what: &str, secret: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut nonce)
            .expect("the operating system's random number generator failed");
        let mut sealed = secret.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(what.as_bytes()),
                &mut sealed,
            )
            .expect("sealing a secret of reasonable size");
        let mut out = nonce.to_vec();
        out.extend_from_slice(&sealed);
        out
    }

    /// The secret sealed as `what`; an error if it was sealed with another key, as
    /// something else, or altered.
    pub fn open(&self, what: &str, sealed: &[u8]) -> Result<Vec<u8>, StoreError> {
        let refused = || {
            StoreError::Unusable(format!(
                "the store's {what} does not open with this edge's secret key"
            ))
        };
        if sealed.len() < NONCE_LEN {
            return Err(refused());
        }
        let (nonce, body) = sealed.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| refused())?;
        let mut body = body.to_vec();
        let plain = self
            .key
            .open_in_place(nonce, Aad::from(what.as_bytes()), &mut body)
            .map_err(|_| refused())?;
        Ok(plain.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_secret_opens_with_its_key_and_label_only() {
        let sealer = Sealer::new(&StoreSecretKey([7; 32]));
        let sealed = sealer.seal("ca key", b"the key");
        assert!(!sealed.windows(7).any(|w| w == b"the key"));
        assert_eq!(sealer.open("ca key", &sealed).unwrap(), b"the key");
        assert!(sealer.open("other", &sealed).is_err());
        let other = Sealer::new(&StoreSecretKey([8; 32]));
        assert!(other.open("ca key", &sealed).is_err());
        assert_ne!(sealer.check(), other.check());
        let mut altered = sealed.clone();
        *altered.last_mut().unwrap() ^= 1;
        assert!(sealer.open("ca key", &altered).is_err());
        assert_ne!(
            sealer.seal("ca key", b"x"),
            sealer.seal("ca key", b"x"),
            "fresh nonce"
        );
    }
}
