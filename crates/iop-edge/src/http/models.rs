//! `GET /v1/models` and `GET /v1/models/{id}` (the model groups as OpenAI models, see
//! `catalog::models`): a key with a model allowlist sees only its models; any other id
//! is a 404 in OpenAI's shape, exactly like one that does not exist. Ids may hold `/`
//! (`meta-llama/Llama-3.1-8B`): the rest of the path is the id.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Extension, Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::auth::Caller;
use crate::canonical::ApiError;
use crate::catalog::models;
use crate::http::error::HttpError;
use crate::service::Edge;

pub fn routes() -> Router<Arc<Edge>> {
    Router::new()
        .route("/v1/models", get(list))
        .route("/v1/models/{*id}", get(retrieve))
}

async fn list(State(edge): State<Arc<Edge>>, Extension(caller): Extension<Caller>) -> Response {
    axum::Json(models::list(&edge.config(), &caller)).into_response()
}

async fn retrieve(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    match models::retrieve(&edge.config(), &caller, &id) {
        Some(model) => axum::Json(model).into_response(),
        None => HttpError(
            ApiError::model_not_found(format!(
                "the model `{id}` does not exist or you do not have access to it; \
                 GET /v1/models lists the models you can use"
            ))
            .with_param("model"),
        )
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use http_body_util::BodyExt;
    use tower_service::Service;

    use serde_json::Value;

    use super::*;
    use crate::EdgeConfig;
    use crate::catalog::models::{DEFAULT_OWNER, created};

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
        let mut router = crate::http::routes::router(edge);
        let request = Request::get(path)
            .header("authorization", format!("Bearer {key}"))
            .body(Body::empty())
            .unwrap();
        let response = router.call(request).await.unwrap();
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap())
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
