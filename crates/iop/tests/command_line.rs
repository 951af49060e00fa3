//! The command line as an operator meets it: `--check` validates a config and touches
//! nothing, `--log-format json` writes one JSON object per log line, `iop completions`
//! prints shell completion scripts, and a closed stdout (`iop status | head`) ends a
//! command quietly instead of a panic. Real `iop` processes.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{IOP, free_addr, tempdir};
use serde_json::Value;

fn iop(dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(IOP)
        .args(args)
        .current_dir(dir)
        .env("RUST_LOG", "info")
        .output()
        .expect("iop runs")
}

fn edge_config(dir: &std::path::Path) -> String {
    format!(
        r#"
listen: {{nodes: "{nodes}", http: "{http}"}}
state_dir: "{state}"
nodes:
  - id: n1
    token: token-n1-0123456789
    providers:
      - {{id: m, kind: mock}}
model_groups:
  - {{name: mock, members: [{{node: n1, provider: m}}]}}
"#,
        nodes = free_addr(),
        http = free_addr(),
        state = dir.join("state").display(),
    )
}

#[test]
fn check_validates_a_config_and_touches_nothing() {
    let dir = tempdir();
    std::fs::write(dir.path().join("edge.yaml"), edge_config(dir.path())).unwrap();
    let out = iop(dir.path(), &["edge", "--check", "--config", "edge.yaml"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains("edge config ok"), "{stdout}");
    assert!(
        stdout.contains("1 nodes, 1 providers, 1 model groups"),
        "{stdout}"
    );
    // No state directory, no CA, no ledger: only the config is there.
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(files, ["edge.yaml"], "nothing was written");

    // A bad config exits 2 naming the field.
    std::fs::write(
        dir.path().join("bad.yaml"),
        "nodes: [{id: n1, token: short, providers: []}]\n",
    )
    .unwrap();
    let out = iop(dir.path(), &["edge", "--check", "--config", "bad.yaml"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("nodes[0].token"), "{stderr}");

    // The node: what it would dial, and no run store created.
    let pin = format!("sha256:{}", "A".repeat(43));
    let node = [
        "node",
        "--check",
        "--edge",
        "127.0.0.1:7700",
        "--token",
        "abcdefghijklmnopq",
        "--edge-pin",
    ];
    let out = iop(dir.path(), &[&node[..], &[pin.as_str()]].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains("node config ok: would dial 127.0.0.1:7700"),
        "{stdout}"
    );
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(files.len(), 2, "no run store: {files:?}");
    let out = iop(dir.path(), &[&node[..], &["sha256:short"]].concat());
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("edge_pin"),
        "{out:?}"
    );
}

#[test]
fn json_logs_are_one_object_per_line() {
    let dir = tempdir();
    std::fs::write(dir.path().join("edge.yaml"), edge_config(dir.path())).unwrap();
    let mut edge = Command::new(IOP)
        .args(["--log-format", "json", "edge", "--config", "edge.yaml"])
        .current_dir(dir.path())
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(edge.stderr.take().unwrap());
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    for line in stderr.lines() {
        let line = line.unwrap();
        let listening = line.contains("edge listening");
        lines.push(line);
        if listening || Instant::now() > deadline {
            break;
        }
    }
    let _ = edge.kill();
    let _ = edge.wait();
    assert!(lines.len() >= 2, "{lines:?}");
    for line in &lines {
        let object: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(
            object["timestamp"].is_string() && object["level"].is_string(),
            "{line}"
        );
        assert!(object["fields"]["message"].is_string(), "{line}");
    }
    // A command that fails says why in JSON too.
    let out = iop(
        dir.path(),
        &["--log-format", "json", "edge", "--config", "missing.yaml"],
    );
    assert_eq!(out.status.code(), Some(2));
    let last = String::from_utf8_lossy(&out.stderr)
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    let object: Value = serde_json::from_str(&last).unwrap_or_else(|e| panic!("{e}: {last}"));
    assert_eq!(object["level"], "ERROR", "{last}");
    assert!(
        object["fields"]["message"]
            .as_str()
            .unwrap()
            .contains("missing.yaml"),
        "{last}"
    );
}

#[test]
fn completions_are_printed_for_bash_and_zsh() {
    let dir = tempdir();
    for (shell, marker) in [("bash", "complete -F _iop"), ("zsh", "#compdef iop")] {
        let out = iop(dir.path(), &["completions", shell]);
        assert!(out.status.success(), "{out:?}");
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(script.contains(marker), "{shell}: {script}");
        assert!(
            script.contains("join-token") && script.contains("--log-format"),
            "{shell}"
        );
    }
}

#[test]
fn a_closed_stdout_ends_a_command_quietly() {
    let dir = tempdir();
    // The reading end is closed before the command writes a byte (`iop … | true`).
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    for args in [&["completions", "bash"][..], &["usage", "--help"][..]] {
        let out = Command::new(IOP)
            .args(args)
            .current_dir(dir.path())
            .stdout(writer.try_clone().unwrap())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("panicked"),
            "{out:?}"
        );
    }
}
