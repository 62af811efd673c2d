//! `runner::broker::fence` against a real nats-server, on a stream of its own that captures
//! `out.>` (the fenced messages) and `runner.fence.>` (the fence subjects).
//!
//! What it must keep: an owner that raised publishes fenced messages; once a newer owner
//! raises, the older owner's next publish is refused as fenced and nothing of it is stored,
//! while the newer owner publishes; of two raisers that read the same last sequence exactly
//! one raises; a raise under a lower epoch than the stored marker is superseded; a retried
//! publish of a stored msg-id under a fence that still holds is not reported as fenced; on an R3 stream of a
//! three-node cluster the older owner is refused the same way. Nothing is timed.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use common::cluster::Cluster;
use common::{NatsServer, jetstream};
use futures::StreamExt;
use runner::broker::fence::{Fence, FenceError, fence_subject};

const STREAM: &str = "FENCED";

async fn fenced_stream(js: &jetstream::Context, replicas: usize) {
    let config = stream::Config {
        name: STREAM.into(),
        subjects: vec!["out.>".into(), "runner.fence.>".into()],
        num_replicas: replicas,
        ..Default::default()
    };
    // A cluster that just formed may not take a replicated stream at once.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match js.create_stream(config.clone()).await {
            Ok(_) => return,
            Err(e) => {
                assert!(Instant::now() < deadline, "create stream: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

async fn out_count(js: &jetstream::Context) -> u64 {
    let s = js.get_stream(STREAM).await.unwrap();
    let mut subjects = s.info_with_subjects("out.>").await.unwrap();
    let mut n = 0;
    while let Some(entry) = subjects.next().await {
        n += entry.unwrap().1 as u64;
    }
    n
}

fn msg(id: &str) -> (HeaderMap, Bytes) {
    let mut h = HeaderMap::new();
    h.insert(async_nats::header::NATS_MESSAGE_ID, id);
    (h, Bytes::from(id.to_string()))
}

async fn publish(fence: &Fence, js: &jetstream::Context, id: &str) -> Result<u64, FenceError> {
    let (h, p) = msg(id);
    fence.publish(js, "out.p0", h, p).await
}

/// A raises and publishes, B raises, A is refused, B publishes.
async fn newer_owner_fences_off_older(js: &jetstream::Context) {
    let a = Fence::raise(js, STREAM, 0, 1, "a").await.unwrap();
    assert_eq!(a.subject(), "runner.fence.FENCED.0");
    publish(&a, js, "a-1").await.unwrap();
    publish(&a, js, "a-2").await.unwrap();
    assert_eq!(out_count(js).await, 2);

    let b = Fence::raise(js, STREAM, 0, 2, "b").await.unwrap();
    assert!(b.sequence() > a.sequence());

    match publish(&a, js, "a-3").await {
        Err(FenceError::Fenced {
            fence_seq, now_seq, ..
        }) => {
            assert_eq!(fence_seq, a.sequence());
            assert_eq!(now_seq, b.sequence());
        }
        other => panic!("a's publish after b raised: {other:?}"),
    }
    assert_eq!(
        out_count(js).await,
        2,
        "nothing of a's refused publish is stored"
    );

    publish(&b, js, "b-1").await.unwrap();
    assert_eq!(out_count(js).await, 3);
    // A is still refused after B published (the fence, not out.p0, decides).
    assert!(matches!(
        publish(&a, js, "a-4").await,
        Err(FenceError::Fenced { .. })
    ));
    assert_eq!(out_count(js).await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_owner_fences_off_the_older_one() {
    let server = NatsServer::start();
    let js = jetstream(&server.url()).await;
    fenced_stream(&js, 1).await;
    newer_owner_fences_off_older(&js).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_owner_fences_off_the_older_one_on_an_r3_stream() {
    let cluster = Cluster::start(3);
    let js = jetstream(&cluster.url(0)).await;
    fenced_stream(&js, 3).await;
    newer_owner_fences_off_older(&js).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_raisers_from_the_same_sequence_exactly_one_raises() {
    let server = NatsServer::start();
    let js = jetstream(&server.url()).await;
    fenced_stream(&js, 1).await;
    Fence::raise(&js, STREAM, 4, 1, "first").await.unwrap();

    let seen_a = Fence::observe(&js, STREAM, 4).await.unwrap();
    let seen_b = Fence::observe(&js, STREAM, 4).await.unwrap();
    assert_eq!(seen_a.sequence(), seen_b.sequence());
    assert_eq!(seen_a.epoch(), Some(1));
    let (a, b) = tokio::join!(seen_a.raise(&js, 2, "a"), seen_b.raise(&js, 3, "b"));
    let won = match (a, b) {
        (Ok(f), Err(FenceError::Superseded { .. }))
        | (Err(FenceError::Superseded { .. }), Ok(f)) => f,
        other => panic!("expected exactly one raise: {other:?}"),
    };
    // The winner's marker is the fence subject's last message.
    let now = Fence::observe(&js, STREAM, 4).await.unwrap();
    assert_eq!(now.sequence(), won.sequence());
    assert_eq!(now.epoch(), Some(won.epoch()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raise_under_an_older_epoch_is_superseded() {
    let server = NatsServer::start();
    let js = jetstream(&server.url()).await;
    fenced_stream(&js, 1).await;
    let newer = Fence::raise(&js, STREAM, 1, 7, "newer").await.unwrap();
    assert!(matches!(
        Fence::raise(&js, STREAM, 1, 6, "stale").await,
        Err(FenceError::Superseded { epoch: 6, .. })
    ));
    publish_on(&newer, &js, "out.p1", "n-1").await.unwrap();
    // The same epoch raises again (the same holder restarting its publisher).
    let again = Fence::raise(&js, STREAM, 1, 7, "newer").await.unwrap();
    assert!(again.sequence() > newer.sequence());
    // Another partition's fence is independent.
    Fence::raise(&js, STREAM, 2, 1, "other").await.unwrap();
}

async fn publish_on(
    fence: &Fence,
    js: &jetstream::Context,
    subject: &str,
    id: &str,
) -> Result<u64, FenceError> {
    let (h, p) = msg(id);
    fence.publish(js, subject, h, p).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_msg_id_under_a_holding_fence_is_not_fenced() {
    let server = NatsServer::start();
    let js = jetstream(&server.url()).await;
    fenced_stream(&js, 1).await;
    let fence = Fence::raise(&js, STREAM, 0, 1, "a").await.unwrap();
    let first = publish(&fence, &js, "m-1").await.unwrap();
    // The checked subject is the fence, which the first copy did not move, so the server
    // answers the retry as a duplicate (the stored sequence); a 10071 there would come back
    // as `MaybeWritten`. Never `Fenced`.
    match publish(&fence, &js, "m-1").await {
        Ok(seq) => assert_eq!(seq, first),
        Err(FenceError::MaybeWritten { fence_seq, .. }) => assert_eq!(fence_seq, fence.sequence()),
        other => panic!("retry of a stored msg-id: {other:?}"),
    }
    assert_eq!(out_count(&js).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_messages_carry_exactly_the_fence_headers() {
    let server = NatsServer::start();
    let js = jetstream(&server.url()).await;
    fenced_stream(&js, 1).await;
    let fence = Fence::raise(&js, STREAM, 5, 3, "a").await.unwrap();
    let seq = publish_on(&fence, &js, "out.p5", "h-1").await.unwrap();
    let stored = js
        .get_stream(STREAM)
        .await
        .unwrap()
        .get_raw_message(seq)
        .await
        .unwrap();
    let h = &stored.headers;
    let get = |name: &str| h.get(name).map(|v| v.as_str().to_string());
    assert_eq!(
        get("Nats-Expected-Last-Subject-Sequence"),
        Some(fence.sequence().to_string())
    );
    assert_eq!(
        get("Nats-Expected-Last-Subject-Sequence-Subject"),
        Some(fence_subject(STREAM, 5))
    );
    assert_eq!(get("Nats-Msg-Id").as_deref(), Some("h-1"));

    let marker = js
        .get_stream(STREAM)
        .await
        .unwrap()
        .get_raw_message(fence.sequence())
        .await
        .unwrap();
    assert_eq!(marker.subject.as_str(), "runner.fence.FENCED.5");
    let body: serde_json::Value = serde_json::from_slice(&marker.payload).unwrap();
    assert_eq!(body, serde_json::json!({"epoch": 3, "owner": "a"}));
    assert_eq!(
        marker
            .headers
            .get("Nats-Expected-Last-Subject-Sequence")
            .map(|v| v.as_str()),
        Some("0")
    );
}
