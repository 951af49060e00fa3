//! The node's request journal: every run and tunnel an edge sent it, by stream id, from
//! its request until a while after its end — the link it goes out on now, the frames it
//! sent that the edge has not returned credit for yet, and its credit window.
//!
//! A link that drops leaves its streams running, detached, for the re-attach wait the
//! edge's config gives (`reattach_wait_ms`); the frames they send meanwhile are kept, and
//! data frames still spend credit, so a detached stream pauses once its window is used
//! up. An edge re-attaches a stream with `StreamResume` on any link: the node sends again
//! every frame after the ones the edge says it received, then the stream goes on there.
//! A stream not re-attached within the wait is stopped (its provider request dropped).
//! An ended stream is forgotten as soon as the edge says it received its last frame
//! (`StreamsReceived`), or answered a heartbeat ping the node sent after that
//! frame (the link delivers in order, so the edge has every frame of it), else once the
//! wait passed after its end.
//!
//! When the edge's config asks for resumable answers (`resume_keep_ms` above 0), a stream
//! keeps every frame it sent, not only the uncredited ones, and an ended stream is kept for
//! that long after its end: a client that lost its connection resumes the answer through
//! any edge (`StreamResume.origin`), which gets the whole stream again under a new id and
//! then its further frames; the previous link, if any, loses it. Only the caller that
//! asked (`owner`) may resume it.
//!
//! Memory is bounded twice: a stream keeps at most [`JournalLimits::stream_bytes`], and all
//! streams together at most [`JournalLimits::total_bytes`]; the oldest ended streams are
//! dropped first once three quarters of that is used. A whole stream over a bound keeps
//! only what the edge has not credited from then on (a client can no longer resume it; a
//! dropped link still can), and a stream whose uncredited frames alone are over a bound
//! drops what it kept and is marked not resumable: a resume then ends it with
//! `broken_stream` saying it may have run. It is never replayed in part.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use foldhash::HashMap;
use iop_proto::pb::{self, provider_tunnel_frame::Frame};
use iop_proto::{ErrorCode, Outbound};
use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// How much the journal keeps.
#[derive(Debug, Clone, Copy)]
pub struct JournalLimits {
    /// Bytes of uncredited frames one stream keeps at most.
    pub stream_bytes: usize,
    /// Bytes of uncredited frames all streams keep at most together.
    pub total_bytes: usize,
}

impl Default for JournalLimits {
    fn default() -> Self {
        Self {
            // A full window of 16 KiB tunnel body frames is 4 MiB; token streams keep a
            // few KiB.
            stream_bytes: 4 * 1024 * 1024,
            total_bytes: 256 * 1024 * 1024,
        }
    }
}

/// What the journal knows of a stream besides its frames: who asked (only they may resume
/// it) and how to bill it should no edge receive its end.
#[derive(Debug, Clone, Default)]
pub struct StreamMeta {
    pub owner: String,
    pub billing: Option<pb::Billing>,
    /// The provider (adapter instance) it went to.
    pub provider: String,
    pub tunnel: bool,
    /// A client may resume it (a streamed tunnel: its events carry ids): it is kept whole
    /// when the edge keeps answers.
    pub resumable: bool,
}

/// Most usage reports of orphaned streams waiting for a live link; more are dropped
/// (counted in the log).
const MAX_PENDING_ORPHANS: usize = 10_000;

/// A link a stream goes out on: which one (for detaching), its outbound queue and its
/// heartbeat marks.
#[derive(Debug, Clone)]
pub struct LinkOut {
    pub id: u64,
    pub outbound: Outbound,
    pub marks: Arc<LinkMarks>,
}

/// Which heartbeat pings a link sent and which the edge answered: a pong for a ping sent
/// after a frame proves the edge received that frame.
#[derive(Debug, Default)]
pub struct LinkMarks {
    pinged: AtomicU64,
    answered: AtomicU64,
}

impl LinkMarks {
    /// A ping with `nonce` was queued on the link.
    pub fn pinged(&self, nonce: u64) {
        self.pinged.fetch_max(nonce, Ordering::AcqRel);
    }

    /// The edge answered the ping with `nonce`.
    pub fn answered(&self, nonce: u64) {
        self.answered.fetch_max(nonce, Ordering::AcqRel);
    }
}

#[derive(Debug)]
pub struct Journal {
    streams: Mutex<HashMap<String, Arc<JournalStream>>>,
    limits: JournalLimits,
    /// Bytes kept by every stream together.
    kept_bytes: Arc<AtomicUsize>,
    /// The re-attach wait, in milliseconds (0: streams stop with their link).
    wait_ms: AtomicU64,
    /// How long a whole answer stays resumable by its client after its end, in
    /// milliseconds (0: clients cannot resume).
    keep_ms: AtomicU64,
    /// The links up now (usage of orphaned streams goes out on one).
    links: Mutex<Vec<LinkOut>>,
    /// Usage of orphaned streams no link took yet.
    orphans: Mutex<VecDeque<pb::OrphanUsage>>,
}

impl Default for Journal {
    fn default() -> Self {
        Self::new(JournalLimits::default())
    }
}

/// One frame of a stream as the journal keeps it: a tunnel's without the stream's id
/// (added as it is sent), so keeping a body frame costs a reference, not a copy.
#[derive(Debug, Clone)]
pub enum StreamFrame {
    Run(pb::RunEvent),
    Tunnel(Frame),
}

impl StreamFrame {
    /// Leaves the usage out (an edge billed it already); false when nothing of the frame
    /// is left to send.
    fn drop_usage(&mut self) -> bool {
        match self {
            StreamFrame::Run(event) => {
                event.usage = None;
                true
            }
            StreamFrame::Tunnel(Frame::Usage(_)) => false,
            StreamFrame::Tunnel(_) => true,
        }
    }

    fn envelope(self, id: &str) -> pb::Envelope {
        match self {
            StreamFrame::Run(event) => event.into(),
            StreamFrame::Tunnel(frame) => pb::ProviderTunnelFrame {
                request_id: id.to_string(),
                frame: Some(frame),
            }
            .into(),
        }
    }

    /// About its size on the wire.
    fn size(&self) -> usize {
        match self {
            StreamFrame::Run(event) => prost::Message::encoded_len(event),
            StreamFrame::Tunnel(frame) => frame.encoded_len() + 8,
        }
    }
}

/// One frame kept for a resend.
#[derive(Debug)]
struct Kept {
    frame: StreamFrame,
    /// A data frame (it spent credit).
    data: bool,
    size: usize,
}

#[derive(Debug)]
struct StreamState {
    link: Option<LinkOut>,
    /// Every frame the stream sent is kept (a client may resume it from its start).
    whole: bool,
    /// The stream's end went out to an edge that bills its usage: on a link that has not
    /// dropped since, or one that confirmed it.
    delivered: bool,
    /// The edge confirmed it has the stream's end.
    confirmed: bool,
    kept: VecDeque<Kept>,
    /// The index (among every frame the stream sent) of `kept[0]`.
    first_kept: u64,
    /// Frames sent in all.
    sent: u64,
    /// Data frames dropped from `kept` because the edge credited them.
    pruned_data: u64,
    kept_bytes: usize,
    /// False once the stream dropped what it kept (over a bound).
    resumable: bool,
    /// When its last frame went out.
    ended_at: Option<Instant>,
    /// The link its last frame went out on and the last ping queued before it: a pong to
    /// a later ping confirms the edge has the whole stream.
    ended_on: Option<(Arc<LinkMarks>, u64)>,
    /// When its link dropped (none while it is on one).
    detached_at: Option<Instant>,
}

/// A run or tunnel in the journal.
#[derive(Debug)]
pub struct JournalStream {
    /// The id the request came with (the journal's key).
    pub id: String,
    /// The id its frames go out under: `id`, or the one a client's resume gave it.
    wire: Mutex<String>,
    /// Who asked and how to bill it.
    meta: StreamMeta,
    state: tokio::sync::Mutex<StreamState>,
    credit: Semaphore,
    /// Data frames the edge credited, in all.
    credited: AtomicU64,
    /// Stops the run or tunnel: the edge cancelled it, the wait passed, the node stops.
    pub cancel: CancellationToken,
    /// Why the node (not the edge) stopped it, if it did.
    stopped: Mutex<Option<String>>,
    limits: JournalLimits,
    total: Arc<AtomicUsize>,
}

/// What a resume found.
#[derive(Debug, PartialEq, Eq)]
pub enum Resumed {
    /// Its frames after `received` went out again on the new link; it goes on there.
    Attached { resent: usize },
    /// The node never saw the stream (the journal lives in the node's memory: a node
    /// process that restarted has not seen any).
    Unknown,
    /// The node saw it but kept too little to send it again: it was ended.
    NotResumable,
}

impl Journal {
    pub fn new(limits: JournalLimits) -> Self {
        Self {
            streams: Mutex::new(HashMap::default()),
            limits,
            kept_bytes: Arc::new(AtomicUsize::new(0)),
            wait_ms: AtomicU64::new(0),
            keep_ms: AtomicU64::new(0),
            links: Mutex::new(Vec::new()),
            orphans: Mutex::new(VecDeque::new()),
        }
    }

    /// Link `link` is up: an orphaned stream's usage may go out on it.
    pub fn link_up(&self, link: LinkOut) {
        let mut links = self.links.lock();
        links.retain(|l| l.id != link.id);
        links.push(link);
    }

    /// Sets how long a whole answer stays resumable after its end (from the edge's
    /// config; 0: clients cannot resume).
    pub fn set_keep(&self, keep: Duration) {
        self.keep_ms
            .store(keep.as_millis() as u64, Ordering::Relaxed);
    }

    pub fn keep(&self) -> Duration {
        Duration::from_millis(self.keep_ms.load(Ordering::Relaxed))
    }

    /// Sets the re-attach wait (from the edge's config).
    pub fn set_wait(&self, wait: Duration) {
        self.wait_ms
            .store(wait.as_millis() as u64, Ordering::Relaxed);
    }

    pub fn wait(&self) -> Duration {
        Duration::from_millis(self.wait_ms.load(Ordering::Relaxed))
    }

    /// Bytes every stream keeps together.
    pub fn kept_bytes(&self) -> usize {
        self.kept_bytes.load(Ordering::Relaxed)
    }

    /// Streams in the journal (running, detached or recently ended).
    pub fn len(&self) -> usize {
        self.streams.lock().len()
    }

    /// Enters a new stream (`meta`) going out on `link` with a window of `window` data
    /// frames. An id already in the journal gets a fresh entry (ids are unique; a reused
    /// one is a new stream).
    pub fn begin(
        &self,
        id: &str,
        meta: StreamMeta,
        link: LinkOut,
        window: u32,
    ) -> Arc<JournalStream> {
        let window = if window == 0 {
            iop_proto::STREAM_WINDOW
        } else {
            window
        };
        let whole = meta.resumable && !self.keep().is_zero();
        let stream = Arc::new(JournalStream {
            id: id.to_string(),
            wire: Mutex::new(id.to_string()),
            meta,
            state: tokio::sync::Mutex::new(StreamState {
                link: Some(link),
                whole,
                delivered: false,
                confirmed: false,
                kept: VecDeque::new(),
                first_kept: 0,
                sent: 0,
                pruned_data: 0,
                kept_bytes: 0,
                resumable: true,
                ended_at: None,
                ended_on: None,
                detached_at: None,
            }),
            credit: Semaphore::new(window as usize),
            credited: AtomicU64::new(0),
            cancel: CancellationToken::new(),
            stopped: Mutex::new(None),
            limits: self.limits,
            total: self.kept_bytes.clone(),
        });
        if let Some(old) = self.streams.lock().insert(id.to_string(), stream.clone()) {
            old.forget_kept_now();
        }
        stream
    }

    /// The stream `id`, if the journal has it.
    pub fn get(&self, id: &str) -> Option<Arc<JournalStream>> {
        self.streams.lock().get(id).cloned()
    }

    /// The edge returned `frames` of credit for stream `id` (unknown ids are ignored).
    pub fn grant(&self, id: &str, frames: u32) {
        if let Some(stream) = self.get(id) {
            stream.grant(u64::from(frames));
        }
    }

    /// The edge has stream `id`'s last frame: nothing of it is kept any longer, unless
    /// its client may still resume it.
    pub fn forget_ended(&self, id: &str) {
        let mut streams = self.streams.lock();
        let Some(stream) = streams.get(id).cloned() else {
            return;
        };
        if *stream.wire.lock() != id {
            // A stale name: the stream went on under another since.
            return;
        }
        // The last frame is sent under the stream's lock; one held now is sending it.
        let Ok(mut state) = stream.state.try_lock() else {
            return;
        };
        if state.ended_at.is_none() {
            return;
        }
        state.confirmed = true;
        state.delivered = true;
        if state.whole {
            return;
        }
        stream.forget_kept(&mut state);
        drop(state);
        streams.retain(|_, s| !Arc::ptr_eq(s, &stream));
    }

    /// Which stream a cancel for `id` stops: the journal's own id for it, or `None` when
    /// `id` is a name the stream no longer goes by (a client resumed it elsewhere, so the
    /// edge that cancels has lost it). Ids the journal does not know pass unchanged.
    pub fn cancel_target(&self, id: &str) -> Option<String> {
        match self.get(id) {
            None => Some(id.to_string()),
            Some(stream) => (*stream.wire.lock() == id).then(|| stream.id.clone()),
        }
    }

    /// Link `link` dropped: its streams go on detached, or — when there is no re-attach
    /// wait, or the node shuts down (`stop`) — are stopped with `why`.
    pub fn detach(&self, link: u64, why: &str, stop: bool) {
        self.links.lock().retain(|l| l.id != link);
        let now = Instant::now();
        let stop = stop || self.wait().is_zero();
        let streams: Vec<_> = self.streams.lock().values().cloned().collect();
        for stream in streams {
            let Ok(mut state) = stream.state.try_lock() else {
                // Sending right now: detached below once it is done.
                let stream = stream.clone();
                let why = why.to_string();
                tokio::spawn(async move {
                    let mut state = stream.state.lock().await;
                    stream.detach_locked(&mut state, link, &why, stop, now);
                });
                continue;
            };
            stream.detach_locked(&mut state, link, why, stop, now);
        }
    }

    /// Re-attaches stream `resume.stream_id` to `link`: sends again what the edge did not
    /// receive, then the stream goes on there. A client's resume (`resume.origin`) gets
    /// the whole stream again, under the new id.
    pub async fn resume(&self, resume: &pb::StreamResume, link: LinkOut) -> Resumed {
        let by_client = !resume.origin.is_empty();
        let Some(stream) = self.find(resume) else {
            let message = if by_client {
                "this answer cannot be resumed: the node does not keep it (it ended longer ago \
                 than answers are kept, or the node process restarted since)"
            } else {
                "the node does not have this request: it never received it (or the node \
                 process restarted since)"
            };
            link.end_stream(
                &resume.stream_id,
                resume.tunnel,
                ErrorCode::NodeDisconnected,
                message,
            )
            .await;
            return Resumed::Unknown;
        };
        if by_client && resume.stop {
            return stop_for_client(&stream, resume, &link).await;
        }
        if !by_client {
            stream.grant_to(resume.credited);
        }
        let mut state = stream.state.lock().await;
        let lost =
            !state.resumable || resume.received < state.first_kept || (by_client && !state.whole);
        if lost {
            let message = if by_client {
                "this answer cannot be resumed: it was too large for the node to keep whole"
            } else {
                stream.forget_kept(&mut state);
                state.link = None;
                stream.stop("its answer could not be sent again after the link dropped");
                "the node's link dropped and it kept too little of the answer to send it \
                 again; the request may have run"
            };
            drop(state);
            link.end_stream(
                &resume.stream_id,
                resume.tunnel,
                ErrorCode::BrokenStream,
                message,
            )
            .await;
            return Resumed::NotResumable;
        }
        if by_client && resume.peek {
            return peek(&state, resume, &link).await;
        }
        if by_client {
            self.rename(&stream, &mut state, resume).await;
        }
        // What the edge received needs no resend.
        let received = resume.received.min(state.sent);
        while state.first_kept < received {
            stream.pop_front(&mut state);
        }
        let wire = stream.wire.lock().clone();
        let billed = by_client && state.delivered;
        let (resent, all) = send_kept(&state.kept, &wire, &link, billed).await;
        if !all {
            // This link dropped too: still detached.
            return Resumed::Attached { resent };
        }
        if state.ended_at.is_some() {
            // The new holder has the end now (with its usage, if no edge billed it yet).
            state.delivered = true;
            state.ended_on = Some((
                link.marks.clone(),
                link.marks.pinged.load(Ordering::Acquire),
            ));
        }
        state.link = Some(link);
        state.detached_at = None;
        Resumed::Attached { resent }
    }

    /// The stream a resume names: by its own id, or — a client's — by the id of the
    /// request it answers, for the caller that asked only.
    fn find(&self, resume: &pb::StreamResume) -> Option<Arc<JournalStream>> {
        if resume.origin.is_empty() {
            return self.get(&resume.stream_id);
        }
        self.get(&resume.origin)
            .filter(|s| s.meta.owner == resume.owner)
    }

    /// A client's resume takes `stream` over under its new id: the link that held it, if
    /// any, is told it lost it.
    async fn rename(
        &self,
        stream: &Arc<JournalStream>,
        state: &mut StreamState,
        resume: &pb::StreamResume,
    ) {
        let old = std::mem::replace(&mut *stream.wire.lock(), resume.stream_id.clone());
        if let Some(previous) = state.link.take() {
            let message = "the client resumed this answer on another connection";
            previous
                .end_stream(&old, resume.tunnel, ErrorCode::Cancelled, message)
                .await;
        }
        self.streams
            .lock()
            .insert(resume.stream_id.clone(), stream.clone());
    }

    /// Stops detached streams the wait passed for; forgets ended ones once an edge has
    /// their end and no client may resume them any longer (or the wait passed after
    /// their end, with none received); drops the oldest ended streams while the journal
    /// holds over three quarters of its bound. Run every second or so.
    pub fn sweep(&self, now: Instant) {
        let (wait, keep) = (self.wait(), self.keep());
        let mut streams: Vec<_> = self.streams.lock().values().cloned().collect();
        // A resumed stream is in the map under two names.
        streams.sort_by_key(|s| Arc::as_ptr(s) as usize);
        streams.dedup_by(|a, b| Arc::ptr_eq(a, b));
        let mut gone = foldhash::HashSet::default();
        let mut ended: Vec<(Instant, Arc<JournalStream>)> = Vec::new();
        let mut orphans = Vec::new();
        for stream in streams {
            let Ok(mut state) = stream.state.try_lock() else {
                continue;
            };
            let since = match (state.ended_at, state.detached_at) {
                (Some(end), Some(detached)) => Some(end.max(detached)),
                (end, None) => end,
                (None, Some(detached)) => {
                    if now.saturating_duration_since(detached) >= wait {
                        drop(state);
                        stream.stop(&format!(
                            "no edge re-attached it within {:.1}s of its link dropping",
                            wait.as_secs_f64()
                        ));
                    }
                    continue;
                }
            };
            let confirmed = state.detached_at.is_none()
                && state
                    .ended_on
                    .as_ref()
                    .is_some_and(|(marks, ping)| marks.answered.load(Ordering::Acquire) > *ping);
            if confirmed {
                state.confirmed = true;
                state.delivered = true;
            }
            let Some(since) = since else {
                continue;
            };
            let age = now.saturating_duration_since(since);
            if state.link.is_none() && !state.delivered && age >= wait {
                // No edge received its end, and none took it within the wait.
                state.delivered = true;
                orphans.push(stream.orphan_usage(&state));
            }
            let done = if state.whole {
                age >= keep.max(wait)
            } else {
                state.confirmed || age >= wait
            };
            if done {
                stream.forget_kept(&mut state);
                gone.insert(Arc::as_ptr(&stream) as usize);
            } else if let Some(end) = state.ended_at {
                ended.push((end, stream.clone()));
            }
        }
        // Over three quarters of the bound: the oldest ended answers go first.
        let mut total = self.kept_bytes();
        if total > self.limits.total_bytes / 4 * 3 {
            ended.sort_by_key(|(end, _)| *end);
        } else {
            ended.clear();
        }
        for (_, stream) in ended {
            if total <= self.limits.total_bytes / 4 * 3 {
                break;
            }
            let Ok(mut state) = stream.state.try_lock() else {
                continue;
            };
            total = total.saturating_sub(state.kept_bytes);
            stream.forget_kept(&mut state);
            drop(state);
            gone.insert(Arc::as_ptr(&stream) as usize);
        }
        if !gone.is_empty() {
            let mut streams = self.streams.lock();
            streams.retain(|_, s| !gone.contains(&(Arc::as_ptr(s) as usize)) || !s.is_ended_now());
        }
        self.report_orphans(orphans);
    }

    /// Sends the usage of orphaned streams (and what waits from before) on a live link;
    /// what no link takes now waits for the next sweep.
    fn report_orphans(&self, new: Vec<pb::OrphanUsage>) {
        let mut pending = self.orphans.lock();
        for report in new {
            tracing::info!(stream_id = %report.stream_id, owner = %report.owner, "no edge received this request's end: its usage goes to another edge to be billed");
            if pending.len() >= MAX_PENDING_ORPHANS {
                tracing::warn!(stream_id = %report.stream_id, "too many unbilled usage reports wait for a link: this one is dropped");
                continue;
            }
            pending.push_back(report);
        }
        let Some(link) = self.links.lock().first().cloned() else {
            return;
        };
        while let Some(report) = pending.pop_front() {
            if !link.outbound.try_send(report.clone()) {
                pending.push_front(report);
                return;
            }
        }
    }

    /// Stops every stream (the node shuts down).
    pub fn stop_all(&self, why: &str) {
        for stream in self.streams.lock().values() {
            stream.stop(why);
        }
    }
}

/// A client cancels the answer: it ends `cancelled` as on an edge's cancel, and the
/// client's stream ends at once.
async fn stop_for_client(
    stream: &JournalStream,
    resume: &pb::StreamResume,
    link: &LinkOut,
) -> Resumed {
    stream.cancel.cancel();
    link.end_tunnel(&resume.stream_id).await;
    Resumed::Attached { resent: 0 }
}

/// A look at a kept answer: its frames so far under `resume.stream_id`, then an end (its
/// own, or one added when it still runs); the answer stays where it is.
async fn peek(state: &StreamState, resume: &pb::StreamResume, link: &LinkOut) -> Resumed {
    let (resent, all) = send_kept(&state.kept, &resume.stream_id, link, true).await;
    if all && state.ended_at.is_none() {
        link.end_tunnel(&resume.stream_id).await;
    }
    Resumed::Attached { resent }
}

/// Sends `kept` again as stream `id` on `link`, without their usage when `billed` (an
/// edge billed it already): how many frames went out, and whether all did (false: the
/// link dropped meanwhile).
async fn send_kept(kept: &VecDeque<Kept>, id: &str, link: &LinkOut, billed: bool) -> (usize, bool) {
    let mut resent = 0;
    for kept in kept {
        let mut frame = kept.frame.clone();
        if billed && !frame.drop_usage() {
            continue;
        }
        if link.outbound.send(frame.envelope(id)).await.is_err() {
            return (resent, false);
        }
        resent += 1;
    }
    (resent, true)
}

impl LinkOut {
    /// Ends tunnel `id` here with a plain end frame.
    async fn end_tunnel(&self, id: &str) {
        let end = StreamFrame::Tunnel(Frame::End(pb::TunnelEnd {}));
        // A link that drops meanwhile loses it; the edge's stream ends with the link.
        let _ = self.outbound.send(end.envelope(id)).await;
    }

    /// Ends stream `id` here with one error frame (a run error event or a tunnel error),
    /// instead of going on with it.
    async fn end_stream(&self, id: &str, tunnel: bool, code: ErrorCode, message: &str) {
        let id = id.to_string();
        let end: pb::Envelope = if tunnel {
            pb::ProviderTunnelFrame {
                request_id: id,
                frame: Some(Frame::Error(pb::TunnelError::new(code, message))),
            }
            .into()
        } else {
            pb::RunEvent {
                run_id: id,
                kind: pb::RunEventKind::Error as i32,
                error: Some(pb::RunError::new(code, message)),
                ..Default::default()
            }
            .into()
        };
        // A link that drops meanwhile loses it; the edge parks the stream again.
        let _ = self.outbound.send(end).await;
    }
}

impl JournalStream {
    /// The usage report of this stream, whose end no edge received: what its kept frames
    /// say the provider reported.
    fn orphan_usage(&self, state: &StreamState) -> pb::OrphanUsage {
        let mut report = pb::OrphanUsage {
            stream_id: self.id.clone(),
            tunnel: self.meta.tunnel,
            owner: self.meta.owner.clone(),
            billing: self.meta.billing.clone(),
            provider: self.meta.provider.clone(),
            ..Default::default()
        };
        for kept in &state.kept {
            match &kept.frame {
                StreamFrame::Tunnel(Frame::Usage(usage)) => report.usage = Some(*usage),
                StreamFrame::Tunnel(Frame::Status(status)) => report.status = *status,
                StreamFrame::Tunnel(Frame::Metadata(meta)) => {
                    if let Some(model) = meta.entries.get("model") {
                        report.model = model.clone();
                    }
                }
                StreamFrame::Run(event) => {
                    if let Some(usage) = event.usage {
                        report.usage = Some(usage);
                    }
                    if !event.model.is_empty() {
                        report.model = event.model.clone();
                    }
                }
                StreamFrame::Tunnel(_) => {}
            }
        }
        report
    }

    /// Takes one frame of credit for a data frame; false once the stream is stopped.
    pub async fn credit(&self) -> bool {
        tokio::select! {
            permit = self.credit.acquire() => match permit {
                Ok(permit) => {
                    permit.forget();
                    true
                }
                Err(_) => false,
            },
            _ = self.cancel.cancelled() => false,
        }
    }

    fn grant(&self, frames: u64) {
        self.credited.fetch_add(frames, Ordering::AcqRel);
        self.credit.add_permits(frames as usize);
    }

    /// The edge says it credited `total` data frames in all: what the node did not get
    /// (lost with a link) is granted now.
    fn grant_to(&self, total: u64) {
        let had = self.credited.load(Ordering::Acquire);
        if total > had {
            self.grant(total - had);
        }
    }

    /// Sends one frame (`data`: it spent credit) on the stream's link, keeping it until
    /// the edge credits it; `last`: the stream's last frame. False only once the stream
    /// was stopped.
    pub async fn send(&self, frame: StreamFrame, data: bool, last: bool) -> bool {
        let mut state = self.state.lock().await;
        self.prune(&mut state);
        state.sent += 1;
        if last {
            state.ended_at = Some(Instant::now());
            state.delivered = state.link.is_some();
            state.ended_on = state
                .link
                .as_ref()
                .map(|l| (l.marks.clone(), l.marks.pinged.load(Ordering::Acquire)));
        }
        if state.resumable {
            let size = frame.size();
            let total = self.total.fetch_add(size, Ordering::AcqRel) + size;
            state.kept_bytes += size;
            if state.whole
                && (state.kept_bytes > self.limits.stream_bytes || total > self.limits.total_bytes)
            {
                // Too large to keep whole: from now on only what the edge has not credited.
                tracing::info!(stream_id = %self.id, kept = state.kept_bytes, total, "the journal keeps this answer no longer whole: its client cannot resume it");
                state.whole = false;
                self.prune(&mut state);
            }
            let total = self.total.load(Ordering::Acquire);
            if state.kept_bytes > self.limits.stream_bytes || total > self.limits.total_bytes {
                tracing::warn!(stream_id = %self.id, kept = state.kept_bytes, total, "the journal's bound is reached: this stream can no longer be resumed after a dropped link");
                self.total.fetch_sub(size, Ordering::AcqRel);
                state.kept_bytes -= size;
                self.forget_kept(&mut state);
            } else {
                state.kept.push_back(Kept {
                    frame: frame.clone(),
                    data,
                    size,
                });
            }
        }
        if let Some(link) = &state.link {
            // A link that is going drops the frame; it is kept, and the detach follows.
            // Sent under the stream's lock, so a resume's resend never overtakes it.
            let wire = self.wire.lock().clone();
            let _ = link.outbound.send(frame.envelope(&wire)).await;
        }
        !self.cancel.is_cancelled()
    }

    /// Drops the kept frames the edge credited (a credited data frame was received, and
    /// every frame before it).
    fn prune(&self, state: &mut StreamState) {
        if state.whole {
            return;
        }
        let credited = self.credited.load(Ordering::Acquire);
        while state.pruned_data < credited && !state.kept.is_empty() {
            self.pop_front(state);
        }
    }

    fn pop_front(&self, state: &mut StreamState) {
        if let Some(front) = state.kept.pop_front() {
            if front.data {
                state.pruned_data += 1;
            }
            state.kept_bytes -= front.size;
            self.total.fetch_sub(front.size, Ordering::AcqRel);
        }
        state.first_kept += 1;
    }

    /// Drops everything kept: the stream can no longer be resumed.
    fn forget_kept(&self, state: &mut StreamState) {
        self.total.fetch_sub(state.kept_bytes, Ordering::AcqRel);
        state.kept_bytes = 0;
        state.first_kept += state.kept.len() as u64;
        state.kept.clear();
        state.resumable = false;
    }

    fn forget_kept_now(&self) {
        if let Ok(mut state) = self.state.try_lock() {
            self.forget_kept(&mut state);
        }
    }

    fn is_ended_now(&self) -> bool {
        self.state
            .try_lock()
            .map(|s| s.ended_at.is_some())
            .unwrap_or(false)
    }

    fn detach_locked(
        &self,
        state: &mut StreamState,
        link: u64,
        why: &str,
        stop: bool,
        now: Instant,
    ) {
        if state.link.as_ref().is_none_or(|l| l.id != link) {
            return;
        }
        if stop {
            // It stays on the link, so its last frame still goes out if the link can
            // carry it (the node shuts down: its writer flushes what is queued).
            state.detached_at = Some(now);
            self.stop(why);
            return;
        }
        state.link = None;
        state.detached_at = Some(now);
        // An end the edge did not confirm may have died with the link.
        state.delivered = state.confirmed;
        if state.ended_at.is_none() {
            tracing::info!(stream_id = %self.id, "link dropped: the stream goes on, waiting for an edge to re-attach it");
        }
    }

    /// The node stops the stream for `why` (not the edge's cancel).
    pub fn stop(&self, why: &str) {
        self.stopped.lock().get_or_insert_with(|| why.to_string());
        self.cancel.cancel();
    }

    /// Why the node stopped the stream, if it did.
    pub fn stopped(&self) -> Option<String> {
        self.stopped.lock().clone()
    }
}

#[cfg(test)]
mod tests;
