use std::time::Duration;

use super::*;
use crate::ledger::RequestRecorder;
use crate::service::test_support::{Collect, cancel_sent, edge_and_session, recorder};

/// A tunnel on a fresh edge's node session, serving a request's record.
struct Served {
    session: Arc<NodeSession>,
    /// What the edge sent the node.
    sent: tokio::sync::mpsc::Receiver<pb::Envelope>,
    stream: TunnelStream,
    recorder: RequestRecorder,
    /// Where the record lands when the request ends.
    sink: Arc<Collect>,
}

async fn served_tunnel() -> Served {
    let (edge, session, sent) = edge_and_session();
    let (recorder, sink) = recorder();
    let mut stream = edge
        .start_tunnel(session.clone(), spec(), StreamTerms::default())
        .await
        .unwrap();
    stream.serve(recorder.clone());
    Served {
        session,
        sent,
        stream,
        recorder,
        sink,
    }
}

fn spec() -> TunnelSpec {
    TunnelSpec::post_json(
        "oa",
        "/chat/completions",
        Vec::new(),
        crate::codec::EVENT_STREAM,
    )
}

fn frame(stream: &TunnelStream, frame: Frame) -> pb::ProviderTunnelFrame {
    pb::ProviderTunnelFrame {
        request_id: stream.core.id.clone(),
        frame: Some(frame),
    }
}

fn usage(output_tokens: u64) -> Frame {
    Frame::Usage(pb::Usage {
        input_tokens: 3,
        output_tokens,
        ..Default::default()
    })
}

fn model(name: &str) -> Frame {
    Frame::Metadata(pb::TunnelMetadata {
        entries: [("model".to_string(), name.to_string())].into(),
    })
}

fn headers(content_type: &str) -> Frame {
    Frame::Headers(pb::TunnelHeaders {
        headers: vec![crate::codec::header("content-type", content_type)],
    })
}

#[tokio::test]
async fn usage_is_recorded_once_at_the_end_with_the_served_model_in_either_order() {
    let Served {
        session,
        mut stream,
        recorder,
        sink,
        ..
    } = served_tunnel().await;
    recorder.responded(200);
    // Usage first, then the metadata naming the model.
    for f in [
        Frame::Status(200),
        usage(16),
        model("served-model"),
        Frame::End(pb::TunnelEnd {}),
    ] {
        assert_eq!(
            session.deliver_tunnel_frame(frame(&stream, f)),
            crate::session::Delivery::Delivered
        );
    }
    assert!(matches!(stream.next().await, Some(TunnelItem::Status(200))));
    assert!(matches!(stream.next().await, Some(TunnelItem::End)));
    drop(stream);
    drop(recorder);
    let finished = sink.0.lock();
    assert_eq!(finished.len(), 1);
    let f = &finished[0];
    assert_eq!(
        (f.record.output_tokens, f.record.outcome.as_str()),
        (16, "ok")
    );
    assert_eq!(f.served_model.as_deref(), Some("served-model"));
}

#[tokio::test]
async fn usage_that_arrived_is_recorded_when_the_client_leaves_before_the_end() {
    let Served {
        session,
        mut sent,
        mut stream,
        recorder,
        sink,
    } = served_tunnel().await;
    recorder.responded(200);
    for f in [Frame::Status(200), model("m"), usage(7)] {
        session.deliver_tunnel_frame(frame(&stream, f));
    }
    assert!(matches!(stream.next().await, Some(TunnelItem::Status(200))));
    // The frames after the status are taken in (observations only), then the client goes.
    let pending = tokio::time::timeout(Duration::from_millis(50), stream.next()).await;
    assert!(pending.is_err(), "no client-relevant frame was sent");
    drop(stream);
    drop(recorder);
    let record = sink.0.lock()[0].record.clone();
    assert_eq!(
        (record.output_tokens, record.outcome.as_str()),
        (7, "client_abort")
    );
    assert!(cancel_sent(&mut sent).await, "no cancel sent to the node");
}

#[tokio::test]
async fn relayed_events_are_counted_for_a_client_that_leaves_without_usage() {
    let Served {
        session,
        mut stream,
        recorder,
        sink,
        ..
    } = served_tunnel().await;
    recorder.dispatched("n1", "oa", "tunnel");
    recorder.responded(200);
    session.deliver_tunnel_frame(frame(&stream, Frame::Status(200)));
    session.deliver_tunnel_frame(frame(&stream, headers("text/event-stream")));
    for piece in ["data: {\"a\":1}\n", "\ndata: {\"b\"", ":2}\r\n\r", "\n"] {
        session.deliver_tunnel_frame(frame(&stream, Frame::Body(Bytes::from(piece))));
    }
    for _ in 0..6 {
        stream.next().await.unwrap();
    }
    drop(stream);
    drop(recorder);
    let r = &sink.0.lock()[0].record;
    assert_eq!(
        (r.outcome.as_str(), r.est_output_tokens),
        ("client_abort", Some(2))
    );
}

#[tokio::test]
async fn a_node_lost_after_it_accepted_is_node_disconnected_and_acknowledged() {
    let (edge, session, _sent) = edge_and_session();
    let mut stream = edge
        .start_tunnel(session.clone(), spec(), StreamTerms::default())
        .await
        .unwrap();
    assert!(!stream.core.acknowledged());
    session.deliver_tunnel_frame(frame(&stream, Frame::Accepted(pb::TunnelAccepted {})));
    session.close("node shut down");
    let e = stream.head().await.unwrap_err();
    assert_eq!(e.error_code(), ErrorCode::NodeDisconnected);
    assert!(stream.core.acknowledged());
}

#[test]
fn events_are_counted_wherever_the_bytes_split() {
    let stream = b"data: a\n\ndata: b\r\n\r\n: comment\n\ndata: [DONE]\n\n";
    for size in 1..stream.len() {
        let mut counter = EventCounter::default();
        let total: u64 = stream.chunks(size).map(|c| counter.push(c)).sum();
        assert_eq!(total, 4, "split by {size}");
    }
    let mut counter = EventCounter::default();
    assert_eq!(
        counter.push(b"\n\n\n"),
        0,
        "empty lines alone make no event"
    );
}

proptest::proptest! {
    /// Whatever the events and however their bytes are split, every event is counted once.
    #[test]
    fn events_are_counted_once_for_any_split(
        events in proptest::collection::vec(("[a-z :]{1,20}", proptest::bool::ANY), 0..30),
        cuts in proptest::collection::vec(proptest::prelude::any::<proptest::sample::Index>(), 0..10),
    ) {
        let mut body = Vec::new();
        for (text, crlf) in &events {
            let end: &[u8] = if *crlf { b"\r\n" } else { b"\n" };
            body.extend_from_slice(b"data: ");
            body.extend_from_slice(text.as_bytes());
            body.extend_from_slice(end);
            body.extend_from_slice(end);
        }
        let mut points: Vec<usize> = cuts.iter().map(|i| i.index(body.len() + 1)).collect();
        points.sort_unstable();
        let mut counter = EventCounter::default();
        let mut from = 0;
        let mut counted = 0;
        for p in points.into_iter().chain([body.len()]) {
            counted += counter.push(&body[from..p]);
            from = p;
        }
        proptest::prop_assert_eq!(counted, events.len() as u64);
    }
}
