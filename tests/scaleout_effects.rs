//! Scale-out with real effects: two partitioned saga replicas and one effect replica on a
//! three-node NATS cluster drive the example order saga through a counting HTTP upstream,
//! and one saga replica is SIGKILLed mid-run. Every order must be shipped exactly once,
//! every effect command executed exactly once upstream (counted per `Idempotency-Key` on
//! each path), and every output stored once.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::scaleout::{replica_with, wait_balanced};
use common::upstream::{Reply, Upstream};
use common::{aggregate_event, jetstream};
use serde_json::json;

/// Copies `manifests/order.yaml`, pointing its services at `base`.
fn local_order_manifest(dir: &std::path::Path, base: &str) -> String {
    let text = std::fs::read_to_string(common::repo_root().join("manifests/order.yaml"))
        .unwrap()
        .replace("http://payments.internal", &format!("{base}/payments"))
        .replace("http://warehouse.internal", &format!("{base}/warehouse"))
        .replace("http://shipping.internal", &format!("{base}/shipping"));
    assert!(
        !text.contains(".internal"),
        "a host this test does not serve"
    );
    let path = dir.join("order.yaml");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_saga_replica_costs_no_double_effect_and_no_lost_order() {
    let cluster = Cluster::start(3);
    let upstream = Upstream::start(Arc::new(|path, key, _| match path {
        "/payments/v1/charges" => Reply::ok(json!({ "payment_id": format!("pay-{key}") })),
        "/warehouse/v1/reservations" => Reply::ok(json!({ "reservation_id": "res-1" })),
        "/shipping/v1/shipments" => Reply::ok(json!({ "tracking_number": "trk-1" })),
        _ => Reply::status(404),
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let manifest = local_order_manifest(dir.path(), &upstream.base);
    let s1 = replica_with(
        &cluster,
        "s1",
        tempfile::tempdir().unwrap(),
        "saga",
        &manifest,
        &[],
    );
    let s2 = replica_with(
        &cluster,
        "s2",
        tempfile::tempdir().unwrap(),
        "saga",
        &manifest,
        &[],
    );
    let e1 = replica_with(
        &cluster,
        "e1",
        tempfile::tempdir().unwrap(),
        "effect",
        &manifest,
        &[],
    );
    wait_balanced(&[&s1, &s2], Duration::from_secs(60)).await;

    let orders = 1000;
    let js = jetstream(&cluster.url(0)).await;
    let now = runner::clock::now_ms();
    let publisher = {
        let js = js.clone();
        tokio::spawn(async move {
            for i in 0..orders {
                let id = format!("o-{i}");
                let ev = aggregate_event(
                    "acme",
                    "Order",
                    &id,
                    "OrderPlaced",
                    now + i,
                    json!({"customer_id": "c", "amount_cents": 1000 + i, "items": [{"sku": "book", "qty": 1}]}),
                );
                common::publish_json(&js, &format!("tenant.acme.aggregate.Order.{id}"), &ev).await;
            }
        })
    };
    let up = upstream.clone();
    common::wait_until("a third charged", Duration::from_secs(120), || {
        let up = up.clone();
        async move {
            up.hits()
                .iter()
                .filter(|h| h.path == "/payments/v1/charges")
                .count()
                >= orders as usize / 3
        }
    })
    .await;
    let _ = s2.kill();
    let killed = Instant::now();
    publisher.await.unwrap();
    let up = upstream.clone();
    common::wait_until("every order shipped", Duration::from_secs(240), || {
        let up = up.clone();
        async move {
            up.hits()
                .iter()
                .filter(|h| h.path == "/shipping/v1/shipments")
                .count()
                >= orders as usize
        }
    })
    .await;
    println!(
        "all {orders} orders shipped {:?} after the SIGKILL",
        killed.elapsed()
    );

    // Each effect command ran exactly once upstream.
    let mut per_path: HashMap<String, HashMap<String, usize>> = HashMap::new();
    for h in upstream.hits() {
        *per_path
            .entry(h.path.clone())
            .or_default()
            .entry(
                h.key
                    .clone()
                    .expect("every call carries its Idempotency-Key"),
            )
            .or_default() += 1;
    }
    for path in [
        "/payments/v1/charges",
        "/warehouse/v1/reservations",
        "/shipping/v1/shipments",
    ] {
        let keys = &per_path[path];
        assert_eq!(keys.len(), orders as usize, "{path}: one command per order");
        let twice: Vec<_> = keys.iter().filter(|(_, n)| **n > 1).collect();
        assert!(
            twice.is_empty(),
            "{path}: executed more than once: {twice:?}"
        );
    }
    // Every output stored once: one OrderFulfilled, one SagaCompleted and one MarkShipped
    // per order.
    let workflow = common::wait_for_messages(
        &js,
        "WORKFLOW_EVENTS",
        "tenant.acme.workflow_event.order.*",
        2 * orders as usize,
        Duration::from_secs(120),
    )
    .await;
    let mut by_order: HashMap<String, usize> = HashMap::new();
    let mut completed: HashMap<String, usize> = HashMap::new();
    for f in &workflow {
        let count = match f.body["event_type"].as_str() {
            Some("OrderFulfilled") => &mut by_order,
            Some("SagaCompleted") => &mut completed,
            other => panic!("unexpected workflow event {other:?}"),
        };
        *count.entry(f.subject.clone()).or_default() += 1;
    }
    assert_eq!(completed.len(), orders as usize, "every order ended once");
    assert!(completed.values().all(|n| *n == 1), "an order ended twice");
    assert_eq!(by_order.len(), orders as usize, "every order fulfilled");
    assert!(
        by_order.values().all(|n| *n == 1),
        "an order fulfilled twice"
    );
    let commands = common::wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.>",
        orders as usize * 5,
        Duration::from_secs(120),
    )
    .await;
    let mut ids = HashMap::new();
    for c in &commands {
        let id = c.msg_id.clone().unwrap();
        assert!(
            ids.insert(id.clone(), ()).is_none(),
            "output {id} stored twice"
        );
    }
    assert_eq!(
        commands.len(),
        orders as usize * 5,
        "per order: 3 effect commands, Confirm and MarkShipped"
    );
    // Every result went straight into its partition's inbox, named by the command's
    // `Runner-Partition`: none was published to the workflow events stream for a router
    // to copy.
    let stray = common::read_stream(&js, "WORKFLOW_EVENTS", "tenant.*.effect_result.>").await;
    assert!(
        stray.is_empty(),
        "{} results went the long way",
        stray.len()
    );
    let direct = common::read_stream(&js, "SAGA_INBOX", "runner.inbox.*.result").await;
    let mut answered: HashMap<String, usize> = HashMap::new();
    for r in &direct {
        *answered
            .entry(r.body["command_id"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    assert_eq!(
        answered.len(),
        orders as usize * 3,
        "one result per command"
    );
    s1.stop();
    e1.stop();
}
