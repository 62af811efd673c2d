//! Effect mode end to end: real nats-server, real `runner --mode effect` processes, a real
//! local HTTP upstream that counts requests per `Idempotency-Key`.
//!
//! Calls that must stay in flight while the test acts (a worker is killed, frozen or
//! duplicated under them) are held on a [`Latch`] the test releases, never on a delay the
//! test has to outrun.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::RunnerProc;
use common::effects::{EffectBed, command, one_per_command, wait_quiescent};
use common::metrics::{metric, metric_across, metric_or_zero, wait_metric, wait_metric_sum};
use common::upstream::{Latch, Reply, Script};
use serde_json::json;

/// Short leases and ack waits so take-overs happen within seconds.
const FAST: &[(&str, &str)] = &[
    ("RUNNER__EFFECT__LEASE_TTL", "1500ms"),
    ("RUNNER__EFFECT__ACK_WAIT", "3s"),
    ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
    ("TEST_UPSTREAM_TOKEN", "s3cret-token-value"),
];

/// The test effects against `base`. `charge` has a per-attempt timeout far above any wait
/// in these tests, so a call held by the test never times out into a retry of its own.
/// `flaky`'s circuit, once open, stays open for the whole test; `mending`'s reopens for a
/// probe after one second.
fn manifest(base: &str) -> String {
    format!(
        r#"format: 1
effects:
  - name: charge
    provider: http
    settings:
      url: "{base}/charge/${{ event.payload.n }}"
      method: POST
      headers: {{ X-Api-Token: "Bearer ${{ saga.secrets.token }}" }}
      secrets: {{ token: {{ env: TEST_UPSTREAM_TOKEN }} }}
      body: {{ amount: "${{ event.payload.n }}", order: "${{ event.metadata.correlation_id }}" }}
    timeout_ms: 600000
    retry: {{ retry_limit: 3, base_backoff: 150, max_backoff: 2000, enable_jitter: false }}
  - name: flaky
    provider: http
    settings:
      url: "{base}/flaky"
    timeout_ms: 5000
    retry: {{ retry_limit: 0 }}
    circuit_breaker: {{ failure_threshold: 3, open_ms: 3600000 }}
  - name: mending
    provider: http
    settings:
      url: "{base}/mending"
    timeout_ms: 5000
    retry: {{ retry_limit: 0 }}
    circuit_breaker: {{ failure_threshold: 3, open_ms: 1000 }}
  - name: nothing
    provider: noop
"#
    )
}

/// Nats, the upstream answering with `script`, and the manifest.
async fn bed(script: Script) -> EffectBed {
    EffectBed::start(script, manifest).await
}

fn effect_runner(bed: &EffectBed) -> RunnerProc {
    bed.runner(FAST)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_execute_each_command_once() {
    const N: u64 = 2000;
    let bed = bed(Arc::new(|_, key, _| Reply::ok(json!({ "charged": key })))).await;
    let workers: Vec<RunnerProc> = (0..3).map(|_| effect_runner(&bed)).collect();

    let cmds: Vec<_> = (0..N).map(|n| command("charge", n)).collect();
    let started = Instant::now();
    let ids = bed.publish(&cmds).await;
    let seen = bed.settle(N as usize, Duration::from_secs(240)).await;
    let elapsed = started.elapsed();
    let by_cmd = one_per_command(&seen);
    assert_eq!(
        by_cmd.len(),
        N as usize,
        "every command has exactly one result"
    );
    for id in &ids {
        let r = &by_cmd[id];
        assert_eq!(r["result_type"], "Succeeded");
        assert_eq!(r["payload"]["charged"], json!(id));
        assert_eq!(
            r["metadata"]["saga"], "test",
            "the command's metadata is echoed"
        );
    }
    let per_key = bed.upstream.per_key();
    assert_eq!(per_key.len(), N as usize);
    for id in &ids {
        assert_eq!(
            per_key.get(id),
            Some(&1),
            "key {id} reached the upstream once"
        );
    }
    let hit = bed.upstream.hits().into_iter().next().unwrap();
    assert!(hit.path.starts_with("/charge/"));
    assert_eq!(
        hit.traceparent.as_deref(),
        Some(common::effects::TRACEPARENT),
        "the command's trace context goes on to the upstream"
    );
    assert!(hit.body["order"].as_str().unwrap().starts_with("c-"));
    // Work was shared.
    let admins: Vec<&str> = workers.iter().map(|w| w.admin.as_str()).collect();
    let shares = metric_across(&admins, "runner_effect_claims_total{event=\"completed\"}").await;
    println!(
        "{N} commands, 3 workers: all results, consumer quiescent, within {:.1}s ({:.0} commands/s); completed per worker {shares:?}",
        elapsed.as_secs_f64(),
        N as f64 / elapsed.as_secs_f64()
    );
    assert_eq!(shares.iter().sum::<f64>(), N as f64);
    assert!(
        shares.iter().filter(|s| **s > 0.0).count() >= 2,
        "work spread over workers: {shares:?}"
    );
    // The secret went to the upstream but never into a log.
    for w in &workers {
        assert!(!w.log.iter().any(|l| l.contains("s3cret-token-value")));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_is_taken_over_after_its_lease() {
    // The first request of every key is held until the test ends: its executor is killed
    // under it, whenever that happens.
    let never = Latch::new();
    let hold = never.clone();
    let bed = bed(Arc::new(move |_, key, nth| {
        let r = Reply::ok(json!({ "by": nth, "key": key }));
        if nth == 1 { r.until(&hold) } else { r }
    }))
    .await;
    let first = effect_runner(&bed);
    let id = bed.publish_one(command("charge", 7)).await;
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            bed.upstream.count(&id) == 1
        })
        .await,
        "the first worker called the upstream"
    );
    let second = effect_runner(&bed);
    assert_eq!(
        bed.upstream.in_flight(),
        1,
        "the first worker's call is still in flight when it is killed"
    );
    let killed_at = Instant::now();
    first.kill();

    let seen = bed.settle(1, Duration::from_secs(60)).await;
    let by_cmd = one_per_command(&seen);
    assert_eq!(by_cmd.len(), 1);
    let r = &by_cmd[&id];
    assert_eq!(r["result_type"], "Succeeded");
    assert_eq!(
        r["payload"]["by"], 2,
        "the second executor's call produced the result"
    );
    let n = bed.upstream.count(&id);
    assert_eq!(n, 2, "the killed call and the take-over's call");
    assert_eq!(
        seen[0].msg_id.as_deref(),
        Some(r["event_id"].as_str().unwrap())
    );
    let steals = metric(&second.admin, "runner_effect_claims_total{event=\"steal\"}").await;
    assert_eq!(steals, 1.0);
    println!(
        "take-over after SIGKILL: result {:.1}s after the kill, upstream saw the key {n} times",
        killed_at.elapsed().as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_zombie_is_fenced_out() {
    // The first call of a key is held until the test has frozen its executor, let a second
    // worker take the command over, and released it; the second call answers at once.
    let late = Latch::new();
    let hold = late.clone();
    let bed = bed(Arc::new(move |_, _, nth| {
        let r = Reply::ok(json!({ "by": nth }));
        if nth == 1 { r.until(&hold) } else { r }
    }))
    .await;
    let mut zombie = effect_runner(&bed);
    let id = bed.publish_one(command("charge", 9)).await;
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            bed.upstream.count(&id) == 1
        })
        .await
    );
    let second = effect_runner(&bed);
    // It has been renewing its lease meanwhile.
    wait_metric(
        &zombie.admin,
        "runner_effect_claims_total{event=\"renewed\"}",
        |v| v >= 2.0,
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(
        bed.upstream.in_flight(),
        1,
        "the zombie's call is in flight"
    );
    zombie.signal("STOP");

    let seen = bed.settle(1, Duration::from_secs(60)).await;
    assert_eq!(one_per_command(&seen)[&id]["payload"]["by"], 2);
    // Now the zombie's call is answered, while it is still frozen, and then it wakes up to
    // a late answer and a stale lease.
    late.release();
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            bed.upstream.in_flight() == 0
        })
        .await,
        "the upstream answered the zombie's call"
    );
    zombie.signal("CONT");
    // It learns on its next renewal, from its own lease's end having passed while it was
    // frozen, or when it tries to record its outcome, and either way gives the command up
    // without publishing: once it has counted that, it has nothing
    // left that could publish a result.
    let line = zombie.wait_for_log("another executor", Duration::from_secs(30));
    println!("zombie said: {line}");
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            fenced_out(&zombie.admin).await >= 1.0
        })
        .await,
        "the zombie counted its fencing"
    );
    // Its nak'ed delivery comes back to a done claim and is replayed under the same
    // `Nats-Msg-Id`; once the consumer holds nothing, the stream is final.
    wait_quiescent(&bed.js, Duration::from_secs(30)).await;
    let seen = bed.results().await;
    assert_eq!(seen.len(), 1, "no second result: {seen:?}");
    assert_eq!(seen[0].body["payload"]["by"], 2);
    assert_eq!(bed.upstream.count(&id), 2);
    assert_eq!(
        metric(&second.admin, "runner_effect_claims_total{event=\"steal\"}").await,
        1.0
    );
}

/// An executor cut off from NATS gives its call up when its lease runs out, not when a
/// renewal nobody answers finally times out (here after 30 s): from the lease's end on,
/// another executor may take the command, and the two must never run it side by side. The
/// first call is held by the upstream; NATS is frozen under the executor; it abandons the
/// call (its log says so) well before its renewal could time out. Thawed, the command is
/// executed again and answered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_cut_off_from_nats_abandons_its_call_when_its_lease_runs_out() {
    let held = Latch::new();
    let hold = held.clone();
    let bed = bed(Arc::new(move |_, _, nth| {
        let r = Reply::ok(json!({ "by": nth }));
        if nth == 1 { r.until(&hold) } else { r }
    }))
    .await;
    let mut envs = FAST.to_vec();
    envs.push(("RUNNER__NATS__REQUEST_TIMEOUT", "30s"));
    let mut cut = bed.runner(&envs);
    let id = bed.publish_one(command("charge", 7)).await;
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            bed.upstream.count(&id) == 1
        })
        .await
    );
    bed.nats.signal("STOP");
    let line = cut.wait_for_log("Lease ran out", Duration::from_secs(20));
    bed.nats.signal("CONT");
    assert!(line.contains("abandoning the command"), "{line}");
    held.release();
    let seen = bed.settle(1, Duration::from_secs(60)).await;
    assert_eq!(one_per_command(&seen)[&id]["payload"]["by"], 2, "{seen:?}");
    wait_quiescent(&bed.js, Duration::from_secs(30)).await;
    assert_eq!(bed.results().await.len(), 1, "one result");
    assert_eq!(bed.upstream.count(&id), 2);
}

/// Times a worker gave a command up because another executor holds it now (a refused
/// renewal, or a refused record of its outcome).
async fn fenced_out(admin: &str) -> f64 {
    metric_or_zero(admin, "runner_effect_claims_total{event=\"renew_failed\"}").await
        + metric_or_zero(admin, "runner_effect_claims_total{event=\"failed\"}").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_claim_is_not_stolen_before_its_lease_expires() {
    // The first executor's call is held until the test has watched the same command come
    // back, to it and to a second worker, for longer than a lease.
    let release = Latch::new();
    let hold = release.clone();
    let bed = bed(Arc::new(move |_, _, nth| {
        Reply::ok(json!({ "by": nth })).until(&hold)
    }))
    .await;
    let first = effect_runner(&bed);
    let (subject, body) = command("charge", 11);
    let id = bed.publish_one((subject.clone(), body.clone())).await;
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            bed.upstream.count(&id) == 1
        })
        .await
    );
    let second = effect_runner(&bed);
    let admins = [first.admin.as_str(), second.admin.as_str()];
    let renewed = "runner_effect_claims_total{event=\"renewed\"}";
    let before = wait_metric(&first.admin, renewed, |v| v >= 1.0, Duration::from_secs(20)).await;
    // The same command again under a new stream sequence (no `Nats-Msg-Id`), as after a
    // redelivery: whichever worker gets it finds a live claim.
    js_publish_plain(&bed, &subject, &body).await;
    wait_metric_sum(
        &admins,
        "runner_effect_claims_total{event=\"busy\"}",
        |v| v >= 2.0,
        Duration::from_secs(30),
    )
    .await;
    // Renewals every third of the lease: four more mean the lease the first executor held
    // when the duplicate arrived has run out, and only renewing kept the claim live.
    wait_metric(
        &first.admin,
        renewed,
        |v| v >= before + 4.0,
        Duration::from_secs(30),
    )
    .await;
    let busy = wait_metric_sum(
        &admins,
        "runner_effect_claims_total{event=\"busy\"}",
        |v| v >= 3.0,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        bed.upstream.count(&id),
        1,
        "executed once while the claim is live"
    );
    assert_eq!(
        bed.upstream.in_flight(),
        1,
        "and that call is still in flight"
    );
    for admin in admins {
        assert_eq!(
            metric_or_zero(admin, "runner_effect_claims_total{event=\"steal\"}").await,
            0.0,
            "nobody took over a live claim"
        );
    }
    release.release();
    let seen = bed.settle(1, Duration::from_secs(60)).await;
    let r = &one_per_command(&seen)[&id];
    assert_eq!(r["result_type"], "Succeeded");
    assert_eq!(r["payload"]["by"], 1, "the first executor's call");
    assert_eq!(r["attempts"], 1);
    assert_eq!(bed.upstream.count(&id), 1, "executed once in all");
    let completed = metric_across(&admins, "runner_effect_claims_total{event=\"completed\"}").await;
    assert_eq!(completed, vec![1.0, 0.0], "the first worker finished it");
    let replayed = metric_across(&admins, "runner_effect_claims_total{event=\"replayed\"}").await;
    assert_eq!(
        replayed.iter().sum::<f64>(),
        1.0,
        "the duplicate, once the claim was done, replayed the stored result"
    );
    println!("live claim: {busy} busy naks, no steal, one call, one result");
}

/// Publishes a command body again with no `Nats-Msg-Id`, so JetStream stores it anew.
async fn js_publish_plain(bed: &EffectBed, subject: &str, body: &serde_json::Value) {
    bed.js
        .publish(
            subject.to_string(),
            serde_json::to_vec(body).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_classification_and_the_circuit_breaker() {
    let mending = Arc::new(AtomicBool::new(false));
    let healthy = mending.clone();
    let bed = bed(Arc::new(move |path, _, nth| match path {
        "/flaky" => Reply::status(503),
        "/mending" if healthy.load(Ordering::SeqCst) => Reply::ok(json!({"ok": true})),
        "/mending" => Reply::status(503),
        // 500 then 200.
        "/charge/1" if nth == 1 => Reply::status(500),
        "/charge/1" => Reply::ok(json!({"second": true})),
        // Client error: never retried.
        "/charge/2" => Reply::status(400),
        _ => Reply::ok(json!({})),
    }))
    .await;
    let worker = effect_runner(&bed);

    let ids = bed
        .publish(&[command("charge", 1), command("charge", 2)])
        .await;
    let seen = bed.settle(2, Duration::from_secs(30)).await;
    let by_cmd = one_per_command(&seen);
    let retried = &by_cmd[&ids[0]];
    assert_eq!(retried["result_type"], "Succeeded");
    assert_eq!(retried["attempts"], 2);
    assert_eq!(bed.upstream.count(&ids[0]), 2);
    let hits: Vec<_> = bed
        .upstream
        .hits()
        .into_iter()
        .filter(|h| h.key.as_deref() == Some(&ids[0]))
        .collect();
    let gap = hits[1].at - hits[0].at;
    // retry 1 waits min(2000, (150*2)^1) = 300 ms (no jitter in this manifest); a lower
    // bound, which a slower machine only exceeds by more.
    assert!(
        gap >= Duration::from_millis(290),
        "retry waited only {gap:?}"
    );
    let fatal = &by_cmd[&ids[1]];
    assert_eq!(fatal["result_type"], "Failed");
    assert_eq!(fatal["attempts"], 1);
    assert_eq!(fatal["payload"]["status"], 400);
    assert_eq!(bed.upstream.count(&ids[1]), 1, "a 400 is not retried");
    println!("500 then 200: retried after {gap:?}; 400: one Failed result, one request");

    // Breaker: three 503s open it; the fourth command fails without a request. `flaky`'s
    // circuit stays open for an hour, so however long this takes, it is still open.
    let mut results = 2;
    for n in 0..3 {
        bed.publish_one(command("flaky", 100 + n)).await;
        results += 1;
        bed.settle(results, Duration::from_secs(30)).await;
    }
    assert_eq!(
        metric(
            &worker.admin,
            "runner_effect_circuit_state{effect=\"flaky\"}"
        )
        .await,
        1.0
    );
    let flaky_hits = || {
        bed.upstream
            .hits()
            .iter()
            .filter(|h| h.path == "/flaky")
            .count()
    };
    assert_eq!(flaky_hits(), 3);
    let open_id = bed.publish_one(command("flaky", 200)).await;
    results += 1;
    let seen = bed.settle(results, Duration::from_secs(30)).await;
    let r = &one_per_command(&seen)[&open_id];
    assert_eq!(r["result_type"], "Failed", "{r}");
    assert!(
        r["payload"]["error"]
            .as_str()
            .unwrap()
            .contains("circuit open"),
        "{r}"
    );
    assert_eq!(
        bed.upstream.count(&open_id),
        0,
        "an open circuit sends nothing upstream"
    );
    assert_eq!(flaky_hits(), 3);

    // Recovery, on `mending` (open for 1 s): three 503s open it; then the upstream heals
    // and a command arrives with retries to spare. Its attempts are refused without a call
    // while the circuit is open; once `open_ms` has passed one probe goes out, succeeds
    // and closes the circuit. No step depends on how fast the test reaches it.
    for n in 0..3 {
        bed.publish_one(command("mending", 300 + n)).await;
        results += 1;
        bed.settle(results, Duration::from_secs(30)).await;
    }
    assert_eq!(
        metric(
            &worker.admin,
            "runner_effect_circuit_state{effect=\"mending\"}"
        )
        .await,
        1.0
    );
    mending.store(true, Ordering::SeqCst);
    let (subject, mut body) = command("mending", 400);
    body["metadata"]["retry"] = json!({ "retry_limit": 1000, "base_backoff": 50, "max_backoff": 100, "enable_jitter": false });
    let probe_id = bed.publish_one((subject, body)).await;
    results += 1;
    let seen = bed.settle(results, Duration::from_secs(60)).await;
    let probe = &one_per_command(&seen)[&probe_id];
    assert_eq!(probe["result_type"], "Succeeded", "{probe}");
    assert_eq!(
        bed.upstream.count(&probe_id),
        1,
        "only the probe reached the upstream; refused attempts sent nothing"
    );
    let mending_hits = bed
        .upstream
        .hits()
        .iter()
        .filter(|h| h.path == "/mending")
        .count();
    assert_eq!(mending_hits, 4, "three failures and one probe");
    assert_eq!(
        metric(
            &worker.admin,
            "runner_effect_circuit_state{effect=\"mending\"}"
        )
        .await,
        0.0
    );
    let all: HashSet<_> = seen
        .iter()
        .map(|s| s.body["command_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(all.len(), results);
    println!(
        "open circuit: probe succeeded on attempt {} after refused attempts",
        probe["attempts"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_done_command_republishes_without_executing() {
    let bed = bed(Arc::new(|_, _, _| Reply::ok(json!({})))).await;
    let worker = effect_runner(&bed);
    let (subject, body) = command("charge", 5);
    let id = bed.publish_one((subject.clone(), body.clone())).await;
    bed.settle(1, Duration::from_secs(30)).await;
    // The same command again, under a new stream sequence (no Nats-Msg-Id de-duplication).
    js_publish_plain(&bed, &subject, &body).await;
    wait_metric(
        &worker.admin,
        "runner_effect_claims_total{event=\"replayed\"}",
        |v| v == 1.0,
        Duration::from_secs(20),
    )
    .await;
    wait_quiescent(&bed.js, Duration::from_secs(20)).await;
    assert_eq!(bed.upstream.count(&id), 1, "executed once");
    assert_eq!(
        bed.results().await.len(),
        1,
        "the republished result was de-duplicated"
    );
}
