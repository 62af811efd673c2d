//! The `grpc` provider end to end: real nats-server, real `runner` processes, and a real
//! tonic server (tests/common/grpc.rs) serving the example's `payments.v1.Payments` from
//! the same `.proto`, counting calls per `idempotency-key`.
//!
//! Covered: a reply mapped into the result (and, in combined mode, into the saga), the
//! request built from the template by the protobuf JSON mapping, metadata and secrets, each
//! retryable status retried then failed, each fatal status failed at once, deadlines,
//! `grpc-retry-pushback-ms`, the breaker, TLS and mutual TLS with a CA made here, server
//! reflection (v1, v1alpha only, none), and a SIGKILL of the executor mid-call.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::effects::{EffectBed, command_with, one_per_command};
use common::grpc::{
    GrpcReply, GrpcScript, GrpcUpstream, Reflection, ServerTls, charged, committed_descriptors,
    compile_descriptor_set,
};
use common::metrics::metric;
use common::upstream::{Latch, Reply};
use common::{NatsServer, RunnerProc, aggregate_event, jetstream, publish_json, read_stream};
use serde_json::{Value as Json, json};
use tonic::Code;

/// Short leases so a take-over happens within seconds.
const FAST: &[(&str, &str)] = &[
    ("RUNNER__EFFECT__LEASE_TTL", "1500ms"),
    ("RUNNER__EFFECT__ACK_WAIT", "3s"),
    ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
    ("TEST_GRPC_TOKEN", "grpc-s3cret"),
];

#[test]
fn committed_descriptor_set_matches_the_proto() {
    // Rebuild with: UPDATE_DESCRIPTORS=1 cargo nextest run --test effect_grpc committed_descriptor_set
    let fresh = compile_descriptor_set();
    let path = committed_descriptors();
    if std::env::var_os("UPDATE_DESCRIPTORS").is_some() {
        std::fs::write(&path, &fresh).unwrap();
    }
    let committed = std::fs::read(&path).unwrap();
    assert!(
        committed == fresh,
        "{} is not built from payments.proto; rebuild it (see the comment above)",
        path.display()
    );
}

/// The script every test server shares: the request's `customerId` says what to answer.
/// `ok` → a charge; `status:NAME` → that status; `pushback:MS` → UNAVAILABLE with that
/// pushback on the first call, then a charge; `big:N` → a charge whose payment id is N
/// bytes; `slow` → a charge after 5 s; `hold` → the
/// first call waits on `latch`.
fn script(latch: Latch) -> GrpcScript {
    Arc::new(move |call| {
        let customer = call.request["customerId"].as_str().unwrap_or("");
        match customer.split_once(':') {
            Some(("status", name)) => GrpcReply::status(code(name), &format!("said {name}")),
            Some(("pushback", ms)) if call.nth == 1 => {
                GrpcReply::status(Code::Unavailable, "busy").pushback(ms)
            }
            Some(("big", bytes)) => {
                let mut body = charged(call);
                body["paymentId"] = json!("x".repeat(bytes.parse().unwrap()));
                GrpcReply::ok(body)
            }
            _ if customer == "slow" => GrpcReply::ok(charged(call)).after(Duration::from_secs(5)),
            _ if customer == "hold" && call.nth == 1 => GrpcReply::ok(charged(call)).until(&latch),
            _ => GrpcReply::ok(charged(call)),
        }
    })
}

fn code(name: &str) -> Code {
    (0..=16)
        .map(Code::from_i32)
        .find(|c| runner::effect::provider::grpc::status_name(*c) == name)
        .unwrap_or_else(|| panic!("no status {name}"))
}

/// One effect calling `Charge` on `base`; `extra` adds settings lines, `policy` is the
/// rest of the effect (timeout, retry, breaker).
fn effect(name: &str, base: &str, extra: &str, policy: &str) -> String {
    format!(
        r#"  - name: {name}
    provider: grpc
    settings:
      endpoint: {base}
      method: payments.v1.Payments/Charge
      request:
        subscription_id: ${{ event.payload.sub }}
        customer_id: ${{ event.payload.customer }}
        amount: {{ units_cents: "${{ event.payload.cents }}", currency: EUR }}
      metadata: {{ authorization: "Bearer ${{ saga.secrets.token }}", x-tenant: "${{ event.tenant_id }}" }}
      secrets: {{ token: {{ env: TEST_GRPC_TOKEN }} }}
      result: {{ payment_id: "${{ state.body.paymentId }}", attempt: "${{ state.body.attempt }}", at: "${{ state.body.chargedAt }}", status: "${{ state.status }}" }}
{extra}    {policy}
"#
    )
}

fn descriptors() -> String {
    format!("      descriptors: {}\n", committed_descriptors().display())
}

/// A bed whose manifest is `effects` (HTTP upstream unused).
async fn bed(effects: String) -> EffectBed {
    EffectBed::start(Arc::new(|_, _, _| Reply::status(404)), move |_| {
        format!("format: 1\neffects:\n{effects}")
    })
    .await
}

fn charge(effect: &str, customer: &str, n: u64) -> (String, Json) {
    command_with(
        effect,
        json!({ "sub": format!("s-{n}"), "customer": customer, "cents": 4200 }),
        n,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_becomes_the_result_and_the_request_follows_the_template() {
    let up = GrpcUpstream::start(script(Latch::new()), Reflection::None, None).await;
    let policy = "timeout_ms: 600000\n    retry: { retry_limit: 0 }";
    let bed = bed(effect("charge", &up.base, &descriptors(), policy)).await;
    let _w = bed.runner(FAST);
    let id = bed.publish_one(charge("charge", "ok", 1)).await;
    let seen = bed.settle(1, Duration::from_secs(60)).await;
    let r = &one_per_command(&seen)[&id];
    assert_eq!(r["result_type"], "Succeeded", "{r}");
    assert_eq!(
        r["payload"],
        json!({ "payment_id": format!("pay-{id}"), "attempt": "1", "at": "2026-11-25T10:00:00Z", "status": "OK" })
    );
    let calls = up.calls();
    assert_eq!(calls.len(), 1);
    let c = &calls[0];
    assert_eq!(c.key, id, "idempotency-key is the command id");
    assert_eq!(
        c.request,
        json!({
            "subscriptionId": "s-1", "customerId": "ok", "description": "", "labels": {},
            "amount": { "unitsCents": "4200", "currency": "EUR" },
        })
    );
    assert_eq!(c.metadata["authorization"], "Bearer grpc-s3cret");
    assert_eq!(c.metadata["x-tenant"], "_");
    assert_eq!(
        c.metadata.get("traceparent").map(String::as_str),
        Some(common::effects::TRACEPARENT),
        "the command's trace context goes on to the upstream"
    );
    assert!(
        c.metadata.contains_key("grpc-timeout"),
        "the attempt's deadline is sent: {:?}",
        c.metadata
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_larger_than_a_result_may_be_fails_once_without_being_read() {
    let up = GrpcUpstream::start(script(Latch::new()), Reflection::None, None).await;
    let policy = "timeout_ms: 600000\n    retry: { retry_limit: 3 }";
    let bed = bed(effect("charge", &up.base, &descriptors(), policy)).await;
    let _w = bed.runner(FAST);
    // 8 MiB: past the broker's 1 MiB record limit and past tonic's own 4 MiB default.
    let big = bed
        .publish_one(charge("charge", &format!("big:{}", 8 << 20), 1))
        .await;
    let small = bed.publish_one(charge("charge", "big:1000", 2)).await;
    let seen = bed.settle(2, Duration::from_secs(60)).await;
    let results = one_per_command(&seen);
    let r = &results[&big];
    assert_eq!(r["result_type"], "Failed", "{r}");
    let error = r["payload"]["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("the reply is larger than the") && error.contains("bytes a result may have"),
        "named as too large, not as a status the upstream sent: {r}"
    );
    assert_eq!(up.count(&big), 1, "refused for good: not called again");
    assert_eq!(
        results[&small]["result_type"], "Succeeded",
        "{}",
        results[&small]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retryable_statuses_are_retried_then_failed_and_fatal_ones_fail_at_once() {
    let up = GrpcUpstream::start(script(Latch::new()), Reflection::None, None).await;
    let policy =
        "timeout_ms: 600000\n    retry: { retry_limit: 2, base_backoff: 20, max_backoff: 100 }";
    let effects = effect("charge", &up.base, &descriptors(), policy)
        + &effect(
            "charge_internal",
            &up.base,
            &(descriptors() + "      retryable_codes: [INTERNAL]\n"),
            policy,
        );
    let bed = bed(effects).await;
    let _w = bed.runner(FAST);
    let retryable = ["UNAVAILABLE", "RESOURCE_EXHAUSTED", "ABORTED"];
    let fatal = [
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "FAILED_PRECONDITION",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNKNOWN",
        "DATA_LOSS",
    ];
    let mut cmds: Vec<((String, Json), &str, usize)> = Vec::new();
    for (i, name) in retryable.iter().enumerate() {
        cmds.push((
            charge("charge", &format!("status:{name}"), i as u64),
            name,
            3,
        ));
    }
    for (i, name) in fatal.iter().enumerate() {
        cmds.push((
            charge("charge", &format!("status:{name}"), 100 + i as u64),
            name,
            1,
        ));
    }
    cmds.push((
        charge("charge_internal", "status:INTERNAL", 200),
        "INTERNAL",
        3,
    ));
    let ids = bed
        .publish(&cmds.iter().map(|(c, _, _)| c.clone()).collect::<Vec<_>>())
        .await;
    let seen = bed.settle(cmds.len(), Duration::from_secs(90)).await;
    let by_cmd = one_per_command(&seen);
    for (id, (_, name, calls)) in ids.iter().zip(&cmds) {
        let r = &by_cmd[id];
        assert_eq!(r["result_type"], "Failed", "{name}: {r}");
        let p = &r["payload"];
        assert_eq!(p["status"], *name, "{p}");
        assert_eq!(p["code"], code(name) as i32, "{p}");
        assert_eq!(p["message"], format!("said {name}"), "{p}");
        assert_eq!(up.count(id), *calls, "{name} ({}) calls", r["effect_name"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_pushback_and_the_breaker() {
    let up = GrpcUpstream::start(script(Latch::new()), Reflection::None, None).await;
    let effects = effect(
        "quick",
        &up.base,
        &descriptors(),
        "timeout_ms: 700\n    retry: { retry_limit: 0 }",
    ) + &effect(
        "patient",
        &up.base,
        &descriptors(),
        "timeout_ms: 600000\n    retry: { retry_limit: 1, base_backoff: 1, max_backoff: 2 }",
    ) + &effect(
        "guarded",
        &up.base,
        &descriptors(),
        "timeout_ms: 600000\n    retry: { retry_limit: 0 }\n    circuit_breaker: { failure_threshold: 2, open_ms: 3600000 }",
    );
    let bed = bed(effects).await;
    let w = bed.runner(FAST);
    // A call outliving its deadline, and a server answering DEADLINE_EXCEEDED: both TimedOut.
    let slow = bed.publish_one(charge("quick", "slow", 1)).await;
    let dl = bed
        .publish_one(charge("quick", "status:DEADLINE_EXCEEDED", 2))
        .await;
    // Pushback: the second call waits at least what the server asked, then succeeds; a
    // negative pushback ends the command at once.
    let pb = bed.publish_one(charge("patient", "pushback:1500", 3)).await;
    let stop = bed.publish_one(charge("patient", "pushback:-1", 4)).await;
    let seen = bed.settle(4, Duration::from_secs(60)).await;
    let by_cmd = one_per_command(&seen);
    assert_eq!(by_cmd[&slow]["result_type"], "TimedOut");
    assert_eq!(by_cmd[&dl]["result_type"], "TimedOut");
    // Each in its own words: our deadline, or the server's answer.
    let error = |id: &str| {
        by_cmd[id]["payload"]["error"]
            .as_str()
            .unwrap_or("")
            .to_string()
    };
    assert!(
        error(&slow).contains("timed out after 700ms"),
        "{}",
        error(&slow)
    );
    assert!(
        error(&dl).contains("upstream answered status DEADLINE_EXCEEDED"),
        "{}",
        error(&dl)
    );
    assert_eq!(by_cmd[&pb]["result_type"], "Succeeded", "{}", by_cmd[&pb]);
    let calls: Vec<_> = up.calls().into_iter().filter(|c| c.key == pb).collect();
    assert_eq!(calls.len(), 2);
    let waited = calls[1].at - calls[0].at;
    assert!(
        waited >= Duration::from_millis(1500),
        "the retry waited {waited:?}, less than the 1500 ms pushback"
    );
    assert_eq!(by_cmd[&stop]["result_type"], "Failed");
    assert_eq!(up.count(&stop), 1, "a negative pushback is not retried");

    // Two UNAVAILABLE failures open `guarded`'s circuit: the third command makes no call.
    let a = charge("guarded", "status:UNAVAILABLE", 5);
    let b = charge("guarded", "status:UNAVAILABLE", 6);
    bed.publish(&[a, b]).await;
    bed.settle(6, Duration::from_secs(60)).await;
    let third = bed.publish_one(charge("guarded", "ok", 7)).await;
    let seen = bed.settle(7, Duration::from_secs(60)).await;
    let r = &one_per_command(&seen)[&third];
    assert_eq!(r["result_type"], "Failed", "{r}");
    assert!(
        r["payload"]["error"]
            .as_str()
            .unwrap()
            .contains("circuit open"),
        "{r}"
    );
    assert_eq!(up.count(&third), 0, "no call through an open circuit");
    let opened = metric(
        &w.admin,
        "runner_effect_attempts_total{effect=\"guarded\",outcome=\"circuit_open\"}",
    )
    .await;
    assert_eq!(opened, 1.0);
}

/// Nothing listening at the endpoint: the command fails as UNAVAILABLE (retried like it),
/// and its result says that nothing answered rather than that the upstream answered a status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_nobody_listens_on_is_reported_as_no_answer() {
    let port = common::cluster::free_ports(1)[0];
    let effects = effect(
        "nowhere",
        &format!("http://127.0.0.1:{port}"),
        &descriptors(),
        "timeout_ms: 5000\n    retry: { retry_limit: 1, base_backoff: 1, max_backoff: 2 }",
    );
    let bed = bed(effects).await;
    let _w = bed.runner(FAST);
    let id = bed.publish_one(charge("nowhere", "ok", 1)).await;
    let seen = bed.settle(1, Duration::from_secs(60)).await;
    let result = &one_per_command(&seen)[&id];
    assert_eq!(result["result_type"], "Failed", "{result}");
    let error = result["payload"]["error"].as_str().unwrap_or("");
    assert!(
        error.contains("no answer from upstream (UNAVAILABLE:") && !error.contains("answered"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_mutual_tls_with_a_test_ca() {
    let certs = tempfile::tempdir().unwrap();
    common::postgres::make_test_ca(certs.path());
    let tls = |mutual| ServerTls {
        dir: certs.path().to_path_buf(),
        mutual,
    };
    let plain_tls =
        GrpcUpstream::start(script(Latch::new()), Reflection::None, Some(tls(false))).await;
    let mtls = GrpcUpstream::start(script(Latch::new()), Reflection::None, Some(tls(true))).await;
    let d = certs.path().display();
    let ca = format!("      tls_ca_file: {d}/ca.pem\n");
    let client =
        format!("      tls_cert_file: {d}/client.pem\n      tls_key_file: {d}/client.key\n");
    let policy = "timeout_ms: 10000\n    retry: { retry_limit: 0 }";
    let effects = effect("tls", &plain_tls.base, &(descriptors() + &ca), policy)
        + &effect("web_roots", &plain_tls.base, &descriptors(), policy)
        + &effect("mtls", &mtls.base, &(descriptors() + &ca + &client), policy)
        + &effect("no_client_cert", &mtls.base, &(descriptors() + &ca), policy);
    let bed = bed(effects).await;
    let _w = bed.runner(FAST);
    let ids = bed
        .publish(&[
            charge("tls", "ok", 1),
            charge("web_roots", "ok", 2),
            charge("mtls", "ok", 3),
            charge("no_client_cert", "ok", 4),
        ])
        .await;
    let seen = bed.settle(4, Duration::from_secs(60)).await;
    let by_cmd = one_per_command(&seen);
    let outcome = |i: usize| by_cmd[&ids[i]]["result_type"].as_str().unwrap().to_string();
    assert_eq!(outcome(0), "Succeeded", "TLS verified against the test CA");
    assert_eq!(
        outcome(1),
        "Failed",
        "the test CA is not among the web roots"
    );
    assert_eq!(
        outcome(2),
        "Succeeded",
        "mutual TLS with the client certificate"
    );
    assert_eq!(
        outcome(3),
        "Failed",
        "mutual TLS without a client certificate"
    );
    assert_eq!(plain_tls.count(&ids[0]), 1);
    assert_eq!(
        plain_tls.count(&ids[1]),
        0,
        "no call over an unverified connection"
    );
    assert_eq!(mtls.count(&ids[2]), 1);
    assert_eq!(mtls.count(&ids[3]), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_reflection_v1_and_v1alpha_and_none() {
    let v1 = GrpcUpstream::start(script(Latch::new()), Reflection::V1, None).await;
    let alpha = GrpcUpstream::start(script(Latch::new()), Reflection::V1AlphaOnly, None).await;
    let none = GrpcUpstream::start(script(Latch::new()), Reflection::None, None).await;
    let policy =
        "timeout_ms: 10000\n    retry: { retry_limit: 2, base_backoff: 1, max_backoff: 2 }";
    let effects = effect("by_v1", &v1.base, "", policy)
        + &effect("by_v1alpha", &alpha.base, "", policy)
        + &effect("by_nothing", &none.base, "", policy);
    let bed = bed(effects).await;
    let _w = bed.runner(FAST);
    let cmds = [
        charge("by_v1", "ok", 1),
        charge("by_v1", "ok", 2),
        charge("by_v1alpha", "ok", 3),
        charge("by_nothing", "ok", 4),
    ];
    let ids = bed.publish(&cmds).await;
    let seen = bed.settle(4, Duration::from_secs(60)).await;
    let by_cmd = one_per_command(&seen);
    for i in 0..3 {
        let r = &by_cmd[&ids[i]];
        assert_eq!(r["result_type"], "Succeeded", "{r}");
        assert_eq!(r["payload"]["payment_id"], format!("pay-{}", ids[i]));
    }
    let call = v1.calls().into_iter().find(|c| c.key == ids[0]).unwrap();
    assert_eq!(call.request["amount"]["unitsCents"], "4200");
    let r = &by_cmd[&ids[3]];
    assert_eq!(r["result_type"], "Failed", "{r}");
    let err = r["payload"]["error"].as_str().unwrap();
    assert!(err.contains("reflection"), "{err}");
    assert_eq!(none.calls().len(), 0, "no method call without its types");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_executor_calls_again_only_after_its_lease_with_the_same_key() {
    let latch = Latch::new();
    let up = GrpcUpstream::start(script(latch.clone()), Reflection::None, None).await;
    let policy = "timeout_ms: 600000\n    retry: { retry_limit: 0 }";
    let bed = bed(effect("charge", &up.base, &descriptors(), policy)).await;
    let first = bed.runner(FAST);
    let id = bed.publish_one(charge("charge", "hold", 1)).await;
    assert!(
        common::eventually(Duration::from_secs(20), || async { up.count(&id) == 1 }).await,
        "the first executor called"
    );
    let second = bed.runner(FAST);
    assert_eq!(
        up.in_flight(),
        1,
        "the first call is in flight when it is killed"
    );
    let killed_at = Instant::now();
    first.kill();
    let seen = bed.settle(1, Duration::from_secs(60)).await;
    let r = &one_per_command(&seen)[&id];
    assert_eq!(r["result_type"], "Succeeded", "{r}");
    assert_eq!(
        r["payload"]["attempt"], "2",
        "the take-over's call answered"
    );
    let calls: Vec<_> = up.calls().into_iter().filter(|c| c.key == id).collect();
    assert_eq!(calls.len(), 2, "the killed call and the take-over's call");
    assert!(calls[1].at > killed_at);
    let steals = metric(&second.admin, "runner_effect_claims_total{event=\"steal\"}").await;
    assert_eq!(steals, 1.0, "the take-over came from an expired lease");
    latch.release();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subscription_example_runs_through_grpc_in_combined_mode() {
    let nats = NatsServer::start();
    let up = GrpcUpstream::start(script(Latch::new()), Reflection::None, None).await;
    let manifests = tempfile::tempdir().unwrap();
    let src = common::repo_root().join("manifests/grpc");
    let text = std::fs::read_to_string(src.join("subscription.yaml"))
        .unwrap()
        .replace("http://billing.internal:50051", &up.base);
    std::fs::write(manifests.path().join("subscription.yaml"), text).unwrap();
    std::fs::copy(
        src.join("payments.binpb"),
        manifests.path().join("payments.binpb"),
    )
    .unwrap();
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
    for (id, customer) in [("sub-1", "ok"), ("sub-2", "status:PERMISSION_DENIED")] {
        let ev = aggregate_event(
            "_",
            "Subscription",
            id,
            "RenewalDue",
            now,
            json!({ "customer_id": customer, "period": 7, "amount_cents": 990, "currency": "EUR" }),
        );
        publish_json(&js, &format!("tenant._.aggregate.Subscription.{id}"), &ev).await;
    }
    let done = common::eventually(Duration::from_secs(60), || async {
        read_stream(&js, "WORKFLOW_COMMANDS", "tenant._.command.Subscription.>")
            .await
            .len()
            == 2
    })
    .await;
    assert!(
        done,
        "no Subscription commands; log:\n{}",
        runner.log.join("\n")
    );
    let cmds = read_stream(&js, "WORKFLOW_COMMANDS", "tenant._.command.Subscription.>").await;
    let extend = cmds
        .iter()
        .find(|c| c.body["command_type"] == "Extend")
        .expect("sub-1 extended");
    let call = up
        .calls()
        .into_iter()
        .find(|c| c.request["subscriptionId"] == "sub-1")
        .unwrap();
    assert_eq!(
        extend.body["payload"],
        json!({ "period": 7, "payment_id": format!("pay-{}", call.key) }),
        "the reply's payment id went through the saga"
    );
    assert_eq!(
        call.request["amount"],
        json!({ "unitsCents": "990", "currency": "EUR" })
    );
    assert_eq!(
        call.request["labels"],
        json!({ "saga": "subscription_renewal" })
    );
    let past_due = cmds
        .iter()
        .find(|c| c.body["command_type"] == "MarkPastDue")
        .expect("sub-2 past due");
    assert_eq!(
        past_due.body["payload"],
        json!({ "period": 7, "reason": "PERMISSION_DENIED" })
    );
    drop(runner);
}
