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
    // The node's own copy of the manifests, fixed and reloaded later.
    let manifests = common::manifest_copy(&["order.yaml", "travel.yaml"]);
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        manifests.path().to_str().unwrap(),
        &env,
    );
    let admin = runner.admin.clone();
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
    // Orders of different keys sit in different partitions: no order between them.
    let mut ids: Vec<_> = charges
        .iter()
        .map(|c| c.body["payload"]["order_id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    assert_eq!(ids, ["o-1", "o-4"]);

    // Each poison kind is in the dead-letter stream with its reason…
    let dlq = wait_for_messages(&js, "RUNNER_DLQ", "tenant.>", 7, Duration::from_secs(30)).await;
    let mut kinds: Vec<_> = dlq
        .iter()
        .map(|m| m.body["kind"].as_str().unwrap().to_string())
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "expression",
            "parked",
            "tenant_mismatch",
            "too_large",
            "too_large",
            "undecodable",
            "unknown_tenant",
        ]
    );
    let of_kind = |kind: &'static str| dlq.iter().filter(move |m| m.body["kind"] == kind);
    assert!(
        of_kind("too_large").any(|m| m.body["reason"].as_str().unwrap().contains("1200 bytes")),
        "the long key is named by its size"
    );
    for m in &dlq {
        assert!(!m.body["reason"].as_str().unwrap().is_empty());
        assert!(m.subject.ends_with(m.body["kind"].as_str().unwrap()));
    }
    let mismatch = of_kind("tenant_mismatch").next().unwrap();
    assert!(mismatch.body["reason"].as_str().unwrap().contains("globex"));
    let unknown = of_kind("unknown_tenant").next().unwrap();
    assert_eq!(unknown.subject, "tenant.evil.deadletter.unknown_tenant");
    // …and in the store, listed while the node runs.
    let listed = dlq_list(&data_dir, &[]);
    assert_eq!(listed.len(), 7);
    let expression = listed.iter().find(|l| l.2 == "expression").unwrap().clone();
    assert_eq!(expression.3, "order/o-bad");
    let held = listed.iter().find(|l| l.2 == "parked").unwrap().clone();

    // The held entry cannot jump the queue.
    let redrive = |tenant: &str, id: u64| {
        let url = format!("{admin}/admin/dlq/{tenant}/{id}/redrive");
        async move { common::post_json(&url, &json!({})).await }
    };
    let (status, body) = redrive("acme", held.0).await;
    assert_eq!(status, 409, "{body}");
    assert!(body.to_string().contains("parked behind"), "{body}");

    // The operator fixes the manifest (missing items now mean rejection), reloads it and
    // redrives: the partition's owner applies the entry, then the one held behind it.
    for f in ["order.yaml", "travel.yaml"] {
        let path = manifests.path().join(f);
        let text = std::fs::read_to_string(&path).unwrap();
        let text = text
            .replace(
                "&& type(event.payload.items) == list",
                "&& has(event.payload.items) && type(event.payload.items) == list",
            )
            .replace(
                "items: ${ event.payload.items }",
                "items: \"${ has(event.payload.items) ? event.payload.items : [] }\"",
            );
        std::fs::write(path, text).unwrap();
    }
    let (status, body) = common::post_json(&format!("{admin}/admin/reload"), &json!({})).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = redrive("acme", expression.0).await;
    assert_eq!(status, 202, "{body}");
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
    common::wait_until("both entries redriven", Duration::from_secs(30), || async {
        dlq_list(&data_dir, &[])
            .iter()
            .all(|l| l.2 != "expression" && l.2 != "parked")
    })
    .await;

    // A second redrive is refused: processed once.
    let (status, body) = redrive("acme", expression.0).await;
    assert_eq!(status, 409, "{body}");

    // An entry of no saga instance (an unknown tenant's input) belongs to no partition: the
    // answer says to republish its input.
    let unknown = listed.iter().find(|l| l.2 == "unknown_tenant").unwrap().0;
    let (status, body) = redrive("evil", unknown).await;
    assert_eq!(status, 409, "{body}");
    assert!(body.to_string().contains("republish its input"), "{body}");

    // Once the outbox is empty every output is on the stream: nothing more can appear.
    common::wait_until("the outbox is empty", Duration::from_secs(30), || async {
        common::saga_progress(&admin, "AGGREGATE_EVENTS").await.1 == 0
    })
    .await;
    let all = read_stream(&js, "WORKFLOW_COMMANDS", "tenant.>").await;
    assert_eq!(all.len(), 3, "o-1, o-4, the o-bad rejection: once each");
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
    let manifests = tempfile::tempdir().unwrap();
    let file = manifests.path().join("ledger.yaml");
    std::fs::copy(common::repo_root().join(ledger), &file).unwrap();
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        manifests.path().to_str().unwrap(),
        &[],
    );
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

    // The operator's fix: a deposit without `n` is ignored. Reloaded, then redriven: the
    // partition's owner applies the entry, then the ones held behind it, in their order.
    let text = std::fs::read_to_string(&file).unwrap();
    let text = text.replace(
        "          Deposited:\n",
        "          Deposited:\n            - when: '!has(event.payload.n)'\n              goto: open\n",
    );
    assert!(text.contains("!has(event.payload.n)"));
    std::fs::write(&file, text).unwrap();
    let (status, body) = common::post_json(&format!("{admin}/admin/reload"), &json!({})).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = common::post_json(
        &format!("{admin}/admin/dlq/bank/{}/redrive", ids[0]),
        &json!({}),
    )
    .await;
    assert_eq!(status, 202, "{body}");

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
