//! The edge's part for the Ollama providers' own models: what each provider's server
//! holds and has loaded, as last asked, the signal to ask again (a node became ready, a
//! pull ended), and the model pulls across the fleet ([`super::model_jobs`]). The groups
//! served for these models are built from [`ProviderModels::held`] by
//! [`crate::local_models`]; asking the nodes is [`super::models`]' job.

use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::Notify;

use super::model_jobs::FleetJobs;
use crate::local_models::Held;

/// One provider: (node, provider).
pub type ProviderKey = (String, String);

#[derive(Debug, Default)]
pub struct ProviderModels {
    /// What each provider's server holds.
    held: Mutex<Held>,
    /// What each provider's server has loaded.
    loaded: Mutex<Held>,
    /// Asks the model refresher to look again.
    stale: Notify,
    /// Model pulls across the fleet, running and recent.
    pub(crate) jobs: FleetJobs,
}

impl ProviderModels {
    /// What each provider holds, as last asked.
    pub fn held(&self) -> Held {
        self.held.lock().clone()
    }

    /// Takes `answers` (what providers said they hold; the others keep what they held):
    /// the whole new picture when it changed anything, else `None`.
    pub fn update_held(
        &self,
        answers: impl IntoIterator<Item = (ProviderKey, Vec<String>)>,
    ) -> Option<Held> {
        let mut held = self.held.lock();
        let mut changed = false;
        for (key, names) in answers {
            if held.get(&key) != Some(&names) {
                held.insert(key, names);
                changed = true;
            }
        }
        changed.then(|| held.clone())
    }

    /// What `provider` said it has loaded.
    pub fn set_loaded(&self, provider: ProviderKey, names: Vec<String>) {
        self.loaded.lock().insert(provider, names);
    }

    /// Each provider with what it holds and has loaded (`null` before it said), for the
    /// admin API.
    pub fn view(&self) -> Vec<Value> {
        let held = self.held();
        let loaded = self.loaded.lock().clone();
        held.into_iter()
            .map(|((node, provider), models)| {
                let loaded = loaded.get(&(node.clone(), provider.clone()));
                json!({"node": node, "provider": provider, "models": models, "loaded": loaded})
            })
            .collect()
    }

    /// Asks the refresher to look again.
    pub fn mark_stale(&self) {
        self.stale.notify_one();
    }

    /// Resolves when something asked to look again (at once when it was asked since the
    /// last time).
    pub async fn stale(&self) {
        self.stale.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(node: &str) -> ProviderKey {
        (node.to_string(), "ollama".to_string())
    }

    fn names(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn an_answer_that_changes_nothing_builds_nothing() {
        let models = ProviderModels::default();
        let held = models
            .update_held([(key("n1"), names(&["a:latest"]))])
            .unwrap();
        assert_eq!(held[&key("n1")], names(&["a:latest"]));
        assert_eq!(
            models.update_held([(key("n1"), names(&["a:latest"]))]),
            None
        );
        assert_eq!(models.update_held([]), None);
    }

    #[test]
    fn a_provider_that_did_not_answer_keeps_what_it_held() {
        let models = ProviderModels::default();
        models.update_held([
            (key("n1"), names(&["a:latest"])),
            (key("n2"), names(&["b:latest"])),
        ]);
        let held = models.update_held([(key("n2"), names(&[]))]).unwrap();
        assert_eq!(held[&key("n1")], names(&["a:latest"]));
        assert_eq!(held[&key("n2")], names(&[]));
        assert_eq!(models.held(), held);
    }

    #[test]
    fn the_view_shows_what_is_loaded_beside_what_is_held() {
        let models = ProviderModels::default();
        models.update_held([
            (key("n1"), names(&["a:latest", "b:latest"])),
            (key("n2"), names(&["c:latest"])),
        ]);
        models.set_loaded(key("n1"), names(&["b:latest"]));
        assert_eq!(
            models.view(),
            [
                json!({"node": "n1", "provider": "ollama", "models": ["a:latest", "b:latest"], "loaded": ["b:latest"]}),
                json!({"node": "n2", "provider": "ollama", "models": ["c:latest"], "loaded": null}),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_look_asked_for_before_the_refresher_waits_is_not_lost() {
        let models = ProviderModels::default();
        models.mark_stale();
        tokio::time::timeout(std::time::Duration::from_secs(1), models.stale())
            .await
            .expect("the earlier ask wakes it");
        assert!(
            tokio::time::timeout(std::time::Duration::from_secs(1), models.stale())
                .await
                .is_err(),
            "one ask, one look"
        );
    }
}
