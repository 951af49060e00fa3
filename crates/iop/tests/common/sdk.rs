//! Running the Python scripts in `tests/python/` against a running edge with the official
//! `openai` SDK (the Python from `IOP_PYTHON`, which `scripts/test.sh` provides).

use std::time::Duration;

/// The Python with the `openai` SDK (`IOP_PYTHON`, else python3), or None when it has no
/// SDK (an error when `IOP_REQUIRE_PYTHON_SDK` is set).
pub fn python_with_openai() -> Option<String> {
    let python = std::env::var("IOP_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_sdk = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if has_sdk {
        return Some(python);
    }
    assert!(
        std::env::var("IOP_REQUIRE_PYTHON_SDK").is_err(),
        "IOP_REQUIRE_PYTHON_SDK is set but {python} cannot import openai"
    );
    eprintln!("SDK part skipped: {python} has no `openai` package (scripts/test.sh installs it)");
    None
}

/// Runs `tests/python/<script>` with `args`, bounded by `within`; returns whether it
/// exited 0, and its stdout and stderr.
pub async fn run_python(
    python: &str,
    script: &str,
    args: &[&str],
    within: Duration,
) -> (bool, String, String) {
    let path = format!("{}/tests/python/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = tokio::time::timeout(
        within,
        tokio::process::Command::new(python)
            .arg(path)
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("{script} did not finish within {within:?}"))
    .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
