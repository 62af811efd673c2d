//! Operator actions on a partitioned node, against the real binary.
//!
//! A dead letter's redrive goes to its partition's owner through the inbox: the key's
//! parked inputs are applied in order once the manifest is fixed, and a second redrive is
//! refused. An operator's replay of a partition from an inbox sequence: without confirmation nothing happens and the answer says what would;
//! confirmed, the owner reads the partition's inbox again — the inputs read again are
//! counted, events already applied are skipped, nothing is sent twice — and the partition
//! goes on with new inputs. Refusals: a replay forward, a partition that does not exist,
//! and the CLI without --confirm.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::metrics::{metric, metric_or_zero};
use common::{
    NatsServer, RunnerProc, aggregate_event, jetstream, publish_json, read_stream, run_to_exit,
};
use serde_json::{Value as Json, json};

const COUNT: u32 = 2;

const MANIFEST: &str = r#"format: 1
sagas:
  - name: door
    version: 1
    triggers: [{ subject: aggregate.Door.*, correlation: event.aggregate_id, start: true }]
    initial_state: closed
    states:
      closed:
        on:
          Opened:
            emit:
              - command: { aggregate_type: Door, command: Log, aggregate_id: "${ event.aggregate_id }", payload: {} }
            goto: open
      open:
        on:
          Closed: { goto: shut }
      shut: { terminal: true }
"#;

/// `runner partitions replay --partition 0 --from 1 [--confirm] --admin <admin>`.
fn replay_from_1(admin: &str, confirm: bool) -> (Option<i32>, String) {
    let mut args = vec!["partitions", "replay", "--partition", "0", "--from", "1"];
    if confirm {
        args.push("--confirm");
    }
    args.extend(["--admin", admin]);
    run_to_exit(&args, &[], Duration::from_secs(30))
}

async fn post(url: &str, body: Json) -> (u16, Json) {
    common::post_json(url, &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmed_replay_reads_the_partition_again_and_applies_nothing_twice() {
    let nats = NatsServer::start();
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(manifests.path().join("door.yaml"), MANIFEST).unwrap();
    let mut runner = RunnerProc::combined(
        &nats.url(),
        manifests.path().to_str().unwrap(),
        &[
            ("RUNNER__PARTITIONS__COUNT", "2"),
            ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
        ],
    );
    let js = jetstream(&nats.url()).await;
    // Doors of partition 0 only, so its inbox holds exactly what the test sent there.
    let doors: Vec<String> = (0..40)
        .map(|i| format!("d{i}"))
        .filter(|d| runner::worker::partition::partition("t", "door", d, COUNT) == 0)
        .take(5)
        .collect();
    for (n, d) in doors.iter().enumerate() {
        let ev = aggregate_event(
            "t",
            "Door",
            d,
            "Opened",
            1_800_000_000_000 + n as u64,
            json!({}),
        );
        publish_json(&js, &format!("tenant.t.aggregate.Door.{d}"), &ev).await;
    }
    let logged = common::eventually(Duration::from_secs(30), || async {
        read_stream(&js, "WORKFLOW_COMMANDS", "tenant.t.command.Door.*")
            .await
            .len()
            == doors.len()
    })
    .await;
    assert!(logged, "the doors never opened");
    let admin = &runner.admin.clone();
    // Counted just after each commit; an output can be seen a moment before (group commit).
    let applied = common::metrics::wait_metric(
        admin,
        "runner_saga_transitions_total{outcome=\"applied\",saga=\"door\"}",
        |v| v >= doors.len() as f64,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(applied, doors.len() as f64);

    let url = format!("{admin}/admin/partitions/0/replay");
    // Not confirmed: nothing done, and the answer says what would be.
    let (status, body) = post(&url, json!({ "from": 1 })).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["would"]
            .as_str()
            .unwrap()
            .contains("without an event id"),
        "{body}"
    );
    let checkpoint = body["checkpoint"].as_u64().unwrap();
    assert!(checkpoint >= doors.len() as u64, "{body}");
    // Forward, or a partition that does not exist: refused.
    let (status, body) = post(&url, json!({ "from": checkpoint + 2, "confirm": true })).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("skip inputs"),
        "{body}"
    );
    let (status, _) = post(
        &format!("{admin}/admin/partitions/9/replay"),
        json!({ "from": 1, "confirm": true }),
    )
    .await;
    assert_eq!(status, 400);
    // The CLI without --confirm does nothing and says so.
    let (code, out) = replay_from_1(admin, false);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("--confirm"), "{out}");
    assert_eq!(
        metric_or_zero(admin, "runner_partition_replayed_inputs_total").await,
        0.0
    );

    // Confirmed through the CLI: the whole inbox of partition 0 is read again.
    let (code, out) = replay_from_1(admin, true);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("\"checkpoint_before\""), "{out}");
    let replayed = common::eventually(Duration::from_secs(30), || async {
        metric_or_zero(admin, "runner_partition_replayed_inputs_total").await == doors.len() as f64
    })
    .await;
    let saw = runner.logged("Replaying the partition");
    assert!(
        replayed && saw,
        "the replay never read the inbox again; log:\n{}",
        runner.log.join("\n")
    );
    // Events already applied were recognised: no transition, no second command.
    let duplicates = common::metrics::wait_metric(
        admin,
        "runner_saga_transitions_total{outcome=\"duplicate\",saga=\"door\"}",
        |v| v >= doors.len() as f64,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(duplicates, doors.len() as f64);
    assert_eq!(
        metric(
            admin,
            "runner_saga_transitions_total{outcome=\"applied\",saga=\"door\"}"
        )
        .await,
        applied
    );
    // The partition goes on with new inputs.
    let ev = aggregate_event(
        "t",
        "Door",
        &doors[0],
        "Closed",
        1_800_000_001_000,
        json!({}),
    );
    publish_json(&js, &format!("tenant.t.aggregate.Door.{}", doors[0]), &ev).await;
    let shut = common::eventually(Duration::from_secs(30), || async {
        metric(
            admin,
            "runner_saga_transitions_total{outcome=\"applied\",saga=\"door\"}",
        )
        .await
            == applied + 1.0
    })
    .await;
    assert!(shut, "a new input after the replay was not applied");
    let sent = read_stream(&js, "WORKFLOW_COMMANDS", "tenant.t.command.Door.*").await;
    assert_eq!(
        sent.len(),
        doors.len(),
        "a command was sent twice: {sent:?}"
    );
    runner.stop();
}

/// `bad` makes `${ event.payload.n + 1 }` a type error for a string `n`.
fn counter(fixed: bool) -> String {
    let n = if fixed {
        "${ string(event.payload.n) }"
    } else {
        "${ event.payload.n + 1 }"
    };
    format!(
        "format: 1\nsagas:\n  - name: visit\n    version: 1\n    triggers: [{{ subject: aggregate.Door.*, correlation: event.aggregate_id, start: true }}]\n    data: {{ n: \"{n}\" }}\n    initial_state: closed\n    states:\n      closed:\n        on:\n          Opened: {{ goto: open }}\n      open:\n        on:\n          Closed: {{ goto: shut }}\n      shut: {{ terminal: true }}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_is_redriven_by_its_partition_owner_once() {
    let nats = NatsServer::start();
    let manifests = tempfile::tempdir().unwrap();
    let file = manifests.path().join("visit.yaml");
    std::fs::write(&file, counter(false)).unwrap();
    let runner = RunnerProc::combined(
        &nats.url(),
        manifests.path().to_str().unwrap(),
        &[
            ("RUNNER__PARTITIONS__COUNT", "4"),
            ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
        ],
    );
    let admin = runner.admin.clone();
    let js = jetstream(&nats.url()).await;
    let opened = aggregate_event(
        "t",
        "Door",
        "door-2",
        "Opened",
        1_800_000_000_000,
        json!({ "n": "x" }),
    );
    publish_json(&js, "tenant.t.aggregate.Door.door-2", &opened).await;
    let closed = aggregate_event(
        "t",
        "Door",
        "door-2",
        "Closed",
        1_800_000_000_001,
        json!({ "n": "x" }),
    );
    publish_json(&js, "tenant.t.aggregate.Door.door-2", &closed).await;
    let two = common::eventually(Duration::from_secs(30), || async {
        common::get_json(&format!("{admin}/admin/dlq?tenant=t")).await["total"] == 2
    })
    .await;
    let letters = common::get_json(&format!("{admin}/admin/dlq?tenant=t")).await;
    assert!(two, "{letters}");
    let id_of = |kind: &str| {
        letters["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["kind"] == kind)
            .unwrap()["id"]
            .as_u64()
            .unwrap()
    };
    let (first, behind) = (id_of("expression"), id_of("parked"));
    // The one behind is not redriven on its own.
    let (status, body) = post(&format!("{admin}/admin/dlq/t/{behind}/redrive"), json!({})).await;
    assert_eq!(status, 409, "{body}");

    std::fs::write(&file, counter(true)).unwrap();
    let (status, _) = post(&format!("{admin}/admin/reload"), json!({})).await;
    assert_eq!(status, 200);
    let (status, body) = post(&format!("{admin}/admin/dlq/t/{first}/redrive"), json!({})).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(
        body["partition"].as_u64().unwrap(),
        u64::from(runner::worker::partition::partition(
            "t", "visit", "door-2", 4
        ))
    );
    let shut = common::eventually(Duration::from_secs(30), || async {
        let v = common::get_json(&format!(
            "{admin}/admin/instance?tenant=t&saga=visit&id=door-2"
        ))
        .await;
        v["instance"]["state"] == "shut"
    })
    .await;
    let view = common::get_json(&format!(
        "{admin}/admin/instance?tenant=t&saga=visit&id=door-2"
    ))
    .await;
    assert!(shut, "the redriven key did not finish: {view}");
    assert_eq!(view["instance"]["data"]["n"], "x");
    let pending = common::get_json(&format!("{admin}/admin/dlq?tenant=t")).await;
    assert_eq!(pending["total"], 0, "{pending}");
    // Once: the letter is redriven now, so a second request is refused.
    let (status, body) = post(&format!("{admin}/admin/dlq/t/{first}/redrive"), json!({})).await;
    assert_eq!(status, 409, "{body}");
    runner.stop();
}
