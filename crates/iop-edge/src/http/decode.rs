//! Decoding a model request's body into its surface's request, off the event loop when
//! the body is large.
//!
//! Decoding is the edge's CPU-heavy step: parsing the JSON and, for the Responses,
//! Messages and Ollama APIs, translating it into the canonical request. A body under
//! `limits.http.large_body_bytes` is decoded in place, which costs microseconds. A larger
//! one is decoded on a worker thread, at most `large_body_workers` at once, so the event
//! loop that also carries `/healthz` and the node links never runs a decode of megabytes
//! itself. A key may have at most `large_bodies_per_key` large requests at once, from
//! before the body is read (when its size is announced) until the request has been
//! answered or its answer starts streaming (more: 429); the edge at most
//! `large_bodies_waiting` waiting for a worker in all (more: 503). So the memory large
//! bodies hold is bounded per key: each holds its body, its translation and the copies sent
//! on (about four times its size), and each decode briefly builds a tree of its JSON (at
//! most [`crate::canonical::MAX_JSON_CONTAINERS`] arrays and objects).
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
    /// Large bodies waiting for a worker.
    waiting: usize,
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
        let any_content_type = matches!(surface, Surface::Ollama(_));
        let body = JsonBody::read(request, edge, any_content_type).await?.0;
        self.decode(turn, key, surface, body, headers).await
    }

    /// Decodes `body` for `surface`: in place when small, else on a worker thread once a
    /// worker is free, counted against `key`'s share (unless `turn` already is).
    async fn decode(
        self: &Arc<Self>,
        turn: Option<KeyTurn>,
        key: &str,
        surface: Surface,
        body: Bytes,
        headers: &HeaderMap,
    ) -> Result<Prepared, ApiError> {
        if body.len() < self.threshold {
            return Prepared::decode(surface, body, headers);
        }
        let turn = match turn {
            Some(turn) => turn,
            None => self.enter(key)?,
        };
        let waiting = Waiting::start(self);
        let worker = self.workers.clone().acquire_owned().await;
        drop(waiting);
        let headers = headers.clone();
        // The worker's turn ends with the decode, even when the client has left.
        let decoded = tokio::task::spawn_blocking(move || {
            let decoded = Prepared::decode(surface, body, &headers);
            drop(worker);
            decoded
        })
        .await
        .unwrap_or_else(|e| {
            Err(ApiError::of(
                ErrorCode::Internal,
                format!("decoding the request failed: {e}"),
            ))
        })?;
        Ok(Prepared {
            _turn: Some(turn),
            ..decoded
        })
    }

    /// Counts a large body of `key`'s, or refuses it over a bound.
    fn enter(self: &Arc<Self>, key: &str) -> Result<KeyTurn, ApiError> {
        let mut state = self.state.lock();
        if state.waiting >= self.waiting_cap {
            return Err(ApiError::of(
                ErrorCode::Unavailable,
                format!(
                    "the edge is busy decoding large requests ({} waiting; limits.http.large_bodies_waiting): retry shortly",
                    state.waiting
                ),
            ));
        }
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

/// One large body counted against its key until its request lets go of it.
#[derive(Debug)]
struct KeyTurn {
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

/// One large body waiting for a worker.
struct Waiting<'a>(&'a LargeBodies);

impl<'a> Waiting<'a> {
    fn start(bodies: &'a LargeBodies) -> Self {
        bodies.state.lock().waiting += 1;
        Self(bodies)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.state.lock().waiting -= 1;
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

    #[tokio::test]
    async fn small_and_large_bodies_decode_alike() {
        let bodies = LargeBodies::new(&limits(1024, 2, 8));
        let surface = Surface::OpenAi(Operation::Chat);
        for n in [10, 10_000] {
            let prepared = bodies
                .decode(None, "k", surface, chat(n), &HeaderMap::new())
                .await
                .unwrap();
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
        let prepared = bodies
            .decode(None, "k", Surface::Messages, body, &HeaderMap::new())
            .await
            .unwrap();
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
        let _waiting = Waiting::start(&bodies);
        assert_eq!(bodies.enter("third").unwrap_err().status, 503);
    }
}
