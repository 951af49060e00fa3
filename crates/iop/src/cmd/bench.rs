//! `iop bench`: drives concurrent chat completions at one or more OpenAI-compatible
//! endpoints and reports p50/p99 latency, p50/p99 time to first token and requests/s.
//!
//! With several `--target`s the rounds are interleaved (a slice of each target in turn),
//! so machine noise lands on all of them alike, and every target after the first is also
//! reported against the first (the baseline): added milliseconds and the ratio.
//!
//! `--cpu NAME=PID,…` also reports the CPU time and context switches per request of the
//! processes serving a target ([`super::bench_cpu`]).
//!
//! `--scenario sessions` plays multi-turn conversations instead ([`super::bench_sessions`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::json;

use super::bench_cpu;
use super::bench_percentile::percentile;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// An endpoint to test, `NAME=URL` with URL the API root (e.g.
    /// `direct=http://127.0.0.1:8000/v1`). Repeat to compare; the first is the baseline.
    #[arg(long = "target", required = true, value_name = "NAME=URL")]
    targets: Vec<String>,
    /// Model to request.
    #[arg(long, default_value = "mock-model")]
    model: String,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Requests per target and mode.
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Interleaved rounds the requests are split into.
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Requests per target sent first and not measured.
    #[arg(long, default_value_t = 200)]
    warmup: usize,
    /// Which modes to run.
    #[arg(long, value_enum, default_value = "both")]
    mode: Modes,
    /// API key sent as a bearer token.
    #[arg(long, env = "IOP_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// What to send: `relay` (one short prompt, again and again: what the relay costs) or
    /// `sessions` (multi-turn conversations sharing long system prompts: what cache-affine
    /// routing buys; a target may name its model, `NAME=URL#MODEL`) or `streams`
    /// (--requests streams opened at once per target: how many an endpoint holds).
    #[arg(long, value_enum, default_value = "relay")]
    scenario: Scenario,
    /// sessions: conversations per target.
    #[arg(long, default_value_t = 64)]
    sessions: usize,
    /// sessions: turns per conversation.
    #[arg(long, default_value_t = 8)]
    turns: usize,
    /// sessions: distinct system prompts the conversations share.
    #[arg(long, default_value_t = 4)]
    system_prompts: usize,
    /// sessions: tokens per system prompt.
    #[arg(long, default_value_t = 2000)]
    system_tokens: usize,
    /// sessions: tokens of each new user message.
    #[arg(long, default_value_t = 400)]
    turn_tokens: usize,
    /// sessions: the share of conversations that name their session (prompt_cache_key);
    /// the others steer by their prompt alone.
    #[arg(long, default_value_t = 0.5)]
    keyed: f64,
    /// sessions: mean pause between a turn's answer and the next turn, in milliseconds.
    #[arg(long, default_value_t = 300)]
    think_ms: u64,
    /// streams: open the streams evenly over this many milliseconds (0: all at once).
    #[arg(long, default_value_t = 0)]
    ramp_ms: u64,
    /// relay: `NAME=PID[,PID...]`, the processes that serve target NAME and nothing else
    /// (e.g. its edge and node, or a router; not a backend every target shares). Their
    /// CPU time and context switches over the target's measured rounds are reported per
    /// request (Linux). Repeat per target.
    #[arg(long = "cpu", value_name = "NAME=PID,...")]
    cpu: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Scenario {
    Relay,
    Sessions,
    Streams,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Modes {
    Stream,
    NonStream,
    Both,
}

#[derive(Debug, Clone)]
struct Target {
    name: String,
    url: String,
}

#[derive(Debug, Default)]
struct Samples {
    latency: Vec<Duration>,
    ttft: Vec<Duration>,
    errors: usize,
    elapsed: Duration,
    requests: usize,
    /// What the target's `--cpu` processes used over its measured rounds.
    used: Option<bench_cpu::Usage>,
}

// Over 100 lines: the benchmark's script, read top to bottom: targets, warm-up, the
// interleaved rounds, the tables; its measuring parts are functions of their own.
pub async fn run(args: Args) -> super::Result {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let targets: Vec<Target> = args
        .targets
        .iter()
        .map(|t| match t.split_once('=') {
            Some((name, url)) => Ok(Target {
                name: name.to_string(),
                url: url.trim_end_matches('/').to_string(),
            }),
            None => Err(format!("--target {t:?} must be NAME=URL")),
        })
        .collect::<Result<_, _>>()?;
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .no_proxy()
        .pool_max_idle_per_host(args.concurrency * 2)
        .build()?;
    match args.scenario {
        Scenario::Sessions => return sessions(&client, &targets, &args).await,
        Scenario::Streams => return streams(&targets, &args).await,
        Scenario::Relay => {}
    }
    let modes: &[bool] = match args.mode {
        Modes::Stream => &[true],
        Modes::NonStream => &[false],
        Modes::Both => &[false, true],
    };
    let watched = watched_pids(&args.cpu, &targets)?;
    let settle = if watched.iter().any(Option::is_some) {
        SETTLE
    } else {
        Duration::ZERO
    };
    let rounds = args.rounds.max(1);
    let per_round = args.requests.div_ceil(rounds);
    let mut report = Vec::new();
    for &stream in modes {
        for t in &targets {
            drive(&client, t, &args, stream, args.warmup).await;
        }
        let mut samples: Vec<Samples> = targets.iter().map(|_| Samples::default()).collect();
        // A target's processes serve it alone, so what they use from before its first
        // measured round to after its last (work they finish late included) is its own.
        tokio::time::sleep(settle).await;
        let before = cpu_of(&watched)?;
        for _ in 0..rounds {
            for (t, s) in targets.iter().zip(samples.iter_mut()) {
                let r = drive(&client, t, &args, stream, per_round).await;
                s.latency.extend(r.latency);
                s.ttft.extend(r.ttft);
                s.errors += r.errors;
                s.elapsed += r.elapsed;
                s.requests += r.requests;
            }
        }
        tokio::time::sleep(settle).await;
        for ((s, after), before) in samples.iter_mut().zip(cpu_of(&watched)?).zip(before) {
            s.used = after.zip(before).map(|(a, b)| a.since(b));
        }
        for (t, mut s) in targets.iter().zip(samples) {
            s.latency.sort();
            s.ttft.sort();
            let per_request = |x: f64| x / s.requests.max(1) as f64;
            report.push(json!({
                "target": t.name,
                "url": t.url,
                "mode": if stream { "stream" } else { "non-stream" },
                "requests": s.requests,
                "errors": s.errors,
                "rps": s.requests as f64 / s.elapsed.as_secs_f64(),
                "p50_ms": percentile(&s.latency, 50.0),
                "p99_ms": percentile(&s.latency, 99.0),
                "ttft_p50_ms": if stream { percentile(&s.ttft, 50.0) } else { f64::NAN },
                "ttft_p99_ms": if stream { percentile(&s.ttft, 99.0) } else { f64::NAN },
                "cpu_us_per_request": s.used.map(|u| per_request(u.cpu.as_secs_f64() * 1e6)),
                "switches_per_request": s.used.map(|u| per_request(u.switches as f64)),
            }));
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "concurrency {}, {} requests per target and mode in {rounds} interleaved rounds, model {}",
        args.concurrency, args.requests, args.model
    );
    println!(
        "| target | mode | requests | errors | req/s | p50 ms | p99 ms | TTFT p50 ms | TTFT p99 ms |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let ms = |v: &serde_json::Value| match v.as_f64() {
        Some(x) if x.is_finite() => format!("{x:.3}"),
        _ => "-".into(),
    };
    for r in &report {
        println!(
            "| {} | {} | {} | {} | {:.0} | {} | {} | {} | {} |",
            r["target"].as_str().unwrap_or(""),
            r["mode"].as_str().unwrap_or(""),
            r["requests"],
            r["errors"],
            r["rps"].as_f64().unwrap_or(0.0),
            ms(&r["p50_ms"]),
            ms(&r["p99_ms"]),
            ms(&r["ttft_p50_ms"]),
            ms(&r["ttft_p99_ms"]),
        );
    }
    if targets.len() > 1 {
        println!();
        println!(
            "| vs {} | mode | added p50 ms | p50 ratio | added TTFT p50 ms | TTFT p50 ratio | req/s ratio |",
            targets[0].name
        );
        println!("|---|---|---:|---:|---:|---:|---:|");
        for chunk in report.chunks(targets.len()) {
            let base = &chunk[0];
            for r in &chunk[1..] {
                let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
                let b = |k: &str| base[k].as_f64().unwrap_or(f64::NAN);
                let fmt = |x: f64, digits: usize| {
                    if x.is_finite() {
                        format!("{x:.digits$}")
                    } else {
                        "-".into()
                    }
                };
                println!(
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    r["target"].as_str().unwrap_or(""),
                    r["mode"].as_str().unwrap_or(""),
                    fmt(f("p50_ms") - b("p50_ms"), 3),
                    fmt(f("p50_ms") / b("p50_ms"), 2),
                    fmt(f("ttft_p50_ms") - b("ttft_p50_ms"), 3),
                    fmt(f("ttft_p50_ms") / b("ttft_p50_ms"), 2),
                    fmt(f("rps") / b("rps"), 2),
                );
            }
        }
    }
    if !settle.is_zero() {
        println!();
        println!("| target | mode | CPU µs per request | context switches per request |");
        println!("|---|---|---:|---:|");
        for r in report.iter().filter(|r| !r["cpu_us_per_request"].is_null()) {
            println!(
                "| {} | {} | {:.1} | {:.2} |",
                r["target"].as_str().unwrap_or(""),
                r["mode"].as_str().unwrap_or(""),
                r["cpu_us_per_request"].as_f64().unwrap_or(f64::NAN),
                r["switches_per_request"].as_f64().unwrap_or(f64::NAN),
            );
        }
    }
    Ok(())
}

/// How long a target's processes are given to finish what its requests left them (a
/// ledger batch) before their CPU is read.
const SETTLE: Duration = Duration::from_millis(300);

/// The `--cpu` processes of each target, in target order.
fn watched_pids(args: &[String], targets: &[Target]) -> Result<Vec<Option<Vec<u32>>>, String> {
    let mut watched = vec![None; targets.len()];
    for arg in args {
        let watch = bench_cpu::Watch::parse(arg)?;
        let i = targets
            .iter()
            .position(|t| t.name == watch.target)
            .ok_or_else(|| format!("--cpu {arg:?} names no --target"))?;
        watched[i] = Some(watch.pids);
    }
    Ok(watched)
}

/// What each target's processes used so far.
fn cpu_of(watched: &[Option<Vec<u32>>]) -> std::io::Result<Vec<Option<bench_cpu::Usage>>> {
    watched
        .iter()
        .map(|pids| pids.as_deref().map(bench_cpu::read).transpose())
        .collect()
}

/// Sends `count` requests to `target` with `args.concurrency` workers.
async fn drive(
    client: &reqwest::Client,
    target: &Target,
    args: &Args,
    stream: bool,
    count: usize,
) -> Samples {
    let next = Arc::new(AtomicUsize::new(0));
    let url = format!("{}/chat/completions", target.url);
    let mut body = json!({
        "model": args.model,
        "messages": [{"role": "user", "content": "Say something short."}],
        "stream": stream,
    });
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    let body = Arc::new(serde_json::to_vec(&body).expect("serializable"));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..args.concurrency.max(1) {
        let (client, next, url, body, key) = (
            client.clone(),
            next.clone(),
            url.clone(),
            body.clone(),
            args.api_key.clone(),
        );
        workers.spawn(async move {
            let mut s = Samples::default();
            while next.fetch_add(1, Ordering::Relaxed) < count {
                let t0 = Instant::now();
                let mut request = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body((*body).clone());
                if let Some(k) = &key {
                    request = request.bearer_auth(k);
                }
                match one(request, stream, t0).await {
                    Some((latency, ttft)) => {
                        s.latency.push(latency);
                        if let Some(t) = ttft {
                            s.ttft.push(t);
                        }
                    }
                    None => s.errors += 1,
                }
                s.requests += 1;
            }
            s
        });
    }
    let mut all = Samples::default();
    while let Some(Ok(s)) = workers.join_next().await {
        all.latency.extend(s.latency);
        all.ttft.extend(s.ttft);
        all.errors += s.errors;
        all.requests += s.requests;
    }
    all.elapsed = started.elapsed();
    all
}

/// One request: total latency, and for streams the time to the first content token.
async fn one(
    request: reqwest::RequestBuilder,
    stream: bool,
    t0: Instant,
) -> Option<(Duration, Option<Duration>)> {
    let response = request.send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    if !stream {
        response.bytes().await.ok()?;
        return Some((t0.elapsed(), None));
    }
    let mut body = response.bytes_stream();
    let mut ttft = None;
    let mut tail: Vec<u8> = Vec::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.ok()?;
        if ttft.is_none() {
            tail.extend_from_slice(&chunk);
            if has_token(&tail) {
                ttft = Some(t0.elapsed());
                tail.clear();
            }
        }
    }
    Some((t0.elapsed(), ttft))
}

/// Whether the SSE bytes so far hold a non-empty `"content":"…"` delta.
fn has_token(bytes: &[u8]) -> bool {
    let needle = b"\"content\":\"";
    bytes
        .windows(needle.len() + 1)
        .any(|w| &w[..needle.len()] == needle && w[needle.len()] != b'"')
}

/// `--scenario sessions`: the conversations against every target, and the table.
async fn sessions(client: &reqwest::Client, targets: &[Target], args: &Args) -> super::Result {
    let targets: Vec<super::bench_sessions::Target> = targets
        .iter()
        .map(|t| {
            let (url, model) = match t.url.split_once('#') {
                Some((url, model)) => (url.to_string(), model.to_string()),
                None => (t.url.clone(), args.model.clone()),
            };
            super::bench_sessions::Target {
                name: t.name.clone(),
                url,
                model,
            }
        })
        .collect();
    let shape = super::bench_sessions::Shape {
        sessions: args.sessions,
        turns: args.turns,
        system_prompts: args.system_prompts,
        system_tokens: args.system_tokens,
        turn_tokens: args.turn_tokens,
        keyed: args.keyed,
        concurrency: args.concurrency,
        rounds: args.rounds,
        think: Duration::from_millis(args.think_ms),
    };
    let report = super::bench_sessions::run(client, &targets, shape, args.api_key.as_deref()).await;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{} conversations of {} turns per target ({} system prompts of {} tokens, {} tokens per turn, {:.0} % keyed), {} at once, {} interleaved rounds",
        args.sessions,
        args.turns,
        args.system_prompts,
        args.system_tokens,
        args.turn_tokens,
        args.keyed * 100.0,
        args.concurrency,
        args.rounds
    );
    println!(
        "| target | turns | errors | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | cached prompt tokens | TTFT p50 vs {} |",
        targets[0].name
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let base = report[0]["ttft_p50_ms"].as_f64().unwrap_or(f64::NAN);
    for r in &report {
        let p50 = r["ttft_p50_ms"].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} % | {:.2}× faster |",
            r["target"].as_str().unwrap_or(""),
            r["turns"],
            r["errors"],
            p50,
            r["ttft_p90_ms"].as_f64().unwrap_or(f64::NAN),
            r["ttft_p99_ms"].as_f64().unwrap_or(f64::NAN),
            r["cached_share"].as_f64().unwrap_or(0.0) * 100.0,
            base / p50,
        );
    }
    Ok(())
}

/// `--scenario streams`: `--requests` streams at once against each target in turn.
async fn streams(targets: &[Target], args: &Args) -> super::Result {
    // One file per stream here too.
    if let Err(err) = iop_edge::fdlimit::raise_open_files_limit() {
        eprintln!("cannot raise the open-files limit: {err}");
    }
    let mut report = Vec::new();
    for t in targets {
        let ramp = Duration::from_millis(args.ramp_ms);
        let key = args.api_key.as_deref();
        let mut r = super::bench_streams::run(&t.url, &args.model, args.requests, ramp, key).await;
        r["target"] = json!(t.name);
        report.push(r);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "| target | streams | completed | refused | failed | most open at once | first byte p50 ms | first byte p99 ms | end p50 ms | end p99 ms |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &report {
        let ms = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.0} | {:.0} |",
            r["target"].as_str().unwrap_or(""),
            r["streams"],
            r["completed"],
            r["refused"],
            r["failed"],
            r["peak_open"],
            ms("first_byte_p50_ms"),
            ms("first_byte_p99_ms"),
            ms("done_p50_ms"),
            ms("done_p99_ms"),
        );
    }
    Ok(())
}
