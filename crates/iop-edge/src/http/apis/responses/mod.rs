//! The OpenAI Responses API (`POST /v1/responses`) on the chat path: the request
//! translated to chat ([`request`]) and the answer rendered as a `response` object or its
//! event stream ([`render`]).

pub mod render;
pub mod request;
