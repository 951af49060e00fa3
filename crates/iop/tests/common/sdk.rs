//! Real clients in tests: `iop demo` started for one test, and the official client
//! libraries (Python packages from `IOP_PYTHON`'s environment, the OpenAI Node SDK
//! installed in `IOP_NODE_SDK_DIR`) run as child processes against an edge.
//! `scripts/test.sh` installs them (pinned) and sets `IOP_REQUIRE_PYTHON_SDK=1` /
//! `IOP_REQUIRE_NODE_SDK=1`, which turn a missing library into a failure instead of a skip.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use super::Proc;
use super::suite::notice;

/// A Python that can import every module of `modules`, or `None` after a notice (a panic
/// under `IOP_REQUIRE_PYTHON_SDK`).
pub fn python(test: &str, modules: &[&str]) -> Option<String> {
    let python = std::env::var("IOP_PYTHON").unwrap_or_else(|_| "python3".into());
    let import = format!("import {}", modules.join(", "));
    let has = Command::new(&python)
        .args(["-c", &import])
        .status()
        .is_ok_and(|s| s.success());
    if has {
        return Some(python);
    }
    assert!(
        std::env::var("IOP_REQUIRE_PYTHON_SDK").is_err(),
        "IOP_REQUIRE_PYTHON_SDK is set but {python} cannot `{import}`"
    );
    notice(&format!(
        "SKIPPED {test}: {python} cannot `{import}` (scripts/test.sh installs the pinned \
         packages of tests/python/requirements.txt)"
    ));
    None
}

/// The directory holding `node_modules/openai` (and the test scripts), or `None` after a
/// notice (a panic under `IOP_REQUIRE_NODE_SDK`).
pub fn node_sdk(test: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("IOP_NODE_SDK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/node")));
    let installed = dir.join("node_modules/openai/package.json").is_file();
    let node = Command::new("node")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if installed && node {
        return Some(dir);
    }
    assert!(
        std::env::var("IOP_REQUIRE_NODE_SDK").is_err(),
        "IOP_REQUIRE_NODE_SDK is set but {} (node found: {node})",
        if installed {
            "node does not run".to_string()
        } else {
            format!("{} has no node_modules/openai", dir.display())
        }
    );
    notice(&format!(
        "SKIPPED {test}: no Node.js or no OpenAI Node SDK in {} (scripts/test.sh installs it)",
        dir.display()
    ));
    None
}

/// A running `iop demo`: models `mock` (rendered runs) and `mock-tunnel` (a tunnelled
/// OpenAI-compatible provider).
pub struct Demo {
    pub proc: Proc,
    /// `http://127.0.0.1:<port>`.
    pub root: String,
    _tmp: tempfile::TempDir,
}

impl Demo {
    pub async fn start() -> Demo {
        let tmp = super::tempdir();
        // The demo keeps its edge state in a temporary directory: the test's own.
        let proc = Proc::spawn_with_env(
            "demo",
            &["demo", "--http", "127.0.0.1:0", "--token-delay-ms", "2"],
            &[("TMPDIR", tmp.path().to_str().unwrap())],
        );
        let line = proc.wait_line("OpenAI API:", Duration::from_secs(20)).await;
        let base = line.split_whitespace().last().unwrap().to_string();
        proc.wait_line("Press Ctrl-C", Duration::from_secs(5)).await;
        let root = base.trim_end_matches("/v1").to_string();
        Demo {
            proc,
            root,
            _tmp: tmp,
        }
    }

    /// The OpenAI API root (`.../v1`).
    pub fn openai_base(&self) -> String {
        format!("{}/v1", self.root)
    }
}

/// Runs a client check program (`program script args...`, at most 2 minutes); it must
/// exit 0 with `ok` as its last line. Returns its output.
pub async fn run_check(program: &str, script: &str, args: &[&str]) -> String {
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(program)
            .arg(script)
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("{script} did not finish within 120 s"))
    .unwrap_or_else(|e| panic!("run {program} {script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && stdout.trim_end().ends_with("ok"),
        "{script} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The path of a check program under `crates/iop/tests/` (e.g. `python/openai_sdk_check.py`).
pub fn check_script(relative: &str) -> String {
    format!("{}/tests/{relative}", env!("CARGO_MANIFEST_DIR"))
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
