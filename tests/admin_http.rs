//! Black-box tests of `runner run`: the real binary against a real nats-server.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{NatsServer, RunnerProc, eventually};

async fn status(url: &str) -> u16 {
    match reqwest::get(url).await {
        Ok(r) => r.status().as_u16(),
        Err(_) => 0,
    }
}

/// A minimal valid manifest declaring one saga called `name`.
fn saga_named(name: &str) -> String {
    std::fs::read_to_string(common::repo_root().join("tests/manifests/ledger.yaml"))
        .unwrap()
        .replace("name: ledger", &format!("name: {name}"))
}

fn manifests_dir(yaml: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("m.yaml"), yaml).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_outage_and_drain() {
    let mut nats = NatsServer::start();
    let url = nats.url();
    let manifests = manifests_dir("format: 1\n");
    let mut runner = RunnerProc::start(
        &[
            "--mode",
            "combined",
            "--config",
            "config/example.toml",
            "--nats-url",
            &url,
            "--manifest",
            manifests.path().to_str().unwrap(),
        ],
        &[],
    );
    let base = runner.admin.clone();

    assert_eq!(status(&format!("{base}/health")).await, 200);
    assert_eq!(status(&format!("{base}/ready")).await, 200);

    let metrics = common::get_text(&format!("{base}/metrics")).await;
    assert_prometheus_text(&metrics);
    assert!(
        metrics.contains("process_resident_memory_bytes"),
        "process metrics missing"
    );
    assert!(metrics.contains("runner_build_info{"), "build info missing");
    // Read from libmdbx at the scrape: the store's opening commit already wrote pages.
    let pages = metrics
        .lines()
        .find_map(|l| l.strip_prefix("runner_store_pages_dirtied_total "))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no store page counter:\n{metrics}"));
    assert!(pages > 0, "{pages}");

    let info: serde_json::Value = common::get_json(&format!("{base}/info")).await;
    assert_eq!(info["mode"], "combined");
    assert_eq!(info["roles"]["saga"], true);
    assert_eq!(info["streams"][0]["name"], "AGGREGATE_EVENTS");
    assert!(!info["node_id"].as_str().unwrap().is_empty());

    // NATS freezes (the socket stays open): /health turns 503 all the same, and 200 again
    // once it answers.
    nats.signal("STOP");
    let frozen = eventually(Duration::from_secs(15), || async {
        status(&format!("{base}/health")).await == 503
    })
    .await;
    nats.signal("CONT");
    assert!(frozen, "/health kept answering 200 while NATS was frozen");
    assert!(
        eventually(Duration::from_secs(30), || async {
            status(&format!("{base}/health")).await == 200
        })
        .await,
        "health did not recover after NATS resumed"
    );

    // NATS goes away: /health turns 503 with the reason; it comes back without a restart.
    nats.stop();
    assert!(
        eventually(Duration::from_secs(15), || async {
            status(&format!("{base}/health")).await == 503
        })
        .await
    );
    let body: serde_json::Value = common::get_json(&format!("{base}/health")).await;
    assert_eq!(body["nats"]["ok"], false);
    assert_eq!(body["storage"]["ok"], true);
    assert_eq!(
        body["storage"]["page_size_bytes"], 8192,
        "a new store has the default page size, and /health says which"
    );
    nats.start_again();
    assert!(
        eventually(Duration::from_secs(30), || async {
            status(&format!("{base}/health")).await == 200
        })
        .await,
        "health did not recover after NATS came back"
    );

    // Drain: ready turns 503 at once, then the process exits 0.
    let client = reqwest::Client::new();
    let r = client
        .post(format!("{base}/admin/drain"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 202);
    let ready = status(&format!("{base}/ready")).await;
    // Either 503 (still draining) or the server already closed (0) — never 200.
    assert!(
        ready == 503 || ready == 0,
        "ready answered {ready} during drain"
    );
    assert_eq!(runner.wait_exit(Duration::from_secs(30)), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_and_exits_zero() {
    let nats = NatsServer::start();
    let manifests = manifests_dir("format: 1\n");
    let mut runner = RunnerProc::start(
        &[
            "--mode",
            "saga",
            "--nats-url",
            &nats.url(),
            "--manifest",
            manifests.path().to_str().unwrap(),
        ],
        &[("RUNNER_NODE_ID", "node-under-test")],
    );
    let info: serde_json::Value = common::get_json(&format!("{}/info", runner.admin)).await;
    assert_eq!(info["node_id"], "node-under-test");
    assert_eq!(info["mode"], "saga");
    runner.signal("TERM");
    assert_eq!(runner.wait_exit(Duration::from_secs(30)), Some(0));
    assert!(
        runner
            .log
            .iter()
            .any(|l| l.contains("Drain started") && l.contains("SIGTERM"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_token_and_reload() {
    let nats = NatsServer::start();
    let manifests = manifests_dir(&saga_named("first"));
    let token = "0123456789abcdef-secret";
    let runner = RunnerProc::start(
        &[
            "--nats-url",
            &nats.url(),
            "--manifest",
            manifests.path().to_str().unwrap(),
        ],
        &[("RUNNER__ADMIN__TOKEN", token)],
    );
    let base = runner.admin.clone();
    let client = reqwest::Client::new();

    // No token, wrong token: 401. Probes stay open.
    let r = client
        .post(format!("{base}/admin/reload"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = client
        .post(format!("{base}/admin/reload"))
        .bearer_auth("0123456789abcdef-secreT")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(status(&format!("{base}/health")).await, 200);
    let info_json = common::get_text(&format!("{base}/info")).await;
    assert!(!info_json.contains(token), "/info leaks the admin token");
    // Without the token /info shows only what probes need.
    let open: serde_json::Value = serde_json::from_str(&info_json).unwrap();
    assert!(
        open.get("node_id").is_none() && open.get("manifests").is_none(),
        "{open}"
    );
    assert!(
        !info_json.contains("data_dir") && !info_json.contains("tenancy"),
        "{info_json}"
    );
    assert_eq!(open["mode"], "combined", "{open}");
    let info_of = |client: reqwest::Client, base: String| async move {
        client
            .get(format!("{base}/info"))
            .bearer_auth(token)
            .send()
            .await
            .unwrap()
            .json::<serde_json::Value>()
            .await
            .unwrap()
    };

    // A broken manifest is rejected with its location, and the old one stays in force.
    std::fs::write(
        manifests.path().join("m.yaml"),
        "format: 1\nsagas:\n  - name: [oops\n",
    )
    .unwrap();
    let r = client
        .post(format!("{base}/admin/reload"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 422);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["status"], "rejected");
    let err = body["errors"][0].as_str().unwrap();
    assert!(err.contains("m.yaml:3:"), "error lacks file:line: {err}");
    let info = info_of(client.clone(), base.clone()).await;
    assert_eq!(info["manifests"]["sagas"][0]["name"], "first");

    // A valid one is swapped in.
    std::fs::write(manifests.path().join("m.yaml"), saga_named("second")).unwrap();
    let r = client
        .post(format!("{base}/admin/reload"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let info = info_of(client.clone(), base.clone()).await;
    assert_eq!(info["manifests"]["sagas"][0]["name"], "second");
    let metrics = common::get_text(&format!("{base}/metrics")).await;
    assert!(metrics.contains("runner_manifest_reloads_total{outcome=\"rejected\"} 1"));
    assert!(metrics.contains("runner_manifest_reloads_total{outcome=\"applied\"} 1"));
}

/// Checks the Prometheus text exposition format line by line.
fn assert_prometheus_text(text: &str) {
    assert!(!text.is_empty());
    let mut samples = 0;
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            assert!(
                rest.starts_with("HELP ") || rest.starts_with("TYPE "),
                "bad comment: {line}"
            );
            continue;
        }
        let (name_part, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("no value: {line}"));
        assert!(
            value.parse::<f64>().is_ok() || ["+Inf", "-Inf", "NaN"].contains(&value),
            "bad value: {line}"
        );
        let name = name_part.split('{').next().unwrap();
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name: {line}"
        );
        if name_part.contains('{') {
            assert!(name_part.ends_with('}'), "unclosed labels: {line}");
        }
        samples += 1;
    }
    assert!(samples > 5, "too few samples");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_refuses_to_strand_running_instances() {
    let nats = NatsServer::start();
    let manifests = manifests_dir(&saga_named("ledger"));
    let runner = common::RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        manifests.path().to_str().unwrap(),
        &[],
    );
    let js = common::jetstream(&nats.url()).await;
    common::start_ledger_instance(&js).await;

    // Version 2 alone, with no migration from 1: the running instance would be stranded.
    let v2 = saga_named("ledger").replace("version: 1", "version: 2");
    std::fs::write(manifests.path().join("m.yaml"), &v2).unwrap();
    let client = reqwest::Client::new();
    let r = client
        .post(format!("{}/admin/reload", runner.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 422);
    let body: serde_json::Value = r.json().await.unwrap();
    let err = body["errors"][0].as_str().unwrap();
    assert!(
        err.contains("`ledger` version 1 has instances in flight but is not loaded"),
        "{err}"
    );
    // `runner validate --data-dir` says the same against the live store.
    let data_dir = runner.data_dir.path().to_str().unwrap().to_string();
    let manifest = manifests.path().join("m.yaml");
    let (code, out) = common::run_to_exit(
        &[
            "validate",
            "--data-dir",
            &data_dir,
            manifest.to_str().unwrap(),
        ],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(
            "<store>:0:0: error: saga `ledger` version 1 has instances in flight but is not loaded"
        ),
        "{out}"
    );

    // Versions 1 and 2 side by side: accepted; the instance stays on 1.
    let both = format!(
        "{}\n{}",
        saga_named("ledger"),
        v2.replace("format: 1\nsagas:\n", "")
    );
    std::fs::write(manifests.path().join("m.yaml"), &both).unwrap();
    let r = client
        .post(format!("{}/admin/reload", runner.admin))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["manifests"]["sagas"].as_array().unwrap().len(), 2);
}
