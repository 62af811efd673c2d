//! Effect commands that cannot run never loop and never stop the others.
//!
//! - 1 100 undecodable commands (more than `effect.max_ack_pending`) while the dead-letter
//!   stream is gone: each is kept in the node's local store and terminated on its first
//!   delivery, one log line each; a genuine command published behind them is executed.
//! - A command that keeps being handed back (here: its claims bucket is gone) is
//!   dead-lettered as `redelivery_limit` on its last delivery (`effect.max_deliver`), and
//!   the upstream is never called.
//!
//! Real binary, real nats-server, real HTTP upstream.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::effects::{EffectBed, command, one_per_command};
use common::metrics::wait_metric;
use common::run_to_exit;
use common::upstream::Reply;
use serde_json::json;

fn manifest(base: &str) -> String {
    format!(
        "format: 1\neffects:\n  - name: charge\n    provider: http\n    settings: {{ url: \"{base}/charge\" }}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undeliverable_dead_letters_are_kept_locally_and_the_rest_flows() {
    let bed = EffectBed::start(
        Arc::new(|_, key, _| Reply::ok(json!({ "charged": key }))),
        manifest,
    )
    .await;
    let mut w = bed.runner(&[("RUNNER__EFFECT__MAX_ACK_PENDING", "256")]);
    bed.js.delete_stream("RUNNER_DLQ").await.unwrap();

    let n = 1_100;
    let mut acks = Vec::new();
    for i in 0..n {
        let subject = format!("tenant._.effect.charge.bad-{i}");
        acks.push(
            bed.js
                .publish(subject, format!("\u{1}not json {i}").into())
                .await
                .unwrap(),
        );
    }
    for a in acks {
        a.await.unwrap();
    }
    let genuine = bed.publish(&[command("charge", 1)]).await;
    let seen = bed.settle(1, Duration::from_secs(60)).await;
    let by = one_per_command(&seen);
    assert_eq!(
        by[&genuine[0]]["result_type"], "Succeeded",
        "{}",
        by[&genuine[0]]
    );
    assert_eq!(bed.upstream.count(&genuine[0]), 1);

    wait_metric(
        &w.admin,
        "runner_effect_deadletters_local_total",
        |v| v >= n as f64,
        Duration::from_secs(60),
    )
    .await;
    let dir = w.data_dir.path().to_str().unwrap().to_owned();
    // `dlq list` prints pages (at most 1000 letters each): walk them with `--after`.
    let (mut out, mut after, mut pages) = (String::new(), None::<String>, 0);
    loop {
        let mut argv = vec!["dlq", "list", "--data-dir", &dir, "--limit", "1000"];
        if let Some(a) = &after {
            argv.extend(["--after", a.as_str()]);
        }
        let (code, page) = run_to_exit(&argv, &[], Duration::from_secs(30));
        assert_eq!(code, Some(0), "{page}");
        pages += 1;
        out += &page;
        after = page
            .lines()
            .find_map(|l| l.strip_prefix("next: "))
            .map(str::to_string);
        if after.is_none() {
            break;
        }
    }
    assert_eq!(pages, 2, "{n} letters in pages of 1000");
    let ids: Vec<u64> = out
        .lines()
        .filter(|l| l.contains("\tundecodable\t"))
        .map(|l| l.split('\t').next().unwrap().parse().unwrap())
        .collect();
    let mut unique = ids.clone();
    unique.dedup();
    assert!(
        ids.len() == n && unique.len() == n && ids.is_sorted(),
        "every one listed once, in order: {} lines",
        ids.len()
    );

    // Nothing loops: every poison command was delivered once and terminated.
    let info = common::effects::own_consumer(&bed.js, "charge").await;
    assert_eq!(info.num_ack_pending, 0, "{info:?}");
    assert_eq!(info.num_redelivered, 0, "{info:?}");
    let count = |w: &mut common::RunnerProc, needle: &str| {
        w.logged(""); // collect the lines written so far
        w.log.iter().filter(|l| l.contains(needle)).count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while count(&mut w, "Effect command refused") < n && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let refused = count(&mut w, "Effect command refused");
    let handed = count(&mut w, "handing it back");
    assert_eq!(refused, n, "one line per refused command");
    assert_eq!(handed, 0);
    assert!(w.exited().is_none());

    // A redrive of such an entry is refused with a clear reason.
    let (code, out) = run_to_exit(
        &[
            "dlq",
            "redrive",
            "--data-dir",
            &dir,
            "--tenant",
            "_",
            "1",
            "--manifest",
            "manifests",
        ],
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("effect command"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_handed_back_too_often_is_dead_lettered_at_its_last_delivery() {
    let bed = EffectBed::start(
        Arc::new(|_, key, _| Reply::ok(json!({ "charged": key }))),
        manifest,
    )
    .await;
    let _w = bed.runner(&[("RUNNER__EFFECT__MAX_DELIVER", "3")]);
    bed.js
        .delete_key_value("RUNNER_EFFECT_CLAIMS")
        .await
        .unwrap();
    let ids = bed.publish(&[command("charge", 7)]).await;
    let dead = common::wait_for_messages(
        &bed.js,
        "RUNNER_DLQ",
        "tenant._.deadletter.redelivery_limit",
        1,
        Duration::from_secs(60),
    )
    .await;
    let body = &dead[0].body;
    assert!(
        body["reason"]
            .as_str()
            .unwrap()
            .contains("delivered 3 times"),
        "{body}"
    );
    assert!(body["body"].as_str().unwrap().contains(&ids[0]), "{body}");
    assert_eq!(bed.upstream.count(&ids[0]), 0, "never executed");
    let info = common::effects::own_consumer(&bed.js, "charge").await;
    assert_eq!(info.num_ack_pending, 0, "{info:?}");
}
