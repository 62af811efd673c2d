//! Control characters from inputs never reach the text log or `runner dlq list` raw: a body
//! whose `tenant_id` holds a newline and an ANSI escape cannot forge a log line. Real
//! binary, real nats-server.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_log_line_stays_on_its_own_line_escaped() {
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("runner.log");
    let data = dir.path().join("data");
    let mut child = Command::new(runner_bin())
        .current_dir(repo_root())
        .args([
            "--log-format",
            "text",
            "run",
            "--mode",
            "saga",
            "--admin-addr",
            "127.0.0.1:0",
        ])
        .args([
            "--nats-url",
            &nats.url(),
            "--manifest",
            "manifests",
            "--data-dir",
        ])
        .arg(&data)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let ready = eventually(Duration::from_secs(30), || async {
        std::fs::read_to_string(&log_path).is_ok_and(|l| l.contains("Ready."))
    })
    .await;
    assert!(ready, "runner did not start");
    let js = jetstream(&nats.url()).await;
    let evil = "acme\n2026-01-01T00:00:00Z ERROR forged \u{1b}[31mline";
    let mut ev = aggregate_event(
        "acme",
        "Order",
        "o-1",
        "OrderPlaced",
        runner::clock::now_ms(),
        json!({"customer_id": "c", "amount_cents": 1, "items": []}),
    );
    ev["tenant_id"] = json!(evil);
    publish_json(&js, "tenant.acme.aggregate.Order.o-1", &ev).await;
    wait_for_messages(
        &js,
        "RUNNER_DLQ",
        "tenant.acme.deadletter.>",
        1,
        Duration::from_secs(30),
    )
    .await;
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();

    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(log.contains("forged"), "the dead letter was logged: {log}");
    for line in log.lines() {
        assert!(
            !line.contains('\u{1b}'),
            "raw escape byte in the log: {line:?}"
        );
        assert!(!line.starts_with("2026-01-01"), "forged line: {line:?}");
    }
    let (code, out) = run_to_exit(
        &["dlq", "list", "--data-dir", data.to_str().unwrap()],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(out.lines().count(), 2, "one entry, one summary: {out:?}");
    assert!(!out.contains('\u{1b}'), "{out:?}");
}
