//! The canonical request and answer that every client API is a codec around, in pure
//! modules (no HTTP server, no edge state): a surface decodes a client's request into a
//! [`request::Decoded`] (the canonical OpenAI-form body beside the client's own request)
//! and renders one [`answer::AnswerEvent`] stream in its own shape; errors are
//! [`error::ApiError`]s built from the wire crate's reason table.
//!
//! [`json`] keeps a request body as its raw top-level fields (reading one parses only
//! it); [`fields`] reads translated requests strictly, naming the offending field.

pub mod answer;
pub mod error;
pub mod fields;
pub mod json;
pub mod request;

pub use answer::{AnswerEvent, Finish, FinishReason, ToolCall};
pub use error::ApiError;
pub use json::ClientRequest;
pub use request::{
    Canonical, Decoded, Immediate, LaneInputs, ModelRequest, Native, NativeApi, Operation,
};
