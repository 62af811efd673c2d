//! Fair service across tenants, against the real binary in combined mode, a real
//! nats-server and a real HTTP upstream that holds its answers until released.
//!
//! Tenant A's sagas fill the queued-work bound (`saga.max_queued_work`) with calls that
//! hang, and A has a backlog of new triggers behind them in the aggregate stream. Tenant
//! B's new trigger, published after that backlog, still goes in and calls the upstream
//! while every one of A's held triggers waits: A's backlog holds A, not B. Once the
//! upstream answers, every saga of both tenants finishes exactly once.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::jobs::{called, finished, tenant_row};
use common::metrics::metric;
use common::upstream::{Reply, Upstream};
use common::{NatsServer, RunnerProc, jetstream, jobs};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_new_input_passes_another_tenants_held_backlog() {
    backlog_then_b(Duration::ZERO).await;
}

/// The same after A's calls have hung for a while: what A has queued is still known to be
/// A's (the estimate fades as the queue drains, and this one does not), so B still passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_stuck_behind_a_hung_upstream_still_does_not_hold_another() {
    backlog_then_b(Duration::from_secs(12)).await;
}

/// A fills the bound with calls that hang and has a backlog; `pause` later B publishes one
/// trigger, which goes in while A's backlog waits; then every saga finishes once.
async fn backlog_then_b(pause: Duration) {
    let nats = NatsServer::start();
    let (hold, upstream, manifests) = jobs::held_upstream().await;
    let runner = RunnerProc::combined(
        &nats.url(),
        manifests.path().to_str().unwrap(),
        &[
            ("RUNNER__SAGA__MAX_QUEUED_WORK", "4"),
            ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
            ("RUNNER__PARTITIONS__COUNT", "8"),
        ],
    );
    let js = jetstream(&nats.url()).await;

    // A fills the bound with calls that hang (at least one more than the bound goes in).
    jobs::start(&js, "a", 0, 10).await;
    let filled = common::eventually(Duration::from_secs(30), || async {
        upstream.in_flight() >= 5
    })
    .await;
    assert!(filled, "calls in flight: {}", upstream.in_flight());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let a_started = called(&upstream, "a").len();
    assert!(
        (5..=10).contains(&a_started),
        "{a_started} of A's ten started"
    );

    // A's backlog, then B's one trigger behind it in the stream.
    jobs::start(&js, "a", 10, 40).await;
    tokio::time::sleep(pause).await;
    jobs::start(&js, "b", 0, 1).await;
    let b_called = common::eventually(Duration::from_secs(30), || async {
        called(&upstream, "b").len() == 1
    })
    .await;
    assert!(
        b_called,
        "B's saga never called the upstream past A's backlog"
    );
    // A's held triggers stayed held: none of them went in while A's work is queued.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        called(&upstream, "a").len(),
        a_started,
        "A's backlog went in while A's own work was queued above the bound"
    );
    assert_eq!(
        metric(&runner.admin, "runner_router_copies_total").await,
        (a_started + 1) as f64,
        "inbox copies: A's started triggers and B's"
    );
    // Each tenant's running instances, counted where they are stored: A's started sagas
    // wait for their calls, B's one too; A's backlog has none yet.
    let live = |t: &'static str| {
        let admin = runner.admin.clone();
        async move { tenant_row(&admin, t).await["live_instances"].as_u64() }
    };
    assert_eq!(live("a").await, Some(a_started as u64), "A's running sagas");
    assert_eq!(live("b").await, Some(1), "B's running saga");

    // The upstream answers: every saga of both tenants finishes, each once.
    hold.release();
    let done = common::eventually(Duration::from_secs(60), || async {
        finished(&js, "a").await.len() == 40 && finished(&js, "b").await.len() == 1
    })
    .await;
    assert!(done, "not every saga finished");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut ids: Vec<String> = finished(&js, "a")
        .await
        .into_iter()
        .map(|s| s.subject)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 40, "each of A's sagas finished once");
    assert_eq!(finished(&js, "b").await.len(), 1);
    assert_eq!(called(&upstream, "a").len(), 40, "one call per A saga");
    assert_eq!(called(&upstream, "b").len(), 1);
    assert_eq!(live("a").await, Some(0), "every saga of A finished");
    assert_eq!(live("b").await, Some(0));
    runner.stop();
}

/// A tenant above its rate limit (`tenancy.rate_limits`) is held, not refused: its new
/// triggers wait in order and go in at the limit, every one applied once, while another
/// tenant's go in at once; the passed turns are counted and `runner tenants list` shows
/// the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_rate_limit_is_held_in_order_and_loses_nothing() {
    const JOBS: u64 = 12;
    let nats = NatsServer::start();
    let upstream = Upstream::start(Arc::new(|_, _, _| Reply::ok(json!({})))).await;
    let manifests = jobs::manifests(&upstream);
    let runner = RunnerProc::combined(
        &nats.url(),
        manifests.path().to_str().unwrap(),
        &[
            ("RUNNER__TENANCY__RATE_LIMITS__A", "2"),
            ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
            ("RUNNER__PARTITIONS__COUNT", "8"),
        ],
    );
    let js = jetstream(&nats.url()).await;

    let started = std::time::Instant::now();
    jobs::start(&js, "a", 0, JOBS).await;
    jobs::start(&js, "b", 0, 3).await;
    let b_done = common::eventually(Duration::from_secs(30), || async {
        finished(&js, "b").await.len() == 3
    })
    .await;
    assert!(b_done, "B's sagas did not finish");
    // B went in at once; A, at two a second with two saved up, is still being let in.
    let a_when_b_done = finished(&js, "a").await.len();
    assert!(
        a_when_b_done < JOBS as usize,
        "A's {a_when_b_done} sagas all finished before B's three: the limit held nothing"
    );
    let a_done = common::eventually(Duration::from_secs(60), || async {
        finished(&js, "a").await.len() == JOBS as usize
    })
    .await;
    assert!(a_done, "A's held sagas did not all finish");
    // Ten past the two saved up, at two a second: no sooner than about five seconds.
    assert!(
        started.elapsed() >= Duration::from_secs(4),
        "A's {JOBS} went in faster than its limit allows: {:?}",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        called(&upstream, "a").len(),
        JOBS as usize,
        "each of A's sagas ran once"
    );
    let limited = metric(
        &runner.admin,
        "runner_tenant_rate_limited_total{tenant=\"a\"}",
    )
    .await;
    assert!(limited >= 1.0, "the held turns were not counted: {limited}");
    let let_in = metric(&runner.admin, "runner_tenant_inputs_total{tenant=\"a\"}").await;
    assert_eq!(let_in, JOBS as f64);
    let a = tenant_row(&runner.admin, "a").await;
    assert_eq!(a["rate_limit_per_s"], json!(2.0), "{a}");
    assert_eq!(a["inputs_let_in"], json!(JOBS), "{a}");
    assert_eq!(a["waiting_inputs"], json!(0), "{a}");
    runner.stop();
}
