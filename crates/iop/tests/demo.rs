//! `iop demo` as a new user meets it: the printed curl line streams text, and the official
//! `openai` Python SDK can list and retrieve models and run streaming and non-streaming
//! completions; its Responses API and the `anthropic` SDK's Messages API work too, the
//! `ollama` Python client speaks its Ollama API, the OpenAI Node SDK streams chat, and the
//! calls Open WebUI makes to an OpenAI and an Ollama connection work.

mod common;

use std::process::Command;

use common::sdk::{self, Demo, check_script, run_check};
use common::*;

#[tokio::test]
async fn the_printed_curl_line_prints_streamed_text() {
    let demo = Demo::start().await;
    let log = demo.proc.log();
    let curl = log
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("curl "))
        .expect("the demo prints a curl line")
        .to_string();
    let out = Command::new("sh")
        .arg("-c")
        .arg(&curl)
        .output()
        .expect("run curl");
    assert!(
        out.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let body = String::from_utf8(out.stdout).unwrap();
    let text: String = sse_events(&body)
        .iter()
        .filter(|(_, d)| d != "[DONE]")
        .filter_map(|(_, d)| {
            let v: serde_json::Value = serde_json::from_str(d).ok()?;
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert!(
        text.split_whitespace().count() >= 10,
        "streamed text: {text:?}\n{body}"
    );
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
}

#[tokio::test]
async fn the_openai_python_sdk_works_against_the_demo() {
    let test = "the OpenAI Python SDK against the demo";
    let Some(python) = sdk::python(test, &["openai"]) else {
        return;
    };
    let demo = Demo::start().await;
    run_check(
        &python,
        &check_script("python/openai_sdk_check.py"),
        &[&demo.openai_base()],
    )
    .await;
}

#[tokio::test]
async fn the_responses_and_messages_sdks_work_against_the_demo() {
    let test = "the Responses and Messages SDKs against the demo";
    let Some(python) = sdk::python(test, &["openai", "anthropic"]) else {
        return;
    };
    let demo = Demo::start().await;
    run_check(
        &python,
        &check_script("python/apis_sdk_check.py"),
        &[&demo.openai_base()],
    )
    .await;
}

#[tokio::test]
async fn the_calls_open_webui_makes_work_against_the_demo() {
    let test = "Open WebUI's calls against the demo";
    let Some(python) = sdk::python(test, &["httpx"]) else {
        return;
    };
    let demo = Demo::start().await;
    run_check(
        &python,
        &check_script("python/open_webui_check.py"),
        &[&demo.root, "any-key"],
    )
    .await;
}

#[tokio::test]
async fn the_ollama_python_client_works_against_the_demo() {
    let test = "the ollama Python client against the demo";
    let Some(python) = sdk::python(test, &["ollama"]) else {
        return;
    };
    let demo = Demo::start().await;
    run_check(
        &python,
        &check_script("python/ollama_client_check.py"),
        &[&demo.root, "--chat=mock,mock-tunnel", "--embed=mock-tunnel"],
    )
    .await;
}

#[tokio::test]
async fn the_openai_node_sdk_streams_chat_from_the_demo() {
    let Some(dir) = sdk::node_sdk("the OpenAI Node SDK against the demo") else {
        return;
    };
    let demo = Demo::start().await;
    let out = run_check(
        "node",
        dir.join("openai_chat_check.mjs").to_str().unwrap(),
        &[&demo.openai_base()],
    )
    .await;
    assert!(out.contains("mock-tunnel:"), "{out}");
}
