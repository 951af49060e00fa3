//! A model of an inference server's prefix (KV) cache, for benchmarks of cache-affine
//! routing: the time to first token is `base + per_token × uncached prompt tokens`, where
//! the cached tokens are the leading blocks of the prompt this mock instance still holds.
//!
//! As vLLM and SGLang do, the prompt is cut into blocks of [`BLOCK_TOKENS`] tokens (here a
//! token is four bytes of prompt text), each block's hash chained to the one before, and
//! the blocks live in an LRU of `blocks` entries per instance. A request's blocks are
//! taken into the cache as it is answered. The usage it reports says
//! `prompt_tokens_details.cached_tokens`, as those servers do.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;
use std::time::Duration;

/// Tokens per cache block (vLLM's default block size).
pub const BLOCK_TOKENS: u64 = 16;
/// Bytes of prompt text per token.
const BYTES_PER_TOKEN: u64 = 4;

/// How the cache model behaves.
#[derive(Debug, Clone, Copy)]
pub struct PrefixCacheConfig {
    /// Blocks the cache holds (its KV memory).
    pub blocks: usize,
    /// Time to first token of a prompt that is all cached.
    pub base: Duration,
    /// Prefill time per uncached prompt token.
    pub per_token: Duration,
}

/// What a prompt costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefill {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// The wait before the first token.
    pub delay: Duration,
}

#[derive(Debug)]
pub struct PrefixCache {
    config: PrefixCacheConfig,
    lru: Mutex<Lru>,
}

/// Block hashes by last use.
#[derive(Debug, Default)]
struct Lru {
    used: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
    clock: u64,
}

impl Lru {
    fn holds(&self, hash: u64) -> bool {
        self.used.contains_key(&hash)
    }

    fn touch(&mut self, hash: u64, capacity: usize) {
        self.clock += 1;
        if let Some(old) = self.used.insert(hash, self.clock) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(self.clock, hash);
        while self.used.len() > capacity {
            let Some((_, oldest)) = self.by_age.pop_first() else {
                break;
            };
            self.used.remove(&oldest);
        }
    }
}

impl PrefixCache {
    pub fn new(config: PrefixCacheConfig) -> Self {
        Self {
            config,
            lru: Mutex::new(Lru::default()),
        }
    }

    /// Looks `prompt` up (its leading cached blocks) and takes its blocks in.
    pub fn prefill(&self, prompt: &str) -> Prefill {
        let bytes = prompt.as_bytes();
        let prompt_tokens = (bytes.len() as u64).div_ceil(BYTES_PER_TOKEN);
        let block_bytes = (BLOCK_TOKENS * BYTES_PER_TOKEN) as usize;
        let hashes = chained(bytes, block_bytes);
        let mut lru = self.lru.lock().expect("not poisoned");
        let cached_blocks = hashes.iter().take_while(|h| lru.holds(**h)).count() as u64;
        for hash in &hashes {
            lru.touch(*hash, self.config.blocks);
        }
        let cached_tokens = (cached_blocks * BLOCK_TOKENS).min(prompt_tokens);
        let uncached = prompt_tokens - cached_tokens;
        Prefill {
            prompt_tokens,
            cached_tokens,
            delay: self.config.base + self.config.per_token * uncached as u32,
        }
    }
}

/// The chained hashes of the full blocks of `bytes`.
fn chained(bytes: &[u8], block: usize) -> Vec<u64> {
    let state =
        std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default();
    let mut previous = 0u64;
    bytes
        .chunks_exact(block)
        .map(|chunk| {
            let mut h = state.build_hasher();
            h.write_u64(previous);
            h.write(chunk);
            previous = h.finish();
            previous
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(blocks: usize) -> PrefixCache {
        PrefixCache::new(PrefixCacheConfig {
            blocks,
            base: Duration::from_millis(10),
            per_token: Duration::from_micros(100),
        })
    }

    #[test]
    fn a_second_turn_prefills_only_what_is_new() {
        let c = cache(1000);
        let system = "s".repeat(64 * 50); // 800 tokens, 50 blocks
        let first = c.prefill(&format!("{system} question one"));
        assert_eq!(first.cached_tokens, 0);
        assert_eq!(
            first.delay,
            Duration::from_millis(10) + Duration::from_micros(100) * first.prompt_tokens as u32
        );
        let second = c.prefill(&format!("{system} question one answer question two"));
        assert_eq!(second.cached_tokens, 800);
        assert!(second.delay < first.delay / 4, "{second:?} vs {first:?}");
        let other = c.prefill(&"o".repeat(64 * 50));
        assert_eq!(other.cached_tokens, 0);
    }

    #[test]
    fn the_least_recently_used_blocks_go_first() {
        let c = cache(20);
        let a = "a".repeat(64 * 10);
        let b = "b".repeat(64 * 10);
        let z = "z".repeat(64 * 10);
        c.prefill(&a);
        c.prefill(&b);
        assert_eq!(
            c.prefill(&a).cached_tokens,
            160,
            "a used again: b is now the oldest"
        );
        c.prefill(&z);
        assert_eq!(c.prefill(&a).cached_tokens, 160);
        assert_eq!(c.prefill(&b).cached_tokens, 0, "b was evicted");
    }
}
