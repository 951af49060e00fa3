//! Other vendors' APIs on the edge: the OpenAI Responses API (`POST /v1/responses`) and
//! the Anthropic Messages API (`POST /v1/messages`).
//!
//! A request goes to one member of its model group through the same dispatch as a chat
//! request (admission, lease, cancel on disconnect, usage). A member whose provider
//! serves the API itself (provider config `apis`) gets the client's request through the
//! raw tunnel, with the upstream `model`, and its answer's bytes go back untouched. Every
//! other member gets the request translated to chat ([`responses::request`],
//! [`messages::request`]); its answer — a node run's events or a tunnelled chat answer —
//! is read as normalized [`answer`] events ([`source`], [`chat_answer`]) and rendered in
//! the API's own shape ([`responses::render`], [`messages::render`]), streamed or not.
//!
//! Translation and rendering are pure; [`serve`] is the one async entry point.

pub mod answer;
pub mod chat_answer;
pub mod fields;
pub mod messages;
pub mod responses;
pub mod serve;
pub mod source;
pub mod sse;

pub use serve::{messages_routes, responses_routes};
