//! The model groups as models: `GET /v1/models` and `GET /v1/models/{id}` in OpenAI's
//! shape, with the metadata the config gives (`context_length`, `owned_by`) and a stable
//! `created`. A key with a model allowlist sees only its models; any other id is a 404 in
//! OpenAI's shape, exactly like one that does not exist. Ids may hold `/`
//! (`meta-llama/Llama-3.1-8B`): the rest of the path is the id.
//!
//! The metadata helpers ([`created`], [`digest`]) serve the Ollama surface too.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Extension, Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::error::ApiError;
use crate::auth::Caller;
use crate::config::ModelGroupConfig;
use crate::service::Edge;

/// `owned_by` of a group whose config names no owner.
pub const DEFAULT_OWNER: &str = "iop";

/// 2024-01-01T00:00:00Z, where the stand-in `created` times begin.
const CREATED_BASE: u64 = 1_704_067_200;
/// Stand-in `created` times spread over this many seconds after [`CREATED_BASE`].
const CREATED_SPREAD: u64 = 365 * 24 * 3600;

pub fn routes() -> Router<Arc<Edge>> {
    Router::new()
        .route("/v1/models", get(list))
        .route("/v1/models/{*id}", get(retrieve))
}

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

async fn list(State(edge): State<Arc<Edge>>, Extension(caller): Extension<Caller>) -> Response {
    let data: Vec<Value> = edge
        .config()
        .model_groups
        .iter()
        .filter(|g| caller.may_use_model(&g.name))
        .map(model_object)
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn retrieve(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    let config = edge.config();
    match config
        .model_groups
        .iter()
        .find(|g| g.name == id && caller.may_use_model(&g.name))
    {
        Some(group) => axum::Json(model_object(group)).into_response(),
        None => ApiError::not_found(
            "model_not_found",
            format!(
                "the model `{id}` does not exist or you do not have access to it; \
                 GET /v1/models lists the models you can use"
            ),
        )
        .with_param("model")
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use http_body_util::BodyExt;
    use tower_service::Service;

    use super::*;
    use crate::EdgeConfig;

    const CONFIG: &str = r#"
auth:
  keys:
    - {name: ops, role: admin, key: admin-key-0123456789}
    - {name: bob, role: client, key: bob-key-01234567890, models: [small]}
nodes:
  - id: n1
    token: node-token-0123456789
    providers: [{id: p, kind: mock}]
model_groups:
  - {name: small, members: [{node: n1, provider: p}], context_length: 8192, owned_by: acme}
  - {name: meta-llama/Llama-3.1-8B, members: [{node: n1, provider: p}]}
"#;

    async fn get(path: &str, key: &str) -> (StatusCode, Value) {
        let edge = Edge::new(EdgeConfig::from_yaml(CONFIG, "test").unwrap());
        let mut router = crate::http::router(edge);
        let request = Request::get(path)
            .header("authorization", format!("Bearer {key}"))
            .body(Body::empty())
            .unwrap();
        let response = router.call(request).await.unwrap();
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap())
    }

    #[test]
    fn created_is_stable_and_plausible() {
        assert_eq!(created("llama"), created("llama"));
        assert_ne!(created("llama"), created("mistral"));
        let c = created("anything");
        assert!((CREATED_BASE..CREATED_BASE + CREATED_SPREAD).contains(&c));
        assert_eq!(digest("x").len(), 64);
    }

    #[tokio::test]
    async fn models_carry_their_metadata_and_ids_may_hold_slashes() {
        let (status, list) = get("/v1/models", "admin-key-0123456789").await;
        assert_eq!(status, 200);
        let small = &list["data"][0];
        assert_eq!(small["id"], "small");
        assert_eq!(small["owned_by"], "acme");
        assert_eq!(small["context_length"], 8192);
        assert_eq!(small["created"], created("small"));
        assert_eq!(list["data"][1]["owned_by"], DEFAULT_OWNER);
        let (status, one) = get("/v1/models/meta-llama/Llama-3.1-8B", "admin-key-0123456789").await;
        assert_eq!(status, 200);
        assert_eq!(one["id"], "meta-llama/Llama-3.1-8B");
        assert!(one.get("context_length").is_none());
        let (status, missing) = get("/v1/models/nope", "admin-key-0123456789").await;
        assert_eq!(status, 404);
        assert_eq!(missing["error"]["code"], "model_not_found");
    }

    #[tokio::test]
    async fn an_allowlisted_key_sees_only_its_models() {
        let (_, list) = get("/v1/models", "bob-key-01234567890").await;
        assert_eq!(list["data"].as_array().unwrap().len(), 1);
        let (status, _) = get("/v1/models/small", "bob-key-01234567890").await;
        assert_eq!(status, 200);
        let (status, body) = get("/v1/models/meta-llama/Llama-3.1-8B", "bob-key-01234567890").await;
        assert_eq!(status, 404);
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("does not exist")
        );
    }
}
