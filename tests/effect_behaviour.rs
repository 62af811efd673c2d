//! Effect worker behaviours beyond the happy path: per-attempt timeouts, `Retry-After`,
//! calls longer than the ack wait, the NATS request/reply provider, and the drain.
//!
//! Where a test needs a call to be in flight when something happens (a drain, an outage),
//! the upstream holds the call until the test releases it, and the test checks that it was
//! in flight before acting.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::RunnerProc;
use common::effects::{EffectBed, command, one_per_command, wait_quiescent};
use common::metrics::{metric, metric_or_zero, wait_metric};
use common::postgres::PgServer;
use common::upstream::{Latch, Reply, Script};
use futures::StreamExt;
use serde_json::json;

/// The test effects against `base`. `patient` backs off for an hour before its retry, so
/// only a hand-back lets anyone else finish it.
fn manifest(base: &str) -> String {
    format!(
        r#"format: 1
effects:
  - name: slow
    provider: http
    settings: {{ url: "{base}/slow" }}
    timeout_ms: 300
    retry: {{ retry_limit: 1, base_backoff: 10, enable_jitter: false }}
  - name: limited
    provider: http
    settings: {{ url: "{base}/limited" }}
    retry: {{ retry_limit: 2, base_backoff: 10, enable_jitter: false }}
  - name: long
    provider: http
    settings:
      url: "{base}/long"
      result: "${{ {{'status': state.status, 'took': state.body.took}} }}"
    timeout_ms: 600000
  - name: patient
    provider: http
    settings: {{ url: "{base}/patient" }}
    retry: {{ retry_limit: 5, base_backoff: 1800000, max_backoff: 3600000, enable_jitter: false }}
  - name: picky
    provider: http
    settings:
      url: "{base}/picky"
      method: PUT
      success_when: "state.body.ok == true"
    retry: {{ retry_limit: 3, base_backoff: 10 }}
  - name: ask
    provider: nats_request
    settings:
      subject: "tenant.${{ saga.tenant }}.svc.echo"
      body: {{ question: "${{ event.payload.n }}" }}
    timeout_ms: 2000
"#
    )
}

/// Short leases and ack waits, so a call outlives several of each.
const ENVS: &[(&str, &str)] = &[
    ("RUNNER__EFFECT__LEASE_TTL", "1500ms"),
    ("RUNNER__EFFECT__ACK_WAIT", "2s"),
];

async fn bed(script: Script) -> EffectBed {
    EffectBed::start(script, manifest).await
}

fn worker(bed: &EffectBed) -> RunnerProc {
    bed.runner(ENVS)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_retry_after_long_calls_and_nats_request() {
    // `/slow` never answers: its 300 ms timeout fires first on any machine.
    let never = Latch::new();
    let bed = bed(Arc::new(move |path, _, nth| match path {
        "/slow" => Reply::ok(json!({})).until(&never),
        "/limited" if nth == 1 => {
            let mut r = Reply::status(429);
            r.retry_after = Some(1);
            r
        }
        "/limited" => Reply::ok(json!({"finally": true})),
        // Longer than the 2 s ack wait: a lower bound, which a slower machine only extends.
        "/long" => Reply::ok(json!({"took": 5})).after(Duration::from_secs(5)),
        "/picky" => Reply::ok(json!({"ok": false})),
        _ => Reply::status(404),
    }))
    .await;
    let w = worker(&bed);
    // A service answering on the request subject.
    let client = async_nats::connect(bed.nats.url()).await.unwrap();
    let mut sub = client.subscribe("tenant._.svc.echo").await.unwrap();
    client.flush().await.unwrap();
    let responder = client.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            let q: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
            let key = m
                .headers
                .as_ref()
                .and_then(|h| h.get("Idempotency-Key"))
                .map(|v| v.as_str().to_string());
            let body = json!({ "answer": q["question"], "key": key });
            if let Some(reply) = m.reply {
                responder
                    .publish(reply, serde_json::to_vec(&body).unwrap().into())
                    .await
                    .unwrap();
            }
        }
    });

    let ids = bed
        .publish(&[
            command("slow", 1),
            command("limited", 2),
            command("long", 3),
            command("ask", 4),
            command("picky", 5),
        ])
        .await;
    let seen = bed.settle(5, Duration::from_secs(60)).await;
    let by = one_per_command(&seen);

    let slow = &by[&ids[0]];
    assert_eq!(slow["result_type"], "TimedOut", "{slow}");
    assert_eq!(slow["attempts"], 2);

    let limited = &by[&ids[1]];
    assert_eq!(limited["result_type"], "Succeeded");
    assert_eq!(limited["payload"]["finally"], true);
    let hits: Vec<_> = bed
        .upstream
        .hits()
        .into_iter()
        .filter(|h| h.path == "/limited")
        .collect();
    let gap = hits[1].at - hits[0].at;
    // A lower bound: a slower machine only waits longer.
    assert!(
        gap >= Duration::from_millis(990),
        "Retry-After: 1 honoured, waited {gap:?}"
    );

    let long = &by[&ids[2]];
    assert_eq!(long["result_type"], "Succeeded");
    assert_eq!(long["payload"], json!({"status": 200, "took": 5}));
    assert_eq!(
        bed.upstream.count(&ids[2]),
        1,
        "a call longer than the ack wait ran once"
    );
    assert_eq!(
        metric_or_zero(&w.admin, "runner_effect_claims_total{event=\"busy\"}").await,
        0.0,
        "progress acks kept the long command from being redelivered"
    );
    assert!(metric(&w.admin, "runner_effect_claims_total{event=\"renewed\"}").await >= 3.0);

    let ask = &by[&ids[3]];
    assert_eq!(ask["result_type"], "Succeeded", "{ask}");
    assert_eq!(ask["payload"]["answer"], 4);
    assert_eq!(ask["payload"]["key"], json!(ids[3]));
    let picky = &by[&ids[4]];
    assert_eq!(picky["result_type"], "Failed", "{picky}");
    assert_eq!(picky["payload"]["body"]["ok"], false);
    assert_eq!(
        bed.upstream.count(&ids[4]),
        1,
        "a 200 failing success_when is fatal, not retried"
    );
    println!("429 + Retry-After: 1 → retried after {gap:?}; 300 ms timeout ×2 → TimedOut");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_finishes_the_call_in_flight() {
    let release = Latch::new();
    let hold = release.clone();
    let bed = bed(Arc::new(move |_, _, _| {
        Reply::ok(json!({"took": "held"})).until(&hold)
    }))
    .await;
    let mut w = worker(&bed);
    let id = bed.publish(&[command("long", 1)]).await.remove(0);
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            bed.upstream.count(&id) == 1
        })
        .await
    );
    w.signal("TERM");
    // The drain has begun (the admin server outlives it) while the call is still held.
    wait_metric(
        &w.admin,
        "runner_draining",
        |v| v == 1.0,
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(
        bed.upstream.in_flight(),
        1,
        "the call was in flight when the drain began"
    );
    assert!(bed.results().await.is_empty(), "and had no result yet");
    release.release();
    assert_eq!(w.wait_exit(Duration::from_secs(30)), Some(0));
    let seen = bed.settle(1, Duration::from_secs(30)).await;
    let r = &one_per_command(&seen)[&id];
    assert_eq!(r["payload"]["took"], "held");
    assert_eq!(r["result_type"], "Succeeded");
    assert_eq!(
        bed.upstream.count(&id),
        1,
        "finished, not abandoned and redone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_commands_are_dead_lettered_and_never_run() {
    let bed = bed(Arc::new(|_, _, _| Reply::ok(json!({})))).await;
    let w = worker(&bed);
    let js = &bed.js;
    js.publish("tenant._.effect.limited.x-1", "not json".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let (_, body) = command("limited", 1);
    let id = body["command_id"].as_str().unwrap().to_string();
    js.publish(
        format!("tenant.acme.effect.limited.{id}"),
        serde_json::to_vec(&body).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let dls = common::wait_for_messages(
        js,
        "RUNNER_DLQ",
        "tenant.*.deadletter.*",
        2,
        Duration::from_secs(20),
    )
    .await;
    let mut kinds: Vec<_> = dls
        .iter()
        .map(|d| {
            (
                d.subject.clone(),
                d.body["kind"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        vec![
            (
                "tenant._.deadletter.undecodable".to_string(),
                "undecodable".to_string()
            ),
            (
                "tenant.acme.deadletter.tenant_mismatch".to_string(),
                "tenant_mismatch".to_string()
            ),
        ]
    );
    wait_metric(
        &w.admin,
        "runner_effect_commands_total{outcome=\"refused\"}",
        |v| v == 2.0,
        Duration::from_secs(20),
    )
    .await;
    // Operators see them through the node: `runner dlq list --stream`, newest first, and a
    // tenant's listing only that tenant's.
    let list = |extra: &[&str]| {
        let mut argv = vec![
            "dlq",
            "list",
            "--stream",
            "--output",
            "json",
            "--admin",
            w.admin.as_str(),
        ];
        argv.extend_from_slice(extra);
        let (code, out) = common::run_to_exit(&argv, &[], Duration::from_secs(30));
        assert_eq!(code, Some(0), "{out}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let all = list(&[]);
    let items = all["items"].as_array().unwrap();
    let mut kinds: Vec<&str> = items
        .iter()
        .map(|i| i["letter"]["kind"].as_str().unwrap())
        .collect();
    kinds.sort_unstable();
    assert_eq!(kinds, ["tenant_mismatch", "undecodable"], "{all}");
    assert!(
        items[0]["seq"].as_u64() > items[1]["seq"].as_u64(),
        "newest first: {all}"
    );
    let acme = list(&["--tenant", "acme"]);
    assert_eq!(acme["items"].as_array().unwrap().len(), 1, "{acme}");
    assert_eq!(
        acme["items"][0]["letter"]["subject"],
        format!("tenant.acme.effect.limited.{id}")
    );
    let (code, out) =
        common::run_to_exit(&["dlq", "list", "--stream"], &[], Duration::from_secs(30));
    assert_eq!(code, Some(1));
    assert!(out.contains("add --admin URL"), "{out}");
    // Both were terminated: the consumer holds nothing that could still run.
    wait_quiescent(js, Duration::from_secs(20)).await;
    assert!(
        bed.upstream.hits().is_empty(),
        "nothing reached the upstream"
    );
    assert!(bed.results().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_mid_run_loses_and_doubles_no_result() {
    const N: u64 = 200;
    /// Calls answered at once; every later one is held until the server is down.
    const FIRST: usize = 50;
    let release = Latch::new();
    let hold = release.clone();
    let calls = Arc::new(AtomicUsize::new(0));
    let seen_calls = calls.clone();
    let mut bed = bed(Arc::new(move |_, _, _| {
        let r = Reply::ok(json!({"took": 0}));
        if seen_calls.fetch_add(1, Ordering::SeqCst) < FIRST {
            r
        } else {
            r.until(&hold)
        }
    }))
    .await;
    let w = worker(&bed);
    let cmds: Vec<_> = (0..N).map(|n| command("long", n)).collect();
    let ids = bed.publish(&cmds).await;
    // Mid-run: some results out, and calls in flight.
    assert!(
        common::eventually(Duration::from_secs(60), || async {
            bed.upstream.in_flight() >= 10 && bed.results().await.len() >= 10
        })
        .await,
        "the run did not reach mid-way: {} in flight, {} results",
        bed.upstream.in_flight(),
        bed.results().await.len()
    );
    let before = bed.results().await.len();
    let in_flight = bed.upstream.in_flight();
    assert!(before < N as usize);
    // The server goes away with those calls in flight; they are answered while it is down.
    bed.nats.stop();
    release.release();
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            bed.upstream.in_flight() == 0
        })
        .await
    );
    bed.nats.start_again();
    bed.reconnect().await;
    let seen = bed.settle(N as usize, Duration::from_secs(120)).await;
    let by = one_per_command(&seen);
    assert_eq!(by.len(), N as usize, "one result per command");
    for id in &ids {
        assert_eq!(by[id]["result_type"], "Succeeded");
        assert!(bed.upstream.count(id) >= 1);
    }
    let repeats = bed.upstream.per_key().values().filter(|n| **n > 1).count();
    println!(
        "NATS down with {in_flight} calls in flight and {before}/{N} results out: {N} results after, {repeats} keys called more than once (at least once)"
    );
    drop(w);
}

/// A local SMTP server (Debian's python3-aiosmtpd) printing what it receives to `out`.
struct SmtpServer {
    child: std::process::Child,
    port: u16,
    out: PathBuf,
}

impl SmtpServer {
    fn start(dir: &Path) -> Self {
        // Debian's package installs for Debian's interpreter, which may not be first on PATH.
        let python = if Path::new("/usr/bin/python3").exists() {
            "/usr/bin/python3"
        } else {
            "python3"
        };
        let ok = std::process::Command::new(python)
            .args(["-c", "import aiosmtpd"])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(
            ok,
            "python3 aiosmtpd not found: install Debian's python3-aiosmtpd (scripts/setup-deps does)"
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let out = dir.join("smtp.out");
        let child = std::process::Command::new(python)
            .args(["-m", "aiosmtpd", "-n", "-l", &format!("127.0.0.1:{port}")])
            .env("PYTHONUNBUFFERED", "1")
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "aiosmtpd did not listen"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Self { child, port, out }
    }
    fn received(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }
}

impl Drop for SmtpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smtp_effect_sends_one_mail_to_a_real_server() {
    let dir = tempfile::tempdir().unwrap();
    let smtp = SmtpServer::start(dir.path());
    // No HTTP upstream is called here; the bed's answers 404 to anything.
    let bed = EffectBed::start(Arc::new(|_, _, _| Reply::status(404)), |_| {
        format!(
            r#"format: 1
effects:
  - name: mail
    provider: smtp
    settings:
      host: 127.0.0.1
      port: {}
      tls: none
      from: "Runner <runner@example.com>"
      to: ["ops@example.com"]
      subject: "Order ${{ event.metadata.correlation_id }}"
      body: "Amount ${{ event.payload.n }}"
    timeout_ms: 5000
"#,
            smtp.port
        )
    })
    .await;
    let _w = worker(&bed);
    let id = bed.publish_one(command("mail", 42)).await;
    let seen = bed.settle(1, Duration::from_secs(30)).await;
    let r = &one_per_command(&seen)[&id];
    assert_eq!(r["result_type"], "Succeeded", "{r}");
    assert_eq!(r["payload"]["code"], "250");
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            smtp.received().contains(&format!("<{id}@runner>"))
        })
        .await,
        "server got: {}",
        smtp.received()
    );
    let got = smtp.received();
    assert!(got.contains("Subject: Order c-42"), "{got}");
    assert!(got.contains("Amount 42"), "{got}");
    assert_eq!(got.matches("MESSAGE FOLLOWS").count(), 1, "one mail: {got}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_effect_runs_one_parameterised_statement() {
    let pg = PgServer::start();
    let client = pg.client().await;
    client
        .batch_execute("CREATE TABLE charges (command_id text PRIMARY KEY, amount int, meta jsonb)")
        .await
        .unwrap();
    // No HTTP upstream is called here; the bed's answers 404 to anything.
    let bed = EffectBed::start(Arc::new(|_, _, _| Reply::status(404)), |_| {
        r#"format: 1
effects:
  - name: record
    provider: postgres
    settings:
      url: "${ saga.secrets.dsn }"
      secrets: { dsn: { env: TEST_PG_DSN } }
      statement: "INSERT INTO charges VALUES ($1, $2, $3) ON CONFLICT (command_id) DO NOTHING"
      params: ["${ event.command_id }", "${ event.payload.n }", "${ event.metadata }"]
    timeout_ms: 5000
  - name: broken
    provider: postgres
    settings:
      url: "${ saga.secrets.dsn }"
      secrets: { dsn: { env: TEST_PG_DSN } }
      statement: "INSERT INTO nowhere VALUES ($1)"
      params: ["${ event.command_id }"]
    retry: { retry_limit: 3, base_backoff: 10 }
"#
        .to_string()
    })
    .await;
    let dsn = pg.url();
    let _w = bed.runner(&[("TEST_PG_DSN", dsn.as_str())]);
    let ids = bed
        .publish(&[command("record", 42), command("broken", 1)])
        .await;
    let seen = bed.settle(2, Duration::from_secs(30)).await;
    let by = one_per_command(&seen);
    assert_eq!(by[&ids[0]]["result_type"], "Succeeded", "{}", by[&ids[0]]);
    assert_eq!(by[&ids[0]]["payload"]["rows"], 1);
    let rows = client
        .query("SELECT command_id, amount, meta FROM charges", &[])
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].get::<_, String>(0), ids[0]);
    assert_eq!(rows[0].get::<_, i32>(1), 42);
    assert_eq!(rows[0].get::<_, serde_json::Value>(2)["saga"], "test");
    let broken = &by[&ids[1]];
    assert_eq!(broken["result_type"], "Failed", "{broken}");
    assert_eq!(broken["attempts"], 1, "an undefined table is fatal");
    assert_eq!(broken["payload"]["sqlstate"], "42P01");
    assert!(
        !broken.to_string().contains("port="),
        "no connection string in errors"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_hands_back_a_command_waiting_between_retries() {
    let healthy = Arc::new(AtomicBool::new(false));
    let h = healthy.clone();
    let bed = bed(Arc::new(move |_, _, _| {
        if h.load(Ordering::SeqCst) {
            Reply::ok(json!({"took": 1}))
        } else {
            Reply::status(503)
        }
    }))
    .await;
    let mut first = worker(&bed);
    let id = bed.publish_one(command("patient", 1)).await;
    // The first attempt failed and was counted: the first worker now waits an hour before
    // its retry, renewing its lease meanwhile, so nobody else can take the command.
    wait_metric(
        &first.admin,
        "runner_effect_attempts_total{effect=\"patient\",outcome=\"retryable\"}",
        |v| v == 1.0,
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(bed.upstream.count(&id), 1);
    assert_eq!(
        bed.upstream.in_flight(),
        0,
        "between attempts, not in a call"
    );
    assert!(bed.results().await.is_empty(), "and not finished");
    let second = worker(&bed);
    healthy.store(true, Ordering::SeqCst);
    first.signal("TERM");
    // Had the drain waited out the backoff, the process would still be running an hour
    // from now (or exit 1 at `runner.drain_timeout`); it drains and exits 0 instead.
    assert_eq!(first.wait_exit(Duration::from_secs(60)), Some(0));
    first.wait_for_log(
        "Draining: command handed back between retries.",
        Duration::from_secs(10),
    );
    assert!(
        first
            .log
            .iter()
            .any(|l| l.contains("handed back") && l.contains("\"released\":true")),
        "the lease was released by CAS"
    );
    // The second worker took it over from the released claim and finished it with one call.
    let seen = bed.settle(1, Duration::from_secs(30)).await;
    let r = &one_per_command(&seen)[&id];
    assert_eq!(r["result_type"], "Succeeded", "{r}");
    assert_eq!(r["attempts"], 1, "the second worker's first call");
    assert_eq!(bed.upstream.count(&id), 2, "the first worker did not retry");
    assert_eq!(
        metric(&second.admin, "runner_effect_claims_total{event=\"steal\"}").await,
        1.0
    );
    assert_eq!(
        metric(
            &second.admin,
            "runner_effect_claims_total{event=\"completed\"}"
        )
        .await,
        1.0
    );
}
