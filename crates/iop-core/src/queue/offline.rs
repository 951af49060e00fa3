//! Groups none of whose members is online: which members are offline, and the waiters
//! that wait for one to reconnect (*stranded*) and when they give up.

use std::time::Instant;

use super::spec::WaiterId;
use super::state::Scheduler;
use crate::lease::Lane;

impl<W> Scheduler<W> {
    /// The members (`node/provider`) of group `g` configured for `lane` that are offline.
    pub(super) fn offline_members(&self, g: usize, lane: Lane) -> Vec<String> {
        self.groups[g]
            .members
            .iter()
            .filter(|m| {
                self.leases.configured_for(m.account, lane) && !self.leases.serves(m.account, lane)
            })
            .map(|m| {
                let key = self.leases.key(m.account);
                format!("{}/{}", key.node, key.provider)
            })
            .collect()
    }

    /// Brings every waiter's stranding up to date: stranded from `now` if no member serves
    /// its lane any more (none it has not already failed on), no longer stranded if one
    /// does.
    pub(super) fn restrand(&mut self, now: Instant) {
        for g in 0..self.groups.len() {
            let live: Vec<bool> = self.groups[g]
                .waiters
                .iter()
                .map(|w| self.live_for(g, w.lane, &w.exclude))
                .collect();
            for (w, live) in self.groups[g].waiters.iter_mut().zip(live) {
                if live {
                    w.stranded_since = None;
                } else if w.stranded_since.is_none() {
                    w.stranded_since = Some(now);
                }
            }
        }
    }

    /// When a stranded waiter gives up waiting for a reconnect; `None` while a member can
    /// serve it (or it is no longer queued).
    pub fn stranded_deadline(&self, id: WaiterId) -> Option<Instant> {
        self.groups.iter().find_map(|g| {
            let w = g.waiters.iter().find(|w| w.id == id)?;
            Some(w.stranded_since? + g.wait_for_reconnect)
        })
    }

    /// Removes a waiter that has been stranded for its group's whole `wait_for_reconnect`
    /// at `now`, with the offline members of its group; `None` if it is not (or no longer
    /// queued).
    pub fn expire_stranded(&mut self, id: WaiterId, now: Instant) -> Option<(W, Vec<String>)> {
        let (g, pos) = self.groups.iter().enumerate().find_map(|(g, group)| {
            let pos = group.waiters.iter().position(|w| w.id == id)?;
            Some((g, pos))
        })?;
        let group = &self.groups[g];
        let w = &group.waiters[pos];
        if w.stranded_since? + group.wait_for_reconnect > now {
            return None;
        }
        let lane = w.lane;
        let waiter = self.groups[g].waiters.remove(pos)?;
        Some((waiter.payload, self.offline_members(g, lane)))
    }
}
