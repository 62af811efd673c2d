//! Work under way goes first (`saga.max_queued_work`), against the real binary in combined
//! mode with a real HTTP upstream: while the effect commands of sagas already started are
//! queued (the upstream holds its answers), new triggers are not routed into the inbox, and
//! of a batch read under a backlog only as many as the bound has room for; once the queue
//! drains, every saga — old and new — completes, and the wait is counted. A replica drained
//! while its router holds leaves the held triggers to the next router, which holds them
//! too, and a node drained while holding leaves them to the next start on its data; nothing
//! is lost or applied twice.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::metrics::metric;
use common::upstream::Upstream;
use common::{NatsServer, RunnerProc, jetstream, jobs, read_stream};

/// Publishes ten triggers under a bound of four and waits until more than the bound of
/// their calls hang (the router lets in what the bound has room for, at least one more);
/// returns how many sagas started.
async fn start_queued(js: &async_nats::jetstream::Context, upstream: &Upstream) -> u64 {
    jobs::start(js, "t", 0, 10).await;
    let queued = common::eventually(Duration::from_secs(30), || async {
        upstream.in_flight() >= 5
    })
    .await;
    assert!(queued, "in flight: {}", upstream.in_flight());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = upstream.in_flight() as u64;
    assert!(
        (5..=10).contains(&started),
        "{started} started under a bound of four"
    );
    started
}

/// The `Finish` commands of the sagas that completed.
async fn finished_jobs(js: &async_nats::jetstream::Context) -> Vec<common::Seen> {
    read_stream(js, "WORKFLOW_COMMANDS", "tenant.t.command.Job.*").await
}

/// While the effect commands of started sagas are queued above the bound, the aggregate
/// stream's router copies no new trigger into the inbox; once the queue drains, every saga
/// completes and the wait is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_triggers_are_not_routed_while_started_work_is_queued() {
    let nats = NatsServer::start();
    let (hold, upstream, manifests) = jobs::held_upstream().await;
    let runner = RunnerProc::combined(
        &nats.url(),
        manifests.path().to_str().unwrap(),
        &[
            ("RUNNER__SAGA__MAX_QUEUED_WORK", "4"),
            ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
            ("RUNNER__PARTITIONS__COUNT", "8"),
            ("RUNNER__PARTITIONS__LEASE_TTL", "3s"),
        ],
    );
    let copies = "runner_router_copies_total";
    let admin = runner.admin.clone();
    let js = jetstream(&nats.url()).await;
    let started = "runner_saga_transitions_total{outcome=\"applied\",saga=\"job\"}";

    // Ten triggers, whose calls the upstream holds. The router copies only what the bound
    // of four has room for (at least one more), looking at the broker through a reading up
    // to 50 ms old: five start on a quiet machine, and on a loaded one (the whole suite at
    // once) up to all ten, published one at a time, can get in before a reading shows the
    // first calls. Either way more than the bound is then queued, which is what the ten
    // triggers after them are held behind.
    jobs::start(&js, "t", 0, 10).await;
    let queued = common::eventually(Duration::from_secs(30), || async {
        upstream.in_flight() >= 5
    })
    .await;
    assert!(queued, "in flight: {}", upstream.in_flight());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let first = metric(&admin, started).await;
    assert!(
        (5.0..=10.0).contains(&first),
        "{first} of ten sagas started under a bound of four"
    );
    let calls = common::eventually(Duration::from_secs(30), || async {
        upstream.in_flight() as f64 == first
    })
    .await;
    assert!(
        calls,
        "{} calls for {first} sagas started",
        upstream.in_flight()
    );

    // Ten more triggers: above the bound, none is copied while the calls hang.
    jobs::start(&js, "t", 10, 20).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        metric(&admin, started).await,
        first,
        "new triggers were taken while started work was queued"
    );
    assert_eq!(
        metric(&admin, copies).await,
        first,
        "inbox copies while held"
    );

    // The queue drains: every saga, old and new, completes; the wait was counted.
    hold.release();
    let done = common::eventually(Duration::from_secs(60), || async {
        finished_jobs(&js).await.len() == 20
    })
    .await;
    assert!(done, "not every saga finished");
    assert_eq!(metric(&admin, started).await, 40.0);
    let waited = metric(&admin, "runner_saga_admission_wait_seconds_count").await;
    assert!(waited >= 1.0, "the wait was not counted: {waited}");
    // The results go straight into their partitions' inboxes: no router copies them.
    assert_eq!(metric(&admin, copies).await, 20.0, "inbox copies in all");
    runner.stop();
}

/// A backlog of new triggers read in one go is admitted only as far as the bound allows:
/// with 300 triggers waiting when the runner starts (one read holds hundreds) and the
/// upstream holding its answers, about the bound's worth of sagas start — not the whole
/// batch read — and the rest wait in the stream until the queue drains; then all finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_read_under_a_backlog_is_admitted_only_as_far_as_the_bound() {
    const BOUND: u64 = 20;
    const JOBS: u64 = 300;
    let nats = NatsServer::start();
    let (hold, upstream, manifests) = jobs::held_upstream().await;
    let bound = BOUND.to_string();
    let envs = [
        ("RUNNER__SAGA__MAX_QUEUED_WORK", bound.as_str()),
        ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
    ];
    let dir = manifests.path().to_str().unwrap();
    // A first start creates the streams and consumers; stopped, it leaves the triggers to
    // pile up unread.
    let data = RunnerProc::combined(&nats.url(), dir, &envs).stop();
    let js = jetstream(&nats.url()).await;
    jobs::start(&js, "t", 0, JOBS).await;
    let runner = RunnerProc::combined_in(data, &nats.url(), dir, &envs);
    let admin = runner.admin.clone();
    let started = "runner_saga_transitions_total{outcome=\"applied\",saga=\"job\"}";
    let calling = common::eventually(Duration::from_secs(30), || async {
        upstream.in_flight() >= BOUND as usize
    })
    .await;
    assert!(calling, "calls in flight: {}", upstream.in_flight());
    // Time for a whole batch to be taken if the bound were looked at once per batch.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let taken = metric(&admin, started).await;
    eprintln!("{taken} of {JOBS} sagas started with the bound at {BOUND}");
    // The bound is read from the broker at most 50 ms old, so what was published meanwhile
    // can be missed once: up to twice the bound, never the batch.
    assert!(
        (BOUND as f64..=2.0 * BOUND as f64).contains(&taken),
        "{taken} sagas started under a bound of {BOUND}"
    );
    let calls = common::eventually(Duration::from_secs(30), || async {
        upstream.in_flight() == taken as usize
    })
    .await;
    assert!(
        calls,
        "{} calls for {taken} sagas started",
        upstream.in_flight()
    );

    hold.release();
    let done = common::eventually(Duration::from_secs(120), || async {
        finished_jobs(&js).await.len() == JOBS as usize
    })
    .await;
    assert!(done, "not every saga finished");
    assert_eq!(pings(&js).await, JOBS as usize, "one command per saga");
    runner.stop();
}

/// Effect commands stored for the `ping` effect (one per saga started).
async fn pings(js: &async_nats::jetstream::Context) -> usize {
    read_stream(js, "WORKFLOW_COMMANDS", "tenant.t.effect.ping.*")
        .await
        .len()
}

/// Asks the node at `admin` to drain (`POST /admin/drain`, answered 202).
async fn drain(admin: &str) {
    let resp = reqwest::Client::new()
        .post(format!("{admin}/admin/drain"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 202);
}

/// Waits until `jobs` sagas have finished, then checks each finished exactly once and
/// called its effect once.
async fn each_finishes_once(js: &async_nats::jetstream::Context, jobs: usize) {
    let done = common::eventually(Duration::from_secs(60), || async {
        finished_jobs(js).await.len() >= jobs
    })
    .await;
    assert!(done, "not every saga finished");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let finished = finished_jobs(js).await;
    let mut ids: Vec<&str> = finished.iter().map(|s| s.subject.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(
        (finished.len(), ids.len()),
        (jobs, jobs),
        "each saga finished once"
    );
    assert_eq!(pings(js).await, jobs, "each saga called its effect once");
}

/// Whether the replica at `admin` routes a share of the aggregate stream now.
async fn routes_aggregates(admin: &str) -> bool {
    let info = common::get_text(&format!("{admin}/info")).await;
    serde_json::from_str::<serde_json::Value>(&info)
        .ok()
        .and_then(|v| v.pointer("/partitions/routing").cloned())
        .and_then(|r| r.as_object().cloned())
        .is_some_and(|r| r.keys().any(|k| k.starts_with("AGGREGATE_EVENTS/")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holding_router_drained_leaves_the_hold_to_its_successor_and_loses_nothing() {
    let nats = NatsServer::start();
    let (hold, upstream, manifests) = jobs::held_upstream().await;
    let m = manifests.path().to_str().unwrap();
    let env = [
        ("RUNNER__SAGA__MAX_QUEUED_WORK", "4"),
        ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
        ("RUNNER__PARTITIONS__COUNT", "8"),
        ("RUNNER__PARTITIONS__LEASE_TTL", "3s"),
    ];
    // Two saga replicas share the partitions; a third process runs the effects, so
    // draining a saga replica does not wait on the held calls.
    let url = nats.url();
    let _effects = RunnerProc::start(
        &["--mode", "effect", "--nats-url", &url, "--manifest", m],
        &env,
    );
    let mut a = RunnerProc::saga(tempfile::tempdir().unwrap(), &url, m, &env);
    let mut b = RunnerProc::saga(tempfile::tempdir().unwrap(), &url, m, &env);
    let js = jetstream(&url).await;

    let first = start_queued(&js, &upstream).await;
    jobs::start(&js, "t", 10, 20).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        pings(&js).await as u64,
        first,
        "new triggers routed while work was queued"
    );

    // Drain the replica that routes (and holds) the aggregate stream.
    let a_routes = routes_aggregates(&a.admin).await;
    assert!(
        a_routes || routes_aggregates(&b.admin).await,
        "one replica routes the aggregate stream"
    );
    let (gone, heir) = if a_routes { (&mut a, &b) } else { (&mut b, &a) };
    drain(&gone.admin).await;
    assert_eq!(gone.wait_exit(Duration::from_secs(60)), Some(0));

    // The other replica takes the router over and holds too.
    let took = common::eventually(Duration::from_secs(30), || routes_aggregates(&heir.admin)).await;
    assert!(
        took,
        "the remaining replica did not take the aggregate router over"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        pings(&js).await as u64,
        first,
        "the successor routed new triggers while work was queued"
    );

    // The queue drains: every saga finishes exactly once.
    hold.release();
    each_finishes_once(&js, 20).await;
    let waited = metric(&heir.admin, "runner_saga_admission_wait_seconds_count").await;
    assert!(
        waited >= 1.0,
        "the successor's wait was not counted: {waited}"
    );
}

/// A saga node drained through its admin endpoint while its router holds new triggers exits
/// without waiting for the queue and without letting the held triggers in, and a node
/// started on its data takes them over: every saga finishes exactly once and calls its
/// effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_drained_while_holding_loses_nothing() {
    let nats = NatsServer::start();
    let (hold, upstream, manifests) = jobs::held_upstream().await;
    let m = manifests.path().to_str().unwrap();
    let env = [
        ("RUNNER__SAGA__MAX_QUEUED_WORK", "4"),
        ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
    ];
    // The effects run in a process of their own, so the drain does not wait on the held
    // calls.
    let url = nats.url();
    let _effects = RunnerProc::start(
        &["--mode", "effect", "--nats-url", &url, "--manifest", m],
        &env,
    );
    let mut saga = RunnerProc::saga(tempfile::tempdir().unwrap(), &url, m, &env);
    let js = jetstream(&url).await;

    jobs::start(&js, "t", 0, 10).await;
    let calling = common::eventually(Duration::from_secs(30), || async {
        upstream.in_flight() >= 4
    })
    .await;
    assert!(calling, "calls in flight: {}", upstream.in_flight());
    jobs::start(&js, "t", 10, 20).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = pings(&js).await;
    // The bound is read from the broker up to 50 ms old, so triggers published one at a
    // time can all get in while the first calls are being made; what matters here is that
    // some are held when the drain comes.
    assert!(
        (4..20).contains(&started),
        "{started} of 20 sagas started under a bound of 4"
    );

    drain(&saga.admin).await;
    assert_eq!(
        saga.wait_exit(Duration::from_secs(30)),
        Some(0),
        "the drained node did not exit cleanly"
    );
    let data = saga.kill();
    let after_drain = pings(&js).await;
    eprintln!("{started} sagas started before the drain, {after_drain} once it ended");
    assert_eq!(after_drain, started, "the drain let held triggers in");
    assert_eq!(
        upstream.in_flight(),
        started,
        "the node left without waiting for the held calls"
    );

    let _heir = RunnerProc::saga(data, &url, m, &env);
    hold.release();
    each_finishes_once(&js, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn triggers_of_a_saga_that_starts_no_effect_are_never_held() {
    // The ledger saga publishes aggregate commands and no effect command: under a bound of
    // four, its deposits must still flow without a hold. (They used to count as queued
    // work until effect commands of theirs showed, which never happens, so the router held
    // every few inputs for the credit's five seconds.)
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "tests/manifests/ledger.yaml",
        &[("RUNNER__SAGA__MAX_QUEUED_WORK", "4")],
    );
    let total = 200u64;
    for n in 1..=total {
        let account = format!("a-{}", n % 20);
        let ev = common::aggregate_event(
            "bank",
            "Account",
            &account,
            "Deposited",
            1_800_000_000_000 + n,
            serde_json::json!({"n": n / 20 + 1, "amount": 1}),
        );
        let subject = format!("tenant.bank.aggregate.Account.{account}");
        common::publish_json(&js, &subject, &ev).await;
    }
    let admin = runner.admin.clone();
    let applied = common::eventually(Duration::from_secs(60), || async {
        metric(&admin, "runner_saga_inputs_total{stream=\"SAGA_INBOX\"}").await >= total as f64
    })
    .await;
    assert!(applied, "every deposit applied");
    let holds = metric(&admin, "runner_saga_admission_wait_seconds_count").await;
    assert_eq!(holds, 0.0, "no trigger was held");
    runner.stop();
}
