//! `iop mock-provider`: a standalone OpenAI- and Ollama-compatible backend.

use std::net::SocketAddr;
use std::time::Duration;

use iop_mock::prefix_cache::PrefixCacheConfig;
use iop_mock::{MockConfig, MockServer};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Address to serve on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// Output tokens per response (a request's max_tokens may lower it).
    #[arg(long, default_value_t = 16)]
    tokens: u32,
    /// Delay before each token, in milliseconds.
    #[arg(long, default_value_t = 0)]
    token_delay_ms: u64,
    /// Emit reasoning deltas and report reasoning tokens for every model.
    #[arg(long)]
    reasoning: bool,
    /// Report this many cached prompt tokens (prompt_tokens_details.cached_tokens).
    #[arg(long)]
    cached_tokens: Option<u64>,
    /// Pause before each progress line of an Ollama model pull (`/api/pull`), in
    /// milliseconds.
    #[arg(long, default_value_t = 50)]
    pull_step_ms: u64,
    /// Model an inference server's prefix (KV) cache of this many 16-token blocks (LRU):
    /// the time to first token is --prefill-base-ms plus --prefill-us-per-token for each
    /// prompt token not cached, and usage reports the cached tokens. 0: off.
    #[arg(long, default_value_t = 0)]
    prefix_cache_blocks: usize,
    /// With --prefix-cache-blocks: time to first token of a fully cached prompt.
    #[arg(long, default_value_t = 20)]
    prefill_base_ms: u64,
    /// With --prefix-cache-blocks: prefill time per uncached prompt token (a prompt token
    /// is four bytes of its text).
    #[arg(long, default_value_t = 250)]
    prefill_us_per_token: u64,
}

pub async fn run(args: Args) -> super::Result {
    let config = MockConfig {
        tokens: args.tokens,
        token_delay: Duration::from_millis(args.token_delay_ms),
        reasoning: args.reasoning,
        cached_tokens: args.cached_tokens,
        pull_step: Duration::from_millis(args.pull_step_ms),
        prefix_cache: (args.prefix_cache_blocks > 0).then(|| PrefixCacheConfig {
            blocks: args.prefix_cache_blocks,
            base: Duration::from_millis(args.prefill_base_ms),
            per_token: Duration::from_micros(args.prefill_us_per_token),
        }),
    };
    let server = MockServer::start(args.listen, config)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    println!(
        "iop mock-provider listening: http://{} (OpenAI API at {}, Ollama API at {})",
        server.addr,
        server.openai_base(),
        server.ollama_base()
    );
    let shutdown = crate::signals::shutdown_on_signal();
    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = server.wait() => {}
    }
    Ok(())
}
