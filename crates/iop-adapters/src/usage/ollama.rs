//! Usage from an Ollama server's native answers, read on the side of a tunnelled
//! `/api/chat`, `/api/generate`, `/api/embed` or `/api/embeddings` response: an NDJSON
//! stream whose final `done` line carries `prompt_eval_count` and `eval_count`, or one
//! JSON document with the same fields (`/api/embed` reports `prompt_eval_count` only).
//! The model is the first line's `model`.
//!
//! Lines are parsed only for the fields read (everything else skipped unbuilt); a line
//! longer than the buffer's limit is not observed.

use std::borrow::Cow;

use iop_proto::pb;
use serde::Deserialize;

use iop_proto::usage::fields::{count, lenient};

/// Longest line kept across chunks (an embeddings answer is one long line).
const MAX_LINE: usize = 8 * 1024 * 1024;

#[derive(Deserialize)]
struct Line<'a> {
    #[serde(borrow, default, deserialize_with = "lenient")]
    model: Option<Cow<'a, str>>,
    #[serde(default, deserialize_with = "count")]
    prompt_eval_count: Option<u64>,
    #[serde(default, deserialize_with = "count")]
    eval_count: Option<u64>,
}

/// Watches an Ollama answer's lines.
#[derive(Debug, Default)]
pub struct OllamaLines {
    /// The incomplete last line.
    carry: Vec<u8>,
    overflowed: bool,
    usage: Option<pb::Usage>,
    model: Option<String>,
}

impl OllamaLines {
    pub fn feed(&mut self, chunk: &[u8]) {
        let Some(last) = memchr::memrchr(b'\n', chunk) else {
            self.keep(chunk);
            return;
        };
        let (complete, rest) = chunk.split_at(last + 1);
        if self.carry.is_empty() && !self.overflowed {
            self.lines(complete);
        } else {
            let mut whole = std::mem::take(&mut self.carry);
            let skip_first = std::mem::take(&mut self.overflowed);
            whole.extend_from_slice(complete);
            let from = if skip_first {
                // The start of this line was not kept: skip what is left of it.
                memchr::memchr(b'\n', &whole).map_or(whole.len(), |p| p + 1)
            } else {
                0
            };
            self.lines(&whole[from..]);
        }
        self.keep(rest);
    }

    fn keep(&mut self, partial: &[u8]) {
        if self.overflowed || partial.is_empty() {
            return;
        }
        if self.carry.len() + partial.len() > MAX_LINE {
            self.carry = Vec::new();
            self.overflowed = true;
        } else {
            self.carry.extend_from_slice(partial);
        }
    }

    fn lines(&mut self, text: &[u8]) {
        for line in text.split(|b| *b == b'\n') {
            self.line(line);
        }
    }

    fn line(&mut self, line: &[u8]) {
        let line = line.trim_ascii();
        if line.is_empty() {
            return;
        }
        // After the model is known, only lines with counts matter.
        if self.model.is_some() && memchr::memmem::find(line, b"eval_count").is_none() {
            return;
        }
        let Ok(seen) = serde_json::from_slice::<Line>(line) else {
            return;
        };
        if self.model.is_none() {
            self.model = seen.model.map(Cow::into_owned);
        }
        if seen.prompt_eval_count.is_some() || seen.eval_count.is_some() {
            self.usage = Some(pb::Usage {
                input_tokens: seen.prompt_eval_count.unwrap_or(0),
                output_tokens: seen.eval_count.unwrap_or(0),
                reasoning_tokens: None,
                cached_input_tokens: None,
            });
        }
    }

    /// The counts the answer reported, once it is complete.
    pub fn finish(&mut self) -> Option<pb::Usage> {
        if !self.overflowed && !self.carry.is_empty() {
            let last = std::mem::take(&mut self.carry);
            self.line(&last);
        }
        self.usage.take()
    }

    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_reports_the_done_lines_counts() {
        let stream = concat!(
            "{\"model\":\"llama3\",\"message\":{\"role\":\"assistant\",\"content\":\"Hi\"},\"done\":false}\n",
            "{\"model\":\"llama3\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done\":true,",
            "\"done_reason\":\"stop\",\"prompt_eval_count\":12,\"eval_count\":34,\"eval_duration\":5}\n"
        );
        let mut o = OllamaLines::default();
        for piece in stream.as_bytes().chunks(9) {
            o.feed(piece);
        }
        assert_eq!(o.model(), Some("llama3"));
        let u = o.finish().unwrap();
        assert_eq!((u.input_tokens, u.output_tokens), (12, 34));
    }

    #[test]
    fn a_json_answer_without_a_newline_is_read_at_the_end() {
        let mut o = OllamaLines::default();
        o.feed(br#"{"model":"nomic","embeddings":[[0.1,0.2]],"prompt_eval_count":3}"#);
        assert!(o.usage.is_none());
        let u = o.finish().unwrap();
        assert_eq!((u.input_tokens, u.output_tokens), (3, 0));
        assert_eq!(o.model(), Some("nomic"));
    }

    #[test]
    fn no_counts_no_usage_and_an_overlong_line_is_skipped() {
        let mut o = OllamaLines::default();
        o.feed(b"{\"embedding\":[0.5]}\n");
        assert!(o.finish().is_none());
        let mut o = OllamaLines::default();
        o.feed(&vec![b'x'; MAX_LINE + 1]);
        o.feed(b"tail\n{\"model\":\"m\",\"prompt_eval_count\":1,\"eval_count\":2}\n");
        assert_eq!(o.finish().map(|u| u.output_tokens), Some(2));
    }
}
