//! Event ids of a resumable relayed event stream: every event the provider sent gets an
//! `id:` field naming the answer and the event's position in it —
//! `{node}.{stream}.{n}`, `n` counting from 1 — added as the event's last field, so it
//! is the id a client's SSE parser remembers even when the provider sent ids of its own.
//! A client that lost the stream sends its request again with that id in `Last-Event-ID`
//! ([`ResumePoint::parse`]); the answer is replayed from its start and the events up to
//! `n` are left out ([`EventIds::resuming`]), so it gets exactly the rest.
//!
//! Pure: bytes in, bytes out. The input holds whole events (the relay's
//! [`super::sse::EventBoundary`] cuts it so); lines end with CRLF, LF or CR. A block of
//! blank lines with no field is not an event and is neither counted nor stamped.

use std::fmt::Write as _;

use bytes::{BufMut, Bytes, BytesMut};

/// The header a client resumes with.
pub const LAST_EVENT_ID: &str = "last-event-id";

/// Where a client resumes: the answer (its node and stream) and the last event it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumePoint {
    pub node: String,
    pub stream: String,
    pub after: u64,
}

impl ResumePoint {
    /// Reads a `Last-Event-ID` this edge (or another of its fleet) gave; `None` for any
    /// other id (the request is then served as a new one).
    pub fn parse(id: &str) -> Option<Self> {
        let mut parts = id.rsplitn(3, '.');
        let after = parts.next()?.parse().ok()?;
        let stream = parts.next()?;
        let node = parts.next()?;
        let is_stream_id = stream.len() == 32 && stream.bytes().all(|b| b.is_ascii_hexdigit());
        (is_stream_id && !node.is_empty()).then(|| Self {
            node: node.to_string(),
            stream: stream.to_string(),
            after,
        })
    }
}

#[derive(Debug)]
pub struct EventIds {
    /// `id: {node}.{stream}.`
    prefix: Vec<u8>,
    /// Events seen so far.
    count: u64,
    /// Events left out (the client has them).
    skip: u64,
    /// The previous bytes ended with a CR, so a leading LF belongs to that line ending.
    after_cr: bool,
    /// The current line is the first of a block that has fields (an event is open).
    in_event: bool,
    /// The current position starts a line.
    line_start: bool,
}

impl EventIds {
    /// Stamps a new answer of stream `stream` on node `node`.
    #[cfg(test)]
    pub fn new(node: &str, stream: &str) -> Self {
        Self::resuming(node, stream, 0)
    }

    /// Stamps an answer replayed from its start, leaving out its first `skip` events.
    pub fn resuming(node: &str, stream: &str, skip: u64) -> Self {
        Self {
            prefix: format!("id: {node}.{stream}.").into_bytes(),
            count: 0,
            skip,
            after_cr: false,
            in_event: false,
            line_start: true,
        }
    }

    /// Whether events are still being left out.
    fn skipping(&self) -> bool {
        self.count < self.skip
    }

    /// The next bytes of the stream, stamped (and without the events the client has).
    pub fn stamp(&mut self, bytes: &[u8]) -> Bytes {
        let mut out = BytesMut::with_capacity(bytes.len() + 64);
        // Start of what is not written yet.
        let mut from = 0;
        let mut pos = 0;
        if self.after_cr && bytes.first() == Some(&b'\n') {
            pos = 1;
        }
        self.after_cr = false;
        while let Some(found) = memchr::memchr2(b'\r', b'\n', &bytes[pos..]) {
            let eol = pos + found;
            let end = if bytes[eol] == b'\r' && bytes.get(eol + 1) == Some(&b'\n') {
                eol + 2
            } else {
                eol + 1
            };
            if bytes[eol] == b'\r' && end == bytes.len() {
                self.after_cr = true;
            }
            let empty = self.line_start && eol == pos;
            if empty && self.in_event {
                // The blank line that ends an event: the id goes just before it.
                self.count += 1;
                self.in_event = false;
                if self.count > self.skip {
                    out.extend_from_slice(&bytes[from..eol]);
                    out.extend_from_slice(&self.prefix);
                    let _ = write!(out, "{}", self.count);
                    out.put_u8(b'\n');
                    out.extend_from_slice(&bytes[eol..end]);
                }
                from = end;
            } else if !empty {
                self.in_event = true;
            } else if self.skipping() {
                // A stray blank line among left-out events.
                from = end;
            }
            self.line_start = true;
            pos = end;
        }
        if pos < bytes.len() {
            // A line goes on in the next bytes (only past an oversized fragment).
            self.line_start = false;
            self.in_event = true;
        }
        // The rest belongs to the event now open (numbered `count + 1`) or is blank.
        if !self.skipping() {
            out.extend_from_slice(&bytes[from..]);
        }
        out.freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODE: &str = "gpu-1";
    const STREAM: &str = "0123456789abcdef0123456789abcdef";

    fn stamp_all(ids: &mut EventIds, chunks: &[&str]) -> String {
        chunks
            .iter()
            .map(|c| String::from_utf8(ids.stamp(c.as_bytes()).to_vec()).unwrap())
            .collect()
    }

    #[test]
    fn every_event_gets_its_position_as_its_last_field() {
        let mut ids = EventIds::new(NODE, STREAM);
        let out = stamp_all(
            &mut ids,
            &["data: a\n\ndata: b\n\n", "event: x\ndata: c\n\n"],
        );
        let id = |n| format!("id: {NODE}.{STREAM}.{n}\n");
        assert_eq!(
            out,
            format!(
                "data: a\n{}\ndata: b\n{}\nevent: x\ndata: c\n{}\n",
                id(1),
                id(2),
                id(3)
            )
        );
        // The provider's own id is overridden by ours, the later field.
        let mut ids = EventIds::new(NODE, STREAM);
        let out = stamp_all(&mut ids, &["id: 7\ndata: a\n\n"]);
        assert!(
            out.ends_with(&format!("id: {NODE}.{STREAM}.1\n\n")),
            "{out}"
        );
    }

    #[test]
    fn crlf_and_cr_line_endings_and_split_crlfs_count_the_same() {
        let mut ids = EventIds::new(NODE, STREAM);
        let out = stamp_all(&mut ids, &["data: a\r\n\r", "\ndata: b\r\rdata: c\n\n"]);
        assert_eq!(out.matches("id: ").count(), 3, "{out}");
        assert!(out.contains(&format!("{STREAM}.3\n")));
        // Blank lines with no field are not events.
        let mut ids = EventIds::new(NODE, STREAM);
        let out = stamp_all(&mut ids, &["\n\ndata: a\n\n\n"]);
        assert_eq!(out.matches("id: ").count(), 1, "{out}");
    }

    #[test]
    fn a_resume_leaves_out_exactly_the_events_the_client_has() {
        let whole = ["data: a\n\ndata: b\n", "\ndata: c\n\n", "data: [DONE]\n\n"];
        let mut first = EventIds::new(NODE, STREAM);
        let full = stamp_all(&mut first, &whole);
        for after in 0..=4 {
            let mut resumed = EventIds::resuming(NODE, STREAM, after);
            let rest = stamp_all(&mut resumed, &whole);
            let events: Vec<&str> = full.split_inclusive("\n\n").collect();
            assert_eq!(rest, events[after as usize..].concat(), "after {after}");
        }
    }

    #[test]
    fn resume_points_are_read_back_from_the_ids_given() {
        let id = format!("my.node.{STREAM}.42");
        assert_eq!(
            ResumePoint::parse(&id),
            Some(ResumePoint {
                node: "my.node".into(),
                stream: STREAM.into(),
                after: 42
            })
        );
        for other in [
            "",
            "42",
            "abc.42",
            &format!("{STREAM}.1"),
            &format!(".{STREAM}.1"),
            &format!("n.{STREAM}.x"),
            "n.short.1",
        ] {
            assert_eq!(ResumePoint::parse(other), None, "{other}");
        }
    }
}
