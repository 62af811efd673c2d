//! Timers across restarts, cancelled timers, and a NATS outage mid-run.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{
    NatsServer, RunnerProc, aggregate_event, effect_result, jetstream, publish_json, read_stream,
    wait_for_messages,
};
use serde_json::json;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn placed(id: &str, ts: u64) -> (String, serde_json::Value) {
    let ev = aggregate_event(
        "acme",
        "Order",
        id,
        "OrderPlaced",
        ts,
        json!({
            "customer_id": "c", "amount_cents": 500, "items": [{"sku": "s", "qty": 1}],
        }),
    );
    (format!("tenant.acme.aggregate.Order.{id}"), ev)
}

/// The orders below are backdated by almost their 15-minute payment timeout, so their timers
/// fall due within seconds: the runner must accept a producer clock that far behind the
/// broker's (`saga.max_clock_skew` is 5 minutes by default).
const BACKDATED: (&str, &str) = ("RUNNER__SAGA__MAX_CLOCK_SKEW", "1h");

fn start(dir: tempfile::TempDir, url: &str) -> RunnerProc {
    RunnerProc::saga(dir, url, "manifests", &[BACKDATED])
}

/// The order saga's payment timeout: due 15 minutes after the order's own timestamp.
const PAYMENT_TIMEOUT_MS: u64 = 900_000;

/// A runner killed with timers still pending, and the moment those timers fall due.
struct KilledBeforeDue {
    nats: NatsServer,
    dir: tempfile::TempDir,
    due: u64,
}

/// Places two orders whose payment timers fall due `window` from now, pays one (which
/// cancels its timer), and SIGKILLs the runner. A saga's time is its input's timestamp, so the
/// test picks the due moment itself. Returns `None` when the kill came only after the due
/// moment: that attempt proves nothing (the timer could have fired before the kill), and the
/// caller tries again with a longer window. When the kill came first, the runner cannot have
/// fired anything, and the store must hold o-late's timer and not o-paid's.
async fn kill_before_timers_are_due(window: Duration) -> Option<KilledBeforeDue> {
    let nats = NatsServer::start();
    let url = nats.url();
    let runner = start(tempfile::tempdir().unwrap(), &url);
    let js = jetstream(&url).await;
    let due = now_ms() + window.as_millis() as u64;
    let ts = due - PAYMENT_TIMEOUT_MS;
    for id in ["o-late", "o-paid"] {
        let (s, b) = placed(id, ts);
        publish_json(&js, &s, &b).await;
    }
    let charges = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        2,
        Duration::from_secs(30),
    )
    .await;
    let paid = charges
        .iter()
        .find(|c| c.body["payload"]["order_id"] == "o-paid")
        .unwrap();
    let (s, b) = effect_result(
        &paid.body,
        "Succeeded",
        ts + 1_000,
        json!({"payment_id": "p-1"}),
    );
    publish_json(&js, &s, &b).await;
    wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.reserve_stock.*",
        1,
        Duration::from_secs(30),
    )
    .await;
    let dir = runner.kill();
    let killed_at = now_ms();
    if killed_at >= due {
        eprintln!(
            "inconclusive: killed {} ms after the timers fell due ({window:?} window)",
            killed_at - due
        );
        return None;
    }
    // The precondition, checked in the store: the runner died before the due moment with
    // o-late's timer pending; o-paid's was deleted by the payment.
    let (pending, late, paid) = {
        let store = common::open_store(dir.path());
        store
            .read_blocking(|t| {
                Ok((
                    t.timers_pending()?,
                    t.timers_of("acme", "order", "o-late")?,
                    t.timers_of("acme", "order", "o-paid")?,
                ))
            })
            .unwrap()
    };
    assert_eq!(
        pending, 1,
        "o-late's timer pending; o-paid's was cancelled by the payment"
    );
    assert_eq!(late.len(), 1);
    assert_eq!(late[0].due_ms, due);
    assert!(paid.is_empty(), "{paid:?}");
    Some(KilledBeforeDue { nats, dir, due })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timers_survive_a_restart_and_cancelled_ones_never_fire() {
    let mut attempt = None;
    for window in [8, 32, 128].map(Duration::from_secs) {
        attempt = kill_before_timers_are_due(window).await;
        if attempt.is_some() {
            break;
        }
    }
    let KilledBeforeDue { nats, dir, due } =
        attempt.expect("the runner could not be killed before its timers fell due");
    let url = nats.url();
    let js = jetstream(&url).await;

    // Both timers fall due while no runner runs; the restarted one fires what the store holds.
    while now_ms() <= due {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let runner = start(dir, &url);
    let cancels = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.command.Order.*",
        1,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(cancels[0].subject, "tenant.acme.command.Order.o-late");
    assert_eq!(cancels[0].body["payload"]["reason"], "payment_timeout");

    // Both were due at the same moment, so had o-paid's row survived it would have fired in
    // the same pass as o-late's. Once everything written is published, the stream is final.
    let admin = runner.admin.clone();
    common::wait_until("the outbox is empty", Duration::from_secs(30), || async {
        common::saga_progress(&admin, "AGGREGATE_EVENTS").await.1 == 0
    })
    .await;
    assert_eq!(
        common::metrics::metric(&admin, "runner_timers_fired_total").await,
        1.0
    );
    assert_eq!(
        common::metrics::metric(&admin, "runner_timer_fire_lag_seconds_count").await,
        1.0
    );
    assert_eq!(
        common::metrics::metric(&admin, "runner_timers_pending").await,
        0.0
    );
    let commands = read_stream(&js, "WORKFLOW_COMMANDS", "tenant.acme.command.Order.*").await;
    assert_eq!(commands.len(), 1, "{commands:?}");
    let dir = runner.stop();

    // inspect shows the instance with its transitions; the timer fired with its due time as
    // the input's timestamp.
    let (code, out) = common::run_to_exit(
        &[
            "inspect",
            "--tenant",
            "acme",
            "--saga",
            "order",
            "--id",
            "o-late",
            "--data-dir",
            dir.path().to_str().unwrap(),
        ],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    let view: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(view["instance"]["state"], "cancelled");
    assert_eq!(view["instance"]["version"], 1);
    let events: Vec<_> = view["recent_transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["event"].as_str().unwrap())
        .collect();
    assert_eq!(events, ["OrderPlaced", "timer.payment_timeout"]);
    assert_eq!(view["recent_transitions"][1]["at_ms"], json!(due));
    assert_eq!(view["recent_transitions"][1]["source"], "timer");
    assert_eq!(view["timers"], json!([]));
    let paid = {
        let store = common::open_store(dir.path());
        store
            .read_blocking(|t| t.instance("acme", "order", "o-paid"))
            .unwrap()
            .unwrap()
    };
    assert_eq!(paid.state, "reserving_stock");
}

/// Publishes orders `ids` without waiting for each acknowledgement in turn (a burst).
async fn publish_orders(js: &async_nats::jetstream::Context, ids: std::ops::Range<u64>) {
    let mut pending = Vec::new();
    for i in ids {
        let (s, b) = placed(&format!("o-{i}"), 1_800_000_000_000 + i);
        let mut h = async_nats::HeaderMap::new();
        h.insert(
            async_nats::header::NATS_MESSAGE_ID,
            b["event_id"].as_str().unwrap(),
        );
        pending.push(
            js.publish_with_headers(s, h, serde_json::to_vec(&b).unwrap().into())
                .await
                .unwrap(),
        );
    }
    for p in pending {
        p.await.unwrap();
    }
}

/// One input per transaction, so that a backlog takes the runner many commits and a fault
/// can land in the middle of it (the tests check that it did).
const ONE_PER_BATCH: (&str, &str) = ("RUNNER__SAGA__BATCH_SIZE", "1");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_outage_mid_run_loses_and_duplicates_nothing() {
    let mut nats = NatsServer::start();
    let url = nats.url();
    // A first start creates the streams; the first half then waits in the source as a
    // backlog, so the runner (one input per commit) is still working through it when NATS
    // stops, however fast it routes.
    let data = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &url,
        "manifests",
        &[ONE_PER_BATCH],
    )
    .stop();
    let total = 600u64;
    let half = total / 2;
    publish_orders(&jetstream(&url).await, 0..half).await;
    let runner = RunnerProc::saga(data, &url, "manifests", &[ONE_PER_BATCH]);
    let admin = runner.admin.clone();
    // Stop NATS once the runner is working through the first half, and check it was: inputs
    // were applied before the fault (`before` > 0), and some were still unapplied after it
    // (`after` < half), so the fault came with work in flight.
    common::wait_until(
        "the runner applies inputs",
        Duration::from_secs(30),
        || async { common::inputs_applied(&admin).await > 0 },
    )
    .await;
    let before = common::inputs_applied(&admin).await;
    nats.stop();
    let after = common::inputs_applied(&admin).await;
    let depth = common::metrics::metric(&admin, "runner_outbox_depth").await;
    eprintln!("NATS stopped after {before}..={after} of {half} inputs; outbox depth {depth}");
    assert!(
        0 < before && after < half,
        "the outage did not come mid-run: {before}..={after} of {half} applied"
    );
    // The runner sees the outage before NATS comes back.
    common::wait_until(
        "/health reports NATS down",
        Duration::from_secs(30),
        || async { common::get_json(&format!("{admin}/health")).await["nats"]["ok"] == false },
    )
    .await;
    nats.start_again();
    let js = jetstream(&url).await;
    publish_orders(&js, half..total).await;
    let charges = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        total as usize,
        Duration::from_secs(60),
    )
    .await;
    // Every input applied and every output acknowledged: nothing more can appear.
    common::wait_until(
        "all applied and published",
        Duration::from_secs(60),
        || async { common::saga_progress(&admin, "AGGREGATE_EVENTS").await == (total, 0) },
    )
    .await;
    let charges_after = read_stream(&js, "WORKFLOW_COMMANDS", "tenant.>").await;
    assert_eq!(charges.len(), total as usize);
    assert_eq!(charges_after.len(), total as usize, "duplicates appeared");
    let mut ids: Vec<_> = charges_after
        .iter()
        .map(|c| c.body["payload"]["order_id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), total as usize);
    runner.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_mid_run_flushes_the_outbox_and_a_restart_finishes_the_rest() {
    let nats = NatsServer::start();
    let url = nats.url();
    let js = jetstream(&url).await;
    let total = 3000u64;
    // A first start creates the streams; then a backlog is published while no runner runs,
    // so the next start is in the middle of it when the drain comes.
    let dir = start(tempfile::tempdir().unwrap(), &url).stop();
    publish_orders(&js, 0..total).await;
    let runner = RunnerProc::saga(dir, &url, "manifests", &[ONE_PER_BATCH]);
    let admin = runner.admin.clone();
    common::wait_until(
        "the runner applies inputs",
        Duration::from_secs(30),
        || async { common::inputs_applied(&admin).await > 0 },
    )
    .await;
    let dir = runner.stop();
    let (checkpoint, depth) = {
        let store = common::open_store(dir.path());
        // One order, one instance: the instances stored are the inputs applied.
        store
            .read_blocking(|t| Ok((t.instances()?.len() as u64, t.outbox_depth()?)))
            .unwrap()
    };
    let published = read_stream(&js, "WORKFLOW_COMMANDS", "tenant.>")
        .await
        .len() as u64;
    eprintln!(
        "drained at checkpoint {checkpoint} of {total}; depth {depth}; published {published}"
    );
    // The drain came mid-run: it began after the first input and before the last.
    assert!(
        0 < checkpoint && checkpoint < total,
        "the drain did not come mid-run: {checkpoint} of {total} applied"
    );
    assert_eq!(depth, 0, "the drain flushed the outbox");
    // Everything applied before the drain is on the stream already.
    assert_eq!(published, checkpoint);
    // The restart takes up exactly where the drain stopped.
    let runner = start(dir, &url);
    let admin = runner.admin.clone();
    let all = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.>",
        total as usize,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(all.len() as u64, total);
    common::wait_until(
        "all applied and published",
        Duration::from_secs(60),
        || async { common::saga_progress(&admin, "AGGREGATE_EVENTS").await == (total, 0) },
    )
    .await;
    assert_eq!(
        read_stream(&js, "WORKFLOW_COMMANDS", "tenant.>")
            .await
            .len() as u64,
        total,
        "an output was published twice"
    );
    runner.stop();
}
