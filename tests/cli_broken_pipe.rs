//! The CLI's output read by a reader that stops early (`runner instances list … | head`):
//! every printing command ends quietly — exit 0, no panic — when stdout is closed after its
//! first line (finding: `println!` panicked on EPIPE, exit 101). Real binary, real libmdbx
//! store filled by the saga processor, offline (no command here needs NATS).
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{open_store, repo_root, run_to_exit, runner_bin};
use runner::manifest::load_str;
use runner::worker::process::{Limits, Processor, RawInput, Scope};
use serde_json::json;

/// Instances and dead letters the store is filled with: each listing is well over a pipe's
/// 64 KiB, so the command is still writing when the reader goes.
const N: usize = 1000;

fn raw(subject: String, body: Vec<u8>, seq: usize) -> RawInput {
    RawInput {
        subject,
        body: body.into(),
        traceparent: None,
        header_bytes: 0,
        refused: None,
        live_cap: None,
        timer_cap: None,
        source: format!("AGGREGATE_EVENTS:{seq}"),
        stored_ms: None,
    }
}

/// A store with `N` running `order` instances of tenant `acme` and `N` dead letters.
fn filled_store() -> tempfile::TempDir {
    let catalog = load_str(&[("order.yaml", include_str!("../manifests/order.yaml"))])
        .catalog
        .unwrap();
    let limits = Limits {
        allowed_tenants: Vec::new(),
        max_message_bytes: 1 << 20,
        max_payload: 1 << 20,
        max_output_bytes: usize::MAX,
        max_clock_skew_ms: runner::saga::DEFAULT_MAX_CLOCK_SKEW_MS,
        seal: runner::seal::Seal::none(),
    };
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let now = runner::clock::now_ms();
    let mut inputs = Vec::new();
    for i in 0..N {
        let id = format!("order-with-a-rather-long-correlation-id-{i:05}");
        let body = json!({
            "v": 1, "event_id": format!("ev-{id}"), "tenant_id": "acme",
            "event_type": "OrderPlaced", "aggregate_type": "Order", "aggregate_id": id,
            "timestamp_ms": 1_700_000_000_000u64, "metadata": {},
            "payload": {"customer_id": "c", "amount_cents": 100, "items": [{"sku": "s", "qty": 1}]},
        });
        let subject = format!("tenant.acme.aggregate.Order.{id}");
        inputs.push(raw(subject, serde_json::to_vec(&body).unwrap(), 2 * i));
        let subject = format!("tenant.acme.aggregate.Order.poison-{i}");
        inputs.push(raw(subject, b"not json".to_vec(), 2 * i + 1));
    }
    store
        .write_blocking(|t| {
            let mut p = Processor::new(&catalog, &limits, now, Scope::whole());
            for r in &inputs {
                p.input(t, r)?;
            }
            Ok(())
        })
        .unwrap();
    drop(store);
    dir
}

/// Runs `runner <args>` with stdout a pipe, reads one line, closes the pipe; the exit
/// status and stderr.
fn first_line_then_close(args: &[&str]) -> (std::process::ExitStatus, String, String) {
    let mut child = Command::new(runner_bin())
        .current_dir(repo_root())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    // The reader (and with it the pipe's only read end) is gone here.
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("`runner {}` did not exit", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, first, err.join().unwrap())
}

#[test]
fn read_commands_end_quietly_when_their_reader_stops_early() {
    let dir = filled_store();
    let d = dir.path().to_str().unwrap();
    let list = [
        "instances",
        "list",
        "--data-dir",
        d,
        "--tenant",
        "acme",
        "--saga",
        "order",
        "--limit",
        "1000",
    ];
    let list_json = [&list[..], &["--output", "json"]].concat();
    let dlq = ["dlq", "list", "--data-dir", d, "--limit", "1000"];
    let dlq_json = [&dlq[..], &["--output", "json"]].concat();
    for args in [&list[..], &list_json, &dlq, &dlq_json] {
        // Read whole, each command works and prints far more than a pipe holds.
        let (code, whole) = run_to_exit(args, &[], Duration::from_secs(60));
        assert_eq!(code, Some(0), "runner {args:?}: {whole}");
        assert!(
            whole.len() > 96 * 1024,
            "runner {args:?}: {} bytes",
            whole.len()
        );

        let (status, first, stderr) = first_line_then_close(args);
        assert!(
            !first.is_empty(),
            "runner {args:?} printed nothing; {stderr}"
        );
        assert!(
            status.success(),
            "runner {args:?} with its reader gone: {status}; stderr: {stderr}"
        );
        assert!(
            !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
            "runner {args:?}: {stderr}"
        );
    }
}

/// `runner test` prints a line per test case; a reader that stops early does not change
/// its verdict (exit 0: every case passed) and causes no panic.
#[test]
fn runner_test_ends_quietly_when_its_reader_stops_early() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("order.yaml"),
        include_str!("../manifests/order.yaml"),
    )
    .unwrap();
    let mut tests = String::from("format: 1\ntenant: acme\ntests:\n");
    for i in 0..N {
        tests += &format!(
            "  - name: an order placed is charged first, case {i:05} of a long list of cases \
             that together print more than a pipe holds\n    saga: order\n    steps:\n      \
             - event:\n          subject: aggregate.Order.o-{i}\n          event_type: \
             OrderPlaced\n          payload: {{ customer_id: c, amount_cents: 100, items: \
             [{{ sku: s, qty: 1 }}] }}\n        expect:\n          state: awaiting_payment\n"
        );
    }
    std::fs::write(dir.path().join("order.tests.yaml"), tests).unwrap();
    let args = ["test", dir.path().to_str().unwrap()];
    let (code, whole) = run_to_exit(&args, &[], Duration::from_secs(120));
    assert_eq!(
        code,
        Some(0),
        "{}",
        &whole[whole.len().saturating_sub(2000)..]
    );
    assert!(whole.contains(&format!("{N} passed, 0 failed")));
    assert!(whole.len() > 96 * 1024, "{} bytes", whole.len());

    let (status, first, stderr) = first_line_then_close(&args);
    assert!(first.starts_with("ok "), "{first}; {stderr}");
    assert!(status.success(), "{status}; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
