//! Admin endpoints for node credentials: create, list and delete join tokens, and revoke a
//! node. They sit with the other `/admin/*` routes (behind the same auth).
//!
//! - `POST /admin/join-tokens` `{"node", "ttl_sec"?, "uses"?, "edges"?}` → 201 with the
//!   join string (the only time its secret is shown);
//! - `GET /admin/join-tokens` → the tokens without their secrets;
//! - `DELETE /admin/join-tokens/{id}`;
//! - `POST /admin/nodes/{node}/revoke` → what the revocation did.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use serde::Deserialize;
use serde_json::json;

use crate::canonical::ApiError;
use crate::http::error::HttpError;
use crate::service::Edge;
use crate::service::credentials::CredentialAdminError;
use crate::trust::SaveError;
use iop_proto::ErrorCode;

/// Default lifetime of a join token.
pub const DEFAULT_JOIN_TTL_SEC: u64 = 24 * 3600;
/// Longest lifetime a join token may be given.
pub const MAX_JOIN_TTL_SEC: u64 = 365 * 86_400;

pub fn routes() -> Router<Arc<Edge>> {
    Router::new()
        .route("/admin/join-tokens", post(create).get(list))
        .route("/admin/join-tokens/{id}", delete(remove))
        .route("/admin/nodes/{node}/revoke", post(revoke))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    node: String,
    #[serde(default)]
    ttl_sec: Option<u64>,
    #[serde(default)]
    uses: Option<u32>,
    /// `host:port` nodes dial; default `node_tls.advertise` or the listener's address.
    #[serde(default)]
    edges: Vec<String>,
}

fn admin_error(e: CredentialAdminError) -> ApiError {
    let message = e.to_string();
    match e {
        CredentialAdminError::NoSuchNode(_) => ApiError::not_found("unknown_node", message),
        CredentialAdminError::BadRequest(_) | CredentialAdminError::NoAddress(_) => {
            ApiError::bad_request("invalid_request", message)
        }
        CredentialAdminError::NoCa(_) => {
            ApiError::of(ErrorCode::Conflict, message).with_detail("join_tokens_unavailable")
        }
        CredentialAdminError::Save(SaveError::Store(_)) => {
            ApiError::of(ErrorCode::Unavailable, message).with_detail("store_unavailable")
        }
        CredentialAdminError::NoState | CredentialAdminError::Save(_) => {
            ApiError::of(ErrorCode::Internal, message).with_detail("state_unavailable")
        }
    }
}

async fn create(
    State(edge): State<Arc<Edge>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, HttpError> {
    let body = body.map_err(|r| crate::http::body::body_error(r, &edge))?;
    let request: CreateBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(
            "invalid_request",
            format!("invalid join token request: {e}"),
        )
    })?;
    let ttl = request.ttl_sec.unwrap_or(DEFAULT_JOIN_TTL_SEC);
    if ttl > MAX_JOIN_TTL_SEC {
        return Err(ApiError::bad_request(
            "invalid_request",
            format!("ttl_sec may be at most {MAX_JOIN_TTL_SEC} (a year)"),
        )
        .into());
    }
    let created = edge
        .create_join(
            &request.node,
            Duration::from_secs(ttl),
            request.uses.unwrap_or(1),
            request.edges,
        )
        .await
        .map_err(admin_error)?;
    let record = &created.record;
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({
            "join": created.join.to_string(),
            "id": record.id,
            "node": record.node_id,
            "expires_unix_ms": record.expires_unix_ms,
            "uses": record.max_uses,
            "pin": created.join.pin.to_string(),
            "edges": created.join.edges,
        })),
    )
        .into_response())
}

async fn list(State(edge): State<Arc<Edge>>) -> Result<Response, HttpError> {
    let trust = edge
        .trust()
        .ok_or_else(|| admin_error(CredentialAdminError::NoState))?;
    let tokens: Vec<_> = trust
        .join_tokens()
        .await
        .map_err(|e| admin_error(e.into()))?
        .into_iter()
        .map(|r| {
            json!({
                "id": r.id,
                "node": r.node_id,
                "created_unix_ms": r.created_unix_ms,
                "expires_unix_ms": r.expires_unix_ms,
                "uses": r.max_uses,
                "uses_left": r.uses_left,
            })
        })
        .collect();
    Ok(axum::Json(json!({"join_tokens": tokens})).into_response())
}

async fn remove(
    State(edge): State<Arc<Edge>>,
    Path(id): Path<String>,
) -> Result<Response, HttpError> {
    let trust = edge
        .trust()
        .ok_or_else(|| admin_error(CredentialAdminError::NoState))?;
    match trust.delete_join_token(&id).await {
        Ok(true) => Ok(axum::Json(json!({"deleted": id})).into_response()),
        Ok(false) => {
            Err(ApiError::not_found("unknown_join_token", format!("no join token {id:?}")).into())
        }
        Err(e) => Err(admin_error(e.into()).into()),
    }
}

async fn revoke(
    State(edge): State<Arc<Edge>>,
    Path(node): Path<String>,
) -> Result<Response, HttpError> {
    let report = edge.revoke(&node).await.map_err(admin_error)?;
    Ok(axum::Json(report).into_response())
}
