//! Pausing and resuming a tenant against the real binary: while tenant `a` is paused its
//! inputs are held whole (one larger than a dead letter's excerpt among them), nothing of
//! it is applied or sent, tenant `b` flows, the pause survives a restart, and the resume
//! applies every held input once, key by key in arrival order, through every partition's
//! inbox (each owner releases its keys in log order); later inputs flow again.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::metrics::{metric, metric_or_zero};
use common::{
    NatsServer, RunnerProc, aggregate_event, get_json, jetstream, publish_json, read_stream,
    run_to_exit,
};
use serde_json::{Value as Json, json};

const MANIFEST: &str = r#"format: 1
sagas:
  - name: door
    version: 1
    triggers: [{ subject: aggregate.Door.*, correlation: event.aggregate_id, start: true }]
    initial_state: closed
    states:
      closed:
        on:
          Opened: { goto: open }
      open:
        on:
          Closed:
            emit:
              - command:
                  aggregate_type: Door
                  command: Lock
                  aggregate_id: ${ event.aggregate_id }
                  payload: { note_len: "${ size(event.payload.note) }" }
            goto: shut
      shut: { terminal: true }
"#;

async fn door(
    js: &async_nats::jetstream::Context,
    tenant: &str,
    id: &str,
    ev: &str,
    n: u64,
    note: &str,
) {
    door_with(js, tenant, id, ev, n, json!({ "note": note })).await;
}

async fn door_with(
    js: &async_nats::jetstream::Context,
    tenant: &str,
    id: &str,
    ev: &str,
    n: u64,
    payload: Json,
) {
    let e = aggregate_event(tenant, "Door", id, ev, 1_800_000_000_000 + n, payload);
    publish_json(js, &format!("tenant.{tenant}.aggregate.Door.{id}"), &e).await;
}

/// `runner tenants <args> --admin <admin>`; its output (stdout and stderr).
fn tenants(admin: &str, args: &[&str]) -> String {
    let mut all = vec!["tenants"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--admin", admin]);
    let (code, out) = run_to_exit(&all, &[], Duration::from_secs(60));
    assert_eq!(code, Some(0), "runner {all:?}: {out}");
    out
}

async fn state_of(admin: &str, tenant: &str, id: &str) -> Option<String> {
    let r = reqwest::get(format!(
        "{admin}/admin/instance?tenant={tenant}&saga=door&id={id}"
    ))
    .await
    .unwrap();
    if r.status().as_u16() == 404 {
        return None;
    }
    let v: Json = r.json().await.unwrap();
    v["instance"]["state"].as_str().map(str::to_string)
}

async fn wait_state(admin: &str, tenant: &str, id: &str, want: &str) {
    let ok = common::eventually(Duration::from_secs(30), || async {
        state_of(admin, tenant, id).await.as_deref() == Some(want)
    })
    .await;
    assert!(
        ok,
        "{tenant}/{id} never reached {want}: {:?}",
        state_of(admin, tenant, id).await
    );
}

async fn locks(js: &async_nats::jetstream::Context, tenant: &str) -> Vec<Json> {
    read_stream(
        js,
        "WORKFLOW_COMMANDS",
        &format!("tenant.{tenant}.command.Door.*"),
    )
    .await
    .into_iter()
    .map(|s| s.body)
    .collect()
}

fn start(url: &str, dir: tempfile::TempDir, manifests: &str) -> RunnerProc {
    let envs = [
        ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
        ("RUNNER__PARTITIONS__COUNT", "4"),
    ];
    RunnerProc::combined_in(dir, url, manifests, &envs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_tenant_is_held_whole_and_released_in_order() {
    let nats = NatsServer::start();
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(manifests.path().join("door.yaml"), MANIFEST).unwrap();
    let m = manifests.path().to_str().unwrap();
    let runner = start(&nats.url(), tempfile::tempdir().unwrap(), m);
    let js = jetstream(&nats.url()).await;

    let out = tenants(&runner.admin, &["pause", "--tenant", "a"]);
    assert!(out.contains("\"paused\": true"), "{out}");
    let long = "x".repeat(6000);
    door(&js, "a", "d1", "Opened", 1, "").await;
    door(&js, "a", "d1", "Closed", 2, &long).await;
    door(&js, "a", "d2", "Opened", 3, "").await;
    door(&js, "b", "d9", "Opened", 4, "").await;
    door(&js, "b", "d9", "Closed", 5, "hi").await;

    // b flows; a is held: no instance, no command, three held letters, none a dead letter.
    wait_state(&runner.admin, "b", "d9", "shut").await;
    let held = common::eventually(Duration::from_secs(30), || async {
        get_json(&format!("{}/admin/dlq?tenant=a", runner.admin)).await["total"] == 3
    })
    .await;
    let letters = get_json(&format!("{}/admin/dlq?tenant=a", runner.admin)).await;
    assert!(held, "{letters}");
    for l in letters["items"].as_array().unwrap() {
        assert_eq!(l["kind"], "tenant_paused", "{l}");
        assert!(l["body_bytes"].is_null(), "held whole: {l}");
    }
    assert_eq!(state_of(&runner.admin, "a", "d1").await, None);
    assert!(locks(&js, "a").await.is_empty());
    common::eventually(Duration::from_secs(30), || async {
        !locks(&js, "b").await.is_empty()
    })
    .await;
    assert_eq!(locks(&js, "b").await.len(), 1);
    assert_eq!(
        metric(
            &runner.admin,
            "runner_saga_transitions_total{outcome=\"held\",saga=\"door\"}"
        )
        .await,
        3.0
    );
    assert_eq!(
        metric_or_zero(
            &runner.admin,
            "runner_deadletters_total{kind=\"tenant_paused\"}"
        )
        .await,
        0.0
    );
    let announced = read_stream(&js, "RUNNER_DLQ", "tenant.a.>").await;
    assert!(
        announced.is_empty(),
        "held inputs announced as dead letters: {announced:?}"
    );
    let listed = tenants(&runner.admin, &["list", "--output", "json"]);
    assert!(listed.contains("\"a\""), "{listed}");

    // The pause outlives the process.
    let dir = runner.stop();
    let runner = start(&nats.url(), dir, m);
    door(&js, "a", "d2", "Closed", 6, "second").await;
    let four = common::eventually(Duration::from_secs(30), || async {
        get_json(&format!("{}/admin/dlq?tenant=a", runner.admin)).await["total"] == 4
    })
    .await;
    assert!(
        four,
        "{}",
        get_json(&format!("{}/admin/dlq?tenant=a", runner.admin)).await
    );

    let out = tenants(&runner.admin, &["resume", "--tenant", "a"]);
    assert!(out.contains("\"partitions\": 4"), "{out}");
    wait_state(&runner.admin, "a", "d1", "shut").await;
    wait_state(&runner.admin, "a", "d2", "shut").await;
    // Later inputs flow at once.
    door(&js, "a", "d3", "Opened", 7, "").await;
    wait_state(&runner.admin, "a", "d3", "open").await;
    // A state is committed before the relay publishes its outputs: wait for them.
    common::eventually(Duration::from_secs(30), || async {
        locks(&js, "a").await.len() >= 2
    })
    .await;
    let sent = locks(&js, "a").await;
    assert_eq!(sent.len(), 2, "each held Closed applied once: {sent:?}");
    let d1 = sent.iter().find(|c| c["aggregate_id"] == "d1").unwrap();
    assert_eq!(
        d1["payload"]["note_len"].to_string().trim_matches('"'),
        "6000",
        "{d1}"
    );
    let pending = get_json(&format!("{}/admin/dlq?tenant=a", runner.admin)).await;
    assert_eq!(pending["total"], 0, "{pending}");
    let listed = tenants(&runner.admin, &["list"]);
    assert!(listed.contains(", 0 paused"), "{listed}");
    // Tenant a's row: what its inputs let in, and no longer paused.
    let row = listed
        .lines()
        .find(|l| l.starts_with("a "))
        .unwrap_or_default();
    assert!(row.trim_end().ends_with("no"), "{listed}");
    // Its running instances in the partitions this node owns: d3 alone (d1 and d2 are
    // shut, a terminal state, since their held inputs were released).
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols.get(1), Some(&"1"), "{listed}");
    runner.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_released_behind_one_that_fails_again_stays_held_whole() {
    let nats = NatsServer::start();
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(manifests.path().join("door.yaml"), MANIFEST).unwrap();
    let m = manifests.path().to_str().unwrap();
    let runner = start(&nats.url(), tempfile::tempdir().unwrap(), m);
    let js = jetstream(&nats.url()).await;
    tenants(&runner.admin, &["pause", "--tenant", "a"]);
    door(&js, "a", "d4", "Opened", 1, "").await;
    // `size()` of a number is an expression error when it is applied.
    door_with(&js, "a", "d4", "Closed", 2, json!({ "note": 5 })).await;
    door(&js, "a", "d4", "Closed", 3, &"y".repeat(6000)).await;
    let held = common::eventually(Duration::from_secs(30), || async {
        get_json(&format!("{}/admin/dlq?tenant=a", runner.admin)).await["total"] == 3
    })
    .await;
    assert!(held);
    let out = tenants(&runner.admin, &["resume", "--tenant", "a"]);
    assert!(out.contains("\"partitions\": 4"), "{out}");
    wait_state(&runner.admin, "a", "d4", "open").await;
    // The failed Closed parks the key; the one behind it is held again, still whole.
    let pending = get_json(&format!("{}/admin/dlq?tenant=a", runner.admin)).await;
    let items = pending["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{pending}");
    let failed = items.iter().find(|l| l["kind"] == "expression").unwrap();
    let behind = items.iter().find(|l| l["kind"] == "tenant_paused").unwrap();
    assert!(behind["body_bytes"].is_null(), "{behind}");
    // A listing shows 4 KiB of a body; the letter itself keeps the input whole.
    assert!(
        behind["body_stored_bytes"].as_u64() > Some(6000),
        "{behind}"
    );
    let whole = get_json(&format!(
        "{}/admin/dlq/a/{}",
        runner.admin,
        behind["id"].as_u64().unwrap()
    ))
    .await;
    assert!(whole["body"].as_str().unwrap().contains(&"y".repeat(6000)));
    assert!(failed["id"].as_u64() < behind["id"].as_u64());
    assert!(locks(&js, "a").await.is_empty());
    runner.stop();
}
