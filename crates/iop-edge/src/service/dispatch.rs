//! Model-group dispatch: one request for a model group in (from any API surface: OpenAI,
//! Responses, Anthropic Messages, Ollama), a response stream (a provider tunnel or a run to
//! render) out, with the number of attempts it took.
//!
//! For each attempt: estimate the lane, wait for a slot on a member ([`Target::Group`]),
//! send what the surface builds for that member ([`MemberRequest::work`]: a tunnelled HTTP
//! request or a run, by the member's provider), and wait for the response to begin — the tunnel's head, the run's first event.
//! A failure before that, that the reason table calls retryable (the node's gate was full,
//! its link dropped, it never acknowledged, the provider was unreachable or answered 429 /
//! 503), is tried again on another member: at most `dispatch.max_attempts` attempts, within
//! the retry budget, after a short jittered backoff, never on a member (under the same
//! generation) that already failed it — except a full gate, which only sends the request
//! back to the queue. Nothing is retried once the response began: the client may have
//! bytes, the provider may be spending tokens.
//!
//! Members whose provider is probed unhealthy or ejected are not chosen while the group has
//! another (the scheduler's rule), and every attempt's outcome goes through
//! [`Edge::attempt_finished`] into passive ejection: a member that keeps failing attempts,
//! here or in its stream, leaves rotation.
//!
//! The request's metrics are counted here or, once a response is returned, by its stream
//! when it ends.

use std::sync::Arc;
use std::time::Duration;

use iop_proto::{ErrorCode, pb};

use super::admission::{AdmitError, Admitted, Target, clock};
use super::run::{RunSpec, RunStream, SubmitError};
use super::stream::{RequestMeter, StreamLimits};
use super::tunnel::{TunnelHead, TunnelSpec, TunnelStream};
use super::{Edge, Observe};
use crate::config::{ProviderConfig, ProviderKind};
use crate::ejection::ProviderOutcome;
use crate::lease::Lane;
use crate::ledger::RequestRecorder;
use crate::queue::Exclusion;

/// What the lane estimate reads of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaneInputs {
    /// Characters of the prompt: every message's text (chat), the prompt, or the input.
    pub prompt_chars: u64,
    /// `max_completion_tokens`, else `max_tokens`, else 0.
    pub max_tokens: u64,
}

/// Cheap context estimate deciding the lane: characters of the prompt / 4 (about one token
/// per four characters of English) plus the requested `max_tokens`.
pub fn estimate_context_tokens(inputs: LaneInputs) -> u64 {
    inputs
        .prompt_chars
        .div_ceil(4)
        .saturating_add(inputs.max_tokens)
}

/// What the lane estimate reads of a request, computed only when the group has a
/// long-context threshold (most have none, and the estimate walks the whole prompt).
pub type LaneEstimate<'a> = &'a (dyn Fn() -> LaneInputs + Sync);

/// The lane a request needs in a group whose long-context threshold is `threshold`;
/// `inputs` is called only when there is one.
pub fn lane_for(threshold: Option<u64>, inputs: impl FnOnce() -> LaneInputs) -> Lane {
    match threshold {
        Some(t) if estimate_context_tokens(inputs()) >= t => Lane::Long,
        _ => Lane::Normal,
    }
}

/// The member an attempt was granted, as the surface needs it to build the request.
#[derive(Debug, Clone, Copy)]
pub struct Member<'a> {
    /// The node the provider is on.
    pub node: &'a str,
    pub provider: &'a ProviderConfig,
    /// The model name the provider knows.
    pub upstream_model: &'a str,
}

/// What an attempt sends to its member.
#[derive(Debug)]
pub enum Work {
    /// An HTTP request through the node's raw tunnel (the provider's answer passes through).
    Tunnel(TunnelSpec),
    /// A normalized run whose events the surface renders.
    Run(RunSpec),
}

/// How a client request is sent to the member that got it, decided per attempt once the
/// grant names the member. The HTTP surface implements it over the body it parsed, so the
/// body is rewritten once per attempt and never re-parsed.
pub trait MemberRequest: Sync {
    /// The request for `member`, or why that member cannot serve it (an operation or API
    /// its provider lacks): not retried elsewhere, the client gets that error.
    fn work(&self, member: Member<'_>) -> Result<Work, SubmitError>;
}

/// A parsed, validated request for a model group.
pub struct GroupRequest<'a> {
    /// The model group (`model`).
    pub group: &'a str,
    pub lane: LaneEstimate<'a>,
    /// The name of the API key that sent it.
    pub api_key: Option<String>,
    /// The client's request id (`x-request-id`): in the node's logs, and sent to providers
    /// within `provider_headers`.
    pub client_request_id: String,
    /// Headers every provider request of this request carries (request id, trace context,
    /// `http.forward_headers`).
    pub provider_headers: Vec<pb::Header>,
    pub body: &'a dyn MemberRequest,
    /// The request's record in the usage ledger: told each attempt, the first token and
    /// the end, with the metrics.
    pub recorder: Option<RequestRecorder>,
}

/// A response that began.
#[derive(Debug)]
pub enum Served {
    /// The provider's own response: its head, then its body from the stream.
    Tunnel {
        head: TunnelHead,
        stream: TunnelStream,
    },
    /// A run whose first event came; the rest is rendered from the stream.
    Run {
        first: pb::RunEvent,
        stream: RunStream,
    },
}

#[derive(Debug)]
pub struct Dispatched {
    pub served: Served,
    /// The kind of the provider that serves it.
    pub kind: ProviderKind,
    /// Attempts it took (1 when the first member served it).
    pub attempts: u32,
}

#[derive(Debug)]
pub struct DispatchFailure {
    pub error: SubmitError,
    /// Attempts made (0 when it never got a slot).
    pub attempts: u32,
}

/// What to do after an attempt failed before its response began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Give the client this attempt's answer.
    Return,
    /// Try again; `exclude`: not on the member (under its generation) that failed.
    Retry { exclude: bool },
}

/// The retry decision for an attempt that failed with `code` before its response began,
/// after `attempts` attempts of at most `max_attempts` (the budget is checked after).
pub fn decide(code: ErrorCode, attempts: u32, max_attempts: u32) -> Decision {
    if !code.retryable() || attempts >= max_attempts {
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

/// Attempts at a grant whose node changed generation between grant and send.
const STALE_GRANT_RETRIES: usize = 3;

enum Attempt {
    /// The response began.
    Served(Served),
    /// The provider's head is a refusal worth retrying elsewhere (429, 503); relayed as
    /// it is if there is no retry.
    Refused { served: Served, code: ErrorCode },
    /// It failed before any response.
    Failed(SubmitError),
}

impl Edge {
    /// Where every attempt's outcome ends up, once per attempt: a failure before the
    /// response began (from the dispatcher), or the end of a stream (from the stream).
    /// `failure` is `None` for a response that ended cleanly with a success status;
    /// `provider_status` is the status the provider answered, if it did. It feeds passive
    /// ejection ([`Edge::report_provider_outcome`]).
    pub(crate) fn attempt_finished(
        &self,
        node: &str,
        provider: &str,
        failure: Option<ErrorCode>,
        provider_status: Option<u32>,
    ) {
        let outcome = ProviderOutcome::of(failure, provider_status);
        if let ProviderOutcome::Failure { reason } = &outcome {
            tracing::debug!(
                node_id = node,
                provider,
                reason,
                "attempt failed at the provider"
            );
        }
        self.report_provider_outcome(node, provider, outcome, clock());
    }

    /// Dispatches one OpenAI request to a member of its model group, retrying before the
    /// response began as the module doc says.
    pub async fn dispatch(
        self: &Arc<Self>,
        request: GroupRequest<'_>,
    ) -> Result<Dispatched, DispatchFailure> {
        let group = request.group;
        let mut meter = RequestMeter::new(self.clone(), group, request.recorder.clone());
        let Some(policy) = self.admission.policy(group) else {
            let error = SubmitError::from(AdmitError::UnknownGroup(group.to_string()));
            meter.finish(Some(error.code()));
            return Err(DispatchFailure { error, attempts: 0 });
        };
        let lane = lane_for(policy.long_context_tokens, request.lane);
        let settings = self.config().dispatch.clone();
        let started = clock();
        // Retries wait in the queue only for what is left of the group's timeout.
        let queue_until = started + policy.timeout;
        self.retry_budget.lock().record_request(started);
        let mut exclude: Vec<Exclusion> = Vec::new();
        let mut attempts = 0u32;
        let mut last: Option<SubmitError> = None;
        let mut stale = 0;
        loop {
            let admitted = match self
                .admission
                .acquire(Target::Group(group), lane, &exclude, Some(queue_until))
                .await
            {
                Ok(admitted) => admitted,
                Err(err) => {
                    let error = match (err, last.take()) {
                        // Every member failed this request, or no other became free in
                        // time: its last failure says why.
                        (
                            AdmitError::Exhausted { .. } | AdmitError::Timeout { .. },
                            Some(previous),
                        ) => previous,
                        (err, _) => err.into(),
                    };
                    meter.finish(Some(error.code()));
                    return Err(DispatchFailure { error, attempts });
                }
            };
            meter.queue_wait(admitted.waited);
            let session = match self.session(&admitted.grant.node) {
                Some(s) if s.generation == admitted.grant.generation => s,
                // The node's connection changed under the grant: its lease was fenced
                // already, so dropping it is a no-op. Try again.
                _ if stale < STALE_GRANT_RETRIES => {
                    stale += 1;
                    continue;
                }
                _ => {
                    let error = SubmitError::from(AdmitError::Unavailable {
                        group: group.to_string(),
                        reason: "its nodes keep reconnecting".into(),
                    });
                    meter.finish(Some(error.code()));
                    return Err(DispatchFailure { error, attempts });
                }
            };
            attempts += 1;
            let exclusion = admitted.grant.exclusion();
            let kind = admitted.grant.traits.kind;
            let path = if admitted.grant.traits.kind.is_tunnel() {
                "tunnel"
            } else {
                "run"
            };
            meter.set_path(path);
            let (code, refused) = match self
                .attempt(session, admitted, &request, settings.ack_timeout())
                .await
            {
                Attempt::Served(served) => {
                    return Ok(self.served(served, meter, attempts, kind));
                }
                Attempt::Refused { served, code } => (code, Some(served)),
                Attempt::Failed(error) => {
                    let code = error.code();
                    last = Some(error);
                    (code, None)
                }
            };
            let decision = match decide(code, attempts, settings.max_attempts) {
                Decision::Retry { .. } if !self.retry_budget.lock().try_retry(clock()) => {
                    tracing::warn!(
                        model_group = group,
                        code = code.as_str(),
                        "retry budget spent: not retrying"
                    );
                    Decision::Return
                }
                decision => decision,
            };
            match (decision, refused) {
                (Decision::Return, Some(served)) => {
                    return Ok(self.served(served, meter, attempts, kind));
                }
                (Decision::Return, None) => {
                    let error = last.take().expect("a failed attempt");
                    meter.finish(Some(code));
                    return Err(DispatchFailure { error, attempts });
                }
                (Decision::Retry { exclude: excluding }, refused) => {
                    if let Some(served) = refused {
                        give_up(served, code);
                        last = Some(SubmitError::Failed {
                            code,
                            message: format!(
                                "the provider of node {} answered {} ({})",
                                exclusion.key.node,
                                code.status(),
                                code.as_str()
                            ),
                        });
                    }
                    tracing::info!(
                        model_group = group,
                        node_id = %exclusion.key.node,
                        provider = %exclusion.key.provider,
                        code = code.as_str(),
                        attempt = attempts,
                        "attempt failed before the response began: retrying"
                    );
                    if excluding {
                        exclude.push(exclusion);
                    }
                    tokio::time::sleep(backoff(attempts, rand::random::<f64>())).await;
                }
            }
        }
    }

    /// A response that began: its stream takes over the request's metrics.
    fn served(
        &self,
        served: Served,
        meter: RequestMeter,
        attempts: u32,
        kind: ProviderKind,
    ) -> Dispatched {
        let served = match served {
            Served::Tunnel { head, mut stream } => {
                stream.set_meter(meter);
                Served::Tunnel { head, stream }
            }
            Served::Run { first, mut stream } => {
                stream.set_meter(meter);
                Served::Run { first, stream }
            }
        };
        Dispatched {
            served,
            kind,
            attempts,
        }
    }

    /// One attempt on the member `admitted` names.
    async fn attempt(
        self: &Arc<Self>,
        session: Arc<crate::session::NodeSession>,
        admitted: Admitted,
        request: &GroupRequest<'_>,
        ack_timeout: Duration,
    ) -> Attempt {
        let Admitted { grant, guard, .. } = admitted;
        let observe = Observe {
            model_group: request.group.to_string(),
            node_id: grant.node.to_string(),
            provider_id: grant.provider.to_string(),
            api_key: request.api_key.clone(),
            recorder: request.recorder.clone(),
        };
        let limits = StreamLimits {
            ack_timeout,
            idle_timeout: grant.traits.idle_timeout,
        };
        let not_sent = |edge: &Edge, error: SubmitError| {
            edge.attempt_finished(&grant.node, &grant.provider, Some(error.code()), None);
            Attempt::Failed(error)
        };
        let Some(provider) = self.provider(&grant.node, &grant.provider) else {
            drop(guard);
            return Attempt::Failed(SubmitError::from(AdmitError::Unavailable {
                group: request.group.to_string(),
                reason: format!(
                    "provider {}/{} was removed from the configuration",
                    grant.node, grant.provider
                ),
            }));
        };
        let work = request.body.work(Member {
            node: &grant.node,
            provider: &provider,
            upstream_model: &grant.upstream_model,
        });
        if let (Some(recorder), Ok(work)) = (&request.recorder, &work) {
            let path = match work {
                Work::Tunnel(_) => "tunnel",
                Work::Run(_) => "run",
            };
            recorder.dispatched(&grant.node, &grant.provider, path);
        }
        let mut spec = match work {
            Err(error) => {
                // This member cannot serve the request: nothing was sent.
                drop(guard);
                return Attempt::Failed(error);
            }
            Ok(Work::Tunnel(mut spec)) => {
                spec.client_request_id = request.client_request_id.clone();
                spec.headers
                    .extend(request.provider_headers.iter().cloned());
                let mut stream = match self
                    .start_tunnel(session, spec, Some(guard), Some(observe), limits)
                    .await
                {
                    Ok(stream) => stream,
                    Err(error) => return not_sent(self, error),
                };
                return match stream.head().await {
                    Ok(head) => {
                        let refusal = ErrorCode::from_provider_status(head.status as u16)
                            .filter(|code| code.retryable());
                        let served = Served::Tunnel { head, stream };
                        match refusal {
                            Some(code) => Attempt::Refused { served, code },
                            None => Attempt::Served(served),
                        }
                    }
                    Err(e) => Attempt::Failed(SubmitError::Failed {
                        code: e.error_code(),
                        message: e.message,
                    }),
                };
            }
            Ok(Work::Run(spec)) => spec,
        };
        spec.client_request_id = request.client_request_id.clone();
        spec.provider_headers
            .extend(request.provider_headers.iter().cloned());
        if spec.owner.is_none() {
            spec.owner = request.api_key.clone();
        }
        let mut stream = match self
            .start_run(session, spec, Some(guard), Some(observe), limits)
            .await
        {
            Ok(stream) => stream,
            Err(error) => return not_sent(self, error),
        };
        match stream.next().await {
            Some(e) if e.kind() == pb::RunEventKind::Error => {
                Attempt::Failed(SubmitError::of_run_error(e.error.as_ref()))
            }
            Some(e) if e.kind() == pb::RunEventKind::Cancelled => {
                Attempt::Failed(SubmitError::Failed {
                    code: ErrorCode::Cancelled,
                    message: "the run was cancelled".into(),
                })
            }
            Some(first) => Attempt::Served(Served::Run { first, stream }),
            None => Attempt::Failed(SubmitError::Failed {
                code: ErrorCode::ProviderError,
                message: "the run ended without events".into(),
            }),
        }
    }
}

/// Drops a response the dispatcher will not relay, recording why.
fn give_up(served: Served, code: ErrorCode) {
    match served {
        Served::Tunnel { mut stream, .. } => stream.fail(code),
        Served::Run { mut stream, .. } => stream.fail(code),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_retried_and_where() {
        use ErrorCode::*;
        let cases = [
            // Failed before the provider accepted: another member.
            (NodeDisconnected, Decision::Retry { exclude: true }),
            (NodeTimeout, Decision::Retry { exclude: true }),
            (ProviderUnreachable, Decision::Retry { exclude: true }),
            (ProviderRateLimited, Decision::Retry { exclude: true }),
            (ProviderOverloaded, Decision::Retry { exclude: true }),
            (UnknownAdapter, Decision::Retry { exclude: true }),
            (CliSpawn, Decision::Retry { exclude: true }),
            // A full gate: back to the queue, any member (the same one included).
            (NodeCapacity, Decision::Retry { exclude: false }),
            // The provider may have done (or be doing) the work, or the client is at fault.
            (ProviderTimeout, Decision::Return),
            (ProviderIdleTimeout, Decision::Return),
            (ProviderError, Decision::Return),
            (BrokenStream, Decision::Return),
            (BadRequest, Decision::Return),
            (UnknownTarget, Decision::Return),
            (Cancelled, Decision::Return),
            (QueueTimeout, Decision::Return),
        ];
        for (code, want) in cases {
            assert_eq!(decide(code, 1, 3), want, "{code:?}");
        }
        // Never more than max_attempts.
        assert_eq!(
            decide(NodeDisconnected, 2, 3),
            Decision::Retry { exclude: true }
        );
        assert_eq!(decide(NodeDisconnected, 3, 3), Decision::Return);
        assert_eq!(decide(NodeCapacity, 1, 1), Decision::Return);
    }

    #[test]
    fn backoff_grows_is_jittered_and_capped() {
        assert_eq!(backoff(1, 0.0), Duration::from_micros(12_500));
        assert_eq!(backoff(1, 1.0), Duration::from_millis(25));
        assert_eq!(backoff(2, 0.0), Duration::from_millis(25));
        for retry in 1..100 {
            for jitter in [0.0, 0.5, 0.999] {
                let wait = backoff(retry, jitter);
                assert!(wait <= Duration::from_secs(1), "{retry} {jitter}");
                assert!(wait >= Duration::from_micros(12_500));
            }
        }
    }

    #[test]
    fn the_lane_follows_the_estimate() {
        let inputs = LaneInputs {
            prompt_chars: 4000,
            max_tokens: 100,
        };
        assert_eq!(estimate_context_tokens(inputs), 1100);
        assert_eq!(lane_for(Some(1100), || inputs), Lane::Long);
        assert_eq!(lane_for(Some(1101), || inputs), Lane::Normal);
        // Without a threshold the prompt is never read.
        assert_eq!(
            lane_for(None, || unreachable!("no threshold, no estimate")),
            Lane::Normal
        );
        let huge = LaneInputs {
            prompt_chars: 4,
            max_tokens: u64::MAX,
        };
        assert_eq!(estimate_context_tokens(huge), u64::MAX);
    }

    #[tokio::test]
    async fn failed_attempts_reach_passive_ejection() {
        use crate::config::EdgeConfig;
        use crate::lease::ProviderKey;
        use crate::registry::Generation;
        let config = EdgeConfig::from_yaml(
            r#"
nodes:
  - {id: a, token: token-a-0123456789ab, providers: [{id: p, kind: mock}]}
  - {id: b, token: token-b-0123456789ab, providers: [{id: p, kind: mock}]}
model_groups:
  - {name: g, members: [{node: a, provider: p}, {node: b, provider: p}]}
"#,
            "test",
        )
        .unwrap();
        let edge = Edge::new(config);
        edge.admission.node_ready("a", Generation(1));
        edge.admission.node_ready("b", Generation(2));
        let ejected = |node: &str| {
            edge.admission.inspect(|s| {
                let account = s.leases().account(&ProviderKey::new(node, "p")).unwrap();
                s.health_view(account, clock()).ejected_until.is_some()
            })
        };
        // Refusals that say nothing about the provider never eject it...
        for code in [
            ErrorCode::ProviderRateLimited,
            ErrorCode::NodeDisconnected,
            ErrorCode::ClientAbort,
        ] {
            for _ in 0..5 {
                edge.attempt_finished("b", "p", Some(code), None);
            }
        }
        assert!(!ejected("b"));
        // ...and a success in between resets the count.
        edge.attempt_finished("b", "p", Some(ErrorCode::ProviderUnreachable), None);
        edge.attempt_finished("b", "p", Some(ErrorCode::ProviderUnreachable), None);
        edge.attempt_finished("b", "p", None, None);
        edge.attempt_finished("b", "p", Some(ErrorCode::ProviderUnreachable), None);
        assert!(!ejected("b"));
        // Three provider failures in a row (the default) eject it.
        edge.attempt_finished("b", "p", Some(ErrorCode::ProviderOverloaded), None);
        edge.attempt_finished("b", "p", Some(ErrorCode::BrokenStream), None);
        assert!(ejected("b"));
        assert!(!ejected("a"));
    }
}
