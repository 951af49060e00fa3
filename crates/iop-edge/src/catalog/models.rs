//! The model groups as models: `GET /v1/models` and `GET /v1/models/{id}` in OpenAI's
//! shape, with the metadata the config gives (`context_length`, `owned_by`) and a stable
//! `created`. A key with a model allowlist sees only its models; any other id is a 404 in
//! OpenAI's shape, exactly like one that does not exist. Ids may hold `/`
//! (`meta-llama/Llama-3.1-8B`): the rest of the path is the id.
//!
//! The metadata helpers ([`created`], [`digest`]) serve Ollama's catalog too ([`super::ollama`]).
//!
//! Pure: the config and the caller in, OpenAI's JSON out (the handlers are
//! `http::models`).

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::auth::Caller;
use crate::config::{EdgeConfig, ModelGroupConfig};

/// `owned_by` of a group whose config names no owner.
pub const DEFAULT_OWNER: &str = "iop";

/// 2024-01-01T00:00:00Z, where the stand-in `created` times begin.
const CREATED_BASE: u64 = 1_704_067_200;
/// Stand-in `created` times spread over this many seconds after [`CREATED_BASE`].
const CREATED_SPREAD: u64 = 365 * 24 * 3600;

/// A stable `created` for a model group: iop does not know when a model was made, so it
/// is a time in 2024 derived from the name — the same on every edge, after every restart
/// and reload, never 0.
pub fn created(name: &str) -> u64 {
    let hash = Sha256::digest(name.as_bytes());
    let n = u64::from_be_bytes(hash[..8].try_into().expect("8 bytes"));
    CREATED_BASE + n % CREATED_SPREAD
}

/// A stable digest for a model group (Ollama's `digest`): the SHA-256 of its name.
pub fn digest(name: &str) -> String {
    hex::encode(Sha256::digest(name.as_bytes()))
}

/// The OpenAI model object of a group.
pub fn model_object(group: &ModelGroupConfig) -> Value {
    let mut model = json!({
        "id": group.name,
        "object": "model",
        "created": created(&group.name),
        "owned_by": group.owned_by.as_deref().unwrap_or(DEFAULT_OWNER),
    });
    if let Some(n) = group.context_length {
        // Both names clients read: `context_length` and vLLM's `max_model_len`.
        model["context_length"] = json!(n);
        model["max_model_len"] = json!(n);
    }
    model
}

/// `GET /v1/models`: the groups `caller` may use.
pub fn list(config: &EdgeConfig, caller: &Caller) -> Value {
    let data: Vec<Value> = config
        .model_groups
        .iter()
        .filter(|g| caller.may_use_model(&g.name))
        .map(model_object)
        .collect();
    json!({"object": "list", "data": data})
}

/// `GET /v1/models/{id}`, if `caller` may use it.
pub fn retrieve(config: &EdgeConfig, caller: &Caller, id: &str) -> Option<Value> {
    config
        .model_groups
        .iter()
        .find(|g| g.name == id && caller.may_use_model(&g.name))
        .map(model_object)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_is_stable_and_plausible() {
        assert_eq!(created("llama"), created("llama"));
        assert_ne!(created("llama"), created("mistral"));
        let c = created("anything");
        assert!((CREATED_BASE..CREATED_BASE + CREATED_SPREAD).contains(&c));
        assert_eq!(digest("x").len(), 64);
    }
}
