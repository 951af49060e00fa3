//! The one way an HTTP surface reaches a model group: wait for a slot on a live member
//! (the group's admission and queue), have the surface build the request that member's
//! provider kind takes — a tunnelled HTTP request or a normalized run — and send it with
//! the client's request id and the headers forwarded to providers ([`super::forward`]).
//! The returned stream holds the slot until it ends; dropping it early cancels the work
//! on the node. Usage is attributed to the group, node, provider and API key.
//!
//! The OpenAI and Ollama surfaces both come through here, so what decides and dispatches
//! (member choice, failover, capacity) can change in one place.

use std::sync::Arc;

use axum::http::{HeaderMap, StatusCode};

use super::error::ApiError;
use super::{forward, request_id};
use crate::auth::Caller;
use crate::config::{ProviderConfig, ProviderKind};
use crate::key_limits::LimitExceeded;
use crate::lease::Lane;
use crate::ledger::RequestRecorder;
use crate::service::{Edge, Observe, RunSpec, RunStream, TunnelSpec, TunnelStream};

/// Which group a request is for, and who asks.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub group: &'a str,
    pub lane: Lane,
    pub caller: &'a Caller,
    /// The client's request headers (after the request-id middleware).
    pub headers: &'a HeaderMap,
    /// The request's record in the usage ledger.
    pub recorder: &'a RequestRecorder,
}

/// The member a slot was granted on.
#[derive(Debug, Clone, Copy)]
pub struct Member<'a> {
    /// The node the provider is on.
    pub node: &'a str,
    pub provider: &'a ProviderConfig,
    /// The model name the provider knows.
    pub upstream_model: &'a str,
}

/// What to send to the granted member.
#[derive(Debug)]
pub enum Work {
    Tunnel(TunnelSpec),
    Run(RunSpec),
}

/// The work in flight.
#[derive(Debug)]
pub enum Started {
    Tunnel(TunnelStream),
    Run(RunStream),
}

#[derive(Debug)]
pub struct Dispatched {
    pub started: Started,
    /// The kind of the provider that serves it.
    pub kind: ProviderKind,
}

impl Started {
    /// `tunnel` or `run`, as metrics and usage events name the path.
    pub fn path(&self) -> &'static str {
        match self {
            Started::Tunnel(_) => "tunnel",
            Started::Run(_) => "run",
        }
    }
}

/// Admits the request to `target.group` and sends what `build` makes for the granted
/// member. The key's limits are asked first, before a slot is taken (a concurrency place
/// is held by the request's recorder until the request ends). `build` may refuse the
/// member (e.g. an operation its kind cannot serve); the slot is then returned.
pub async fn dispatch(
    edge: &Arc<Edge>,
    target: Target<'_>,
    mut build: impl FnMut(Member<'_>) -> Result<Work, ApiError>,
) -> Result<Dispatched, ApiError> {
    target.recorder.set_group(target.group);
    if let Some(permit) = edge
        .admit_key(target.caller)
        .map_err(|e| over_limit(target.caller, e))?
    {
        target.recorder.hold(Box::new(permit));
    }
    let (admitted, session) = edge.admit_group(target.group, target.lane).await?;
    let grant = admitted.grant.clone();
    let provider = edge.provider(&grant.node, &grant.provider).ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "model_unavailable",
            format!(
                "provider {}/{} was removed from the configuration",
                grant.node, grant.provider
            ),
        )
    })?;
    let work = build(Member {
        node: &grant.node,
        provider: &provider,
        upstream_model: &grant.upstream_model,
    })?;
    let observe = Observe {
        model_group: target.group.to_string(),
        node_id: grant.node.to_string(),
        provider_id: grant.provider.to_string(),
        api_key: target.caller.owner(),
        recorder: Some(target.recorder.clone()),
    };
    let client_request_id = request_id::of(target.headers).to_string();
    let forwarded = forward::provider_headers(target.headers, &edge.config().http);
    tracing::debug!(
        model_group = target.group,
        node_id = %grant.node,
        provider_id = %grant.provider,
        "dispatching"
    );
    let path = match &work {
        Work::Tunnel(_) => "tunnel",
        Work::Run(_) => "run",
    };
    target
        .recorder
        .dispatched(&grant.node, &grant.provider, path);
    let started = match work {
        Work::Tunnel(mut spec) => {
            spec.client_request_id = client_request_id;
            spec.headers.extend(forwarded);
            Started::Tunnel(
                edge.start_tunnel(session, spec, Some(admitted.guard), Some(observe))
                    .await?,
            )
        }
        Work::Run(mut spec) => {
            spec.client_request_id = client_request_id;
            spec.provider_headers.extend(forwarded);
            if spec.owner.is_none() {
                spec.owner = target.caller.owner();
            }
            Started::Run(
                edge.start_run(session, spec, Some(admitted.guard), Some(observe))
                    .await?,
            )
        }
    };
    Ok(Dispatched {
        started,
        kind: provider.kind,
    })
}

/// The 429 for a request over one of its key's limits, naming the limit.
fn over_limit(caller: &Caller, exceeded: LimitExceeded) -> ApiError {
    let key = caller.key_name().unwrap_or_default();
    ApiError {
        retry_after: Some(exceeded.retry_after_secs()),
        ..ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            exceeded.limit.code(),
            format!(
                "API key `{key}` is over its limit of {}; retry in {} s",
                exceeded.limit.describe(),
                exceeded.retry_after_secs()
            ),
        )
    }
}
