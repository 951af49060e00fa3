//! The nodes' part of the edge: who owns each node (the registry's generations), each
//! node's dispatch-ready session, how its current connection is secured (its link), the
//! config version it was last sent, where the node listener is, and the streams of a
//! lost connection waiting for the node to come back (parked). Each has its own lock,
//! held only for the call; nothing here sends or waits.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use iop_proto::Outbound;
use parking_lot::{Mutex, RwLock};
use tokio_util::sync::CancellationToken;

use crate::config::{EdgeConfig, TokenHash, hash_token};
use crate::registry::{
    ClaimError, DisconnectOutcome, Generation, OwnerState, ReadyOutcome, Registry,
};
use crate::session::{DetachedStream, NodeSession};
use crate::status::LinkStatus;

/// What the edge may do to a registered connection: send it a last frame and drop it.
#[derive(Debug, Clone)]
pub struct ConnectionControl {
    pub outbound: Outbound,
    pub kick: CancellationToken,
}

/// How a node's current connection reached the edge, and how to drop it.
#[derive(Debug)]
pub struct LinkEntry {
    pub generation: Generation,
    pub status: LinkStatus,
    pub control: ConnectionControl,
    /// The credential it registered with, as a revocation checks it.
    pub proof: LinkProof,
}

/// What a revocation is checked against for a live connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkProof {
    /// A client certificate valid from this time (Unix seconds).
    Certificate { not_before_secs: i64 },
    /// The static token with this hash.
    Token { hash: [u8; 32] },
    /// A join whose credential could not be read back: any revocation covers it.
    Joined,
}

#[derive(Debug)]
pub struct Nodes {
    registry: Mutex<Registry>,
    /// Dispatch-ready sessions by node id (current generation only).
    sessions: RwLock<foldhash::HashMap<String, Arc<NodeSession>>>,
    /// How each node's current connection reached the edge and what it registered with.
    links: Mutex<HashMap<String, LinkEntry>>,
    /// The config payload version each node was last sent.
    sent_config: Mutex<HashMap<String, u64>>,
    /// The node listener's bound address.
    listener: Mutex<Option<SocketAddr>>,
    parked: Arc<Parked>,
}

/// Streams of lost connections by node id, each with the number of its parking, until
/// the node's next session adopts them or the re-attach wait ends.
#[derive(Debug, Default)]
pub struct Parked {
    streams: Mutex<HashMap<String, Vec<(u64, DetachedStream)>>>,
    parkings: std::sync::atomic::AtomicU64,
}

impl Parked {
    /// Parks the streams of a lost connection of `node_id` until the node is ready again
    /// ([`Self::take_parked`]) or the wait ends ([`Self::give_up`] with the number
    /// returned).
    pub fn park(&self, node_id: &str, streams: Vec<DetachedStream>) -> u64 {
        let parking = self
            .parkings
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.streams
            .lock()
            .entry(node_id.to_string())
            .or_default()
            .extend(streams.into_iter().map(|s| (parking, s)));
        parking
    }

    /// The parked streams of `node_id`, for its new session to adopt.
    pub fn take_parked(&self, node_id: &str) -> Vec<DetachedStream> {
        self.streams
            .lock()
            .remove(node_id)
            .map(|streams| streams.into_iter().map(|(_, s)| s).collect())
            .unwrap_or_default()
    }

    /// The node did not come back within the wait of `parking`: its streams end. Returns
    /// how many.
    pub fn give_up(&self, node_id: &str, parking: u64) -> usize {
        let given_up: Vec<DetachedStream> = {
            let mut parked = self.streams.lock();
            let Some(streams) = parked.get_mut(node_id) else {
                return 0;
            };
            let (ended, kept) = std::mem::take(streams)
                .into_iter()
                .partition(|(p, _)| *p == parking);
            *streams = kept;
            if streams.is_empty() {
                parked.remove(node_id);
            }
            ended.into_iter().map(|(_, s)| s).collect()
        };
        let count = given_up.len();
        given_up.into_iter().for_each(DetachedStream::give_up);
        count
    }
}

/// What losing a connection ended.
#[derive(Debug)]
pub enum Lost {
    /// An old connection of the node: nothing changed.
    Stale,
    /// The node's current connection; `session`: its dispatch-ready session, if it had
    /// one (removed now).
    Current { session: Option<Arc<NodeSession>> },
}

impl Nodes {
    /// The nodes of a config, by their static tokens.
    pub fn new(tokens: Vec<(String, TokenHash)>) -> Self {
        Self {
            registry: Mutex::new(Registry::new(tokens)),
            sessions: RwLock::new(foldhash::HashMap::default()),
            links: Mutex::new(HashMap::new()),
            sent_config: Mutex::new(HashMap::new()),
            listener: Mutex::new(None),
            parked: Arc::default(),
        }
    }

    /// The streams of lost connections waiting for their nodes.
    pub fn parked(&self) -> &Arc<Parked> {
        &self.parked
    }

    /// Takes the tokens of a reloaded config.
    pub fn update_tokens(&self, tokens: Vec<(String, TokenHash)>) {
        self.registry.lock().update(tokens);
    }

    /// A fresh generation for an accepted connection.
    pub fn next_generation(&self) -> Generation {
        self.registry.lock().next_generation()
    }

    /// The node a static token belongs to.
    pub fn authenticate(&self, token: &str) -> Option<String> {
        self.registry.lock().authenticate(token).map(String::from)
    }

    /// Claims pending ownership of `node_id` for the connection of `generation`.
    pub fn claim(&self, node_id: &str, generation: Generation) -> Result<(), ClaimError> {
        self.registry.lock().claim_node(node_id, generation)
    }

    /// Gives up a claim whose registration failed after it.
    pub fn unclaim(&self, node_id: &str, generation: Generation) {
        self.registry.lock().disconnect(node_id, generation);
    }

    pub fn owner_state(&self, node_id: &str) -> OwnerState {
        self.registry.lock().state(node_id)
    }

    /// The node's ready: the first of its current generation makes `session()` its
    /// dispatch-ready session.
    pub fn ready(
        &self,
        node_id: &str,
        generation: Generation,
        session: impl FnOnce() -> NodeSession,
    ) -> ReadyOutcome {
        let mut registry = self.registry.lock();
        let outcome = registry.ready(node_id, generation);
        if outcome == ReadyOutcome::Activated {
            let session = Arc::new(session());
            self.sessions.write().insert(node_id.to_string(), session);
        }
        outcome
    }

    /// The connection of `generation` ended: if it is the node's current one, the node is
    /// offline and its link and session go.
    pub fn lose(&self, node_id: &str, generation: Generation) -> Lost {
        let outcome = self.registry.lock().disconnect(node_id, generation);
        {
            let mut links = self.links.lock();
            if links
                .get(node_id)
                .is_some_and(|l| l.generation == generation)
            {
                links.remove(node_id);
            }
        }
        let DisconnectOutcome::Current { was_ready } = outcome else {
            return Lost::Stale;
        };
        let session = was_ready
            .then(|| {
                let mut sessions = self.sessions.write();
                match sessions.get(node_id) {
                    Some(s) if s.generation == generation => sessions.remove(node_id),
                    _ => None,
                }
            })
            .flatten();
        Lost::Current { session }
    }

    /// The node's dispatch-ready session, if it has one.
    pub fn session(&self, node_id: &str) -> Option<Arc<NodeSession>> {
        self.sessions.read().get(node_id).cloned()
    }

    /// Every dispatch-ready session, by node id.
    pub fn ready_sessions(&self) -> Vec<Arc<NodeSession>> {
        let mut sessions: Vec<_> = self.sessions.read().values().cloned().collect();
        sessions.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        sessions
    }

    /// The ids of the dispatch-ready nodes, sorted.
    pub fn ready_node_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.sessions.read().keys().cloned().collect();
        ids.sort();
        ids
    }

    /// Records how the node's connection of `entry.generation` is secured.
    pub fn set_link(&self, node_id: String, entry: LinkEntry) {
        self.links.lock().insert(node_id, entry);
    }

    /// How the node's connection of `generation` is secured, if it is the current one.
    pub fn link_status(&self, node_id: &str, generation: Generation) -> Option<LinkStatus> {
        self.links
            .lock()
            .get(node_id)
            .filter(|l| l.generation == generation)
            .map(|l| l.status.clone())
    }

    /// Removes and returns the node's link entry when `covered` says so.
    pub fn take_link_if(
        &self,
        node_id: &str,
        covered: impl FnOnce(&LinkEntry) -> bool,
    ) -> Option<LinkEntry> {
        let mut links = self.links.lock();
        if !links.get(node_id).is_some_and(covered) {
            return None;
        }
        links.remove(node_id)
    }

    /// Notes that the node was sent config `version`; whether that is news to it (a
    /// version it was not sent last).
    pub fn config_sent(&self, node_id: &str, version: u64) -> bool {
        self.sent_config.lock().insert(node_id.to_string(), version) != Some(version)
    }

    /// Whether the node was last sent config `version`.
    pub fn has_config(&self, node_id: &str, version: u64) -> bool {
        self.sent_config.lock().get(node_id) == Some(&version)
    }

    /// Records where the node listener is bound.
    pub fn set_listener(&self, addr: SocketAddr) {
        *self.listener.lock() = Some(addr);
    }

    /// Where the node listener is bound (once it is).
    pub fn listener(&self) -> Option<SocketAddr> {
        *self.listener.lock()
    }
}

/// `(node id, token hash)` of every configured node.
pub fn token_records(config: &EdgeConfig) -> Vec<(String, TokenHash)> {
    config
        .nodes
        .iter()
        .map(|n| {
            // A node without a static token (it registers by certificate) gets a hash no
            // token matches.
            let hash = n
                .token_hash()
                .unwrap_or_else(|| hash_token(&uuid::Uuid::new_v4().to_string()));
            (n.id.clone(), hash)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes() -> Nodes {
        Nodes::new(vec![(
            "n1".into(),
            crate::config::hash_token("node-token-0123456789"),
        )])
    }

    fn session(node: &str, generation: Generation) -> NodeSession {
        let (outbound, _rx) = Outbound::channel(4);
        NodeSession::new(
            node.into(),
            generation,
            "peer".into(),
            outbound,
            CancellationToken::new(),
        )
    }

    fn ready_node(nodes: &Nodes) -> Generation {
        let generation = nodes.next_generation();
        nodes.claim("n1", generation).unwrap();
        let outcome = nodes.ready("n1", generation, || session("n1", generation));
        assert_eq!(outcome, ReadyOutcome::Activated);
        generation
    }

    #[test]
    fn a_ready_node_has_a_session_until_its_connection_is_lost() {
        let nodes = nodes();
        assert_eq!(
            nodes.authenticate("node-token-0123456789").as_deref(),
            Some("n1")
        );
        let generation = ready_node(&nodes);
        assert_eq!(nodes.owner_state("n1"), OwnerState::Ready(generation));
        assert_eq!(nodes.ready_sessions().len(), 1);
        let Lost::Current { session: Some(s) } = nodes.lose("n1", generation) else {
            panic!("the current connection's session goes with it")
        };
        assert_eq!(s.generation, generation);
        assert!(nodes.session("n1").is_none());
        assert_eq!(nodes.owner_state("n1"), OwnerState::Offline);
    }

    #[test]
    fn losing_an_old_connection_changes_nothing() {
        let nodes = nodes();
        let old = ready_node(&nodes);
        nodes.lose("n1", old);
        let current = ready_node(&nodes);
        assert!(matches!(nodes.lose("n1", old), Lost::Stale));
        assert_eq!(nodes.session("n1").unwrap().generation, current);
    }

    #[test]
    fn a_second_claim_while_owned_is_refused_and_an_unclaim_frees_it() {
        let nodes = nodes();
        let first = nodes.next_generation();
        nodes.claim("n1", first).unwrap();
        assert!(nodes.claim("n1", nodes.next_generation()).is_err());
        nodes.unclaim("n1", first);
        assert!(nodes.claim("n1", nodes.next_generation()).is_ok());
    }

    #[tokio::test]
    async fn parked_streams_go_to_the_next_session_or_end_with_their_own_wait() {
        let nodes = nodes();
        let parked = nodes.parked();
        let first = session("n1", Generation(1));
        let mut early = first.open_run("early").unwrap();
        let early_parking = parked.park("n1", first.close_detaching("lost"));
        let second = session("n1", Generation(2));
        let mut late = second.open_run("late").unwrap();
        parked.park("n1", second.close_detaching("lost again"));
        // The first parking's wait ends: only its stream ends.
        assert_eq!(parked.give_up("n1", early_parking), 1);
        assert!(early.recv().await.is_none());
        // The node is back: the rest goes to its new session.
        let third = session("n1", Generation(3));
        let resumes = third.adopt(parked.take_parked("n1"));
        assert_eq!(resumes.len(), 1);
        assert!(matches!(
            &resumes[0].message,
            Some(iop_proto::pb::envelope::Message::StreamResume(r)) if r.stream_id == "late"
        ));
        assert!(third.has_stream("late"));
        assert_eq!(parked.give_up("n1", early_parking + 1), 0);
        drop(third);
        assert!(late.recv().await.is_none());
    }

    #[test]
    fn a_config_version_is_news_once() {
        let nodes = nodes();
        assert!(!nodes.has_config("n1", 7));
        assert!(nodes.config_sent("n1", 7));
        assert!(nodes.has_config("n1", 7));
        assert!(
            !nodes.config_sent("n1", 7),
            "the same version again is no news"
        );
        assert!(nodes.config_sent("n1", 8));
    }
}
