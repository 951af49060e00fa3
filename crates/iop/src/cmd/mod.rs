//! One module per subcommand; each exposes `Args` and `run`.

pub mod bench;
pub mod bench_cpu;
pub mod bench_percentile;
pub mod bench_sessions;
pub mod bench_streams;
pub mod demo;
pub mod edge;
pub mod edge_api;
pub mod join_token;
pub mod mock_provider;
pub mod models;
pub mod node;
pub mod revoke;
pub mod status;
pub mod usage;

/// A failed command: what to print and the process exit code.
#[derive(Debug)]
pub struct Failure {
    pub message: String,
    pub code: u8,
}

/// Exit codes.
pub const EXIT_ERROR: u8 = 1;
/// A configuration or credential problem: fix it, retrying will not help.
pub const EXIT_CONFIG: u8 = 2;
/// The node gave up reconnecting (reconnect.max_attempts).
pub const EXIT_EXHAUSTED: u8 = 3;

impl Failure {
    pub fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            code,
        }
    }
}

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure::new(EXIT_ERROR, e.to_string())
    }
}

pub type Result = std::result::Result<(), Failure>;
