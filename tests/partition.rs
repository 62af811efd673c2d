//! `runner::worker::partition::partition` against the real thing: a nats-server stream whose
//! subject transform partitions at ingest with `{{partition(64,1,2,3)}}`.
//!
//! What it must keep: for every key (tenant, saga, correlation id) the partition the server
//! stores the message under is the partition Runner computes, including keys that collide
//! by concatenation and tokens outside ASCII.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;

use async_nats::jetstream::stream::{Config, SubjectTransform};
use common::{NatsServer, jetstream};
use runner::worker::partition::partition;

const P: u32 = 64;

/// A few hundred varied keys: several tenants and sagas, ids of different shapes and
/// lengths, the ("ab", "c") / ("a", "bc") pair, and non-ASCII tokens.
fn keys() -> Vec<(String, String, String)> {
    let tenants = ["acme", "t1", "tenant-with-dashes", "T_9", "x"];
    let sagas = ["order", "payment", "Order", "s"];
    let mut out = Vec::new();
    for (i, t) in tenants.iter().enumerate() {
        for (j, s) in sagas.iter().enumerate() {
            for k in 0..15u64 {
                let n = (i * 100 + j * 10) as u64 + k;
                let id = match k % 5 {
                    0 => format!("{n}"),
                    1 => format!("order-{n}"),
                    2 => format!("{:08x}-{:04x}-4{:03x}-a000-{:012x}", n * 7919, n, n, n * 31),
                    3 => format!("id_{}", "z".repeat(k as usize)),
                    _ => format!("{t}{s}{n}"),
                };
                out.push((t.to_string(), s.to_string(), id));
            }
        }
    }
    for (t, s, id) in [
        ("ab", "c", "1"),
        ("a", "bc", "1"),
        ("über", "bestellung", "nr-1"),
        ("日本", "注文", "一"),
    ] {
        out.push((t.into(), s.into(), id.into()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_and_the_server_agree_on_every_partition() {
    let server = NatsServer::start();
    let js = jetstream(&server.url()).await;
    let stream = js
        .create_stream(Config {
            name: "PARTITION_PROBE".into(),
            subjects: vec!["runner.in.*.*.*".into()],
            subject_transform: Some(SubjectTransform {
                source: "runner.in.*.*.*".into(),
                destination: format!(
                    "runner.inbox.{{{{partition({P},1,2,3)}}}}.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}.{{{{wildcard(3)}}}}"
                ),
            }),
            ..Default::default()
        })
        .await
        .unwrap();

    let keys = keys();
    assert!(keys.len() >= 300, "{} keys", keys.len());
    let mut acks = Vec::new();
    for (t, s, id) in &keys {
        acks.push(
            js.publish(format!("runner.in.{t}.{s}.{id}"), "{}".into())
                .await
                .unwrap(),
        );
    }
    let mut seen = BTreeSet::new();
    for ((t, s, id), ack) in keys.iter().zip(acks) {
        let seq = ack.await.unwrap().sequence;
        let stored = stream.get_raw_message(seq).await.unwrap();
        let subject = stored.subject.to_string();
        let tokens: Vec<&str> = subject.split('.').collect();
        assert_eq!(tokens.len(), 6, "stored subject {subject}");
        assert_eq!(
            &tokens[..2],
            &["runner", "inbox"],
            "stored subject {subject}"
        );
        assert_eq!(&tokens[3..], &[t.as_str(), s.as_str(), id.as_str()]);
        let by_server: u32 = tokens[2].parse().unwrap();
        assert_eq!(
            by_server,
            partition(t, s, id, P),
            "key ({t}, {s}, {id}) stored as {subject}"
        );
        seen.insert(by_server);
    }
    // The keys spread over most partitions, so the agreement above is not a coincidence of
    // a few buckets.
    assert!(seen.len() >= 48, "only {} partitions hit", seen.len());
    assert_eq!(partition("ab", "c", "1", P), partition("a", "bc", "1", P));
}
