//! The `nats_publish` and `log` providers end to end: a real nats-server, a real
//! `runner --mode effect`, real result events. (HTTP, `nats_request`, SMTP and PostgreSQL
//! are covered in `effect_worker.rs` and `effect_behaviour.rs`.) Also the subject rules
//! (`src/subject.rs`): a rendered subject too long for the server's control line, or
//! outside the command's tenant, fails that command alone and leaves the one connection up;
//! so does an admin request naming such a tenant.
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
      subject: "tenant.${ saga.tenant }.notify.${ event.payload.n }"
      body: { order: "${ event.metadata.correlation_id }", amount: "${ event.payload.n }" }
  - name: forward
    provider: nats_publish
    settings:
      subject: "tenant.${ saga.tenant }.forward.${ event.command_id }"
  - name: token
    provider: nats_publish
    settings:
      subject: "tenant.${ saga.tenant }.token.${ event.payload.token }"
  - name: anywhere
    provider: nats_publish
    settings:
      subject: "${ event.payload.to }"
  - name: shared
    provider: nats_publish
    settings:
      subject: "${ event.payload.to }"
      tenant_scoped: false
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
    let mut sub = client.subscribe("tenant._.notify.>").await.unwrap();
    let mut fwd = client.subscribe("tenant._.forward.>").await.unwrap();
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
    assert_eq!(
        m.subject.as_str(),
        "tenant._.notify.42",
        "templated subject"
    );
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
    assert_eq!(m.subject.as_str(), format!("tenant._.forward.{forward}"));
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

/// The next message on `s`, within 30 s.
async fn next(s: &mut async_nats::Subscriber) -> async_nats::Message {
    tokio::time::timeout(Duration::from_secs(30), s.next())
        .await
        .expect("a message arrived")
        .unwrap()
}

/// Waits for `w` to exit after SIGTERM and returns how often it logged that its NATS
/// connection came up and that it was lost: a server that closed the connection (a protocol
/// line over its `max_control_line`) shows as a loss and a second "up".
fn connection_history(w: &mut common::RunnerProc) -> (usize, usize) {
    w.signal("TERM");
    assert_eq!(w.wait_exit(Duration::from_secs(60)), Some(0));
    let count = |needle: &str| w.log.iter().filter(|l| l.contains(needle)).count();
    (count("NATS connection up."), count("NATS connection lost"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5000_byte_token_in_a_subject_fails_that_command_and_the_connection_stays_up() {
    let bed = bed().await;
    let client = async_nats::connect(bed.nats.url()).await.unwrap();
    let mut sub = client.subscribe("tenant._.token.>").await.unwrap();
    client.flush().await.unwrap();
    let mut w = bed.runner(&[]);

    // The subject would be 5 000 bytes of token plus `tenant._.token.`: over the server's
    // 4096-byte control line, which would close Runner's only connection.
    let huge = bed
        .publish_one(command_with("token", json!({"token": "k".repeat(5000)}), 1))
        .await;
    let seen = bed.settle(1, Duration::from_secs(30)).await;
    let r = &one_per_command(&seen)[&huge];
    assert_eq!(r["result_type"], "Failed", "{r}");
    assert_eq!(r["attempts"], 1, "fatal: not retried: {r}");
    let error = r["payload"]["error"].as_str().unwrap();
    assert_eq!(
        error,
        "fatal: effect `token`: rendered subject refused: subject is 5015 bytes; the limit is \
         1024 (nats-server closes the connection on a protocol line over its max_control_line)",
        "{r}"
    );
    assert_eq!(r["payload"]["subject_bytes"], 5015);

    // The next command on the same effect runs, on the same connection.
    let next = bed
        .publish_one(command_with("token", json!({"token": "ok"}), 2))
        .await;
    let seen = bed.settle(2, Duration::from_secs(30)).await;
    let r = &one_per_command(&seen)[&next];
    assert_eq!(r["result_type"], "Succeeded", "{r}");
    let m = tokio::time::timeout(Duration::from_secs(30), sub.next())
        .await
        .expect("the next command's message arrived")
        .unwrap();
    assert_eq!(m.subject.as_str(), "tenant._.token.ok");
    client.flush().await.unwrap();
    assert!(
        sub.next().now_or_never().is_none(),
        "nothing was sent for the refused command"
    );

    let (up, lost) = connection_history(&mut w);
    assert_eq!((up, lost), (1, 0), "one connection, never lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_outside_the_tenant_is_refused_unless_the_effect_opts_out() {
    let bed = bed().await;
    let client = async_nats::connect(bed.nats.url()).await.unwrap();
    let mut own = client.subscribe("tenant._.mine").await.unwrap();
    let mut other = client.subscribe("tenant.other.>").await.unwrap();
    let mut shared = client.subscribe("shared.>").await.unwrap();
    client.flush().await.unwrap();
    let _w = bed.runner(&[]);

    let to = |effect: &str, to: &str, n: u64| command_with(effect, json!({ "to": to }), n);
    let ids = bed
        .publish(&[
            to("anywhere", "shared.news", 1),
            to("anywhere", "tenant.other.orders", 2),
            to("anywhere", "tenant._.mine", 3),
            to("shared", "shared.news", 4),
            to("shared", "tenant.other.orders", 5),
        ])
        .await;
    let seen = bed.settle(5, Duration::from_secs(30)).await;
    let by = one_per_command(&seen);
    let refused = "fatal: effect `anywhere`: rendered subject refused: subject is outside \
                   tenant `_`: it must start with `tenant._.` (set `tenant_scoped: false` on \
                   the effect to publish on a shared subject)";
    for id in &ids[..2] {
        let r = &by[id];
        assert_eq!(r["result_type"], "Failed", "{r}");
        assert_eq!(r["attempts"], 1, "{r}");
        assert_eq!(r["payload"]["error"], refused, "{r}");
    }
    for id in &ids[2..] {
        assert_eq!(by[id]["result_type"], "Succeeded", "{}", by[id]);
    }

    assert_eq!(next(&mut own).await.subject.as_str(), "tenant._.mine");
    // Only the opted-out effect reached the shared subject, and another tenant's subject.
    assert_eq!(next(&mut shared).await.subject.as_str(), "shared.news");
    let m = next(&mut other).await;
    assert_eq!(m.subject.as_str(), "tenant.other.orders");
    let key = m.headers.as_ref().and_then(|h| h.get("Idempotency-Key"));
    assert_eq!(key.map(|v| v.as_str()), Some(ids[4].as_str()));
    client.flush().await.unwrap();
    assert!(
        own.next().now_or_never().is_none(),
        "one message in the tenant"
    );
    assert!(shared.next().now_or_never().is_none(), "one shared message");
    assert!(
        other.next().now_or_never().is_none(),
        "the refused one never went out"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_request_naming_a_5000_byte_tenant_is_a_400_naming_the_rule() {
    let bed = bed().await;
    // Combined: pause and resume are answered (they write the control bucket's
    // `paused.<tenant>` key, a subject on the node's one connection).
    let mut w = common::RunnerProc::combined(&bed.nats.url(), bed.manifest.to_str().unwrap(), &[]);
    let http = reqwest::Client::new();
    let long = "t".repeat(5000);
    let too_long = "`tenant` must be a name: tenant is 5000 bytes; the limit is 128";
    for (method, path, says) in [
        ("POST", format!("/admin/tenants/{long}/pause"), too_long),
        ("POST", format!("/admin/tenants/{long}/resume"), too_long),
        ("GET", format!("/admin/dlq/stream?tenant={long}"), too_long),
        (
            "POST",
            format!("/admin/dlq/stream/{long}/1/redrive"),
            too_long,
        ),
        ("POST", format!("/admin/dlq/{long}/1/redrive"), too_long),
        (
            "POST",
            "/admin/tenants/a%20b/pause".to_string(),
            "`tenant` must be a name: tenant holds whitespace or a control character",
        ),
        (
            "POST",
            "/admin/tenants/a.b/pause".to_string(),
            "`tenant` must be a name: tenant must be one subject token: it holds a `.`",
        ),
    ] {
        let url = format!("{}{path}", w.admin);
        let req = match method {
            "GET" => http.get(&url),
            _ => http.post(&url),
        };
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let body: serde_json::Value = r.json().await.unwrap();
        let shown = &path[..path.len().min(60)];
        assert_eq!(status, 400, "{method} {shown}: {body}");
        let error = body["error"].as_str().unwrap();
        assert!(error.starts_with(says), "{method} {shown}: {error}");
        assert!(error.len() < 400, "the tenant is not echoed whole: {error}");
    }

    // The node's connection is still the first one: a real pause and resume go through.
    for verb in ["pause", "resume"] {
        let r = http
            .post(format!("{}/admin/tenants/acme/{verb}", w.admin))
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status().as_u16(),
            200,
            "{verb}: {}",
            r.text().await.unwrap()
        );
    }
    let (up, lost) = connection_history(&mut w);
    assert_eq!((up, lost), (1, 0), "one connection, never lost");
}
