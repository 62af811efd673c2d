//! A client that may publish on `tenant.<t>.>` forges `charge_card.Succeeded` for another
//! order (a made-up command id and the victim's correlation id): the order saga does not
//! move, the forgery is dead-lettered as `unanswered_result` with its reason, the victim's
//! key is not parked, and the genuine result still completes the step. Real binary, real
//! nats-server.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

fn inspect(data_dir: &str) -> serde_json::Value {
    let (code, out) = run_to_exit(
        &[
            "inspect",
            "--data-dir",
            data_dir,
            "--tenant",
            "acme",
            "--saga",
            "order",
            "--id",
            "o-1",
        ],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_result_is_dead_lettered_and_moves_nothing() {
    let nats = NatsServer::start();
    let runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &[]);
    let data_dir = runner.data_dir.path().to_str().unwrap().to_string();
    let js = jetstream(&nats.url()).await;
    let now = runner::clock::now_ms();
    let order = aggregate_event(
        "acme",
        "Order",
        "o-1",
        "OrderPlaced",
        now,
        json!({"customer_id": "c", "amount_cents": 4200, "items": [{"sku": "s", "qty": 1}]}),
    );
    publish_json(&js, "tenant.acme.aggregate.Order.o-1", &order).await;
    let charges = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        1,
        Duration::from_secs(30),
    )
    .await;
    let charge = charges[0].body.clone();

    // The forgery: same effect and correlation, a command id the saga never issued.
    let mut fake = charge.clone();
    fake["command_id"] = json!(uuid::Uuid::now_v7().to_string());
    let (subject, body) =
        effect_result(&fake, "Succeeded", now + 1, json!({"payment_id": "forged"}));
    publish_json(&js, &subject, &body).await;
    let dead = wait_for_messages(
        &js,
        "RUNNER_DLQ",
        "tenant.acme.deadletter.unanswered_result",
        1,
        Duration::from_secs(30),
    )
    .await;
    let reason = dead[0].body.to_string();
    assert!(
        reason.contains(fake["command_id"].as_str().unwrap()),
        "{reason}"
    );
    let view = inspect(&data_dir);
    assert_eq!(view["instance"]["state"], "awaiting_payment", "{view}");
    assert_eq!(
        view["parked_by"],
        serde_json::Value::Null,
        "the key is not parked: {view}"
    );
    assert!(
        view["instance"]["data"].get("payment_id").is_none(),
        "{view}"
    );

    // The genuine result still moves the saga on.
    let (subject, body) =
        effect_result(&charge, "Succeeded", now + 2, json!({"payment_id": "p-1"}));
    publish_json(&js, &subject, &body).await;
    wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.reserve_stock.*",
        1,
        Duration::from_secs(30),
    )
    .await;
    let view = inspect(&data_dir);
    assert_eq!(view["instance"]["state"], "reserving_stock", "{view}");
    assert_eq!(view["instance"]["data"]["payment_id"], "p-1", "{view}");
}
