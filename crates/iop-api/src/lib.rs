//! The client APIs as pure codecs, walled off from the daemons: what a request says and
//! what an answer is, whichever API they come in and go out on.
//!
//! - [`canonical`]: the one request and answer every surface decodes into and renders
//!   from, and the errors in their API-independent form;
//! - [`surfaces`]: the client APIs (OpenAI, Responses, Messages, Ollama, the native runs
//!   API) as decoders, renderers and error shapes;
//! - [`codec`]: the provider side: the canonical request as an OpenAI-compatible
//!   provider's request, its answers and streams read back, run events in canonical form;
//! - [`provider_api`]: the HTTP APIs a provider can serve itself.
//!
//! No I/O, no async runtime, no edge state: everything here is tested on its own
//! (`cargo test -p iop-api`).

pub mod canonical;
pub mod codec;
pub mod provider_api;
pub mod surfaces;
