//! Effect concurrency limits, measured where they matter — at the upstream and on the
//! effect's own consumer: at most `effect.concurrency` calls of one effect in flight per
//! process, the commands beyond it left on the server (not pulled and handed back), so
//! another replica takes them, while other effects keep running beside the full one; and
//! at most `effect.max_inflight_bytes` of commands held at once, so large commands run
//! fewer at a time while small ones still fill every slot.
//!
//! Every upstream call is held until the test releases it, so "the limit is full" is a
//! state the test waits for and then inspects, not a race it hopes to win.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::effects::{EffectBed, command, command_with, one_per_command, own_consumer};
use common::metrics::{metric, metric_or_zero, wait_metric};
use common::upstream::{Latch, Reply};
use serde_json::json;

/// `capped` calls the upstream (held by the test); `free` calls nothing.
fn manifest(base: &str) -> String {
    format!(
        r#"format: 1
effects:
  - name: capped
    provider: http
    settings: {{ url: "{base}/capped" }}
    timeout_ms: 600000
  - name: free
    provider: noop
    settings: {{ result: {{ free: true }} }}
"#
    )
}

/// A bed whose upstream holds every call until `release` is released.
async fn held_bed(release: &Latch) -> EffectBed {
    let hold = release.clone();
    EffectBed::start(
        Arc::new(move |_, key, _| Reply::ok(json!({ "key": key })).until(&hold)),
        manifest,
    )
    .await
}

const LEASE: (&str, &str) = ("RUNNER__EFFECT__LEASE_TTL", "1500ms");
const ACK_WAIT: (&str, &str) = ("RUNNER__EFFECT__ACK_WAIT", "3s");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_effect_limit_caps_calls_in_flight_and_leaves_the_rest_on_the_server() {
    const N: u64 = 8;
    const LIMIT: usize = 3;
    let release = Latch::new();
    let bed = held_bed(&release).await;
    let w = bed.runner(&[LEASE, ACK_WAIT, ("RUNNER__EFFECT__CONCURRENCY", "3")]);
    let cmds: Vec<_> = (0..N).map(|n| command("capped", n)).collect();
    let ids = bed.publish(&cmds).await;

    // The limit fills; the loop pulls no command it has no slot for, so the other five stay
    // on the server, undelivered, however long the limit stays full: here until every held
    // lease was renewed eight times (four seconds, past the three-second ack wait, so a
    // command held back by this process would have been redelivered by now).
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            bed.upstream.in_flight() == LIMIT
        })
        .await
    );
    let renewed = wait_metric(
        &w.admin,
        "runner_effect_claims_total{event=\"renewed\"}",
        |v| v >= 8.0 * LIMIT as f64,
        Duration::from_secs(60),
    )
    .await;
    let info = own_consumer(&bed.js, "capped").await;
    assert_eq!(
        (info.num_ack_pending, info.num_pending, info.num_redelivered),
        (LIMIT, N - LIMIT as u64, 0),
        "only the commands running are delivered; the rest wait on the server"
    );
    assert_eq!(
        bed.upstream.max_in_flight(),
        LIMIT,
        "never more than the limit at once"
    );
    assert_eq!(
        bed.upstream.hits().len(),
        LIMIT,
        "the commands beyond the limit did not reach the upstream"
    );
    assert_eq!(
        metric(&w.admin, "runner_effect_in_flight").await,
        LIMIT as f64
    );
    assert_eq!(
        metric_or_zero(&w.admin, "runner_effect_claims_total{event=\"busy\"}").await,
        0.0,
        "the limit holds before the claim: no claim was contended"
    );

    // The limit is per effect: another effect runs while this one is full.
    let free = bed.publish_one(command("free", 100)).await;
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            bed.results()
                .await
                .iter()
                .any(|r| r.body["command_id"] == json!(free))
        })
        .await,
        "a command of another effect finished while `capped` was full"
    );
    assert_eq!(
        bed.upstream.in_flight(),
        LIMIT,
        "`capped` was still full then"
    );

    release.release();
    let seen = bed.settle(N as usize + 1, Duration::from_secs(120)).await;
    let by = one_per_command(&seen);
    for id in &ids {
        assert_eq!(by[id]["result_type"], "Succeeded", "{}", by[id]);
        assert_eq!(bed.upstream.count(id), 1, "each command called once");
    }
    assert_eq!(by[&free]["payload"]["free"], true);
    assert_eq!(
        bed.upstream.max_in_flight(),
        LIMIT,
        "the limit held after the release too"
    );
    let mut w = w;
    assert!(
        !w.logged("Effect consumer failed"),
        "a pull that got all it asked for ended normally"
    );
    println!("per-effect limit {LIMIT}: held through {renewed} lease renewals; {N} results");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_effect_leaves_its_further_commands_to_other_replicas() {
    let release = Latch::new();
    let bed = held_bed(&release).await;
    let full = bed.runner(&[LEASE, ACK_WAIT, ("RUNNER__EFFECT__CONCURRENCY", "2")]);
    let mut ids = bed
        .publish(&[command("capped", 1), command("capped", 2)])
        .await;
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            bed.upstream.in_flight() == 2
        })
        .await
    );
    assert_eq!(metric(&full.admin, "runner_effect_in_flight").await, 2.0);

    // `capped` has no free slot in `full`, yet another effect still runs there.
    let free = bed.publish_one(command("free", 3)).await;
    wait_metric(
        &full.admin,
        "runner_effect_claims_total{event=\"completed\"}",
        |v| v == 1.0,
        Duration::from_secs(60),
    )
    .await;

    // A further `capped` command is not `full`'s to take: the other replica runs it.
    let other = bed.runner(&[LEASE, ACK_WAIT]);
    ids.push(bed.publish_one(command("capped", 4)).await);
    assert!(
        common::eventually(Duration::from_secs(60), || async {
            bed.upstream.in_flight() == 3
        })
        .await,
        "another replica took the command the full one could not"
    );
    assert_eq!(metric(&other.admin, "runner_effect_in_flight").await, 1.0);
    assert_eq!(
        metric(&full.admin, "runner_effect_in_flight").await,
        2.0,
        "the full replica was still full"
    );
    assert_eq!(bed.upstream.max_in_flight(), 3);

    release.release();
    let seen = bed.settle(4, Duration::from_secs(60)).await;
    let by = one_per_command(&seen);
    for id in &ids {
        assert_eq!(by[id]["result_type"], "Succeeded", "{}", by[id]);
        assert_eq!(bed.upstream.count(id), 1);
    }
    assert_eq!(by[&free]["payload"]["free"], true);
    let completed = "runner_effect_claims_total{event=\"completed\"}";
    assert_eq!(metric(&full.admin, completed).await, 3.0);
    assert_eq!(metric(&other.admin, completed).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_commands_run_as_many_as_the_byte_budget_holds_and_small_ones_fill_the_slots() {
    let release = Latch::new();
    let bed = held_bed(&release).await;
    // 64 slots, but a budget of 1 MiB (the least: the server's max_payload plus room for
    // subjects), which two 400 KiB commands fill.
    let w = bed.runner(&[
        LEASE,
        ACK_WAIT,
        ("RUNNER__EFFECT__CONCURRENCY", "64"),
        ("RUNNER__EFFECT__MAX_INFLIGHT_BYTES", "1MiB"),
    ]);
    const N: u64 = 6;
    let big = "x".repeat(400 * 1024);
    let cmds: Vec<_> = (0..N)
        .map(|n| command_with("capped", json!({ "n": n, "blob": big }), n))
        .collect();
    let ids = bed.publish(&cmds).await;
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            bed.upstream.in_flight() == 2
        })
        .await,
        "two large commands run"
    );
    // Held past the ack wait, so a command pulled and then held back would show as
    // redelivered; the rest must still be on the server, never delivered.
    wait_metric(
        &w.admin,
        "runner_effect_claims_total{event=\"renewed\"}",
        |v| v >= 8.0,
        Duration::from_secs(60),
    )
    .await;
    let info = own_consumer(&bed.js, "capped").await;
    assert_eq!(
        (info.num_ack_pending, info.num_pending, info.num_redelivered),
        (2, N - 2, 0),
        "only what the budget holds is delivered; the rest waits on the server"
    );
    assert_eq!(
        bed.upstream.max_in_flight(),
        2,
        "never more than the budget"
    );
    release.release();
    let seen = bed.settle(N as usize, Duration::from_secs(120)).await;
    let by = one_per_command(&seen);
    for id in &ids {
        assert_eq!(by[id]["result_type"], "Succeeded", "{}", by[id]);
        assert_eq!(bed.upstream.count(id), 1, "each command called once");
    }
    assert_eq!(
        bed.upstream.max_in_flight(),
        2,
        "the budget held to the end"
    );

    // Small commands are not held back by the budget: twenty run at once.
    let again = Latch::new();
    let hold = again.clone();
    bed.upstream.set_script(Arc::new(move |_, key, _| {
        Reply::ok(json!({ "key": key })).until(&hold)
    }));
    let small: Vec<_> = (100..120).map(|n| command("capped", n)).collect();
    let small_ids = bed.publish(&small).await;
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            bed.upstream.in_flight() == 20
        })
        .await,
        "twenty small commands run at once under the same budget"
    );
    again.release();
    let seen = bed.settle(N as usize + 20, Duration::from_secs(120)).await;
    let by = one_per_command(&seen);
    for id in &small_ids {
        assert_eq!(by[id]["result_type"], "Succeeded", "{}", by[id]);
    }
    let mut w = w;
    assert!(
        !w.logged("Effect consumer failed"),
        "a pull ended by its byte limit is not a consumer failure"
    );
    println!("byte budget of 1 MiB: 2 of {N} 400 KiB commands at once; 20 small ones at once");
}
