//! The one pipeline every request passes through, whichever API it came in on:
//!
//! ```text
//! start_request (its record: the one accounting point, fed when it ends)
//!   → admit: the group (or a native run's adapter) exists and the key may use it,
//!            then the key's limits (rate, concurrency, token reservation)
//!   → serve_model: dispatch (member, route, at most one execution) → the answer
//!     serve_run:   the run on its provider's own queue → its events
//! ```
//!
//! A surface only decodes before and renders after; what holds for one request holds
//! for every surface by construction.

use std::sync::Arc;

use iop_proto::ErrorCode;

use super::Edge;
use super::admission::Target;
use super::dispatch::{RequestContext, Served};
use super::errors::SubmitError;
use super::run::RunStream;
use super::stream::{Reports, StreamLimits, StreamTerms};
use crate::auth::Caller;
use crate::canonical::{ApiError, ModelRequest};
use crate::codec::RunSpec;
use crate::key_limits::LimitExceeded;
use crate::lease::{Lane, ProviderKey};
use crate::ledger::RequestRecorder;
use crate::ledger::record::unknown_model_label;

/// What a request asks to be admitted for.
#[derive(Debug, Clone, Copy)]
pub enum AdmitTarget<'a> {
    /// A model group, by the name the client gave (Ollama's `:latest` tag may be left
    /// off); `models_endpoint` is where the client lists the models it may use.
    Model {
        name: &'a str,
        models_endpoint: &'static str,
    },
    /// A native run on `adapter` of `node`, for `target`.
    Run {
        node: &'a str,
        adapter: &'a str,
        target: &'a str,
    },
}

/// What admission needs to reserve tokens for a request.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokenEstimate {
    /// Input tokens estimated from the prompt.
    pub input: u64,
    /// The most output tokens it asks for, if it says.
    pub max_output: Option<u64>,
}

/// The 429 for a request over one of its key's limits, naming the limit.
fn over_limit(caller: &Caller, exceeded: LimitExceeded) -> ApiError {
    let key = caller.key_name().unwrap_or_default();
    let code = match exceeded.limit {
        crate::key_limits::Limit::RequestsPerMinute(_) => ErrorCode::RequestsPerMinuteExceeded,
        crate::key_limits::Limit::TokensPerDay(_) => ErrorCode::TokensPerDayExceeded,
        crate::key_limits::Limit::MaxConcurrent(_) => ErrorCode::MaxConcurrentExceeded,
    };
    ApiError::of(
        code,
        format!(
            "API key `{key}` is over its limit of {}; retry in {} s",
            exceeded.limit.describe(),
            exceeded.retry_after_secs()
        ),
    )
    .with_retry_after(exceeded.retry_after_secs())
}

impl Edge {
    /// The model group `name` resolves to, if `caller` may use it; else the 404 that names
    /// `models_endpoint`, where the client lists the models it may use.
    pub(crate) fn model_group_for(
        &self,
        caller: &Caller,
        name: &str,
        models_endpoint: &str,
    ) -> Result<String, ApiError> {
        let config = self.config();
        config
            .resolve_group(name)
            .filter(|g| caller.may_use_model(&g.name))
            .map(|g| g.name.clone())
            .ok_or_else(|| {
                ApiError::model_not_found(format!(
                    "the model `{name}` does not exist or you do not have access to it; \
                     {models_endpoint} lists the models you can use"
                ))
                .with_param("model")
            })
    }

    /// THE admission point of every request: what it is for must exist and the key may
    /// use it (its model allowlist), then the key's limits. The group (a run's
    /// `node/adapter`; the stand-in of a name no group has) goes on the request's record, and what the limits hold (a
    /// concurrency place, a token reservation) is held by the record until the request
    /// ends. Returns the model group's name (empty for a run).
    pub(crate) async fn admit(
        &self,
        caller: &Caller,
        target: AdmitTarget<'_>,
        estimate: TokenEstimate,
        recorder: &RequestRecorder,
    ) -> Result<String, ApiError> {
        let group = match target {
            AdmitTarget::Model {
                name,
                models_endpoint,
            } => match self.model_group_for(caller, name, models_endpoint) {
                Ok(group) => {
                    recorder.set_group(&group);
                    group
                }
                Err(e) => {
                    recorder.set_group(&unknown_model_label(name));
                    return Err(e);
                }
            },
            AdmitTarget::Run {
                node,
                adapter,
                target,
            } => {
                // A run is recorded under its `node/adapter` (names the config has: what
                // a client chose is recorded only as the stand-in of a name).
                let run_of = format!("{node}/{adapter}");
                if let Err(e) = self.check_run(caller, node, adapter, target) {
                    recorder.set_group(&unknown_model_label(&run_of));
                    return Err(e);
                }
                recorder.set_group(&run_of);
                String::new()
            }
        };
        let reserve = caller.limits().map_or(0, |l| {
            estimate.input + l.reserved_output(estimate.max_output)
        });
        let permit = self
            .keys
            .admit(caller, reserve, estimate.input)
            .await
            .map_err(|e| over_limit(caller, e))?;
        let reserved = permit.as_ref().map_or(0, |p| p.reserved_tokens());
        recorder.admitted(estimate.input, reserved);
        if let Some(permit) = permit {
            recorder.hold(Box::new(permit));
        }
        Ok(group)
    }

    /// Whether a run on `adapter` of `node` for `target` exists and `caller` may start
    /// it: with a model allowlist, only runs a group the key may use reaches — a member
    /// on that node and adapter whose upstream model is the target.
    fn check_run(
        &self,
        caller: &Caller,
        node: &str,
        adapter: &str,
        target: &str,
    ) -> Result<(), ApiError> {
        let config = self.config();
        let Some(provider) = super::provider_of(&config, node, adapter) else {
            let known = config
                .nodes
                .iter()
                .find(|n| n.id == node)
                .map(|n| {
                    let ids: Vec<&str> = n.providers.iter().map(|p| p.id.as_str()).collect();
                    ids.join(", ")
                })
                .unwrap_or_default();
            return Err(SubmitError::UnknownAdapter {
                node: node.to_string(),
                adapter: adapter.to_string(),
                known,
            }
            .into());
        };
        if !provider.enabled {
            return Err(ApiError::of(
                ErrorCode::NotFound,
                format!("adapter `{adapter}` of node `{node}` is disabled in the edge config"),
            )
            .with_detail("unknown_adapter"));
        }
        let Some(models) = caller.allowed_models() else {
            return Ok(());
        };
        let reachable = config
            .model_groups
            .iter()
            .filter(|g| models.contains(&g.name))
            .flat_map(|g| g.members.iter().map(move |m| (g, m)))
            .any(|(g, m)| {
                m.node == node
                    && m.provider == adapter
                    && m.model.as_deref().unwrap_or(&g.name) == target
            });
        if reachable {
            return Ok(());
        }
        Err(ApiError::forbidden(format!(
            "this API key may not run `{target}` on adapter `{adapter}` of node `{node}`: no \
             model group of the key's reaches it (a member on that node and adapter whose \
             upstream model is the target)"
        )))
    }

    /// Serves an admitted model request: a refusal of its translation is the answer when
    /// no member of its group serves its API itself; else it is dispatched.
    pub(crate) async fn serve_model(
        self: &Arc<Self>,
        request: &ModelRequest<'_>,
        ctx: &RequestContext,
    ) -> Result<Served, ApiError> {
        if let Err(refusal) = request.canonical
            && !self
                .dispatcher
                .admission
                .group_serves_natively(request.group, request.native.api)
        {
            return Err(refusal.clone());
        }
        self.dispatch(request, ctx).await
    }

    /// Serves an admitted native run: a slot on its provider (waiting in that provider's
    /// own queue like any request), then the run on its node.
    pub(crate) async fn serve_run(
        self: &Arc<Self>,
        node: &str,
        mut spec: RunSpec,
        ctx: &RequestContext,
    ) -> Result<RunStream, ApiError> {
        let config = self.config();
        let provider = super::provider_of(&config, node, &spec.adapter)
            .ok_or_else(|| SubmitError::NodeNotReady(node.to_string()))?;
        let lane = if provider.capacity.normal > 0 {
            Lane::Normal
        } else {
            Lane::Long
        };
        let key = ProviderKey::new(node, &spec.adapter);
        let limits = StreamLimits {
            ack_timeout: config.dispatch.ack_timeout(),
            idle_timeout: provider.idle_timeout(),
        };
        drop(config);
        let admitted = self
            .dispatcher
            .admission
            .acquire(
                Target::Provider(&key),
                lane,
                &[],
                &crate::routing::Affinity::none(),
                None,
            )
            .await
            .map_err(SubmitError::from)?;
        ctx.recorder.queue_wait(admitted.waited);
        let session = match self.session(node) {
            Some(s) if s.generation == admitted.grant.generation => s,
            _ => return Err(SubmitError::NodeNotReady(node.to_string()).into()),
        };
        spec.client_request_id = ctx.client_request_id.clone();
        spec.provider_headers = ctx.provider_headers.clone();
        spec.owner = ctx.api_key.clone();
        spec.billing = Some(ctx.recorder.billing());
        ctx.recorder.dispatched(node, &spec.adapter, "run");
        let terms = StreamTerms {
            lease: Some(admitted.guard),
            reports: Reports {
                member: None,
                recorder: Some(ctx.recorder.clone()),
            },
            limits,
        };
        Ok(self.start_run(session, spec, terms).await?)
    }
}
