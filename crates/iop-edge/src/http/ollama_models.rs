//! Ollama's model-management endpoints on the edge, fleet-wide and for admin keys only
//! (mounted with the admin routes: a client key gets 403): `POST /api/pull`,
//! `DELETE /api/delete`, `POST /api/copy` and `POST /api/create` act on every enabled
//! Ollama provider of a connected node, or on those `?node=`/`?provider=` (or the
//! `x-iop-node`/`x-iop-provider` headers) select.
//!
//! A pull is a fleet job (`service::model_jobs`) streamed as Ollama's NDJSON progress, each
//! line naming its `node` and `provider`, one `success` or `error` line per target, then a
//! last line without them: `{"status":"success"}` when every target succeeded, else an
//! `error` naming the ones that failed — so an Ollama client that reads the last line
//! sees the outcome. With `"stream": false` the answer is that last line alone (an error
//! as a 500). A client that leaves stops reading the job, not the pulls.
//!
//! `GET /api/ps` with `?fleet=true` or a selector is answered here too ([`fleet_ps`]).
//!
//! Delete, copy and create answer once every target has: 200 with what happened on each
//! (`results`), 404 in Ollama's shape when no target holds the model, 502 when a target
//! failed otherwise.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use futures::StreamExt;
use iop_proto::ErrorCode;
use serde::Deserialize;
use serde_json::{Value, json};

use super::body::OllamaBody;
use super::error;
use super::error::HttpError;
use crate::canonical::ApiError;
use crate::service::Edge;
use crate::service::command::CommandError;
use crate::service::model_jobs::{FleetJob, job_lines};
use crate::service::models::Target;
use crate::surfaces::ErrorShape;

pub fn routes() -> Router<Arc<Edge>> {
    Router::new()
        .route("/api/pull", post(pull))
        .route("/api/delete", delete(remove))
        .route("/api/copy", post(copy))
        .route("/api/create", post(create))
}

/// Which targets a request selects.
#[derive(Debug, Default, Deserialize)]
pub struct Selector {
    pub node: Option<String>,
    pub provider: Option<String>,
}

fn ollama_error(e: ApiError) -> Response {
    error::response(ErrorShape::Ollama, e)
}

/// The targets a request selects, or why there are none.
pub fn targets(
    edge: &Edge,
    selector: Selector,
    headers: &HeaderMap,
) -> Result<Vec<Target>, ApiError> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
    };
    let node = selector.node.or_else(|| header("x-iop-node"));
    let provider = selector.provider.or_else(|| header("x-iop-provider"));
    let targets = edge.ollama_targets(node.as_deref(), provider.as_deref());
    if targets.is_empty() {
        return Err(ApiError::of(
            ErrorCode::ModelUnavailable,
            format!(
                "no enabled Ollama provider on a connected node{}{}",
                node.map(|n| format!(", node {n}")).unwrap_or_default(),
                provider
                    .map(|p| format!(", provider {p}"))
                    .unwrap_or_default(),
            ),
        )
        .with_detail("no_target"));
    }
    Ok(targets)
}

/// A string field of the body, required.
fn field<'a>(body: &'a Value, names: &[&str]) -> Result<&'a str, ApiError> {
    names
        .iter()
        .find_map(|n| body.get(*n).and_then(Value::as_str))
        .filter(|v| !v.is_empty())
        .ok_or_else(|| {
            ApiError::bad_request("missing_field", format!("you must provide `{}`", names[0]))
                .with_param(names[0])
        })
}

fn parse(body: Result<OllamaBody, HttpError>) -> Result<Value, ApiError> {
    let OllamaBody(bytes) = body.map_err(|e| e.0)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request("invalid_json", format!("invalid JSON: {e}")))
}

fn ndjson(lines: impl futures::Stream<Item = Value> + Send + 'static) -> Response {
    let body =
        lines.map(|line| Ok::<_, std::convert::Infallible>(Bytes::from(format!("{line}\n"))));
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(body),
    )
        .into_response()
}

async fn pull(
    State(edge): State<Arc<Edge>>,
    Query(selector): Query<Selector>,
    headers: HeaderMap,
    body: Result<OllamaBody, HttpError>,
) -> Response {
    let begun = (|| {
        let body = parse(body)?;
        let model = field(&body, &["model", "name"])?.to_string();
        let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(true);
        let targets = targets(&edge, selector, &headers)?;
        Ok::<_, ApiError>((model, stream, targets))
    })();
    let (model, stream, targets) = match begun {
        Ok(begun) => begun,
        Err(e) => return ollama_error(e),
    };
    let mut job = edge.start_pull_job(&model, targets);
    if stream {
        return ndjson(job_lines(job));
    }
    let ended = job.wait_for(FleetJob::ended).await.map(|j| j.clone());
    let last = match ended {
        Ok(job) => job.outcome(),
        Err(_) => json!({"error": "the edge stopped following the pull"}),
    };
    match last.get("error") {
        Some(_) => (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(last)).into_response(),
        None => axum::Json(last).into_response(),
    }
}

/// `GET /api/ps` fleet-wide (an admin's, with `?fleet=true` or a selector): what each
/// target's Ollama server has loaded, its own `/api/ps` entries naming `node` and
/// `provider`; targets that did not answer are listed under `errors`.
pub async fn fleet_ps(edge: &Edge, selector: Selector, headers: &HeaderMap) -> Response {
    let targets = match targets(edge, selector, headers) {
        Ok(targets) => targets,
        Err(e) => return ollama_error(e),
    };
    let results = on_every_target(edge, &targets, "ollama.ps", &[]).await;
    let mut models = Vec::new();
    let mut errors = Vec::new();
    for (target, result) in results {
        match result {
            Ok(ps) => {
                for mut model in ps["models"].as_array().cloned().unwrap_or_default() {
                    model["node"] = json!(target.node);
                    model["provider"] = json!(target.provider);
                    models.push(model);
                }
            }
            Err(e) => errors.push(
                json!({"node": target.node, "provider": target.provider, "error": e.to_string()}),
            ),
        }
    }
    let mut answer = json!({"models": models});
    if !errors.is_empty() {
        answer["errors"] = json!(errors);
    }
    axum::Json(answer).into_response()
}

/// Runs `name` with `args` on every target at once; each target's result.
async fn on_every_target(
    edge: &Edge,
    targets: &[Target],
    name: &str,
    args: &[(&str, &str)],
) -> Vec<(Target, Result<Value, CommandError>)> {
    let calls = targets.iter().map(|t| async move {
        let result = edge.target_command(t, name, args).await;
        (t.clone(), result)
    });
    futures::future::join_all(calls).await
}

/// The answer to a delete, copy or create from every target's result: 200 with each
/// target's, 404 when none holds the model, 502 when one failed otherwise.
fn fleet_answer(model: &str, results: Vec<(Target, Result<Value, CommandError>)>) -> Response {
    let not_found = |e: &CommandError| matches!(e, CommandError::Failed { code, .. } if matches!(code, ErrorCode::NotFound | ErrorCode::ModelNotFound));
    let mut each = Vec::new();
    let mut failed = Vec::new();
    let mut missing = 0;
    for (target, result) in &results {
        let mut line = match result {
            Ok(_) => json!({"status": "success"}),
            Err(e) => json!({"error": e.to_string()}),
        };
        line["node"] = json!(target.node);
        line["provider"] = json!(target.provider);
        each.push(line);
        match result {
            Err(e) if not_found(e) => missing += 1,
            Err(e) => failed.push((target.clone(), e.to_string())),
            Ok(_) => {}
        }
    }
    if missing == results.len() {
        return ollama_error(ApiError::not_found(
            "model_not_found",
            format!("model '{model}' not found on any target"),
        ));
    }
    if !failed.is_empty() {
        let each: Vec<String> = failed
            .iter()
            .map(|(t, e)| format!("{}/{}: {e}", t.node, t.provider))
            .collect();
        let message = format!(
            "failed on {} of {} targets: {}",
            failed.len(),
            results.len(),
            each.join("; ")
        );
        let mut e = ApiError::of(ErrorCode::ProviderError, message);
        e.status = StatusCode::BAD_GATEWAY;
        return ollama_error(e);
    }
    axum::Json(json!({"status": "success", "results": each})).into_response()
}

/// The arguments of a fleet command from its body: the model its errors name, and the
/// node command's arguments.
type Arguments = Result<(String, Vec<(String, String)>), ApiError>;

/// Runs node command `name` on every selected target with the arguments `arguments`
/// reads from the body, looks at the providers' models again, and answers for all.
async fn on_the_fleet(
    edge: &Edge,
    selector: Selector,
    headers: &HeaderMap,
    body: Result<OllamaBody, HttpError>,
    name: &str,
    arguments: fn(&Value) -> Arguments,
) -> Response {
    let begun = parse(body)
        .and_then(|body| arguments(&body))
        .and_then(|(model, args)| Ok((model, args, targets(edge, selector, headers)?)));
    let (model, args, targets) = match begun {
        Ok(begun) => begun,
        Err(e) => return ollama_error(e),
    };
    let args: Vec<(&str, &str)> = args.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let results = on_every_target(edge, &targets, name, &args).await;
    edge.refresh_local_models(None).await;
    fleet_answer(&model, results)
}

async fn remove(
    State(edge): State<Arc<Edge>>,
    Query(selector): Query<Selector>,
    headers: HeaderMap,
    body: Result<OllamaBody, HttpError>,
) -> Response {
    on_the_fleet(&edge, selector, &headers, body, "ollama.delete", |body| {
        let model = field(body, &["model", "name"])?.to_string();
        Ok((model.clone(), vec![("model".into(), model)]))
    })
    .await
}

async fn copy(
    State(edge): State<Arc<Edge>>,
    Query(selector): Query<Selector>,
    headers: HeaderMap,
    body: Result<OllamaBody, HttpError>,
) -> Response {
    on_the_fleet(&edge, selector, &headers, body, "ollama.copy", |body| {
        let source = field(body, &["source"])?.to_string();
        let destination = field(body, &["destination"])?.to_string();
        let args = vec![
            ("source".into(), source.clone()),
            ("destination".into(), destination),
        ];
        Ok((source, args))
    })
    .await
}

async fn create(
    State(edge): State<Arc<Edge>>,
    Query(selector): Query<Selector>,
    headers: HeaderMap,
    body: Result<OllamaBody, HttpError>,
) -> Response {
    on_the_fleet(
        &edge,
        selector,
        &headers,
        body,
        "ollama.create",
        create_arguments,
    )
    .await
}

/// `/api/create`'s arguments: `model` `from` an existing model, with `system`, `template`
/// and `parameters`.
fn create_arguments(body: &Value) -> Arguments {
    let model = field(body, &["model", "name"])?.to_string();
    let from = field(body, &["from"]).map_err(|_| {
        ApiError::bad_request(
            "missing_field",
            "this edge creates models `from` an existing model only (no files or adapters)",
        )
        .with_param("from")
    })?;
    let mut args = vec![
        ("model".to_string(), model.clone()),
        ("from".to_string(), from.to_string()),
    ];
    for key in ["system", "template"] {
        if let Some(text) = body.get(key).and_then(Value::as_str) {
            args.push((key.to_string(), text.to_string()));
        }
    }
    if let Some(parameters) = body.get("parameters").filter(|p| p.is_object()) {
        args.push(("parameters".to_string(), parameters.to_string()));
    }
    Ok((model, args))
}
