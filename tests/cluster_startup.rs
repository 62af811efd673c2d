//! Start-up on a three-node NATS cluster that is still forming: stream and bucket set-up is
//! retried until `nats.setup_timeout`, so a runner started before the cluster has a
//! JetStream meta leader comes up by itself once it has one, with R3 streams; and a runner
//! whose cluster never forms exits non-zero past the deadline, naming what failed.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::{RunnerProc, aggregate_event, jetstream, publish_json, wait_for_messages};
use serde_json::json;

/// `runner run` in saga mode against every node of `cluster`, on data directory `dir`.
fn saga_run(cluster: &Cluster, dir: &std::path::Path) -> Vec<String> {
    [
        "run",
        "--mode",
        "saga",
        "--admin-addr",
        "127.0.0.1:0",
        "--nats-url",
        &cluster.urls(),
        "--manifest",
        "manifests",
        "--data-dir",
        dir.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Whether node 0's monitoring endpoint lists a client connection named `runner`.
fn runner_connected(cluster: &Cluster) -> bool {
    let Some(connz) = cluster.monitor_json(0, "/connz") else {
        return false;
    };
    connz["connections"]
        .as_array()
        .is_some_and(|cs| cs.iter().any(|c| c["name"] == "runner"))
}

/// Starts a combined runner against one node of three, brings the others up once it is
/// connected, and checks it comes up by itself, with R3 streams and buckets, and works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_started_before_the_cluster_forms_comes_up_with_r3_streams_and_buckets() {
    let mut cluster = Cluster::new(3);
    // One node of three: JetStream has no quorum, so no stream can be created yet.
    cluster.start_node(0);
    let urls = cluster.urls();
    let starting = std::thread::spawn(move || {
        RunnerProc::start(
            &[
                "--mode",
                "combined",
                "--nats-url",
                &urls,
                "--manifest",
                "manifests",
            ],
            &[
                ("RUNNER__STREAMS__REPLICAS", "3"),
                ("RUNNER__NATS__SETUP_TIMEOUT", "120s"),
            ],
        )
    });
    // Bring the other two nodes up only once the runner is connected to the lone node, so its
    // set-up provably starts against a cluster without a leader.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !runner_connected(&cluster) {
        assert!(
            Instant::now() < deadline,
            "the runner never connected to node 0"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    cluster.start_node(1);
    cluster.start_node(2);
    let runner = starting.join().expect("runner came up");
    assert!(
        runner
            .log
            .iter()
            .any(|l| l.contains("JetStream set-up not possible yet")),
        "the runner never had to retry, so this run did not test a forming cluster; log:\n{}",
        runner.log.join("\n")
    );

    let js = jetstream(&cluster.url(0)).await;
    for name in [
        "AGGREGATE_EVENTS",
        "WORKFLOW_COMMANDS",
        "WORKFLOW_EVENTS",
        "SAGA_INBOX",
        "KV_RUNNER_LEASES",
        "OBJ_RUNNER_SNAPSHOTS",
    ] {
        let info = js.get_stream(name).await.unwrap().cached_info().clone();
        assert_eq!(info.config.num_replicas, 3, "{name} is not R3");
    }
    // And it works: an order placed now produces its charge command.
    let ev = aggregate_event(
        "acme",
        "Order",
        "o-1",
        "OrderPlaced",
        1_800_000_000_000,
        json!({"customer_id": "c-1", "amount_cents": 1200, "items": [{"sku": "book", "qty": 1}]}),
    );
    publish_json(&js, "tenant.acme.aggregate.Order.o-1", &ev).await;
    let charges = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        1,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(charges.len(), 1);
}

#[test]
fn a_cluster_that_never_forms_stops_the_start_past_the_setup_deadline() {
    let mut cluster = Cluster::new(3);
    cluster.start_node(0);
    let dir = tempfile::tempdir().unwrap();
    let args = saga_run(&cluster, dir.path());
    let (code, out) = common::run_to_exit(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &[
            ("RUNNER__STREAMS__REPLICAS", "3"),
            ("RUNNER__NATS__SETUP_TIMEOUT", "3s"),
            ("RUNNER__NATS__REQUEST_TIMEOUT", "1s"),
        ],
        Duration::from_secs(120),
    );
    assert_eq!(code, Some(1), "output:\n{out}");
    assert!(
        out.contains("JetStream set-up not possible yet"),
        "no retry was logged:\n{out}"
    );
    assert!(
        out.contains("JetStream") && out.contains("AGGREGATE_EVENTS"),
        "the final error does not name the stream:\n{out}"
    );
}

#[test]
fn a_drain_requested_while_set_up_waits_ends_the_start_cleanly() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let mut cluster = Cluster::new(3);
    cluster.start_node(0);
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(common::runner_bin())
        .current_dir(common::repo_root())
        .args(["--log-format", "json"])
        .args(saga_run(&cluster, dir.path()))
        // Far longer than the waits below: exiting before it proves the drain cut it short.
        .env("RUNNER__NATS__SETUP_TIMEOUT", "600s")
        .env("RUNNER__STREAMS__REPLICAS", "3")
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push(line.clone());
        if line.contains("JetStream set-up not possible yet") {
            break;
        }
    }
    assert!(
        seen.iter()
            .any(|l| l.contains("JetStream set-up not possible yet")),
        "the runner exited before retrying set-up:\n{}",
        seen.join("\n")
    );
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "runner did not stop after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(0), "log:\n{}", rest.join("\n"));
    assert!(
        rest.iter()
            .any(|l| l.contains("Drain requested during start-up")),
        "log:\n{}",
        rest.join("\n")
    );
}
