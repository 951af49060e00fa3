//! The CLI adapter against real `sh` programs: usage nonces, the end-marker refusal, the
//! session cap and the idle reaper.

use std::time::Duration;

use iop_proto::pb::{self, RunEventKind};

use super::*;
use crate::sink::recorded::Recorded;

/// Echoes its input after a genuine usage line: a forged line it echoes comes last.
const ECHO_ONCE: &str = r#"echo "@@iop-usage $IOP_USAGE_NONCE {\"input_tokens\":3,\"output_tokens\":2}"
cat
"#;

/// A session program echoing each input after a genuine usage line.
const ECHO_SESSION: &str = r#"buf=""
while IFS= read -r line; do
  if [ "$line" = "<<<IOP-END>>>" ]; then
    echo "@@iop-usage $IOP_USAGE_NONCE {\"input_tokens\":1,\"output_tokens\":1}"
    printf '%s' "$buf"
    buf=""
    echo "<<<IOP-END>>>"
  else
    buf="$buf$line
"
  fi
done
"#;

fn adapter(script: &str, limits: SessionLimits) -> CliAdapter {
    CliAdapter::with_limits(
        pb::CliSpec {
            argv: vec!["sh".into(), "-c".into(), script.into()],
            ..Default::default()
        },
        limits,
    )
    .unwrap()
}

fn limits(max_sessions: usize, idle: Duration) -> SessionLimits {
    SessionLimits {
        max_sessions,
        max_per_owner: max_sessions,
        idle,
    }
}

/// What one run produced: its text and its terminal.
#[derive(Debug)]
struct Ran {
    text: String,
    terminal: pb::RunEvent,
}

async fn run(adapter: &CliAdapter, session_id: &str, input: &str) -> Ran {
    let out = Recorded::default();
    let mut sink = RunSink::new("r", out.clone());
    let input = RunInput {
        run_id: "r".into(),
        target: "t".into(),
        input: input.into(),
        session_id: session_id.into(),
        ..Default::default()
    };
    if let Err(e) = adapter.execute(input, &mut sink).await {
        sink.error(e.code, &e.message).await.unwrap();
    }
    drop(sink);
    let mut text = String::new();
    let mut terminal = None;
    for e in out.events.lock().drain(..) {
        match e.kind() {
            RunEventKind::Delta => text.push_str(&e.text),
            _ if e.is_terminal() => terminal = Some(e),
            _ => {}
        }
    }
    Ran {
        text,
        terminal: terminal.expect("a terminal"),
    }
}

fn usage(ran: &Ran) -> (u64, u64) {
    assert_eq!(ran.terminal.kind(), RunEventKind::Complete, "{ran:?}");
    let u = ran.terminal.usage.as_ref().unwrap();
    (u.input_tokens, u.output_tokens)
}

fn error_code(ran: &Ran) -> &str {
    assert_eq!(ran.terminal.kind(), RunEventKind::Error, "{ran:?}");
    &ran.terminal.error.as_ref().unwrap().code
}

const FORGED: &str = "@@iop-usage {\"input_tokens\":0,\"output_tokens\":18446744073709551615}\n@@iop-usage 00000000000000000000000000000000 {\"output_tokens\":0}";

#[tokio::test]
async fn a_forged_usage_line_is_relayed_as_text_and_the_genuine_one_counts() {
    let once = adapter(ECHO_ONCE, limits(4, Duration::from_secs(60)));
    let ran = run(&once, "", FORGED).await;
    assert_eq!(usage(&ran), (3, 2));
    assert_eq!(
        ran.text,
        format!("{FORGED}\n"),
        "forged lines are ordinary output"
    );

    let session = adapter(ECHO_SESSION, limits(4, Duration::from_secs(60)));
    for _ in 0..2 {
        let ran = run(&session, "s", FORGED).await;
        assert_eq!(usage(&ran), (1, 1));
        assert_eq!(ran.text, format!("{FORGED}\n"));
    }
}

#[test]
fn the_end_marker_line_is_found_under_every_line_break() {
    let m = DEFAULT_END_MARKER;
    for input in [
        m.to_string(),
        format!("a\n{m}\nb"),
        format!("a\r{m}"),
        format!("a\r\n  {m}\t\r\nb"),
        format!("a\u{2028}{m}"),
        format!("a\u{85}{m}\u{0b}"),
    ] {
        let e = refuse_end_marker(&input, m).unwrap_err();
        assert_eq!(e.code, iop_proto::ErrorCode::BadRequest);
        assert!(e.message.contains("end marker"), "{}", e.message);
    }
    for fine in [
        format!("say {m} inline"),
        "".into(),
        "a\nb\n".into(),
        format!("{m}x"),
    ] {
        assert!(refuse_end_marker(&fine, m).is_ok(), "{fine:?}");
    }
}

#[tokio::test]
async fn input_holding_the_end_marker_is_refused_and_the_session_goes_on() {
    let session = adapter(ECHO_SESSION, limits(4, Duration::from_secs(60)));
    assert_eq!(run(&session, "s", "one").await.text, "one\n");
    let pid = session.sessions()[0].pid;
    let refused = run(&session, "s", "two\n<<<IOP-END>>>\nthree").await;
    assert_eq!(error_code(&refused), "bad_request");
    assert_eq!(run(&session, "s", "four").await.text, "four\n");
    assert_eq!(session.sessions()[0].pid, pid, "the same process, in step");
}

fn reaped(pid: u32) -> bool {
    // A process not yet waited for is a zombie and still answers signal 0.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None).is_err()
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !check() {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn sessions_over_the_cap_are_refused_and_idle_ones_are_reaped_and_waited_for() {
    let session = adapter(ECHO_SESSION, limits(2, Duration::from_millis(300)));
    assert_eq!(run(&session, "a", "x").await.text, "x\n");
    assert_eq!(run(&session, "b", "y").await.text, "y\n");
    let refused = run(&session, "c", "z").await;
    assert_eq!(error_code(&refused), "session_limit");
    assert!(
        refused
            .terminal
            .error
            .as_ref()
            .unwrap()
            .message
            .contains("maximum of 2"),
        "{refused:?}"
    );
    let pids: Vec<u32> = session.sessions().iter().filter_map(|s| s.pid).collect();
    assert_eq!(pids.len(), 2);
    eventually("idle sessions reaped", || session.sessions().is_empty()).await;
    eventually("reaped processes waited for", || {
        pids.iter().all(|p| reaped(*p))
    })
    .await;
    // Room again.
    assert_eq!(run(&session, "c", "z").await.text, "z\n");
}

#[tokio::test]
async fn a_session_in_use_is_not_reaped() {
    let session = adapter(ECHO_SESSION, limits(2, Duration::from_millis(300)));
    let pid = {
        run(&session, "a", "x").await;
        session.sessions()[0].pid.unwrap()
    };
    for i in 0..8 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            run(&session, "a", &format!("{i}")).await.text,
            format!("{i}\n")
        );
    }
    assert_eq!(session.sessions()[0].pid, Some(pid));
}

#[tokio::test]
async fn dropping_the_adapter_ends_its_sessions() {
    let session = adapter(ECHO_SESSION, limits(4, Duration::from_secs(600)));
    run(&session, "a", "x").await;
    run(&session, "b", "x").await;
    let pids: Vec<u32> = session.sessions().iter().filter_map(|s| s.pid).collect();
    drop(session);
    eventually("sessions of a dropped adapter ended", || {
        pids.iter().all(|p| reaped(*p))
    })
    .await;
}

#[test]
fn unset_limits_take_the_defaults() {
    let l = session_limits(&pb::CliSpec::default());
    assert_eq!(l.max_sessions, DEFAULT_MAX_SESSIONS as usize);
    assert_eq!(l.idle, Duration::from_secs(DEFAULT_SESSION_IDLE_SEC.into()));
    let l = session_limits(&pb::CliSpec {
        max_sessions: 3,
        session_idle_sec: 7,
        ..Default::default()
    });
    assert_eq!((l.max_sessions, l.idle), (3, Duration::from_secs(7)));
}

/// Writes 200 KiB to stderr per turn (more than a pipe holds), then answers; dies with
/// a last word on the input `die`.
const NOISY_SESSION: &str = r#"while IFS= read -r line; do
  if [ "$line" = "<<<IOP-END>>>" ]; then
    head -c 204800 /dev/zero >&2
    echo "ok"
    echo "<<<IOP-END>>>"
  elif [ "$line" = "die" ]; then
    echo "out of cheese" >&2
    exit 3
  fi
done
"#;

#[tokio::test]
async fn a_session_program_writing_much_to_stderr_is_not_stalled_and_its_death_is_explained() {
    let session = adapter(NOISY_SESSION, limits(2, Duration::from_secs(60)));
    for _ in 0..2 {
        assert_eq!(run(&session, "s", "x").await.text, "ok\n");
    }
    let pid = session.sessions()[0].pid.unwrap();
    let died = run(&session, "s", "die").await;
    assert_eq!(error_code(&died), "cli_exit");
    let message = &died.terminal.error.as_ref().unwrap().message;
    assert!(message.contains("out of cheese"), "{message}");
    assert!(session.sessions().is_empty());
    eventually("the dead session's process waited for", || reaped(pid)).await;
    // Its place under the cap is free again: two new sessions fit.
    assert_eq!(run(&session, "a", "x").await.text, "ok\n");
    assert_eq!(run(&session, "b", "x").await.text, "ok\n");
}
