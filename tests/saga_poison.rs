//! Poison input: every kind lands in the dead-letter store and stream with its reason while
//! the rest flows; a parked key holds its later inputs; a redrive processes an entry once.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{
    NatsServer, RunnerProc, aggregate_event, jetstream, publish_json, read_stream, run_to_exit,
    wait_for_messages,
};
use serde_json::json;

const TS: u64 = 1_800_000_000_000;

fn order(tenant: &str, id: &str, payload: serde_json::Value) -> (String, serde_json::Value) {
    (
        format!("tenant.{tenant}.aggregate.Order.{id}"),
        aggregate_event(tenant, "Order", id, "OrderPlaced", TS, payload),
    )
}

fn good(tenant: &str, id: &str) -> (String, serde_json::Value) {
    order(
        tenant,
        id,
        json!({"customer_id": "c", "amount_cents": 100, "items": [{"sku": "a", "qty": 1}]}),
    )
}

/// `runner dlq list` lines as (id, tenant, kind, saga/correlation).
fn dlq_list(data_dir: &str, extra_env: &[(&str, &str)]) -> Vec<(u64, String, String, String)> {
    let (code, out) = run_to_exit(
        &["dlq", "list", "--data-dir", data_dir],
        extra_env,
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    out.lines()
        .filter(|l| l.contains('\t'))
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            (
                f[0].parse().unwrap(),
                f[1].to_string(),
                f[2].to_string(),
                f[5].to_string(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_is_dead_lettered_parked_and_redriven_once() {
    let nats = NatsServer::start();
    let env = [
        ("RUNNER__TENANCY__ALLOWED", "acme,globex"),
        ("RUNNER__SAGA__MAX_MESSAGE_BYTES", "2KiB"),
    ];
    let runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &env);
    let data_dir = runner.data_dir.path().to_str().unwrap().to_string();
    let js = jetstream(&nats.url()).await;

    let (s, b) = good("acme", "o-1");
    publish_json(&js, &s, &b).await;
    js.publish("tenant.acme.aggregate.Order.o-x", "{not json".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let (s, mut b) = good("acme", "o-m");
    b["tenant_id"] = json!("globex");
    publish_json(&js, &s, &b).await;
    let (s, b) = good("evil", "o-2");
    publish_json(&js, &s, &b).await;
    let (s, b) = order(
        "acme",
        "o-3",
        json!({"customer_id": "c", "amount_cents": 1, "items": [], "blob": "x".repeat(4096)}),
    );
    publish_json(&js, &s, &b).await;
    // No `items`: the guard's size() fails — an expression error; the key gets parked.
    let (s, b) = order(
        "acme",
        "o-bad",
        json!({"customer_id": "c", "amount_cents": 100}),
    );
    publish_json(&js, &s, &b).await;
    // A later input of the parked key is held, not applied.
    let (s, b) = good("acme", "o-bad");
    publish_json(&js, &s, &b).await;
    // An aggregate id far longer than any storage key may be: poison, not a stuck batch.
    let long_id = "x".repeat(1200);
    let (s, b) = good("acme", &long_id);
    publish_json(&js, &s, &b).await;
    let (s, b) = good("globex", "o-4");
    publish_json(&js, &s, &b).await;

    // Everything else flowed.
    let charges = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.*.effect.charge_card.*",
        2,
        Duration::from_secs(30),
    )
    .await;
    let ids: Vec<_> = charges
        .iter()
        .map(|c| c.body["payload"]["order_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, ["o-1", "o-4"]);

    // Each poison kind is in the dead-letter stream with its reason…
    let dlq = wait_for_messages(&js, "RUNNER_DLQ", ">", 7, Duration::from_secs(30)).await;
    let kinds: Vec<_> = dlq
        .iter()
        .map(|m| m.body["kind"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        kinds,
        [
            "undecodable",
            "tenant_mismatch",
            "unknown_tenant",
            "too_large",
            "expression",
            "parked",
            "too_large"
        ]
    );
    assert!(
        dlq[6].body["reason"]
            .as_str()
            .unwrap()
            .contains("1200 bytes"),
        "{}",
        dlq[6].body
    );
    for m in &dlq {
        assert!(!m.body["reason"].as_str().unwrap().is_empty());
        assert!(m.subject.ends_with(m.body["kind"].as_str().unwrap()));
    }
    assert!(dlq[1].body["reason"].as_str().unwrap().contains("globex"));
    assert_eq!(dlq[2].subject, "tenant.evil.deadletter.unknown_tenant");
    // …and in the store, listed while the node runs.
    let listed = dlq_list(&data_dir, &[]);
    assert_eq!(listed.len(), 7);
    let expression = listed.iter().find(|l| l.2 == "expression").unwrap().clone();
    assert_eq!(expression.3, "order/o-bad");
    let held = listed.iter().find(|l| l.2 == "parked").unwrap().clone();

    // The held entry cannot jump the queue.
    let (code, out) = run_to_exit(
        &[
            "dlq",
            "redrive",
            "--tenant",
            "acme",
            &held.0.to_string(),
            "--data-dir",
            &data_dir,
            "--manifest",
            "manifests",
        ],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(1));
    assert!(out.contains("held behind"), "{out}");

    // The operator fixes the manifest (missing items now mean rejection) and redrives.
    let fixed = tempfile::tempdir().unwrap();
    for f in ["order.yaml", "travel.yaml"] {
        let text = std::fs::read_to_string(common::repo_root().join("manifests").join(f)).unwrap();
        let text = text
            .replace(
                "&& type(event.payload.items) == list",
                "&& has(event.payload.items) && type(event.payload.items) == list",
            )
            .replace(
                "items: ${ event.payload.items }",
                "items: \"${ has(event.payload.items) ? event.payload.items : [] }\"",
            );
        std::fs::write(fixed.path().join(f), text).unwrap();
    }
    let fixed_dir = fixed.path().to_str().unwrap();
    let redrive = [
        "dlq",
        "redrive",
        "--tenant",
        "acme",
        &expression.0.to_string(),
        "--data-dir",
        &data_dir,
        "--manifest",
        fixed_dir,
    ];
    let (code, out) = run_to_exit(&redrive, &[], Duration::from_secs(20));
    assert_eq!(code, Some(0), "{out}");
    let report: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
    assert_eq!(report["processed"], json!([expression.0, held.0]));
    assert_eq!(
        report["applied"], 1,
        "the held OrderPlaced meets a finished instance and is ignored"
    );
    let rejects = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.command.Order.o-bad",
        1,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        rejects[0].body["payload"]["reason"],
        "empty, free or malformed order"
    );

    // A second redrive is refused: processed once.
    let (code, out) = run_to_exit(&redrive, &[], Duration::from_secs(20));
    assert_eq!(code, Some(1));
    assert!(out.contains("already redriven"), "{out}");

    // The unknown tenant is admitted by the operator and redriven.
    let unknown = listed
        .iter()
        .find(|l| l.2 == "unknown_tenant")
        .unwrap()
        .0
        .to_string();
    let (code, out) = run_to_exit(
        &[
            "dlq",
            "redrive",
            "--tenant",
            "evil",
            &unknown,
            "--data-dir",
            &data_dir,
            "--manifest",
            "manifests",
        ],
        &[("RUNNER__TENANCY__ALLOWED", "acme,globex,evil")],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.evil.effect.charge_card.*",
        1,
        Duration::from_secs(30),
    )
    .await;

    // Once the outbox is empty every output is on the stream: nothing more can appear.
    common::wait_until("the outbox is empty", Duration::from_secs(30), || async {
        common::saga_progress(&runner.admin, "AGGREGATE_EVENTS")
            .await
            .1
            == 0
    })
    .await;
    let all = read_stream(&js, "WORKFLOW_COMMANDS", ">").await;
    assert_eq!(
        all.len(),
        4,
        "o-1, o-4, o-bad rejection, evil/o-2: once each"
    );
    assert!(
        dlq_list(&data_dir, &[])
            .iter()
            .all(|l| l.2 != "expression" && l.2 != "parked")
    );
}

/// A deposit of the ledger saga; `n: None` leaves out the field its guard reads.
fn deposit(account: &str, n: Option<u64>, amount: u64) -> (String, serde_json::Value) {
    let payload = match n {
        Some(n) => json!({"n": n, "amount": amount}),
        None => json!({"amount": amount}),
    };
    (
        format!("tenant.bank.aggregate.Account.{account}"),
        aggregate_event("bank", "Account", account, "Deposited", TS, payload),
    )
}

/// The `n` of each ledger acknowledgement for `account` on the command stream, in order.
async fn acknowledged(js: &async_nats::jetstream::Context, account: &str) -> Vec<u64> {
    read_stream(
        js,
        "WORKFLOW_COMMANDS",
        &format!("tenant.bank.command.Account.{account}"),
    )
    .await
    .iter()
    .map(|s| s.body["payload"]["n"].as_u64().unwrap())
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inputs_held_behind_a_poisoned_key_apply_in_their_original_order_on_redrive() {
    let nats = NatsServer::start();
    let ledger = "tests/manifests/ledger.yaml";
    let runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), ledger, &[]);
    let admin = runner.admin.clone();
    let data_dir = runner.data_dir.path().to_str().unwrap().to_string();
    let js = jetstream(&nats.url()).await;

    // a-1: deposit 1 applies; a deposit without `n` fails the guard and parks the key;
    // deposits 2, 3, 4 are held behind it. a-2 goes on meanwhile. The ledger breaks on any
    // deposit out of order, so its final state shows the order they were applied in.
    let inputs = [
        deposit("a-1", Some(1), 10),
        deposit("a-1", None, 1000),
        deposit("a-2", Some(1), 1),
        deposit("a-1", Some(2), 20),
        deposit("a-1", Some(3), 30),
        deposit("a-2", Some(2), 2),
        deposit("a-1", Some(4), 40),
    ];
    for (s, b) in &inputs {
        publish_json(&js, s, b).await;
    }
    common::wait_until(
        "all inputs applied and published",
        Duration::from_secs(30),
        || async {
            common::saga_progress(&admin, "AGGREGATE_EVENTS").await == (inputs.len() as u64, 0)
        },
    )
    .await;
    assert_eq!(acknowledged(&js, "a-1").await, [1]);
    assert_eq!(acknowledged(&js, "a-2").await, [1, 2]);
    let listed = dlq_list(&data_dir, &[]);
    let kinds: Vec<_> = listed
        .iter()
        .map(|l| (l.2.as_str(), l.3.as_str()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("expression", "ledger/a-1"),
            ("parked", "ledger/a-1"),
            ("parked", "ledger/a-1"),
            ("parked", "ledger/a-1"),
        ]
    );
    let ids: Vec<u64> = listed.iter().map(|l| l.0).collect();

    // The operator's fix: a deposit without `n` is ignored.
    let fixed = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(common::repo_root().join(ledger)).unwrap();
    let text = text.replace(
        "          Deposited:\n",
        "          Deposited:\n            - when: '!has(event.payload.n)'\n              goto: open\n",
    );
    assert!(text.contains("!has(event.payload.n)"));
    std::fs::write(fixed.path().join("ledger.yaml"), text).unwrap();
    let (code, out) = run_to_exit(
        &[
            "dlq",
            "redrive",
            "--tenant",
            "bank",
            &ids[0].to_string(),
            "--data-dir",
            &data_dir,
            "--manifest",
            fixed.path().to_str().unwrap(),
        ],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    let report: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
    assert_eq!(
        report["processed"],
        json!(ids),
        "the entry, then the held ones in order"
    );
    assert_eq!(report["dead_lettered"], 0);
    assert_eq!(report["applied"], 4);

    // The running node publishes the redrive's outputs: 2, 3, 4 after 1, once each.
    common::wait_until(
        "the redrive's outputs published",
        Duration::from_secs(30),
        || async { acknowledged(&js, "a-1").await.len() >= 4 },
    )
    .await;
    common::wait_until("the outbox is empty", Duration::from_secs(30), || async {
        common::saga_progress(&admin, "AGGREGATE_EVENTS").await.1 == 0
    })
    .await;
    assert_eq!(acknowledged(&js, "a-1").await, [1, 2, 3, 4]);
    let inst = common::open_store(runner.data_dir.path())
        .read_blocking(|t| t.instance("bank", "ledger", "a-1"))
        .unwrap()
        .unwrap();
    assert_eq!(
        inst.state, "open",
        "a held deposit was applied out of order"
    );
    assert_eq!(inst.data["count"], json!(4));
    assert_eq!(inst.data["total"], json!(100));
    assert!(dlq_list(&data_dir, &[]).is_empty(), "all redriven");
    runner.stop();
}
