//! Named server-sent events, as the Responses and Messages APIs send them: an `event:`
//! line naming the event and one `data:` line of JSON, ending on an empty line.

use serde_json::Value;

use crate::canonical::AnswerEvent;

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

/// The writer of an API whose answers stream as named events (Responses, Messages):
/// the events that open a stream, those each answer event becomes, and the whole answer
/// once it finished.
pub trait EventWriter {
    /// The events that open a stream.
    fn start(&mut self, out: &mut Vec<SseEvent>);
    /// The events `event` becomes (on a stream; a whole answer only collects it).
    fn push(&mut self, event: AnswerEvent, out: &mut Vec<SseEvent>);
    /// The whole answer, once it finished (`None` before, and after a failure).
    fn finished(&self) -> Option<&Value>;

    /// Everything `events` become (after the opening events when `streaming`), and the
    /// whole answer.
    #[cfg(test)]
    fn render(
        &mut self,
        events: Vec<AnswerEvent>,
        streaming: bool,
    ) -> (Vec<SseEvent>, Option<Value>) {
        let mut out = Vec::new();
        if streaming {
            self.start(&mut out);
        }
        for e in events {
            self.push(e, &mut out);
        }
        (out, self.finished().cloned())
    }
}

/// The bytes of `events`.
#[cfg(test)]
pub fn encode(events: &[SseEvent]) -> bytes::Bytes {
    let mut out = Vec::with_capacity(events.len() * 256);
    for e in events {
        e.write(&mut out);
    }
    bytes::Bytes::from(out)
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
