//! The admin server cannot be opened to the network without a token, a flood of half-open
//! connections neither holds it nor starves the node, and slow connections filling the
//! connection cap cannot starve the probes. Real binary, real
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
    // The node still answers, and says what it closed at the cap: evicted (the oldest
    // half-open one, to make room for a newer one) or refused.
    let health = get_json(&format!("{}/health", runner.admin)).await;
    assert_eq!(health["status"], "ok", "{health}");
    let refused =
        common::metrics::metric(&runner.admin, "runner_admin_connections_refused_total").await;
    let evicted =
        common::metrics::metric(&runner.admin, "runner_admin_connections_evicted_total").await;
    assert!(
        refused + evicted >= 200.0,
        "refused {refused}, evicted {evicted}"
    );
    let open = common::metrics::metric(&runner.admin, "runner_admin_connections").await;
    assert!(open <= 32.0, "{open} admin connections open");
}

/// Slow-loris connections: requests whose headers are dripped one byte at a time, often
/// enough never to be idle. With `reopen`, a connection the server closes is replaced by a
/// new one, as an attacker keeping the cap full would. Bounded: loopback only, at most `n`
/// connections at once and 400 in all, and the dripping stops when the value is dropped or
/// after a minute, whichever comes first.
struct SlowLoris {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// How many of the connections the server has not closed yet.
    open: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    dripper: Option<std::thread::JoinHandle<()>>,
}

impl SlowLoris {
    fn open(addr: &str, n: usize, reopen: bool) -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        fn connect(addr: &str) -> Option<TcpStream> {
            let mut s = TcpStream::connect(addr).ok()?;
            s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                .ok()?;
            Some(s)
        }
        let mut held: Vec<Option<TcpStream>> = Vec::new();
        for _ in 0..n {
            held.push(Some(connect(addr).unwrap()));
            // Let the server accept them in this order (the oldest is the first evicted).
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut opened = n;
        let stop = Arc::new(AtomicBool::new(false));
        let open = Arc::new(AtomicUsize::new(n));
        let (s2, o2, addr) = (stop.clone(), open.clone(), addr.to_string());
        let dripper = std::thread::spawn(move || {
            let until = Instant::now() + Duration::from_secs(60);
            while !s2.load(Ordering::SeqCst) && Instant::now() < until {
                for slot in &mut held {
                    if let Some(s) = slot {
                        // A write to a connection the server closed fails (at the latest
                        // on the second one, after the reset).
                        if s.write_all(b"a").is_err() {
                            *slot = None;
                        }
                    }
                    if slot.is_none() && reopen && opened < 400 {
                        opened += 1;
                        *slot = connect(&addr);
                    }
                }
                o2.store(held.iter().flatten().count(), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        Self {
            stop,
            open,
            dripper: Some(dripper),
        }
    }

    fn still_open(&self) -> usize {
        self.open.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for SlowLoris {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.dripper.take() {
            let _ = t.join();
        }
    }
}

/// `n` probes of `path`, each on a connection of its own (as a kubelet makes them), each
/// given 5 s; returns the status codes, or the error for a probe that got no answer.
async fn probe(admin: &str, path: &str, n: usize) -> Vec<Result<u16, String>> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let r = client.get(format!("{admin}{path}")).send().await;
        out.push(match r {
            Ok(r) => Ok(r.status().as_u16()),
            Err(e) => Err(format!("{e:?}")),
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_are_answered_while_slow_connections_fill_the_cap() {
    const CAP: usize = 8;
    let nats = NatsServer::start();
    let runner = RunnerProc::start(
        &["--nats-url", &nats.url(), "--manifest", "manifests"],
        &[
            ("RUNNER__ADMIN__MAX_CONNECTIONS", "8"),
            // The slow connections drip a byte every 200 ms: never idle, and held far
            // longer than the test by the lifetime limit alone.
            ("RUNNER__ADMIN__IDLE_TIMEOUT", "2s"),
            ("RUNNER__ADMIN__CONNECTION_TIMEOUT", "10m"),
        ],
    );
    let addr = runner.admin.trim_start_matches("http://").to_string();

    // The cap is filled with slow connections, which stay open while nobody else comes.
    let slow = SlowLoris::open(&addr, CAP, false);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        slow.still_open(),
        CAP,
        "the slow connections are held (neither idle nor too old)"
    );

    // Every probe is answered, each taking the slot of the connection that has waited
    // longest without a request.
    for path in ["/health", "/ready"] {
        let answers = probe(&runner.admin, path, 30).await;
        let bad: Vec<_> = answers.iter().filter(|a| **a != Ok(200)).collect();
        assert!(
            bad.is_empty(),
            "{} of 30 {path} probes not answered 200: {bad:?}",
            bad.len()
        );
    }

    // A flood of further slow connections, each reopened as soon as it is closed, does not
    // raise what the node holds above the cap, and the probes are still answered while it
    // goes on.
    let flood = SlowLoris::open(&addr, 40, true);
    std::thread::sleep(Duration::from_secs(1));
    let answers = probe(&runner.admin, "/health", 30).await;
    assert!(
        answers.iter().all(|a| *a == Ok(200)),
        "probes during the flood: {answers:?}"
    );
    let scrape = common::metrics::Scrape::of(&runner.admin).await;
    let open = scrape.get("runner_admin_connections").unwrap();
    assert!(
        open <= CAP as f64,
        "{open} admin connections open, cap {CAP}"
    );
    let evicted = scrape
        .get("runner_admin_connections_evicted_total")
        .unwrap_or_else(|| {
            panic!(
                "{}",
                scrape.describe("runner_admin_connections_evicted_total")
            )
        });
    assert!(evicted >= 40.0, "evicted {evicted}");
    drop(flood);
    assert_eq!(
        slow.still_open(),
        0,
        "the first slow connections were evicted"
    );
}
