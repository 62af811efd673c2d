//! Scale-out acceptance on a three-node NATS cluster on loopback (R3 streams and buckets)
//! with several partitioned saga replicas, each a real `runner` process.
//!
//! The workload is the `ledger` saga (tests/manifests/ledger.yaml): each account takes
//! deposits numbered 1, 2, 3, … and acknowledges each with a command carrying its number;
//! a deposit out of order breaks the instance. So the command stream alone shows whether
//! every input was applied once and in order: for every account the acknowledged numbers
//! must be exactly 1..=K, each once, in stream order — nothing stored twice, nothing
//! missing, no instance broken.
//!
//! Ownership is checked at the broker: every partition's fence markers (the `runner.fence.>`
//! subjects) must show non-decreasing epochs, each epoch written by one owner only.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::jetstream;
use common::scaleout::{P, metric, print_warnings, replica, wait_balanced};

/// A stored message: subject and JSON body.
struct Seen {
    subject: String,
    body: serde_json::Value,
}

/// Publishes deposits 1..=k for `accounts` accounts, interleaved, retrying each publish
/// (a cluster node may be down meanwhile).
async fn deposit(url: &str, accounts: usize, from: u64, to: u64) {
    let js = jetstream(url).await;
    for n in from..=to {
        for a in 0..accounts {
            let (subject, ev) = common::ledger_deposit(a, n);
            let body = serde_json::to_vec(&ev).unwrap();
            loop {
                let mut h = async_nats::HeaderMap::new();
                h.insert(
                    async_nats::header::NATS_MESSAGE_ID,
                    format!("dep-{a}-{n}").as_str(),
                );
                let sent = async {
                    js.publish_with_headers(subject.clone(), h, body.clone().into())
                        .await?
                        .await
                        .map_err(async_nats::Error::from)
                };
                match sent.await {
                    Ok(_) => break,
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        }
    }
}

/// Every message of `stream` matching `filter` (subject, body), or `None` while the
/// cluster does not answer.
async fn try_read(
    url: &str,
    stream: &str,
    filter: &str,
) -> Option<Vec<(String, serde_json::Value)>> {
    let all = common::read_stream_once(url, stream, filter).await?;
    Some(all.into_iter().map(|(s, _, b)| (s, b)).collect())
}

/// The acknowledged deposit numbers per account, in stream order (retried until the
/// cluster answers).
async fn acknowledged(url: &str) -> BTreeMap<String, Vec<u64>> {
    let seen = loop {
        match try_read(url, "WORKFLOW_COMMANDS", "tenant.bank.command.Account.*").await {
            Some(v) => break v,
            None => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    };
    let mut out: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (subject, body) in seen {
        let s = Seen { subject, body };
        let account = s.subject.rsplit('.').next().unwrap().to_string();
        let n = s.body["payload"]["n"]
            .as_u64()
            .or_else(|| s.body["payload"]["n"].as_str().and_then(|v| v.parse().ok()))
            .unwrap();
        out.entry(account).or_default().push(n);
    }
    out
}

/// Waits until `accounts × k` acknowledgements are stored (or `timeout`), then checks that
/// every account has exactly 1..=k, once each, in order.
async fn assert_exactly_once(url: &str, accounts: usize, k: u64, timeout: Duration) {
    let started = Instant::now();
    let mut got;
    loop {
        got = acknowledged(url).await;
        let total: usize = got.values().map(Vec::len).sum();
        if total >= accounts * k as usize || started.elapsed() > timeout {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let want: Vec<u64> = (1..=k).collect();
    assert_eq!(got.len(), accounts, "accounts acknowledged");
    for (account, ns) in &got {
        assert_eq!(
            ns, &want,
            "account {account}: acknowledgements not exactly 1..={k} in order"
        );
    }
}

/// Checks every fence subject: epochs never go down, and one epoch has one owner.
async fn assert_fences_monotonic(url: &str) -> usize {
    let mut last: BTreeMap<String, u64> = BTreeMap::new();
    let mut owner_of: BTreeMap<(String, u64), String> = BTreeMap::new();
    let markers: Vec<Seen> = try_read(url, "WORKFLOW_COMMANDS", "runner.fence.>")
        .await
        .unwrap()
        .into_iter()
        .map(|(subject, body)| Seen { subject, body })
        .collect();
    for m in &markers {
        let epoch = m.body["epoch"].as_u64().unwrap();
        let owner = m.body["owner"].as_str().unwrap().to_string();
        let prev = last.insert(m.subject.clone(), epoch).unwrap_or(0);
        assert!(
            epoch >= prev,
            "{}: epoch went down from {prev} to {epoch}",
            m.subject
        );
        let first = owner_of
            .entry((m.subject.clone(), epoch))
            .or_insert_with(|| owner.clone());
        assert_eq!(
            first, &owner,
            "{} epoch {epoch} written by two owners",
            m.subject
        );
    }
    markers.len()
}

/// Polls every replica's /info while `running`; fails if two report the same partition
/// under the same epoch at once.
fn watch_epochs(admins: Vec<String>, running: Arc<AtomicBool>) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut rounds = 0;
        while running.load(Ordering::SeqCst) {
            let mut seen: BTreeMap<(u32, u64), String> = BTreeMap::new();
            for a in &admins {
                let Ok(resp) = reqwest::get(format!("{a}/info")).await else {
                    continue;
                };
                let Ok(info) = resp.json::<serde_json::Value>().await else {
                    continue;
                };
                if let Some(m) = info["partitions"]["owned"].as_object() {
                    for (k, v) in m {
                        let key = (k.parse().unwrap(), v["epoch"].as_u64().unwrap());
                        if let Some(other) = seen.insert(key, a.clone()) {
                            panic!(
                                "partition {} epoch {} held by {other} and {a}",
                                key.0, key.1
                            );
                        }
                    }
                }
            }
            rounds += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        rounds
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_the_partitions_and_a_fourth_joins() {
    let cluster = Cluster::start(3);
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut dirs = dirs.into_iter();
    let r1 = replica(&cluster, "r1", dirs.next().unwrap(), &[]);
    let r2 = replica(&cluster, "r2", dirs.next().unwrap(), &[]);
    let r3 = replica(&cluster, "r3", dirs.next().unwrap(), &[]);
    let took = wait_balanced(&[&r1, &r2, &r3], Duration::from_secs(60)).await;
    println!("three replicas balanced after {took:?}");

    let running = Arc::new(AtomicBool::new(true));
    let mut admins = vec![r1.admin.clone(), r2.admin.clone(), r3.admin.clone()];
    let (accounts, k) = (24, 30);
    let url = cluster.url(0);
    let load = tokio::spawn(async move { deposit(&url, accounts, 1, k).await });
    let r4 = replica(&cluster, "r4", dirs.next().unwrap(), &[]);
    admins.push(r4.admin.clone());
    let watcher = watch_epochs(admins, running.clone());
    let took = wait_balanced(&[&r1, &r2, &r3, &r4], Duration::from_secs(90)).await;
    println!("four replicas balanced {took:?} after the fourth started");
    load.await.unwrap();
    assert_exactly_once(&cluster.url(1), accounts, k, Duration::from_secs(120)).await;
    running.store(false, Ordering::SeqCst);
    let rounds = watcher.await.unwrap();
    assert!(rounds > 0);
    let markers = assert_fences_monotonic(&cluster.url(2)).await;
    assert!(markers >= P, "every partition raised its fence");
    for r in [r1, r2, r3, r4] {
        r.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_s_partitions_are_taken_over_with_nothing_twice_or_missing() {
    let cluster = Cluster::start(3);
    let r1 = replica(&cluster, "r1", tempfile::tempdir().unwrap(), &[]);
    let r2 = replica(&cluster, "r2", tempfile::tempdir().unwrap(), &[]);
    let r3 = replica(&cluster, "r3", tempfile::tempdir().unwrap(), &[]);
    wait_balanced(&[&r1, &r2, &r3], Duration::from_secs(60)).await;
    // 20 000 deposits.
    let (accounts, k) = (100, 200);
    let url = cluster.url(0);
    let load = tokio::spawn(async move { deposit(&url, accounts, 1, k).await });
    // Kill r2 once a third of the work is acknowledged.
    let js_url = cluster.url(1);
    common::wait_until("a third acknowledged", Duration::from_secs(120), || {
        let u = js_url.clone();
        async move {
            acknowledged(&u).await.values().map(Vec::len).sum::<usize>()
                >= accounts * k as usize / 3
        }
    })
    .await;
    let _ = r2.kill();
    let killed = Instant::now();
    let took = wait_balanced(&[&r1, &r3], Duration::from_secs(60)).await;
    println!(
        "partitions owned again {:?} after SIGKILL",
        killed.elapsed().max(took)
    );
    load.await.unwrap();
    assert_exactly_once(&cluster.url(2), accounts, k, Duration::from_secs(600)).await;
    assert_fences_monotonic(&cluster.url(0)).await;
    r1.stop();
    r3.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_owner_is_fenced_off_and_nothing_is_stored_twice_past_the_dedupe_window() {
    let cluster = Cluster::start(3);
    // A 10 s de-duplication window, a 20 s pause: only fencing and watermarks can keep
    // outputs single.
    let window = [("RUNNER__STREAMS__DUPLICATE_WINDOW", "10s")];
    let r1 = replica(&cluster, "r1", tempfile::tempdir().unwrap(), &window);
    let r2 = replica(&cluster, "r2", tempfile::tempdir().unwrap(), &window);
    let r3 = replica(&cluster, "r3", tempfile::tempdir().unwrap(), &window);
    wait_balanced(&[&r1, &r2, &r3], Duration::from_secs(60)).await;
    let (accounts, k) = (24, 40);
    let url = cluster.url(0);
    let load = tokio::spawn(async move { deposit(&url, accounts, 1, k).await });
    let js_url = cluster.url(1);
    common::wait_until("some acknowledged", Duration::from_secs(120), || {
        let u = js_url.clone();
        async move { acknowledged(&u).await.values().map(Vec::len).sum::<usize>() >= accounts * 5 }
    })
    .await;
    let before = r1.admin.clone();
    r1.signal("STOP");
    tokio::time::sleep(Duration::from_secs(20)).await;
    wait_balanced(&[&r2, &r3], Duration::from_secs(30)).await;
    r1.signal("CONT");
    // The former owner notices: its partitions are lost or fenced, none is kept.
    common::wait_until(
        "the paused owner gave its partitions up",
        Duration::from_secs(30),
        || {
            let a = before.clone();
            async move {
                let text = common::get_text(&format!("{a}/metrics")).await;
                metric(&text, "runner_lease_events_total{event=\"lost\"}")
                    + metric(&text, "runner_lease_events_total{event=\"fenced\"}")
                    >= 1.0
            }
        },
    )
    .await;
    let text = common::get_text(&format!("{before}/metrics")).await;
    println!(
        "paused owner: fenced publishes refused {}, leases lost {}, fenced {}",
        metric(&text, "runner_fenced_rejections_total"),
        metric(&text, "runner_lease_events_total{event=\"lost\"}"),
        metric(&text, "runner_lease_events_total{event=\"fenced\"}")
    );
    load.await.unwrap();
    assert_exactly_once(&cluster.url(2), accounts, k, Duration::from_secs(180)).await;
    assert_fences_monotonic(&cluster.url(0)).await;
    for r in [r1, r2, r3] {
        r.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_inbox_leader_node_mid_run_keeps_every_guarantee() {
    let mut cluster = Cluster::start(3);
    let r1 = replica(&cluster, "r1", tempfile::tempdir().unwrap(), &[]);
    let r2 = replica(&cluster, "r2", tempfile::tempdir().unwrap(), &[]);
    wait_balanced(&[&r1, &r2], Duration::from_secs(60)).await;
    let js = jetstream(&cluster.url(0)).await;
    let leader = js
        .get_stream("SAGA_INBOX")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .cluster
        .clone()
        .and_then(|c| c.leader)
        .unwrap();
    let idx: usize = leader.trim_start_matches('n').parse::<usize>().unwrap() - 1;
    let other = (idx + 1) % 3;
    let (accounts, k) = (20, 30);
    let url = cluster.url(other);
    let load = tokio::spawn(async move { deposit(&url, accounts, 1, k).await });
    let js_url = cluster.url(other);
    common::wait_until("some acknowledged", Duration::from_secs(120), || {
        let u = js_url.clone();
        async move { acknowledged(&u).await.values().map(Vec::len).sum::<usize>() >= accounts * 5 }
    })
    .await;
    cluster.stop_node(idx);
    let killed = Instant::now();
    println!("killed {leader}, the SAGA_INBOX leader");
    load.await.unwrap();
    println!(
        "all deposits published {:?} after the kill",
        killed.elapsed()
    );
    let (mut r1, mut r2) = (r1, r2);
    let done = common::eventually(Duration::from_secs(60), || {
        let u = cluster.url(other);
        async move {
            acknowledged(&u).await.values().map(Vec::len).sum::<usize>() >= accounts * k as usize
        }
    })
    .await;
    if !done {
        for r in [&mut r1, &mut r2] {
            r.logged("");
            let noisy: Vec<&String> = r.log.iter().filter(|l| !l.contains("\"INFO\"")).collect();
            for l in &noisy[noisy.len().saturating_sub(60)..] {
                println!("{l}");
            }
        }
    }
    println!("all acknowledged {:?} after the kill", killed.elapsed());
    assert_exactly_once(&cluster.url(other), accounts, k, Duration::from_secs(10)).await;
    r1.stop();
    r2.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_restarted_empty_restores_a_snapshot_and_republishes_nothing() {
    let cluster = Cluster::start(3);
    // Snapshots every 2 s; a de-duplication window of 1 s, far shorter than the gap between
    // the snapshot and the restart: the window cannot be what keeps outputs single.
    let env = [
        ("RUNNER__STREAMS__DUPLICATE_WINDOW", "1s"),
        ("RUNNER__PARTITIONS__SNAPSHOT_INTERVAL", "2s"),
    ];
    let r1 = replica(&cluster, "r1", tempfile::tempdir().unwrap(), &env);
    wait_balanced(&[&r1], Duration::from_secs(60)).await;
    let (accounts, k) = (16, 24);
    deposit(&cluster.url(0), accounts, 1, k / 3).await;
    assert_exactly_once(&cluster.url(0), accounts, k / 3, Duration::from_secs(120)).await;
    common::wait_until("snapshots taken", Duration::from_secs(30), || {
        let a = r1.admin.clone();
        async move {
            metric(
                &common::get_text(&format!("{a}/metrics")).await,
                "runner_snapshots_total",
            ) >= P as f64
        }
    })
    .await;
    // More work after the snapshot, published before the crash: the replay must not
    // publish it again.
    deposit(&cluster.url(0), accounts, k / 3 + 1, 2 * k / 3).await;
    assert_exactly_once(
        &cluster.url(0),
        accounts,
        2 * k / 3,
        Duration::from_secs(120),
    )
    .await;
    let _ = r1.kill();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let r2 = replica(&cluster, "r2", tempfile::tempdir().unwrap(), &env);
    deposit(&cluster.url(1), accounts, 2 * k / 3 + 1, k).await;
    assert_exactly_once(&cluster.url(2), accounts, k, Duration::from_secs(120)).await;
    let text = common::get_text(&format!("{}/metrics", r2.admin)).await;
    let restored = metric(
        &text,
        "runner_partition_restores_total{source=\"snapshot\"}",
    );
    let suppressed = metric(&text, "runner_relay_suppressed_total");
    println!(
        "empty restart: {restored} partitions restored from snapshots, {suppressed} outputs not republished"
    );
    assert!(restored >= 1.0, "the new replica restored from snapshots");
    assert!(
        suppressed >= 1.0,
        "the replay skipped what its predecessor had published"
    );
    r2.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_replica_hands_its_partitions_over_with_nothing_replayed() {
    let cluster = Cluster::start(3);
    let mut r1 = replica(&cluster, "r1", tempfile::tempdir().unwrap(), &[]);
    let mut r2 = replica(&cluster, "r2", tempfile::tempdir().unwrap(), &[]);
    let mut r3 = replica(&cluster, "r3", tempfile::tempdir().unwrap(), &[]);
    wait_balanced(&[&r1, &r2, &r3], Duration::from_secs(60)).await;
    let (accounts, k) = (24, 40);
    let url = cluster.url(0);
    let load = tokio::spawn(async move { deposit(&url, accounts, 1, k).await });
    let js_url = cluster.url(1);
    common::wait_until("some acknowledged", Duration::from_secs(120), || {
        let u = js_url.clone();
        async move { acknowledged(&u).await.values().map(Vec::len).sum::<usize>() >= accounts * 5 }
    })
    .await;
    let resp = reqwest::Client::new()
        .post(format!("{}/admin/drain", r2.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 202);
    assert_eq!(r2.wait_exit(Duration::from_secs(60)), Some(0));
    wait_balanced(&[&r1, &r3], Duration::from_secs(60)).await;
    load.await.unwrap();
    assert_exactly_once(&cluster.url(2), accounts, k, Duration::from_secs(180)).await;
    let mut replayed = 0.0;
    let mut from_snapshot = 0.0;
    let mut inherited = 0.0;
    for r in [&r1, &r3] {
        let text = common::get_text(&format!("{}/metrics", r.admin)).await;
        replayed += metric(&text, "runner_partition_replayed_inputs_total");
        from_snapshot += metric(
            &text,
            "runner_partition_restores_total{source=\"snapshot\"}",
        );
        inherited += metric(&text, "runner_lease_events_total{event=\"inherited\"}");
    }
    println!(
        "drain hand-over: {from_snapshot} partitions restored from snapshots, {inherited} leases inherited from hand-overs, {replayed} inputs replayed"
    );
    assert!(
        from_snapshot >= 1.0,
        "the heirs took the drained partitions from snapshots"
    );
    // Every drained partition was taken through a hand-over that named its snapshot (the
    // count also holds the hand-overs of the start-up balancing, restored locally).
    assert!(
        inherited >= from_snapshot,
        "{inherited} leases inherited, {from_snapshot} restored from snapshots"
    );
    if replayed > 0.0 {
        for (name, r) in [("r1", &mut r1), ("r2", &mut r2), ("r3", &mut r3)] {
            print_warnings(name, r);
        }
    }
    assert_eq!(replayed, 0.0, "a drain hands over with nothing replayed");
    r1.stop();
    r3.stop();
}
