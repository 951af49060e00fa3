//! iop Node: runs next to the backends. Dials the edge, registers, applies the config it
//! is given, runs adapters (OpenAI-compatible, vLLM, Ollama, CLI, mock: the
//! `iop-adapters` crate, with the usage readers and the run sink) and relays their events
//! or raw HTTP/SSE bytes back, records its runs in SQLite, and reconnects by itself.
//!
//! `supervisor` owns the connection life (`edge_probe`: is the edge back?; `fleet`: the
//! edges of a fleet, one link to each); `session` is one connection, `link` how it reaches
//! and authenticates to the edge (`tls`, `identity`: the state file); `runtime` is the
//! state that outlives connections (adapter `instance`s, active runs, store); `runs`, `tunnel` and
//! `commands` handle the three kinds of work the edge sends (a run's events leave through
//! `run_outlet`, onto the link it came on; `permits`: how many of a
//! provider's slots each linked edge may use; `model_jobs`: model pulls on Ollama
//! providers, which outlive their commands); `probe` checks each provider's
//! health (`health` is the state machine) and the session reports changes to the edge.

pub(crate) use iop_adapters as adapters;
pub(crate) use iop_adapters::{sink, usage};
pub(crate) mod commands;
pub mod config;
pub(crate) mod edge_probe;
pub(crate) mod fleet;
pub(crate) mod health;
pub(crate) mod identity;
pub(crate) mod instance;
pub(crate) mod journal;
pub mod link;
pub(crate) mod model_jobs;
pub(crate) mod permit_desk;
pub(crate) mod permits;
pub(crate) mod probe;
pub(crate) mod run_outlet;
pub(crate) mod runs;
pub(crate) mod runtime;
pub(crate) mod session;
pub mod store;
pub(crate) mod supervisor;
pub mod tls;
pub(crate) mod tunnel;

pub use config::NodeConfig;
pub use link::{EdgeLink, Security};
pub use runtime::NodeRuntime;
pub use session::EdgeTarget;
pub use supervisor::{NodeExit, supervise};
