//! Decoding a request's body (into its surface's request, or for `count_tokens` into what
//! is counted) off the event loop unless it is small.
//!
//! Decoding is the edge's CPU-heavy step: parsing the JSON and, for the Responses,
//! Messages and Ollama APIs, translating it into the canonical request. A body under
//! [`INLINE_DECODE_BYTES`] (16 KiB) is decoded in place, which costs microseconds; every
//! larger one on a worker thread, at most `large_body_workers` at once, so the event loop
//! that also carries `/healthz` and the node links never runs a decode that grows with
//! what a client sends. Bodies of `limits.http.large_body_bytes` or more are also counted:
//! a key may have at most `large_bodies_per_key` of them at once, from before the body is
//! read (when its size is announced) until the request has been answered or its answer
//! starts streaming (more: 429); and they wait for a worker in a list of
//! `large_bodies_waiting` places shared fairly between keys (a key holds at most the list
//! over the keys waiting; a key with none waiting always gets a place; more: 503). So the
//! memory large bodies hold is bounded per key: each holds its body, its translation and
//! the copies sent on (about four times its size), and each decode briefly builds a tree of
//! its JSON (at most [`crate::canonical::MAX_JSON_CONTAINERS`] arrays and objects).
//!
//! A decoded request borrows its body; [`Prepared`] owns both (the body, and the
//! translated canonical body when there is one), so it can cross from the worker thread
//! back to the request's task.

use std::collections::HashMap;
use std::mem;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::{HeaderMap, header};
use futures::StreamExt;
use iop_proto::ErrorCode;
use parking_lot::Mutex;
use tokio::sync::Semaphore;

use super::body::JsonBody;
use crate::canonical::{ApiError, Canonical, ClientRequest, Decoded};
use crate::config::HttpLimitsConfig;
use crate::service::Edge;
use crate::surfaces::Surface;

self_cell::self_cell!(
    /// A client's body and its surface's decoding of it.
    struct DecodedBody {
        owner: Bytes,
        #[covariant]
        dependent: Decoded,
    }
    impl {Debug}
);

self_cell::self_cell!(
    /// A translated canonical body and its top-level fields.
    struct TranslatedBody {
        owner: Vec<u8>,
        #[covariant]
        dependent: ClientRequest,
    }
    impl {Debug}
);

/// A decoded request that owns its bytes.
#[derive(Debug)]
pub struct Prepared {
    decoded: DecodedBody,
    translated: Option<TranslatedBody>,
    /// A large body's place in its key's share, held while the request holds the body.
    _turn: Option<KeyTurn>,
}

impl Prepared {
    /// Decodes `body` as `surface` reads it (on the calling thread).
    pub fn decode(surface: Surface, body: Bytes, headers: &HeaderMap) -> Result<Self, ApiError> {
        let mut translated = None;
        let decoded = DecodedBody::try_new(body, |body| {
            let mut decoded = surface.decode(body, headers)?;
            if let Canonical::Translated(bytes) = &mut decoded.canonical {
                translated = Some(mem::take(bytes));
            }
            Ok::<_, ApiError>(decoded)
        })?;
        let translated = match translated {
            Some(bytes) => Some(TranslatedBody::try_new(bytes, |b| {
                ClientRequest::parse(b.as_slice())
            })?),
            None => None,
        };
        Ok(Self {
            decoded,
            translated,
            _turn: None,
        })
    }

    /// The surface's decoding (a translated body is in [`Prepared::canonical`]).
    pub fn decoded(&self) -> &Decoded<'_> {
        self.decoded.borrow_dependent()
    }

    /// The canonical request, or what its translation refused.
    pub fn canonical(&self) -> Result<&ClientRequest<'_>, &ApiError> {
        let decoded = self.decoded();
        match (&decoded.canonical, &self.translated) {
            (Canonical::Client, _) => Ok(&decoded.native.request),
            (Canonical::Translated(_), Some(translated)) => Ok(translated.borrow_dependent()),
            (Canonical::Refused(refusal), _) => Err(refusal),
            (Canonical::Translated(_), None) => unreachable!("a translation is kept"),
        }
    }
}

/// Bodies under this size are decoded on the event loop: a Messages body of this size
/// with many small blocks decodes and translates in about 0.1 ms (measured by
/// `inline_decode_is_cheap` below, in release builds), less than a worker's hand-off costs
/// in latency. Everything larger goes to a worker, so no decode on the loop grows with what
/// a client sends.
pub const INLINE_DECODE_BYTES: usize = 16 * 1024;

/// The bounds on decoding large bodies, and the worker threads' turns.
#[derive(Debug)]
pub struct LargeBodies {
    threshold: usize,
    per_key: usize,
    waiting_cap: usize,
    workers: Arc<Semaphore>,
    state: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    /// Large bodies decoding or waiting, per key.
    per_key: HashMap<String, usize>,
    /// Bodies waiting for a worker, in all and per key.
    waiting: usize,
    waiting_per_key: HashMap<String, usize>,
}

impl LargeBodies {
    pub fn new(limits: &HttpLimitsConfig) -> Arc<Self> {
        Arc::new(Self {
            threshold: limits.large_body_bytes,
            per_key: limits.large_bodies_per_key,
            waiting_cap: limits.large_bodies_waiting,
            workers: Arc::new(Semaphore::new(limits.large_body_workers)),
            state: Mutex::new(Counts::default()),
        })
    }

    /// Reads `request`'s JSON body and decodes it for `surface` (`headers`: the request's,
    /// as the handler already holds them). A body that announces a
    /// large size is counted against `key`'s share before it is read, so a refused one is
    /// read and dropped, never held or decoded.
    pub async fn read_and_decode(
        self: &Arc<Self>,
        edge: &Arc<Edge>,
        key: &str,
        surface: Surface,
        request: Request,
        headers: &HeaderMap,
    ) -> Result<Prepared, ApiError> {
        let any_content_type = matches!(surface, Surface::Ollama(_));
        let body = self
            .read(edge, key, request, headers, any_content_type)
            .await?;
        let headers = headers.clone();
        let (decoded, turn) = self
            .work(body, key, move |body| {
                Prepared::decode(surface, body, &headers)
            })
            .await?;
        Ok(Prepared {
            _turn: turn,
            ..decoded
        })
    }

    /// Reads `request`'s JSON body within the limits (any `Content-Type` with
    /// `any_content_type`). A body that announces a large size is counted against `key`'s
    /// share before it is read, so a refused one is read and dropped, never held.
    pub async fn read(
        self: &Arc<Self>,
        edge: &Arc<Edge>,
        key: &str,
        request: Request,
        headers: &HeaderMap,
        any_content_type: bool,
    ) -> Result<ReadBody, ApiError> {
        let announced = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
        let turn = match announced {
            Some(n) if n >= self.threshold => match self.enter(key) {
                Ok(turn) => Some(turn),
                Err(refusal) => {
                    discard_body(request, edge.config().limits.max_body_bytes).await;
                    return Err(refusal);
                }
            },
            _ => None,
        };
        let bytes = JsonBody::read(request, edge, any_content_type).await?.0;
        Ok(ReadBody { bytes, turn })
    }

    /// Runs `work` on a read body: in place when it is small (under
    /// [`INLINE_DECODE_BYTES`]), else on a worker thread once a worker is free. A body of
    /// `limits.http.large_body_bytes` or more counts against `key`'s share (unless it
    /// already does) until the returned turn is dropped, and takes a place in the list
    /// waiting for a worker.
    pub async fn work<T: Send + 'static>(
        self: &Arc<Self>,
        body: ReadBody,
        key: &str,
        work: impl FnOnce(Bytes) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<(T, Option<KeyTurn>), ApiError> {
        let ReadBody { bytes, turn } = body;
        if bytes.len() < INLINE_DECODE_BYTES.min(self.threshold) {
            return Ok((work(bytes)?, turn));
        }
        let turn = match turn {
            Some(turn) => Some(turn),
            None if bytes.len() >= self.threshold => Some(self.enter(key)?),
            None => None,
        };
        // Only large bodies take a place in the (bounded, shared) waiting list; smaller
        // ones wait without one, bounded by the connections that sent them.
        let waiting = match turn {
            Some(_) => Some(self.wait(key)?),
            None => None,
        };
        let worker = self.workers.clone().acquire_owned().await;
        drop(waiting);
        // The worker's turn ends with the work, even when the client has left.
        let done = tokio::task::spawn_blocking(move || {
            let done = work(bytes);
            drop(worker);
            done
        })
        .await
        .unwrap_or_else(|e| {
            Err(ApiError::of(
                ErrorCode::Internal,
                format!("decoding the request failed: {e}"),
            ))
        })?;
        Ok((done, turn))
    }

    /// Counts a large body of `key`'s, or refuses it over a bound.
    fn enter(self: &Arc<Self>, key: &str) -> Result<KeyTurn, ApiError> {
        let mut state = self.state.lock();
        let mine = state.per_key.entry(key.to_string()).or_insert(0);
        if *mine >= self.per_key {
            return Err(ApiError::of(
                ErrorCode::QueueFull,
                format!(
                    "this key already has {} requests with large bodies (at least {} bytes) in progress (limits.http.large_bodies_per_key): wait for one to finish",
                    *mine, self.threshold
                ),
            ));
        }
        *mine += 1;
        Ok(KeyTurn {
            bodies: self.clone(),
            key: key.to_string(),
        })
    }
}

impl LargeBodies {
    /// A place for a body of `key`'s in the list waiting for a worker. The list is shared
    /// fairly: a key may hold at most its share of `large_bodies_waiting` (the list over
    /// the keys waiting, itself included), and a key with nothing waiting always gets one
    /// place, even over a full list (keys are configured, so that stays bounded).
    fn wait(&self, key: &str) -> Result<Waiting<'_>, ApiError> {
        let mut state = self.state.lock();
        let mine = state.waiting_per_key.get(key).copied().unwrap_or(0);
        if mine > 0 {
            let keys = state.waiting_per_key.len();
            let share = (self.waiting_cap / keys).max(1);
            if state.waiting >= self.waiting_cap || mine >= share {
                return Err(ApiError::of(
                    ErrorCode::Unavailable,
                    format!(
                        "the edge is busy decoding large requests ({} waiting, {mine} of them this key's; its share of limits.http.large_bodies_waiting is {share}): retry shortly",
                        state.waiting
                    ),
                ));
            }
        }
        state.waiting += 1;
        *state.waiting_per_key.entry(key.to_string()).or_default() += 1;
        Ok(Waiting {
            bodies: self,
            key: key.to_string(),
        })
    }
}

/// Reads a refused request's body without keeping it (at most `limit` bytes, within the
/// body deadline), so that its client, still sending, reads the refusal instead of a
/// broken connection.
async fn discard_body(request: Request, limit: usize) {
    let mut body = request.into_body().into_data_stream();
    let mut read = 0;
    while let Some(Ok(chunk)) = body.next().await {
        read += chunk.len();
        if read > limit {
            return;
        }
    }
}

/// A body read within the limits, with its key's turn when it announced a large size.
#[derive(Debug)]
pub struct ReadBody {
    pub bytes: Bytes,
    turn: Option<KeyTurn>,
}

/// One large body counted against its key until its request lets go of it.
#[derive(Debug)]
pub struct KeyTurn {
    bodies: Arc<LargeBodies>,
    key: String,
}

impl Drop for KeyTurn {
    fn drop(&mut self) {
        let mut state = self.bodies.state.lock();
        if let Some(n) = state.per_key.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                state.per_key.remove(&self.key);
            }
        }
    }
}

/// One body waiting for a worker, counted in all and against its key.
struct Waiting<'a> {
    bodies: &'a LargeBodies,
    key: String,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut state = self.bodies.state.lock();
        state.waiting -= 1;
        if let Some(n) = state.waiting_per_key.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                state.waiting_per_key.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::Operation;

    fn limits(threshold: usize, per_key: usize, waiting: usize) -> HttpLimitsConfig {
        HttpLimitsConfig {
            large_body_bytes: threshold,
            large_bodies_per_key: per_key,
            large_bodies_waiting: waiting,
            large_body_workers: 1,
            ..Default::default()
        }
    }

    fn chat(n: usize) -> Bytes {
        let content = "x".repeat(n);
        Bytes::from(
            serde_json::to_vec(&serde_json::json!({
                "model": "m", "messages": [{"role": "user", "content": content}]
            }))
            .unwrap(),
        )
    }

    /// Decodes `body` for `surface` as a request handler would, after reading it.
    async fn decode(
        bodies: &Arc<LargeBodies>,
        surface: Surface,
        body: Bytes,
    ) -> Result<Prepared, ApiError> {
        let read = ReadBody {
            bytes: body,
            turn: None,
        };
        let (prepared, turn) = bodies
            .work(read, "k", move |b| {
                Prepared::decode(surface, b, &HeaderMap::new())
            })
            .await?;
        Ok(Prepared {
            _turn: turn,
            ..prepared
        })
    }

    #[tokio::test]
    async fn small_and_large_bodies_decode_alike() {
        let bodies = LargeBodies::new(&limits(1024, 2, 8));
        let surface = Surface::OpenAi(Operation::Chat);
        for n in [10, 10_000] {
            let prepared = decode(&bodies, surface, chat(n)).await.unwrap();
            assert_eq!(prepared.decoded().model, "m");
            assert!(prepared.canonical().is_ok());
        }
        assert!(bodies.state.lock().per_key.is_empty());
    }

    #[tokio::test]
    async fn a_translated_body_keeps_its_canonical_form() {
        let bodies = LargeBodies::new(&limits(16, 2, 8));
        let body = Bytes::from_static(
            br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
        );
        let prepared = decode(&bodies, Surface::Messages, body).await.unwrap();
        let canonical = prepared.canonical().unwrap();
        assert!(canonical.raw("messages").is_some());
    }

    #[test]
    fn a_key_over_its_share_and_a_full_wait_are_refused() {
        let bodies = LargeBodies::new(&limits(16, 2, 1));
        let a = bodies.enter("k").unwrap();
        let _b = bodies.enter("k").unwrap();
        assert_eq!(bodies.enter("k").unwrap_err().status, 429);
        let _other = bodies.enter("other").unwrap();
        drop(a);
        let _c = bodies.enter("k").unwrap();
    }

    #[test]
    fn the_waiting_list_is_shared_fairly_between_keys() {
        let bodies = LargeBodies::new(&limits(16, 100, 4));
        // One key alone may fill the list.
        let a: Vec<_> = (0..4).map(|_| bodies.wait("a").unwrap()).collect();
        assert_eq!(bodies.wait("a").err().unwrap().status, 503);
        // Another key still gets a place, past the full list; a second one does not.
        let b = bodies.wait("b").unwrap();
        assert_eq!(bodies.wait("b").err().unwrap().status, 503);
        // With two keys waiting, each holds at most half the list once it frees up.
        drop(a);
        let a: Vec<_> = (0..2).map(|_| bodies.wait("a").unwrap()).collect();
        assert_eq!(bodies.wait("a").err().unwrap().status, 503);
        let _b2 = bodies.wait("b").unwrap();
        drop((a, b));
        assert_eq!(bodies.state.lock().waiting, 1);
    }

    #[tokio::test]
    async fn bodies_over_the_inline_size_are_decoded_on_a_worker() {
        let bodies = LargeBodies::new(&limits(1 << 20, 2, 8));
        let on = |n: usize| {
            let bodies = bodies.clone();
            async move {
                let read = ReadBody {
                    bytes: chat(n),
                    turn: None,
                };
                let (thread, turn) = bodies
                    .work(read, "k", |_| Ok(std::thread::current().id()))
                    .await
                    .unwrap();
                assert!(turn.is_none(), "under the large-body size: no key turn");
                thread
            }
        };
        let here = std::thread::current().id();
        assert_eq!(on(100).await, here);
        assert_ne!(on(INLINE_DECODE_BYTES + 1).await, here);
    }
}
