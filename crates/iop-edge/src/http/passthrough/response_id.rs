//! A background response's events name it by iop's id: the provider's own id for the
//! response (read from the first event that carries a `response` object) is replaced, as
//! a whole JSON string, by iop's in every event, so a client that reads the id from the
//! stream (`response.created`) can fetch or resume the response through any edge.
//!
//! Pure: bytes in, bytes out. The input holds whole events (the relay cuts it so).

use bytes::{Bytes, BytesMut};
use serde_json::Value;

#[derive(Debug)]
pub struct ResponseRename {
    /// iop's id, quoted.
    ours: Vec<u8>,
    /// The provider's, quoted, once an event named it.
    theirs: Option<Vec<u8>>,
}

impl ResponseRename {
    pub fn new(ours: &str) -> Self {
        Self {
            ours: quoted(ours),
            theirs: None,
        }
    }

    /// The next whole events, with the provider's response id replaced by iop's.
    pub fn apply(&mut self, bytes: Bytes) -> Bytes {
        if self.theirs.is_none() {
            self.theirs = provider_id(&bytes).map(|id| quoted(&id));
        }
        let Some(theirs) = &self.theirs else {
            return bytes;
        };
        let finder = memchr::memmem::Finder::new(theirs);
        let mut found = finder.find_iter(&bytes).peekable();
        if found.peek().is_none() {
            return bytes;
        }
        let mut out = BytesMut::with_capacity(bytes.len() + 64);
        let mut from = 0;
        for at in found {
            out.extend_from_slice(&bytes[from..at]);
            out.extend_from_slice(&self.ours);
            from = at + theirs.len();
        }
        out.extend_from_slice(&bytes[from..]);
        out.freeze()
    }
}

fn quoted(id: &str) -> Vec<u8> {
    serde_json::to_vec(id).expect("strings serialize")
}

/// The `response.id` of the first event in `bytes` that carries a response object.
fn provider_id(bytes: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(bytes).ok()?;
    text.split("\n\n").find_map(|event| {
        let data = event
            .lines()
            .find_map(|l| l.strip_prefix("data:"))?
            .trim_start();
        let value: Value = serde_json::from_str(data).ok()?;
        value["response"]["id"].as_str().map(String::from)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_providers_response_id_becomes_iops_in_every_event() {
        let mut rename = ResponseRename::new("resp_iop");
        let first = rename.apply(Bytes::from_static(
            b"event: response.created\ndata: {\"response\":{\"id\":\"resp_1\",\"status\":\"queued\"}}\n\n",
        ));
        assert_eq!(
            &first[..],
            b"event: response.created\ndata: {\"response\":{\"id\":\"resp_iop\",\"status\":\"queued\"}}\n\n"
        );
        let later = rename.apply(Bytes::from_static(
            b"data: {\"item_id\":\"msg_1\",\"delta\":\"resp_1 \\\"resp_1\\\"\"}\n\ndata: {\"response\":{\"id\":\"resp_1\"}}\n\n",
        ));
        // The id as a whole JSON string only: text that merely contains it is left alone.
        assert_eq!(
            &later[..],
            b"data: {\"item_id\":\"msg_1\",\"delta\":\"resp_1 \\\"resp_1\\\"\"}\n\ndata: {\"response\":{\"id\":\"resp_iop\"}}\n\n"
        );
        // Nothing to rename before an event names the response.
        let mut fresh = ResponseRename::new("resp_iop");
        let text = Bytes::from_static(b"data: {\"x\":1}\n\n");
        assert_eq!(fresh.apply(text.clone()), text);
    }
}
