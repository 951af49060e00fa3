//! `iop bench --scenario streams`: `--requests` streamed chat completions opened against
//! each target, evenly over `--ramp-ms` (all at once with 0), to see how many concurrent
//! streams an endpoint holds and what they cost: how many completed (read to `[DONE]`),
//! were refused (an error status) or failed (the connection), the most that were open at
//! once, and the time to the first byte of the response body and to the end, p50 and p99.
//!
//! An edge caps connections per client address (`limits.http.max_connections_per_address`,
//! 1024), so against a loopback target the streams come from many loopback addresses
//! (127.0.0.2 on, [`STREAMS_PER_SOURCE`] each), as that many clients would.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};

/// Streams opened from one source address (loopback targets).
pub const STREAMS_PER_SOURCE: usize = 500;

#[derive(Debug, Default)]
struct Outcomes {
    completed: usize,
    refused: usize,
    failed: usize,
    first_byte: Vec<Duration>,
    done: Vec<Duration>,
}

/// Opens `streams` streams to `url` (an API root) at once and reads each to its end.
pub async fn run(
    url: &str,
    model: &str,
    streams: usize,
    ramp: Duration,
    api_key: Option<&str>,
) -> Value {
    let loopback = url.contains("://127.0.0.1") || url.contains("://localhost");
    let sources = if loopback {
        streams.div_ceil(STREAMS_PER_SOURCE).clamp(1, 250)
    } else {
        1
    };
    let clients: Vec<reqwest::Client> = (0..sources)
        .map(|i| {
            let mut builder = reqwest::Client::builder()
                .tcp_nodelay(true)
                .no_proxy()
                .pool_max_idle_per_host(0)
                .timeout(Duration::from_secs(600));
            if loopback {
                builder = builder.local_address(std::net::IpAddr::from([127, 0, 0, 2 + i as u8]));
            }
            builder.build().expect("a client")
        })
        .collect();
    let body = Arc::new(
        serde_json::to_vec(&json!({
            "model": model,
            "messages": [{"role": "user", "content": "Say something."}],
            "stream": true,
        }))
        .expect("serializable"),
    );
    let url = format!("{}/chat/completions", url.trim_end_matches('/'));
    let started = Instant::now();
    let open = Arc::new(Open::default());
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..streams {
        let at = started + ramp.mul_f64(i as f64 / streams.max(1) as f64);
        tokio::time::sleep_until(at.into()).await;
        let mut request = clients[i % clients.len()]
            .post(&url)
            .header("content-type", "application/json")
            .body((*body).clone());
        if let Some(k) = api_key {
            request = request.bearer_auth(k);
        }
        tasks.spawn(one(request, open.clone()));
    }
    let mut o = Outcomes::default();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok((first, done))) => {
                o.completed += 1;
                o.first_byte.push(first);
                o.done.push(done);
            }
            Ok(Err(true)) => o.refused += 1,
            _ => o.failed += 1,
        }
    }
    o.first_byte.sort();
    o.done.sort();
    json!({
        "streams": streams,
        "completed": o.completed,
        "refused": o.refused,
        "failed": o.failed,
        "peak_open": open.peak.load(Ordering::Relaxed),
        "first_byte_p50_ms": super::bench_percentile::percentile(&o.first_byte, 50.0),
        "first_byte_p99_ms": super::bench_percentile::percentile(&o.first_byte, 99.0),
        "done_p50_ms": super::bench_percentile::percentile(&o.done, 50.0),
        "done_p99_ms": super::bench_percentile::percentile(&o.done, 99.0),
        "elapsed_ms": started.elapsed().as_secs_f64() * 1000.0,
    })
}

/// One stream: times to its first body byte and to its end; `Err(true)` when refused with
/// an error status, `Err(false)` when the connection failed or the stream did not end
/// with `[DONE]`.
async fn one(
    request: reqwest::RequestBuilder,
    open: Arc<Open>,
) -> Result<(Duration, Duration), bool> {
    let t0 = Instant::now();
    let _open = open.enter();
    let response = request.send().await.map_err(|_| false)?;
    if !response.status().is_success() {
        return Err(true);
    }
    let mut body = response.bytes_stream();
    let mut first = None;
    let mut tail: Vec<u8> = Vec::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|_| false)?;
        first.get_or_insert_with(|| t0.elapsed());
        tail.extend_from_slice(&chunk);
        if tail.len() > 64 {
            tail.drain(..tail.len() - 64);
        }
    }
    let done = tail.windows(6).any(|w| w == b"[DONE]");
    match first {
        Some(first) if done => Ok((first, t0.elapsed())),
        _ => Err(false),
    }
}

/// Streams open now, and the most at once.
#[derive(Debug, Default)]
struct Open {
    now: AtomicUsize,
    peak: AtomicUsize,
}

impl Open {
    fn enter(self: &Arc<Self>) -> OpenGuard {
        let now = self.now.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak.fetch_max(now, Ordering::Relaxed);
        OpenGuard(self.clone())
    }
}

struct OpenGuard(Arc<Open>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::Relaxed);
    }
}
