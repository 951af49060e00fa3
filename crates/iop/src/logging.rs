//! Log setup: lines on stderr, filtered by `RUST_LOG` (default `info`) — human-readable
//! text, or one JSON object per line (`--log-format json`) for a log pipeline.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
}

pub fn init(format: Format) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,hyper=warn,reqwest=warn"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    match format {
        Format::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        Format::Json => logs.json().with_current_span(true).init(),
    }
}
