//! Named server-sent events, as the Responses and Messages APIs send them: an `event:`
//! line naming the event and one `data:` line of JSON, ending on an empty line.

use bytes::Bytes;
use serde_json::Value;

/// One event to send.
#[derive(Debug, Clone, PartialEq)]
pub struct SseEvent {
    pub name: &'static str,
    pub data: Value,
}

impl SseEvent {
    pub fn new(name: &'static str, data: Value) -> Self {
        Self { name, data }
    }

    /// Appends the event's bytes to `out`.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(self.name.as_bytes());
        out.extend_from_slice(b"\ndata: ");
        serde_json::to_writer(&mut *out, &self.data).expect("JSON values serialize");
        out.extend_from_slice(b"\n\n");
    }
}

/// The bytes of `events`.
pub fn encode(events: &[SseEvent]) -> Bytes {
    let mut out = Vec::with_capacity(events.len() * 256);
    for e in events {
        e.write(&mut out);
    }
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_its_name_and_one_data_line() {
        let e = SseEvent::new("ping", serde_json::json!({"type": "ping", "x": "a\nb"}));
        assert_eq!(
            encode(&[e]),
            "event: ping\ndata: {\"type\":\"ping\",\"x\":\"a\\nb\"}\n\n"
        );
    }
}
