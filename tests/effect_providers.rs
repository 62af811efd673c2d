//! The `nats_publish` and `log` providers end to end: a real nats-server, a real
//! `runner --mode effect`, real result events. (HTTP, `nats_request`, SMTP and PostgreSQL
//! are covered in `effect_worker.rs` and `effect_behaviour.rs`.)
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::effects::{EffectBed, command, command_with, one_per_command};
use common::upstream::Reply;
use futures::{FutureExt, StreamExt};
use serde_json::json;

/// No HTTP upstream is called in this file; the bed's answers 404 to anything.
async fn bed() -> EffectBed {
    EffectBed::start(Arc::new(|_, _, _| Reply::status(404)), |_| {
        r#"format: 1
effects:
  - name: notify
    provider: nats_publish
    settings:
      subject: "notify.${ saga.tenant }.${ event.payload.n }"
      body: { order: "${ event.metadata.correlation_id }", amount: "${ event.payload.n }" }
  - name: forward
    provider: nats_publish
    settings:
      subject: "forward.${ event.command_id }"
  - name: audit
    provider: log
"#
        .to_string()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_publish_sends_one_message_per_command_with_its_key() {
    let bed = bed().await;
    let client = async_nats::connect(bed.nats.url()).await.unwrap();
    let mut sub = client.subscribe("notify.>").await.unwrap();
    let mut fwd = client.subscribe("forward.>").await.unwrap();
    client.flush().await.unwrap();
    let _w = bed.runner(&[]);

    let notify = bed.publish_one(command("notify", 42)).await;
    let forward = bed
        .publish_one(command_with("forward", json!({"n": 5, "note": "as is"}), 5))
        .await;
    let seen = bed.settle(2, Duration::from_secs(30)).await;
    let by = one_per_command(&seen);
    for id in [&notify, &forward] {
        assert_eq!(by[id]["result_type"], "Succeeded", "{}", by[id]);
        assert_eq!(by[id]["attempts"], 1);
        assert_eq!(by[id]["payload"], json!({}), "a publish has no answer");
    }

    let m = tokio::time::timeout(Duration::from_secs(30), sub.next())
        .await
        .expect("the notify message arrived")
        .unwrap();
    assert_eq!(m.subject.as_str(), "notify._.42", "templated subject");
    let body: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
    assert_eq!(
        body,
        json!({"order": "c-42", "amount": 42}),
        "templated body"
    );
    let key = m.headers.as_ref().and_then(|h| h.get("Idempotency-Key"));
    assert_eq!(key.map(|v| v.as_str()), Some(notify.as_str()));

    let m = tokio::time::timeout(Duration::from_secs(30), fwd.next())
        .await
        .expect("the forward message arrived")
        .unwrap();
    assert_eq!(m.subject.as_str(), format!("forward.{forward}"));
    let body: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
    assert_eq!(
        body,
        json!({"n": 5, "note": "as is"}),
        "the default body is the payload"
    );

    // No second message: each was published before its result was recorded, on the
    // runner's one connection, so both reached the server before the results we settled
    // on. A round trip on our connection then flushes everything the server routed to us.
    client.flush().await.unwrap();
    assert!(sub.next().now_or_never().is_none(), "one notify message");
    assert!(fwd.next().now_or_never().is_none(), "one forward message");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_provider_logs_the_command_but_not_its_payload() {
    let bed = bed().await;
    let mut w = bed.runner(&[]);
    let payload = json!({"n": 7, "card": "4111-do-not-log"});
    let id = bed
        .publish_one(command_with("audit", payload.clone(), 7))
        .await;
    let seen = bed.settle(1, Duration::from_secs(30)).await;
    let r = &one_per_command(&seen)[&id];
    assert_eq!(r["result_type"], "Succeeded", "{r}");
    assert_eq!(r["payload"], json!({}));
    assert_eq!(r["attempts"], 1);

    let line = w.wait_for_log("(log provider)", Duration::from_secs(30));
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["command_id"], json!(id), "{line}");
    assert_eq!(v["effect"], "audit", "{line}");
    assert_eq!(
        v["payload_bytes"],
        json!(serde_json::to_string(&payload).unwrap().len()),
        "{line}"
    );
    // Drain it so that every line it wrote is read, then look through them all.
    w.signal("TERM");
    assert_eq!(w.wait_exit(Duration::from_secs(60)), Some(0));
    assert!(
        !w.log.iter().any(|l| l.contains("4111-do-not-log")),
        "the payload never reaches the log"
    );
    assert_eq!(
        w.log
            .iter()
            .filter(|l| l.contains("(log provider)"))
            .count(),
        1,
        "logged once"
    );
}
