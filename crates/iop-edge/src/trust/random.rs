//! The randomness behind the edge's secrets (join token ids and secrets, certificate
//! serials and CA names), all from the operating system's CSPRNG.

/// Fills `buf` from the operating system's CSPRNG.
pub fn random_bytes(buf: &mut [u8]) {
    rustls::crypto::ring::default_provider()
        .secure_random
        .fill(buf)
        .expect("the operating system's random number generator failed");
}
