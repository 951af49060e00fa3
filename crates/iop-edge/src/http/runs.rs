//! The native runs API: submit a run to an adapter on a node and stream its `RunEvent`s
//! as SSE (one `event:` per RunEvent, ending with exactly one terminal), cancel a run,
//! terminate a logical session.
//!
//! A run goes through the same pipeline as every model request: it is recorded (the usage
//! ledger, metrics), admitted by the key's allowlist (a key with one may run only what its
//! model groups reach) and limits, and takes a slot on its provider.
//!
//! A run's stream is kept alive (`limits.http.stream_keepalive_sec`) while it waits for
//! its slot and while the run is silent, as the model APIs' streams are
//! ([`super::keepalive`]).
//!
//! A client key's runs and sessions are its own: cancelling another key's run answers 404
//! as for a run that does not exist, and the session ids it names live in its own
//! namespace.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use futures::stream;
use serde_json::json;

use super::decode::LargeBodies;
use super::{forward, keepalive, request_id};
use crate::auth::Caller;
use crate::canonical::ApiError;
use crate::http::error::HttpError;
use crate::ledger::{ClientApi, RequestRecorder};
use crate::service::Edge;
use crate::service::dispatch::RequestContext;
use crate::service::pipeline::{AdmitTarget, TokenEstimate};
use crate::surfaces::runs;

/// Routes any key may use, for its own runs and sessions. A run's body is read by the
/// large-body reader `large` (decoded off the event loop unless small, under the key's
/// share of large bodies), as a model request's is.
pub fn routes(large: Arc<LargeBodies>) -> Router<Arc<Edge>> {
    Router::new()
        .route(
            "/v1/runs",
            post(
                move |State(edge): State<Arc<Edge>>,
                      Extension(caller): Extension<Caller>,
                      headers: HeaderMap,
                      body: Request| async move {
                    submit(edge, large, caller, headers, body).await
                },
            ),
        )
        .route("/v1/runs/{run_id}/cancel", post(cancel))
        .route(
            "/v1/sessions/{node}/{adapter}/{target}/{session_id}",
            delete(terminate_session),
        )
}

async fn submit(
    edge: Arc<Edge>,
    large: Arc<LargeBodies>,
    caller: Caller,
    headers: HeaderMap,
    body: Request,
) -> Response {
    let recorder = edge.start_request(ClientApi::Runs, &caller);
    let every = edge.config().limits.http.stream_keepalive();
    // Owned, so a run kept alive while it waits can outlive the handler.
    let (owned_edge, answer_recorder) = (edge.clone(), recorder.clone());
    let answering = async move {
        handle(
            &owned_edge,
            &large,
            &caller,
            &headers,
            body,
            &answer_recorder,
            every,
        )
        .await
    };
    let answered = match every {
        None => answering.await,
        Some(every) => {
            let errors = keepalive::ErrorEvents::Runs;
            keepalive::answer_or_keep_alive(answering, every, errors, &recorder).await
        }
    };
    match answered {
        Ok(response) => {
            recorder.responded(response.status().as_u16());
            response
        }
        Err(e) => {
            recorder.failed(e.reason, e.status.as_u16());
            HttpError(e).into_response()
        }
    }
}

async fn handle(
    edge: &Arc<Edge>,
    large: &Arc<LargeBodies>,
    caller: &Caller,
    headers: &HeaderMap,
    body: Request,
    recorder: &RequestRecorder,
    keep_alive: Option<std::time::Duration>,
) -> Result<Response, ApiError> {
    let key = caller.key_name().unwrap_or("");
    let body = large.read(edge, key, body, headers, false).await?;
    // A large body's place in its key's share is held until the run has started.
    let (runs::RunRequest { node, mut spec }, _turn) =
        large.work(body, key, |body| runs::decode(&body)).await?;
    let node = edge.pick_node(node.as_deref())?.node_id.clone();
    let input = spec.input.len() + spec.messages.iter().map(|m| m.content.len()).sum::<usize>();
    let estimate = TokenEstimate {
        input: (input as u64).div_ceil(4),
        max_output: spec
            .options
            .as_ref()
            .and_then(|o| o.max_tokens)
            .map(u64::from),
    };
    let target = AdmitTarget::Run {
        node: &node,
        adapter: &spec.adapter,
        target: &spec.target,
    };
    edge.admit(caller, target, estimate, recorder).await?;
    spec.session_id = caller.scoped_session_id(&spec.session_id);
    let ctx = RequestContext {
        api_key: caller.owner(),
        client_request_id: request_id::of(headers).to_string(),
        provider_headers: forward::provider_headers(headers, &edge.config().http),
        recorder: recorder.clone(),
    };
    let run = edge.serve_run(&node, spec, &ctx).await?;
    let run_id = run.core.id.clone();
    let body = stream::unfold(run, move |mut run| async move {
        // A silent run (a CLI agent thinking) is kept alive as a waiting one is. Reading
        // the next event is cancel-safe: a keepalive in between loses nothing.
        let next = match keep_alive {
            None => run.next().await,
            Some(every) => match tokio::time::timeout(every, run.next()).await {
                Ok(next) => next,
                Err(_) => return Some((Ok(Bytes::from_static(keepalive::KEEPALIVE)), run)),
            },
        };
        let event = next?;
        Some((
            Ok::<_, std::io::Error>(Bytes::from(runs::sse_event(&event))),
            run,
        ))
    });
    let mut response = (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response();
    let headers = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&run_id) {
        headers.insert("x-iop-run-id", v);
    }
    if let Ok(v) = HeaderValue::from_str(&node) {
        headers.insert("x-iop-node", v);
    }
    Ok(response)
}

async fn cancel(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    Path(run_id): Path<String>,
) -> Result<Response, HttpError> {
    edge.cancel_run(&run_id, &caller).await?;
    Ok(axum::Json(json!({"run_id": run_id, "cancelled": true})).into_response())
}

async fn terminate_session(
    State(edge): State<Arc<Edge>>,
    Extension(caller): Extension<Caller>,
    Path((node, adapter, target, session_id)): Path<(String, String, String, String)>,
) -> Result<Response, HttpError> {
    let scoped = caller.scoped_session_id(&session_id);
    edge.terminate_session(&node, &adapter, &target, &scoped)
        .await?;
    Ok(axum::Json(json!({
        "node": node, "adapter": adapter, "target": target, "session_id": session_id, "terminated": true
    }))
    .into_response())
}
