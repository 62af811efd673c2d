//! Start-up failures: each fails fast with one clear line naming the key or URL.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{NatsServer, run_to_exit};

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
    let p = dir.path().join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

/// The stderr line that says why start failed (the last `runner:` line).
fn failure_line(out: &str) -> &str {
    out.lines()
        .rev()
        .find(|l| l.starts_with("runner: "))
        .unwrap_or_else(|| panic!("no failure line in:\n{out}"))
}

#[test]
fn unknown_config_key_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        &dir,
        "bad.toml",
        "[nats]\nurls = [\"nats://127.0.0.1:1\"]\nconect_timeout = \"1s\"\n",
    );
    let (code, out) = run_to_exit(&["run", "--config", &cfg], &[], Duration::from_secs(20));
    assert_eq!(code, Some(1));
    let line = failure_line(&out);
    assert!(line.contains("bad.toml:3:1"), "{line}");
    assert!(line.contains("nats.conect_timeout"), "{line}");
    assert!(line.contains("unknown field"), "{line}");
}

#[test]
fn bad_duration_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        &dir,
        "bad.toml",
        "[runner]\ndrain_timeout = \"ten seconds\"\n",
    );
    let (code, out) = run_to_exit(&["run", "--config", &cfg], &[], Duration::from_secs(20));
    assert_eq!(code, Some(1));
    let line = failure_line(&out);
    assert!(line.contains("bad.toml:2:"), "{line}");
    assert!(line.contains("runner.drain_timeout"), "{line}");
    assert!(line.contains("invalid duration"), "{line}");
}

#[test]
fn bad_env_override_is_named() {
    let (code, out) = run_to_exit(
        &["run"],
        &[("RUNNER__STREAMS__DUPLICATE_WINDOW", "120")],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(1));
    let line = failure_line(&out);
    assert!(line.contains("RUNNER__STREAMS__DUPLICATE_WINDOW"), "{line}");
    assert!(line.contains("streams.duplicate_window"), "{line}");
}

#[test]
fn out_of_range_value_names_key_and_range() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(&dir, "c.toml", "[streams]\nreplicas = 9\n");
    let (code, out) = run_to_exit(&["run", "--config", &cfg], &[], Duration::from_secs(20));
    assert_eq!(code, Some(1));
    let line = failure_line(&out);
    assert!(
        line.contains("streams.replicas") && line.contains("1 to 5"),
        "{line}"
    );
}

#[test]
fn unreachable_nats_fails_fast_naming_the_url() {
    // A port nothing listens on: bind one, note it, close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("nats://127.0.0.1:{port}");
    let data = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let (code, out) = run_to_exit(
        &[
            "run",
            "--nats-url",
            &url,
            "--data-dir",
            data.path().to_str().unwrap(),
            "--admin-addr",
            "127.0.0.1:0",
        ],
        &[("RUNNER__NATS__CONNECT_TIMEOUT", "2s")],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1));
    let line = failure_line(&out);
    assert!(line.contains(&url), "{line}");
    assert!(line.contains("cannot connect to NATS"), "{line}");
    // It gave up after about the configured time, not immediately and not much later.
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "gave up too early"
    );
}

#[test]
fn incompatible_stream_names_the_field() {
    let nats = NatsServer::start();
    let data = tempfile::tempdir().unwrap();
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(manifests.path().join("m.yaml"), "format: 1\n").unwrap();
    let base = [
        "run",
        "--nats-url",
        &nats.url(),
        "--data-dir",
        data.path().to_str().unwrap(),
        "--admin-addr",
        "127.0.0.1:0",
        "--manifest",
        manifests.path().to_str().unwrap(),
    ];
    // Someone else created AGGREGATE_EVENTS for one tenant only: Runner must not start.
    let args: Vec<&str> = base.to_vec();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = async_nats::connect(nats.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "AGGREGATE_EVENTS".into(),
            subjects: vec!["tenant.acme.aggregate.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    });
    let (code, out) = run_to_exit(&args, &[], Duration::from_secs(30));
    assert_eq!(code, Some(1));
    let line = failure_line(&out);
    assert!(
        line.contains("AGGREGATE_EVENTS") && line.contains("`subjects`"),
        "{line}"
    );
}

#[test]
fn version_names_revision() {
    let (code, out) = run_to_exit(&["--version"], &[], Duration::from_secs(10));
    assert_eq!(code, Some(0));
    assert!(
        out.starts_with(&format!("runner {} (", env!("CARGO_PKG_VERSION"))),
        "{out}"
    );
}
