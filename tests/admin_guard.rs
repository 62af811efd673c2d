//! The admin server cannot be opened to the network without a token, and a flood of
//! half-open connections neither holds it nor starves the node. Real binary, real
//! nats-server.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;

#[test]
fn a_non_loopback_admin_address_without_a_token_is_refused_naming_the_key() {
    let nats = NatsServer::start();
    let (code, out) = run_to_exit(
        &[
            "run",
            "--nats-url",
            &nats.url(),
            "--manifest",
            "manifests",
            "--admin-addr",
            "0.0.0.0:0",
        ],
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("admin.addr"), "{out}");
    assert!(out.contains("admin.token"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_connections_are_capped_and_timed_out() {
    let nats = NatsServer::start();
    let runner = RunnerProc::start(
        &["--nats-url", &nats.url(), "--manifest", "manifests"],
        &[
            ("RUNNER__ADMIN__MAX_CONNECTIONS", "32"),
            ("RUNNER__ADMIN__IDLE_TIMEOUT", "1s"),
            ("RUNNER__ADMIN__CONNECTION_TIMEOUT", "5s"),
        ],
    );
    let addr = runner.admin.trim_start_matches("http://").to_string();
    // 300 requests that never finish their headers.
    let started = Instant::now();
    let mut held: Vec<TcpStream> = (0..300)
        .filter_map(|_| {
            let mut s = TcpStream::connect(&addr).ok()?;
            s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").ok()?;
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            Some(s)
        })
        .collect();
    assert!(
        held.len() >= 250,
        "could open only {} connections",
        held.len()
    );
    // Every one is closed by the server: at once beyond the cap, after the idle timeout
    // otherwise; none is held past it.
    for s in &mut held {
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).unwrap_or(0);
        assert!(
            n == 0 || String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 408"),
            "a half-open request got an answer: {:?}",
            String::from_utf8_lossy(&buf[..n])
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "half-open connections were held for {:?}",
        started.elapsed()
    );
    drop(held);
    // The node still answers, and says what it refused.
    let health = get_json(&format!("{}/health", runner.admin)).await;
    assert_eq!(health["status"], "ok", "{health}");
    let refused =
        common::metrics::metric(&runner.admin, "runner_admin_connections_refused_total").await;
    assert!(refused >= 200.0, "refused {refused}");
    let open = common::metrics::metric(&runner.admin, "runner_admin_connections").await;
    assert!(open <= 32.0, "{open} admin connections open");
}
