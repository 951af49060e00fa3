//! Config parsing and validation errors, each naming its YAML path.
use super::*;

fn parse(yaml: &str) -> Result<EdgeConfig, ConfigError> {
    EdgeConfig::from_yaml(yaml, "edge.yaml")
}

fn err_text(yaml: &str) -> String {
    parse(yaml).unwrap_err().to_string()
}

const GOOD: &str = r#"
nodes:
  - id: gpu
    token: secret-token-0123456789
    providers:
      - id: vllm
        kind: vllm
        base_url: http://127.0.0.1:8000/v1
        capacity: {normal: 2, long: 1}
      - id: echo
        kind: cli
        cli: {argv: ["cat"]}
model_groups:
  - name: llama
    members: [{node: gpu, provider: vllm, model: meta/llama}]
"#;

#[test]
fn a_good_config_parses_with_defaults() {
    let c = parse(GOOD).unwrap();
    assert_eq!(c.listen.nodes.to_string(), DEFAULT_NODE_LISTEN);
    assert_eq!(c.listen.http.to_string(), DEFAULT_HTTP_LISTEN);
    assert_eq!(c.max_frame_bytes, 16 * 1024 * 1024);
    assert_eq!(c.nodes[0].providers[0].max_concurrency(), 3);
    assert_eq!(c.nodes[0].providers[1].capacity, CapacityConfig::default());
    assert_eq!(
        c.model_groups[0].queue.max_waiting,
        DEFAULT_QUEUE_MAX_WAITING
    );
    assert_eq!(
        c.nodes[0].token_hash(),
        Some(hash_token("secret-token-0123456789"))
    );
}

#[test]
fn unknown_field_is_named_with_its_path() {
    let text = err_text(&GOOD.replace("capacity: {normal: 2", "capacity: {nromal: 2"));
    assert!(text.contains("nodes[0].providers[0].capacity"), "{text}");
    assert!(text.contains("nromal"), "{text}");
}

#[test]
fn wrong_type_is_named_with_its_path() {
    let text = err_text(&GOOD.replace("long: 1", "long: many"));
    assert!(
        text.contains("nodes[0].providers[0].capacity.long"),
        "{text}"
    );
}

#[test]
fn unknown_kind_is_named() {
    let text = err_text(&GOOD.replace("kind: vllm", "kind: tgi"));
    assert!(text.contains("nodes[0].providers[0].kind"), "{text}");
}

#[test]
fn missing_base_url_is_named() {
    let text = err_text(&GOOD.replace("base_url: http://127.0.0.1:8000/v1", ""));
    assert!(
        text.contains("nodes[0].providers[0].base_url: required for kind vllm"),
        "{text}"
    );
}

#[test]
fn bad_base_url_is_named() {
    let text = err_text(&GOOD.replace("http://127.0.0.1:8000/v1", "ftp://x"));
    assert!(text.contains("nodes[0].providers[0].base_url"), "{text}");
}

#[test]
fn a_node_without_a_token_registers_by_certificate_unless_plaintext() {
    let c = parse(&GOOD.replace("token: secret-token-0123456789", "")).unwrap();
    assert_eq!(c.nodes[0].token_hash(), None);
    let text = err_text(&format!(
        "node_tls: {{mode: insecure_plaintext}}\n{}",
        GOOD.replace("token: secret-token-0123456789", "")
    ));
    assert!(text.contains("nodes[0].token: one of token"), "{text}");
}

#[test]
fn two_token_sources_are_refused() {
    let text = err_text(&GOOD.replace(
        "token: secret-token-0123456789",
        "token: a\n    token_env: B",
    ));
    assert!(text.contains("nodes[0].token: give only one"), "{text}");
}

#[test]
fn unset_token_env_is_named() {
    let text = err_text(&GOOD.replace(
        "token: secret-token-0123456789",
        "token_env: IOP_TEST_SURELY_UNSET_VAR",
    ));
    assert!(text.contains("nodes[0].token_env"), "{text}");
    assert!(text.contains("IOP_TEST_SURELY_UNSET_VAR"), "{text}");
}

#[test]
fn token_sha256_is_accepted_and_checked() {
    let hex_hash = hex::encode(hash_token("secret-token-0123456789"));
    let c = parse(&GOOD.replace(
        "token: secret-token-0123456789",
        &format!("token_sha256: {hex_hash}"),
    ))
    .unwrap();
    assert_eq!(
        c.nodes[0].token_hash(),
        Some(hash_token("secret-token-0123456789"))
    );
    let text = err_text(&GOOD.replace("token: secret-token-0123456789", "token_sha256: abc"));
    assert!(text.contains("nodes[0].token_sha256"), "{text}");
}

#[test]
fn duplicate_node_id_is_named() {
    let dup = GOOD.replace(
        "model_groups:",
        "  - id: gpu\n    token: other-token-0123456789\nmodel_groups:",
    );
    let text = err_text(&dup);
    assert!(text.contains("nodes[1].id: duplicate node id"), "{text}");
}

#[test]
fn duplicate_provider_id_is_named() {
    let text = err_text(&GOOD.replace("id: echo", "id: vllm"));
    assert!(
        text.contains("nodes[0].providers[1].id: duplicate provider id"),
        "{text}"
    );
}

#[test]
fn member_referencing_unknown_provider_is_named() {
    let text = err_text(&GOOD.replace("provider: vllm, model", "provider: nope, model"));
    assert!(
        text.contains("model_groups[0].members[0].provider"),
        "{text}"
    );
}

#[test]
fn member_referencing_unknown_node_is_named() {
    let text = err_text(&GOOD.replace("{node: gpu,", "{node: cpu,"));
    assert!(text.contains("model_groups[0].members[0].node"), "{text}");
}

#[test]
fn cli_without_argv_is_named() {
    let text = err_text(&GOOD.replace(r#"cli: {argv: ["cat"]}"#, "cli: {argv: []}"));
    assert!(text.contains("nodes[0].providers[1].cli.argv"), "{text}");
}

#[test]
fn cli_session_settings_are_bounded_and_carried_to_the_node() {
    let cli = |fields: &str| {
        GOOD.replace(
            r#"cli: {argv: ["cat"]}"#,
            &format!("cli: {{argv: [cat], {fields}}}"),
        )
    };
    for (fields, path) in [
        ("max_sessions: 0", "nodes[0].providers[1].cli.max_sessions"),
        (
            "max_sessions: 10001",
            "nodes[0].providers[1].cli.max_sessions",
        ),
        (
            "session_idle_sec: 0",
            "nodes[0].providers[1].cli.session_idle_sec",
        ),
        ("end_marker: \"  \"", "nodes[0].providers[1].cli.end_marker"),
    ] {
        let text = err_text(&cli(fields));
        assert!(text.contains(path), "{fields}: {text}");
    }
    let c = parse(&cli("max_sessions: 4, session_idle_sec: 30")).unwrap();
    let spec = c.nodes[0].providers[1].cli.as_ref().unwrap();
    assert_eq!(
        (spec.max_sessions, spec.session_idle_sec),
        (Some(4), Some(30))
    );
    // Unset: the node's defaults (they travel as 0, the edge's payload tests say).
    let c = parse(GOOD).unwrap();
    let spec = c.nodes[0].providers[1].cli.as_ref().unwrap();
    assert_eq!((spec.max_sessions, spec.session_idle_sec), (None, None));
}

#[test]
fn zero_capacity_is_refused() {
    let text = err_text(&GOOD.replace("{normal: 2, long: 1}", "{normal: 0, long: 0}"));
    assert!(text.contains("nodes[0].providers[0].capacity"), "{text}");
}

#[test]
fn bad_listen_address_is_named() {
    let text = err_text(&format!("listen: {{http: 'not an address'}}\n{GOOD}"));
    assert!(text.contains("listen.http"), "{text}");
}

#[test]
fn zero_queue_timeout_is_named() {
    let text = err_text(&format!("{GOOD}    queue: {{timeout_sec: 0}}\n"));
    assert!(text.contains("model_groups[0].queue.timeout_sec"), "{text}");
}

#[test]
fn an_empty_file_is_a_clear_error() {
    for text in ["", "\n\n", "# only a comment\n---\n"] {
        let text = err_text(text);
        assert!(
            text.contains("edge.yaml: (top level): the file is empty"),
            "{text}"
        );
    }
}

#[test]
fn a_short_inline_token_is_refused() {
    let text = err_text(&GOOD.replace("token: secret-token-0123456789", "token: fifteen-chars-x"));
    assert!(
        text.contains("nodes[0].token: must be at least 16 characters"),
        "{text}"
    );
    parse(&GOOD.replace("token: secret-token-0123456789", "token: sixteen-chars-xy")).unwrap();
}

#[test]
fn the_same_token_on_two_nodes_names_both() {
    let two = GOOD.replace(
        "model_groups:",
        "  - id: cpu\n    token: secret-token-0123456789\nmodel_groups:",
    );
    let text = err_text(&two);
    assert!(text.contains("nodes[1].token:"), "{text}");
    assert!(
        text.contains("\"gpu\"") && text.contains("\"cpu\""),
        "{text}"
    );
}

#[test]
fn the_same_token_as_a_hash_on_another_node_is_refused() {
    let hex_hash = hex::encode(hash_token("secret-token-0123456789"));
    let two = GOOD.replace(
        "model_groups:",
        &format!("  - id: cpu\n    token_sha256: {hex_hash}\nmodel_groups:"),
    );
    let text = err_text(&two);
    assert!(text.contains("nodes[1].token_sha256:"), "{text}");
    assert!(
        text.contains("\"gpu\"") && text.contains("\"cpu\""),
        "{text}"
    );
}

#[test]
fn capacities_are_bounded() {
    let text = err_text(&GOOD.replace("{normal: 2, long: 1}", "{normal: 4294967295, long: 1}"));
    assert!(
        text.contains("nodes[0].providers[0].capacity.normal: must be at most 10000"),
        "{text}"
    );
    let text = err_text(&GOOD.replace(
        "{normal: 2, long: 1}",
        "{normal: 2, long: 1}\n        max_concurrency: 20000",
    ));
    assert!(
        text.contains("nodes[0].providers[0].max_concurrency"),
        "{text}"
    );
}

#[test]
fn max_frame_bytes_is_bounded() {
    for bad in ["1000", "1073741824"] {
        let text = err_text(&format!("max_frame_bytes: {bad}\n{GOOD}"));
        assert!(
            text.contains("max_frame_bytes: must be between 65536"),
            "{text}"
        );
    }
}

#[test]
fn node_limits_have_defaults_and_bounds() {
    let c = parse(GOOD).unwrap();
    let l = &c.limits.nodes;
    assert_eq!(l.first_frame_bytes, 64 * 1024);
    assert_eq!(
        l.tls_handshake_timeout(),
        std::time::Duration::from_secs(10)
    );
    assert_eq!(l.register_timeout(), std::time::Duration::from_secs(5));
    assert_eq!(l.ready_timeout(), std::time::Duration::from_secs(30));
    assert_eq!(
        (l.max_unauthenticated, l.max_unauthenticated_per_address),
        (256, 16)
    );
    assert_eq!(l.stream_buffer_bytes, 8 * 1024 * 1024);
    for (yaml, path) in [
        ("first_frame_bytes: 100", "limits.nodes.first_frame_bytes"),
        (
            "first_frame_bytes: 33554432",
            "limits.nodes.first_frame_bytes",
        ),
        (
            "tls_handshake_timeout_sec: 0",
            "limits.nodes.tls_handshake_timeout_sec",
        ),
        (
            "register_timeout_sec: 0",
            "limits.nodes.register_timeout_sec",
        ),
        ("ready_timeout_sec: -1", "limits.nodes.ready_timeout_sec"),
        ("max_unauthenticated: 0", "limits.nodes.max_unauthenticated"),
        (
            "max_unauthenticated_per_address: 300",
            "limits.nodes.max_unauthenticated_per_address",
        ),
        (
            "stream_buffer_bytes: 10",
            "limits.nodes.stream_buffer_bytes",
        ),
        (
            "summary_interval_sec: 0",
            "limits.nodes.summary_interval_sec",
        ),
        ("nope: 1", "limits.nodes"),
    ] {
        let text = err_text(&format!("limits:\n  nodes: {{{yaml}}}\n{GOOD}"));
        assert!(text.contains(path), "{yaml}: {text}");
    }
}

#[test]
fn stream_keepalive_defaults_to_15_s_and_is_bounded() {
    let config = parse(GOOD).unwrap();
    assert_eq!(
        config.limits.http.stream_keepalive(),
        Some(std::time::Duration::from_secs(15))
    );
    let off = parse(&format!(
        "limits:\n  http: {{stream_keepalive_sec: 0}}\n{GOOD}"
    ))
    .unwrap();
    assert_eq!(off.limits.http.stream_keepalive(), None);
    let text = err_text(&format!(
        "limits:\n  http: {{stream_keepalive_sec: 3601}}\n{GOOD}"
    ));
    assert!(text.contains("limits.http.stream_keepalive_sec"), "{text}");
}

#[test]
fn node_tls_files_belong_to_the_provided_mode() {
    let text = err_text(&format!(
        "node_tls: {{mode: provided, cert: c.pem}}\n{GOOD}"
    ));
    assert!(text.contains("node_tls.key: required"), "{text}");
    let text = err_text(&format!("node_tls: {{cert: c.pem}}\n{GOOD}"));
    assert!(
        text.contains("node_tls.cert: only with node_tls.mode provided"),
        "{text}"
    );
    let text = err_text(&format!(
        "node_tls: {{advertise: [edge.example.net]}}\n{GOOD}"
    ));
    assert!(text.contains("node_tls.advertise[0]"), "{text}");
    let text = err_text(&format!("node_tls: {{mode: tls}}\n{GOOD}"));
    assert!(text.contains("node_tls.mode"), "{text}");
    parse(&format!(
        "node_tls: {{mode: provided, cert: c.pem, key: k.pem, client_ca: ca.pem}}\n{GOOD}"
    ))
    .unwrap();
}

#[test]
fn relative_state_and_tls_paths_are_taken_from_the_config_directory() {
    let mut c = parse(&format!(
        "http_tls: {{cert: tls/c.pem, key: /abs/k.pem}}\n{GOOD}"
    ))
    .unwrap();
    c.resolve_paths(std::path::Path::new("/etc/iop"));
    assert_eq!(
        c.state_dir.as_deref(),
        Some(std::path::Path::new("/etc/iop/iop-edge-state"))
    );
    let http = c.http_tls.unwrap();
    assert_eq!(http.cert, std::path::Path::new("/etc/iop/tls/c.pem"));
    assert_eq!(http.key, std::path::Path::new("/abs/k.pem"));
}

#[test]
fn health_settings_have_defaults_and_per_provider_overrides() {
    let c = parse(GOOD).unwrap();
    assert_eq!(c.health.interval_sec, 5.0);
    assert_eq!(c.health.ejection.consecutive_failures, 3);
    assert_eq!(c.model_groups[0].queue.wait_for_reconnect_sec, 0);
    let probe = c.health.probe_settings(None);
    assert_eq!(probe.timeout, std::time::Duration::from_secs(2));
    let c = parse(&format!(
        "{}health: {{interval_sec: 2, ejection: {{base_sec: 5, max_sec: 50}}}}\n",
        GOOD.replace(
            "capacity: {normal: 2, long: 1}",
            "capacity: {normal: 2, long: 1}\n        health: {interval_sec: 0.5}"
        )
        .replace(
            "members: [{node: gpu, provider: vllm, model: meta/llama}]",
            "members: [{node: gpu, provider: vllm, model: meta/llama}]\n    queue: {wait_for_reconnect_sec: 10}"
        )
    ))
    .unwrap();
    let own = c
        .health
        .probe_settings(c.nodes[0].providers[0].health.as_ref());
    assert_eq!(own.interval, std::time::Duration::from_millis(500));
    assert_eq!(
        own.timeout,
        std::time::Duration::from_secs(2),
        "edge-wide default"
    );
    assert_eq!(
        c.health.probe_settings(None).interval,
        std::time::Duration::from_secs(2)
    );
    assert_eq!(c.health.ejection.base_sec, 5.0);
    assert_eq!(c.model_groups[0].queue.wait_for_reconnect_sec, 10);
}

#[test]
fn bad_health_settings_name_their_path() {
    let with = |extra: &str| err_text(&format!("{GOOD}{extra}\n"));
    assert!(with("health: {interval_sec: 0}").contains("health.interval_sec"));
    assert!(with("health: {timeout_sec: -1}").contains("health.timeout_sec"));
    assert!(with("health: {unhealthy_after: 0}").contains("health.unhealthy_after"));
    assert!(
        with("health: {ejection: {base_sec: 60, max_sec: 30}}").contains("health.ejection.max_sec")
    );
    assert!(with("health: {probe: yes}").contains("unknown field"));
    let e = err_text(&GOOD.replace(
        "capacity: {normal: 2, long: 1}",
        "capacity: {normal: 2, long: 1}\n        health: {interval_sec: 99999}",
    ));
    assert!(
        e.contains("nodes[0].providers[0].health.interval_sec"),
        "{e}"
    );
    let e = err_text(&GOOD.replace(
        "members: [{node: gpu, provider: vllm, model: meta/llama}]",
        "members: [{node: gpu, provider: vllm, model: meta/llama}]\n    queue: {wait_for_reconnect_sec: 999999}",
    ));
    assert!(
        e.contains("model_groups[0].queue.wait_for_reconnect_sec"),
        "{e}"
    );
}

#[test]
fn tunnel_usage_defaults_to_inject_and_is_only_for_tunnelled_kinds() {
    let c = parse(GOOD).unwrap();
    assert!(c.nodes[0].providers[0].injects_stream_usage());
    assert!(!c.nodes[0].providers[1].injects_stream_usage());
    let off = parse(&GOOD.replace(
        "capacity: {normal: 2, long: 1}",
        "capacity: {normal: 2, long: 1}\n        tunnel_usage: off",
    ))
    .unwrap();
    assert!(!off.nodes[0].providers[0].injects_stream_usage());
    let text = err_text(&GOOD.replace(
        "cli: {argv: [\"cat\"]}",
        "cli: {argv: [\"cat\"]}\n        tunnel_usage: inject",
    ));
    assert!(
        text.contains("nodes[0].providers[1].tunnel_usage: only for kinds openai_compat and vllm"),
        "{text}"
    );
    let text = err_text(&GOOD.replace(
        "capacity: {normal: 2, long: 1}",
        "capacity: {normal: 2, long: 1}\n        tunnel_usage: sometimes",
    ));
    assert!(
        text.contains("nodes[0].providers[0].tunnel_usage"),
        "{text}"
    );
}

#[test]
fn apis_default_per_kind_and_are_only_for_tunnelled_kinds() {
    use crate::ProviderApi;
    let c = parse(GOOD).unwrap();
    let tunnel = &c.nodes[0].providers[0];
    for api in [
        ProviderApi::Chat,
        ProviderApi::Completions,
        ProviderApi::Embeddings,
    ] {
        assert!(tunnel.serves(api), "{api:?}");
    }
    assert!(!tunnel.serves(ProviderApi::Responses));
    assert!(!tunnel.serves(ProviderApi::Messages));
    // A run provider serves nothing natively.
    assert!(!c.nodes[0].providers[1].serves(ProviderApi::Chat));

    let native = parse(&GOOD.replace(
        "capacity: {normal: 2, long: 1}",
        "capacity: {normal: 2, long: 1}\n        apis: [chat, responses, messages]",
    ))
    .unwrap();
    let p = &native.nodes[0].providers[0];
    assert!(p.serves(ProviderApi::Responses) && p.serves(ProviderApi::Messages));
    assert!(!p.serves(ProviderApi::Embeddings));

    for (yaml, expected) in [
        (
            "cli: {argv: [\"cat\"]}\n        apis: [chat]",
            "nodes[0].providers[1].apis: only for kinds openai_compat and vllm",
        ),
        (
            "capacity: {normal: 2, long: 1}\n        apis: []",
            "nodes[0].providers[0].apis: must list at least one API",
        ),
        (
            "capacity: {normal: 2, long: 1}\n        apis: [chat, ollama]",
            "nodes[0].providers[0].apis",
        ),
    ] {
        let (from, to) = yaml.split_once('\n').unwrap();
        let text = err_text(&GOOD.replace(from, &format!("{from}\n{to}")));
        assert!(text.contains(expected), "{yaml}: {text}");
    }
}

#[test]
fn ledger_and_key_limits_are_checked_with_their_paths() {
    let config = parse(GOOD).unwrap();
    assert_eq!(config.ledger, LedgerConfig::default());
    assert!(config.ledger.enabled);
    assert_eq!(config.ledger.retention_days, 90);
    let with = |extra: &str| format!("{GOOD}{extra}");
    let e = err_text(&with("ledger: {retention_days: 0}\n"));
    assert!(e.contains("ledger.retention_days"), "{e}");
    let e = err_text(&with("ledger: {keep: 1}\n"));
    assert!(e.contains("keep"), "{e}");
    let key = |limits: &str| {
        with(&format!(
            "auth:\n  keys:\n    - {{name: a, role: client, key: key-a-0123456789ab, limits: {limits}}}\n"
        ))
    };
    let ok = parse(&key(
        "{requests_per_minute: 10, tokens_per_day: 1000, max_concurrent: 2}",
    ))
    .unwrap();
    let limits = ok.auth.keys[0].limits;
    assert_eq!(
        (
            limits.requests_per_minute,
            limits.tokens_per_day,
            limits.max_concurrent
        ),
        (Some(10), Some(1000), Some(2))
    );
    for (limits, path) in [
        (
            "{requests_per_minute: 0}",
            "auth.keys[0].limits.requests_per_minute",
        ),
        ("{max_concurrent: 0}", "auth.keys[0].limits.max_concurrent"),
        ("{tokens_per_day: 0}", "auth.keys[0].limits.tokens_per_day"),
        ("{per_hour: 5}", "per_hour"),
    ] {
        let e = err_text(&key(limits));
        assert!(e.contains(path), "{limits}: {e}");
    }
    // A token budget counts across restarts from the ledger: it needs one.
    let e = err_text(&format!(
        "{}ledger: {{enabled: false}}\n",
        key("{tokens_per_day: 5}")
    ));
    assert!(e.contains("auth.keys[0].limits.tokens_per_day"), "{e}");
    assert!(e.contains("ledger.enabled"), "{e}");
}

#[test]
fn secrets_are_resolved_once_when_the_config_is_read() {
    let text = r#"
auth:
  keys:
    - {name: ops, role: admin, key_env: IOP_TEST_ONLY_IN_THIS_ENV_KEY}
    - {name: dev, role: client, key: inline-key-0123456789}
nodes:
  - id: gpu
    token_env: IOP_TEST_ONLY_IN_THIS_ENV_TOKEN
    providers: [{id: m, kind: mock}]
model_groups:
  - {name: small, members: [{node: gpu, provider: m}]}
"#;
    let env = |var: &str| {
        var.starts_with("IOP_TEST_ONLY")
            .then(|| format!("{var}-value-0123456789"))
    };
    let c = EdgeConfig::from_yaml_with_env(text, "edge.yaml", &env).unwrap();
    // The variables exist only in `env`: what is kept is what was read then.
    assert_eq!(
        c.nodes[0].token_hash(),
        Some(hash_token(
            "IOP_TEST_ONLY_IN_THIS_ENV_TOKEN-value-0123456789"
        ))
    );
    assert_eq!(
        c.auth.keys[0].key_hash(),
        Some(hash_token("IOP_TEST_ONLY_IN_THIS_ENV_KEY-value-0123456789"))
    );
    assert_eq!(
        c.auth.keys[1].key_hash(),
        Some(hash_token("inline-key-0123456789"))
    );
    // Inline secrets are not kept once hashed, and validating again reads nothing.
    assert!(c.auth.keys[1].key.is_none());
    c.validate().unwrap();
}

#[test]
#[cfg(feature = "store-url")]
fn the_store_url_comes_from_the_config_or_iop_store_url() {
    let text = r#"
store: {url: "postgres://iop@127.0.0.1/one"}
nodes:
  - id: gpu
    token: token-gpu-0123456789
    providers: [{id: m, kind: mock}]
model_groups:
  - {name: small, members: [{node: gpu, provider: m}]}
"#;
    let key = |var: &str| (var == "IOP_STORE_SECRET_KEY").then(|| "A".repeat(43) + "=");
    let c = EdgeConfig::from_yaml_with_env(text, "edge.yaml", &key).unwrap();
    assert_eq!(c.store.url.as_deref(), Some("postgres://iop@127.0.0.1/one"));
    let env = |var: &str| match var {
        "IOP_STORE_URL" => Some("postgres://iop@[::1]/two".to_string()),
        other => key(other),
    };
    let c = EdgeConfig::from_yaml_with_env(text, "edge.yaml", &env).unwrap();
    assert_eq!(c.store.url.as_deref(), Some("postgres://iop@[::1]/two"));
    let remote = |var: &str| match var {
        "IOP_STORE_URL" => Some("postgres://iop:pw@db.example.net/iop?sslmode=disable".to_string()),
        other => key(other),
    };
    let err = EdgeConfig::from_yaml_with_env(text, "edge.yaml", &remote).unwrap_err();
    assert!(!err.to_string().contains("pw@"), "{err}");
    // The fleet's CA is sealed with the secret key: without one the config says how to
    // make it.
    let err = EdgeConfig::from_yaml_with_env(text, "edge.yaml", &|_| None).unwrap_err();
    assert!(err.to_string().contains("store.secret_key_file"), "{err}");
    assert!(err.to_string().contains("head -c 32 /dev/urandom"), "{err}");
}

fn ollama_provider(extra: &str) -> String {
    format!(
        "nodes:\n  - id: box\n    token: secret-token-0123456789\n    providers:\n      - {{id: ol, kind: ollama, base_url: \"http://127.0.0.1:11434\"{extra}}}\n"
    )
}

#[test]
fn an_ollama_providers_models_setting_is_checked() {
    let auto = parse(&ollama_provider("")).unwrap();
    let provider = &auto.nodes[0].providers[0];
    assert!(provider.local_models().unwrap().exposes("anything:latest"));
    let picky = parse(&ollama_provider(", models: [\"llama3.2\", \"qwen*\"]")).unwrap();
    let models = picky.nodes[0].providers[0].local_models().unwrap();
    assert!(models.exposes("llama3.2:latest") && models.exposes("qwen2.5:7b"));
    assert!(!models.exposes("llama3.2:1b") && !models.exposes("gemma:2b"));
    assert_eq!(models.wanted(), ["llama3.2"]);
    let off = parse(&ollama_provider(", models: []")).unwrap();
    assert!(off.nodes[0].providers[0].local_models().is_none());
    assert!(err_text(&ollama_provider(", models: every")).contains("auto"));
    assert!(err_text(&ollama_provider(", reconcile: pull")).contains("reconcile"));
    parse(&ollama_provider(", models: [llama3.2], reconcile: pull")).unwrap();
    let not_ollama = GOOD.replace(
        "base_url: http://127.0.0.1:8000/v1",
        "base_url: http://127.0.0.1:8000/v1\n        models: auto",
    );
    assert!(err_text(&not_ollama).contains("only for kind ollama"));
}

#[test]
fn globs_match_runs_of_characters() {
    use crate::provider::glob_match;
    assert!(glob_match("qwen*", "qwen2.5:7b"));
    assert!(glob_match("*:7b", "qwen2.5:7b"));
    assert!(glob_match("q*2*b", "qwen2.5:7b"));
    assert!(glob_match("exact", "exact"));
    assert!(!glob_match("exact", "exactly"));
    assert!(!glob_match("a*b", "ba"));
    assert!(glob_match("*", ""));
}

#[test]
fn an_allowlist_may_name_a_model_an_ollama_provider_serves_by_itself() {
    let keys = "auth:\n  keys:\n    - {name: t, role: client, key: team-key-0123456789, models: [llama3.2]}\n";
    parse(&format!("{}{keys}", ollama_provider(""))).unwrap();
    let text = err_text(&format!(
        "{}{keys}",
        ollama_provider(", models: [\"qwen*\"]")
    ));
    assert!(text.contains("no model group named"), "{text}");
}
