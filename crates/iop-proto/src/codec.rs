//! Frame codec: a big-endian `u32` length followed by one protobuf [`Envelope`].
//!
//! The decoder refuses a frame whose announced length exceeds the configured maximum
//! before buffering it, so a peer cannot make us allocate more than the limit. Errors are
//! typed so the connection owner can log why it closed the connection.

pub use crate::DEFAULT_MAX_FRAME_BYTES;
use bytes::{Buf, BufMut, BytesMut};
use prost::Message;
use tokio_util::codec::{Decoder, Encoder};

use crate::pb::Envelope;

const HEADER_LEN: usize = 4;
/// Free room kept in the read buffer while a frame is incomplete, so one read takes in
/// whatever the peer sent (many small frames of a burst) instead of the few bytes left.
const READ_ROOM: usize = 8 * 1024;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("undecodable frame: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("connection error: {0}")]
    Io(#[from] std::io::Error),
}

/// Length-prefixed [`Envelope`] codec with a maximum frame size.
#[derive(Debug, Clone, Copy)]
pub struct EnvelopeCodec {
    max_frame_bytes: usize,
}

impl EnvelopeCodec {
    pub fn new(max_frame_bytes: usize) -> Self {
        Self { max_frame_bytes }
    }

    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    /// Changes the limit for the frames decoded from now on: the edge reads a connection's
    /// first frame under a small limit and raises it once the peer has authenticated.
    pub fn set_max_frame_bytes(&mut self, max_frame_bytes: usize) {
        self.max_frame_bytes = max_frame_bytes;
    }
}

impl Default for EnvelopeCodec {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_FRAME_BYTES)
    }
}

impl Decoder for EnvelopeCodec {
    type Item = Envelope;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Envelope>, FrameError> {
        if src.len() < HEADER_LEN {
            src.reserve(READ_ROOM);
            return Ok(None);
        }
        let len = u32::from_be_bytes([src[0], src[1], src[2], src[3]]) as usize;
        if len > self.max_frame_bytes {
            return Err(FrameError::TooLarge {
                len,
                max: self.max_frame_bytes,
            });
        }
        if src.len() < HEADER_LEN + len {
            src.reserve((HEADER_LEN + len - src.len()).max(READ_ROOM));
            return Ok(None);
        }
        src.advance(HEADER_LEN);
        let frame = src.split_to(len).freeze();
        Ok(Some(Envelope::decode(frame)?))
    }
}

impl Encoder<Envelope> for EnvelopeCodec {
    type Error = FrameError;

    fn encode(&mut self, item: Envelope, dst: &mut BytesMut) -> Result<(), FrameError> {
        let len = item.encoded_len();
        if len > self.max_frame_bytes {
            return Err(FrameError::TooLarge {
                len,
                max: self.max_frame_bytes,
            });
        }
        dst.reserve(HEADER_LEN + len);
        dst.put_u32(len as u32);
        item.encode(dst).expect("reserved enough capacity");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::{self, envelope::Message as M};

    fn ping(nonce: u64) -> Envelope {
        Envelope {
            message: Some(M::Ping(pb::Ping { nonce })),
        }
    }

    fn encoded(env: Envelope) -> BytesMut {
        let mut buf = BytesMut::new();
        EnvelopeCodec::default().encode(env, &mut buf).unwrap();
        buf
    }

    #[test]
    fn round_trips_one_frame() {
        let mut buf = encoded(ping(7));
        let got = EnvelopeCodec::default().decode(&mut buf).unwrap();
        assert_eq!(got, Some(ping(7)));
        assert!(buf.is_empty());
    }

    #[test]
    fn split_reads_yield_nothing_until_the_frame_is_whole() {
        let whole = encoded(ping(42));
        let mut codec = EnvelopeCodec::default();
        let mut buf = BytesMut::new();
        for (i, byte) in whole.iter().enumerate() {
            buf.put_u8(*byte);
            let got = codec.decode(&mut buf).unwrap();
            if i + 1 < whole.len() {
                assert_eq!(got, None, "decoded early at byte {i}");
            } else {
                assert_eq!(got, Some(ping(42)));
            }
        }
    }

    #[test]
    fn two_frames_in_one_read_decode_in_order() {
        let mut buf = encoded(ping(1));
        buf.extend_from_slice(&encoded(ping(2)));
        let mut codec = EnvelopeCodec::default();
        assert_eq!(codec.decode(&mut buf).unwrap(), Some(ping(1)));
        assert_eq!(codec.decode(&mut buf).unwrap(), Some(ping(2)));
        assert_eq!(codec.decode(&mut buf).unwrap(), None);
    }

    #[test]
    fn oversized_length_is_refused_before_buffering() {
        let mut codec = EnvelopeCodec::new(1024);
        let mut buf = BytesMut::new();
        buf.put_u32(1025);
        match codec.decode(&mut buf) {
            Err(FrameError::TooLarge {
                len: 1025,
                max: 1024,
            }) => {}
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }

    #[test]
    fn a_small_first_frame_limit_refuses_a_huge_announcement_without_allocating_it() {
        let mut codec = EnvelopeCodec::new(64 * 1024);
        let mut buf = BytesMut::new();
        buf.put_u32(16 * 1024 * 1024);
        buf.extend_from_slice(&[0u8; 100]);
        let err = codec.decode(&mut buf).unwrap_err();
        assert!(
            matches!(err, FrameError::TooLarge { max: 65536, .. }),
            "{err}"
        );
        assert!(buf.capacity() < 64 * 1024, "buffered {}", buf.capacity());
    }

    #[test]
    fn a_raised_limit_applies_to_the_next_frames() {
        let big = Envelope {
            message: Some(M::ProviderTunnelFrame(pb::ProviderTunnelFrame {
                request_id: "r".into(),
                frame: Some(pb::provider_tunnel_frame::Frame::Body(
                    vec![0u8; 4096].into(),
                )),
            })),
        };
        let mut wire = encoded(ping(1));
        wire.extend_from_slice(&encoded(big.clone()));
        let mut codec = EnvelopeCodec::new(1024);
        assert_eq!(codec.decode(&mut wire).unwrap(), Some(ping(1)));
        codec.set_max_frame_bytes(8192);
        assert_eq!(codec.decode(&mut wire).unwrap(), Some(big));
    }

    #[test]
    fn frame_exactly_at_the_limit_is_accepted() {
        let env = ping(u64::MAX);
        let len = env.encoded_len();
        let mut codec = EnvelopeCodec::new(len);
        let mut buf = BytesMut::new();
        codec.encode(env.clone(), &mut buf).unwrap();
        assert_eq!(codec.decode(&mut buf).unwrap(), Some(env));
    }

    #[test]
    fn encoder_refuses_oversized_messages() {
        let env = Envelope {
            message: Some(M::ProviderTunnelFrame(pb::ProviderTunnelFrame {
                request_id: "r".into(),
                frame: Some(pb::provider_tunnel_frame::Frame::Body(
                    vec![0u8; 2048].into(),
                )),
            })),
        };
        let mut buf = BytesMut::new();
        let err = EnvelopeCodec::new(1024).encode(env, &mut buf).unwrap_err();
        assert!(
            matches!(err, FrameError::TooLarge { max: 1024, .. }),
            "{err}"
        );
    }

    #[test]
    fn garbage_is_a_decode_error() {
        let mut buf = BytesMut::new();
        buf.put_u32(4);
        buf.extend_from_slice(&[0xff, 0xff, 0xff, 0xff]);
        let err = EnvelopeCodec::default().decode(&mut buf).unwrap_err();
        assert!(matches!(err, FrameError::Decode(_)), "{err}");
    }

    proptest::proptest! {
        #[test]
        fn any_chunking_of_a_frame_stream_decodes_the_same(
            nonces in proptest::collection::vec(proptest::num::u64::ANY, 1..20),
            cuts in proptest::collection::vec(1usize..64, 1..50),
        ) {
            let mut wire = BytesMut::new();
            for n in &nonces {
                wire.extend_from_slice(&encoded(ping(*n)));
            }
            let mut codec = EnvelopeCodec::default();
            let mut buf = BytesMut::new();
            let mut got = Vec::new();
            let mut rest = &wire[..];
            let mut cut = cuts.iter().cycle();
            while !rest.is_empty() {
                let n = (*cut.next().unwrap()).min(rest.len());
                buf.extend_from_slice(&rest[..n]);
                rest = &rest[n..];
                while let Some(env) = codec.decode(&mut buf).unwrap() {
                    got.push(env);
                }
            }
            let want: Vec<_> = nonces.iter().map(|n| ping(*n)).collect();
            proptest::prop_assert_eq!(got, want);
        }

        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let mut codec = EnvelopeCodec::new(1024);
            let mut buf = BytesMut::from(&data[..]);
            while let Ok(Some(_)) = codec.decode(&mut buf) {}
        }
    }
}
