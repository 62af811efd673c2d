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

/// `runner run` against `nats` with `manifests`, on a fresh data dir unless `data` is given;
/// returns the exit code and everything it printed.
fn run_against(
    nats: &NatsServer,
    manifests: &str,
    data: Option<&std::path::Path>,
    envs: &[(&str, &str)],
) -> (Option<i32>, String) {
    let fresh = tempfile::tempdir().unwrap();
    let data = data.unwrap_or(fresh.path());
    run_to_exit(
        &[
            "run",
            "--nats-url",
            &nats.url(),
            "--data-dir",
            data.to_str().unwrap(),
            "--admin-addr",
            "127.0.0.1:0",
            "--manifest",
            manifests,
        ],
        envs,
        Duration::from_secs(30),
    )
}

/// Creates AGGREGATE_EVENTS as someone else might have, capturing what Runner needs, with
/// `change` applied; then checks `runner run` refuses to start, naming the stream, the
/// field and both values, and returns the failure line.
fn refused_against_existing(
    change: impl FnOnce(&mut async_nats::jetstream::stream::Config),
    envs: &[(&str, &str)],
) -> String {
    let nats = NatsServer::start();
    let mut config = async_nats::jetstream::stream::Config {
        name: "AGGREGATE_EVENTS".into(),
        subjects: vec!["tenant.*.aggregate.*.*".into()],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    };
    change(&mut config);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let js = rt.block_on(async {
        let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
        js.create_stream(config).await.unwrap();
        js
    });
    let on_server = || {
        rt.block_on(async {
            let s = js.get_stream("AGGREGATE_EVENTS").await.unwrap();
            s.cached_info().config.clone()
        })
    };
    let before = on_server();
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(manifests.path().join("m.yaml"), "format: 1\n").unwrap();
    let (code, out) = run_against(&nats, manifests.path().to_str().unwrap(), None, envs);
    assert_eq!(code, Some(1), "{out}");
    let line = failure_line(&out).to_string();
    assert!(
        line.contains("AGGREGATE_EVENTS") && line.contains("incompatible"),
        "{line}"
    );
    assert_eq!(
        on_server(),
        before,
        "Runner never modifies an existing stream"
    );
    line
}

#[test]
fn incompatible_stream_names_the_field() {
    // Someone else created AGGREGATE_EVENTS for one tenant only: Runner must not start.
    let line =
        refused_against_existing(|c| c.subjects = vec!["tenant.acme.aggregate.>".into()], &[]);
    assert!(line.contains("`subjects`"), "{line}");
}

#[test]
fn stream_in_memory_is_refused_naming_storage() {
    use async_nats::jetstream::stream::StorageType;
    let line = refused_against_existing(|c| c.storage = StorageType::Memory, &[]);
    assert!(
        line.contains("`storage` is Memory") && line.contains("needs File"),
        "{line}"
    );
}

#[test]
fn stream_with_work_queue_retention_is_refused_naming_retention() {
    use async_nats::jetstream::stream::RetentionPolicy;
    let line = refused_against_existing(|c| c.retention = RetentionPolicy::WorkQueue, &[]);
    assert!(
        line.contains("`retention` is WorkQueue") && line.contains("needs Limits"),
        "{line}"
    );
}

#[test]
fn stream_with_a_shorter_duplicate_window_is_refused_naming_it() {
    let line = refused_against_existing(|c| c.duplicate_window = Duration::from_secs(10), &[]);
    assert!(
        line.contains("`duplicate_window` is 10s") && line.contains("at least 2m"),
        "{line}"
    );
}

#[test]
fn stream_with_fewer_replicas_than_configured_is_refused_naming_replicas() {
    let line = refused_against_existing(|_| {}, &[("RUNNER__STREAMS__REPLICAS", "3")]);
    assert!(
        line.contains("`num_replicas` is 1") && line.contains("needs 3"),
        "{line}"
    );
}

#[test]
fn run_refuses_a_broken_manifest_naming_every_problem_with_its_location() {
    let nats = NatsServer::start();
    let (code, out) = run_against(&nats, "tests/broken/semantic.yaml", None, &[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        failure_line(&out).contains("manifests are invalid"),
        "{out}"
    );
    // Every error `runner validate` reports for this file, each with file:line:column.
    let expected =
        std::fs::read_to_string(common::repo_root().join("tests/broken/expected.txt")).unwrap();
    let errors: Vec<&str> = expected
        .lines()
        .filter(|l| l.starts_with("tests/broken/semantic.yaml:") && l.contains(": error: "))
        .collect();
    assert!(errors.len() > 5);
    for e in errors {
        assert!(out.contains(e), "missing {e:?} in:\n{out}");
    }
    assert!(!out.contains("Ready."), "it started anyway:\n{out}");

    let (code, out) = run_against(&nats, "tests/broken/syntax.yaml", None, &[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("tests/broken/syntax.yaml:5:17: error: invalid manifest: unclosed bracket"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_refuses_manifests_that_would_strand_stored_instances() {
    let nats = NatsServer::start();
    let v1 =
        std::fs::read_to_string(common::repo_root().join("tests/manifests/ledger.yaml")).unwrap();
    let manifests = tempfile::tempdir().unwrap();
    let file = manifests.path().join("m.yaml");
    std::fs::write(&file, &v1).unwrap();
    let dir = manifests.path().to_str().unwrap().to_string();
    // A running instance on version 1.
    let runner = common::RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), &dir, &[]);
    let js = common::jetstream(&nats.url()).await;
    common::start_ledger_instance(&js).await;
    let data = runner.stop();

    // Version 2 alone, with no migration from 1: the start is refused.
    std::fs::write(&file, v1.replace("version: 1", "version: 2")).unwrap();
    let (code, out) = run_against(&nats, &dir, Some(data.path()), &[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        failure_line(&out).contains("manifests are invalid"),
        "{out}"
    );
    assert!(
        out.contains("saga `ledger` version 1 has instances in flight but is not loaded"),
        "{out}"
    );
    assert!(!out.contains("Ready."), "it started anyway:\n{out}");
    let inst = common::open_store(data.path())
        .read_blocking(|t| t.instance("bank", "ledger", "a-1"))
        .unwrap()
        .unwrap();
    assert_eq!(inst.version, 1);
    assert_eq!(inst.data["count"], serde_json::json!(1));
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

#[test]
fn a_stream_whose_subjects_another_stream_owns_is_refused_at_once_not_retried() {
    // Someone else's stream captures the aggregate subjects under another name: the server
    // refuses to create AGGREGATE_EVENTS for good, so the start stops without waiting out
    // nats.setup_timeout (set far beyond the run_to_exit bound below).
    let nats = NatsServer::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "THEIRS".into(),
            subjects: vec!["tenant.*.aggregate.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    });
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(manifests.path().join("m.yaml"), "format: 1\n").unwrap();
    let (code, out) = run_against(
        &nats,
        manifests.path().to_str().unwrap(),
        None,
        &[("RUNNER__NATS__SETUP_TIMEOUT", "600s")],
    );
    assert_eq!(code, Some(1), "{out}");
    let line = failure_line(&out);
    assert!(
        line.contains("refused") && line.contains("AGGREGATE_EVENTS"),
        "{line}"
    );
    assert!(
        !out.contains("JetStream set-up not possible yet"),
        "a definite refusal was retried:\n{out}"
    );
}

#[test]
fn tls_required_against_a_plain_server_says_so() {
    let nats = NatsServer::start();
    let data = tempfile::tempdir().unwrap();
    let (code, out) = run_to_exit(
        &[
            "run",
            "--nats-url",
            &nats.url(),
            "--data-dir",
            data.path().to_str().unwrap(),
            "--admin-addr",
            "127.0.0.1:0",
        ],
        &[
            ("RUNNER__NATS__CONNECT_TIMEOUT", "1s"),
            ("RUNNER__NATS__TLS_REQUIRED", "true"),
        ],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1), "{out}");
    let line = failure_line(&out);
    assert!(line.contains("did not answer the TLS handshake"), "{line}");
}

#[test]
fn credentials_in_a_nats_url_are_refused_and_never_printed() {
    let nats = NatsServer::start();
    let url = nats.url().replace("nats://", "nats://alice:pa55-w0rd-xyz@");
    let data = tempfile::tempdir().unwrap();
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
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(failure_line(&out).contains("nats.urls"), "{out}");
    assert!(!out.contains("pa55-w0rd-xyz"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_node_on_a_live_node_s_data_dir_is_refused_naming_the_holder() {
    let nats = NatsServer::start();
    let mut first =
        common::RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &[]);
    let (code, out) = run_against(&nats, "manifests", Some(first.data_dir.path()), &[]);
    assert_eq!(code, Some(1), "{out}");
    let line = failure_line(&out);
    assert!(
        line.contains(first.data_dir.path().to_str().unwrap())
            && line.contains(&format!(
                "is in use by another `runner run` (pid {})",
                first.pid()
            )),
        "{line}"
    );
    assert!(!out.contains("Ready."), "it started anyway:\n{out}");
    assert!(first.exited().is_none(), "the first node kept running");

    // Once the first has gone (killed: the kernel lets go of its lock), the directory is free.
    let data = first.kill();
    let mut second = common::RunnerProc::saga(data, &nats.url(), "manifests", &[]);
    assert!(
        second.exited().is_none(),
        "a node starts on the freed directory"
    );
    let _ = second.stop();
}
