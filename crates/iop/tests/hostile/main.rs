//! Hostile-network tests: real `iop` processes on loopback, attacked the way an anonymous
//! peer, a client or a misbehaving node would. One module per attack surface.

#[path = "../common/mod.rs"]
mod common;

mod catalog;
mod cli;
mod ejection;
mod http;
mod load;
mod node_listener;
mod node_return;
