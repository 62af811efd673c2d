//! Effects do not hold one another back: each declared effect has a durable consumer of its
//! own (`runner-effect-<effect>`), shared by every effect-mode replica, with its own fetch
//! loop and its own `effect.concurrency` slots in each process. What these tests show,
//! black-box, with real `runner` processes, a real nats-server and real HTTP upstreams:
//!
//! - two replicas whose slots for a slow effect are all taken still run every command of a
//!   fast effect, and every command runs exactly once upstream;
//! - a command of an effect no manifest declares gets a `Failed` result saying so (from the
//!   catch-all consumer), and no consumer is made for that name;
//! - a manifest reload that adds an effect starts its consumer, which starts after what the
//!   catch-all already answered instead of replaying it;
//! - the single shared consumer of earlier versions turns into the catch-all in place, and
//!   the new per-effect consumers start where it stood: nothing it acknowledged runs again.
//!
//! The slow upstream holds every call until the test lets go, so "the slow effect is still
//! busy when the fast one is done" is a state the test sets up, not a race on timings.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{self, DeliverPolicy, pull};
use common::effects::{
    COMMAND_STREAM, EFFECT_CONSUMER, EffectBed, command, consumer_info, effect_consumers,
    one_per_command, own_consumer,
};
use common::metrics::metric;
use common::upstream::{Latch, Reply, Upstream};
use futures::StreamExt;
use serde_json::json;

/// `slow` and `fast` call two different HTTP upstreams.
fn two_effects(slow: &str, fast: &str) -> String {
    format!(
        r#"format: 1
effects:
  - name: slow
    provider: http
    settings: {{ url: "{slow}/slow" }}
    timeout_ms: 600000
  - name: fast
    provider: http
    settings: {{ url: "{fast}/fast" }}
"#
    )
}

/// `fast` only, plus `late` when `with_late`.
fn fast_only(base: &str, with_late: bool) -> String {
    let mut m = format!(
        r#"format: 1
effects:
  - name: fast
    provider: http
    settings: {{ url: "{base}/fast" }}
"#
    );
    if with_late {
        m.push_str(&format!(
            r#"  - name: late
    provider: http
    settings: {{ url: "{base}/late" }}
"#
        ));
    }
    m
}

/// An upstream that answers at once.
fn prompt() -> common::upstream::Script {
    Arc::new(|path, key, _| Reply::ok(json!({ "path": path, "key": key })))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upstream_holds_back_only_its_own_effect() {
    const SLOTS: usize = 4;
    const SLOW: u64 = 24;
    const FAST: u64 = 20;
    let release = Latch::new();
    let hold = release.clone();
    let slow = Upstream::start(Arc::new(move |_, key, _| {
        Reply::ok(json!({ "slow": key })).until(&hold)
    }))
    .await;
    let bed = EffectBed::start(prompt(), |fast| two_effects(&slow.base, fast)).await;
    let envs = [("RUNNER__EFFECT__CONCURRENCY", "4")];
    let a = bed.runner(&envs);
    let b = bed.runner(&envs);

    let slow_ids = bed
        .publish(&(0..SLOW).map(|n| command("slow", n)).collect::<Vec<_>>())
        .await;
    // Both replicas fill every slot they have for `slow`; the rest wait on the server.
    assert!(
        common::eventually(Duration::from_secs(60), || async {
            slow.in_flight() == 2 * SLOTS
        })
        .await,
        "both replicas run their share of `slow`: {} in flight",
        slow.in_flight()
    );
    for w in [&a, &b] {
        assert_eq!(
            metric(&w.admin, "runner_effect_in_flight").await,
            SLOTS as f64,
            "each replica pulls from the shared `slow` consumer"
        );
    }

    // Every `fast` command completes while all of `slow` is stuck.
    let fast_ids = bed
        .publish(
            &(0..FAST)
                .map(|n| command("fast", 100 + n))
                .collect::<Vec<_>>(),
        )
        .await;
    assert!(
        common::eventually(Duration::from_secs(60), || async {
            let seen = bed.results().await;
            fast_ids
                .iter()
                .all(|id| seen.iter().any(|r| r.body["command_id"] == json!(id)))
        })
        .await,
        "every fast command got its result while the slow upstream held its calls"
    );
    let seen = bed.results().await;
    assert!(
        seen.iter().all(|r| r.body["effect_name"] == "fast"),
        "no slow command has finished yet"
    );
    assert_eq!(slow.in_flight(), 2 * SLOTS, "`slow` was still full");
    assert_eq!(
        slow.hits().len(),
        2 * SLOTS,
        "no slow command beyond the slots ran"
    );
    let info = own_consumer(&bed.js, "slow").await;
    assert_eq!(
        (info.num_ack_pending, info.num_pending),
        (2 * SLOTS, SLOW - 2 * SLOTS as u64),
        "the slow commands without a slot waited on the server"
    );

    release.release();
    let seen = bed
        .settle((SLOW + FAST) as usize, Duration::from_secs(120))
        .await;
    let by = one_per_command(&seen);
    assert_eq!(by.len(), (SLOW + FAST) as usize);
    for id in &slow_ids {
        assert_eq!(by[id]["result_type"], "Succeeded", "{}", by[id]);
        assert_eq!(slow.count(id), 1, "slow command {id} ran once");
        assert_eq!(bed.upstream.count(id), 0);
    }
    for id in &fast_ids {
        assert_eq!(by[id]["result_type"], "Succeeded", "{}", by[id]);
        assert_eq!(bed.upstream.count(id), 1, "fast command {id} ran once");
        assert_eq!(slow.count(id), 0);
    }
    assert_eq!(slow.hits().len(), SLOW as usize);
    assert_eq!(bed.upstream.hits().len(), FAST as usize);
    assert!(
        slow.max_in_flight() <= 2 * SLOTS,
        "never more than the two replicas' slots"
    );

    // One durable per effect (the same for both replicas), beside the catch-all.
    let consumers = effect_consumers(&bed.js).await.unwrap();
    let names: BTreeSet<String> = consumers.iter().map(|c| c.name.clone()).collect();
    let want: BTreeSet<String> = [
        EFFECT_CONSUMER.to_string(),
        format!("{EFFECT_CONSUMER}-slow"),
        format!("{EFFECT_CONSUMER}-fast"),
    ]
    .into();
    assert_eq!(names, want);
    for c in &consumers {
        let filter = match c.name.strip_prefix(&format!("{EFFECT_CONSUMER}-")) {
            Some(effect) => format!("tenant.*.effect.{effect}.*"),
            None => "tenant.*.effect.>".to_string(),
        };
        assert_eq!(c.config.filter_subject, filter, "{}", c.name);
        assert_eq!(c.config.headers_only, c.name == EFFECT_CONSUMER);
        // By default a dead executor's commands come back 5 s after their claims lapse
        // (effect.lease_ttl 15 s), not after 30 s as before.
        assert_eq!(c.config.ack_wait, Duration::from_secs(20), "{}", c.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_of_an_undeclared_effect_fails_with_the_reason() {
    let bed = EffectBed::start(prompt(), |base| fast_only(base, false)).await;
    let w = bed.runner(&[]);
    let ghost = bed.publish_one(command("ghost", 1)).await;
    let fast = bed.publish_one(command("fast", 2)).await;
    let seen = bed.settle(2, Duration::from_secs(60)).await;
    let by = one_per_command(&seen);
    assert_eq!(by.len(), 2);
    assert_eq!(by[&ghost]["result_type"], "Failed", "{}", by[&ghost]);
    assert_eq!(by[&ghost]["effect_name"], "ghost");
    let reason = by[&ghost]["payload"]["error"].as_str().unwrap();
    assert!(
        reason.contains("`ghost` is not declared"),
        "the result says why: {reason}"
    );
    assert_eq!(by[&fast]["result_type"], "Succeeded");
    assert_eq!(bed.upstream.count(&ghost), 0);
    assert_eq!(bed.upstream.count(&fast), 1);
    assert!(
        consumer_info(&bed.js, &format!("{EFFECT_CONSUMER}-ghost"))
            .await
            .is_none(),
        "no consumer is made for a name no manifest declares"
    );
    assert_eq!(
        metric(
            &w.admin,
            "runner_effect_results_total{effect=\"undeclared\",result_type=\"Failed\"}"
        )
        .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_adds_an_effect_starts_its_consumer_after_what_was_answered() {
    let bed = EffectBed::start(prompt(), |base| fast_only(base, false)).await;
    let w = bed.runner(&[]);
    // Not declared yet: the catch-all answers it.
    let early = bed.publish_one(command("late", 1)).await;
    let seen = bed.settle(1, Duration::from_secs(60)).await;
    assert_eq!(one_per_command(&seen)[&early]["result_type"], "Failed");

    std::fs::write(&bed.manifest, fast_only(&bed.upstream.base, true)).unwrap();
    let r = reqwest::Client::new()
        .post(format!("{}/admin/reload", w.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap());
    let name = format!("{EFFECT_CONSUMER}-late");
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            consumer_info(&bed.js, &name).await.is_some()
        })
        .await,
        "the reload started a consumer for `late`"
    );

    let later = bed.publish_one(command("late", 2)).await;
    let seen = bed.settle(2, Duration::from_secs(60)).await;
    let by = one_per_command(&seen);
    assert_eq!(by.len(), 2);
    assert_eq!(
        by[&early]["result_type"], "Failed",
        "answered once, not again"
    );
    assert_eq!(by[&later]["result_type"], "Succeeded", "{}", by[&later]);
    assert_eq!(bed.upstream.count(&early), 0);
    assert_eq!(bed.upstream.count(&later), 1);
    let info = own_consumer(&bed.js, "late").await;
    assert!(
        matches!(
            info.config.deliver_policy,
            DeliverPolicy::ByStartSequence { start_sequence } if start_sequence > 1
        ),
        "it starts after the catch-all's floor: {:?}",
        info.config.deliver_policy
    );
    assert_eq!(
        info.delivered.consumer_sequence, 1,
        "it delivered the one command published after the reload, not the answered one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_consumer_of_earlier_versions_becomes_the_catch_all() {
    let bed = EffectBed::start(prompt(), |base| fast_only(base, false)).await;
    // What an earlier version left: one shared consumer over every effect command, which
    // has taken and acknowledged the first three. The stream is made as Runner makes it.
    let stream = bed
        .js
        .create_stream(async_nats::jetstream::stream::Config {
            name: COMMAND_STREAM.into(),
            subjects: common::COMMAND_SUBJECTS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .unwrap();
    let old = stream
        .create_consumer(pull::Config {
            durable_name: Some(EFFECT_CONSUMER.into()),
            filter_subject: "tenant.*.effect.>".into(),
            ack_policy: consumer::AckPolicy::Explicit,
            max_deliver: -1,
            ..Default::default()
        })
        .await
        .unwrap();
    let done = bed
        .publish(&(0..3).map(|n| command("fast", n)).collect::<Vec<_>>())
        .await;
    // A pull that waits for them (a no-wait fetch can come back empty on a busy machine).
    let mut taken = old
        .batch()
        .max_messages(3)
        .expires(Duration::from_secs(10))
        .messages()
        .await
        .unwrap();
    let mut acked = 0;
    while acked < 3
        && let Some(m) = taken.next().await
    {
        m.unwrap().double_ack().await.unwrap();
        acked += 1;
    }
    assert_eq!(acked, 3);
    let fresh = bed
        .publish(&(3..5).map(|n| command("fast", n)).collect::<Vec<_>>())
        .await;

    let _w = bed.runner(&[]);
    let seen = bed.settle(2, Duration::from_secs(60)).await;
    let by = one_per_command(&seen);
    assert_eq!(
        by.len(),
        2,
        "only the commands the old consumer had not taken ran"
    );
    for id in &fresh {
        assert_eq!(by[id]["result_type"], "Succeeded");
        assert_eq!(bed.upstream.count(id), 1);
    }
    for id in &done {
        assert_eq!(bed.upstream.count(id), 0, "{id} was not run again");
    }
    let catch_all = consumer_info(&bed.js, EFFECT_CONSUMER).await.unwrap();
    assert!(
        catch_all.config.headers_only,
        "the old consumer is now the catch-all"
    );
    let own = own_consumer(&bed.js, "fast").await;
    assert!(
        matches!(
            own.config.deliver_policy,
            DeliverPolicy::ByStartSequence { start_sequence: 4 }
        ),
        "the new consumer starts right after the old one's floor: {:?}",
        own.config.deliver_policy
    );
}
