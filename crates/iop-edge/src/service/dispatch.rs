//! Model-group dispatch: one request for a model group in (from any surface), a response
//! that began out — the provider's own answer in the client's API, or canonical answer
//! events to render — with the number of attempts it took.
//!
//! For each attempt: estimate the lane, wait for a slot on a member, decide the route
//! from that member's traits ([`super::route`]), send the tunnel request or run the codecs
//! build for it, and wait for the response to begin — the tunnel's head, the run's first
//! event. A failure before that, that the reason table calls retryable (the node's gate
//! was full, its link dropped, it never acknowledged, the provider was unreachable or
//! answered 429 / 503), is tried again on another member: at most `dispatch.max_attempts`
//! attempts, within the retry budget, after a short jittered backoff, never on a member
//! (under the same generation) that already failed it — except a full gate, which only
//! sends the request back to the queue.
//!
//! At most one execution: once the node accepted the request (its `accepted` frame, or
//! any frame of the response) only a failure that proves the provider did nothing (it
//! was unreachable, it refused with 429 or 503) is retried; losing the node or its
//! acknowledgement after that ends the request with that reason. Nothing is retried once
//! the response began. A retry never moves the group's rotation, and a member that
//! answered 429 cools down for its `Retry-After` before it is chosen again.
//!
//! Members whose provider is probed unhealthy, ejected or cooling down are not chosen
//! while the group has another, and every attempt's outcome goes through
//! `Edge::attempt_finished` into passive ejection.

use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_proto::{ErrorCode, pb};

use super::Edge;
use super::admission::{AdmitError, Admitted, Target, clock};
use super::answer::AnswerSource;
use super::route::{self, Route, Work};
use super::run::RunStream;
use super::stream::{AttemptOf, Reports, StreamLimits, StreamTerms};
use super::tunnel::{TunnelHead, TunnelStream};
use crate::canonical::{ApiError, LaneInputs, ModelRequest};
use crate::ejection::ProviderOutcome;
use crate::lease::{Lane, ProviderKey};
use crate::ledger::RequestRecorder;
use crate::queue::Exclusion;
use crate::routing::Affinity;

/// Cheap context estimate deciding the lane: characters of the prompt / 4 (about one token
/// per four characters of English) plus the requested `max_tokens`.
pub fn estimate_context_tokens(inputs: LaneInputs) -> u64 {
    inputs
        .prompt_chars
        .div_ceil(4)
        .saturating_add(inputs.max_tokens)
}

/// The lane a request needs in a group whose long-context threshold is `threshold`;
/// `inputs` is called only when there is one.
pub fn lane_for(threshold: Option<u64>, inputs: impl FnOnce() -> LaneInputs) -> Lane {
    match threshold {
        Some(t) if estimate_context_tokens(inputs()) >= t => Lane::Long,
        _ => Lane::Normal,
    }
}

/// What every attempt of one request carries.
#[derive(Debug)]
pub struct RequestContext {
    /// The name of the API key that sent it.
    pub api_key: Option<String>,
    /// The client's request id (`x-request-id`): in the node's logs, and sent to providers
    /// within `provider_headers`.
    pub client_request_id: String,
    /// Headers every provider request of this request carries (request id, trace context,
    /// `http.forward_headers`).
    pub provider_headers: Vec<pb::Header>,
    /// The request's record: told each attempt, the queue wait, and (through the stream
    /// that serves it) how it ended.
    pub recorder: RequestRecorder,
}

/// A response that began.
#[derive(Debug)]
pub enum Answer {
    /// The provider's own response in the client's API: its head, then its body.
    Native {
        head: TunnelHead,
        stream: TunnelStream,
    },
    /// The answer as canonical events, for the client's API to render.
    Events(AnswerSource),
}

#[derive(Debug)]
pub struct Served {
    pub answer: Answer,
    /// Attempts it took (1 when the first member served it).
    pub attempts: u32,
    /// When the attempt that served it was sent.
    pub dispatched: Instant,
}

/// What to do after an attempt failed before its response began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Give the client this attempt's answer.
    Return,
    /// Try again; `exclude`: not on the member (under its generation) that failed.
    Retry { exclude: bool },
}

/// The retry decision for an attempt that failed with `code` before its response began
/// (`accepted`: after the node or provider accepted it), after `attempts` attempts of at
/// most `max_attempts` (the budget is checked after).
pub fn decide(code: ErrorCode, accepted: bool, attempts: u32, max_attempts: u32) -> Decision {
    let may_have_run = accepted && !code.refused_before_work();
    if !code.retryable() || may_have_run || attempts >= max_attempts {
        return Decision::Return;
    }
    Decision::Retry {
        // A full gate is no fault of the member: back to the queue, any member.
        exclude: code != ErrorCode::NodeCapacity,
    }
}

/// The wait before retry number `retry` (1 for the first): 25 ms doubling up to 1 s, half
/// of it jittered by `jitter` in [0, 1).
pub fn backoff(retry: u32, jitter: f64) -> Duration {
    let ceiling = Duration::from_millis(25)
        .saturating_mul(1 << retry.saturating_sub(1).min(6))
        .min(Duration::from_secs(1));
    ceiling / 2 + ceiling.mul_f64(jitter.clamp(0.0, 1.0) / 2.0)
}

/// How long a member that answered 429 without a `Retry-After` is left out.
pub const DEFAULT_COOL_DOWN: Duration = Duration::from_secs(2);
/// The longest a provider's `Retry-After` keeps its member out.
pub const MAX_COOL_DOWN: Duration = Duration::from_secs(300);

/// Attempts at a grant whose node changed generation between grant and send.
const STALE_GRANT_RETRIES: usize = 3;

enum Attempt {
    /// The response began.
    Served(Answer),
    /// The provider refused outright (429, 503): relayed as it is if there is no retry.
    Refused {
        answer: Answer,
        code: ErrorCode,
        retry_after: Option<u64>,
    },
    /// It failed before any response; `accepted`: after the node accepted it.
    Failed { error: ApiError, accepted: bool },
}

/// Where one request's attempts stand.
struct Tries {
    /// When waiting in the queue ends (the group's timeout, from the first attempt).
    queue_until: Instant,
    lane: Lane,
    /// Members (under their generation) that failed it.
    exclude: Vec<Exclusion>,
    /// What steers it to a member (session, prompt prefix).
    affinity: Affinity,
    attempts: u32,
    /// The last attempt's failure.
    last: Option<ApiError>,
    /// Grants whose node reconnected before the request was sent.
    stale: usize,
}

/// One attempt's member.
struct Member {
    admitted: Admitted,
    session: Arc<crate::session::NodeSession>,
    route: Route,
}

impl Edge {
    /// Where every attempt's outcome ends up, once per attempt: a failure before the
    /// response began (from the dispatcher), or the end of a stream (from the stream).
    /// `failure` is `None` for a response that ended cleanly with a success status;
    /// `provider_status` is the status the provider answered, if it did. It feeds passive
    /// ejection ([`Edge::report_provider_outcome`]).
    pub(crate) fn attempt_finished(
        &self,
        of: &AttemptOf,
        failure: Option<ErrorCode>,
        provider_status: Option<u32>,
    ) {
        let outcome = ProviderOutcome::of(failure, provider_status, &of.caller);
        if let ProviderOutcome::Failure { reason, .. } = &outcome {
            tracing::debug!(
                node_id = &*of.node,
                provider = &*of.provider,
                reason,
                "attempt failed at the provider"
            );
        }
        self.report_provider_outcome(&of.node, &of.provider, outcome, clock());
    }

    /// Dispatches a request to a member of its model group `request.group`, retrying
    /// before the response began as the module doc says. The error carries the attempts.
    pub(crate) async fn dispatch(
        self: &Arc<Self>,
        request: &ModelRequest<'_>,
        ctx: &RequestContext,
    ) -> Result<Served, ApiError> {
        let group = request.group;
        let Some(policy) = self.dispatcher.admission.policy(group) else {
            return Err(AdmitError::UnknownGroup(group.to_string()).into());
        };
        let lane = lane_for(policy.long_context_tokens, || request.lane_inputs());
        let settings = self.config().dispatch.clone();
        let started = clock();
        self.dispatcher.request_started(started);
        let mut tries = Tries {
            // Retries wait in the queue only for what is left of the group's timeout.
            queue_until: started + policy.timeout,
            lane,
            exclude: Vec::new(),
            affinity: crate::routing::affinity(policy.routing, request),
            attempts: 0,
            last: None,
            stale: 0,
        };
        loop {
            let member = self
                .next_member(request, ctx, &mut tries)
                .await
                .map_err(|e| e.with_attempts(tries.attempts))?;
            let exclusion = member.admitted.grant.exclusion();
            let dispatched = Instant::now();
            let served = |mut answer: Answer, attempts| {
                answer.serve(&ctx.recorder);
                Ok(Served {
                    answer,
                    attempts,
                    dispatched,
                })
            };
            let (code, accepted, refused) = match self
                .attempt(member, request, ctx, settings.ack_timeout())
                .await
            {
                Attempt::Served(answer) => return served(answer, tries.attempts),
                Attempt::Refused {
                    answer,
                    code,
                    retry_after,
                } => {
                    self.cool_down_after_429(&exclusion.key, code, retry_after);
                    (code, true, Some(answer))
                }
                Attempt::Failed { error, accepted } => {
                    let code = error.reason;
                    tries.last = Some(error);
                    (code, accepted, None)
                }
            };
            match (
                self.next_step(group, code, accepted, &tries, &settings),
                refused,
            ) {
                (Decision::Return, Some(answer)) => return served(answer, tries.attempts),
                (Decision::Return, None) => {
                    let error = tries.last.take().expect("a failed attempt");
                    return Err(error.with_attempts(tries.attempts));
                }
                (Decision::Retry { exclude }, refused) => {
                    if let Some(answer) = refused {
                        answer.give_up(code);
                        tries.last = Some(ApiError::of(
                            code,
                            format!(
                                "the provider of node {} answered {}",
                                exclusion.key.node,
                                code.status()
                            ),
                        ));
                    }
                    tracing::info!(model_group = group, node_id = %exclusion.key.node, provider = %exclusion.key.provider, code = code.as_str(), attempt = tries.attempts, "attempt failed before the response began: retrying");
                    if exclude {
                        tries.exclude.push(exclusion);
                    }
                    tokio::time::sleep(backoff(tries.attempts, rand::random::<f64>())).await;
                }
            }
        }
    }

    /// Waits for the next member that may take the request — not one `tries` excludes —
    /// and decides its route; counts the attempt. The error is what the client gets.
    async fn next_member(
        &self,
        request: &ModelRequest<'_>,
        ctx: &RequestContext,
        tries: &mut Tries,
    ) -> Result<Member, ApiError> {
        let group = request.group;
        loop {
            let target = Target::Group(group);
            let acquired = self
                .dispatcher
                .admission
                .acquire(
                    target,
                    tries.lane,
                    &tries.exclude,
                    &tries.affinity,
                    Some(tries.queue_until),
                )
                .await;
            let admitted = match (acquired, tries.last.take()) {
                (Ok(admitted), last) => {
                    tries.last = last;
                    admitted
                }
                // Every member failed this request, or no other became free in time: its
                // last failure says why.
                (
                    Err(AdmitError::Exhausted { .. } | AdmitError::Timeout { .. }),
                    Some(previous),
                ) => return Err(previous),
                (Err(err), _) => return Err(err.into()),
            };
            ctx.recorder.queue_wait(admitted.waited);
            ctx.recorder.routed(admitted.grant.decision);
            self.telemetry
                .metrics
                .group(group)
                .count_route(admitted.grant.decision);
            let session = match self.session(&admitted.grant.node) {
                Some(s) if s.generation == admitted.grant.generation => s,
                // The node's connection changed under the grant: its lease was fenced
                // already, so dropping it is a no-op. Try again.
                _ if tries.stale < STALE_GRANT_RETRIES => {
                    tries.stale += 1;
                    continue;
                }
                _ => {
                    return Err(ApiError::from(AdmitError::Unavailable {
                        group: group.to_string(),
                        reason: "its nodes keep reconnecting".into(),
                    }));
                }
            };
            tries.attempts += 1;
            // A member that cannot serve the request: nothing was sent.
            let route = route::decide(&admitted.grant.traits, request, group)?;
            return Ok(Member {
                admitted,
                session,
                route,
            });
        }
    }

    /// A member whose provider answered 429 cools down for its `Retry-After` (bounded), or
    /// [`DEFAULT_COOL_DOWN`] without one.
    fn cool_down_after_429(&self, key: &ProviderKey, code: ErrorCode, retry_after: Option<u64>) {
        if code == ErrorCode::ProviderRateLimited {
            let wait = retry_after
                .map_or(DEFAULT_COOL_DOWN, Duration::from_secs)
                .min(MAX_COOL_DOWN);
            self.dispatcher.admission.cool_down(key, wait, clock());
        }
    }

    /// [`decide`], then the retry budget: a retry it has no room for is not made.
    fn next_step(
        &self,
        group: &str,
        code: ErrorCode,
        accepted: bool,
        tries: &Tries,
        settings: &crate::config::DispatchConfig,
    ) -> Decision {
        match decide(code, accepted, tries.attempts, settings.max_attempts) {
            Decision::Retry { .. } if !self.dispatcher.try_retry(clock()) => {
                tracing::warn!(
                    model_group = group,
                    code = code.as_str(),
                    "retry budget spent: not retrying"
                );
                Decision::Return
            }
            decision => decision,
        }
    }

    /// One attempt on the member granted.
    async fn attempt(
        self: &Arc<Self>,
        member: Member,
        request: &ModelRequest<'_>,
        ctx: &RequestContext,
        ack_timeout: Duration,
    ) -> Attempt {
        let Member {
            admitted,
            session,
            route,
        } = member;
        let Admitted { grant, guard, .. } = admitted;
        let attempt_of = AttemptOf {
            node: grant.node.clone(),
            provider: grant.provider.clone(),
            caller: ctx.api_key.as_deref().unwrap_or("").into(),
        };
        let terms = StreamTerms {
            lease: Some(guard),
            reports: Reports {
                member: Some(attempt_of.clone()),
                recorder: None,
            },
            limits: StreamLimits {
                ack_timeout,
                idle_timeout: grant.traits.idle_timeout,
            },
        };
        let not_sent = |edge: &Edge, error: super::errors::SubmitError| {
            edge.attempt_finished(&attempt_of, Some(error.code()), None);
            Attempt::Failed {
                error: error.into(),
                accepted: false,
            }
        };
        let work = route::work(
            route,
            request,
            &grant.traits,
            &grant.provider,
            &grant.upstream_model,
        );
        ctx.recorder
            .dispatched(&grant.node, &grant.provider, route.path());
        match work {
            Work::Tunnel(mut spec) => {
                spec.client_request_id = ctx.client_request_id.clone();
                spec.headers.extend(ctx.provider_headers.iter().cloned());
                spec.owner = ctx.api_key.clone().unwrap_or_default();
                spec.billing = Some(ctx.recorder.billing());
                let stream = match self.start_tunnel(session, spec, terms).await {
                    Ok(stream) => stream,
                    Err(error) => return not_sent(self, error),
                };
                self.tunnel_began(stream, route, request).await
            }
            Work::Run(mut spec) => {
                spec.client_request_id = ctx.client_request_id.clone();
                spec.provider_headers
                    .extend(ctx.provider_headers.iter().cloned());
                spec.owner = ctx.api_key.clone();
                spec.billing = Some(ctx.recorder.billing());
                let stream = match self.start_run(session, spec, terms).await {
                    Ok(stream) => stream,
                    Err(error) => return not_sent(self, error),
                };
                run_began(stream).await
            }
        }
    }

    /// Waits for a tunnel's head: the answer that began, a refusal worth retrying, or the
    /// failure before it.
    async fn tunnel_began(
        &self,
        mut stream: TunnelStream,
        route: Route,
        request: &ModelRequest<'_>,
    ) -> Attempt {
        let head = match stream.head().await {
            Ok(head) => head,
            Err(e) => {
                return Attempt::Failed {
                    error: ApiError::from_tunnel_error(&e),
                    accepted: stream.core.acknowledged(),
                };
            }
        };
        let refusal =
            ErrorCode::from_provider_status(head.status as u16).filter(|code| code.retryable());
        let retry_after = head.retry_after();
        let answer = match route {
            Route::Native => Answer::Native { head, stream },
            _ => {
                stream.replay_head(head);
                let max = self.config().limits.http.max_response_bytes;
                Answer::Events(AnswerSource::tunnel(stream, request.op, max))
            }
        };
        match refusal {
            Some(code) => Attempt::Refused {
                answer,
                code,
                retry_after,
            },
            None => Attempt::Served(answer),
        }
    }
}

/// Waits for a run's first event: the answer that began, or the failure before it.
async fn run_began(mut stream: RunStream) -> Attempt {
    let failed = |error: ApiError, stream: &RunStream| Attempt::Failed {
        error,
        accepted: stream.core.acknowledged(),
    };
    match stream.next().await {
        Some(e) if e.kind() == pb::RunEventKind::Error => {
            failed(ApiError::from_run_error(e.error.as_ref()), &stream)
        }
        Some(e) if e.kind() == pb::RunEventKind::Cancelled => failed(
            ApiError::of(ErrorCode::Cancelled, "the run was cancelled"),
            &stream,
        ),
        Some(first) => {
            stream.replay_first(first);
            Attempt::Served(Answer::Events(AnswerSource::run(stream)))
        }
        None => failed(
            ApiError::of(ErrorCode::ProviderError, "the run ended without events"),
            &stream,
        ),
    }
}

impl Answer {
    /// Makes this answer's outcome and usage the client request's.
    fn serve(&mut self, recorder: &RequestRecorder) {
        match self {
            Answer::Native { stream, .. } => stream.serve(recorder.clone()),
            Answer::Events(source) => source.serve(recorder.clone()),
        }
    }

    /// Drops a response the dispatcher will not relay, recording why.
    fn give_up(self, code: ErrorCode) {
        match self {
            Answer::Native { mut stream, .. } => stream.fail(code),
            Answer::Events(source) => source.give_up(code),
        }
    }
}

#[cfg(test)]
mod tests;
