//! The edge's in-process event bus: node lifecycle events, run events and usage
//! observations fanned out to any number of subscribers.
//!
//! Built on a bounded broadcast channel: publishing never waits. A subscriber that falls
//! more than [`EVENT_BUS_CAPACITY`] events behind loses the oldest ones (it sees a lag
//! notice) instead of stalling the transport. Tunnel body bytes never enter the bus.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::sync::broadcast;

/// Events kept for a slow subscriber before it starts losing the oldest.
pub const EVENT_BUS_CAPACITY: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeEventKind {
    Registered,
    Rejected,
    Ready,
    Disconnected,
}

/// A node lifecycle event (`EdgeNodeEvent` on the wire).
#[derive(Debug, Clone, Serialize)]
pub struct NodeEvent {
    /// Empty when a registration was rejected before the node was known.
    pub node_id: String,
    pub kind: NodeEventKind,
    pub reason: String,
    pub peer: String,
    pub unix_ms: u64,
}

/// Provider-reported token counts for one request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct UsageEvent {
    pub model_group: String,
    pub node_id: String,
    pub provider_id: String,
    /// `tunnel` or `run`.
    pub path: &'static str,
    pub input_tokens: u64,
    pub output_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached_input_tokens: Option<u64>,
    /// The model that served the request as reported from the node's side: the `model`
    /// of the provider's response on the tunnel path, the run's start event on the run
    /// path. Absent when nothing was reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served_model: Option<String>,
    /// The name of the API key that made the request (absent on an edge without keys).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
}

/// A run event as subscribers see it.
#[derive(Debug, Clone, Serialize)]
pub struct RunEventNotice {
    pub node_id: String,
    pub run_id: String,
    pub kind: &'static str,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub text: String,
}

#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EdgeEvent {
    Node(NodeEvent),
    Run(RunEventNotice),
    Usage(UsageEvent),
}

#[derive(Debug, Clone)]
pub struct EventBus {
    tx: broadcast::Sender<Arc<EdgeEvent>>,
}

impl Default for EventBus {
    fn default() -> Self {
        Self::new(EVENT_BUS_CAPACITY)
    }
}

impl EventBus {
    pub fn new(capacity: usize) -> Self {
        let (tx, _) = broadcast::channel(capacity);
        Self { tx }
    }

    /// Publishes to every current subscriber; never waits.
    pub fn publish(&self, event: EdgeEvent) {
        if self.tx.receiver_count() > 0 {
            let _ = self.tx.send(Arc::new(event));
        }
    }

    /// Whether anyone listens (so callers can skip building an event nobody reads).
    pub fn has_subscribers(&self) -> bool {
        self.tx.receiver_count() > 0
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<EdgeEvent>> {
        self.tx.subscribe()
    }

    pub fn node_event(&self, node_id: &str, kind: NodeEventKind, reason: &str, peer: &str) {
        self.publish(EdgeEvent::Node(NodeEvent {
            node_id: node_id.to_string(),
            kind,
            reason: reason.to_string(),
            peer: peer.to_string(),
            unix_ms: unix_ms(),
        }));
    }
}

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_subscriber_gets_every_event() {
        let bus = EventBus::new(16);
        let mut a = bus.subscribe();
        let mut b = bus.subscribe();
        bus.node_event("n", NodeEventKind::Ready, "", "peer");
        for rx in [&mut a, &mut b] {
            match &*rx.recv().await.unwrap() {
                EdgeEvent::Node(e) => assert_eq!(e.kind, NodeEventKind::Ready),
                other => panic!("{other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn a_slow_subscriber_never_blocks_the_publisher() {
        let bus = EventBus::new(4);
        let mut slow = bus.subscribe();
        // Far more than the capacity: publish must return every time.
        for i in 0..100 {
            bus.node_event(&format!("n{i}"), NodeEventKind::Registered, "", "");
        }
        // The slow one is told it lagged, then sees the newest events.
        assert!(matches!(
            slow.recv().await,
            Err(broadcast::error::RecvError::Lagged(_))
        ));
        match &*slow.recv().await.unwrap() {
            EdgeEvent::Node(e) => assert_eq!(e.node_id, "n96"),
            other => panic!("{other:?}"),
        }
    }
}
