//! Effect worker behaviours beyond the happy path: per-attempt timeouts, `Retry-After`,
//! calls longer than the ack wait, the NATS request/reply provider, and the drain.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::effects::{command, metric, one_per_command, publish_commands, settle_results};
use common::upstream::{Reply, Upstream};
use common::{NatsServer, RunnerProc, jetstream};
use futures::StreamExt;
use serde_json::json;

fn manifest(dir: &Path, base: &str) -> PathBuf {
    let path = dir.join("effects.yaml");
    let text = format!(
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
    timeout_ms: 30000
  - name: patient
    provider: http
    settings: {{ url: "{base}/patient" }}
    retry: {{ retry_limit: 5, base_backoff: 3000, max_backoff: 30000, enable_jitter: false }}
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
      subject: "svc.echo.${{ saga.tenant }}"
      body: {{ question: "${{ event.payload.n }}" }}
    timeout_ms: 2000
"#
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn worker(url: &str, m: &Path) -> RunnerProc {
    RunnerProc::start(
        &[
            "--mode",
            "effect",
            "--nats-url",
            url,
            "--manifest",
            m.to_str().unwrap(),
        ],
        &[
            ("RUNNER__EFFECT__LEASE_TTL", "1500ms"),
            ("RUNNER__EFFECT__ACK_WAIT", "2s"),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_retry_after_long_calls_and_nats_request() {
    let nats = NatsServer::start();
    let upstream = Upstream::start(Arc::new(|path, _, nth| match path {
        "/slow" => Reply::ok(json!({})).after(Duration::from_secs(1)),
        "/limited" if nth == 1 => {
            let mut r = Reply::status(429);
            r.retry_after = Some(1);
            r
        }
        "/limited" => Reply::ok(json!({"finally": true})),
        "/long" => Reply::ok(json!({"took": 5})).after(Duration::from_secs(5)),
        "/picky" => Reply::ok(json!({"ok": false})),
        _ => Reply::status(404),
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path(), &upstream.base);
    let w = worker(&nats.url(), &m);
    let js = jetstream(&nats.url()).await;
    // A service answering on the request subject.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut sub = client.subscribe("svc.echo._").await.unwrap();
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

    let ids = publish_commands(
        &js,
        &[
            command("slow", 1),
            command("limited", 2),
            command("long", 3),
            command("ask", 4),
            command("picky", 5),
        ],
    )
    .await;
    let seen = settle_results(&js, 5, Duration::from_secs(60)).await;
    let by = one_per_command(&seen);

    let slow = &by[&ids[0]];
    assert_eq!(slow["result_type"], "TimedOut", "{slow}");
    assert_eq!(slow["attempts"], 2);

    let limited = &by[&ids[1]];
    assert_eq!(limited["result_type"], "Succeeded");
    assert_eq!(limited["payload"]["finally"], true);
    let hits: Vec<_> = upstream
        .hits()
        .into_iter()
        .filter(|h| h.path == "/limited")
        .collect();
    let gap = hits[1].at - hits[0].at;
    assert!(
        gap >= Duration::from_millis(990),
        "Retry-After: 1 honoured, waited {gap:?}"
    );

    let long = &by[&ids[2]];
    assert_eq!(long["result_type"], "Succeeded");
    assert_eq!(long["payload"], json!({"status": 200, "took": 5}));
    assert_eq!(
        upstream.count(&ids[2]),
        1,
        "a call longer than the ack wait ran once"
    );
    assert_eq!(
        metric(&w.admin, "runner_effect_claims_total{event=\"busy\"}").await,
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
        upstream.count(&ids[4]),
        1,
        "a 200 failing success_when is fatal, not retried"
    );
    println!("429 + Retry-After: 1 → retried after {gap:?}; 300 ms timeout ×2 → TimedOut");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_finishes_the_call_in_flight() {
    let nats = NatsServer::start();
    let upstream = Upstream::start(Arc::new(|_, _, _| {
        Reply::ok(json!({"took": 2})).after(Duration::from_secs(2))
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path(), &upstream.base);
    let mut w = worker(&nats.url(), &m);
    let js = jetstream(&nats.url()).await;
    let id = publish_commands(&js, &[command("long", 1)]).await.remove(0);
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            upstream.count(&id) == 1
        })
        .await
    );
    w.signal("TERM");
    assert_eq!(w.wait_exit(Duration::from_secs(30)), Some(0));
    let seen = settle_results(&js, 1, Duration::from_secs(5)).await;
    assert_eq!(one_per_command(&seen)[&id]["payload"]["took"], 2);
    assert_eq!(one_per_command(&seen)[&id]["result_type"], "Succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_commands_are_dead_lettered_and_never_run() {
    let nats = NatsServer::start();
    let upstream = Upstream::start(Arc::new(|_, _, _| Reply::ok(json!({})))).await;
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path(), &upstream.base);
    let w = worker(&nats.url(), &m);
    let js = jetstream(&nats.url()).await;
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
        &js,
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
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(upstream.hits().is_empty(), "nothing reached the upstream");
    assert!(common::effects::results(&js).await.is_empty());
    assert_eq!(
        metric(
            &w.admin,
            "runner_effect_commands_total{outcome=\"refused\"}"
        )
        .await,
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_mid_run_loses_and_doubles_no_result() {
    const N: u64 = 200;
    let mut nats = NatsServer::start();
    let upstream = Upstream::start(Arc::new(|_, _, _| {
        Reply::ok(json!({"took": 0})).after(Duration::from_millis(20))
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path(), &upstream.base);
    let w = worker(&nats.url(), &m);
    let js = jetstream(&nats.url()).await;
    let cmds: Vec<_> = (0..N).map(|n| command("long", n)).collect();
    let ids = publish_commands(&js, &cmds).await;
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            upstream.hits().len() >= 20
        })
        .await
    );
    nats.restart();
    let js = jetstream(&nats.url()).await;
    let seen = settle_results(&js, N as usize, Duration::from_secs(120)).await;
    let by = one_per_command(&seen);
    assert_eq!(by.len(), N as usize, "one result per command");
    for id in &ids {
        assert_eq!(by[id]["result_type"], "Succeeded");
        assert!(upstream.count(id) >= 1);
    }
    let repeats = upstream.per_key().values().filter(|n| **n > 1).count();
    println!(
        "NATS restart mid-run: {N} results, {repeats} keys called more than once (at least once)"
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
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let smtp = SmtpServer::start(dir.path());
    let m = dir.path().join("mail.yaml");
    std::fs::write(
        &m,
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
        ),
    )
    .unwrap();
    let _w = worker(&nats.url(), &m);
    let js = jetstream(&nats.url()).await;
    let id = publish_commands(&js, &[command("mail", 42)])
        .await
        .remove(0);
    let seen = settle_results(&js, 1, Duration::from_secs(30)).await;
    let r = &one_per_command(&seen)[&id];
    assert_eq!(r["result_type"], "Succeeded", "{r}");
    assert_eq!(r["payload"]["code"], "250");
    assert!(
        common::eventually(Duration::from_secs(5), || async {
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

/// A throw-away PostgreSQL server (Debian's postgresql) on a free port, run as the
/// `postgres` user when the test runs as root (PostgreSQL refuses root).
struct PgServer {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl PgServer {
    fn start() -> Self {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .ok()
            .and_then(|d| d.filter_map(Result::ok).map(|e| e.path().join("bin")).max())
            .filter(|p| p.join("initdb").exists())
            .expect("PostgreSQL not found: install Debian's postgresql (scripts/setup-deps does)");
        let dir = tempfile::tempdir().unwrap();
        let root = running_as_root();
        let run = |prog: &Path, args: &[&str]| {
            let mut c = if root {
                let mut c = std::process::Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(prog);
                c
            } else {
                std::process::Command::new(prog)
            };
            c.args(args);
            c
        };
        if root {
            std::process::Command::new("chown")
                .args(["-R", "postgres"])
                .arg(dir.path())
                .status()
                .unwrap();
        }
        let data = dir.path().join("data");
        let st = run(
            &bin.join("initdb"),
            &[
                "-D",
                data.to_str().unwrap(),
                "-A",
                "trust",
                "-U",
                "postgres",
            ],
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
        assert!(st.success(), "initdb failed");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = run(
            &bin.join("postgres"),
            &[
                "-D",
                data.to_str().unwrap(),
                "-p",
                &port.to_string(),
                "-k",
                dir.path().to_str().unwrap(),
                "-c",
                "listen_addresses=127.0.0.1",
            ],
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "postgres did not listen"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Self {
            child,
            port,
            _dir: dir,
        }
    }
    fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }
}

fn running_as_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_effect_runs_one_parameterised_statement() {
    let nats = NatsServer::start();
    let pg = PgServer::start();
    let (client, conn) = loop {
        // The server may still be starting up after it opened its port.
        match tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls).await {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    tokio::spawn(conn);
    client
        .batch_execute("CREATE TABLE charges (command_id text PRIMARY KEY, amount int, meta jsonb)")
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("pg.yaml");
    std::fs::write(
        &m,
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
"#,
    )
    .unwrap();
    let dsn = pg.url();
    let _w = RunnerProc::start(
        &[
            "--mode",
            "effect",
            "--nats-url",
            &nats.url(),
            "--manifest",
            m.to_str().unwrap(),
        ],
        &[("TEST_PG_DSN", dsn.as_str())],
    );
    let js = jetstream(&nats.url()).await;
    let ids = publish_commands(&js, &[command("record", 42), command("broken", 1)]).await;
    let seen = settle_results(&js, 2, Duration::from_secs(30)).await;
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
    let nats = NatsServer::start();
    let healthy = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let h = healthy.clone();
    let upstream = Upstream::start(Arc::new(move |_, _, _| {
        if h.load(std::sync::atomic::Ordering::SeqCst) {
            Reply::ok(json!({"took": 1}))
        } else {
            Reply::status(503)
        }
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(dir.path(), &upstream.base);
    let mut first = worker(&nats.url(), &m);
    let js = jetstream(&nats.url()).await;
    let id = publish_commands(&js, &[command("patient", 1)])
        .await
        .remove(0);
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            upstream.count(&id) == 1
        })
        .await
    );
    // The first worker now waits 6 s before its retry; the drain must not wait for it.
    let second = worker(&nats.url(), &m);
    healthy.store(true, std::sync::atomic::Ordering::SeqCst);
    let t = std::time::Instant::now();
    first.signal("TERM");
    assert_eq!(first.wait_exit(Duration::from_secs(30)), Some(0));
    let drained = t.elapsed();
    assert!(drained < Duration::from_secs(4), "drain took {drained:?}");
    let seen = settle_results(&js, 1, Duration::from_secs(30)).await;
    let r = &one_per_command(&seen)[&id];
    assert_eq!(r["result_type"], "Succeeded", "{r}");
    assert_eq!(r["attempts"], 1, "the second worker's first call");
    assert_eq!(upstream.count(&id), 2);
    assert_eq!(
        metric(&second.admin, "runner_effect_claims_total{event=\"steal\"}").await,
        1.0
    );
    println!(
        "drain during a 6 s backoff: exited after {drained:?}, result {:?} after the signal",
        t.elapsed()
    );
}
