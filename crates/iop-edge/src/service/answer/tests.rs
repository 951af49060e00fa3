use iop_proto::pb::provider_tunnel_frame::Frame;

use super::*;
use crate::codec::TunnelSpec;
use crate::service::stream::StreamTerms;
use crate::service::test_support::{cancel_sent, edge_and_session};

/// A tunnel whose frames the test delivers, and a way to deliver them.
async fn open_tunnel() -> (
    TunnelStream,
    impl Fn(Frame),
    tokio::sync::mpsc::Receiver<pb::Envelope>,
) {
    let (edge, session, sent) = edge_and_session();
    let spec = TunnelSpec::post_json("oa", "/chat/completions", Vec::new(), crate::codec::JSON);
    let stream = edge
        .start_tunnel(session.clone(), spec, StreamTerms::default())
        .await
        .unwrap();
    let id = stream.core.id.clone();
    let deliver = move |frame: Frame| {
        session.deliver_tunnel_frame(pb::ProviderTunnelFrame {
            request_id: id.clone(),
            frame: Some(frame),
        });
    };
    (stream, deliver, sent)
}

fn head(deliver: &impl Fn(Frame), status: u32, content_type: &str) {
    deliver(Frame::Status(status));
    deliver(Frame::Headers(pb::TunnelHeaders {
        headers: vec![pb::Header {
            name: "content-type".into(),
            value: content_type.as_bytes().to_vec(),
        }],
    }));
}

async fn all(source: &mut AnswerSource) -> Vec<AnswerEvent> {
    let mut out = Vec::new();
    while let Some(e) = source.next().await {
        out.push(e);
    }
    out
}

#[tokio::test]
async fn a_chat_stream_split_anywhere_becomes_answer_events_ending_at_the_tunnel_end() {
    let stream = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\r\n\r\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":3}}\n\n",
        "data: [DONE]\n\n",
    );
    // (At most a credit window of frames: a node never sends more unread.)
    for size in [3, 7, 64, stream.len()] {
        let (tunnel, deliver, _sent) = open_tunnel().await;
        head(&deliver, 200, "text/event-stream; charset=utf-8");
        for piece in stream.as_bytes().chunks(size) {
            deliver(Frame::Body(Bytes::copy_from_slice(piece)));
        }
        deliver(Frame::End(pb::TunnelEnd {}));
        let mut source = AnswerSource::tunnel(tunnel, Operation::Chat, 1024);
        let events = all(&mut source).await;
        let text: String = events
            .iter()
            .filter_map(|e| match e {
                AnswerEvent::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(text, "Hello", "split by {size}");
        assert!(matches!(events[0], AnswerEvent::Started));
        match events.last().unwrap() {
            AnswerEvent::Finished(f) => assert_eq!(f.usage.unwrap().output_tokens, 3),
            other => panic!("split by {size}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn the_finish_waits_for_the_tunnel_end() {
    let (tunnel, deliver, _sent) = open_tunnel().await;
    head(&deliver, 200, "text/event-stream");
    deliver(Frame::Body(Bytes::from_static(
        b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n",
    )));
    let mut source = AnswerSource::tunnel(tunnel, Operation::Chat, 1024);
    assert!(matches!(source.next().await, Some(AnswerEvent::Started)));
    assert!(matches!(source.next().await, Some(AnswerEvent::Text(_))));
    let pending = tokio::time::timeout(std::time::Duration::from_millis(50), source.next()).await;
    assert!(pending.is_err(), "the finish came before the tunnel ended");
    deliver(Frame::End(pb::TunnelEnd {}));
    assert!(matches!(
        source.next().await,
        Some(AnswerEvent::Finished(_))
    ));
    assert!(source.next().await.is_none());
}

#[tokio::test]
async fn provider_errors_tunnel_errors_and_oversized_answers_fail() {
    // A provider's error answer keeps its status and message.
    let (tunnel, deliver, _sent) = open_tunnel().await;
    head(&deliver, 400, "application/json");
    deliver(Frame::Body(Bytes::from_static(
        br#"{"error":{"message":"no tools here","type":"invalid_request_error"}}"#,
    )));
    deliver(Frame::End(pb::TunnelEnd {}));
    let e = AnswerSource::tunnel(tunnel, Operation::Chat, 1024)
        .first()
        .await
        .unwrap_err();
    assert_eq!(
        (e.status.as_u16(), e.message.as_str()),
        (400, "no tools here")
    );

    // A JSON answer over the limit.
    let (tunnel, deliver, _sent) = open_tunnel().await;
    head(&deliver, 200, "application/json");
    deliver(Frame::Body(Bytes::from(vec![b' '; 2048])));
    deliver(Frame::End(pb::TunnelEnd {}));
    let events = all(&mut AnswerSource::tunnel(tunnel, Operation::Chat, 1024)).await;
    assert!(
        matches!(events.last(), Some(AnswerEvent::Failed(e)) if e.code() == "response_too_large"),
        "{events:?}"
    );

    // The tunnel failing mid-stream.
    let (tunnel, deliver, _sent) = open_tunnel().await;
    head(&deliver, 200, "text/event-stream");
    deliver(Frame::Body(Bytes::from_static(
        b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n",
    )));
    deliver(Frame::Error(pb::TunnelError::new(
        iop_proto::ErrorCode::BrokenStream,
        "connection reset",
    )));
    let events = all(&mut AnswerSource::tunnel(tunnel, Operation::Chat, 1024)).await;
    assert!(
        matches!(events.last(), Some(AnswerEvent::Failed(e)) if e.message == "connection reset"),
        "{events:?}"
    );

    // One event longer than the limit, with no end in sight.
    let (tunnel, deliver, mut sent) = open_tunnel().await;
    head(&deliver, 200, "text/event-stream");
    let chunk = Bytes::from(vec![b'a'; 64 * 1024]);
    deliver(Frame::Body(Bytes::from_static(b"data: ")));
    for _ in 0..(MAX_EVENT_BYTES / chunk.len() + 1) {
        deliver(Frame::Body(chunk.clone()));
    }
    let mut source = AnswerSource::tunnel(tunnel, Operation::Chat, 1024);
    let events = all(&mut source).await;
    assert!(
        matches!(events.last(), Some(AnswerEvent::Failed(e)) if e.message.contains("longer than")),
        "{events:?}"
    );
    drop(source);
    // Dropping the unfinished tunnel cancels it on the node.
    assert!(cancel_sent(&mut sent).await);
}

#[test]
fn event_length_resets_at_empty_lines_across_chunks() {
    let mut l = EventLength::default();
    assert!(l.push(b"data: abc\n"));
    assert_eq!(l.event, 10);
    assert!(l.push(b"\n"));
    assert_eq!(l.event, 0);
    assert!(l.push(b"data: x\r\n\r"));
    assert!(l.push(b"\n"));
    assert_eq!((l.event, l.line), (0, 0));
    let big = vec![b'a'; MAX_EVENT_BYTES / 2];
    assert!(l.push(&big));
    assert!(l.push(b"\n"));
    assert!(!l.push(&big), "one event over the limit");
    let mut l = EventLength::default();
    for _ in 0..10 {
        assert!(l.push(&big));
        assert!(l.push(b"\n\n"));
    }
}
