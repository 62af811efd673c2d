//! Combined mode: saga and effect workers in one process drive both example manifests to
//! completion through real HTTP calls to a local upstream.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::upstream::{Reply, Upstream};
use common::{NatsServer, RunnerProc, aggregate_event, jetstream, publish_json, read_stream};
use runner::config::StorageConfig;
use runner::saga::Status;
use runner::storage::Store;
use serde_json::json;

/// Copies the example manifests, pointing each example host at a path prefix of `base`.
fn local_manifests(dir: &std::path::Path, base: &str) {
    for file in ["order.yaml", "travel.yaml"] {
        let text = std::fs::read_to_string(common::repo_root().join("manifests").join(file))
            .unwrap()
            .replace("http://payments.internal", &format!("{base}/payments"))
            .replace("http://warehouse.internal", &format!("{base}/warehouse"))
            .replace("http://shipping.internal", &format!("{base}/shipping"))
            .replace("http://flights.internal", &format!("{base}/flights"));
        assert!(
            !text.contains(".internal"),
            "{file} names a host this test does not serve"
        );
        std::fs::write(dir.join(file), text).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_example_sagas_complete_through_real_http_effects() {
    let nats = NatsServer::start();
    let upstream = Upstream::start(Arc::new(|path, key, _| match path {
        "/payments/v1/charges" => Reply::ok(json!({ "payment_id": format!("pay-{key}") })),
        "/warehouse/v1/reservations" => Reply::ok(json!({ "reservation_id": "res-1" })),
        "/shipping/v1/shipments" => Reply::ok(json!({ "tracking_number": "trk-1" })),
        "/flights/v1/reservations" => {
            Reply::ok(json!({ "booking_ref": "FL-1", "arrival": "2026-12-01T10:00:00Z" }))
        }
        _ => Reply::status(404),
    }))
    .await;
    let manifests = tempfile::tempdir().unwrap();
    local_manifests(manifests.path(), &upstream.base);
    let runner = RunnerProc::start(
        &[
            "--mode",
            "combined",
            "--nats-url",
            &nats.url(),
            "--manifest",
            manifests.path().to_str().unwrap(),
        ],
        &[("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync")],
    );
    let js = jetstream(&nats.url()).await;
    let now = runner::clock::now_ms();
    let order = aggregate_event(
        "_",
        "Order",
        "o-1",
        "OrderPlaced",
        now,
        json!({ "customer_id": "c-1", "amount_cents": 4200, "items": [{"sku": "book", "qty": 2}] }),
    );
    publish_json(&js, "tenant._.aggregate.Order.o-1", &order).await;
    let trip = aggregate_event(
        "_",
        "Trip",
        "t-1",
        "TripRequested",
        now,
        json!({ "traveller": "ada", "flight": "LH123", "hotel": "h-9", "car": "compact" }),
    );
    publish_json(&js, "tenant._.aggregate.Trip.t-1", &trip).await;

    // The order ends with OrderFulfilled; the trip with results for its last two steps,
    // which the executor publishes straight into the waiting partition's inbox.
    let results = || read_stream(&js, "SAGA_INBOX", "runner.inbox.*.result");
    let done = common::eventually(Duration::from_secs(60), || async {
        let events = read_stream(&js, "WORKFLOW_EVENTS", "tenant._.>").await;
        let fulfilled = events
            .iter()
            .any(|e| e.body["event_type"] == "OrderFulfilled");
        let trip_steps = results()
            .await
            .iter()
            .filter(|e| {
                e.body["effect_name"] == "reserve_hotel" || e.body["effect_name"] == "reserve_car"
            })
            .count();
        fulfilled && trip_steps == 2
    })
    .await;
    assert!(
        done,
        "sagas did not finish; log:\n{}",
        runner.log.join("\n")
    );

    let events = results().await;
    assert!(!events.is_empty());
    for e in &events {
        assert_eq!(e.body["result_type"], "Succeeded", "{}", e.body);
    }
    let paths: Vec<String> = upstream.hits().iter().map(|h| h.path.clone()).collect();
    for p in [
        "/payments/v1/charges",
        "/warehouse/v1/reservations",
        "/shipping/v1/shipments",
        "/flights/v1/reservations",
    ] {
        assert_eq!(
            paths.iter().filter(|x| *x == p).count(),
            1,
            "{p} called once: {paths:?}"
        );
    }
    let charge = upstream
        .hits()
        .into_iter()
        .find(|h| h.path == "/payments/v1/charges")
        .unwrap();
    assert_eq!(
        charge.body["amount_cents"], 4200,
        "body is the command payload"
    );

    let dir = runner.stop();
    let store = Store::open(&StorageConfig {
        data_dir: dir.path().to_path_buf(),
        ..StorageConfig::default()
    })
    .unwrap();
    let instances = store.read_blocking(|t| t.instances()).unwrap();
    let status = |saga: &str| {
        instances
            .iter()
            .find(|i| i.saga == saga)
            .map(|i| (i.status, i.state.clone(), i.data.clone()))
            .unwrap()
    };
    let (st, state, data) = status("order");
    assert_eq!(
        (st, state.as_str()),
        (Status::Completed, "shipped"),
        "{data}"
    );
    assert!(data["payment_id"].as_str().unwrap().starts_with("pay-"));
    let (st, state, data) = status("travel_booking");
    assert_eq!(st, Status::Completed, "{state} {data}");
    assert_eq!(data["results"]["flight"]["booking_ref"], "FL-1");
    println!("order: shipped; travel_booking: {state}; upstream calls: {paths:?}");
}
