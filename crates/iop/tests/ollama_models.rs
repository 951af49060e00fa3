//! Managing Ollama models on the nodes with real processes: the `ollama.*` control
//! commands (pull, delete, copy, create, load, unload, jobs) sent to two nodes' Ollama
//! providers (the mock provider's Ollama mode, which follows Ollama's documented API)
//! through the edge's node-command API — admin keys only, `POST` only.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const CLIENT_KEY: &str = "team-key-0123456789";

struct Setup {
    _dir: tempfile::TempDir,
    edge: EdgeProc,
    _mocks: Vec<MockProc>,
    _nodes: Vec<Proc>,
}

async fn setup() -> Setup {
    let dir = tempdir();
    // Slow enough pulls that one is seen running, fast enough for a quick test.
    let a = start_mock(&["--pull-step-ms", "30"]).await;
    let b = start_mock(&["--pull-step-ms", "30"]).await;
    let config = format!(
        r#"
auth:
  keys:
    - {{name: ops, role: admin, key: "{TEST_API_KEY}"}}
    - {{name: team, role: client, key: {CLIENT_KEY}}}
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: ol, kind: ollama, base_url: "{a}"}}
      - {{id: mk, kind: mock}}
  - id: n2
    token: token-n2-0123456789
    providers:
      - {{id: ol, kind: ollama, base_url: "{b}"}}
"#,
        a = a.ollama_base(),
        b = b.ollama_base(),
    );
    let edge = start_edge(dir.path(), &config).await;
    let n1 = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    let n2 = start_node("n2", dir.path(), &edge.nodes, "token-n2-0123456789", "");
    wait_ready(&edge, "n1").await;
    wait_ready(&edge, "n2").await;
    Setup {
        _dir: dir,
        edge,
        _mocks: vec![a, b],
        _nodes: vec![n1, n2],
    }
}

fn command_url(edge: &EdgeProc, node: &str, name: &str) -> String {
    edge.url(&format!("/v1/nodes/{node}/commands/{name}?adapter=ol"))
}

/// `POST`s a node command with `args` as its body; the status and JSON answer.
async fn post(edge: &EdgeProc, node: &str, name: &str, args: Value, key: &str) -> (u16, Value) {
    let response = client()
        .post(command_url(edge, node, name))
        .bearer_auth(key)
        .json(&args)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, body)
}

async fn admin(edge: &EdgeProc, node: &str, name: &str, args: Value) -> Value {
    let (status, body) = post(edge, node, name, args, TEST_API_KEY).await;
    assert_eq!(status, 200, "{name}: {body}");
    body
}

/// An admin's command that fails: its status and the error's message.
async fn failed(edge: &EdgeProc, node: &str, name: &str, args: Value) -> (u16, String) {
    let (status, body) = post(edge, node, name, args, TEST_API_KEY).await;
    assert!(status >= 400, "{name}: {status} {body}");
    let message = body["error"]["message"].as_str();
    (
        status,
        message.unwrap_or_else(|| panic!("{body}")).to_string(),
    )
}

async fn query(edge: &EdgeProc, node: &str, name: &str) -> Value {
    let response = client()
        .get(command_url(edge, node, name))
        .bearer_auth(TEST_API_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

fn names(list: &Value) -> Vec<String> {
    list["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn models_are_pulled_loaded_copied_created_and_deleted_on_the_nodes() {
    let s = setup().await;
    let edge = &s.edge;

    // n1: a pull the command waits for.
    let pulled = admin(edge, "n1", "ollama.pull", json!({"model": "tiny:1b"})).await;
    assert_eq!(pulled["state"], "succeeded", "{pulled}");
    assert_eq!(pulled["model"], "tiny:1b");
    assert!(names(&query(edge, "n1", "ollama.tags").await).contains(&"tiny:1b".to_string()));

    // n2: a pull answered at once, still running; the job goes on without the command
    // and `ollama.jobs` follows it to its end, its progress never going back.
    let started = admin(
        edge,
        "n2",
        "ollama.pull",
        json!({"model": "tiny:1b", "wait_ms": 0}),
    )
    .await;
    assert_eq!(started["state"], "running", "{started}");
    let mut seen: Vec<u64> = Vec::new();
    let finished = loop {
        let jobs = query(edge, "n2", "ollama.jobs").await;
        let job = jobs["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["id"] == started["id"])
            .cloned()
            .unwrap_or_else(|| panic!("{jobs}"));
        if let Some(done) = job["progress"]["completed"].as_u64()
            && job["progress"]["total"].as_u64() > Some(1000)
        {
            seen.push(done);
        }
        if job["state"] != "running" {
            break job;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(finished["state"], "succeeded", "{finished}");
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
    assert!(names(&query(edge, "n2", "ollama.tags").await).contains(&"tiny:1b".to_string()));

    // A pull whose stream from Ollama breaks off is issued again and resumes.
    let resumed = admin(
        edge,
        "n1",
        "ollama.pull",
        json!({"model": "drop-mid-pull:1b"}),
    )
    .await;
    assert_eq!(resumed["state"], "succeeded", "{resumed}");
    assert_eq!(resumed["attempts"], 2, "{resumed}");

    // Load and unload: `ollama.ps` shows the loaded model until it is unloaded.
    let loaded = admin(edge, "n1", "ollama.load", json!({"model": "tiny:1b"})).await;
    assert_eq!(loaded["done_reason"], "load", "{loaded}");
    let ps = query(edge, "n1", "ollama.ps").await;
    assert_eq!(names(&ps), ["tiny:1b"], "{ps}");
    assert!(ps["models"][0]["expires_at"].is_string(), "{ps}");
    let unloaded = admin(edge, "n1", "ollama.unload", json!({"model": "tiny:1b"})).await;
    assert_eq!(unloaded["done_reason"], "unload", "{unloaded}");
    assert!(names(&query(edge, "n1", "ollama.ps").await).is_empty());

    // Copy, and create from it with a system prompt and parameters.
    admin(
        edge,
        "n1",
        "ollama.copy",
        json!({"source": "tiny:1b", "destination": "tiny:copy"}),
    )
    .await;
    admin(
        edge,
        "n1",
        "ollama.create",
        json!({"model": "tiny-brief", "from": "tiny:copy", "system": "Be brief.",
               "parameters": {"temperature": 0.1}}),
    )
    .await;
    let shown = client()
        .get(format!(
            "{}&model=tiny-brief",
            command_url(edge, "n1", "ollama.show")
        ))
        .bearer_auth(TEST_API_KEY)
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(shown["system"], "Be brief.", "{shown}");
    assert_eq!(shown["parameters"]["temperature"], 0.1, "{shown}");

    // Delete; a second delete is Ollama's 404, with its message.
    admin(edge, "n1", "ollama.delete", json!({"model": "tiny:copy"})).await;
    let tags = names(&query(edge, "n1", "ollama.tags").await);
    assert!(!tags.contains(&"tiny:copy".to_string()), "{tags:?}");
    let (status, message) =
        failed(edge, "n1", "ollama.delete", json!({"model": "tiny:copy"})).await;
    assert_eq!(status, 404, "{message}");
    assert!(message.contains("not found"), "{message}");
}

#[tokio::test]
async fn failures_and_refusals_are_clear() {
    let s = setup().await;
    let edge = &s.edge;

    // An error line inside Ollama's 200 stream fails the pull with its text.
    let (_, message) = failed(edge, "n1", "ollama.pull", json!({"model": "missing-model"})).await;
    assert!(message.contains("file does not exist"), "{message}");
    // Half way through a download, too.
    let (_, message) = failed(
        edge,
        "n2",
        "ollama.pull",
        json!({"model": "error-mid-pull"}),
    )
    .await;
    assert!(message.contains("max retries exceeded"), "{message}");
    let jobs = query(edge, "n2", "ollama.jobs").await;
    assert_eq!(jobs["jobs"][0]["state"], "failed", "{jobs}");

    // Model names are checked on the node before Ollama sees them.
    let (status, message) = failed(
        edge,
        "n1",
        "ollama.pull",
        json!({"model": "../../etc/passwd"}),
    )
    .await;
    assert_eq!(status, 400, "{message}");
    assert!(message.contains("invalid model name"), "{message}");

    // Like every node command, the controls take their arguments in the query too, and
    // are admin only.
    let response = client()
        .get(format!(
            "{}&model=viaget:1b",
            command_url(edge, "n2", "ollama.pull")
        ))
        .bearer_auth(TEST_API_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let pulled: Value = response.json().await.unwrap();
    assert_eq!(pulled["state"], "succeeded", "{pulled}");
    let response = client()
        .get(format!(
            "{}&model=viaget:1b",
            command_url(edge, "n2", "ollama.delete")
        ))
        .bearer_auth(TEST_API_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let (status, _) = post(
        edge,
        "n1",
        "ollama.pull",
        json!({"model": "tiny"}),
        CLIENT_KEY,
    )
    .await;
    assert_eq!(status, 403);
    let (status, _) = post(
        edge,
        "n1",
        "ollama.delete",
        json!({"model": "mock-model"}),
        CLIENT_KEY,
    )
    .await;
    assert_eq!(status, 403);
    // Nothing was pulled or deleted by the refused calls.
    let tags = names(&query(edge, "n1", "ollama.tags").await);
    assert_eq!(tags, ["mock-model:latest"], "{tags:?}");

    // On an adapter that is not Ollama's: 501, as for the queries.
    let response = client()
        .post(edge.url("/v1/nodes/n1/commands/ollama.pull?adapter=mk"))
        .bearer_auth(TEST_API_KEY)
        .json(&json!({"model": "tiny"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 501);
    // A body that is not an object of arguments.
    let response = client()
        .post(command_url(edge, "n1", "ollama.pull"))
        .bearer_auth(TEST_API_KEY)
        .body("[1, 2]")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
}

/// The lines of an NDJSON body.
fn lines(body: &str) -> Vec<Value> {
    body.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// The model names the edge's `/api/tags` lists for `key`.
async fn edge_tags(edge: &EdgeProc, key: &str) -> Vec<String> {
    let tags: Value = client()
        .get(edge.url("/api/tags"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    names(&tags)
}

async fn fleet(
    edge: &EdgeProc,
    method: reqwest::Method,
    path: &str,
    body: Value,
    key: &str,
) -> reqwest::Response {
    client()
        .request(method, edge.url(path))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn an_admin_pulls_onto_the_fleet_and_clients_use_the_model_by_name() {
    let s = setup().await;
    let edge = &s.edge;

    // Ollama's own /api/pull on the edge: progress from both nodes, each naming its
    // target and never going back, one success per target, and a last plain success.
    let response = fleet(
        edge,
        reqwest::Method::POST,
        "/api/pull",
        json!({"model": "tiny:1b"}),
        TEST_API_KEY,
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/x-ndjson");
    let all = lines(&response.text().await.unwrap());
    assert_eq!(
        all.last().unwrap(),
        &json!({"status": "success"}),
        "{all:?}"
    );
    for node in ["n1", "n2"] {
        let own: Vec<&Value> = all.iter().filter(|l| l["node"] == node).collect();
        assert!(own.iter().all(|l| l["provider"] == "ol"), "{own:?}");
        assert_eq!(own.last().unwrap()["status"], "success", "{own:?}");
        let progress: Vec<(String, u64)> = own
            .iter()
            .filter_map(|l| Some((l["digest"].as_str()?.to_string(), l["completed"].as_u64()?)))
            .collect();
        assert!(!progress.is_empty(), "{own:?}");
        for pair in progress.windows(2) {
            if pair[0].0 == pair[1].0 {
                assert!(pair[0].1 <= pair[1].1, "{progress:?}");
            }
        }
    }

    // The model is a group of its own at once, on both nodes, in both catalogs.
    assert!(
        edge_tags(edge, CLIENT_KEY)
            .await
            .contains(&"tiny:1b".to_string())
    );
    let models: Value = client()
        .get(edge.url("/v1/models"))
        .bearer_auth(CLIENT_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["id"] == "tiny:1b"),
        "{models}"
    );
    let status = status(edge).await;
    let group = status["model_groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "tiny:1b")
        .cloned()
        .unwrap_or_else(|| panic!("{status}"));
    assert_eq!(group["members"].as_array().unwrap().len(), 2, "{group}");

    // Clients use it by name through Ollama's API and OpenAI's.
    let chat = fleet(edge, reqwest::Method::POST, "/api/chat",
        json!({"model": "tiny:1b", "stream": false, "messages": [{"role": "user", "content": "hi"}]}),
        CLIENT_KEY).await;
    assert_eq!(chat.status(), 200);
    let chat: Value = chat.json().await.unwrap();
    assert!(
        chat["message"]["content"]
            .as_str()
            .unwrap()
            .contains("Hello"),
        "{chat}"
    );
    let completion = fleet(
        edge,
        reqwest::Method::POST,
        "/v1/chat/completions",
        json!({"model": "tiny:1b", "messages": [{"role": "user", "content": "hi"}]}),
        CLIENT_KEY,
    )
    .await;
    assert_eq!(completion.status(), 200);
    let completion: Value = completion.json().await.unwrap();
    assert_eq!(completion["model"], "tiny:1b", "{completion}");

    // Deleted everywhere, it leaves the catalog; a second delete finds it nowhere.
    let deleted = fleet(
        edge,
        reqwest::Method::DELETE,
        "/api/delete",
        json!({"model": "tiny:1b"}),
        TEST_API_KEY,
    )
    .await;
    assert_eq!(deleted.status(), 200);
    let deleted: Value = deleted.json().await.unwrap();
    assert_eq!(deleted["results"].as_array().unwrap().len(), 2, "{deleted}");
    assert!(
        !edge_tags(edge, CLIENT_KEY)
            .await
            .contains(&"tiny:1b".to_string())
    );
    let again = fleet(
        edge,
        reqwest::Method::DELETE,
        "/api/delete",
        json!({"model": "tiny:1b"}),
        TEST_API_KEY,
    )
    .await;
    assert_eq!(again.status(), 404);
    let again: Value = again.json().await.unwrap();
    assert!(
        again["error"].as_str().unwrap().contains("not found"),
        "{again}"
    );
}

#[tokio::test]
async fn fleet_pulls_fail_clearly_outlive_their_client_and_need_an_admin() {
    let s = setup().await;
    let edge = &s.edge;

    // An error line inside Ollama's stream fails that target with its text, and the last
    // line says which targets failed.
    let response = fleet(
        edge,
        reqwest::Method::POST,
        "/api/pull?node=n2",
        json!({"model": "missing-model"}),
        TEST_API_KEY,
    )
    .await;
    assert_eq!(response.status(), 200);
    let all = lines(&response.text().await.unwrap());
    assert!(
        all.iter().all(|l| l.get("node").is_none_or(|n| n == "n2")),
        "{all:?}"
    );
    let last = all.last().unwrap();
    assert!(last["error"].as_str().unwrap().contains("n2/ol"), "{all:?}");
    assert!(
        last["error"]
            .as_str()
            .unwrap()
            .contains("file does not exist"),
        "{all:?}"
    );
    // Not streamed: the outcome alone, an error as a 500.
    let response = fleet(
        edge,
        reqwest::Method::POST,
        "/api/pull",
        json!({"model": "missing-model", "stream": false}),
        TEST_API_KEY,
    )
    .await;
    assert_eq!(response.status(), 500);

    // A client that leaves after the first line does not stop the pull: the model
    // arrives and becomes a group all the same.
    let mut response = fleet(
        edge,
        reqwest::Method::POST,
        "/api/pull",
        json!({"model": "left:1b"}),
        TEST_API_KEY,
    )
    .await;
    let first = response.chunk().await.unwrap().unwrap();
    assert!(
        !String::from_utf8_lossy(&first).contains("\"success\""),
        "{first:?}"
    );
    drop(response);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !edge_tags(edge, TEST_API_KEY)
        .await
        .contains(&"left:1b".to_string())
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the pull did not finish without its client"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for node in ["n1", "n2"] {
        assert!(names(&query(edge, node, "ollama.tags").await).contains(&"left:1b".to_string()));
    }

    // Client keys may not manage models, in Ollama's error shape; nothing happens.
    for (method, path) in [
        (reqwest::Method::POST, "/api/pull"),
        (reqwest::Method::DELETE, "/api/delete"),
        (reqwest::Method::POST, "/api/copy"),
        (reqwest::Method::POST, "/api/create"),
    ] {
        let response = fleet(
            edge,
            method,
            path,
            json!({"model": "left:1b", "source": "left:1b", "destination": "x", "from": "left:1b"}),
            CLIENT_KEY,
        )
        .await;
        assert_eq!(response.status(), 403, "{path}");
        let body: Value = response.json().await.unwrap();
        assert!(body["error"].as_str().unwrap().contains("admin"), "{body}");
    }
    assert!(names(&query(edge, "n1", "ollama.tags").await).contains(&"left:1b".to_string()));

    // Copy and create across the fleet, selected by header: only n1 gets them.
    let copied = client()
        .post(edge.url("/api/copy"))
        .bearer_auth(TEST_API_KEY)
        .header("x-iop-node", "n1")
        .json(&json!({"source": "left:1b", "destination": "right:1b"}))
        .send()
        .await
        .unwrap();
    assert_eq!(copied.status(), 200);
    assert!(names(&query(edge, "n1", "ollama.tags").await).contains(&"right:1b".to_string()));
    assert!(!names(&query(edge, "n2", "ollama.tags").await).contains(&"right:1b".to_string()));
    let created = fleet(
        edge,
        reqwest::Method::POST,
        "/api/create",
        json!({"model": "brief", "from": "left:1b", "system": "Be brief."}),
        TEST_API_KEY,
    )
    .await;
    assert_eq!(created.status(), 200);
    let tags = edge_tags(edge, TEST_API_KEY).await;
    assert!(
        tags.contains(&"brief".to_string()) && tags.contains(&"right:1b".to_string()),
        "{tags:?}"
    );
    // Nothing matches the selector: a clear error.
    let none = fleet(
        edge,
        reqwest::Method::POST,
        "/api/pull?node=ghost",
        json!({"model": "x"}),
        TEST_API_KEY,
    )
    .await;
    assert_eq!(none.status(), 503);
}

/// Runs `iop models ARGS` against the edge with the admin key: exit success and stdout.
async fn iop_models(edge: &EdgeProc, args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new(IOP)
        .arg("models")
        .args(args)
        .env("IOP_URL", edge.url(""))
        .env("IOP_API_KEY", TEST_API_KEY)
        .output()
        .await
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn jobs_sse_the_status_page_data_and_the_cli() {
    let s = setup().await;
    let edge = &s.edge;

    // A job started by the admin API, followed as SSE to its end.
    let started = fleet(
        edge,
        reqwest::Method::POST,
        "/admin/models/pull",
        json!({"model": "job:1b", "node": "n1"}),
        TEST_API_KEY,
    )
    .await;
    assert_eq!(started.status(), 202);
    let started: Value = started.json().await.unwrap();
    let id = started["job"]["id"].as_str().unwrap().to_string();
    assert_eq!(
        started["job"]["targets"].as_array().unwrap().len(),
        1,
        "{started}"
    );
    let events = client()
        .get(edge.url(&format!("/admin/jobs/{id}/events")))
        .bearer_auth(TEST_API_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(events.headers()["content-type"], "text/event-stream");
    let events = sse_events(&events.text().await.unwrap());
    assert!(
        events.iter().any(|(kind, _)| kind == "progress"),
        "{events:?}"
    );
    let (kind, data) = events.last().unwrap();
    assert_eq!(kind, "end");
    assert_eq!(
        serde_json::from_str::<Value>(data).unwrap(),
        json!({"status": "success"})
    );
    let job: Value = admin_get(edge, &format!("/admin/jobs/{id}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(job["job"]["targets"][0]["state"], "succeeded", "{job}");
    assert!(job["job"]["ended_unix_ms"].is_u64(), "{job}");
    assert_eq!(admin_get(edge, "/admin/jobs/nope").await.status(), 404);

    // The status snapshot shows the jobs and what each provider holds and has loaded.
    let chat = fleet(edge, reqwest::Method::POST, "/api/chat",
        json!({"model": "job:1b", "stream": false, "messages": [{"role": "user", "content": "hi"}]}),
        CLIENT_KEY).await;
    assert_eq!(chat.status(), 200);
    let ps: Value = client()
        .get(edge.url("/api/ps?fleet=true"))
        .bearer_auth(TEST_API_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let loaded: Vec<(&str, &str)> = ps["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["node"].as_str().unwrap(), m["name"].as_str().unwrap()))
        .collect();
    assert_eq!(loaded, [("n1", "job:1b")], "{ps}");
    let refused = client()
        .get(edge.url("/api/ps?fleet=true"))
        .bearer_auth(CLIENT_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    let snapshot = status(edge).await;
    assert!(
        snapshot["ollama"]["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|j| j["id"] == id.as_str()),
        "{snapshot}"
    );
    let n1 = snapshot["ollama"]["providers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["node"] == "n1")
        .cloned()
        .unwrap();
    assert!(
        n1["models"].as_array().unwrap().contains(&json!("job:1b")),
        "{n1}"
    );
    // What n1 has loaded, as the edge saw it when it last looked (a model operation
    // makes it look again).
    admin(edge, "n1", "ollama.load", json!({"model": "job:1b"})).await;
    fleet(
        edge,
        reqwest::Method::POST,
        "/api/copy",
        json!({"source": "job:1b", "destination": "job:copy"}),
        TEST_API_KEY,
    )
    .await;
    let snapshot = status(edge).await;
    let n1 = snapshot["ollama"]["providers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["node"] == "n1")
        .cloned()
        .unwrap();
    assert_eq!(n1["loaded"], json!(["job:1b"]), "{n1}");

    // The CLI: a pull with progress per target and exit 0; ls; ps; rm.
    let (ok, out, err) = iop_models(edge, &["pull", "cli:1b"]).await;
    assert!(ok, "{out}\n{err}");
    for target in ["n1/ol", "n2/ol"] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(target) && l.contains('%')),
            "{out}"
        );
        assert!(
            out.lines()
                .any(|l| l.starts_with(target) && l.ends_with("success")),
            "{out}"
        );
    }
    let (ok, out, err) = iop_models(edge, &["ls", "--node", "n2"]).await;
    assert!(ok, "{err}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("n2") && l.ends_with("cli:1b")),
        "{out}"
    );
    assert!(!out.lines().any(|l| l.starts_with("n1")), "{out}");
    let (ok, out, err) = iop_models(edge, &["ps"]).await;
    assert!(ok, "{err}");
    assert!(out.lines().any(|l| l.contains("job:1b")), "{out}");
    let (ok, out, err) = iop_models(edge, &["rm", "cli:1b"]).await;
    assert!(ok, "{err}");
    assert_eq!(
        out.lines().filter(|l| l.contains("deleted cli:1b")).count(),
        2,
        "{out}"
    );
    // A failed pull exits non-zero with Ollama's error.
    let (ok, _, err) = iop_models(edge, &["pull", "missing-model", "--node", "n1"]).await;
    assert!(!ok);
    assert!(err.contains("file does not exist"), "{err}");
}

#[tokio::test]
async fn a_listed_model_the_server_lacks_is_pulled_and_only_listed_models_are_served() {
    let dir = tempdir();
    let mock = start_mock(&["--pull-step-ms", "10"]).await;
    let config = format!(
        r#"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: ol, kind: ollama, base_url: "{}", models: ["wanted:1b", "mock-*"], reconcile: pull}}
"#,
        mock.ollama_base()
    );
    let edge = start_edge(dir.path(), &config).await;
    let _node = start_node("n1", dir.path(), &edge.nodes, "token-n1-0123456789", "");
    wait_ready(&edge, "n1").await;
    // Once the node is ready the edge sees `wanted:1b` missing and pulls it; the pattern
    // serves the mock's own model too, and nothing else is served.
    edge.proc
        .wait_line("(reconcile: pull): pulling it", Duration::from_secs(30))
        .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut tags = edge_tags(&edge, "").await;
        tags.sort();
        if tags == ["mock-model", "wanted:1b"] {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{tags:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_ollama_python_client_manages_the_fleets_models() {
    let test = "the ollama Python client managing the fleet's models";
    let Some(python) = common::sdk::python(test, &["ollama"]) else {
        return;
    };
    let s = setup().await;
    common::sdk::run_check(
        &python,
        &common::sdk::check_script("python/ollama_manage_check.py"),
        &[&format!("http://{}", s.edge.http), TEST_API_KEY],
    )
    .await;
}
