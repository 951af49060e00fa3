//! The `iop` binary: parses arguments and hands off to the edge, node and mock libraries.
//! Each subcommand lives in `cmd/`.

/// `println!` through [`out`]: a closed stdout ends the process quietly instead of
/// panicking. Defined before the modules, so it is the one they use.
macro_rules! println {
    () => {
        $crate::out::line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::out::line(format_args!($($arg)*))
    };
}

/// `print!` through [`out`].
macro_rules! print {
    ($($arg:tt)*) => {
        $crate::out::text(format_args!($($arg)*))
    };
}

mod cmd;
mod logging;
mod out;
mod runtime;
mod signals;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

/// mimalloc: the relay path allocates small buffers per frame; glibc's malloc showed up as
/// the largest user-space cost in profiles. Built without transparent huge pages
/// (`no_thp`): with them an idle edge held 10 MB more, its first heap pages backed 2 MB at
/// a time.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// iop serves LLMs from machines you own — GPU boxes behind NAT, laptops running Ollama,
/// CLI coding agents — through one OpenAI-compatible endpoint.
///
/// Run an edge where clients can reach it, and a node next to each backend; nodes dial
/// out to the edge, so they may sit behind NAT. `iop demo` runs both in one process.
#[derive(Debug, Parser)]
#[command(name = "iop", version, propagate_version = true)]
struct Cli {
    /// How log lines are written on stderr: `text` for people, `json` (one object per
    /// line: timestamp, level, message, fields, span) for a log pipeline.
    #[arg(long, global = true, value_enum, env = "IOP_LOG_FORMAT", default_value_t = logging::Format::Text)]
    log_format: logging::Format,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the edge: the public OpenAI-compatible endpoint that nodes connect to.
    Edge(cmd::edge::Args),
    /// Run a node: dials the edge and serves its configured backends.
    Node(cmd::node::Args),
    /// Run edge + node + a mock backend in one process on loopback, to try iop out.
    Demo(cmd::demo::Args),
    /// Run a deterministic OpenAI- and Ollama-compatible backend (for tests and benchmarks).
    MockProvider(cmd::mock_provider::Args),
    /// Show an edge's nodes, providers, capacity and queues.
    Status(cmd::status::Args),
    /// Create a join token for a node on a running edge; prints the join string.
    JoinToken(cmd::join_token::Args),
    /// Revoke a node's credentials on a running edge and close its connection.
    Revoke(cmd::revoke::Args),
    /// Show usage from an edge's ledger: requests and tokens per key, model group, node.
    Usage(cmd::usage::Args),
    /// Manage the models of the fleet's Ollama servers: pull, rm, ls, ps.
    Models(cmd::models::Args),
    /// Load-test an OpenAI-compatible endpoint (or several, side by side). A flag given
    /// twice takes its last value (so a script's defaults can be overridden).
    #[command(args_override_self = true)]
    Bench(cmd::bench::Args),
    /// Print a shell's completion script for iop, e.g.
    /// `iop completions bash > /etc/bash_completion.d/iop` or
    /// `iop completions zsh > "${fpath[1]}/_iop"`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Completions { shell } = cli.command {
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "iop", &mut script);
        out::bytes(&script);
        return ExitCode::SUCCESS;
    }
    logging::init(cli.log_format);
    let threads = match &cli.command {
        Command::Edge(args) => Some(args.runtime.threads),
        Command::Node(args) => Some(args.runtime.threads),
        Command::Demo(args) => Some(args.runtime.threads),
        Command::MockProvider(_)
        | Command::Status(_)
        | Command::JoinToken(_)
        | Command::Revoke(_)
        | Command::Usage(_)
        | Command::Models(_)
        | Command::Bench(_)
        | Command::Completions { .. } => None,
    };
    let runtime = match runtime::build(threads) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("iop: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Edge(args) => cmd::edge::run(args).await,
            Command::Node(args) => cmd::node::run(args).await,
            Command::Demo(args) => cmd::demo::run(args).await,
            Command::MockProvider(args) => cmd::mock_provider::run(args).await,
            Command::Status(args) => cmd::status::run(args).await,
            Command::JoinToken(args) => cmd::join_token::run(args).await,
            Command::Revoke(args) => cmd::revoke::run(args).await,
            Command::Usage(args) => cmd::usage::run(args).await,
            Command::Models(args) => cmd::models::run(args).await,
            Command::Bench(args) => cmd::bench::run(args).await,
            Command::Completions { .. } => Ok(()),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            if cli.log_format == logging::Format::Json {
                // One more log line, so a pipeline reading JSON sees why the process ended.
                tracing::error!(exit_code = err.code, "{}", err.message);
            } else {
                eprintln!("iop: {}", err.message);
            }
            ExitCode::from(err.code)
        }
    }
}
