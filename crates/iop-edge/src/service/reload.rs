//! Config reload (SIGHUP): applies a new edge config to a running edge without dropping
//! connections. Node records, provider capacities, model groups, queue settings and API
//! keys change at once; nodes whose provider specs changed get a `ConfigRefresh`; queued
//! requests the new capacity allows are dispatched; requests waiting in removed groups end
//! with an error; nodes removed from the config are disconnected. Listen addresses, the
//! frame limit, the body limit and the HTTP listener's timeouts and connection cap need a
//! restart.

use std::collections::HashMap;
use std::sync::Arc;

use iop_proto::pb;

use super::Edge;
use crate::config::EdgeConfig;
use crate::payload::build_payload;
use crate::registry::OwnerState;

/// What a reload did.
#[derive(Debug, Default, Clone)]
pub struct ReloadReport {
    /// Nodes sent a new config payload.
    pub refreshed: Vec<String>,
    /// Nodes disconnected because they left the config.
    pub removed: Vec<String>,
    /// Settings that changed but only take effect after a restart.
    pub needs_restart: Vec<&'static str>,
}

impl Edge {
    /// Applies `new` (already validated, as the file has it) to the running edge, with
    /// the groups of the Ollama providers' own models added.
    pub fn reload(&self, new: EdgeConfig) -> ReloadReport {
        let _applying = self.configs.applying();
        let held = self.provider_models.held();
        self.configs.set_file(Arc::new(new.clone()));
        let report = self.apply_config(crate::local_models::with_local_groups(&new, &held));
        tracing::info!(
            refreshed = ?report.refreshed,
            removed = ?report.removed,
            needs_restart = ?report.needs_restart,
            "config reloaded"
        );
        report
    }

    /// The config as the file has it.
    pub fn file_config(&self) -> Arc<EdgeConfig> {
        self.configs.file()
    }

    /// Serves `new` from now on (a reload, or the Ollama providers' own models changed).
    pub(crate) fn apply_config(&self, new: EdgeConfig) -> ReloadReport {
        let old = self.config();
        let mut report = ReloadReport::default();
        if new.listen.nodes != old.listen.nodes || new.listen.http != old.listen.http {
            report.needs_restart.push("listen");
        }
        if new.max_frame_bytes != old.max_frame_bytes {
            report.needs_restart.push("max_frame_bytes");
        }
        if new.limits.max_body_bytes != old.limits.max_body_bytes {
            report.needs_restart.push("limits.max_body_bytes");
        }
        if new.limits.nodes.summary_interval_sec != old.limits.nodes.summary_interval_sec {
            report
                .needs_restart
                .push("limits.nodes.summary_interval_sec");
        }
        if old.limits.http.needs_restart(&new.limits.http) {
            report.needs_restart.push("limits.http");
        }
        if new.state_dir != old.state_dir {
            report.needs_restart.push("state_dir");
        }
        if new.node_tls != old.node_tls {
            report.needs_restart.push("node_tls");
        }
        if new.ledger != old.ledger {
            report.needs_restart.push("ledger");
        }
        if new.store != old.store {
            report.needs_restart.push("store");
        }
        if new.http_tls.is_some() != old.http_tls.is_some() {
            report.needs_restart.push("http_tls (turning it on or off)");
        }
        // Nodes that left the config lose their connection through the usual loss path.
        for node in &old.nodes {
            if !new.nodes.iter().any(|n| n.id == node.id) {
                if let OwnerState::Ready(generation) | OwnerState::Pending(generation) =
                    self.nodes.owner_state(&node.id)
                {
                    if let Some(session) = self.session(&node.id) {
                        session.kick.cancel();
                    }
                    self.connection_lost(&node.id, generation, "node removed from the edge config");
                }
                report.removed.push(node.id.clone());
            }
        }
        // The config first: a registration between the two finds either the old registry
        // and the new config (a removed node is refused as unknown) or both new.
        let new = Arc::new(new);
        self.configs.serve(new.clone());
        self.nodes.update_tokens(super::nodes::token_records(&new));
        self.keys.replace(&new.auth);
        self.telemetry.configure(&new);
        let online: HashMap<String, crate::registry::Generation> = self
            .nodes
            .ready_sessions()
            .iter()
            .map(|s| (s.node_id.clone(), s.generation))
            .collect();
        // Nodes first get their new providers, so requests dispatched by the new
        // capacity below find them (frames on a connection are handled in order).
        for session in self.nodes.ready_sessions() {
            let Some(node) = new.nodes.iter().find(|n| n.id == session.node_id) else {
                continue;
            };
            let payload = match build_payload(node, &new.health, new.max_frame_bytes, &new.dispatch)
            {
                Ok(p) => p,
                Err(e) => {
                    tracing::error!(node_id = %node.id, error = %e, "config reload: cannot build the node's payload; it keeps its old config");
                    continue;
                }
            };
            let version = payload.config_version;
            if self.nodes.has_config(&node.id, version) {
                continue;
            }
            if session.outbound.try_send(pb::ConfigRefresh {
                config: Some(payload),
            }) {
                self.nodes.config_sent(&node.id, version);
                report.refreshed.push(node.id.clone());
            } else {
                tracing::warn!(node_id = %node.id, "config reload: the node's queue is full; it keeps its old config until it reconnects");
            }
        }
        self.dispatcher.reconfigure(&new, &online);
        report
    }
}

#[cfg(test)]
mod tests {
    use iop_proto::Outbound;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::service::Rejection;
    use crate::service::nodes::ConnectionControl;
    use crate::trust::Link;

    async fn register(edge: &Edge) -> Result<crate::service::Registered, Rejection> {
        let (outbound, _sent) = Outbound::channel(8);
        let request = pb::RegisterRequest {
            token: "token-n1-0123456789".into(),
            ..Default::default()
        };
        let control = ConnectionControl {
            outbound,
            kick: CancellationToken::new(),
        };
        edge.register(
            &request,
            &Link::Plaintext,
            edge.nodes.next_generation(),
            "peer",
            control,
        )
        .await
    }

    #[tokio::test]
    async fn a_registration_in_the_middle_of_a_reload_that_removed_its_node_is_refused() {
        let config = |nodes: &str| {
            EdgeConfig::from_yaml(&format!("nodes: {nodes}\nmodel_groups: []\n"), "test").unwrap()
        };
        let edge = Edge::new(config(
            "[{id: n1, token: token-n1-0123456789, providers: [{id: p, kind: mock}]}]",
        ));
        // The reload has swapped the config (without n1) and not yet the registry, which
        // still knows n1's token: refused as an unknown node, and nothing is left claimed.
        edge.configs.serve(Arc::new(config("[]")));
        assert!(matches!(
            register(&edge).await,
            Err(Rejection::UnknownNode { node_id }) if node_id == "n1"
        ));
        assert_eq!(edge.nodes.owner_state("n1"), OwnerState::Offline);
        // The whole reload: n1 is gone for good.
        edge.reload(config("[]"));
        assert!(matches!(
            register(&edge).await,
            Err(Rejection::UnknownToken)
        ));
    }

    #[test]
    fn a_changed_store_is_reported_as_needing_a_restart() {
        let config = |store: &str| {
            EdgeConfig::from_yaml_with_env(
                &format!("{store}nodes: []\nmodel_groups: []\n"),
                "test",
                &|var| {
                    (var == crate::config::store::STORE_SECRET_KEY_ENV)
                        .then(|| "A".repeat(43) + "=")
                },
            )
            .unwrap()
        };
        let edge = Edge::new(config(""));
        let report = edge.reload(config("store: {url: \"postgres://iop@127.0.0.1/iop\"}\n"));
        assert_eq!(report.needs_restart, ["store"]);
        let report = edge.reload(config("store: {url: \"postgres://iop@127.0.0.1/iop\"}\n"));
        assert!(
            report.needs_restart.is_empty(),
            "{:?}",
            report.needs_restart
        );
    }
}
