//! The ledger's writer: one dedicated thread that owns the SQLite connection, takes
//! records from a bounded channel and commits them in batches (up to [`MAX_BATCH`]
//! records, or what arrived within [`BATCH_WINDOW`] of a batch's first record), and prunes
//! rows past the retention once an hour. Nothing on the relay path waits for it: the
//! sending side only ever `try_send`s ([`super::Ledger::push`]).
//!
//! While a batch fills, the writer does not wait on the channel: it sleeps (parked) and
//! takes what arrived every [`GATHER_TICK`]. A receiver blocked on the channel would be
//! woken by every record, a system call and a thread switch per request on the relay's
//! thread; parked, only the first record of a batch wakes it. A flush or close unparks
//! it ([`super::Ledger::flush`]), so neither waits for the tick.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use rusqlite::Connection;

use super::record::UsageRecord;
use super::store;

/// Most records committed in one transaction.
pub const MAX_BATCH: usize = 1_000;
/// How long a batch waits for more records after its first.
pub const BATCH_WINDOW: Duration = Duration::from_millis(200);
/// How often a filling batch takes what arrived.
pub const GATHER_TICK: Duration = Duration::from_millis(25);
/// How often rows past the retention are deleted.
pub const PRUNE_EVERY: Duration = Duration::from_secs(3600);

/// What the writer is sent. Nearly every message is a record, so records are not boxed
/// (that would be an allocation per request for the rare flush and close); the channel
/// allocates its slots in blocks as it fills and frees them as it drains.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Message {
    Record(UsageRecord),
    /// Commit everything sent before, then answer.
    Flush(SyncSender<()>),
    /// Commit everything sent before and stop.
    Close,
}

/// What the writer thread needs.
pub struct Writer {
    pub conn: Connection,
    pub rx: Receiver<Message>,
    /// Records sent and not yet taken: one less for each record received.
    pub queued: Arc<AtomicUsize>,
    /// Rows older than this many days are deleted.
    pub retention_days: u32,
    /// Records committed.
    pub written: Counter,
    /// Records lost (here: a failed commit).
    pub dropped: Counter,
}

impl Writer {
    /// A record taken from the channel into the batch.
    fn take(&self, batch: &mut Vec<UsageRecord>, record: UsageRecord) {
        self.queued.fetch_sub(1, Ordering::Relaxed);
        batch.push(record);
    }

    /// Runs until [`Message::Close`] or every sender is gone, committing what came first.
    pub fn run(mut self) {
        let mut batch: Vec<UsageRecord> = Vec::with_capacity(MAX_BATCH);
        let mut acks: Vec<SyncSender<()>> = Vec::new();
        let mut next_prune = Instant::now();
        let mut closing = false;
        while !closing {
            if Instant::now() >= next_prune {
                self.prune();
                next_prune = Instant::now() + PRUNE_EVERY;
            }
            let wait = next_prune.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(wait) {
                Ok(Message::Record(r)) => self.take(&mut batch, r),
                Ok(Message::Flush(ack)) => acks.push(ack),
                Ok(Message::Close) | Err(RecvTimeoutError::Disconnected) => closing = true,
                Err(RecvTimeoutError::Timeout) => continue,
            }
            // Fill the batch: what arrives within BATCH_WINDOW after its first record, taken
            // every GATHER_TICK (or at once when unparked), until MAX_BATCH records. A
            // flush or close commits at once.
            let until = Instant::now() + BATCH_WINDOW;
            loop {
                // Everything queued; after a close too, so records that came in just
                // behind it are committed, not lost.
                loop {
                    match self.rx.try_recv() {
                        Ok(Message::Record(r)) => self.take(&mut batch, r),
                        Ok(Message::Flush(ack)) => acks.push(ack),
                        Ok(Message::Close) => closing = true,
                        Err(TryRecvError::Disconnected) => {
                            closing = true;
                            break;
                        }
                        Err(TryRecvError::Empty) => break,
                    }
                }
                let left = until.saturating_duration_since(Instant::now());
                if closing || !acks.is_empty() || batch.len() >= MAX_BATCH || left.is_zero() {
                    break;
                }
                std::thread::park_timeout(left.min(GATHER_TICK));
            }
            self.commit(&mut batch);
            for ack in acks.drain(..) {
                let _ = ack.try_send(());
            }
        }
        tracing::debug!(written = self.written.get(), "usage ledger writer stopped");
    }

    fn commit(&mut self, batch: &mut Vec<UsageRecord>) {
        if batch.is_empty() {
            return;
        }
        for chunk in batch.chunks(MAX_BATCH) {
            match store::insert(&mut self.conn, chunk) {
                Ok(()) => {
                    self.written.inc_by(chunk.len() as u64);
                }
                Err(err) => {
                    self.dropped.inc_by(chunk.len() as u64);
                    tracing::error!(%err, records = chunk.len(), "usage ledger: cannot write records; they are counted as dropped");
                }
            }
        }
        batch.clear();
    }

    fn prune(&self) {
        let cutoff = super::record::unix_ms_now() - i64::from(self.retention_days) * 86_400_000;
        match store::prune(&self.conn, cutoff) {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                deleted = n,
                retention_days = self.retention_days,
                "usage ledger: old records deleted"
            ),
            Err(err) => tracing::warn!(%err, "usage ledger: cannot delete old records"),
        }
    }
}
