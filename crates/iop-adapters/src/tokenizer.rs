//! One provider's token counting state: how many counts it serves at once, and which of
//! its endpoints counts a chat, as learnt by the first count (`super::token_count`).

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Semaphore;

/// How long each counting request may take, and a count may wait for a place: counting
/// is quick, and the client is waiting.
pub const COUNT_TIMEOUT: Duration = Duration::from_secs(5);
/// Counts one provider serves at once, whatever the edges ask.
pub const TOKENIZER_PLACES: usize = 4;
/// How long a provider found without a tokenizer is not asked again.
pub const RETRY_MISSING_AFTER: Duration = Duration::from_secs(300);

/// Which endpoints count a chat on a provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// Not learned yet.
    Unknown,
    /// `/tokenize` with `messages` answers a count (vLLM).
    Tokenize,
    /// `/apply-template`, then `/tokenize` of its prompt (llama-server).
    Template,
    /// `/tokenize` is missing; not asked again until then.
    Missing { until: Instant },
}

/// One provider's counting: its places and what it was learned to speak.
#[derive(Debug)]
pub struct Tokenizer {
    pub places: Semaphore,
    pub dialect: Mutex<Dialect>,
}

impl Default for Tokenizer {
    fn default() -> Self {
        Self {
            places: Semaphore::new(TOKENIZER_PLACES),
            dialect: Mutex::new(Dialect::Unknown),
        }
    }
}
