//! Node commands over HTTP: `/v1/nodes/{node}/commands/{name}`, admin keys only. `GET`
//! takes the arguments in the query, as it always has; `POST` — meant for the commands
//! that change a provider (`ollama.pull`, `ollama.delete`, `ollama.copy`,
//! `ollama.create`, `ollama.load`, `ollama.unload`) — in the query or as a JSON object
//! body (strings as they are, other values as JSON text).

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use crate::canonical::ApiError;
use crate::http::error::HttpError;
use crate::service::Edge;

pub(super) async fn get_command(
    State(edge): State<Arc<Edge>>,
    Path((node, name)): Path<(String, String)>,
    Query(args): Query<HashMap<String, String>>,
) -> Result<Response, HttpError> {
    run(&edge, &node, &name, args).await
}

pub(super) async fn post_command(
    State(edge): State<Arc<Edge>>,
    Path((node, name)): Path<(String, String)>,
    Query(mut args): Query<HashMap<String, String>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, HttpError> {
    let body = body.map_err(|r| crate::http::body::body_error(r, &edge))?;
    args.extend(body_args(&body)?);
    run(&edge, &node, &name, args).await
}

async fn run(
    edge: &Edge,
    node: &str,
    name: &str,
    mut args: HashMap<String, String>,
) -> Result<Response, HttpError> {
    let adapter = args.remove("adapter").unwrap_or_default();
    let result = edge.node_command(node, name, &adapter, args).await?;
    Ok(axum::Json(result).into_response())
}

/// A command's arguments from a JSON object body (an empty body has none).
fn body_args(body: &[u8]) -> Result<HashMap<String, String>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(HashMap::new());
    }
    let invalid = |why: String| ApiError::bad_request("invalid_request", why);
    let Value::Object(fields) = serde_json::from_slice(body)
        .map_err(|e| invalid(format!("the command's body is not JSON: {e}")))?
    else {
        return Err(invalid(
            "the command's body must be a JSON object of its arguments".into(),
        ));
    };
    Ok(fields
        .into_iter()
        .map(|(key, value)| match value {
            Value::String(text) => (key, text),
            other => (key, other.to_string()),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_arguments_are_strings_or_json_text() {
        let args =
            body_args(br#"{"model":"m:1b","parameters":{"temperature":0.2},"wait_ms":5}"#).unwrap();
        assert_eq!(args["model"], "m:1b");
        assert_eq!(args["parameters"], r#"{"temperature":0.2}"#);
        assert_eq!(args["wait_ms"], "5");
        assert!(body_args(b"  ").unwrap().is_empty());
        assert_eq!(body_args(b"[1]").unwrap_err().status, 400);
        assert_eq!(body_args(b"{").unwrap_err().status, 400);
    }
}
