//! What an OpenAI-compatible provider says about one of its models, for the edge's Ollama
//! `/api/show` (the `models.show` node command): `GET /v1/models`, the entry whose `id` (or
//! one of its `aliases`) is the model, and the Ollama-style entry llama-server lists
//! beside it (`models[]`, with `details` and `capabilities`).
//!
//! The answer is `{"data": <OpenAI entry or null>, "ollama": <Ollama-style entry or null>}`.

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};

use super::error::AdapterError;
use super::http::HttpProvider;

/// How long the lookup may take: `/api/show` waits for it.
const SHOW_TIMEOUT: Duration = Duration::from_secs(5);

/// The provider's entries for `model`.
pub async fn show(provider: &HttpProvider, model: &str) -> Result<Value, AdapterError> {
    let request = provider.request(Method::GET, "/models");
    let list = provider
        .json_lookup(request, SHOW_TIMEOUT, "GET /v1/models")
        .await?;
    Ok(entries(&list, model))
}

/// `model`'s entries in a `/models` answer.
fn entries(list: &Value, model: &str) -> Value {
    let named = |entry: &&Value, keys: &[&str]| {
        keys.iter()
            .any(|k| entry.get(*k).and_then(Value::as_str) == Some(model))
            || entry
                .get("aliases")
                .and_then(Value::as_array)
                .is_some_and(|a| a.iter().any(|x| x.as_str() == Some(model)))
    };
    let find = |key: &str, names: &[&str]| {
        list.get(key)
            .and_then(Value::as_array)
            .and_then(|entries| entries.iter().find(|e| named(e, names)))
            .cloned()
            .unwrap_or(Value::Null)
    };
    json!({"data": find("data", &["id"]), "ollama": find("models", &["name", "model"])})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_models_entries_are_found_by_id_alias_or_name() {
        let list = json!({
            "models": [{"name": "tiny", "model": "tiny", "details": {"format": "gguf"}}],
            "object": "list",
            "data": [
                {"id": "other", "object": "model"},
                {"id": "tiny.gguf", "aliases": ["tiny"], "meta": {"n_params": 146880}}
            ]
        });
        let found = entries(&list, "tiny");
        assert_eq!(found["data"]["meta"]["n_params"], 146880);
        assert_eq!(found["ollama"]["details"]["format"], "gguf");
        let missing = entries(&list, "nope");
        assert_eq!(missing, json!({"data": null, "ollama": null}));
    }
}
