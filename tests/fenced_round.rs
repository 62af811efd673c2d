//! Fenced rounds (`broker::fenced_round`, the transport of the fenced relay and the routers
//! on a stream of one replica) against a real nats-server, on a stream of their own that
//! captures `out.>` (the fenced messages) and `runner.fence.>` (the fence subjects).
//!
//! What they must keep: a round's messages stored in order and its marker after them, so a
//! new owner reads a watermark that covers exactly what was stored; once a newer owner has
//! raised, an older owner's round stores nothing at all — not one message — and is told it
//! is fenced off; a round whose marker was lost is settled from the fence, not guessed;
//! rounds left unmarked are covered by the next marker, and a marker of a former owner is
//! refused.
//! Nothing is timed.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use common::{NatsServer, at, fenced_messages as messages, jetstream, read_stream};
use runner::broker::fence::Fence;
use runner::broker::fenced_batch::{Outcome, Transport};
use runner::broker::fenced_round;

const STREAM: &str = "ROUNDS";
const TIMEOUT: Duration = Duration::from_secs(5);

async fn setup(url: &str) -> (async_nats::Client, jetstream::Context) {
    let client = async_nats::connect(url).await.unwrap();
    let js = jetstream(url).await;
    js.create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec!["out.>".into(), "runner.fence.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    (client, js)
}

#[test]
fn one_replica_gets_rounds_and_a_replicated_stream_atomic_batches() {
    assert_eq!(Transport::for_replicas(1), Transport::Round);
    assert_eq!(Transport::for_replicas(0), Transport::Round);
    assert_eq!(Transport::for_replicas(3), Transport::Batch);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_stores_its_messages_in_order_then_a_marker_that_covers_them() {
    let nats = NatsServer::start();
    let (client, js) = setup(&nats.url()).await;
    let mut fence = Fence::raise(&js, STREAM, "7", 1, "me").await.unwrap();
    for round in 1..=3u64 {
        let out = Transport::Round
            .publish(
                &js,
                &client,
                &mut fence,
                &messages("a", round, 50),
                at(round * 100),
                TIMEOUT,
            )
            .await;
        assert!(matches!(out, Outcome::Stored), "round {round}: {out:?}");
        assert_eq!(fence.through(), Some(at(round * 100)));
    }
    let want: Vec<String> = (1..=3u64)
        .flat_map(|r| (0..50).map(move |i| format!("a:{r}:{i}")))
        .collect();
    let ids: Vec<String> = read_stream(&js, STREAM, "out.>")
        .await
        .iter()
        .map(|s| s.msg_id.clone().unwrap())
        .collect();
    assert_eq!(ids, want, "every message once, in publish order");
    // The last marker is the fence, with its watermark: what a new owner reads.
    let seen = Fence::observe(&js, STREAM, "7").await.unwrap();
    assert_eq!(
        (seen.sequence(), seen.through(), seen.epoch()),
        (fence.sequence(), Some(at(300)), Some(1))
    );
    let marker = read_stream(&js, STREAM, "runner.fence.>").await;
    let last_out = read_stream(&js, STREAM, "out.>").await.last().unwrap().seq;
    assert!(
        marker.last().unwrap().seq > last_out,
        "the marker is stored after the messages it covers"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_owner_s_round_stores_nothing_once_a_newer_one_raised() {
    let nats = NatsServer::start();
    let (client, js) = setup(&nats.url()).await;
    let mut old = Fence::raise(&js, STREAM, "3", 1, "old").await.unwrap();
    let out = Transport::Round
        .publish(
            &js,
            &client,
            &mut old,
            &messages("b", 1, 10),
            at(10),
            TIMEOUT,
        )
        .await;
    assert!(matches!(out, Outcome::Stored), "{out:?}");
    // A newer owner raises and inherits the watermark.
    let new = Fence::raise(&js, STREAM, "3", 2, "new").await.unwrap();
    assert_eq!(new.through(), Some(at(10)));
    // The old owner wakes up and sends a round of 40: the broker takes none of them.
    let out = Transport::Round
        .publish(
            &js,
            &client,
            &mut old,
            &messages("b", 2, 40),
            at(50),
            TIMEOUT,
        )
        .await;
    assert!(matches!(out, Outcome::Fenced), "{out:?}");
    let stored = read_stream(&js, STREAM, "out.>").await;
    assert_eq!(stored.len(), 10, "nothing of the zombie's round is stored");
    let seen = Fence::observe(&js, STREAM, "3").await.unwrap();
    assert_eq!(
        (seen.sequence(), seen.epoch(), seen.through()),
        (new.sequence(), Some(2), Some(at(10)))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_whose_marker_already_landed_is_settled_as_stored() {
    let nats = NatsServer::start();
    let (client, js) = setup(&nats.url()).await;
    let mut fence = Fence::raise(&js, STREAM, "5", 4, "me").await.unwrap();
    // A copy of the fence that misses the marker its twin stored: what a publisher holds
    // when the marker's answer was lost.
    let mut stale = fence.clone();
    let out = Transport::Round
        .publish(
            &js,
            &client,
            &mut fence,
            &messages("c", 1, 5),
            at(5),
            TIMEOUT,
        )
        .await;
    assert!(matches!(out, Outcome::Stored), "{out:?}");
    // Sending the same round again under the stale copy: refused under the fence, then the
    // recheck finds our own marker covering it, and the round is reported stored; the
    // stream drops the re-sent messages as duplicates, and the fence moves to the marker.
    let out = Transport::Round
        .publish(
            &js,
            &client,
            &mut stale,
            &messages("c", 1, 5),
            at(5),
            TIMEOUT,
        )
        .await;
    assert!(matches!(out, Outcome::Stored), "{out:?}");
    assert_eq!(stale.sequence(), fence.sequence());
    assert_eq!(read_stream(&js, STREAM, "out.>").await.len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rounds_left_unmarked_are_covered_by_the_next_marker_and_a_zombie_cannot_mark() {
    let nats = NatsServer::start();
    let (_client, js) = setup(&nats.url()).await;
    let mut fence = Fence::raise(&js, STREAM, "9", 1, "me").await.unwrap();
    let raised_at = fence.sequence();
    let never = Duration::from_secs(3600);
    for round in 1..=3u64 {
        let out = fenced_round::publish(
            &js,
            &mut fence,
            &messages("d", round, 4),
            at(round),
            TIMEOUT,
            never,
        )
        .await;
        assert!(matches!(out, Outcome::Stored), "round {round}: {out:?}");
    }
    // Stored, not marked: the fence did not move, and knows what its next marker covers.
    assert_eq!(fence.sequence(), raised_at);
    assert_eq!(fence.unmarked(), Some(at(3)));
    assert_eq!(read_stream(&js, STREAM, "out.>").await.len(), 12);
    assert_eq!(
        Fence::observe(&js, STREAM, "9").await.unwrap().through(),
        None
    );
    // The marker covers all three rounds.
    assert!(matches!(
        fenced_round::mark(&js, &mut fence).await,
        Outcome::Stored
    ));
    assert_eq!(fence.unmarked(), None);
    assert_eq!(fence.through(), Some(at(3)));
    let seen = Fence::observe(&js, STREAM, "9").await.unwrap();
    assert_eq!(
        (seen.sequence(), seen.through()),
        (fence.sequence(), Some(at(3)))
    );
    // Nothing to mark: no marker is stored.
    let before = fence.sequence();
    assert!(matches!(
        fenced_round::mark(&js, &mut fence).await,
        Outcome::Stored
    ));
    assert_eq!(fence.sequence(), before);
    // One more round, unmarked; a newer owner raises; the old owner's marker is refused and
    // it learns it is fenced off. The newer owner inherits only what was marked.
    let out =
        fenced_round::publish(&js, &mut fence, &messages("d", 4, 2), at(4), TIMEOUT, never).await;
    assert!(matches!(out, Outcome::Stored), "{out:?}");
    let newer = Fence::raise(&js, STREAM, "9", 2, "newer").await.unwrap();
    assert_eq!(newer.through(), Some(at(3)));
    assert!(matches!(
        fenced_round::mark(&js, &mut fence).await,
        Outcome::Fenced
    ));
    assert_eq!(
        Fence::observe(&js, STREAM, "9").await.unwrap().epoch(),
        Some(2)
    );
}
