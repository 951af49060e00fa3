//! The ledger end to end on a real SQLite file: records survive a reopen, summaries and
//! raw records read back what was written, a file of the previous schema is brought up to
//! date, retention deletes old rows, and a full queue counts drops instead of blocking the
//! caller.

use std::time::Duration;

use super::query::{self, Bucket, Filter, OutcomeFilter, Per};
use super::*;

const HOUR: i64 = 3_600_000;
const T0: i64 = 1_700_000_000_000 / HOUR * HOUR;

fn record(key: &str, group: &str, time_ms: i64, outcome: &str, output: u64) -> UsageRecord {
    UsageRecord::sample(key, group, time_ms, outcome, output)
}

fn all_time() -> Filter {
    Filter {
        since_ms: 0,
        until_ms: i64::MAX,
        ..Filter::default()
    }
}

#[tokio::test]
async fn records_survive_a_reopen_and_read_back_summed_and_raw() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(dir.path(), 3650).unwrap();
    let written = [
        record("alice", "g", T0 + 10, "ok", 16),
        record("alice", "g", T0 + HOUR + 10, "ok", 16),
        record("alice", "h", T0 + 20, "provider_error", 0),
        record("bob", "g", T0 + 30, "client_abort", 5),
    ];
    for r in &written {
        assert!(ledger.push(r.clone()));
    }
    ledger.close(Duration::from_secs(30)).await;
    assert_eq!((ledger.written(), ledger.dropped()), (4, 0));
    // After the close a record is counted, not lost quietly.
    assert!(!ledger.push(written[0].clone()));
    assert_eq!(ledger.dropped(), 1);
    let mode = std::fs::metadata(dir.path().join(store::FILE_NAME))
        .unwrap()
        .permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
        0o600
    );

    let ledger = Ledger::open(dir.path(), 3650).unwrap();
    let (rows, truncated) = ledger
        .read(|c| query::summarize(c, &all_time(), Bucket::Total, &[Per::Key], 100))
        .await
        .unwrap();
    assert!(!truncated);
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].per, ["alice"]);
    assert_eq!((rows[0].requests, rows[0].ok, rows[0].failed), (3, 2, 1));
    assert_eq!((rows[0].input_tokens, rows[0].output_tokens), (9, 32));
    assert_eq!(rows[0].reasoning_tokens, 3);
    assert_eq!((rows[1].per[0].as_str(), rows[1].failed), ("bob", 1));

    let (rows, _) = ledger
        .read(|c| query::summarize(c, &all_time(), Bucket::Hour, &[Per::Group, Per::Key], 100))
        .await
        .unwrap();
    let shape: Vec<(i64, Vec<String>, u64)> = rows
        .iter()
        .map(|r| (r.start_ms.unwrap(), r.per.clone(), r.requests))
        .collect();
    assert_eq!(
        shape,
        [
            (T0, vec!["g".into(), "alice".into()], 1),
            (T0, vec!["g".into(), "bob".into()], 1),
            (T0, vec!["h".into(), "alice".into()], 1),
            (T0 + HOUR, vec!["g".into(), "alice".into()], 1),
        ]
    );
    // Capped rows say so.
    let (rows, truncated) = ledger
        .read(|c| query::summarize(c, &all_time(), Bucket::Hour, &[Per::Key], 1))
        .await
        .unwrap();
    assert_eq!((rows.len(), truncated), (1, true));

    let failed = Filter {
        outcome: Some(OutcomeFilter::Failed),
        ..all_time()
    };
    let raw = ledger
        .read(move |c| query::records(c, &failed, 10))
        .await
        .unwrap();
    assert_eq!(
        raw,
        [written[3].clone(), written[2].clone()],
        "newest first"
    );
    let alice_g = Filter {
        key: Some("alice".into()),
        group: Some("g".into()),
        since_ms: T0 + HOUR,
        ..all_time()
    };
    let raw = ledger
        .read(move |c| query::records(c, &alice_g, 10))
        .await
        .unwrap();
    assert_eq!(raw, [written[1].clone()]);
    let mut tokens = ledger.tokens_since(T0 + 15);
    tokens.sort();
    assert_eq!(tokens, [("alice".into(), 22), ("bob".into(), 8)]);
    ledger.close(Duration::from_secs(30)).await;
}

#[tokio::test]
async fn a_ledger_from_before_routing_was_recorded_opens_and_sums_per_routing() {
    let dir = tempfile::tempdir().unwrap();
    // A version 2 file, as the previous release wrote it, with one record.
    {
        let conn = rusqlite::Connection::open(dir.path().join(store::FILE_NAME)).unwrap();
        conn.execute_batch(
            "CREATE TABLE requests (id INTEGER PRIMARY KEY, time_ms INTEGER NOT NULL,
                key TEXT NOT NULL, grp TEXT NOT NULL, node TEXT NOT NULL,
                provider TEXT NOT NULL, path TEXT NOT NULL, api TEXT NOT NULL,
                input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
                reasoning_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
                est_input_tokens INTEGER, est_output_tokens INTEGER,
                latency_ms INTEGER NOT NULL, ttft_ms INTEGER, outcome TEXT NOT NULL,
                status INTEGER NOT NULL, attempts INTEGER NOT NULL);
             INSERT INTO requests VALUES (1, 1600000000000, 'alice', 'g', 'n1', 'p1',
                'tunnel', 'openai', 3, 5, 0, 0, NULL, NULL, 12, 4, 'ok', 200, 1);
             PRAGMA user_version = 2;",
        )
        .unwrap();
    }
    let ledger = Ledger::open(dir.path(), 3650).unwrap();
    let mut hit = record("alice", "g", T0 + 10, "ok", 16);
    hit.routing = "session/hit";
    hit.cached_tokens = 2;
    let mut cold = record("alice", "g", T0 + 20, "ok", 16);
    cold.routing = "prefix/cold";
    for r in [&hit, &hit, &cold] {
        assert!(ledger.push(r.clone()));
    }
    ledger.close(Duration::from_secs(30)).await;

    let ledger = Ledger::open(dir.path(), 3650).unwrap();
    let (rows, _) = ledger
        .read(|c| query::summarize(c, &all_time(), Bucket::Total, &[Per::Routing], 100))
        .await
        .unwrap();
    let by_routing: Vec<(String, u64, u64)> = rows
        .iter()
        .map(|r| (r.per[0].clone(), r.requests, r.cached_tokens))
        .collect();
    assert_eq!(
        by_routing,
        [
            (String::new(), 1, 0),
            ("prefix/cold".into(), 1, 0),
            ("session/hit".into(), 2, 4),
        ]
    );
    let raw = ledger
        .read(|c| query::records(c, &all_time(), 10))
        .await
        .unwrap();
    let routing: Vec<&str> = raw.iter().map(|r| r.routing).collect();
    assert_eq!(routing, ["prefix/cold", "session/hit", "session/hit", ""]);
    ledger.close(Duration::from_secs(30)).await;
}

#[tokio::test]
async fn retention_deletes_old_rows_when_the_writer_starts() {
    let dir = tempfile::tempdir().unwrap();
    let now = unix_ms_now();
    let ledger = Ledger::open(dir.path(), 3650).unwrap();
    ledger.push(record("a", "g", now - 10 * DAY, "ok", 1));
    ledger.push(record("a", "g", now - DAY, "ok", 1));
    ledger.close(Duration::from_secs(30)).await;
    // Reopened with a 5-day retention: the writer prunes as it starts.
    let ledger = Ledger::open(dir.path(), 5).unwrap();
    assert!(ledger.flush(Duration::from_secs(30)).await);
    let left = ledger
        .read(|c| query::records(c, &all_time(), 10))
        .await
        .unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].time_ms, now - DAY);
    ledger.close(Duration::from_secs(30)).await;
}

const DAY: i64 = 86_400_000;

#[tokio::test]
async fn a_full_queue_counts_drops_instead_of_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open_with_queue(dir.path(), 3650, 4).unwrap();
    // Another connection holds the write lock: the writer's first commit waits on it, so
    // nothing leaves the queue while the records below are pushed.
    let blocker = rusqlite::Connection::open(dir.path().join(store::FILE_NAME)).unwrap();
    blocker.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let total = 5_000u64;
    let mut queued = 0u64;
    for i in 0..total {
        if ledger.push(record("k", "g", T0 + i as i64, "ok", 1)) {
            queued += 1;
        }
    }
    // Pushing returned for every record although the writer is stuck.
    assert!(ledger.dropped() > 0, "the queue of 4 never filled");
    assert_eq!(queued + ledger.dropped(), total);
    blocker.execute_batch("COMMIT").unwrap();
    ledger.close(Duration::from_secs(60)).await;
    // Every record was either written or counted.
    assert_eq!(ledger.written() + ledger.dropped(), total);
    assert_eq!(ledger.written(), queued);
}

/// Not a check: `scripts/bench-ledger.sh` runs it (release build) to measure how many
/// records per second the writer commits, sustained.
#[tokio::test]
#[ignore]
async fn write_throughput() {
    let total: usize = std::env::var("IOP_LEDGER_BENCH_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let dir = tempfile::tempdir().unwrap();
    // A queue that holds every record, so the producer never waits and nothing is dropped:
    // the time measured is the writer's.
    let ledger = Ledger::open_with_queue(dir.path(), 3650, total).unwrap();
    let started = std::time::Instant::now();
    for i in 0..total {
        let key = ["alice", "bob", "carol", "dave"][i % 4];
        assert!(ledger.push(record(key, "g", T0 + i as i64, "ok", 16)));
    }
    let pushed = started.elapsed();
    ledger.close(Duration::from_secs(600)).await;
    let elapsed = started.elapsed();
    assert_eq!(ledger.written(), total as u64);
    println!(
        "ledger write throughput: {total} records in {:.2} s = {:.0} records/s (pushing took {:.0} ns/record)",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64(),
        pushed.as_nanos() as f64 / total as f64
    );
}
