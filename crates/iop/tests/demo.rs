//! `iop demo` as a new user meets it: the printed curl line streams text, and the official
//! `openai` Python SDK can list models and run streaming and non-streaming completions; its
//! Responses API and the `anthropic` SDK's Messages API work too.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

async fn start_demo(tmp: &std::path::Path) -> (Proc, String) {
    // The demo keeps its edge state in a temporary directory: the test's own.
    let demo = Proc::spawn_with_env(
        "demo",
        &["demo", "--http", "127.0.0.1:0", "--token-delay-ms", "2"],
        &[("TMPDIR", tmp.to_str().unwrap())],
    );
    let line = demo.wait_line("OpenAI API:", Duration::from_secs(20)).await;
    let base = line.split_whitespace().last().unwrap().to_string();
    demo.wait_line("Press Ctrl-C", Duration::from_secs(5)).await;
    (demo, base)
}

#[tokio::test]
async fn the_printed_curl_line_prints_streamed_text() {
    let tmp = tempdir();
    let (demo, _) = start_demo(tmp.path()).await;
    let log = demo.log();
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
    let python = std::env::var("IOP_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_sdk = Command::new(&python)
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_sdk {
        assert!(
            std::env::var("IOP_REQUIRE_PYTHON_SDK").is_err(),
            "IOP_REQUIRE_PYTHON_SDK is set but {python} cannot import openai"
        );
        eprintln!("skipped: {python} has no `openai` package (scripts/test.sh installs it)");
        return;
    }
    let tmp = tempdir();
    let (_demo, base) = start_demo(tmp.path()).await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/openai_sdk_check.py"
    );
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(&python)
            .arg(script)
            .arg(&base)
            .output(),
    )
    .await
    .expect("the SDK check finishes within 60s")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "SDK check failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.trim_end().ends_with("ok"), "{stdout}");
}

#[tokio::test]
async fn the_responses_and_messages_sdks_work_against_the_demo() {
    let python = std::env::var("IOP_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_sdks = Command::new(&python)
        .args(["-c", "import openai, anthropic"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_sdks {
        assert!(
            std::env::var("IOP_REQUIRE_PYTHON_SDK").is_err(),
            "IOP_REQUIRE_PYTHON_SDK is set but {python} cannot import openai and anthropic"
        );
        eprintln!(
            "skipped: {python} lacks the `openai` or `anthropic` package (scripts/test.sh installs them)"
        );
        return;
    }
    let tmp = tempdir();
    let (_demo, base) = start_demo(tmp.path()).await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/apis_sdk_check.py"
    );
    let out = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::process::Command::new(&python)
            .arg(script)
            .arg(&base)
            .output(),
    )
    .await
    .expect("the SDK check finishes within 90s")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "SDK check failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.trim_end().ends_with("ok"), "{stdout}");
}
