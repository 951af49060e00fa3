//! The mock model's play, shared by the mock server (`iop-mock`) and the node's built-in
//! mock adapter, so that the node does not link a server it never runs: when an agent's
//! conversation gets a tool call ([`agent_turn`]) and the arguments it carries
//! ([`schema`]). Pure: JSON in, JSON out.

pub mod agent_turn;
pub mod schema;
