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
    token: secret
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
    assert_eq!(c.nodes[0].token_hash().unwrap(), Some(hash_token("secret")));
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
    let c = parse(&GOOD.replace("token: secret", "")).unwrap();
    assert_eq!(c.nodes[0].token_hash().unwrap(), None);
    let text = err_text(&format!(
        "node_tls: {{mode: insecure_plaintext}}\n{}",
        GOOD.replace("token: secret", "")
    ));
    assert!(text.contains("nodes[0].token: one of token"), "{text}");
}

#[test]
fn two_token_sources_are_refused() {
    let text = err_text(&GOOD.replace("token: secret", "token: a\n    token_env: B"));
    assert!(text.contains("nodes[0].token: give only one"), "{text}");
}

#[test]
fn unset_token_env_is_named() {
    let text = err_text(&GOOD.replace("token: secret", "token_env: IOP_TEST_SURELY_UNSET_VAR"));
    assert!(text.contains("nodes[0].token_env"), "{text}");
    assert!(text.contains("IOP_TEST_SURELY_UNSET_VAR"), "{text}");
}

#[test]
fn token_sha256_is_accepted_and_checked() {
    let hex_hash = hex::encode(hash_token("secret"));
    let c = parse(&GOOD.replace("token: secret", &format!("token_sha256: {hex_hash}"))).unwrap();
    assert_eq!(c.nodes[0].token_hash().unwrap(), Some(hash_token("secret")));
    let text = err_text(&GOOD.replace("token: secret", "token_sha256: abc"));
    assert!(text.contains("nodes[0].token_sha256"), "{text}");
}

#[test]
fn duplicate_node_id_is_named() {
    let dup = GOOD.replace(
        "model_groups:",
        "  - id: gpu\n    token: other\nmodel_groups:",
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
