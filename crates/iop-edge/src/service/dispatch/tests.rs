use std::time::Duration;

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
        assert_eq!(decide(code, false, 1, 3), want, "{code:?}");
    }
    // Never more than max_attempts.
    assert_eq!(
        decide(NodeDisconnected, false, 2, 3),
        Decision::Retry { exclude: true }
    );
    assert_eq!(decide(NodeDisconnected, false, 3, 3), Decision::Return);
    assert_eq!(decide(NodeCapacity, false, 1, 1), Decision::Return);
    // Once the node accepted the request, only a provider that provably did nothing is
    // tried elsewhere: losing the node (or its acknowledgement) is the request's end.
    for code in [NodeDisconnected, NodeTimeout] {
        assert_eq!(decide(code, true, 1, 3), Decision::Return, "{code:?}");
    }
    for code in [ProviderUnreachable, ProviderRateLimited, ProviderOverloaded] {
        assert_eq!(
            decide(code, true, 1, 3),
            Decision::Retry { exclude: true },
            "{code:?}"
        );
    }
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
    edge.dispatcher.admission.node_ready("a", Generation(1));
    edge.dispatcher.admission.node_ready("b", Generation(2));
    let ejected = |node: &str| {
        edge.dispatcher.admission.inspect(|s| {
            let account = s.leases().account(&ProviderKey::new(node, "p")).unwrap();
            s.health_view(account, clock()).ejected_until.is_some()
        })
    };
    let of_b = AttemptOf {
        node: "b".into(),
        provider: "p".into(),
        caller: "k".into(),
    };
    // Refusals that say nothing about the provider never eject it...
    for code in [
        ErrorCode::ProviderRateLimited,
        ErrorCode::NodeDisconnected,
        ErrorCode::ClientAbort,
    ] {
        for _ in 0..5 {
            edge.attempt_finished(&of_b, Some(code), None);
        }
    }
    assert!(!ejected("b"));
    // ...and a success in between resets the count.
    edge.attempt_finished(&of_b, Some(ErrorCode::ProviderUnreachable), None);
    edge.attempt_finished(&of_b, Some(ErrorCode::ProviderUnreachable), None);
    edge.attempt_finished(&of_b, None, None);
    edge.attempt_finished(&of_b, Some(ErrorCode::ProviderUnreachable), None);
    assert!(!ejected("b"));
    // Three provider failures in a row (the default) eject it.
    edge.attempt_finished(&of_b, Some(ErrorCode::ProviderOverloaded), None);
    edge.attempt_finished(&of_b, Some(ErrorCode::BrokenStream), None);
    assert!(ejected("b"));
    assert!(!ejected("a"));
}
