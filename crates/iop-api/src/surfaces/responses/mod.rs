//! The OpenAI Responses API as a codec: a request ([`request`]) translates into the
//! canonical chat request; the canonical answer renders as a `response` object or its
//! event stream ([`render`]); errors take OpenAI's shape.

pub mod render;
pub mod request;
