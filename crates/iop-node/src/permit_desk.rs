//! The node's permits at work: the [`PermitBook`] behind a lock, the links its grants go
//! out on, and the hook each run or tunnel holds from its arrival to the end of its slot,
//! so the book knows what each edge has running here.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use iop_proto::connection::Outbound;
use iop_proto::pb;
use parking_lot::Mutex;

use crate::permits::{Demand, Grant, LinkId, PermitBook};

/// At most this many providers are read from one report.
const MAX_REPORT_ENTRIES: usize = 1024;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[derive(Debug, Default)]
pub struct PermitDesk {
    book: Mutex<PermitBook>,
    links: Mutex<HashMap<LinkId, Outbound>>,
    last_link: AtomicU64,
}

/// Held by a run or tunnel from its arrival until its slot is let go.
#[derive(Debug)]
pub struct PermitHook {
    desk: Arc<PermitDesk>,
    provider: String,
    link: LinkId,
}

impl Drop for PermitHook {
    fn drop(&mut self) {
        let grants = self
            .desk
            .book
            .lock()
            .ended(&self.provider, self.link, now_ms());
        self.desk.send(grants);
    }
}

impl PermitDesk {
    /// Sets the providers and their `max_concurrency` (config applied).
    pub fn configure(&self, capacities: &[(String, u32)]) {
        let grants = self.book.lock().configure(capacities, now_ms());
        self.send(grants);
    }

    /// A connection to an edge became a link: its first grant goes out on `outbound` now,
    /// before anything else the node sends after it.
    pub fn link(&self, outbound: &Outbound) -> LinkId {
        let link = self.last_link.fetch_add(1, Ordering::Relaxed) + 1;
        self.links.lock().insert(link, outbound.clone());
        let grants = self.book.lock().link(link, now_ms());
        self.send(grants);
        link
    }

    /// The link ended: its permits go to the other edges.
    pub fn unlink(&self, link: LinkId) {
        if self.links.lock().remove(&link).is_none() {
            return;
        }
        let grants = self.book.lock().unlink(link, now_ms());
        self.send(grants);
    }

    /// An edge's `PermitReport` on `link`.
    pub fn report(&self, link: LinkId, report: &pb::PermitReport) {
        let demands: Vec<Demand> = report
            .providers
            .iter()
            .take(MAX_REPORT_ENTRIES)
            .map(|d| Demand {
                provider: d.provider_id.clone(),
                in_use: d.in_use,
                unsent: d.unsent,
                waiting: d.waiting,
                oldest_wait_ms: d.oldest_wait_ms,
            })
            .collect();
        let grants = self
            .book
            .lock()
            .report(link, report.acked_seq, &demands, now_ms());
        self.send(grants);
    }

    /// A run or tunnel for `provider` arrived on `link`.
    pub fn arrived(self: &Arc<Self>, provider: &str, link: LinkId) -> PermitHook {
        self.book.lock().started(provider, link);
        PermitHook {
            desk: self.clone(),
            provider: provider.to_string(),
            link,
        }
    }

    /// Edges waiting for permits are asked about runs they have not sent (the book's
    /// recheck); called now and then.
    pub fn tick(&self) {
        let grants = self.book.lock().rebalance(now_ms());
        self.send(grants);
    }

    fn send(&self, grants: Vec<Grant>) {
        if grants.is_empty() {
            return;
        }
        let links = self.links.lock();
        for grant in grants {
            let Some(outbound) = links.get(&grant.link) else {
                continue;
            };
            let message = pb::PermitGrant {
                seq: grant.seq,
                providers: grant
                    .permits
                    .into_iter()
                    .map(|(provider_id, permits)| pb::ProviderPermits {
                        provider_id,
                        permits,
                    })
                    .collect(),
            };
            tracing::debug!(link = grant.link, seq = message.seq, "permits granted");
            if !outbound.try_send(message.clone()) {
                // A full queue: sent as soon as there is room. The edge ignores a grant
                // older than one it applied, and acknowledging the later one covers it.
                let outbound = outbound.clone();
                tokio::spawn(async move {
                    let _ = outbound.send(message).await;
                });
            }
        }
    }
}
