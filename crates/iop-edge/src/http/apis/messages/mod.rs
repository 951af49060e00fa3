//! The Anthropic Messages API (`POST /v1/messages`) on the chat path: the request
//! translated to chat ([`request`]), the answer rendered as a `message` object or its
//! event stream ([`render`]), and errors in the API's own shape ([`error`]).

pub mod error;
pub mod render;
pub mod request;
