//! iop edges as a fleet: what several edges share through one PostgreSQL store.
//!
//! - [`store`]: the store itself — its connection pool and TLS, the schema and its
//!   migrations, the table of live edges (heartbeats, the list nodes are told), secrets
//!   sealed with the fleet's key, and the statements of the API key limits;
//! - [`fleet_limits`]: `requests_per_minute`, `tokens_per_day` and `max_concurrent` held
//!   exact across every edge through the store, with each edge's share to fall back on
//!   while the store does not answer.
//!
//! The edge composes these with its own trust store (join tokens and revocations shared
//! through the store) and usage ledger (shipped to it); every decision here that depends
//! on time takes `now`.

pub(crate) use iop_core::key_limits;
pub(crate) use iop_edge_config as config;

pub mod fleet_limits;
pub mod store;
