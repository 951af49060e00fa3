//! The edge's config part: the config it serves and the file's own, each replaced as a
//! whole, and the lock that applies one config at a time.
//!
//! What is served is the file's config with the Ollama providers' own models added as
//! groups ([`crate::local_models`]). A reload (a new file) and a change of those models
//! each build the served config from the other's latest half, so each holds
//! [`Configs::applying`] from reading that half to serving the result: neither serves a
//! config built from what the other is replacing.

use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard, RwLock};

use crate::config::EdgeConfig;

#[derive(Debug)]
pub struct Configs {
    /// What the edge serves.
    served: RwLock<Arc<EdgeConfig>>,
    /// The config as the file has it.
    file: RwLock<Arc<EdgeConfig>>,
    /// Held while a config is built and applied.
    applying: Mutex<()>,
}

impl Configs {
    /// Serves `config`, the file's.
    pub fn new(config: EdgeConfig) -> Self {
        let config = Arc::new(config);
        Self {
            served: RwLock::new(config.clone()),
            file: RwLock::new(config),
            applying: Mutex::new(()),
        }
    }

    /// The config served now.
    pub fn served(&self) -> Arc<EdgeConfig> {
        self.served.read().clone()
    }

    /// The config as the file has it.
    pub fn file(&self) -> Arc<EdgeConfig> {
        self.file.read().clone()
    }

    /// One config application at a time: held from reading what a new config is built
    /// from to serving it.
    pub(crate) fn applying(&self) -> MutexGuard<'_, ()> {
        self.applying.lock()
    }

    /// The file's new config (served once applied: [`Configs::serve`]).
    pub(crate) fn set_file(&self, config: Arc<EdgeConfig>) {
        *self.file.write() = config;
    }

    /// Serves `config` from now on.
    pub(crate) fn serve(&self, config: Arc<EdgeConfig>) {
        *self.served.write() = config;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(groups: &str) -> Arc<EdgeConfig> {
        Arc::new(EdgeConfig::from_yaml(&format!("model_groups: {groups}\n"), "test").unwrap())
    }

    #[test]
    fn the_file_and_what_is_served_are_replaced_apart() {
        let configs = Configs::new((*config("[]")).clone());
        assert!(Arc::ptr_eq(&configs.served(), &configs.file()));
        let file = config("[]");
        configs.set_file(file.clone());
        assert!(Arc::ptr_eq(&configs.file(), &file));
        assert!(
            !Arc::ptr_eq(&configs.served(), &file),
            "not served before it is applied"
        );
        let served = config("[]");
        configs.serve(served.clone());
        assert!(Arc::ptr_eq(&configs.served(), &served));
        assert!(Arc::ptr_eq(&configs.file(), &file));
    }

    #[test]
    fn one_application_at_a_time() {
        let configs = Configs::new((*config("[]")).clone());
        let first = configs.applying();
        assert!(configs.applying.try_lock().is_none());
        // Reading either config does not wait for an application.
        let _ = (configs.served(), configs.file());
        drop(first);
        assert!(configs.applying.try_lock().is_some());
    }
}
