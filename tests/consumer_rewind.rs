//! A consumer that goes back, against the real binary and a real nats-server: async-nats
//! recreates an ordered consumer that lost its way before delivering anything from the
//! stream's start, not from the sequence it was opened at. A source's routers (one per
//! share) whose consumers were opened past their position and then deleted before any new
//! input must notice the rewind, reopen at their position (counted as `reason="rewound"`),
//! copy nothing twice, and go on with new inputs.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use async_nats::jetstream;
use common::{NatsServer, RunnerProc, saga_progress};
use futures::TryStreamExt;

async fn deposit(js: &jetstream::Context, i: u64) {
    let (subject, ev) = common::ledger_deposit(i, 1);
    common::publish_json(js, &subject, &ev).await;
}

/// Rewinds noticed by the routers of the aggregate stream's shares.
async fn rewinds(admin: &str) -> f64 {
    common::get_text(&format!("{admin}/metrics"))
        .await
        .lines()
        .filter(|l| {
            l.starts_with("runner_consumer_recreated_total{consumer=\"router:AGGREGATE_EVENTS/")
                && l.contains("reason=\"rewound\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The sum of the samples of `name` in `admin`'s metrics; 0 when it has none yet.
async fn metric(admin: &str, name: &str) -> f64 {
    common::scaleout::metric(&common::get_text(&format!("{admin}/metrics")).await, name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_rewound_to_the_stream_start_is_reopened_at_the_checkpoint() {
    let nats = NatsServer::start();
    let envs = [("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync")];
    let manifest = "tests/manifests/ledger.yaml";
    let js = common::jetstream(&nats.url()).await;
    let dir = tempfile::tempdir().unwrap();
    let runner = RunnerProc::saga(dir, &nats.url(), manifest, &envs);
    for i in 0..5 {
        deposit(&js, i).await;
    }
    common::wait_until("five deposits applied", Duration::from_secs(30), || {
        let admin = runner.admin.clone();
        async move { saga_progress(&admin, "AGGREGATE_EVENTS").await.0 >= 5 }
    })
    .await;
    // Restarted, the loop opens its consumer at 6 and nothing new comes: delete it under
    // the client, which recreates it having delivered nothing.
    let stream = js.get_stream("AGGREGATE_EVENTS").await.unwrap();
    let first: Vec<String> = stream.consumer_names().try_collect().await.unwrap();
    let dir = runner.stop();
    let runner = RunnerProc::saga(dir, &nats.url(), manifest, &envs);
    // Copies routed into the saga inbox (an input copied again would count here).
    let applied = "runner_router_copies_total";
    let before = metric(&runner.admin, applied).await;
    // The first process's ephemeral consumers may outlive it a while, and the new ones may
    // not be open yet: wait for one consumer per share the first process did not have.
    let shares = runner::worker::ownership::router::share::SHARES as usize;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let names = loop {
        let names: Vec<String> = stream.consumer_names().try_collect().await.unwrap();
        if names.iter().filter(|n| !first.contains(n)).count() >= shares {
            break names;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the restarted runner opened no consumer of its own"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for name in &names {
        let _ = stream.delete_consumer(name).await;
    }
    common::wait_until(
        "every share's rewind noticed",
        Duration::from_secs(60),
        || {
            let admin = runner.admin.clone();
            async move { rewinds(&admin).await >= shares as f64 }
        },
    )
    .await;
    // Nothing was applied again, and new inputs still flow.
    assert_eq!(metric(&runner.admin, applied).await, before);
    deposit(&js, 5).await;
    common::wait_until("the sixth deposit applied", Duration::from_secs(30), || {
        let admin = runner.admin.clone();
        async move { saga_progress(&admin, "AGGREGATE_EVENTS").await.0 >= 6 }
    })
    .await;
    assert_eq!(metric(&runner.admin, applied).await, before + 1.0);
    runner.stop();
}
