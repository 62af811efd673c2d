//! The monitoring files against the real tools: `promtool check rules` and `promtool test
//! rules` on `deploy/prometheus/alerts.yml` (unit tests for every alert), and every PromQL
//! expression of the Grafana dashboard `deploy/grafana/runner.json`, and every metric the
//! alerts name, run against a real Prometheus scraping a live `runner` (combined mode,
//! partitioned, with a saga that runs an effect, fires a timer and dead-letters a poison
//! input) — each must return at least one series, so no panel or alert names a metric
//! Runner does not export. And a node that has seen no traffic already has a series (at
//! zero) for each of those metrics but the snapshot age.
//!
//! Prometheus and promtool come from Debian's `prometheus` package (`scripts/setup-deps
//! --test` installs it); their absence fails the test.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{NatsServer, RunnerProc, aggregate_event, jetstream, publish_json};
use serde_json::{Value as Json, json};

fn deploy(path: &str) -> PathBuf {
    common::repo_root().join("deploy").join(path)
}

/// Finds a tool of the `prometheus` package or fails saying how to get it.
fn tool(name: &str) -> PathBuf {
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        let p = Path::new(dir).join(name);
        if p.is_file() {
            return p;
        }
    }
    panic!("`{name}` not found: install Debian's `prometheus` package (scripts/setup-deps --test)");
}

#[test]
fn alert_rules_are_valid_and_their_unit_tests_pass() {
    let promtool = tool("promtool");
    let dir = deploy("prometheus");
    for args in [
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts.test.yml"],
    ] {
        let out = Command::new(&promtool)
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "promtool {args:?}:\n{text}");
        assert!(text.contains("SUCCESS"), "promtool {args:?}:\n{text}");
    }
    // Every alert has a unit test that names it.
    let rules = std::fs::read_to_string(dir.join("alerts.yml")).unwrap();
    let tests = std::fs::read_to_string(dir.join("alerts.test.yml")).unwrap();
    for line in rules.lines() {
        if let Some(name) = line.trim().strip_prefix("- alert: ") {
            assert!(
                tests.contains(&format!("alertname: {name}\n")),
                "alert {name} has no unit test"
            );
        }
    }
}

/// A saga with a noop effect and a one-second timer.
const MANIFEST: &str = r#"format: 1
effects:
  - { name: ping, provider: noop, circuit_breaker: { failure_threshold: 5, open_ms: 10000 } }
sagas:
  - name: watch
    version: 1
    triggers:
      - { subject: aggregate.Thing.*, correlation: event.aggregate_id, start: true }
      - { subject: effect_result.ping.*, correlation: event.metadata.correlation_id }
    initial_state: new
    states:
      new:
        on:
          Made:
            emit: [{ effect: { name: ping, payload: {} } }]
            timers: [{ name: soon, delay_ms: 1000 }]
            goto: waiting
      waiting:
        on:
          ping.Succeeded: {}
          timer.soon: { goto: done }
      done: { terminal: true }
"#;

struct Prometheus {
    child: Child,
    base: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (host:port) every second.
    fn start(targets: &[String]) -> Self {
        let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let target = targets.join(", ");
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("prometheus.yml");
        std::fs::write(
            &conf,
            format!(
                "global: {{ scrape_interval: 1s, evaluation_interval: 1s }}\nscrape_configs:\n  - job_name: runner\n    static_configs: [{{ targets: [{target}] }}]\n"
            ),
        )
        .unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(tool("prometheus"))
            .arg(format!("--config.file={}", conf.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        }
    }

    async fn query(&self, q: &str) -> Result<Vec<Json>, String> {
        let r = reqwest::Client::new()
            .get(format!("{}/api/v1/query", self.base))
            .query(&[("query", q)])
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let body: Json = r.json().await.map_err(|e| e.to_string())?;
        if body["status"] != "success" {
            return Err(body.to_string());
        }
        Ok(body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }
}

/// Every `expr` of the dashboard, with its variables filled in.
fn dashboard_exprs() -> Vec<(String, String)> {
    let dash: Json =
        serde_json::from_str(&std::fs::read_to_string(deploy("grafana/runner.json")).unwrap())
            .unwrap();
    let mut out = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"]
                .as_str()
                .unwrap()
                .replace("$instance", ".+")
                .replace("$__rate_interval", "30s");
            out.push((p["title"].as_str().unwrap().to_string(), expr));
        }
    }
    out
}

/// The metric names the alert rules use.
fn alert_metrics() -> BTreeSet<String> {
    let rules = std::fs::read_to_string(deploy("prometheus/alerts.yml")).unwrap();
    let mut names = BTreeSet::new();
    for (i, _) in rules.match_indices("runner_") {
        let name: String = rules[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        names.insert(name);
    }
    names
}

/// Publishes eight starts and one poison input; returns once every instance has ended
/// (through its timer).
async fn drive(nats: &NatsServer) {
    let js = jetstream(&nats.url()).await;
    let now = runner::clock::now_ms();
    for i in 0..8 {
        let ev = aggregate_event(
            "acme",
            "Thing",
            &format!("t-{i}"),
            "Made",
            now + i,
            json!({}),
        );
        publish_json(&js, &format!("tenant.acme.aggregate.Thing.t-{i}"), &ev).await;
    }
    js.publish("tenant.acme.aggregate.Thing.bad", "not json".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let ended = common::wait_for_messages(
        &js,
        "WORKFLOW_EVENTS",
        "tenant.acme.workflow_event.watch.*",
        8,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(ended.len(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_and_alert_metric_has_series_from_a_live_runner() {
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(manifests.path().join("watch.yaml"), MANIFEST).unwrap();
    let mdir = manifests.path().to_str().unwrap().to_string();
    // Two combined nodes, each on its own nats-server: one tuned so partitions, leases and
    // snapshots move within the test's time, one with the defaults.
    let nats_a = NatsServer::start();
    let tuned = RunnerProc::start(
        &[
            "--mode",
            "combined",
            "--nats-url",
            &nats_a.url(),
            "--manifest",
            &mdir,
        ],
        &[
            ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
            ("RUNNER__PARTITIONS__COUNT", "4"),
            ("RUNNER__PARTITIONS__LEASE_TTL", "3s"),
            ("RUNNER__PARTITIONS__SNAPSHOT_INTERVAL", "2s"),
        ],
    );
    let nats_b = NatsServer::start();
    let default = RunnerProc::start(
        &[
            "--mode",
            "combined",
            "--nats-url",
            &nats_b.url(),
            "--manifest",
            &mdir,
        ],
        &[("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync")],
    );
    let targets: Vec<String> = [&tuned, &default]
        .iter()
        .map(|r| r.admin.trim_start_matches("http://").to_string())
        .collect();
    let prom = Prometheus::start(&targets);
    drive(&nats_a).await;
    drive(&nats_b).await;

    let exprs = dashboard_exprs();
    assert!(exprs.len() >= 25, "{} dashboard queries", exprs.len());
    let metrics = alert_metrics();
    assert!(metrics.len() >= 10, "{metrics:?}");
    let mut missing = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        missing.clear();
        for (title, expr) in &exprs {
            match prom.query(expr).await {
                Ok(series) if !series.is_empty() => {}
                Ok(_) => missing.push(format!("panel `{title}`: no series for {expr}")),
                Err(e) => missing.push(format!("panel `{title}`: {expr}: {e}")),
            }
        }
        for m in &metrics {
            let q = format!("count({{__name__=~\"{m}(_bucket)?\"}})");
            match prom.query(&q).await {
                Ok(series) if !series.is_empty() => {}
                Ok(_) => missing.push(format!("alert metric {m}: no series")),
                Err(e) => missing.push(format!("alert metric {m}: {e}")),
            }
        }
        if missing.is_empty() || std::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    assert!(
        missing.is_empty(),
        "{} of {} queries returned nothing:\n{}",
        missing.len(),
        exprs.len() + metrics.len(),
        missing.join("\n")
    );
    drop((tuned, default));
}

/// The metric names a PromQL expression reads (`runner_…`, without a histogram suffix).
fn names_in(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in expr.match_indices("runner_") {
        let name: String = expr[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let name = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .map_or(name.clone(), str::to_string);
        out.insert(name);
    }
    out
}

/// A node that has seen no traffic yet already exports every metric a dashboard panel or an
/// alert reads (at zero), so panels show 0 rather than "No data" — except the age of the
/// newest snapshot, which exists once a partition has one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_node_exports_every_metric_the_dashboard_and_alerts_read() {
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(manifests.path().join("watch.yaml"), MANIFEST).unwrap();
    let mdir = manifests.path().to_str().unwrap().to_string();
    let nats = NatsServer::start();
    let runner = RunnerProc::start(
        &[
            "--mode",
            "combined",
            "--nats-url",
            &nats.url(),
            "--manifest",
            &mdir,
        ],
        &[
            ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
            ("RUNNER__PARTITIONS__COUNT", "4"),
        ],
    );
    let mut wanted: BTreeSet<String> = alert_metrics();
    for (_, expr) in dashboard_exprs() {
        wanted.extend(names_in(&expr));
    }
    wanted.remove("runner_snapshot_last_timestamp_seconds");
    assert!(wanted.len() >= 20, "{wanted:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let missing = loop {
        let text = common::get_text(&format!("{}/metrics", runner.admin)).await;
        let missing = wanted
            .iter()
            .filter(|m| {
                !text.lines().any(|l| {
                    l.strip_prefix(m.as_str()).is_some_and(|rest| {
                        rest.starts_with(['{', ' '])
                            || ["_bucket", "_count", "_sum"]
                                .iter()
                                .any(|s| rest.starts_with(s))
                    })
                })
            })
            .cloned()
            .collect::<Vec<_>>();
        if missing.is_empty() || std::time::Instant::now() > deadline {
            break missing;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(missing.is_empty(), "no series at start for {missing:?}");
    runner.stop();
}
