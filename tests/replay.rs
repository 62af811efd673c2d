//! `runner replay`, the real binary against a store and streams a real node wrote: a door
//! saga runs three instances, then a changed manifest (one guard's threshold moved) is
//! replayed against them. Exactly the one instance the change would take elsewhere is
//! reported, at the step and with the states that differ; the unchanged manifests report
//! nothing; manifests that are not the ones that ran are named as such.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{NatsServer, RunnerProc, aggregate_event, get_json, jetstream, publish_json};
use serde_json::json;

/// The door saga; a `Closed` with `force` under `limit` shuts the door, one at or above it
/// jams it. Opening sets an alarm timer either way.
fn door(limit: u32) -> String {
    format!(
        r#"format: 1
sagas:
  - name: door
    version: 1
    triggers: [{{ subject: aggregate.Door.*, correlation: event.aggregate_id, start: true }}]
    initial_state: closed
    states:
      closed:
        on:
          Opened:
            timers: [{{ name: alarm, delay_ms: 600000 }}]
            goto: open
      open:
        on:
          Closed:
            - when: "event.payload.force < {limit}"
              cancel_timers: [alarm]
              emit: [{{ event: {{ event_type: DoorShut, payload: {{ by: "${{ event.payload.force }}" }} }} }}]
              goto: shut
            - cancel_timers: [alarm]
              emit: [{{ event: {{ event_type: DoorJammed, payload: {{}} }} }}]
              goto: jammed
          timer.alarm: {{ goto: open }}
      shut: {{ terminal: true }}
      jammed: {{ terminal: true, outcome: failed }}
"#
    )
}

fn manifests(limit: u32) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("door.yaml"), door(limit)).unwrap();
    dir
}

fn replay(
    data: &std::path::Path,
    current: &std::path::Path,
    new: &std::path::Path,
    url: &str,
    json: bool,
) -> (i32, String) {
    let mut cmd = Command::new(common::runner_bin());
    cmd.arg("replay")
        .arg("--data-dir")
        .arg(data)
        .arg("--current")
        .arg(current)
        .arg("--manifest")
        .arg(new)
        .args(["--nats-url", url]);
    if json {
        cmd.args(["--output", "json"]);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_guard_is_reported_for_exactly_the_instance_it_would_move() {
    let nats = NatsServer::start();
    let url = nats.url();
    let current = manifests(5);
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &url,
        current.path().to_str().unwrap(),
        &[("RUNNER__PARTITIONS__COUNT", "4")],
    );
    let js = jetstream(&url).await;
    let now = runner::clock::now_ms();
    // d1 closes gently (shut), d2 hard (jammed), d3 only opens.
    let events = [
        ("d1", "Opened", json!({})),
        ("d2", "Opened", json!({})),
        ("d3", "Opened", json!({})),
        ("d1", "Closed", json!({ "force": 3 })),
        ("d2", "Closed", json!({ "force": 7 })),
    ];
    for (i, (id, ty, payload)) in events.iter().enumerate() {
        let ev = aggregate_event("acme", "Door", id, ty, now + i as u64, payload.clone());
        publish_json(&js, &format!("tenant.acme.aggregate.Door.{id}"), &ev).await;
    }
    let admin = runner.admin.clone();
    for (id, state) in [("d1", "shut"), ("d2", "jammed"), ("d3", "open")] {
        let url = format!("{admin}/admin/instance?tenant=acme&saga=door&id={id}");
        common::wait_until(&format!("{id} {state}"), Duration::from_secs(60), || {
            let url = url.clone();
            async move { get_json(&url).await["instance"]["state"] == state }
        })
        .await;
    }
    let data = runner.stop();

    // The threshold moves from 5 to 8: d2's close (force 7) would now shut it.
    let changed = manifests(8);
    let (code, out) = replay(data.path(), current.path(), changed.path(), &url, false);
    assert_eq!(code, 1, "{out}");
    let differs: Vec<&str> = out.lines().filter(|l| l.starts_with("differs")).collect();
    assert_eq!(differs.len(), 1, "{out}");
    assert!(
        differs[0].starts_with("differs acme/door/d2 at step 2 (Closed, from AGGREGATE_EVENTS:")
            && differs[0].contains("state: now `jammed`, new `shut`"),
        "{out}"
    );
    assert!(
        out.contains("3 instance(s) replayed: 1 would decide differently; 0 not reproduced by the current manifests; 0 skipped"),
        "{out}"
    );
    let (code, out) = replay(data.path(), current.path(), changed.path(), &url, true);
    assert_eq!(code, 1, "{out}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["replayed"], 3, "{report}");
    assert_eq!(report["diverged"][0]["correlation_id"], "d2", "{report}");
    assert_eq!(report["diverged"][0]["step"], 2, "{report}");

    // The same manifests: nothing would change.
    let (code, out) = replay(data.path(), current.path(), current.path(), &url, false);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("3 instance(s) replayed: 0 would decide differently"),
        "{out}"
    );

    // Manifests that are not the ones that ran, given as current, are named as such.
    let (code, out) = replay(data.path(), changed.path(), changed.path(), &url, false);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("not reproduced acme/door/d2 at step 2 (Closed)")
            && out.contains("recorded `open` → `jammed`"),
        "{out}"
    );
}
