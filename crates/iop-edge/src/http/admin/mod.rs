//! Admin endpoints: `/admin/status` (the snapshot, with the ledger's counters and where
//! each API key stands against its limits), `/admin/events` (the event bus as SSE:
//! every prompt and output passes through it), `/metrics` (Prometheus text, or OpenMetrics
//! when the scraper's `Accept` asks for it), node commands
//! (`/v1/nodes/{node}/commands/{name}`, [`command`]), the usage ledger ([`usage`]) and node credentials
//! ([`trust`]), fleet model jobs and the Ollama providers' models ([`jobs`]) — admin
//! keys only — and the open probes `/healthz` and `/readyz` and the
//! status page ([`ui`]).

mod command;
mod jobs;
pub mod trust;
pub mod ui;
pub mod usage;

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::stream;
use serde_json::json;
use tokio::sync::broadcast::error::RecvError;

use crate::events::EdgeEvent;
use crate::service::Edge;

/// Routes for admin keys only (everyone on an edge without keys).
pub fn admin_routes() -> Router<Arc<Edge>> {
    Router::new()
        .route("/admin/status", get(status))
        .route("/admin/events", get(events))
        .route("/metrics", get(metrics))
        .route(
            "/v1/nodes/{node}/commands/{name}",
            get(command::get_command).post(command::post_command),
        )
        .merge(jobs::routes())
        .merge(trust::routes())
        .merge(usage::routes())
}

/// Routes that are always open (the probes, the status page).
pub fn open_routes() -> Router<Arc<Edge>> {
    Router::new()
        .route("/", get(root))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .merge(ui::routes())
}

async fn status(State(edge): State<Arc<Edge>>) -> Response {
    let mut body = serde_json::to_value(edge.snapshot()).unwrap_or_default();
    let ledger = edge.telemetry.ledger();
    body["ledger"] = json!({
        "enabled": ledger.is_enabled(),
        "written_records": ledger.written(),
        "dropped_records": ledger.dropped(),
    });
    body["ollama"] = json!({
        "providers": edge.ollama_models(),
        "jobs": edge.provider_models.jobs.list(),
    });
    body["keys"] = edge
        .keys
        .usage()
        .into_iter()
        .map(|(name, usage)| {
            let mut key = json!(usage);
            key["name"] = json!(name);
            key
        })
        .collect();
    if let Some(fleet) = edge.fleet.get() {
        let live = fleet.live();
        // Which edges of the fleet each node is linked to, as each edge last said.
        if let Some(nodes) = body["nodes"].as_array_mut() {
            for node in nodes {
                let id = node["id"].as_str().unwrap_or_default().to_string();
                let linked: Vec<&str> = live
                    .iter()
                    .filter(|e| e.record.linked.contains(&id))
                    .map(|e| e.record.id.as_str())
                    .collect();
                node["edges"] = json!(linked);
            }
        }
        body["edges"] = json!(live);
        if let Some(error) = fleet.store_error() {
            body["store_error"] = json!(error);
        }
    }
    body["draining"] = json!(edge.drain.is_draining());
    body["requests_in_progress"] = json!(edge.drain.in_progress());
    axum::Json(body).into_response()
}

/// `GET /` (and `HEAD /`, which clients such as Claude Code use to check the endpoint):
/// 200, like an Ollama server's "Ollama is running".
async fn root() -> &'static str {
    "iop edge is running"
}

async fn healthz() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

/// Ready when at least one node is dispatch-ready.
/// 200 once a node is ready, 503 before — and from the start of a drain, so a load
/// balancer moves traffic to other edges.
async fn readyz(State(edge): State<Arc<Edge>>) -> Response {
    let nodes_ready = edge.nodes.ready_sessions().len();
    let draining = edge.drain.is_draining();
    let ready = nodes_ready > 0 && !draining;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut body = json!({"ready": ready, "nodes_ready": nodes_ready});
    if draining {
        body["draining"] = json!(true);
    }
    (status, axum::Json(body)).into_response()
}

async fn metrics(State(edge): State<Arc<Edge>>, headers: HeaderMap) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = crate::metrics::Format::negotiate(accept);
    let text = edge.telemetry.metrics.render(&edge.snapshot(), format);
    ([(header::CONTENT_TYPE, format.content_type())], text).into_response()
}

async fn events(State(edge): State<Arc<Edge>>) -> Response {
    let rx = edge.telemetry.events.subscribe();
    let shutdown = edge.shutdown_token().clone();
    let body = stream::unfold((rx, shutdown), |(mut rx, shutdown)| async move {
        let received = tokio::select! {
            _ = shutdown.cancelled() => return None,
            received = rx.recv() => received,
        };
        let bytes = match received {
            Ok(event) => {
                let name = match &*event {
                    EdgeEvent::Node(_) => "node",
                    EdgeEvent::Run(_) => "run",
                    EdgeEvent::Usage(_) => "usage",
                };
                let data = serde_json::to_string(&*event).unwrap_or_default();
                format!("event: {name}\ndata: {data}\n\n")
            }
            Err(RecvError::Lagged(n)) => format!("event: lagged\ndata: {{\"missed\":{n}}}\n\n"),
            Err(RecvError::Closed) => return None,
        };
        Some((Ok::<_, std::io::Error>(Bytes::from(bytes)), (rx, shutdown)))
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}
