//! Removing from an OpenAI-style event stream what `stream_options.include_usage` added,
//! when the edge asked for it and the client did not: the client then gets the bytes the
//! provider would have sent for the request as the client made it.
//!
//! What the option adds, and what is removed, per OpenAI's convention:
//! - the separate usage event before `data: [DONE]` — a `data:` line whose JSON carries a
//!   `usage` object and no (or empty) `choices` — with the blank line that ends its event
//!   and any non-data field lines (`event:`, `id:`, comments) before it in that event;
//! - the `"usage": null` member every other chunk then carries, with the comma that
//!   separated it from its neighbour (so `{"a":1,"usage":null}` becomes `{"a":1}`, and the
//!   `{"usage": null, "a": 1}` of a Python server becomes `{"a": 1}`).
//!
//! Field lines of the usage event that already went out with an earlier chunk cannot be
//! taken back: then the event's blank line is kept, so the client sees an event without
//! data, which an event-stream client does not dispatch.
//!
//! A usage object in a chunk that has choices is left alone: providers that report usage
//! on their last content chunk (llama.cpp) or on every chunk (vLLM's
//! `continuous_usage_stats`, which the edge turns off when it asks) commonly do so whether
//! asked or not, and removing it could change a chunk the client would have received.
//!
//! The cuts are found by the observer's one search for `"usage"` per relayed chunk (see
//! [`super::UsageObserver::relay`]); a chunk without that key is relayed as it is.

use std::ops::Range;

use super::find::{usage_keys, value_start};

/// Longest incomplete line held back before the stripper gives up on a stream and relays
/// the rest as it is.
pub(super) const MAX_HELD_LINE: usize = 1 << 20;

/// The stripping state of one stream.
#[derive(Debug, Default)]
pub(super) struct Stripper {
    /// The previous text ended with a removed usage event's line: the blank line that ends
    /// that event opens the next text.
    blank_pending: bool,
    /// The previous text ended inside an event (its last line was not blank): lines of
    /// the next event already went out.
    mid_event: bool,
    /// Byte ranges of the current text to remove, in order, not overlapping.
    cuts: Vec<Range<usize>>,
}

impl Stripper {
    /// Starts on the next run of complete lines.
    pub(super) fn begin(&mut self, text: &[u8]) {
        self.cuts.clear();
        if std::mem::take(&mut self.blank_pending)
            && let Some(n) = blank_line(text, 0)
        {
            self.cuts.push(0..n);
        }
    }

    /// The complete line `text[start..end]` (its newline at `end`), which the observer
    /// parsed: removed with its event if it is the separate usage event, otherwise only its
    /// `"usage": null` members.
    pub(super) fn line(&mut self, text: &[u8], start: usize, end: usize, usage_event: bool) {
        if !usage_event {
            for at in usage_keys(&text[start..end]).map(|at| start + at) {
                self.null_member(text, at, value_start(text, at));
            }
            return;
        }
        let from = event_fields_start(text, start);
        let mut to = end + 1;
        if from == 0 && self.mid_event {
            // Its first lines already went out: keep the blank line that ends them.
        } else {
            match blank_line(text, to) {
                Some(n) => to += n,
                None if to == text.len() => self.blank_pending = true,
                None => {}
            }
        }
        self.push(from..to);
    }

    /// The key `"usage"` at `key` whose value starts at `value`: removed with its comma if
    /// the value is `null` and the line is a `data:` line.
    pub(super) fn null_member(&mut self, text: &[u8], key: usize, value: usize) {
        let value_end = value + b"null".len();
        if !text[value..].starts_with(b"null")
            || !matches!(
                text.get(value_end),
                Some(b',' | b'}' | b' ' | b'\t' | b'\r' | b'\n')
            )
        {
            return;
        }
        let line_start = memchr::memrchr(b'\n', &text[..key]).map_or(0, |p| p + 1);
        if !text[line_start..].starts_with(b"data:") {
            return;
        }
        let before = text[line_start..key]
            .iter()
            .rposition(|b| !is_space(*b))
            .map(|p| line_start + p);
        match before.map(|p| (p, text[p])) {
            // `…, "usage": null`: from the comma.
            Some((comma, b',')) => self.push(comma..value_end),
            // `{"usage": null, …`: through the comma after it and the spaces after that.
            Some((_, b'{')) => {
                let after = skip_spaces(text, value_end);
                if text.get(after) == Some(&b',') {
                    self.push(key..skip_spaces(text, after + 1));
                } else {
                    self.push(key..value_end);
                }
            }
            _ => {}
        }
    }

    fn push(&mut self, mut range: Range<usize>) {
        while let Some(last) = self.cuts.last() {
            if last.start < range.start {
                break;
            }
            range.end = range.end.max(last.end);
            self.cuts.pop();
        }
        match self.cuts.last_mut() {
            Some(last) if last.end >= range.start => last.end = last.end.max(range.end),
            _ => self.cuts.push(range),
        }
    }

    /// `text` without the cuts; `None` when there are none. Ends the text.
    pub(super) fn apply(&mut self, text: &[u8]) -> Option<Vec<u8>> {
        let body = text.strip_suffix(b"\n").unwrap_or(text);
        let body = body.strip_suffix(b"\r").unwrap_or(body);
        let last_line_blank = body.is_empty() || body.ends_with(b"\n");
        self.mid_event = !last_line_blank && !self.blank_pending;
        if self.cuts.is_empty() {
            return None;
        }
        let removed: usize = self.cuts.iter().map(|r| r.len()).sum();
        let mut out = Vec::with_capacity(text.len() - removed);
        let mut at = 0;
        for cut in &self.cuts {
            out.extend_from_slice(&text[at..cut.start]);
            at = cut.end;
        }
        out.extend_from_slice(&text[at..]);
        Some(out)
    }
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t')
}

fn skip_spaces(text: &[u8], from: usize) -> usize {
    text[from..]
        .iter()
        .position(|b| !is_space(*b))
        .map_or(text.len(), |p| from + p)
}

/// The length of the blank line at `at` (`\n` or `\r\n`), if there is one.
fn blank_line(text: &[u8], at: usize) -> Option<usize> {
    let rest = text.get(at..)?;
    if rest.starts_with(b"\n") {
        Some(1)
    } else if rest.starts_with(b"\r\n") {
        Some(2)
    } else {
        None
    }
}

/// Where the event of the line at `start` begins, counting the non-data field lines just
/// before it (`event:`, `id:`, `retry:`, comments) that belong to it. A data line before
/// it is never taken along: a provider that separates events by single newlines keeps its
/// content.
fn event_fields_start(text: &[u8], mut start: usize) -> usize {
    while start > 0 {
        let prev_end = start - 1;
        let prev_start = memchr::memrchr(b'\n', &text[..prev_end]).map_or(0, |p| p + 1);
        let prev = &text[prev_start..prev_end];
        let prev = prev.strip_suffix(b"\r").unwrap_or(prev);
        if prev.is_empty() || prev.starts_with(b"data:") {
            break;
        }
        start = prev_start;
    }
    start
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::super::{UsageDialect, UsageObserver};

    /// A stream as the mock (and OpenAI) sends it with `include_usage`, and the same
    /// stream as it is without it.
    const WITH: &str = concat!(
        "data: {\"choices\":[{\"delta\":{\"content\":\"\",\"role\":\"assistant\"},\"index\":0}],\"id\":\"c\",\"model\":\"m\",\"usage\":null}\n\n",
        "data: {\"choices\":[{\"delta\":{\"content\":\"Hi \\\"usage\\\":null\"},\"index\":0}],\"id\":\"c\",\"model\":\"m\",\"usage\":null}\n\n",
        "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\",\"index\":0}],\"id\":\"c\",\"model\":\"m\",\"usage\":null}\n\n",
        "data: {\"choices\":[],\"id\":\"c\",\"model\":\"m\",\"usage\":{\"completion_tokens\":2,\"prompt_tokens\":3,\"total_tokens\":5}}\n\n",
        "data: [DONE]\n\n",
    );
    const WITHOUT: &str = concat!(
        "data: {\"choices\":[{\"delta\":{\"content\":\"\",\"role\":\"assistant\"},\"index\":0}],\"id\":\"c\",\"model\":\"m\"}\n\n",
        "data: {\"choices\":[{\"delta\":{\"content\":\"Hi \\\"usage\\\":null\"},\"index\":0}],\"id\":\"c\",\"model\":\"m\"}\n\n",
        "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\",\"index\":0}],\"id\":\"c\",\"model\":\"m\"}\n\n",
        "data: [DONE]\n\n",
    );

    /// Relays `pieces` through a stripping observer: the bytes out, and the usage seen.
    fn relay(pieces: &[&[u8]]) -> (String, Option<(u64, u64)>) {
        let mut o = UsageObserver::new(true, UsageDialect::OpenAi).removing_injected_usage();
        let mut out = Vec::new();
        for piece in pieces {
            out.extend_from_slice(&o.relay(Bytes::copy_from_slice(piece)));
        }
        out.extend_from_slice(&o.take_held());
        let usage = o.finish().map(|u| (u.input_tokens, u.output_tokens));
        (String::from_utf8(out).unwrap(), usage)
    }

    #[test]
    fn the_injected_usage_is_removed_and_still_observed() {
        let (out, usage) = relay(&[WITH.as_bytes()]);
        assert_eq!(out, WITHOUT);
        assert_eq!(usage, Some((3, 2)));
    }

    #[test]
    fn cut_at_every_byte_the_result_is_the_same() {
        let bytes = WITH.as_bytes();
        for at in 0..=bytes.len() {
            let (out, usage) = relay(&[&bytes[..at], &bytes[at..]]);
            assert_eq!(out, WITHOUT, "split at {at}");
            assert_eq!(usage, Some((3, 2)), "split at {at}");
        }
        for size in [1, 2, 3, 7, 64] {
            let pieces: Vec<&[u8]> = bytes.chunks(size).collect();
            assert_eq!(relay(&pieces).0, WITHOUT, "pieces of {size}");
        }
    }

    #[test]
    fn spaced_json_and_crlf_events_come_out_as_without_the_option() {
        let with = concat!(
            "data: {\"usage\": null, \"model\": \"m\", \"choices\": [{\"delta\": {\"content\": \"a\"}}]}\r\n\r\n",
            "data: {\"model\": \"m\", \"choices\": [{\"delta\": {}}], \"usage\" : null }\r\n\r\n",
            "event: usage\r\n",
            "data: {\"model\": \"m\", \"choices\": [], \"usage\": {\"prompt_tokens\": 1, \"completion_tokens\": 4}}\r\n\r\n",
            "data: [DONE]\r\n\r\n",
        );
        let without = concat!(
            "data: {\"model\": \"m\", \"choices\": [{\"delta\": {\"content\": \"a\"}}]}\r\n\r\n",
            "data: {\"model\": \"m\", \"choices\": [{\"delta\": {}}] }\r\n\r\n",
            "data: [DONE]\r\n\r\n",
        );
        // Split after the usage event's `event:` line went out, its blank line stays: an
        // event without data, which clients do not dispatch.
        let event_line_end = with
            .find("data: {\"model\": \"m\", \"choices\": [],")
            .unwrap();
        let data_line_end = event_line_end + with[event_line_end..].find('\n').unwrap() + 1;
        let dangling = without.replace("data: [DONE]", "event: usage\r\n\r\ndata: [DONE]");
        for at in 0..=with.len() {
            let (out, usage) = relay(&[&with.as_bytes()[..at], &with.as_bytes()[at..]]);
            if (event_line_end..data_line_end).contains(&at) {
                assert_eq!(out, dangling, "split at {at}");
            } else {
                assert_eq!(out, without, "split at {at}");
            }
            assert_eq!(usage, Some((1, 4)));
        }
    }

    #[test]
    fn usage_inside_a_content_chunk_and_other_streams_are_left_alone() {
        // llama.cpp style: usage on the finishing chunk; nothing is removed.
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"model\":\"m\"}\n\n",
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n",
            "data: [DONE]\n\n",
        );
        let (out, usage) = relay(&[stream.as_bytes()]);
        assert_eq!(out, stream);
        assert_eq!(usage, Some((1, 1)));
        // An error event, a comment and a trailing incomplete line pass through.
        let stream =
            ": keep-alive\n\ndata: {\"error\":{\"message\":\"usage: none\"}}\n\ndata: {\"x\"";
        assert_eq!(relay(&[stream.as_bytes()]).0, stream);
    }

    #[test]
    fn a_chunk_without_the_key_is_relayed_without_a_copy() {
        let mut o = UsageObserver::new(true, UsageDialect::OpenAi).removing_injected_usage();
        let chunk = Bytes::from_static(b"data: {\"model\":\"m\",\"choices\":[]}\n\n");
        let out = o.relay(chunk.clone());
        assert_eq!(out, chunk);
        assert_eq!(out.as_ptr(), chunk.as_ptr());
    }

    #[test]
    fn an_endless_line_is_relayed_as_it_is() {
        let mut o = UsageObserver::new(true, UsageDialect::OpenAi).removing_injected_usage();
        let mut out = Vec::new();
        let piece = vec![b'x'; 64 * 1024];
        for _ in 0..(super::MAX_HELD_LINE / piece.len() + 2) {
            out.extend_from_slice(&o.relay(Bytes::from(piece.clone())));
        }
        assert!(out.len() >= super::MAX_HELD_LINE, "{}", out.len());
        out.extend_from_slice(&o.relay(Bytes::from_static(
            b"\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n\n",
        )));
        // Given up: the rest passes as it is (and usage is still observed).
        assert!(String::from_utf8_lossy(&out).ends_with("\"prompt_tokens\":1}}\n\n"));
        assert_eq!(o.finish().map(|u| u.input_tokens), Some(1));
    }

    /// Streams made of the pieces that matter, split at random: never a panic, never more
    /// bytes out than in, and a stream without the key comes out as it went in.
    #[test]
    fn random_streams_and_splits_are_safe() {
        const PIECES: &[&str] = &[
            "data: ",
            "\"usage\"",
            ":",
            " ",
            "null",
            "{",
            "}",
            ",",
            "\n",
            "\r\n",
            "\n\n",
            "\"choices\":[]",
            "\"choices\":[1]",
            "\"model\":\"m\"",
            "event: x\n",
            "nul",
            "[DONE]",
        ];
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move |bound: usize| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as usize % bound
        };
        for _ in 0..2000 {
            let stream: String = (0..next(60)).map(|_| PIECES[next(PIECES.len())]).collect();
            let bytes = stream.as_bytes();
            let mut cuts: Vec<usize> = (0..next(5)).map(|_| next(bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut pieces = Vec::new();
            let mut at = 0;
            for cut in cuts {
                pieces.push(&bytes[at..cut]);
                at = cut;
            }
            pieces.push(&bytes[at..]);
            let (out, _) = relay(&pieces);
            assert!(out.len() <= bytes.len(), "{stream:?}");
            if !stream.contains("\"usage\"") {
                assert_eq!(out, stream);
            }
        }
    }
}
