//! Shared fenced batches (`broker::fenced_batch::publish_together`, `relay::combine`)
//! against a real nats-server, on a stream of their own with atomic batches that captures
//! `out.>` (the fenced messages) and `runner.fence.>` (the fence subjects).
//!
//! What they must keep: several fences' parts stored in one batch, each part behind its own
//! fence headers and followed by its own marker, and each fence movable to the sequence it
//! is told; one stale fence refuses the whole shared batch, nothing of it is stored, and
//! each part sent alone then ends as the single path decides (stored, or fenced off); many
//! relays publishing at once through one combiner are each answered, every message stored
//! once, in order per fence. Nothing is timed.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use common::{NatsServer, at, fenced_messages as messages, jetstream, read_stream};
use runner::broker::fence::Fence;
use runner::broker::fenced_batch::{self, Outcome, Part, PartOutcome};
use runner::relay::combine::Combiner;

const STREAM: &str = "SHARED";
const TIMEOUT: Duration = Duration::from_secs(5);

async fn setup(url: &str) -> (async_nats::Client, jetstream::Context) {
    let client = async_nats::connect(url).await.unwrap();
    let js = jetstream(url).await;
    js.create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec!["out.>".into(), "runner.fence.>".into()],
        allow_atomic_publish: true,
        ..Default::default()
    })
    .await
    .unwrap();
    (client, js)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_fences_share_one_batch_each_behind_its_own_marker() {
    let nats = NatsServer::start();
    let (client, js) = setup(&nats.url()).await;
    let mut a = Fence::raise(&js, STREAM, "a", 1, "me").await.unwrap();
    let mut b = Fence::raise(&js, STREAM, "b", 1, "me").await.unwrap();
    for round in 1..=2u64 {
        let parts = vec![
            Part {
                fence: a.clone(),
                messages: messages("a", round, 2),
                position: at(10 * round),
                expect: true,
            },
            Part {
                fence: b.clone(),
                messages: messages("b", round, 1),
                position: at(20 * round),
                expect: true,
            },
        ];
        let out = fenced_batch::publish_together(&client, parts, TIMEOUT).await;
        let (PartOutcome::Stored(sa), PartOutcome::Stored(sb)) = (&out[0], &out[1]) else {
            panic!("round {round}: {out:?}");
        };
        // One batch: a's two messages, a's marker, b's message, b's marker.
        assert_eq!(*sb, sa + 2, "round {round}");
        a.advance(*sa, Some(at(10 * round)));
        b.advance(*sb, Some(at(20 * round)));
    }
    // The fences were moved to the right markers: each still holds, with its watermark.
    let seen = Fence::observe(&js, STREAM, "a").await.unwrap();
    assert_eq!(
        (seen.sequence(), seen.through()),
        (a.sequence(), Some(at(20)))
    );
    let seen = Fence::observe(&js, STREAM, "b").await.unwrap();
    assert_eq!(
        (seen.sequence(), seen.through()),
        (b.sequence(), Some(at(40)))
    );
    let stored: Vec<String> = read_stream(&js, STREAM, "out.>")
        .await
        .iter()
        .map(|s| s.subject.clone())
        .collect();
    assert_eq!(
        stored,
        ["out.a", "out.a", "out.b", "out.a", "out.a", "out.b"],
        "every message once, in order"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stale_fence_refuses_the_shared_batch_and_each_part_then_goes_alone() {
    let nats = NatsServer::start();
    let (client, js) = setup(&nats.url()).await;
    let mut a = Fence::raise(&js, STREAM, "a", 1, "me").await.unwrap();
    let mut b = Fence::raise(&js, STREAM, "b", 1, "me").await.unwrap();
    // Another owner takes b over.
    Fence::raise(&js, STREAM, "b", 2, "other").await.unwrap();
    let (a_messages, b_messages) = (messages("a", 1, 2), messages("b", 1, 1));
    let parts = vec![
        Part {
            fence: a.clone(),
            messages: a_messages.clone(),
            position: at(10),
            expect: true,
        },
        Part {
            fence: b.clone(),
            messages: b_messages.clone(),
            position: at(20),
            expect: true,
        },
    ];
    let out = fenced_batch::publish_together(&client, parts, TIMEOUT).await;
    assert!(
        out.iter().all(|o| matches!(o, PartOutcome::Alone)),
        "{out:?}"
    );
    assert!(
        read_stream(&js, STREAM, "out.>").await.is_empty(),
        "nothing of it stored"
    );
    // Alone, a is stored and b learns it is fenced off.
    let outcome = fenced_batch::publish(&js, &client, &mut a, &a_messages, at(10), TIMEOUT).await;
    assert!(matches!(outcome, Outcome::Stored), "{outcome:?}");
    let outcome = fenced_batch::publish(&js, &client, &mut b, &b_messages, at(20), TIMEOUT).await;
    assert!(matches!(outcome, Outcome::Fenced), "{outcome:?}");
    let stored = read_stream(&js, STREAM, "out.>").await;
    assert_eq!(stored.len(), 2);
    assert!(stored.iter().all(|s| s.subject == "out.a"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_publishing_at_once_through_one_combiner_are_each_answered() {
    let nats = NatsServer::start();
    let (client, js) = setup(&nats.url()).await;
    let combiner = Arc::new(Combiner::default());
    let (relays, rounds, per) = (16u64, 5u64, 3usize);
    let mut tasks = Vec::new();
    for r in 0..relays {
        let (client, js, combiner) = (client.clone(), js.clone(), combiner.clone());
        tasks.push(tokio::spawn(async move {
            let key = format!("r{r}");
            let mut fence = Fence::raise(&js, STREAM, &key, 1, "me").await.unwrap();
            for round in 1..=rounds {
                // The way the partition relay does it: shared, else alone.
                let msgs = messages(&key, round, per);
                let part = Part {
                    fence: fence.clone(),
                    messages: msgs.clone(),
                    position: at(round),
                    expect: true,
                };
                match combiner.publish(&client, STREAM, part, TIMEOUT).await {
                    PartOutcome::Stored(seq) => fence.advance(seq, Some(at(round))),
                    PartOutcome::Alone => {
                        let o = fenced_batch::publish(
                            &js,
                            &client,
                            &mut fence,
                            &msgs,
                            at(round),
                            TIMEOUT,
                        )
                        .await;
                        assert!(matches!(o, Outcome::Stored), "{key} round {round}: {o:?}");
                    }
                }
            }
            let seen = Fence::observe(&js, STREAM, &key).await.unwrap();
            assert_eq!(
                (seen.sequence(), seen.through()),
                (fence.sequence(), Some(at(rounds))),
                "{key}"
            );
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let stored = read_stream(&js, STREAM, "out.>").await;
    assert_eq!(
        stored.len() as u64,
        relays * rounds * per as u64,
        "each message once"
    );
    for r in 0..relays {
        let key = format!("r{r}");
        let bodies: Vec<String> = stored
            .iter()
            .filter(|s| s.subject == format!("out.{key}"))
            .map(|s| s.msg_id.clone().unwrap())
            .collect();
        let expected: Vec<String> = (1..=rounds)
            .flat_map(|round| (0..per).map(move |i| format!("r{r}:{round}:{i}")))
            .collect();
        assert_eq!(bodies, expected, "{key}: in order, once");
    }
}
