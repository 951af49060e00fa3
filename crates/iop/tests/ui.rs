//! The status page (`GET /ui`) in a real headless Chromium against a real edge: it signs in
//! with the admin key, shows every node and provider with its lane bars, marks a killed
//! node offline within seconds of the edge seeing it go, lists a failed request with its
//! reason code, and logs no console error on the way (a CSP violation would be one).
//!
//! Without Chromium the tests skip, unless `IOP_REQUIRE_BROWSER=1`.
//! `IOP_UI_SCREENSHOT=<path>` makes `screenshot_for_the_docs` write the README's picture.

mod common;

use std::time::{Duration, Instant};

use common::browser::{Browser, Page};
use common::*;
use serde_json::{Value, json};

const CLIENT_KEYS: [(&str, &str); 2] = [
    ("team-a", "sk-team-a-0123456789"),
    ("team-b", "sk-team-b-0123456789"),
];

/// An edge config: `nodes` (id, provider capacity) each with one OpenAI-compatible
/// provider `gpu` on `mock`; `groups` (name, [(node, model)]); an admin and two client keys.
fn config(mock: &MockProc, nodes: &[(&str, u32)], groups: &[(&str, &[(&str, &str)])]) -> String {
    let mut yaml = format!(
        "auth:\n  keys:\n    - {{name: ops, role: admin, key: {TEST_API_KEY}}}\n{}",
        CLIENT_KEYS
            .iter()
            .map(|(name, key)| format!("    - {{name: {name}, role: client, key: {key}}}\n"))
            .collect::<String>()
    );
    yaml.push_str("health:\n  interval_sec: 0.5\n  timeout_sec: 1\nnodes:\n");
    for (id, capacity) in nodes {
        yaml.push_str(&format!(
            "  - id: {id}\n    token: token-{id}-0123456789\n    providers:\n      - {{id: gpu, kind: openai_compat, base_url: \"{}\", capacity: {{normal: {capacity}, long: 1}}}}\n",
            mock.openai_base()
        ));
    }
    yaml.push_str("model_groups:\n");
    for (name, members) in groups {
        yaml.push_str(&format!("  - name: {name}\n    members:\n"));
        for (node, model) in *members {
            yaml.push_str(&format!(
                "      - {{node: {node}, provider: gpu, model: {model}}}\n"
            ));
        }
    }
    yaml
}

/// Sends one chat completion as `key`; returns its status.
async fn chat(edge: &EdgeProc, key: &str, model: &str, stream: bool) -> u16 {
    client()
        .post(edge.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({
            "model": model,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "stream": stream,
        }))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// A streamed request to `model` whose provider never answers: it holds a slot until the
/// task is aborted.
fn hold_a_slot(edge: &EdgeProc, model: &str) -> tokio::task::JoinHandle<()> {
    // No client timeout: the request is meant to wait.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let request = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(edge.url("/v1/chat/completions"))
        .bearer_auth(CLIENT_KEYS[0].1)
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "x"}], "stream": true}));
    tokio::spawn(async move {
        let _ = request.send().await;
    })
}

/// An admin GET of `path`, as JSON.
async fn admin_json(edge: &EdgeProc, path: &str) -> Value {
    let response = client()
        .get(edge.url(path))
        .bearer_auth(TEST_API_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{path}");
    response.json().await.unwrap()
}

/// Opens the page and signs in with the admin key through its form.
async fn open_signed_in<'a>(browser: &'a Browser, edge: &EdgeProc, width: u32) -> Page<'a> {
    let page = browser.new_page(width, 900).await;
    page.navigate(&edge.url("/ui")).await;
    page.wait_for(
        "!document.getElementById('login').hidden",
        Duration::from_secs(10),
        "the key form",
    )
    .await;
    page.eval(&format!(
        "document.getElementById('key').value = {}; \
         document.getElementById('login').requestSubmit(); true",
        json!(TEST_API_KEY)
    ))
    .await;
    page.wait_for(
        "!document.getElementById('sections').hidden",
        Duration::from_secs(20),
        "the sections after signing in",
    )
    .await;
    page
}

/// The `data-state` of node `id`'s row on the page.
fn node_state(id: &str) -> String {
    format!("document.querySelector('tr[data-node=\"{id}\"]')?.dataset.state ?? null")
}

#[tokio::test]
async fn the_page_shows_nodes_providers_a_killed_node_and_failures_without_console_errors() {
    let Some(browser) = Browser::launch(1280, 900) else {
        return;
    };
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let edge = start_edge(
        dir.path(),
        &config(
            &mock,
            &[("n1", 4), ("n2", 4)],
            &[
                ("chat", &[("n1", "mock-model"), ("n2", "mock-model")]),
                ("held", &[("n1", "hang")]),
                ("broken", &[("n1", "fail-500")]),
            ],
        ),
    )
    .await;
    let _n1 = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    let mut n2 = start_node("n2", dir.path(), &edge.nodes, "token-n2-0123456789", "");
    wait_ready(&edge, "n1").await;
    wait_ready(&edge, "n2").await;

    // Traffic: answered requests from both keys, one that fails at the provider, and a
    // request that holds a slot on n1 (its provider never answers) while the page is read.
    for (_, key) in CLIENT_KEYS {
        assert_eq!(chat(&edge, key, "chat", false).await, 200);
        assert_eq!(chat(&edge, key, "chat", true).await, 200);
    }
    let failed = chat(&edge, CLIENT_KEYS[1].1, "broken", false).await;
    assert!(failed >= 500, "the failing request answered {failed}");
    let held = hold_a_slot(&edge, "held");
    wait_status(
        &edge,
        Duration::from_secs(20),
        "the held request on n1",
        |s| provider_of(s, "n1", "gpu")["in_flight"]["normal"] == 1,
    )
    .await;

    let page = open_signed_in(&browser, &edge, 1280).await;
    let within = Duration::from_secs(20);
    for id in ["n1", "n2"] {
        page.wait_for(
            &format!("{} === 'ready'", node_state(id)),
            within,
            &format!("{id} ready"),
        )
        .await;
    }
    // The node row carries what the status knows of the connection.
    let n1_row = page
        .eval("document.querySelector('tr[data-node=\"n1\"]').innerText")
        .await;
    let n1_row = n1_row.as_str().unwrap();
    assert!(n1_row.contains(env!("CARGO_PKG_VERSION")), "{n1_row}");
    assert!(n1_row.contains("127.0.0.1:"), "peer address: {n1_row}");
    // Provider bars: in flight, and both lanes, of both providers; n1's normal lane one of
    // four busy.
    let bars = page
        .wait_for(
            "(() => { const b = document.querySelector('tr[data-provider=\"n1/gpu\"] .bar[data-lane=\"normal\"]'); \
               return b && b.innerText.trim() === '1/4' && parseFloat(b.querySelector('.fill').style.width) === 25 \
                 && document.querySelectorAll('tr[data-provider] .bar').length; })()",
            within,
            "n1/gpu's normal lane at 1/4",
        )
        .await;
    assert_eq!(bars, 6, "the total and two lanes for each of two providers");
    let n1_total = page
        .eval("document.querySelector('tr[data-provider=\"n1/gpu\"] .bar[data-lane=\"total\"]').innerText.trim()")
        .await;
    assert_eq!(n1_total, "1/5", "in flight of both lanes");
    let n2_bar = page
        .eval("document.querySelector('tr[data-provider=\"n2/gpu\"] .bar[data-lane=\"normal\"]').innerText.trim()")
        .await;
    assert_eq!(n2_bar, "0/4");

    // Kill n2: the page shows it offline within 5 s of the edge logging the disconnect.
    n2.kill9();
    edge.proc
        .wait_line("node disconnected", Duration::from_secs(20))
        .await;
    let disconnected = Instant::now();
    page.wait_for(
        &format!("{} === 'offline'", node_state("n2")),
        Duration::from_secs(15),
        "n2 offline",
    )
    .await;
    let took = disconnected.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "the page showed n2 offline {took:?} after the edge saw it disconnect"
    );
    assert_eq!(page.eval(&node_state("n1")).await, "ready");
    page.wait_for(
        "document.querySelector('tr[data-provider=\"n2/gpu\"]')?.innerText.includes('offline')",
        within,
        "n2/gpu offline",
    )
    .await;
    // The group shows one of its two members usable.
    page.wait_for(
        "document.querySelector('tr[data-group=\"chat\"]')?.innerText.includes('1/2 usable')",
        within,
        "chat with 1/2 members usable",
    )
    .await;
    // The failed request, with the reason code the ledger recorded for it.
    let records = admin_json(&edge, "/admin/usage/records?outcome=failed&limit=50").await;
    let record = records["records"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["group"] == "broken")
        .unwrap_or_else(|| panic!("no failed record for the broken group: {records}"))
        .clone();
    let reason = record["outcome"].as_str().unwrap().to_string();
    assert!(!reason.is_empty() && reason != "ok", "{record}");
    let shown = page
        .wait_for(
            "[...document.querySelectorAll('tr.failure')].map(r => r.innerText).find(t => t.includes('broken')) ?? null",
            within,
            "the failed request",
        )
        .await;
    let shown = shown.as_str().unwrap();
    assert!(shown.contains(&reason), "reason {reason} not in {shown:?}");
    assert!(shown.contains("team-b"), "the key is not in {shown:?}");

    // Usage charts per key, from the ledger.
    page.wait_for(
        "document.querySelectorAll('tr[data-key] svg.spark rect').length >= 2",
        within,
        "a usage chart per key",
    )
    .await;

    // The filter hides what does not match; the sections collapse.
    page.eval("const f = document.getElementById('filter'); f.value = 'n2'; f.dispatchEvent(new Event('input')); true")
        .await;
    page.wait_for(
        "!document.querySelector('tr[data-node=\"n1\"]') && !!document.querySelector('tr[data-node=\"n2\"]')",
        within,
        "only n2 after filtering",
    )
    .await;
    page.eval("document.querySelector('#sec-nodes > summary').click(); true")
        .await;
    assert_eq!(
        page.eval("document.getElementById('sec-nodes').open").await,
        false
    );

    // A narrow window: nothing is wider than the window but the tables' own scrollers.
    let narrow = open_signed_in(&browser, &edge, 380).await;
    narrow
        .wait_for(
            &format!("{} === 'ready'", node_state("n1")),
            within,
            "n1 in a narrow window",
        )
        .await;
    let wide = narrow
        .eval(
            "[...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > window.innerWidth + 1 && !e.closest('.scroll')).map(e => e.tagName + '.' + e.className + '#' + e.id).slice(0, 10)",
        )
        .await;
    assert_eq!(wide, json!([]), "wider than a narrow window");
    assert_eq!(
        narrow
            .eval("document.documentElement.scrollWidth <= window.innerWidth")
            .await,
        true,
        "the page scrolls sideways in a narrow window"
    );

    let errors = browser.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:#?}");
    held.abort();
}

/// The Ollama section: each provider's held and loaded models, and a fleet pull with its
/// targets' progress.
#[tokio::test]
async fn the_page_shows_the_ollama_providers_models_and_the_pulls() {
    let Some(browser) = Browser::launch(1280, 900) else {
        return;
    };
    let dir = tempdir();
    let mock = start_mock(&["--pull-step-ms", "10"]).await;
    let config = format!(
        "auth:\n  keys:\n    - {{name: ops, role: admin, key: {TEST_API_KEY}}}\nnodes:\n  - id: n1\n    token: token-n1-0123456789\n    providers:\n      - {{id: ol, kind: ollama, base_url: \"{}\"}}\n",
        mock.ollama_base()
    );
    let edge = start_edge(dir.path(), &config).await;
    let _n1 = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    let started = client()
        .post(edge.url("/admin/models/pull"))
        .bearer_auth(TEST_API_KEY)
        .json(&json!({"model": "seen:1b"}))
        .send()
        .await
        .unwrap();
    assert_eq!(started.status(), 202);

    let page = open_signed_in(&browser, &edge, 1280).await;
    let within = Duration::from_secs(20);
    page.wait_for(
        "document.querySelector('tr[data-ollama=\"n1/ol\"]')?.innerText.includes('seen:1b') ?? false",
        within,
        "n1/ol holding the pulled model",
    )
    .await;
    let job = page
        .wait_for(
            "document.querySelector('[data-job]')?.innerText ?? null",
            within,
            "the pull among the jobs",
        )
        .await;
    let job = job.as_str().unwrap();
    assert!(
        job.contains("pull seen:1b") && job.contains("n1/ol: succeeded"),
        "{job}"
    );
    // The group made of the model is listed with the others.
    page.wait_for(
        "!!document.querySelector('tr[data-group=\"seen:1b\"]')",
        within,
        "the model's own group",
    )
    .await;
    let errors = browser.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:#?}");
}

/// Writes the README's picture to `IOP_UI_SCREENSHOT`: four nodes (one offline), five
/// model groups, traffic from two keys, a failure and a stream in flight.
#[tokio::test]
async fn screenshot_for_the_docs() {
    let Some(path) = std::env::var_os("IOP_UI_SCREENSHOT") else {
        eprintln!("SKIPPED: set IOP_UI_SCREENSHOT=<path.png> to write the docs' screenshot");
        return;
    };
    let Some(browser) = Browser::launch(1280, 900) else {
        return;
    };
    let dir = tempdir();
    let mock = start_mock(&[]).await;
    let edge = start_edge(
        dir.path(),
        &config(
            &mock,
            &[("gpu-a", 8), ("gpu-b", 8), ("mac-mini", 2), ("spare", 4)],
            &[
                (
                    "llama-3.1-8b",
                    &[
                        ("gpu-a", "mock-model"),
                        ("gpu-b", "mock-model"),
                        ("spare", "mock-model"),
                    ],
                ),
                (
                    "qwen2.5-coder",
                    &[("gpu-b", "mock-model"), ("mac-mini", "mock-model")],
                ),
                ("mistral-small", &[("gpu-a", "hang")]),
                ("nomic-embed", &[("mac-mini", "mock-model")]),
                ("experimental", &[("gpu-a", "fail-500")]),
            ],
        ),
    )
    .await;
    let mut nodes = Vec::new();
    for id in ["gpu-a", "gpu-b", "mac-mini", "spare"] {
        nodes.push(start_node(
            id,
            dir.path(),
            &edge.nodes,
            &format!("token-{id}-0123456789"),
            "",
        ));
        wait_ready(&edge, id).await;
    }
    for (i, (_, key)) in CLIENT_KEYS.iter().enumerate() {
        for model in [
            "llama-3.1-8b",
            "qwen2.5-coder",
            "llama-3.1-8b",
            "nomic-embed",
        ] {
            for _ in 0..(3 - i) {
                assert_eq!(chat(&edge, key, model, i == 0).await, 200);
            }
        }
    }
    assert!(chat(&edge, CLIENT_KEYS[1].1, "experimental", false).await >= 500);
    let held = hold_a_slot(&edge, "mistral-small");
    nodes.pop().unwrap().kill9();
    edge.proc
        .wait_line("node disconnected", Duration::from_secs(20))
        .await;
    let page = open_signed_in(&browser, &edge, 1280).await;
    let within = Duration::from_secs(20);
    page.wait_for(
        &format!("{} === 'offline'", node_state("spare")),
        within,
        "spare offline",
    )
    .await;
    page.wait_for(
        "document.querySelectorAll('tr.failure').length",
        within,
        "the failure",
    )
    .await;
    page.wait_for(
        "document.querySelectorAll('tr[data-key] svg.spark rect').length >= 2",
        within,
        "the usage charts",
    )
    .await;
    std::fs::write(&path, page.screenshot().await).unwrap();
    eprintln!("wrote {}", std::path::Path::new(&path).display());
    held.abort();
}
