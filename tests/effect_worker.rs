//! Effect mode end to end: real nats-server, real `runner --mode effect` processes, a real
//! local HTTP upstream that counts requests per `Idempotency-Key`.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::effects::{
    command, metric, one_per_command, publish_commands, results, settle_results,
};
use common::upstream::{Reply, Upstream};
use common::{NatsServer, RunnerProc, jetstream};
use serde_json::json;

/// Short leases and ack waits so take-overs happen within seconds.
const FAST: &[(&str, &str)] = &[
    ("RUNNER__EFFECT__LEASE_TTL", "1500ms"),
    ("RUNNER__EFFECT__ACK_WAIT", "3s"),
    ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
];

/// Writes a manifest declaring the test effects against `base`.
fn manifest(dir: &Path, base: &str) -> PathBuf {
    let path = dir.join("effects.yaml");
    let text = format!(
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
    timeout_ms: 30000
    retry: {{ retry_limit: 3, base_backoff: 150, max_backoff: 2000, enable_jitter: false }}
  - name: flaky
    provider: http
    settings:
      url: "{base}/flaky"
    timeout_ms: 5000
    retry: {{ retry_limit: 0 }}
    circuit_breaker: {{ failure_threshold: 3, open_ms: 6000 }}
  - name: nothing
    provider: noop
"#
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn effect_runner(url: &str, manifest: &Path) -> RunnerProc {
    let mut envs = FAST.to_vec();
    envs.push(("TEST_UPSTREAM_TOKEN", "s3cret-token-value"));
    RunnerProc::start(
        &[
            "--mode",
            "effect",
            "--nats-url",
            url,
            "--manifest",
            manifest.to_str().unwrap(),
        ],
        &envs,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_execute_each_command_once() {
    const N: u64 = 2000;
    let nats = NatsServer::start();
    let upstream =
        Upstream::start(Arc::new(|_, key, _| Reply::ok(json!({ "charged": key })))).await;
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path(), &upstream.base);
    let workers: Vec<RunnerProc> = (0..3).map(|_| effect_runner(&nats.url(), &m)).collect();
    let js = jetstream(&nats.url()).await;

    let cmds: Vec<_> = (0..N).map(|n| command("charge", n)).collect();
    let started = Instant::now();
    let ids = publish_commands(&js, &cmds).await;
    let seen = settle_results(&js, N as usize, Duration::from_secs(240)).await;
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
    let per_key = upstream.per_key();
    assert_eq!(per_key.len(), N as usize);
    for id in &ids {
        assert_eq!(
            per_key.get(id),
            Some(&1),
            "key {id} reached the upstream once"
        );
    }
    let hit = upstream.hits().into_iter().next().unwrap();
    assert!(hit.path.starts_with("/charge/"));
    assert!(hit.body["order"].as_str().unwrap().starts_with("c-"));
    // Work was shared.
    let mut shares = Vec::new();
    for w in &workers {
        shares.push(metric(&w.admin, "runner_effect_claims_total{event=\"completed\"}").await);
    }
    println!(
        "{N} commands, 3 workers: all results and a 2 s quiet period after them within {:.1}s ({:.0} commands/s counting the quiet period); completed per worker {shares:?}",
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
    let nats = NatsServer::start();
    // The first request of every key hangs long enough to be killed under.
    let upstream = Upstream::start(Arc::new(|_, key, nth| {
        let r = Reply::ok(json!({ "by": nth, "key": key }));
        if nth == 1 {
            r.after(Duration::from_secs(60))
        } else {
            r
        }
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path(), &upstream.base);
    let first = effect_runner(&nats.url(), &m);
    let js = jetstream(&nats.url()).await;
    let cmd = command("charge", 7);
    let id = publish_commands(&js, std::slice::from_ref(&cmd))
        .await
        .remove(0);
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            upstream.count(&id) == 1
        })
        .await,
        "the first worker called the upstream"
    );
    let second = effect_runner(&nats.url(), &m);
    let killed_at = Instant::now();
    first.kill();

    let seen = settle_results(&js, 1, Duration::from_secs(60)).await;
    let by_cmd = one_per_command(&seen);
    assert_eq!(by_cmd.len(), 1);
    let r = &by_cmd[&id];
    assert_eq!(r["result_type"], "Succeeded");
    assert_eq!(
        r["payload"]["by"], 2,
        "the second executor's call produced the result"
    );
    let n = upstream.count(&id);
    assert!(n <= 2, "upstream saw the key {n} times");
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
    let nats = NatsServer::start();
    // First call of a key answers after 8 s (by then its executor is frozen and replaced);
    // the second answers at once.
    let upstream = Upstream::start(Arc::new(|_, _, nth| {
        let r = Reply::ok(json!({ "by": nth }));
        if nth == 1 {
            r.after(Duration::from_secs(8))
        } else {
            r
        }
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path(), &upstream.base);
    let mut zombie = effect_runner(&nats.url(), &m);
    let js = jetstream(&nats.url()).await;
    let cmd = command("charge", 9);
    let id = publish_commands(&js, std::slice::from_ref(&cmd))
        .await
        .remove(0);
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            upstream.count(&id) == 1
        })
        .await
    );
    let second = effect_runner(&nats.url(), &m);
    // It has been renewing its lease meanwhile.
    assert!(
        common::eventually(Duration::from_secs(10), || async {
            metric(
                &zombie.admin,
                "runner_effect_claims_total{event=\"renewed\"}",
            )
            .await
                >= 2.0
        })
        .await
    );
    zombie.signal("STOP");

    let seen = settle_results(&js, 1, Duration::from_secs(60)).await;
    assert_eq!(one_per_command(&seen)[&id]["payload"]["by"], 2);
    zombie.signal("CONT");
    // The zombie learns on its next renewal or when it tries to record its outcome.
    let line = zombie.wait_for_log("another executor", Duration::from_secs(30));
    println!("zombie said: {line}");
    for l in zombie
        .log
        .iter()
        .filter(|l| l.contains("enew") || l.contains("WARN"))
    {
        println!("zombie log: {l}");
    }
    // Give its late upstream answer time to arrive and be refused.
    let first_call = upstream.hits()[0].at;
    while first_call.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let seen = results(&js).await;
    assert_eq!(seen.len(), 1, "no second result: {seen:?}");
    assert_eq!(seen[0].body["payload"]["by"], 2);
    assert_eq!(upstream.count(&id), 2);
    assert_eq!(
        metric(&second.admin, "runner_effect_claims_total{event=\"steal\"}").await,
        1.0
    );
    let fenced = metric(
        &zombie.admin,
        "runner_effect_claims_total{event=\"renew_failed\"}",
    )
    .await
        + metric(
            &zombie.admin,
            "runner_effect_claims_total{event=\"failed\"}",
        )
        .await;
    assert!(fenced >= 1.0, "the zombie counted its fencing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_classification_and_the_circuit_breaker() {
    let nats = NatsServer::start();
    let healthy = Arc::new(AtomicBool::new(false));
    let h = healthy.clone();
    let upstream = Upstream::start(Arc::new(move |path, _, nth| {
        if path == "/flaky" {
            return if h.load(Ordering::SeqCst) {
                Reply::ok(json!({"ok": true}))
            } else {
                Reply::status(503)
            };
        }
        match path {
            // 500 then 200.
            "/charge/1" if nth == 1 => Reply::status(500),
            "/charge/1" => Reply::ok(json!({"second": true})),
            // Client error: never retried.
            "/charge/2" => Reply::status(400),
            _ => Reply::ok(json!({})),
        }
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path(), &upstream.base);
    let worker = effect_runner(&nats.url(), &m);
    let js = jetstream(&nats.url()).await;

    let ids = publish_commands(&js, &[command("charge", 1), command("charge", 2)]).await;
    let seen = settle_results(&js, 2, Duration::from_secs(30)).await;
    let by_cmd = one_per_command(&seen);
    let retried = &by_cmd[&ids[0]];
    assert_eq!(retried["result_type"], "Succeeded");
    assert_eq!(retried["attempts"], 2);
    assert_eq!(upstream.count(&ids[0]), 2);
    let hits: Vec<_> = upstream
        .hits()
        .into_iter()
        .filter(|h| h.key.as_deref() == Some(&ids[0]))
        .collect();
    let gap = hits[1].at - hits[0].at;
    // retry 1 waits min(2000, (150*2)^1) = 300 ms (no jitter in this manifest).
    assert!(
        gap >= Duration::from_millis(290),
        "retry waited only {gap:?}"
    );
    let fatal = &by_cmd[&ids[1]];
    assert_eq!(fatal["result_type"], "Failed");
    assert_eq!(fatal["attempts"], 1);
    assert_eq!(fatal["payload"]["status"], 400);
    assert_eq!(upstream.count(&ids[1]), 1, "a 400 is not retried");
    println!("500 then 200: retried after {gap:?}; 400: one Failed result, one request");

    // Breaker: three 503s open it; the fourth command fails without a request.
    let mut flaky_ids = Vec::new();
    for n in 0..3 {
        let c = command("flaky", 100 + n);
        flaky_ids.extend(publish_commands(&js, std::slice::from_ref(&c)).await);
        settle_results(&js, 3 + n as usize, Duration::from_secs(30)).await;
    }
    assert_eq!(
        metric(
            &worker.admin,
            "runner_effect_circuit_state{effect=\"flaky\"}"
        )
        .await,
        1.0
    );
    let before = upstream
        .hits()
        .iter()
        .filter(|h| h.path == "/flaky")
        .count();
    assert_eq!(before, 3);
    let c = command("flaky", 200);
    let open_id = publish_commands(&js, std::slice::from_ref(&c))
        .await
        .remove(0);
    let seen = settle_results(&js, 6, Duration::from_secs(30)).await;
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
        upstream.count(&open_id),
        0,
        "an open circuit sends nothing upstream"
    );
    // Recovery: after open_ms a probe goes out, succeeds and closes the circuit.
    healthy.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(6100)).await;
    let c = command("flaky", 300);
    let probe_id = publish_commands(&js, std::slice::from_ref(&c))
        .await
        .remove(0);
    let seen = settle_results(&js, 7, Duration::from_secs(30)).await;
    assert_eq!(
        one_per_command(&seen)[&probe_id]["result_type"],
        "Succeeded"
    );
    assert_eq!(
        metric(
            &worker.admin,
            "runner_effect_circuit_state{effect=\"flaky\"}"
        )
        .await,
        0.0
    );
    let all: HashSet<_> = seen
        .iter()
        .map(|s| s.body["command_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(all.len(), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_done_command_republishes_without_executing() {
    let nats = NatsServer::start();
    let upstream = Upstream::start(Arc::new(|_, _, _| Reply::ok(json!({})))).await;
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path(), &upstream.base);
    let worker = effect_runner(&nats.url(), &m);
    let js = jetstream(&nats.url()).await;
    let (subject, body) = command("charge", 5);
    let id = publish_commands(&js, &[(subject.clone(), body.clone())])
        .await
        .remove(0);
    settle_results(&js, 1, Duration::from_secs(30)).await;
    // The same command again, under a new stream sequence (no Nats-Msg-Id de-duplication).
    js.publish(subject, serde_json::to_vec(&body).unwrap().into())
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            metric(
                &worker.admin,
                "runner_effect_claims_total{event=\"replayed\"}",
            )
            .await
                == 1.0
        })
        .await
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(upstream.count(&id), 1, "executed once");
    assert_eq!(
        results(&js).await.len(),
        1,
        "the republished result was de-duplicated"
    );
}
