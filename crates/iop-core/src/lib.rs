//! The edge's core, walled off from its I/O: pure state machines and decisions (no I/O,
//! no async runtime; whatever depends on time takes `now`), each tested exhaustively on
//! its own (`cargo test -p iop-core`).
//!
//! - [`registry`]: node ownership and generations (register → ready → lost);
//! - [`lease`] and [`queue`]: per-provider capacity in normal and long-context lanes, and
//!   the waiters of each model group in order;
//! - [`routing`]: which member a request prefers, from its session and prefix hashes;
//! - [`health`] and [`ejection`]: what probes and failed requests say of a member;
//! - [`retry_budget`], [`throttle`]: retries within a share of traffic, wrong keys slowed;
//! - [`auth`], [`key_limits`], [`day_tokens`]: API keys and what each may do and spend;
//! - [`join`] and [`revocation`]: node join tokens and the credentials an admin revoked.

pub mod auth;
pub mod day_tokens;
pub mod ejection;
pub mod health;
pub mod join;
pub mod key_limits;
pub mod lease;
pub mod queue;
pub mod registry;
pub mod retry_budget;
pub mod revocation;
pub mod routing;
pub mod throttle;

// The names the modules use for what they read.
use iop_api::canonical;
use iop_edge_config as config;
