//! The operator's read commands work on a live node whatever its durability (finding: `runner
//! dlq list` and `runner inspect --data-dir` failed with `MDBX_INCOMPATIBLE` against a node
//! running with `storage.durability` other than `full`, because they opened the store for
//! writing in the default mode). The same for a node writing its store through the memory
//! map (`storage.write_map`), whose mode the read commands do not share. Real binary, real
//! nats-server, real libmdbx.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_commands_work_on_a_live_node_of_every_durability() {
    for (durability, write_map) in [
        ("unsafe_no_sync", "false"),
        ("no_meta_sync", "false"),
        ("full", "true"),
    ] {
        let nats = NatsServer::start();
        let env = [
            ("RUNNER__STORAGE__DURABILITY", durability),
            ("RUNNER__STORAGE__WRITE_MAP", write_map),
        ];
        let durability = format!("{durability} (write_map {write_map})");
        let mut runner =
            RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &env);
        let js = jetstream(&nats.url()).await;
        let order = aggregate_event(
            "acme",
            "Order",
            "o-1",
            "OrderPlaced",
            runner::clock::now_ms(),
            json!({"customer_id": "c", "amount_cents": 100, "items": [{"sku": "s", "qty": 1}]}),
        );
        publish_json(&js, "tenant.acme.aggregate.Order.o-1", &order).await;
        js.publish("tenant.acme.aggregate.Order.o-2", "not json".into())
            .await
            .unwrap()
            .await
            .unwrap();
        wait_for_messages(
            &js,
            "RUNNER_DLQ",
            "tenant.acme.deadletter.>",
            1,
            Duration::from_secs(30),
        )
        .await;
        let dir = runner.data_dir.path().to_str().unwrap().to_owned();
        // The setting reached the store: the node maps its data file writable only when it
        // writes through the map.
        let data = std::fs::canonicalize(runner.data_dir.path().join("runner.mdbx/mdbx.dat"))
            .expect("the node's data file");
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", runner.pid())).unwrap();
        let mapping = maps
            .lines()
            .find(|l| l.ends_with(data.to_str().unwrap()))
            .unwrap_or_else(|| panic!("{} is not mapped:\n{maps}", data.display()));
        assert_eq!(
            mapping.split_whitespace().nth(1).unwrap().starts_with("rw"),
            write_map == "true",
            "{durability}: {mapping}"
        );
        let (code, out) = run_to_exit(
            &["dlq", "list", "--data-dir", &dir],
            &[],
            Duration::from_secs(20),
        );
        assert_eq!(code, Some(0), "dlq list against {durability}: {out}");
        assert!(out.contains("1 dead letter(s)"), "{out}");
        let (code, out) = run_to_exit(
            &["dlq", "show", "--data-dir", &dir, "--tenant", "acme", "1"],
            &[],
            Duration::from_secs(20),
        );
        assert_eq!(code, Some(0), "dlq show against {durability}: {out}");
        assert!(out.contains("undecodable"), "{out}");
        let (code, out) = run_to_exit(
            &[
                "dlq",
                "show",
                "--data-dir",
                &dir,
                "--tenant",
                "acme",
                "1",
                "--output",
                "text",
            ],
            &[],
            Duration::from_secs(20),
        );
        assert_eq!(code, Some(0), "dlq show --output text: {out}");
        assert!(
            out.lines().any(|l| l == "kind: undecodable")
                && out.lines().any(|l| l == "tenant: acme"),
            "{out}"
        );
        let (code, out) = run_to_exit(
            &[
                "inspect",
                "--data-dir",
                &dir,
                "--tenant",
                "acme",
                "--saga",
                "order",
                "--id",
                "o-1",
            ],
            &[],
            Duration::from_secs(20),
        );
        assert_eq!(code, Some(0), "inspect against {durability}: {out}");
        assert!(out.contains("awaiting_payment"), "{out}");
        assert!(runner.exited().is_none(), "the node kept running");
    }
}
