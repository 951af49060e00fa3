//! The edge's HTTP server: plumbing around the service. One listener ([`server`], HTTPS
//! when `http_tls` is set: [`tls`]) with connection deadlines ([`deadlines`]); in front of
//! the routes ([`routes`]: [`front`]) every response gets the request's `x-request-id`
//! ([`request_id`]), browsers get CORS when it is configured ([`cors`]) and bodies are
//! bounded. Then:
//!
//! - [`auth`]: the bearer key (`x-api-key` too on Anthropic's route) becomes the request's
//!   caller; wrong keys are throttled per address;
//! - [`model`]: the one handler of every model endpoint of every API (decode, admit,
//!   serve, render: `surfaces` and `service` do the work), with [`answer`] rendering
//!   canonical answers and [`passthrough`] relaying a provider's own bytes, and
//!   [`keepalive`] keeping a streamed request's connection alive while it waits;
//! - [`runs`]: the native runs API; [`models`] and [`ollama`]: the model catalogs;
//! - [`admin`]: status, metrics, usage, node credentials, node commands, and
//!   [`ollama_models`]: Ollama's model management across the fleet (admin keys only);
//!   and the open probes and status page.
//!
//! On an edge without keys every route is open. Errors render in the shape of the API a
//! request was for ([`error`]).

pub mod admin;
pub mod answer;
pub mod auth;
pub mod background;
pub mod body;
pub mod client_addr;
pub mod connection_table;
pub mod cors;
pub mod count_tokens;
pub mod deadlines;
pub mod decode;
pub mod error;
pub mod forward;
pub mod front;
pub mod keepalive;
pub mod model;
pub mod models;
pub mod ollama;
pub mod ollama_models;
pub mod passthrough;
pub mod request_id;
pub mod resume;
pub mod routes;
pub mod runs;
pub mod server;
pub mod tls;

pub use server::serve_http;
