//! Builds the `NodeConfigPayload` a node receives in its `RegisterResponse` from the node's
//! record in the edge config.

use iop_proto::pb;
use prost::Message;
use sha2::{Digest, Sha256};

use crate::config::{HealthConfig, NodeConfig, ProviderConfig};

/// Bytes kept free in a frame around the payload (the rest of the `RegisterResponse`).
const FRAME_MARGIN: usize = 256;

fn provider_spec(p: &ProviderConfig, health: &HealthConfig) -> pb::ProviderSpec {
    let probe = health.probe_settings(p.health.as_ref());
    let ms = |d: std::time::Duration| d.as_millis().clamp(1, u32::MAX as u128) as u32;
    pb::ProviderSpec {
        id: p.id.clone(),
        kind: p.kind.wire() as i32,
        capacity: Some(pb::Capacity {
            normal: p.capacity.normal,
            long: p.capacity.long,
        }),
        max_concurrency: p.max_concurrency(),
        base_url: p.base_url.clone().unwrap_or_default(),
        api_key_env: p.api_key_env.clone().unwrap_or_default(),
        api_key: p.api_key.clone().unwrap_or_default(),
        request_timeout_sec: p.request_timeout_sec.unwrap_or(0),
        stream_head_timeout_sec: p.stream_head_timeout_sec.unwrap_or(0),
        headers: p.headers.clone().into_iter().collect(),
        cli: p.cli.as_ref().map(|c| pb::CliSpec {
            argv: c.argv.clone(),
            env: c.env.clone().into_iter().collect(),
            working_dir: c.working_dir.clone().unwrap_or_default(),
            end_marker: c.end_marker.clone().unwrap_or_default(),
            max_sessions: c.max_sessions.unwrap_or(0),
            session_idle_sec: c.session_idle_sec.unwrap_or(0),
            max_sessions_per_owner: c.max_sessions_per_key.unwrap_or(0),
        }),
        mock: p.mock.as_ref().map(|m| pb::MockSpec {
            tokens: m.tokens.unwrap_or(0),
            token_delay_ms: m.token_delay_ms.unwrap_or(0),
            reasoning: m.reasoning,
            text: m.text.clone().unwrap_or_default(),
        }),
        health: Some(pb::HealthCheckSpec {
            interval_ms: ms(probe.interval),
            timeout_ms: ms(probe.timeout),
            unhealthy_after: probe.unhealthy_after,
            healthy_after: probe.healthy_after,
        }),
    }
}

/// How much longer than the edge's re-attach wait the node keeps a detached stream.
const REATTACH_SLACK: std::time::Duration = std::time::Duration::from_secs(5);

/// The payload for `node` (its providers probed as `health` says, its streams kept going
/// the re-attach wait after a link drops, whole answers kept for clients as long as
/// `dispatch` says), or why it cannot be sent (it would not fit in one
/// frame).
pub fn build_payload(
    node: &NodeConfig,
    health: &HealthConfig,
    max_frame_bytes: usize,
    dispatch: &crate::config::DispatchConfig,
) -> Result<pb::NodeConfigPayload, String> {
    let reattach_wait = dispatch.reattach_wait();
    let providers: Vec<pb::ProviderSpec> = node
        .providers
        .iter()
        .filter(|p| p.enabled)
        .map(|p| provider_spec(p, health))
        .collect();
    let mut payload = pb::NodeConfigPayload {
        node_id: node.id.clone(),
        providers,
        config_version: 0,
        // The node holds a detached stream a little longer than the edge waits, so that a
        // resume the edge sends at the end of its wait still finds it.
        reattach_wait_ms: if reattach_wait.is_zero() {
            0
        } else {
            u32::try_from((reattach_wait + REATTACH_SLACK).as_millis()).unwrap_or(u32::MAX)
        },
        resume_keep_ms: u32::try_from(dispatch.resume_keep().as_millis()).unwrap_or(u32::MAX),
    };
    let digest = Sha256::digest(payload.encode_to_vec());
    payload.config_version = u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"));
    let len = payload.encoded_len();
    if len + FRAME_MARGIN > max_frame_bytes {
        return Err(format!(
            "config payload for node {:?} is {len} bytes, over the {max_frame_bytes}-byte frame limit (max_frame_bytes)",
            node.id
        ));
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EdgeConfig;

    fn config() -> EdgeConfig {
        EdgeConfig::from_yaml(
            r#"
nodes:
  - id: n
    token: node-token-0123456789
    providers:
      - {id: m, kind: mock, mock: {tokens: 3}}
      - {id: off, kind: mock, enabled: false}
      - {id: o, kind: ollama, base_url: "http://127.0.0.1:11434", capacity: {normal: 2, long: 1}}
"#,
            "edge.yaml",
        )
        .unwrap()
    }

    #[test]
    fn payload_carries_enabled_providers() {
        let c = config();
        let p = payload_of(&c, 1 << 20).unwrap();
        assert_eq!(p.node_id, "n");
        let ids: Vec<_> = p.providers.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(ids, ["m", "o"]);
        assert_eq!(p.providers[0].mock.as_ref().unwrap().tokens, 3);
        assert_eq!(p.providers[1].max_concurrency, 3);
        let health = p.providers[1].health.unwrap();
        assert_eq!((health.interval_ms, health.timeout_ms), (5000, 2000));
        assert_ne!(p.config_version, 0);
    }

    #[test]
    fn cli_session_limits_travel_and_unset_ones_travel_as_zero() {
        let yaml = |cli: &str| {
            format!(
                "nodes:\n  - id: n\n    token: node-token-0123456789\n    providers:\n      - {{id: c, kind: cli, cli: {{argv: [\"cat\"]{cli}}}}}\n"
            )
        };
        for (cli, want) in [
            (", max_sessions: 4, session_idle_sec: 30", (4, 30)),
            ("", (0, 0)),
        ] {
            let c = EdgeConfig::from_yaml(&yaml(cli), "edge.yaml").unwrap();
            let p = payload_of(&c, 1 << 20).unwrap();
            let spec = p.providers[0].cli.as_ref().unwrap();
            assert_eq!((spec.max_sessions, spec.session_idle_sec), want, "{cli}");
        }
    }

    /// The payload of `c`'s first node with `max_frame_bytes`, default dispatch settings.
    fn payload_of(c: &EdgeConfig, max_frame_bytes: usize) -> Result<pb::NodeConfigPayload, String> {
        build_payload(
            &c.nodes[0],
            &c.health,
            max_frame_bytes,
            &crate::config::DispatchConfig::default(),
        )
    }

    #[test]
    fn version_changes_with_content() {
        let mut c = config();
        let a = payload_of(&c, 1 << 20).unwrap().config_version;
        c.nodes[0].providers[0].capacity.normal = 9;
        let b = payload_of(&c, 1 << 20).unwrap().config_version;
        assert_ne!(a, b);
    }

    #[test]
    fn an_oversized_payload_fails_to_build() {
        let c = config();
        let err = payload_of(&c, 300).unwrap_err();
        assert!(err.contains("frame limit"), "{err}");
    }
}
