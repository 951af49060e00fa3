use super::*;
use iop_proto::pb::envelope::Message;

fn link(id: u64) -> (LinkOut, tokio::sync::mpsc::Receiver<pb::Envelope>) {
    let (outbound, rx) = Outbound::channel(100_000);
    (
        LinkOut {
            id,
            outbound,
            marks: Arc::default(),
        },
        rx,
    )
}

fn body(n: u8) -> StreamFrame {
    StreamFrame::Tunnel(Frame::Body(vec![n; 100].into()))
}

fn end() -> StreamFrame {
    StreamFrame::Tunnel(Frame::End(pb::TunnelEnd {}))
}

fn drain(rx: &mut tokio::sync::mpsc::Receiver<pb::Envelope>) -> Vec<pb::Envelope> {
    std::iter::from_fn(|| rx.try_recv().ok()).collect()
}

fn first_byte(envelope: &pb::Envelope) -> Option<u8> {
    match &envelope.message {
        Some(Message::ProviderTunnelFrame(f)) => match &f.frame {
            Some(Frame::Body(b)) => b.first().copied(),
            _ => None,
        },
        _ => None,
    }
}

fn error_code(envelope: &pb::Envelope) -> Option<ErrorCode> {
    match &envelope.message {
        Some(Message::ProviderTunnelFrame(f)) => match &f.frame {
            Some(Frame::Error(e)) => Some(e.error_code()),
            _ => None,
        },
        Some(Message::RunEvent(e)) => e.error.as_ref().map(|e| e.error_code()),
        _ => None,
    }
}

fn resume(id: &str, tunnel: bool, received: u64, credited: u64) -> pb::StreamResume {
    pb::StreamResume {
        stream_id: id.into(),
        tunnel,
        received,
        credited,
        ..Default::default()
    }
}

/// A client's resume of stream `origin` (owned by `owner`) under the new id `id`.
fn client_resume(id: &str, origin: &str, owner: &str) -> pb::StreamResume {
    pb::StreamResume {
        stream_id: id.into(),
        tunnel: true,
        origin: origin.into(),
        owner: owner.into(),
        ..Default::default()
    }
}

fn stream_id(envelope: &pb::Envelope) -> &str {
    match &envelope.message {
        Some(Message::ProviderTunnelFrame(f)) => &f.request_id,
        _ => "",
    }
}

fn usage() -> StreamFrame {
    StreamFrame::Tunnel(Frame::Usage(pb::Usage {
        input_tokens: 3,
        output_tokens: 5,
        ..Default::default()
    }))
}

fn streamed() -> StreamMeta {
    StreamMeta {
        tunnel: true,
        resumable: true,
        ..Default::default()
    }
}

fn owned(owner: &str) -> StreamMeta {
    StreamMeta {
        owner: owner.into(),
        ..streamed()
    }
}

fn resumable() -> Journal {
    let journal = Journal::default();
    journal.set_wait(Duration::from_secs(15));
    journal.set_keep(Duration::from_secs(300));
    journal
}

#[tokio::test]
async fn a_client_resume_gets_the_whole_answer_again_under_its_new_id_and_the_rest_after() {
    let journal = resumable();
    let (first, mut on_first) = link(1);
    let stream = journal.begin("t", owned("alice"), first, 8);
    for n in 0..5 {
        assert!(stream.send(body(n), true, false).await);
    }
    // The edge consumed and credited all of it: still kept whole.
    journal.grant("t", 5);
    assert_eq!(drain(&mut on_first).len(), 5);
    // The edge died; the client resumes through another edge.
    journal.detach(1, "gone", false);
    let (second, mut on_second) = link(2);
    let resumed = journal
        .resume(&client_resume("u", "t", "alice"), second)
        .await;
    assert_eq!(resumed, Resumed::Attached { resent: 5 });
    let again = drain(&mut on_second);
    assert_eq!(
        again.iter().map(first_byte).collect::<Vec<_>>(),
        (0..5).map(Some).collect::<Vec<_>>()
    );
    assert!(again.iter().all(|e| stream_id(e) == "u"));
    // Later frames follow it there, under its new name.
    assert!(stream.send(body(5), true, false).await);
    assert!(stream.send(end(), false, true).await);
    let rest = drain(&mut on_second);
    assert_eq!(rest.len(), 2);
    assert!(rest.iter().all(|e| stream_id(e) == "u"));
    // The new edge's credit reaches it; the old name no longer cancels it.
    journal.grant("u", 1);
    assert_eq!(journal.cancel_target("t"), None);
    assert_eq!(journal.cancel_target("u").as_deref(), Some("t"));
    assert_eq!(journal.cancel_target("other").as_deref(), Some("other"));
}

#[tokio::test]
async fn only_the_caller_that_asked_resumes_an_answer() {
    let journal = resumable();
    let (first, _on_first) = link(1);
    let stream = journal.begin("t", owned("alice"), first, 8);
    assert!(stream.send(body(0), true, false).await);
    let (second, mut on_second) = link(2);
    let resumed = journal
        .resume(&client_resume("u", "t", "mallory"), second)
        .await;
    assert_eq!(resumed, Resumed::Unknown);
    let answer = drain(&mut on_second);
    assert_eq!(answer.len(), 1);
    assert_eq!(error_code(&answer[0]), Some(ErrorCode::NodeDisconnected));
    // Alice's stream was not touched.
    assert!(!stream.cancel.is_cancelled());
}

#[tokio::test]
async fn a_live_holder_loses_the_stream_to_its_clients_resume() {
    let journal = resumable();
    let (first, mut on_first) = link(1);
    let stream = journal.begin("t", streamed(), first, 8);
    assert!(stream.send(body(0), true, false).await);
    drain(&mut on_first);
    let (second, mut on_second) = link(2);
    journal.resume(&client_resume("u", "t", ""), second).await;
    let told = drain(&mut on_first);
    assert_eq!(told.len(), 1);
    assert_eq!(error_code(&told[0]), Some(ErrorCode::Cancelled));
    assert_eq!(stream_id(&told[0]), "t");
    assert_eq!(drain(&mut on_second).len(), 1);
}

#[tokio::test]
async fn an_answer_an_edge_received_whole_is_replayed_without_its_usage() {
    let journal = resumable();
    let (first, mut on_first) = link(1);
    let stream = journal.begin("t", streamed(), first, 8);
    assert!(stream.send(body(0), true, false).await);
    assert!(stream.send(usage(), false, false).await);
    assert!(stream.send(end(), false, true).await);
    drain(&mut on_first);
    // The edge has its end: kept still, for the client.
    journal.forget_ended("t");
    assert_eq!(journal.len(), 1);
    let (second, mut on_second) = link(2);
    let resumed = journal.resume(&client_resume("u", "t", ""), second).await;
    assert_eq!(resumed, Resumed::Attached { resent: 2 });
    let replay = drain(&mut on_second);
    assert!(replay.iter().all(|e| !matches!(&e.message, Some(Message::ProviderTunnelFrame(f)) if matches!(f.frame, Some(Frame::Usage(_))))));
    // An answer whose end no edge received is replayed with it (the new edge bills it).
    let (third, mut on_third) = link(3);
    let other = journal.begin("v", streamed(), third, 8);
    assert!(other.send(usage(), false, false).await);
    assert!(other.send(end(), false, true).await);
    journal.detach(3, "gone", false);
    drain(&mut on_third);
    let (fourth, mut on_fourth) = link(4);
    let resumed = journal.resume(&client_resume("w", "v", ""), fourth).await;
    assert_eq!(resumed, Resumed::Attached { resent: 2 });
    drain(&mut on_fourth);
}

#[tokio::test]
async fn ended_answers_are_kept_for_their_time_and_the_oldest_go_first_under_pressure() {
    let limits = JournalLimits {
        stream_bytes: 64 * 1024,
        total_bytes: 4 * 1024,
    };
    let journal = Journal::new(limits);
    journal.set_wait(Duration::from_secs(1));
    journal.set_keep(Duration::from_secs(60));
    let (l, _rx) = link(1);
    for i in 0..4 {
        let stream = journal.begin(&format!("s{i}"), streamed(), l.clone(), 64);
        // 100-byte bodies: 8 frames are about a kilobyte.
        for n in 0..8 {
            assert!(stream.send(body(n), true, false).await);
        }
        assert!(stream.send(end(), false, true).await);
        journal.forget_ended(&format!("s{i}"));
        assert!(
            journal.kept_bytes() <= limits.total_bytes,
            "{}",
            journal.kept_bytes()
        );
    }
    let now = Instant::now();
    journal.sweep(now);
    assert!(journal.kept_bytes() <= limits.total_bytes / 4 * 3);
    assert!(journal.get("s0").is_none(), "the oldest went first");
    assert!(journal.get("s3").is_some(), "the newest is still kept");
    // Past its time, an answer is forgotten.
    journal.sweep(now + Duration::from_secs(61));
    assert_eq!(journal.len(), 0);
    assert_eq!(journal.kept_bytes(), 0);
}

#[tokio::test]
async fn a_resume_sends_again_exactly_what_the_edge_did_not_receive() {
    let journal = Journal::default();
    journal.set_wait(Duration::from_secs(30));
    let (first, mut first_rx) = link(1);
    let stream = journal.begin("t", streamed(), first, 8);
    for n in 0..5 {
        assert!(stream.credit().await);
        assert!(stream.send(body(n), true, false).await);
    }
    assert_eq!(drain(&mut first_rx).len(), 5);
    // The edge got 3 of them before the link dropped; it credited 2.
    journal.detach(1, "link dropped", false);
    assert!(!stream.cancel.is_cancelled(), "a detached stream goes on");
    // Sent while detached: kept, sent nowhere.
    assert!(stream.credit().await);
    assert!(stream.send(body(5), true, false).await);
    assert!(stream.send(end(), false, true).await);
    assert!(drain(&mut first_rx).is_empty());
    let (second, mut second_rx) = link(2);
    let resumed = journal.resume(&resume("t", true, 3, 2), second).await;
    assert_eq!(resumed, Resumed::Attached { resent: 4 });
    let resent: Vec<_> = drain(&mut second_rx).iter().map(first_byte).collect();
    assert_eq!(resent, vec![Some(3), Some(4), Some(5), None]);
}

#[tokio::test]
async fn credit_lost_with_a_link_is_given_again_on_resume() {
    let journal = Journal::default();
    journal.set_wait(Duration::from_secs(30));
    let (first, _rx) = link(1);
    let stream = journal.begin("t", streamed(), first, 2);
    for n in 0..2 {
        assert!(stream.credit().await);
        stream.send(body(n), true, false).await;
    }
    journal.detach(1, "link dropped", false);
    // The window is used up: a detached stream pauses.
    let waiting = tokio::time::timeout(Duration::from_millis(50), stream.credit()).await;
    assert!(waiting.is_err());
    // The edge had returned 2 frames of credit that the old link lost.
    let (second, _rx2) = link(2);
    journal.resume(&resume("t", true, 2, 2), second).await;
    assert!(
        tokio::time::timeout(Duration::from_secs(5), stream.credit())
            .await
            .unwrap()
    );
}

#[tokio::test]
async fn credited_frames_are_no_longer_kept() {
    let journal = Journal::default();
    let (first, _rx) = link(1);
    let stream = journal.begin("t", streamed(), first, 256);
    for n in 0..100 {
        stream.credit().await;
        stream.send(body(n), true, false).await;
    }
    let all = journal.kept_bytes();
    assert!(all > 100 * 100, "{all}");
    journal.grant("t", 90);
    stream.send(end(), false, true).await;
    assert!(journal.kept_bytes() < all / 5, "{}", journal.kept_bytes());
}

#[tokio::test]
async fn a_stream_the_node_never_saw_is_answered_as_never_run() {
    let journal = Journal::default();
    let (l, mut rx) = link(1);
    assert_eq!(
        journal.resume(&resume("r", false, 0, 0), l).await,
        Resumed::Unknown
    );
    let sent = drain(&mut rx);
    assert_eq!(sent.len(), 1);
    assert!(matches!(sent[0].message, Some(Message::RunEvent(_))));
    assert_eq!(error_code(&sent[0]), Some(ErrorCode::NodeDisconnected));
}

#[tokio::test]
async fn a_flood_past_the_bounds_is_not_resumable_and_memory_stays_bounded() {
    let limits = JournalLimits {
        stream_bytes: 64 * 1024,
        total_bytes: 256 * 1024,
    };
    let journal = Journal::new(limits);
    journal.set_wait(Duration::from_secs(30));
    let (l, _rx) = link(1);
    // Eight streams whose edge never returns credit (an unbounded window here), each
    // sending far more than either bound.
    let mut streams = Vec::new();
    for s in 0..8 {
        let id = format!("t{s}");
        let stream = journal.begin(&id, streamed(), l.clone(), u32::MAX / 2);
        for n in 0..2000u32 {
            stream.send(body(n as u8), true, false).await;
            assert!(journal.kept_bytes() <= limits.total_bytes);
        }
        streams.push(stream);
    }
    journal.detach(1, "link dropped", false);
    let (l2, mut rx2) = link(2);
    assert_eq!(
        journal.resume(&resume("t0", true, 10, 0), l2).await,
        Resumed::NotResumable
    );
    let sent = drain(&mut rx2);
    assert_eq!(sent.len(), 1, "never a partial replay");
    assert_eq!(error_code(&sent[0]), Some(ErrorCode::BrokenStream));
    assert!(streams[0].cancel.is_cancelled(), "it is stopped");
}

#[tokio::test]
async fn a_detached_stream_is_stopped_after_the_wait_and_forgotten_after_its_end() {
    let journal = Journal::default();
    journal.set_wait(Duration::from_secs(10));
    let (l, _rx) = link(1);
    let stream = journal.begin("r", streamed(), l, 0);
    journal.detach(1, "link dropped", false);
    let now = Instant::now();
    journal.sweep(now + Duration::from_secs(5));
    assert!(!stream.cancel.is_cancelled());
    journal.sweep(now + Duration::from_secs(11));
    assert!(stream.cancel.is_cancelled());
    assert!(stream.stopped().unwrap().contains("re-attached"));
    // Its last frame (the run's error) is kept for a resume until the wait passes again.
    stream
        .send(
            StreamFrame::Run(pb::RunEvent {
                run_id: "r".into(),
                kind: pb::RunEventKind::Error as i32,
                ..Default::default()
            }),
            false,
            true,
        )
        .await;
    journal.sweep(Instant::now());
    assert_eq!(journal.len(), 1);
    journal.sweep(Instant::now() + Duration::from_secs(11));
    assert_eq!(journal.len(), 0);
    assert_eq!(journal.kept_bytes(), 0);
}

#[tokio::test]
async fn without_a_wait_a_dropped_link_stops_its_streams() {
    let journal = Journal::default();
    let (l, _rx) = link(1);
    let stream = journal.begin("r", streamed(), l, 0);
    let (other, _rx2) = link(2);
    let elsewhere = journal.begin("s", streamed(), other, 0);
    journal.detach(1, "the node's connection to the edge ended", false);
    assert!(stream.cancel.is_cancelled());
    assert!(
        !elsewhere.cancel.is_cancelled(),
        "another link's stream goes on"
    );
}

#[tokio::test]
async fn an_ended_stream_is_forgotten_once_the_edge_answered_a_later_ping() {
    let journal = Journal::default();
    journal.set_wait(Duration::from_secs(30));
    let (l, _rx) = link(1);
    let marks = l.marks.clone();
    marks.pinged(1);
    marks.answered(1);
    let stream = journal.begin("t", streamed(), l, 0);
    stream.send(end(), false, true).await;
    // Only a pong for a ping queued before the end: the edge may not have it yet.
    journal.sweep(Instant::now());
    assert_eq!(journal.len(), 1);
    marks.pinged(2);
    journal.sweep(Instant::now());
    assert_eq!(journal.len(), 1, "pinged, not answered yet");
    marks.answered(2);
    journal.sweep(Instant::now());
    assert_eq!(journal.len(), 0);
    assert_eq!(journal.kept_bytes(), 0);
}

#[tokio::test]
async fn an_ended_stream_the_edge_confirmed_is_forgotten_at_once() {
    let journal = Journal::default();
    journal.set_wait(Duration::from_secs(30));
    let (l, _rx) = link(1);
    let stream = journal.begin("t", streamed(), l, 0);
    stream.send(body(1), true, false).await;
    journal.forget_ended("t");
    assert_eq!(journal.len(), 1, "not before its last frame");
    stream.send(end(), false, true).await;
    journal.forget_ended("t");
    assert_eq!(journal.len(), 0);
    assert_eq!(journal.kept_bytes(), 0);
}

#[tokio::test]
async fn the_usage_of_a_stream_no_edge_received_the_end_of_is_reported_once() {
    let journal = resumable();
    let (first, mut on_first) = link(1);
    let meta = StreamMeta {
        owner: "alice".into(),
        billing: Some(pb::Billing {
            group: "m".into(),
            api: "openai".into(),
            received_unix_ms: 7,
        }),
        provider: "oa".into(),
        ..streamed()
    };
    let stream = journal.begin("t", meta, first, 8);
    assert!(stream.send(body(0), true, false).await);
    // The edge died: the link dropped before the answer ended.
    journal.detach(1, "gone", false);
    assert!(stream.send(usage(), false, false).await);
    assert!(stream.send(end(), false, true).await);
    drain(&mut on_first);
    let (other, mut on_other) = link(2);
    journal.link_up(other);
    let now = Instant::now();
    // Within the wait, an edge may still take it: nothing is reported.
    journal.sweep(now);
    assert!(drain(&mut on_other).is_empty());
    journal.sweep(now + Duration::from_secs(16));
    let reports = drain(&mut on_other);
    assert_eq!(reports.len(), 1);
    let Some(Message::OrphanUsage(report)) = &reports[0].message else {
        panic!("{reports:?}");
    };
    assert_eq!(report.owner, "alice");
    assert_eq!(report.billing.as_ref().unwrap().group, "m");
    assert_eq!(report.usage.unwrap().output_tokens, 5);
    journal.sweep(now + Duration::from_secs(17));
    assert!(drain(&mut on_other).is_empty(), "reported once");
    // A client's resume later replays it without the usage: it was billed.
    let (third, mut on_third) = link(3);
    journal
        .resume(&client_resume("u", "t", "alice"), third)
        .await;
    let replay = drain(&mut on_third);
    assert_eq!(
        replay.len(),
        2,
        "the body and the end, no usage: {replay:?}"
    );
}
