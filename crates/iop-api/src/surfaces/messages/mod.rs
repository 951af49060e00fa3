//! The Anthropic Messages API as a codec: a request ([`request`]) translates into the
//! canonical chat request; the canonical answer renders as a `message` object or its
//! event stream ([`render`]); errors take Anthropic's shape ([`error`]).

pub mod error;
pub mod render;
pub mod request;
