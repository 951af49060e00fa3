//! Prefix affinity: a prompt cut into fixed-size blocks, each block's hash chained to the
//! one before (so a block's hash stands for the whole prompt up to its end), and a bounded
//! index per member of the block hashes recently routed to it.
//!
//! The prompt is what an inference server caches in order: the request's `system` /
//! `instructions`, `tools`, then `messages` (or `prompt` / `input`), as the JSON text the
//! client sent — two turns of one conversation share every block up to where they part.
//!
//! Memory: at most [`MAX_BLOCKS_PER_MEMBER`] hashes per member (two generations of half as
//! many: a lookup reads both, an insert goes to the newer, and a full newer one retires
//! the older), about 300 KiB per member when full; [`MAX_BLOCKS_PER_REQUEST`] hashes per
//! request. Pure.

use std::sync::Arc;

use crate::canonical::ClientRequest;

/// Bytes of prompt per block.
pub const BLOCK_BYTES: usize = 512;
/// The fewest leading blocks a member must hold for the prompt to be steered to it: a
/// shared prefix of at least 1 KiB (a short common system prompt is not worth it).
pub const MIN_MATCH_BLOCKS: usize = 2;
/// Blocks hashed per request: the first 512 KiB of a prompt steer it.
pub const MAX_BLOCKS_PER_REQUEST: usize = 1024;
/// Block hashes kept per member.
pub const MAX_BLOCKS_PER_MEMBER: usize = 16_384;

/// The request fields that make up a prompt, in the order a server reads them.
const PROMPT_FIELDS: &[&str] = &[
    "system",
    "instructions",
    "tools",
    "messages",
    "prompt",
    "input",
];

/// The chained block hashes of `request`'s prompt (only full blocks count).
pub fn blocks(request: &ClientRequest) -> Arc<[u64]> {
    let mut chain = Chain::default();
    for field in PROMPT_FIELDS {
        if let Some(raw) = request.raw(field) {
            chain.feed(raw.get().as_bytes());
            if chain.hashes.len() >= MAX_BLOCKS_PER_REQUEST {
                break;
            }
        }
    }
    chain.hashes.truncate(MAX_BLOCKS_PER_REQUEST);
    chain.hashes.into()
}

/// Hashes bytes fed in pieces as one stream of blocks.
#[derive(Default)]
struct Chain {
    buf: Vec<u8>,
    hashes: Vec<u64>,
}

impl Chain {
    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() && self.hashes.len() < MAX_BLOCKS_PER_REQUEST {
            let take = (BLOCK_BYTES - self.buf.len()).min(bytes.len());
            self.buf.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.buf.len() == BLOCK_BYTES {
                let seed = self.hashes.last().copied().unwrap_or(0x696f_702d_7072_6566);
                self.hashes
                    .push(xxhash_rust::xxh3::xxh3_64_with_seed(&self.buf, seed));
                self.buf.clear();
            }
        }
    }
}

/// The block hashes recently routed to one member, bounded.
#[derive(Debug, Default)]
pub struct BlockIndex {
    newer: hashbrown::HashSet<u64, foldhash::fast::RandomState>,
    older: hashbrown::HashSet<u64, foldhash::fast::RandomState>,
}

impl BlockIndex {
    fn holds(&self, hash: u64) -> bool {
        self.newer.contains(&hash) || self.older.contains(&hash)
    }

    /// How many leading blocks of `blocks` this member holds (a binary search: a block is
    /// held only if the prompt up to it was routed here, so the held ones lead).
    pub fn match_len(&self, blocks: &[u64]) -> usize {
        let (mut lo, mut hi) = (0, blocks.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.holds(blocks[mid]) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Notes that a prompt of `blocks` was routed to this member.
    pub fn record(&mut self, blocks: &[u64]) {
        let half = MAX_BLOCKS_PER_MEMBER / 2;
        for &hash in blocks {
            if self.newer.contains(&hash) {
                continue;
            }
            if self.newer.len() >= half {
                self.older = std::mem::take(&mut self.newer);
            }
            self.newer.insert(hash);
        }
    }

    /// Hashes held now.
    pub fn len(&self) -> usize {
        self.newer.len() + self.older.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn of(body: &serde_json::Value) -> Arc<[u64]> {
        let text = body.to_string();
        blocks(&ClientRequest::parse(text.as_bytes()).unwrap())
    }

    fn chat(system: &str, turns: &[&str]) -> serde_json::Value {
        let mut messages = vec![json!({"role": "system", "content": system})];
        for t in turns {
            messages.push(json!({"role": "user", "content": t}));
        }
        json!({"model": "m", "messages": messages})
    }

    #[test]
    fn turns_of_a_conversation_share_their_leading_blocks() {
        let system = "You are a careful assistant. ".repeat(100);
        let one = of(&chat(&system, &["first question"]));
        let two = of(&chat(&system, &["first question", "second question"]));
        assert!(one.len() >= 5);
        let shared = one
            .iter()
            .zip(two.iter())
            .take_while(|(a, b)| a == b)
            .count();
        assert!(shared + 1 >= one.len(), "shared {shared} of {}", one.len());
        let other = of(&chat(
            &"Another system prompt. ".repeat(100),
            &["first question"],
        ));
        assert_ne!(one[0], other[0]);
    }

    #[test]
    fn short_prompts_have_no_blocks_and_long_ones_are_capped() {
        assert!(of(&chat("hi", &["hello"])).is_empty());
        let huge = "x".repeat(BLOCK_BYTES * (MAX_BLOCKS_PER_REQUEST + 10));
        assert_eq!(of(&chat(&huge, &[])).len(), MAX_BLOCKS_PER_REQUEST);
    }

    #[test]
    fn the_index_finds_the_longest_held_prefix_and_stays_bounded() {
        let blocks: Vec<u64> = (1..=10).collect();
        let mut index = BlockIndex::default();
        assert_eq!(index.match_len(&blocks), 0);
        index.record(&blocks[..6]);
        assert_eq!(index.match_len(&blocks), 6);
        assert_eq!(index.match_len(&[1, 2, 3, 99, 100]), 3);
        assert_eq!(index.match_len(&[99, 100]), 0);
        for start in 0..(MAX_BLOCKS_PER_MEMBER as u64) {
            index.record(&[1_000_000 + start]);
        }
        assert!(index.len() <= MAX_BLOCKS_PER_MEMBER);
        assert_eq!(index.match_len(&blocks), 0, "the oldest were retired");
    }
}
