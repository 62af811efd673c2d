//! Upgrade in place: a data directory and JetStream store written by the last single-active
//! release (`tests/fixtures/upgrade/fixture.tar.gz`, made by `scripts/upgrade-fixture` with
//! that release's own binary) are taken over at the first start of this one, with nothing
//! lost and nothing applied twice:
//! - every in-flight instance keeps its state and goes on (the ledger saga breaks on any
//!   deposit applied out of order or twice);
//! - the records the old relay never published (three commands and a dead letter's event)
//!   are published once;
//! - the pending timers fire;
//! - the dead letter is still listed;
//! - no input the old release applied is routed into the saga inbox again;
//! - a second start finds nothing left to take over and goes on.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use serde_json::json;

/// The fixture unpacked: the nats-server store directory and the runner data directory.
fn unpack() -> (tempfile::TempDir, tempfile::TempDir) {
    let work = tempfile::tempdir().unwrap();
    let ok = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(repo_root().join("tests/fixtures/upgrade/fixture.tar.gz"))
        .arg("-C")
        .arg(work.path())
        .status()
        .unwrap();
    assert!(ok.success(), "cannot unpack the fixture");
    let (nats, store) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    std::fs::rename(work.path().join("nats"), nats.path().join("jetstream")).unwrap();
    for e in std::fs::read_dir(work.path().join("store")).unwrap() {
        let e = e.unwrap();
        std::fs::rename(e.path(), store.path().join(e.file_name())).unwrap();
    }
    (nats, store)
}

/// `(aggregate id, payload.n)` of every command on WORKFLOW_COMMANDS, counted.
async fn commands(js: &async_nats::jetstream::Context) -> BTreeMap<(String, String), usize> {
    let mut out = BTreeMap::new();
    for m in read_stream(js, "WORKFLOW_COMMANDS", "tenant.>").await {
        let n = &m.body["payload"]["n"];
        let n = n.as_str().map_or_else(|| n.to_string(), str::to_string);
        let key = (
            m.body["aggregate_id"].as_str().unwrap_or("?").to_string(),
            n,
        );
        *out.entry(key).or_insert(0) += 1;
    }
    out
}

async fn deposit(js: &async_nats::jetstream::Context, acct: &str, n: u64) {
    let ev = aggregate_event(
        "bank",
        "Account",
        acct,
        "Deposited",
        1_800_000_000_000 + n,
        json!({ "n": n }),
    );
    publish_json(js, &format!("tenant.bank.aggregate.Account.{acct}"), &ev).await;
}

const ACCOUNTS: [&str; 3] = ["a-1", "a-2", "a-3"];
const MANIFESTS: &str = "tests/fixtures/upgrade/manifests";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_active_store_and_its_streams_are_taken_over_at_the_first_start() {
    let (nats_dir, store) = unpack();
    let nats = NatsServer::start_in(nats_dir);
    let js = jetstream(&nats.url()).await;
    // What the old release left on the broker: twelve inputs, six commands.
    let events = js.get_stream("AGGREGATE_EVENTS").await.unwrap();
    assert_eq!(events.cached_info().state.last_sequence, 12);
    assert_eq!(commands(&js).await.values().sum::<usize>(), 6);
    // The fixture made WORKFLOW_COMMANDS by hand, capped at six messages: lift the cap, and
    // give it the fence subjects and atomic batches of a stream Runner creates.
    let mut config = js
        .get_stream("WORKFLOW_COMMANDS")
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    config.max_messages = -1;
    config
        .subjects
        .push(runner::broker::fence_subjects("WORKFLOW_COMMANDS"));
    config.allow_atomic_publish = true;
    js.update_stream(config).await.unwrap();

    let mut runner = RunnerProc::saga(store, &nats.url(), MANIFESTS, &[]);
    runner.wait_for_log(
        "Took over the position of the single-active release",
        Duration::from_secs(30),
    );
    for a in ACCOUNTS {
        deposit(&js, a, 4).await;
    }
    // 3 accounts × deposits 1..4, and the two timers' releases.
    wait_until("every command published", Duration::from_secs(60), || {
        let js = js.clone();
        async move { commands(&js).await.values().sum::<usize>() >= 14 }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let got = commands(&js).await;
    let mut want = BTreeMap::new();
    for a in ACCOUNTS {
        for n in 1..=4 {
            want.insert((a.to_string(), n.to_string()), 1);
        }
    }
    for h in ["h-1", "h-2"] {
        want.insert((h.to_string(), "null".to_string()), 1);
    }
    assert_eq!(
        got, want,
        "each command once: deposits 1..4 and both releases"
    );
    // The dead letter's event, left in the old outbox, is published.
    wait_for_messages(
        &js,
        "RUNNER_DLQ",
        "tenant.bank.deadletter.>",
        1,
        Duration::from_secs(30),
    )
    .await;
    // Nothing the old release applied is copied into the inbox again: only the new deposits.
    let routed: Vec<u64> = read_stream(&js, "SAGA_INBOX", "runner.inbox.*.AGGREGATE_EVENTS")
        .await
        .into_iter()
        .map(|m| {
            m.msg_id
                .unwrap()
                .split(':')
                .nth(1)
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(routed.len(), 3, "{routed:?}");
    assert!(routed.iter().all(|s| *s > 12), "{routed:?}");

    // A second start finds nothing to take over and goes on where the first stopped.
    let store = runner.stop();
    let mut runner = RunnerProc::saga(store, &nats.url(), MANIFESTS, &[]);
    for a in ACCOUNTS {
        deposit(&js, a, 5).await;
    }
    wait_until(
        "the fifth deposits acknowledged",
        Duration::from_secs(60),
        || {
            let js = js.clone();
            async move { commands(&js).await.values().sum::<usize>() >= 17 }
        },
    )
    .await;
    assert!(
        !runner.logged("Took over the position"),
        "a second start took over again"
    );
    let store = runner.stop();
    let got = commands(&js).await;
    assert_eq!(got.values().sum::<usize>(), 17);
    assert!(got.values().all(|c| *c == 1), "{got:?}");

    // Instances kept and went on; the dead letter is still there.
    let s = open_store(store.path());
    let instances = s.read_blocking(|t| t.instances()).unwrap();
    let states: BTreeMap<String, String> = instances
        .into_iter()
        .map(|i| (i.correlation_id, i.state))
        .collect();
    assert_eq!(
        states,
        BTreeMap::from([
            ("a-1".into(), "open".into()),
            ("a-2".into(), "open".into()),
            ("a-3".into(), "open".into()),
            ("h-1".into(), "released".into()),
            ("h-2".into(), "released".into()),
        ])
    );
    let letters = s.read_blocking(|t| t.dead_letters()).unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].tenant, "bank");
}
