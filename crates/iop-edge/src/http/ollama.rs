//! Ollama's catalog endpoints on the edge: `/api/version`, `/api/tags`, `/api/ps` and
//! `/api/show` (the model groups as Ollama models, `catalog::ollama`). Its
//! model endpoints (chat, generate, embeddings) are served by the one model handler
//! (`http::model`); those that manage the nodes' Ollama models (`/api/pull`,
//! `/api/delete`, `/api/copy`, `/api/create`) by `http::ollama_models`, for admin keys.
//! Pushing to a registry and uploading blobs (`/api/push`, `/api/blobs/…`) answer 501.
//! Errors take Ollama's shape.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::extract::{Extension, Query, State};
use axum::http::{HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use iop_proto::ErrorCode;
use serde_json::{Value, json};

use super::error;
use crate::auth::Caller;
use crate::canonical::ApiError;
use crate::catalog::ollama as catalog;
use crate::config::{ModelGroupConfig, ProviderKind};
use crate::service::Edge;
use crate::surfaces::ErrorShape;
use crate::surfaces::ollama::request;

/// How long `/api/show` waits for an Ollama member's own details.
pub const SHOW_LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a group's `/api/show` answer is kept: a member is asked at most once per group
/// in this time, however many clients ask.
pub const SHOW_CACHE_FOR: Duration = Duration::from_secs(30);
/// The largest `/api/show` body read (it names a model: a few bytes).
pub const SHOW_MAX_BODY: usize = 64 * 1024;

/// `/api/show` answers by group, with when they were made.
#[derive(Debug, Default)]
pub struct ShowCache(parking_lot::Mutex<std::collections::HashMap<String, (Instant, Value)>>);

impl ShowCache {
    fn get(&self, group: &str, now: Instant) -> Option<Value> {
        let cached = self.0.lock();
        let (at, answer) = cached.get(group)?;
        (now.saturating_duration_since(*at) < SHOW_CACHE_FOR).then(|| answer.clone())
    }

    fn put(&self, group: &str, answer: &Value, now: Instant) {
        let mut cached = self.0.lock();
        // Only configured groups get here, so this stays as small as the config; stale
        // entries of removed groups go when it is cleared.
        cached.retain(|_, (at, _)| now.saturating_duration_since(*at) < SHOW_CACHE_FOR);
        cached.insert(group.to_string(), (now, answer.clone()));
    }
}

pub fn routes() -> Router<Arc<Edge>> {
    let cache = Arc::new(ShowCache::default());
    Router::new()
        .route("/api/version", get(version))
        .route("/api/tags", get(tags))
        .route("/api/ps", get(ps))
        .route(
            "/api/show",
            post(
                move |State(edge): State<Arc<Edge>>,
                      Extension(caller): Extension<Caller>,
                      request: axum::extract::Request| {
                    show(edge, cache.clone(), caller, request)
                },
            ),
        )
        .route("/api/push", post(not_supported))
        .route("/api/blobs/{digest}", any(not_supported))
}

fn ollama_error(e: ApiError) -> Response {
    error::response(ErrorShape::Ollama, e)
}

async fn version() -> Response {
    axum::Json(json!({"version": catalog::OLLAMA_API_VERSION})).into_response()
}

async fn tags(State(edge): State<Arc<Edge>>, Extension(caller): Extension<Caller>) -> Response {
    axum::Json(catalog::tags(&edge.config(), &caller)).into_response()
}

/// `GET /api/ps` asking for the fleet's view (`fleet=true`, or a target selector).
#[derive(Debug, Default, serde::Deserialize)]
struct PsQuery {
    /// `true` (or `1`) asks for the fleet's view.
    #[serde(default)]
    fleet: Option<String>,
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    provider: Option<String>,
}

async fn ps(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    Query(query): Query<PsQuery>,
    headers: HeaderMap,
) -> Response {
    let selected = query.node.is_some()
        || query.provider.is_some()
        || headers.contains_key("x-iop-node")
        || headers.contains_key("x-iop-provider");
    let fleet = matches!(query.fleet.as_deref(), Some("true" | "1"));
    if fleet || selected {
        if !caller.is_admin() {
            return ollama_error(ApiError::forbidden(
                "/api/ps of the fleet's Ollama servers needs an admin API key; this key's role is client",
            ));
        }
        let selector = super::ollama_models::Selector {
            node: query.node,
            provider: query.provider,
        };
        return super::ollama_models::fleet_ps(&edge, selector, &headers).await;
    }
    let config = edge.config();
    let served = |g: &ModelGroupConfig| {
        g.members.iter().any(|m| {
            edge.session(&m.node).is_some()
                && crate::service::provider_of(&config, &m.node, &m.provider)
                    .is_some_and(|p| p.enabled)
        })
    };
    axum::Json(catalog::ps(&config, &caller, served, SystemTime::now())).into_response()
}

async fn not_supported(uri: Uri) -> Response {
    ollama_error(ApiError::of(
        ErrorCode::NotImplemented,
        format!(
            "{} is not served here: this Ollama API is served by iop, whose models are the \
             model groups its nodes serve; an admin key pulls, copies, creates and \
             deletes models on the nodes' Ollama servers with /api/pull, /api/copy, \
             /api/create and /api/delete",
            uri.path()
        ),
    ))
}

/// Reads a small body (at most [`SHOW_MAX_BODY`]), whatever its `Content-Type`.
async fn small_body(request: axum::extract::Request) -> Result<axum::body::Bytes, ApiError> {
    let too_large = || {
        ApiError::of(
            ErrorCode::RequestTooLarge,
            format!("an /api/show request names a model: at most {SHOW_MAX_BODY} bytes"),
        )
    };
    let announced = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if announced.is_some_and(|n| n > SHOW_MAX_BODY) {
        return Err(too_large());
    }
    axum::body::to_bytes(request.into_body(), SHOW_MAX_BODY)
        .await
        .map_err(|_| too_large())
}

async fn show(
    edge: Arc<Edge>,
    cache: Arc<ShowCache>,
    caller: Caller,
    request: axum::extract::Request,
) -> Response {
    let result = async {
        let body = small_body(request).await?;
        let request: request::ShowRequest = request::parse(&body)?;
        let name = request.model().ok_or_else(|| {
            ApiError::bad_request("missing_model", "you must provide a `model`").with_param("model")
        })?;
        let config = edge.config();
        let group = catalog::resolve(&config, &caller, name)
            .ok_or_else(|| crate::surfaces::ollama::error::model_not_found(name))?;
        if let Some(answer) = cache.get(&group.name, Instant::now()) {
            return Ok(answer);
        }
        let answer = show_group(&edge, group).await;
        cache.put(&group.name, &answer, Instant::now());
        Ok::<_, ApiError>(answer)
    };
    match result.await {
        Ok(body) => axum::Json(body).into_response(),
        Err(e) => ollama_error(e),
    }
}

/// `/api/show` for a group: from the first member on a connected node that can say (an
/// Ollama member's own `/api/show`, an OpenAI-compatible member's `/v1/models`), waiting
/// at most [`SHOW_LOOKUP_TIMEOUT`], else from the config.
async fn show_group(edge: &Edge, group: &ModelGroupConfig) -> Value {
    let config = edge.config();
    let member = group.members.iter().find_map(|m| {
        let p = crate::service::provider_of(&config, &m.node, &m.provider)?;
        let usable = edge.session(&m.node).is_some() && p.enabled;
        (usable && (p.kind == ProviderKind::Ollama || p.kind.is_tunnel())).then_some((m, p.kind))
    });
    let Some((member, kind)) = member else {
        return catalog::show_from_config(group);
    };
    let model = member.model.clone().unwrap_or_else(|| group.name.clone());
    let command = if kind == ProviderKind::Ollama {
        "ollama.show"
    } else {
        "models.show"
    };
    let args = [("model".to_string(), model.clone())].into();
    let lookup = edge.node_command(&member.node, command, &member.provider, args);
    match tokio::time::timeout(SHOW_LOOKUP_TIMEOUT, lookup).await {
        Ok(Ok(answer)) if kind == ProviderKind::Ollama => catalog::show_from_member(group, &answer),
        Ok(Ok(answer)) => catalog::show_from_openai(group, &model, &answer),
        Ok(Err(err)) => {
            tracing::debug!(model_group = %group.name, node_id = %member.node, %err, "{command} failed: answering from the config");
            catalog::show_from_config(group)
        }
        Err(_) => {
            tracing::debug!(model_group = %group.name, node_id = %member.node, "{command} timed out: answering from the config");
            catalog::show_from_config(group)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_show_answer_is_kept_for_its_time_then_asked_again() {
        let cache = ShowCache::default();
        let t = Instant::now();
        assert!(cache.get("g", t).is_none());
        cache.put("g", &json!({"details": {}}), t);
        assert!(cache.get("g", t + SHOW_CACHE_FOR / 2).is_some());
        assert!(cache.get("g", t + SHOW_CACHE_FOR).is_none());
        cache.put("h", &json!({}), t + SHOW_CACHE_FOR);
        assert_eq!(cache.0.lock().len(), 1, "stale answers are dropped");
    }

    #[tokio::test]
    async fn an_oversized_show_body_is_refused_unread() {
        let request = axum::http::Request::builder()
            .header("content-length", (SHOW_MAX_BODY + 1).to_string())
            .body(axum::body::Body::from(vec![b' '; SHOW_MAX_BODY + 1]))
            .unwrap();
        assert_eq!(small_body(request).await.unwrap_err().status, 413);
    }
}
