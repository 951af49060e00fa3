//! `iop bench --scenario sessions`: multi-turn conversations, as coding agents and chat
//! send them, to measure what cache-affine routing buys.
//!
//! `--sessions` conversations each open with one of `--system-prompts` long system
//! prompts (`--system-tokens` each) and take `--turns` turns; every turn sends the whole
//! conversation so far plus a new user message of `--turn-tokens` (a pasted file, a tool's
//! output), streamed, and keeps the answer. Up to `--concurrency` conversations run at
//! once, each turn after the last one's answer and a pause (a user reading, a tool
//! running: `--think-ms` on average, the same pauses for every target), so the
//! conversations do not march in step. A `--keyed` share of them name their
//! session (`prompt_cache_key`, as Codex does); the rest send nothing but their prompt.
//!
//! Each target (`NAME=URL#MODEL`: a model group per routing policy, over members of its
//! own) gets the same conversations, interleaved round by round. Reported per target:
//! time to first token p50/p90/p99, and the share of prompt tokens the provider said it
//! had cached (`prompt_tokens_details.cached_tokens`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};

/// What the scenario sends.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub sessions: usize,
    pub turns: usize,
    pub system_prompts: usize,
    pub system_tokens: usize,
    pub turn_tokens: usize,
    pub keyed: f64,
    pub concurrency: usize,
    pub rounds: usize,
    /// The mean pause between a turn's answer and the next turn.
    pub think: Duration,
}

/// The pause before turn `turn` of `session`: uniform in [0, 2 × mean), the same on
/// every run and target.
fn pause(mean: Duration, session: usize, turn: usize) -> Duration {
    let mut z = (session as u64) << 32 | turn as u64;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    mean.mul_f64(2.0 * (z % 10_000) as f64 / 10_000.0)
}

#[derive(Debug, Clone)]
pub struct Target {
    pub name: String,
    pub url: String,
    pub model: String,
}

#[derive(Debug, Default)]
struct Samples {
    ttft: Vec<Duration>,
    prompt_tokens: u64,
    cached_tokens: u64,
    errors: usize,
    turns: usize,
}

impl Samples {
    fn add(&mut self, other: Samples) {
        self.ttft.extend(other.ttft);
        self.prompt_tokens += other.prompt_tokens;
        self.cached_tokens += other.cached_tokens;
        self.errors += other.errors;
        self.turns += other.turns;
    }
}

/// Text of about `tokens` tokens (four bytes each), distinct per `seed`.
fn filler(seed: &str, tokens: usize) -> String {
    let mut text = String::with_capacity(tokens * 4 + 64);
    let mut i = 0u64;
    while text.len() < tokens * 4 {
        text.push_str(&format!("{seed}-{i:x} "));
        i += 1;
    }
    text.truncate(tokens * 4);
    text
}

pub async fn run(
    client: &reqwest::Client,
    targets: &[Target],
    shape: Shape,
    api_key: Option<&str>,
) -> Vec<Value> {
    let systems: Arc<Vec<String>> = Arc::new(
        (0..shape.system_prompts.max(1))
            .map(|i| {
                format!(
                    "You are agent {i}. {}",
                    filler(&format!("sys{i}"), shape.system_tokens)
                )
            })
            .collect(),
    );
    let rounds = shape.rounds.max(1);
    let per_round = shape.sessions.div_ceil(rounds);
    let mut samples: Vec<Samples> = targets.iter().map(|_| Samples::default()).collect();
    for round in 0..rounds {
        let first = round * per_round;
        let sessions: Vec<usize> = (first..(first + per_round).min(shape.sessions)).collect();
        for (t, s) in targets.iter().zip(samples.iter_mut()) {
            s.add(conversations(client, t, &shape, &systems, &sessions, api_key).await);
        }
    }
    targets
        .iter()
        .zip(samples)
        .map(|(t, mut s)| {
            s.ttft.sort();
            json!({
                "target": t.name,
                "model": t.model,
                "turns": s.turns,
                "errors": s.errors,
                "ttft_p50_ms": super::bench_percentile::percentile(&s.ttft, 50.0),
                "ttft_p90_ms": super::bench_percentile::percentile(&s.ttft, 90.0),
                "ttft_p99_ms": super::bench_percentile::percentile(&s.ttft, 99.0),
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
                "cached_share": if s.prompt_tokens > 0 { s.cached_tokens as f64 / s.prompt_tokens as f64 } else { 0.0 },
            })
        })
        .collect()
}

/// Plays `sessions` to their end against `target`, `shape.concurrency` at once.
async fn conversations(
    client: &reqwest::Client,
    target: &Target,
    shape: &Shape,
    systems: &Arc<Vec<String>>,
    sessions: &[usize],
    api_key: Option<&str>,
) -> Samples {
    let next = Arc::new(AtomicUsize::new(0));
    let sessions = Arc::new(sessions.to_vec());
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..shape.concurrency.max(1) {
        let (client, next, sessions, systems, target, shape) = (
            client.clone(),
            next.clone(),
            sessions.clone(),
            systems.clone(),
            target.clone(),
            *shape,
        );
        let key = api_key.map(String::from);
        workers.spawn(async move {
            let mut s = Samples::default();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&session) = sessions.get(i) else {
                    break;
                };
                play(
                    &client,
                    &target,
                    &shape,
                    &systems,
                    session,
                    key.as_deref(),
                    &mut s,
                )
                .await;
            }
            s
        });
    }
    let mut all = Samples::default();
    while let Some(Ok(s)) = workers.join_next().await {
        all.add(s);
    }
    all
}

/// One conversation, turn after turn.
async fn play(
    client: &reqwest::Client,
    target: &Target,
    shape: &Shape,
    systems: &[String],
    session: usize,
    api_key: Option<&str>,
    s: &mut Samples,
) {
    let url = format!("{}/chat/completions", target.url);
    let keyed =
        (session as f64 + 0.5) / shape.sessions.max(1) as f64 <= shape.keyed || shape.keyed >= 1.0;
    let mut messages = vec![json!({"role": "system", "content": systems[session % systems.len()]})];
    for turn in 0..shape.turns {
        if turn > 0 {
            tokio::time::sleep(pause(shape.think, session, turn)).await;
        }
        messages.push(json!({"role": "user", "content": filler(&format!("s{session}t{turn}"), shape.turn_tokens)}));
        let mut body = json!({
            "model": target.model,
            "messages": messages,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if keyed {
            body["prompt_cache_key"] = json!(format!("conversation-{session}"));
        }
        let mut request = client.post(&url).json(&body);
        if let Some(k) = api_key {
            request = request.bearer_auth(k);
        }
        s.turns += 1;
        match turn_of(request).await {
            Some((ttft, answer, prompt, cached)) => {
                s.ttft.push(ttft);
                s.prompt_tokens += prompt;
                s.cached_tokens += cached;
                messages.push(json!({"role": "assistant", "content": answer}));
            }
            None => {
                s.errors += 1;
                return;
            }
        }
    }
}

/// One streamed turn: time to its first content, the answer, prompt and cached tokens.
async fn turn_of(request: reqwest::RequestBuilder) -> Option<(Duration, String, u64, u64)> {
    let t0 = Instant::now();
    let response = request.send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let mut events = eventsource_stream::EventStream::new(response.bytes_stream());
    let (mut ttft, mut answer, mut prompt, mut cached) = (None, String::new(), 0, 0);
    while let Some(event) = events.next().await {
        let event = event.ok()?;
        if event.data == "[DONE]" {
            break;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(&event.data) else {
            continue;
        };
        if let Some(text) = chunk
            .pointer("/choices/0/delta/content")
            .and_then(Value::as_str)
            && !text.is_empty()
        {
            ttft.get_or_insert_with(|| t0.elapsed());
            answer.push_str(text);
        }
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            prompt = usage["prompt_tokens"].as_u64().unwrap_or(0);
            cached = usage
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0);
        }
    }
    Some((ttft?, answer, prompt, cached))
}
