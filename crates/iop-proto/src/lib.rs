//! The Edge–Node wire (`iop.edge-node-runtime-wire`): the protobuf types generated from
//! `proto/iop/runtime.proto`, the length-prefixed frame codec, and the split connection
//! (frame reader + batching frame writer) both daemons run over a TCP or TLS stream, the
//! heartbeat both sides keep on it, the one-scheduler-round yield the relay path uses to
//! batch what is ready into one write, the trust material (CA pin, join string) an
//! operator carries from the edge to a node, and the typed error reasons ([`ErrorCode`])
//! with their fault / status / retry table.
//!
//! Nothing above this crate sees bytes: the edge and the node exchange [`pb::Envelope`]s.
//!
//! The codec, the connection, the heartbeat and the yield need an async runtime, a
//! certificate's pin and the owner-only files of secrets ([`private_file`]) the daemons'
//! TLS and files; they come with the `io` feature (the daemons turn it on); without it the crate is the wire's types
//! and facts alone, for pure layers such as `iop-api`.

#[cfg(feature = "io")]
pub mod codec;
#[cfg(feature = "io")]
pub mod connection;
pub mod envelope;
pub mod error_code;
pub mod health_check;
#[cfg(feature = "io")]
pub mod heartbeat;
pub mod model_name;
#[cfg(feature = "io")]
pub mod private_file;
pub mod provider_kind;
pub mod run_event;
pub mod trust;
pub mod usage;
#[cfg(feature = "io")]
pub mod yield_once;

/// Data frames (deltas, body chunks) a node may have in flight per stream before it waits
/// for credit from the edge, unless the stream's open says otherwise.
pub const STREAM_WINDOW: u32 = 256;

/// Generated protobuf types of package `iop.runtime.v1`.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/iop.runtime.v1.rs"));
}

#[cfg(feature = "io")]
pub use codec::{EnvelopeCodec, FrameError};
#[cfg(feature = "io")]
pub use connection::{ByteStream, FrameReader, Outbound, split_stream};
pub use error_code::{Disposition, Fault};
#[cfg(feature = "io")]
pub use heartbeat::{HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, Heartbeat};
pub use pb::ErrorCode;
#[cfg(feature = "io")]
pub use yield_once::yield_once;

/// Default largest frame either side accepts: 16 MiB.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 16 * 1024 * 1024;

/// The wire contract id this crate implements.
pub const WIRE_CONTRACT: &str = "iop.edge-node-runtime-wire";
