//! Node registry: which configured node a token belongs to, and which connection currently
//! owns each node id.
//!
//! Pure state, no I/O. Every accepted connection gets a fresh [`Generation`]; registering
//! makes it the node's *pending* owner, the first ready of that generation makes it
//! dispatch-ready. A duplicate ready is acknowledged idempotently, a ready or disconnect
//! from any other generation is stale and changes nothing. The generation never leaves
//! the edge.

use std::collections::HashMap;

use subtle::ConstantTimeEq;

use crate::config::{TokenHash, hash_token};

/// Internal fence identifying one accepted connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(pub u64);

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// Why a registration was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimError {
    UnknownToken,
    /// The node already has a live owner connection.
    Duplicate {
        node_id: String,
    },
}

/// What a `NodeReadyRequest` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadyOutcome {
    /// First ready of the current owner: the node is now dispatch-ready.
    Activated,
    /// The current owner was ready already: acknowledge, change nothing.
    AlreadyReady,
    /// Not the current owner (stale or never claimed): refuse.
    Refused,
}

/// What a connection's end did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DisconnectOutcome {
    /// The current owner left; `was_ready` says whether it had been dispatch-ready.
    Current { was_ready: bool },
    /// Some other generation owns the node (or nobody does): nothing changes.
    Stale,
}

/// A node's connection state as the snapshot shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnerState {
    Offline,
    Pending(Generation),
    Ready(Generation),
}

#[derive(Debug)]
struct Entry {
    node_id: String,
    token_hash: TokenHash,
    owner: Option<Owner>,
}

#[derive(Debug, Clone, Copy)]
struct Owner {
    generation: Generation,
    ready: bool,
}

#[derive(Debug, Default)]
pub struct Registry {
    entries: Vec<Entry>,
    by_id: HashMap<String, usize>,
    last_generation: u64,
}

impl Registry {
    /// A registry of the configured nodes: `(node id, token hash)` pairs.
    pub fn new(nodes: impl IntoIterator<Item = (String, TokenHash)>) -> Self {
        let mut registry = Registry::default();
        for (node_id, token_hash) in nodes {
            registry
                .by_id
                .insert(node_id.clone(), registry.entries.len());
            registry.entries.push(Entry {
                node_id,
                token_hash,
                owner: None,
            });
        }
        registry
    }

    /// Replaces the node records (config reload). Nodes that stay keep their owner; new
    /// ones start offline; removed ones are forgotten (their connections must be dropped
    /// by the caller).
    pub fn update(&mut self, nodes: impl IntoIterator<Item = (String, TokenHash)>) {
        let mut old: HashMap<String, Entry> = self
            .entries
            .drain(..)
            .map(|e| (e.node_id.clone(), e))
            .collect();
        self.by_id.clear();
        for (node_id, token_hash) in nodes {
            let owner = old.remove(&node_id).and_then(|e| e.owner);
            self.by_id.insert(node_id.clone(), self.entries.len());
            self.entries.push(Entry {
                node_id,
                token_hash,
                owner,
            });
        }
    }

    /// A fresh generation for a newly accepted connection.
    pub fn next_generation(&mut self) -> Generation {
        self.last_generation += 1;
        Generation(self.last_generation)
    }

    /// The node id a token belongs to. Compares against every record in constant time so
    /// the answer's timing says nothing about which record (or how much of it) matched.
    pub fn authenticate(&self, token: &str) -> Option<&str> {
        let presented = hash_token(token);
        let mut found = None;
        for entry in &self.entries {
            if bool::from(entry.token_hash.ct_eq(&presented)) {
                found = Some(entry.node_id.as_str());
            }
        }
        found
    }

    /// Authenticates `token` and makes `generation` the node's pending owner.
    #[cfg(test)]
    pub fn claim(&mut self, token: &str, generation: Generation) -> Result<String, ClaimError> {
        let node_id = self
            .authenticate(token)
            .ok_or(ClaimError::UnknownToken)?
            .to_string();
        self.claim_node(&node_id, generation)?;
        Ok(node_id)
    }

    /// Makes `generation` the pending owner of `node_id`, already authenticated some other
    /// way (a certificate, a join token).
    pub fn claim_node(&mut self, node_id: &str, generation: Generation) -> Result<(), ClaimError> {
        let Some(&index) = self.by_id.get(node_id) else {
            return Err(ClaimError::UnknownToken);
        };
        let node_id = node_id.to_string();
        let entry = &mut self.entries[index];
        if entry.owner.is_some() {
            return Err(ClaimError::Duplicate { node_id });
        }
        entry.owner = Some(Owner {
            generation,
            ready: false,
        });
        Ok(())
    }

    pub fn ready(&mut self, node_id: &str, generation: Generation) -> ReadyOutcome {
        let Some(owner) = self.owner_mut(node_id) else {
            return ReadyOutcome::Refused;
        };
        if owner.generation != generation {
            return ReadyOutcome::Refused;
        }
        if owner.ready {
            return ReadyOutcome::AlreadyReady;
        }
        owner.ready = true;
        ReadyOutcome::Activated
    }

    pub fn disconnect(&mut self, node_id: &str, generation: Generation) -> DisconnectOutcome {
        let Some(&index) = self.by_id.get(node_id) else {
            return DisconnectOutcome::Stale;
        };
        let entry = &mut self.entries[index];
        match entry.owner {
            Some(owner) if owner.generation == generation => {
                entry.owner = None;
                DisconnectOutcome::Current {
                    was_ready: owner.ready,
                }
            }
            _ => DisconnectOutcome::Stale,
        }
    }

    pub fn state(&self, node_id: &str) -> OwnerState {
        let owner = self.by_id.get(node_id).and_then(|&i| self.entries[i].owner);
        match owner {
            None => OwnerState::Offline,
            Some(o) if o.ready => OwnerState::Ready(o.generation),
            Some(o) => OwnerState::Pending(o.generation),
        }
    }

    /// Whether `generation` is the node's current, dispatch-ready owner.
    #[cfg(test)]
    pub fn is_ready(&self, node_id: &str, generation: Generation) -> bool {
        self.state(node_id) == OwnerState::Ready(generation)
    }

    fn owner_mut(&mut self, node_id: &str) -> Option<&mut Owner> {
        let index = *self.by_id.get(node_id)?;
        self.entries[index].owner.as_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry() -> Registry {
        Registry::new([
            ("a".to_string(), hash_token("token-a")),
            ("b".to_string(), hash_token("token-b")),
        ])
    }

    #[test]
    fn tokens_map_to_their_node() {
        let r = registry();
        assert_eq!(r.authenticate("token-a"), Some("a"));
        assert_eq!(r.authenticate("token-b"), Some("b"));
        assert_eq!(r.authenticate("token-c"), None);
        assert_eq!(r.authenticate(""), None);
    }

    #[test]
    fn generations_are_fresh() {
        let mut r = registry();
        let g1 = r.next_generation();
        let g2 = r.next_generation();
        assert_ne!(g1, g2);
    }

    #[test]
    fn a_node_authenticated_otherwise_is_claimed_by_id() {
        let mut r = registry();
        let g = r.next_generation();
        assert_eq!(r.claim_node("a", g), Ok(()));
        assert_eq!(r.state("a"), OwnerState::Pending(g));
        let g2 = r.next_generation();
        assert!(matches!(
            r.claim_node("a", g2),
            Err(ClaimError::Duplicate { .. })
        ));
        assert_eq!(r.claim_node("nope", g2), Err(ClaimError::UnknownToken));
    }

    #[test]
    fn register_is_pending_until_ready() {
        let mut r = registry();
        let g = r.next_generation();
        assert_eq!(r.claim("token-a", g), Ok("a".into()));
        assert_eq!(r.state("a"), OwnerState::Pending(g));
        assert!(!r.is_ready("a", g));
        assert_eq!(r.ready("a", g), ReadyOutcome::Activated);
        assert_eq!(r.state("a"), OwnerState::Ready(g));
    }

    #[test]
    fn unknown_token_is_refused() {
        let mut r = registry();
        let g = r.next_generation();
        assert_eq!(r.claim("nope", g), Err(ClaimError::UnknownToken));
    }

    #[test]
    fn second_connection_for_a_live_node_is_a_duplicate() {
        let mut r = registry();
        let g1 = r.next_generation();
        let g2 = r.next_generation();
        r.claim("token-a", g1).unwrap();
        assert_eq!(
            r.claim("token-a", g2),
            Err(ClaimError::Duplicate {
                node_id: "a".into()
            })
        );
        // Still a duplicate once the first owner is ready.
        r.ready("a", g1);
        assert!(matches!(
            r.claim("token-a", g2),
            Err(ClaimError::Duplicate { .. })
        ));
        assert_eq!(r.state("a"), OwnerState::Ready(g1));
    }

    #[test]
    fn duplicate_ready_is_acknowledged_without_change() {
        let mut r = registry();
        let g = r.next_generation();
        r.claim("token-a", g).unwrap();
        assert_eq!(r.ready("a", g), ReadyOutcome::Activated);
        assert_eq!(r.ready("a", g), ReadyOutcome::AlreadyReady);
        assert_eq!(r.state("a"), OwnerState::Ready(g));
    }

    #[test]
    fn stale_ready_is_refused() {
        let mut r = registry();
        let old = r.next_generation();
        r.claim("token-a", old).unwrap();
        r.disconnect("a", old);
        let new = r.next_generation();
        r.claim("token-a", new).unwrap();
        assert_eq!(r.ready("a", old), ReadyOutcome::Refused);
        assert_eq!(r.state("a"), OwnerState::Pending(new));
        assert_eq!(r.ready("a", new), ReadyOutcome::Activated);
    }

    #[test]
    fn ready_without_a_claim_is_refused() {
        let mut r = registry();
        let g = r.next_generation();
        assert_eq!(r.ready("a", g), ReadyOutcome::Refused);
        assert_eq!(r.ready("unknown", g), ReadyOutcome::Refused);
        assert_eq!(r.state("a"), OwnerState::Offline);
    }

    #[test]
    fn stale_disconnect_is_ignored() {
        let mut r = registry();
        let old = r.next_generation();
        r.claim("token-a", old).unwrap();
        r.ready("a", old);
        assert_eq!(
            r.disconnect("a", old),
            DisconnectOutcome::Current { was_ready: true }
        );
        let new = r.next_generation();
        r.claim("token-a", new).unwrap();
        r.ready("a", new);
        // The old connection's late disconnect must not take the new owner down.
        assert_eq!(r.disconnect("a", old), DisconnectOutcome::Stale);
        assert_eq!(r.state("a"), OwnerState::Ready(new));
    }

    #[test]
    fn disconnect_of_pending_owner_frees_the_node() {
        let mut r = registry();
        let g = r.next_generation();
        r.claim("token-a", g).unwrap();
        assert_eq!(
            r.disconnect("a", g),
            DisconnectOutcome::Current { was_ready: false }
        );
        assert_eq!(r.state("a"), OwnerState::Offline);
        let g2 = r.next_generation();
        assert_eq!(r.claim("token-a", g2), Ok("a".into()));
    }

    #[test]
    fn an_update_keeps_owners_and_takes_new_tokens() {
        let mut r = registry();
        let g = r.next_generation();
        r.claim("token-a", g).unwrap();
        r.ready("a", g);
        r.update([
            ("a".to_string(), hash_token("token-a2")),
            ("c".to_string(), hash_token("token-c")),
        ]);
        assert_eq!(r.state("a"), OwnerState::Ready(g));
        assert_eq!(r.state("b"), OwnerState::Offline);
        assert_eq!(r.authenticate("token-b"), None);
        assert_eq!(r.authenticate("token-a2"), Some("a"));
        assert_eq!(r.authenticate("token-c"), Some("c"));
        assert_eq!(
            r.disconnect("a", g),
            DisconnectOutcome::Current { was_ready: true }
        );
    }

    #[test]
    fn nodes_are_independent() {
        let mut r = registry();
        let ga = r.next_generation();
        let gb = r.next_generation();
        r.claim("token-a", ga).unwrap();
        r.claim("token-b", gb).unwrap();
        r.ready("a", ga);
        assert_eq!(r.disconnect("b", ga), DisconnectOutcome::Stale);
        assert_eq!(r.state("b"), OwnerState::Pending(gb));
        assert_eq!(r.ready("b", ga), ReadyOutcome::Refused);
    }
}
