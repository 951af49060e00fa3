//! Event boundaries of a relayed event stream: the relay forwards a provider's SSE bytes
//! only up to the end of the last complete event and holds the rest until its blank line
//! arrives. When the provider then fails mid-event, the held fragment is dropped and the
//! edge's error event starts on a fresh boundary instead of being glued onto half an
//! event (which a client would parse as one broken event).
//!
//! Pure: bytes in, bytes out. Lines end with CRLF, LF or CR (the SSE grammar); an event
//! ends with an empty line. A fragment longer than [`MAX_HELD`] is let through as it is
//! (a provider with events that large gets no boundary guarantee, but is not stalled).

use bytes::{Bytes, BytesMut};

/// Largest incomplete event held back.
pub const MAX_HELD: usize = 1024 * 1024;

#[derive(Debug)]
pub struct EventBoundary {
    held: BytesMut,
    /// The previous byte ended a line (or nothing came yet).
    line_start: bool,
    /// The previous byte was a CR, so an LF now belongs to it.
    after_cr: bool,
    /// That CR ended an empty line (an event boundary).
    cr_was_boundary: bool,
    /// An oversized fragment was let through: what went out ends inside an event.
    mid_event: bool,
}

impl Default for EventBoundary {
    fn default() -> Self {
        Self {
            held: BytesMut::new(),
            line_start: true,
            after_cr: false,
            cr_was_boundary: false,
            mid_event: false,
        }
    }
}

impl EventBoundary {
    /// Takes the next bytes of the stream; returns what may be sent now (complete events).
    pub fn push(&mut self, chunk: Bytes) -> Bytes {
        let cut = if chunk.ends_with(b"\n\n") {
            // The usual case: whole events. Either LF LF or CRLF LF: an empty line ends it.
            self.line_start = true;
            self.after_cr = false;
            self.cr_was_boundary = false;
            Some(chunk.len())
        } else {
            self.scan(&chunk)
        };
        match cut {
            None => {
                self.held.extend_from_slice(&chunk);
                if self.held.len() > MAX_HELD {
                    self.mid_event = true;
                    return self.held.split().freeze();
                }
                Bytes::new()
            }
            Some(cut) => {
                self.mid_event = false;
                let out = if self.held.is_empty() {
                    chunk.slice(..cut)
                } else {
                    self.held.extend_from_slice(&chunk[..cut]);
                    self.held.split().freeze()
                };
                self.held.extend_from_slice(&chunk[cut..]);
                out
            }
        }
    }

    /// Whether the bytes let through so far end inside an event (after an oversized
    /// fragment), so an event appended now would be glued onto it.
    pub fn mid_event(&self) -> bool {
        self.mid_event
    }

    /// Whether an incomplete event is held back.
    #[cfg(test)]
    pub fn holds_fragment(&self) -> bool {
        !self.held.is_empty()
    }

    /// The held bytes, for a stream that ended normally: the provider's bytes go out as
    /// they are.
    pub fn take_held(&mut self) -> Bytes {
        self.held.split().freeze()
    }

    /// Drops the held fragment (the stream failed); returns whether there was one.
    pub fn discard_held(&mut self) -> bool {
        let had = !self.held.is_empty();
        self.held.clear();
        had
    }

    /// The offset just after the last event boundary in `chunk`, if it has one.
    fn scan(&mut self, chunk: &[u8]) -> Option<usize> {
        let mut cut = None;
        for (i, &b) in chunk.iter().enumerate() {
            if self.after_cr && b == b'\n' {
                // The LF of a CRLF: one line ending, already counted at the CR.
                self.after_cr = false;
                if self.cr_was_boundary {
                    cut = Some(i + 1);
                }
                continue;
            }
            self.after_cr = false;
            match b {
                b'\r' | b'\n' => {
                    let boundary = self.line_start;
                    if boundary {
                        cut = Some(i + 1);
                    }
                    self.line_start = true;
                    self.after_cr = b == b'\r';
                    self.cr_was_boundary = boundary && b == b'\r';
                }
                _ => self.line_start = false,
            }
        }
        cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push_all(b: &mut EventBoundary, chunks: &[&str]) -> String {
        let mut out = String::new();
        for c in chunks {
            out.push_str(std::str::from_utf8(&b.push(Bytes::from(c.to_string()))).unwrap());
        }
        out
    }

    #[test]
    fn whole_events_pass_at_once() {
        let mut b = EventBoundary::default();
        assert_eq!(
            push_all(&mut b, &["data: 1\n\ndata: 2\n\n"]),
            "data: 1\n\ndata: 2\n\n"
        );
        assert!(!b.holds_fragment());
    }

    #[test]
    fn a_split_event_is_held_until_its_blank_line() {
        let mut b = EventBoundary::default();
        assert_eq!(
            push_all(&mut b, &["data: 1\n\ndata: {\"a\""]),
            "data: 1\n\n"
        );
        assert!(b.holds_fragment());
        assert_eq!(push_all(&mut b, &[": 2}\n"]), "");
        assert_eq!(push_all(&mut b, &["\ndata: 3"]), "data: {\"a\": 2}\n\n");
        assert_eq!(b.take_held(), Bytes::from("data: 3"));
    }

    #[test]
    fn a_torn_event_is_dropped_on_failure() {
        let mut b = EventBoundary::default();
        assert_eq!(
            push_all(&mut b, &["data: ok\n\n", "data: {\"choi"]),
            "data: ok\n\n"
        );
        assert!(b.discard_held());
        assert!(!b.holds_fragment());
    }

    #[test]
    fn crlf_and_cr_line_endings_are_boundaries_too() {
        let mut b = EventBoundary::default();
        assert_eq!(
            push_all(&mut b, &["data: 1\r\n\r\ndata: 2\r\rdata: x"]),
            "data: 1\r\n\r\ndata: 2\r\r"
        );
        let mut b = EventBoundary::default();
        // A CRLF split across chunks: the LF belongs to the boundary.
        assert_eq!(push_all(&mut b, &["data: 1\r\n\r"]), "data: 1\r\n\r");
        assert_eq!(push_all(&mut b, &["\n"]), "\n");
        assert!(!b.holds_fragment());
    }

    #[test]
    fn one_line_ending_is_not_a_boundary() {
        let mut b = EventBoundary::default();
        assert_eq!(push_all(&mut b, &["data: 1\n", "data: 2\r\n"]), "");
        assert_eq!(push_all(&mut b, &["\n"]), "data: 1\ndata: 2\r\n\n");
    }

    #[test]
    fn byte_by_byte_gives_the_same_events() {
        let stream =
            "data: a\n\nevent: x\r\ndata: b\r\n\r\n: comment\n\ndata: c\rdata: d\r\rdata: tail";
        let mut b = EventBoundary::default();
        let mut out = String::new();
        for ch in stream.chars() {
            out.push_str(std::str::from_utf8(&b.push(Bytes::from(ch.to_string()))).unwrap());
        }
        assert_eq!(out, &stream[..stream.len() - "data: tail".len()]);
        assert_eq!(b.take_held(), Bytes::from("data: tail"));
    }

    #[test]
    fn an_oversized_fragment_is_let_through() {
        let mut b = EventBoundary::default();
        let big = "x".repeat(MAX_HELD + 1);
        assert_eq!(b.push(Bytes::from(big.clone())).len(), big.len());
        assert!(!b.holds_fragment());
        assert!(b.mid_event());
        assert_eq!(b.push(Bytes::from("x\n\n")), Bytes::from("x\n\n"));
        assert!(!b.mid_event());
    }
}
