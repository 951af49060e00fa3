//! The fleet's live edges: every edge with a store refreshes its own row every
//! [`HEARTBEAT`] and reads the rows refreshed within [`LIVE_WITHIN`]; `/admin/status` shows
//! that list. An edge that drains or stops removes its row; one that dies drops out of the
//! list after [`LIVE_WITHIN`]. While the store cannot be reached the edge keeps serving and
//! keeps trying; the list it shows is the last one it read.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::{Store, StoreError};

/// How often an edge refreshes its row and reads the others.
pub const HEARTBEAT: Duration = Duration::from_secs(2);
/// An edge whose row is older than this is no longer live.
pub const LIVE_WITHIN: Duration = Duration::from_secs(10);
/// How far back the number of edges sharing a key's limits while the store is away looks
/// ([`Fleet::sharing`]).
pub const SHARING_MEMORY: Duration = Duration::from_secs(60);

/// This edge, as the fleet sees it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct EdgeRecord {
    pub id: String,
    /// Its HTTP listener and node listener, as bound.
    pub http: String,
    pub nodes: String,
    /// The `host:port` nodes dial it at (`store.node_address`).
    pub node_address: String,
    pub version: String,
    pub started_unix_ms: i64,
    /// The nodes linked to it (dispatch-ready), as it last said.
    pub linked: Vec<String>,
}

impl EdgeRecord {
    /// This edge, listening on `http` and `nodes`, named `id` or `<hostname>:<http port>`;
    /// nodes dial it at `node_address`, else at `nodes` unless that is a wildcard address,
    /// else at `<hostname>:<node port>`.
    pub fn this_edge(
        id: Option<String>,
        node_address: Option<String>,
        http: SocketAddr,
        nodes: SocketAddr,
    ) -> Self {
        let host = || {
            std::env::var("HOSTNAME")
                .ok()
                .filter(|h| !h.is_empty())
                .or_else(|| nix::unistd::gethostname().ok()?.into_string().ok())
                .unwrap_or_else(|| "edge".into())
        };
        let id = id.unwrap_or_else(|| format!("{}:{}", host(), http.port()));
        let node_address = node_address.unwrap_or_else(|| {
            if nodes.ip().is_unspecified() {
                format!("{}:{}", host(), nodes.port())
            } else {
                nodes.to_string()
            }
        });
        EdgeRecord {
            id,
            http: http.to_string(),
            nodes: nodes.to_string(),
            node_address,
            linked: Vec::new(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            started_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64),
        }
    }
}

/// A live edge of the fleet, as last read from the store.
#[derive(Debug, Clone, Serialize)]
pub struct LiveEdge {
    #[serde(flatten)]
    pub record: EdgeRecord,
    /// How long ago it refreshed its row, by the store's clock.
    pub seen_ms_ago: i64,
    /// Whether it is this edge.
    pub this_edge: bool,
}

/// What this edge knows of the fleet: the list last read, and whether the store answers.
#[derive(Debug, Default)]
pub struct Fleet {
    live: parking_lot::Mutex<Vec<LiveEdge>>,
    /// How many edges each read of the last [`SHARING_MEMORY`] found live, and when.
    counts: parking_lot::Mutex<std::collections::VecDeque<(std::time::Instant, usize)>>,
    last_error: parking_lot::Mutex<Option<StoreError>>,
    /// Set when this edge drains: it leaves the fleet's list at once.
    retiring: tokio::sync::Notify,
    retired: std::sync::atomic::AtomicBool,
    /// Notified once the row is gone and the nodes were told.
    left: tokio::sync::Notify,
}

impl Fleet {
    /// This edge drains: it removes its row (the other edges drop it from their lists
    /// within one heartbeat) and its nodes are told the list without it. Resolves once
    /// both are done, or after `within`.
    pub async fn retire(&self, within: Duration) {
        let left = self.left.notified();
        self.retired
            .store(true, std::sync::atomic::Ordering::Release);
        self.retiring.notify_one();
        let _ = tokio::time::timeout(within, left).await;
    }

    fn is_retired(&self) -> bool {
        self.retired.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn live(&self) -> Vec<LiveEdge> {
        self.live.lock().clone()
    }

    /// How many edges share a key's limits while the store does not answer: the most any
    /// read of the last [`SHARING_MEMORY`] found live (at least 1). Not just the last read:
    /// a read taken while the other edges' heartbeats lagged (a loaded store, a busy
    /// machine) would otherwise hand this edge too big a share.
    pub fn sharing(&self, now: std::time::Instant) -> usize {
        let counts = self.counts.lock();
        let recent = counts
            .iter()
            .filter(|(at, _)| now.saturating_duration_since(*at) <= SHARING_MEMORY)
            .map(|(_, n)| *n);
        recent
            .chain([self.live.lock().len()])
            .max()
            .unwrap_or(1)
            .max(1)
    }

    /// A read of the store found `count` edges live at `now`.
    fn counted(&self, count: usize, now: std::time::Instant) {
        let mut counts = self.counts.lock();
        while counts
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > SHARING_MEMORY)
        {
            counts.pop_front();
        }
        counts.push_back((now, count));
    }

    /// The live edges as nodes dial them (this edge included), for a register reply or
    /// a `FleetUpdate`.
    pub fn for_nodes(&self) -> Vec<iop_proto::pb::FleetEdge> {
        for_nodes(&self.live.lock())
    }

    /// This edge's id in the fleet.
    pub fn this_edge_id(&self) -> String {
        self.live
            .lock()
            .iter()
            .find(|e| e.this_edge)
            .map(|e| e.record.id.clone())
            .unwrap_or_default()
    }

    /// The last failure to reach the store, while it lasts.
    pub fn store_error(&self) -> Option<String> {
        self.last_error.lock().as_ref().map(StoreError::to_string)
    }
}

fn for_nodes(live: &[LiveEdge]) -> Vec<iop_proto::pb::FleetEdge> {
    live.iter()
        .filter(|e| !e.record.node_address.is_empty())
        .map(|e| iop_proto::pb::FleetEdge {
            id: e.record.id.clone(),
            address: e.record.node_address.clone(),
        })
        .collect()
}

/// Each live edge nodes can dial, with its address and when it started.
fn incarnations(live: &[LiveEdge]) -> Vec<(String, String, i64)> {
    live.iter()
        .filter(|e| !e.record.node_address.is_empty())
        .map(|e| {
            (
                e.record.id.clone(),
                e.record.node_address.clone(),
                e.record.started_unix_ms,
            )
        })
        .collect()
}

/// Keeps this edge's row fresh (with the nodes `linked` returns) and the fleet's list
/// current until `shutdown`, then removes the row. Whenever the edges nodes should link
/// to change, `announce` gets the new list.
pub async fn run(
    store: Arc<Store>,
    me: EdgeRecord,
    linked: impl Fn() -> Vec<String> + Send + 'static,
    announce: impl Fn(Vec<iop_proto::pb::FleetEdge>) + Send + 'static,
    fleet: Arc<Fleet>,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(HEARTBEAT);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut me = me;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = ticker.tick() => {}
            _ = fleet.retiring.notified() => {}
        }
        if fleet.is_retired() {
            let others: Vec<LiveEdge> = fleet.live().into_iter().filter(|e| !e.this_edge).collect();
            announce(for_nodes(&others));
            remove_row(&store, &me.id).await;
            tracing::info!("draining: left the fleet's list of live edges and told the nodes");
            fleet.left.notify_waiters();
            shutdown.cancelled().await;
            return;
        }
        me.linked = linked();
        match refresh(&store, &me).await {
            Ok(live) => {
                if fleet.last_error.lock().take().is_some() {
                    tracing::info!("the store answers again");
                }
                // An edge that restarted between two refreshes is news too: while it
                // drained it told its nodes the list without it.
                let before = incarnations(&fleet.live.lock());
                let after = incarnations(&live);
                let list = for_nodes(&live);
                fleet.counted(live.len(), std::time::Instant::now());
                *fleet.live.lock() = live;
                if before != after {
                    announce(list);
                }
            }
            Err(error) => {
                let mut last = fleet.last_error.lock();
                if last.as_ref() != Some(&error) {
                    tracing::warn!(%error, "store unreachable; serving on, retrying every {}s", HEARTBEAT.as_secs());
                }
                *last = Some(error);
            }
        }
    }
    remove_row(&store, &me.id).await;
}

/// Removes this edge's row (bounded: a store that does not answer is left to expire it).
async fn remove_row(store: &Store, id: &str) {
    if let Ok(Ok(client)) = tokio::time::timeout(Duration::from_secs(2), store.client()).await {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&id];
        let removed = client.execute("DELETE FROM iop_edges WHERE id = $1", &params);
        let _ = tokio::time::timeout(Duration::from_secs(2), removed).await;
    }
}

/// Writes this edge's row and reads the live ones.
async fn refresh(store: &Store, me: &EdgeRecord) -> Result<Vec<LiveEdge>, StoreError> {
    let client = store.client().await?;
    let fail = |e: tokio_postgres::Error| StoreError::statement("edges", &e);
    let within = LIVE_WITHIN.as_secs_f64();
    // The row is this edge's, or one no live edge refreshes: two live edges never share
    // an id (their key limits and ledgers would mix).
    let written = client
        .execute(
            "INSERT INTO iop_edges (id, http, nodes, node_address, version, started_unix_ms,
                                    linked, seen)
             VALUES ($1, $2, $3, $4, $5, $6, $7, now())
             ON CONFLICT (id) DO UPDATE SET http = $2, nodes = $3, node_address = $4,
                 version = $5, started_unix_ms = $6, linked = $7, seen = now()
             WHERE iop_edges.started_unix_ms = $6
                OR iop_edges.seen <= now() - make_interval(secs => $8)",
            &[
                &me.id,
                &me.http,
                &me.nodes,
                &me.node_address,
                &me.version,
                &me.started_unix_ms,
                &me.linked,
                &within,
            ],
        )
        .await
        .map_err(fail)?;
    if written == 0 {
        return Err(StoreError::Unusable(format!(
            "the edge id {:?} is held by another live edge (one with the same store.edge_id, \
             or this edge's previous run if it died less than {}s ago): give each edge its \
             own store.edge_id",
            me.id,
            LIVE_WITHIN.as_secs()
        )));
    }
    let rows = client
        .query(
            "SELECT id, http, nodes, node_address, version, started_unix_ms, linked,
                    (EXTRACT(EPOCH FROM (now() - seen)) * 1000)::BIGINT
             FROM iop_edges WHERE seen > now() - make_interval(secs => $1) ORDER BY id",
            &[&within],
        )
        .await
        .map_err(fail)?;
    Ok(rows
        .iter()
        .map(|row| {
            let record = EdgeRecord {
                id: row.get(0),
                http: row.get(1),
                nodes: row.get(2),
                node_address: row.get(3),
                version: row.get(4),
                started_unix_ms: row.get(5),
                linked: row.get(6),
            };
            LiveEdge {
                this_edge: record.id == me.id,
                record,
                seen_ms_ago: row.get(7),
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_that_found_fewer_edges_does_not_grow_the_share() {
        let fleet = Fleet::default();
        let start = std::time::Instant::now();
        assert_eq!(fleet.sharing(start), 1);
        fleet.counted(3, start);
        // The others' heartbeats lagged behind one read: still three share.
        fleet.counted(1, start + HEARTBEAT);
        assert_eq!(fleet.sharing(start + HEARTBEAT * 2), 3);
        // Nobody else seen for over a minute: this edge alone.
        let later = start + SHARING_MEMORY + HEARTBEAT * 3;
        fleet.counted(1, later);
        assert_eq!(fleet.sharing(later), 1);
    }
}
