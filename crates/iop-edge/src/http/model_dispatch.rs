//! The one way an HTTP surface reaches a model group: the surface says what to send to a
//! member in the shape that member's provider takes — a tunnelled HTTP request or a
//! normalized run — and the service's dispatcher ([`Edge::dispatch`]) does the rest:
//! admission and queue, the member choice, failover before the first byte, metrics. This
//! layer adds the client's request id and the headers forwarded to providers
//! ([`super::forward`]) and hands the surface a stream read from its start. The stream
//! holds the slot until it ends; dropping it early cancels the work on the node. Usage is
//! attributed to the group, node, provider and API key.
//!
//! The OpenAI, Responses, Anthropic Messages and Ollama surfaces all come through here.

use std::sync::{Arc, Mutex};

use axum::http::{HeaderMap, StatusCode};

use super::error::ApiError;
use super::{forward, request_id};
use crate::auth::Caller;
use crate::config::ProviderKind;
use crate::key_limits::LimitExceeded;
use crate::ledger::RequestRecorder;
use crate::service::run::SubmitError;
use crate::service::{Edge, GroupRequest, MemberRequest, RunStream, Served, TunnelStream};

pub use crate::service::{LaneEstimate, LaneInputs, Member, Work};

/// Which group a request is for, and who asks.
#[derive(Clone, Copy)]
pub struct Target<'a> {
    pub group: &'a str,
    /// What the lane estimate reads (prompt characters, max tokens), asked only for a
    /// group with a long-context threshold.
    pub lane: LaneEstimate<'a>,
    pub caller: &'a Caller,
    /// The client's request headers (after the request-id middleware).
    pub headers: &'a HeaderMap,
    /// The request's record in the usage ledger.
    pub recorder: &'a RequestRecorder,
}

/// The work in flight, read from its start (the head or first event the dispatcher
/// waited for comes again first).
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
    /// Attempts it took (1 when the first member served it).
    pub attempts: u32,
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

/// A surface's builder as the dispatcher's [`MemberRequest`]; a refusal keeps the
/// surface's own error, so the client gets it as the surface made it.
struct Builder<F> {
    build: F,
    refusal: Mutex<Option<ApiError>>,
}

impl<F> MemberRequest for Builder<F>
where
    F: Fn(Member<'_>) -> Result<Work, ApiError> + Sync,
{
    fn work(&self, member: Member<'_>) -> Result<Work, SubmitError> {
        // Only the last attempt's refusal can be the request's error.
        *self.refusal.lock().expect("refusal lock") = None;
        (self.build)(member).map_err(|e| {
            let error = SubmitError::Failed {
                code: e.reason,
                message: e.message.clone(),
            };
            *self.refusal.lock().expect("refusal lock") = Some(e);
            error
        })
    }
}

/// Sends the request to a member of `target.group`: `build` makes what the granted
/// member takes, or refuses it (e.g. an operation its provider cannot serve). Errors are
/// the surface's shape-neutral [`ApiError`], with the attempts made. The key's limits
/// are asked first, before a slot is taken (a concurrency place is held by the request's
/// recorder until the request ends).
pub async fn dispatch(
    edge: &Arc<Edge>,
    target: Target<'_>,
    build: impl Fn(Member<'_>) -> Result<Work, ApiError> + Sync,
) -> Result<Dispatched, ApiError> {
    target.recorder.set_group(target.group);
    if let Some(permit) = edge
        .admit_key(target.caller)
        .map_err(|e| over_limit(target.caller, e))?
    {
        target.recorder.hold(Box::new(permit));
    }
    let builder = Builder {
        build,
        refusal: Mutex::new(None),
    };
    let request = GroupRequest {
        group: target.group,
        lane: target.lane,
        api_key: target.caller.owner(),
        client_request_id: request_id::of(target.headers).to_string(),
        provider_headers: forward::provider_headers(target.headers, &edge.config().http),
        body: &builder,
        recorder: Some(target.recorder.clone()),
    };
    tracing::debug!(model_group = target.group, "dispatching");
    let dispatched = match edge.dispatch(request).await {
        Ok(dispatched) => dispatched,
        Err(failure) => {
            let refused = builder.refusal.lock().expect("refusal lock").take();
            let error = refused.unwrap_or_else(|| ApiError::from(failure.error));
            // The dispatcher's meter counted the request.
            return Err(error.with_attempts(failure.attempts).metered());
        }
    };
    let started = match dispatched.served {
        Served::Tunnel { head, mut stream } => {
            stream.replay_head(head);
            Started::Tunnel(stream)
        }
        Served::Run { first, mut stream } => {
            stream.replay_first(first);
            Started::Run(stream)
        }
    };
    Ok(Dispatched {
        started,
        kind: dispatched.kind,
        attempts: dispatched.attempts,
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
