//! The Edge–Node wire (`iop.edge-node-runtime-wire`): the protobuf types generated from
//! `proto/iop/runtime.proto`, the length-prefixed frame codec, and the split connection
//! (frame reader + batching frame writer) both daemons run over a TCP or TLS stream, the
//! heartbeat both sides keep on it, the one-scheduler-round yield the relay path uses to
//! batch what is ready into one write, the trust material (CA pin, join string) an
//! operator carries from the edge to a node, and the typed error reasons ([`ErrorCode`])
//! with their fault / status / retry table.
//!
//! Nothing above this crate sees bytes: the edge and the node exchange [`pb::Envelope`]s.

pub mod codec;
pub mod connection;
pub mod envelope;
pub mod error_code;
pub mod heartbeat;
pub mod model_name;
pub mod run_event;
pub mod trust;
pub mod yield_once;

/// Generated protobuf types of package `iop.runtime.v1`.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/iop.runtime.v1.rs"));
}

pub use codec::{DEFAULT_MAX_FRAME_BYTES, EnvelopeCodec, FrameError};
pub use connection::{ByteStream, FrameReader, Outbound, split_stream};
pub use error_code::{Disposition, Fault};
pub use heartbeat::{HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, Heartbeat};
pub use pb::ErrorCode;
pub use yield_once::yield_once;

/// The wire contract id this crate implements.
pub const WIRE_CONTRACT: &str = "iop.edge-node-runtime-wire";
