//! Saga mode end to end: the real binary, a real nats-server, the example manifests.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{
    NatsServer, RunnerProc, aggregate_event, effect_result, jetstream, publish_json, read_stream,
    wait_for_messages,
};
use serde_json::json;

const TS: u64 = 1_800_000_000_000;

/// Every instance in a stopped runner's data directory.
fn instances(
    data_dir: &std::path::Path,
) -> HashMap<(String, String, String), runner::saga::Instance> {
    let store = common::open_store(data_dir);
    store
        .read_blocking(|t| t.instances())
        .unwrap()
        .into_iter()
        .map(|i| {
            (
                (i.tenant.clone(), i.saga.clone(), i.correlation_id.clone()),
                i,
            )
        })
        .collect()
}

fn assert_unique_ids(seen: &[common::Seen]) {
    let mut ids = HashMap::new();
    for s in seen {
        let id = s.msg_id.clone().expect("every output carries Nats-Msg-Id");
        if let Some(prev) = ids.insert(id.clone(), s.subject.clone()) {
            panic!("duplicate output {id} on {prev} and {}", s.subject);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_of_two_tenants_reach_their_states_and_emit_once() {
    let nats = NatsServer::start();
    let mut runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &[]);
    let js = jetstream(&nats.url()).await;

    let tenants = ["acme", "globex"];
    let per_tenant = 40;
    for t in tenants {
        for i in 0..per_tenant {
            let id = format!("o-{i}");
            let ev = aggregate_event(
                t,
                "Order",
                &id,
                "OrderPlaced",
                TS + i,
                json!({
                    "customer_id": format!("c-{i}"),
                    "amount_cents": 1000 + i,
                    "items": [{"sku": "book", "qty": 1}],
                }),
            );
            publish_json(&js, &format!("tenant.{t}.aggregate.Order.{id}"), &ev).await;
        }
    }
    let total = tenants.len() * per_tenant as usize;
    let charges = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.*.effect.charge_card.*",
        total,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(charges.len(), total);
    assert_unique_ids(&charges);

    // Play the payment service: even orders are paid, odd ones declined.
    for c in &charges {
        let order: u64 = c.body["payload"]["order_id"].as_str().unwrap()[2..]
            .parse()
            .unwrap();
        let (subject, body) = if order.is_multiple_of(2) {
            effect_result(
                &c.body,
                "Succeeded",
                TS + 10_000,
                json!({"payment_id": format!("p-{order}")}),
            )
        } else {
            effect_result(&c.body, "Failed", TS + 10_000, json!({"error": "declined"}))
        };
        publish_json(&js, &subject, &body).await;
    }
    let half = total / 2;
    let reserves = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.*.effect.reserve_stock.*",
        half,
        Duration::from_secs(60),
    )
    .await;
    let cancels = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.*.command.Order.*",
        half,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(reserves.len(), half);
    assert_eq!(cancels.len(), half);
    for c in &cancels {
        assert_eq!(c.body["payload"]["reason"], "payment_failed");
        let t = c.body["tenant_id"].as_str().unwrap();
        assert!(c.subject.starts_with(&format!("tenant.{t}.command.Order.")));
    }
    let all = read_stream(&js, "WORKFLOW_COMMANDS", "tenant.>").await;
    assert_eq!(
        all.len(),
        total + half + half,
        "an output appeared more than once"
    );
    assert_unique_ids(&all);

    // Each declined order ended (cancelled): one SagaFailed each, which callers wait for.
    let ended = wait_for_messages(
        &js,
        "WORKFLOW_EVENTS",
        "tenant.*.workflow_event.order.*",
        half,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(ended.len(), half);
    assert_unique_ids(&ended);
    for e in &ended {
        assert_eq!(e.body["event_type"], "SagaFailed", "{}", e.body);
        assert_eq!(e.body["payload"]["state"], "cancelled");
        assert_eq!(e.body["payload"]["status"], "failed");
    }

    let info: serde_json::Value = common::get_json(&format!("{}/info", runner.admin)).await;
    assert_eq!(
        info["saga_progress"]["routed"]["AGGREGATE_EVENTS"],
        json!(total)
    );
    // The router reads the whole WORKFLOW_EVENTS stream: the results it was sent, the
    // terminal events the sagas published and the partitions' fence markers (none of which
    // a trigger wants: covered, not copied).
    let covered = common::eventually(Duration::from_secs(30), || async {
        let info: serde_json::Value = common::get_json(&format!("{}/info", runner.admin)).await;
        let mut stream = js.get_stream("WORKFLOW_EVENTS").await.unwrap();
        let last = stream.info().await.unwrap().state.last_sequence;
        info["saga_progress"]["routed"]["WORKFLOW_EVENTS"] == json!(last)
    })
    .await;
    assert!(
        covered,
        "WORKFLOW_EVENTS not routed through its last message"
    );
    runner.signal("TERM");
    assert_eq!(runner.wait_exit(Duration::from_secs(30)), Some(0));
    let inst = instances(runner.data_dir.path());
    assert_eq!(inst.len(), total);
    for t in tenants {
        for i in 0..per_tenant {
            let got = &inst[&(t.to_string(), "order".to_string(), format!("o-{i}"))];
            let want = if i.is_multiple_of(2) {
                "reserving_stock"
            } else {
                "cancelled"
            };
            assert_eq!(got.state, want, "{t}/o-{i}");
            assert_eq!(got.data["amount_cents"], json!(1000 + i));
        }
    }
}
