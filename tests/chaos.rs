//! Chaos: random SIGKILL and SIGSTOP/SIGCONT of saga replicas, of effect replicas and of
//! NATS nodes while two workloads flow; then, with everything healed, nothing may be lost,
//! doubled or reordered, no effect may run twice under one lease, and the time each fault
//! stalled the output is printed.
//!
//! `scripts/chaos` runs it for a set time; in the ordinary test run it is short. Settings
//! (environment): `CHAOS_SECONDS` (chaos time per topology, default 20), `CHAOS_TOPOLOGY`
//! (`single`, `cluster` or `both`, default `both`), `CHAOS_SEED` (the random schedule;
//! printed, so a failing run can be replayed).
//!
//! Ledger workload (`tests/manifests/ledger.yaml`), with poison inputs mixed in: deposit n of
//! an account applies only when the account has seen exactly n-1, and each applied deposit
//! emits one acknowledgement, so lost, doubled or reordered work shows in the
//! acknowledgements; no output may be stored twice and the dead letters must hold exactly
//! the poison inputs. Two partitioned saga replicas share the work; the second writes its
//! store through the memory map (`storage.write_map`), so what the schedule does lands on
//! both write paths.
//!
//! Effect workload (`tests/manifests/chaos_shipment.yaml`, see `chaos/effects.rs`): the same
//! saga replicas place parcels whose one HTTP effect, run by two effect-mode replicas against
//! a counting upstream the test serves, completes the saga. Every parcel must complete
//! exactly once with the upstream's answer to its own command, every command must reach the
//! upstream, at most once per time its lease was taken (the claim's attempt count, plus the
//! last holder's retries), and no two calls of one command may be at the upstream at once
//! unless one was sent by a process just thawed (the upstream sees no fencing token, so a
//! call sent on a lease that ran out while frozen is the one double the design admits; those
//! are counted and printed apart).
//!
//! The schedule draws the faults from a shuffled bag (each of the six kinds and a quiet
//! spell once, in random order, then a new bag), so a short run still sees most kinds.
//!
//! Stalls: for each fault the time from the fault to the next output JetStream stored after
//! it (a ledger acknowledgement or a completed parcel, from their stored times) is printed
//! per fault kind (count, median, max), over both workloads and for each. A stall includes
//! the load's own gaps: a parcel every 250 ms, a ledger round every `CHAOS_SECONDS`/40 s.
//! Printed only: timings are not asserted.
//!
//! Killed replicas, saga or effect, restart on their data dir (a saga replica now and then
//! on an empty one). Real binaries, real nats-server, real libmdbx, a real HTTP server.
#![allow(clippy::unwrap_used)]

mod common;
#[path = "chaos/effects.rs"]
mod effects;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::*;
use effects::{EffectCounts, Effects};

/// The NATS side: one server or a three-node cluster.
enum Nats {
    Single(NatsServer),
    Cluster(Cluster),
}

impl Nats {
    fn urls(&self) -> String {
        match self {
            Nats::Single(s) => s.url(),
            Nats::Cluster(c) => c.urls(),
        }
    }
    fn nodes(&self) -> usize {
        match self {
            Nats::Single(_) => 1,
            Nats::Cluster(_) => 3,
        }
    }
    /// A URL of a node that is up (for the test's own clients).
    fn url_up(&self) -> String {
        match self {
            Nats::Single(s) => s.url(),
            Nats::Cluster(c) => (0..3)
                .find(|i| c.running(*i))
                .map(|i| c.url(i))
                .unwrap_or_else(|| c.url(0)),
        }
    }
    fn kill(&mut self, i: usize) {
        match self {
            Nats::Single(s) => s.stop(),
            Nats::Cluster(c) => c.stop_node(i),
        }
    }
    fn start(&mut self, i: usize) {
        match self {
            Nats::Single(s) => s.start_again(),
            Nats::Cluster(c) => c.start_node(i),
        }
    }
    fn signal(&self, i: usize, sig: &str) {
        match self {
            Nats::Single(s) => s.signal(sig),
            Nats::Cluster(c) => {
                c.signal_node(i, sig);
            }
        }
    }
}

fn replica(urls: &str, node: &str, dir: tempfile::TempDir, shipment: &str) -> RunnerProc {
    let replicas = if urls.contains(',') { "3" } else { "1" };
    let write_map = if node == "c2" { "true" } else { "false" };
    RunnerProc::start_in(
        dir,
        &[
            "--mode",
            "saga",
            "--nats-url",
            urls,
            "--manifest",
            "tests/manifests/ledger.yaml",
            "--manifest",
            shipment,
        ],
        &[
            ("RUNNER__PARTITIONS__COUNT", "8"),
            ("RUNNER__PARTITIONS__LEASE_TTL", "3s"),
            ("RUNNER__PARTITIONS__SNAPSHOT_INTERVAL", "5s"),
            ("RUNNER__STREAMS__REPLICAS", replicas),
            ("RUNNER__NATS__CONNECT_TIMEOUT", "120s"),
            ("RUNNER__NATS__SETUP_TIMEOUT", "120s"),
            ("RUNNER__NODE__ID", node),
            ("RUNNER__STORAGE__WRITE_MAP", write_map),
        ],
    )
}

/// Publishes `body` on `subject` with message id `id`, retrying until it is stored.
async fn publish_until_stored(
    url: &Arc<std::sync::Mutex<String>>,
    subject: &str,
    id: &str,
    body: Vec<u8>,
) {
    loop {
        let u = url.lock().unwrap().clone();
        let sent = async {
            let client = async_nats::ConnectOptions::new()
                .connection_timeout(Duration::from_secs(2))
                .connect(u.as_str())
                .await?;
            let mut js = async_nats::jetstream::new(client);
            js.set_timeout(Duration::from_secs(3));
            let mut h = async_nats::HeaderMap::new();
            h.insert(async_nats::header::NATS_MESSAGE_ID, id);
            js.publish_with_headers(subject.to_string(), h, body.clone().into())
                .await?
                .await
                .map_err(async_nats::Error::from)
        };
        if sent.await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[derive(Default, Debug)]
struct Counts {
    events: u64,
    poison: u64,
    runner_kills: u64,
    runner_pauses: u64,
    runner_wipes: u64,
    nats_kills: u64,
    nats_pauses: u64,
    lost: u64,
    doubled: u64,
    out_of_order: u64,
    outputs_stored_twice: u64,
    dead_letters: u64,
    dead_letters_unexpected: u64,
    effects: EffectCounts,
    /// Per fault kind, the stall after each fault of that kind (see [`stalls`]).
    stalls: BTreeMap<&'static str, Vec<Stall>>,
}

/// What followed one fault: how long until the next stored output of either workload, and
/// of each (`None`: nothing was stored after it).
#[derive(Debug, Clone, Copy)]
struct Stall {
    any: Option<u64>,
    ack: Option<u64>,
    order: Option<u64>,
}

/// For each fault (kind, wall time in ms), the time to the first output stored at or after
/// it, among `acks` and `orders` (stored times in ms, in any order).
fn stalls(
    faults: &[(&'static str, u64)],
    acks: &[u64],
    orders: &[u64],
) -> BTreeMap<&'static str, Vec<Stall>> {
    let sorted = |v: &[u64]| {
        let mut v = v.to_vec();
        v.sort_unstable();
        v
    };
    let (acks, orders) = (sorted(acks), sorted(orders));
    let next = |v: &[u64], at: u64| v.get(v.partition_point(|t| *t < at)).map(|t| t - at);
    let mut out: BTreeMap<&'static str, Vec<Stall>> = BTreeMap::new();
    for (kind, at) in faults {
        let (ack, order) = (next(&acks, *at), next(&orders, *at));
        let any = match (ack, order) {
            (Some(a), Some(o)) => Some(a.min(o)),
            (a, o) => a.or(o),
        };
        out.entry(kind).or_default().push(Stall { any, ack, order });
    }
    out
}

/// The median (upper) and the largest of `ms`, in seconds as text (`-` when empty).
fn p50_max(ms: impl Iterator<Item = u64>) -> (String, String) {
    let mut v: Vec<u64> = ms.collect();
    v.sort_unstable();
    let secs = |i: usize| format!("{:.1}s", v[i] as f64 / 1000.0);
    if v.is_empty() {
        ("-".into(), "-".into())
    } else {
        (secs(v.len() / 2), secs(v.len() - 1))
    }
}

async fn run(topology: &str, seconds: u64, seed: u64) -> Counts {
    let mut rng = SplitMix(seed);
    let mut nats = if topology == "cluster" {
        let c = Cluster::start(3);
        c.wait_formed(Duration::from_secs(60));
        Nats::Cluster(c)
    } else {
        Nats::Single(NatsServer::start())
    };
    let urls = nats.urls();
    let mut effects = Effects::new(&urls);
    let shipment = effects.manifest();
    let mut replicas: Vec<Option<RunnerProc>> = vec![
        Some(replica(
            &urls,
            "c1",
            tempfile::tempdir().unwrap(),
            &shipment,
        )),
        Some(replica(
            &urls,
            "c2",
            tempfile::tempdir().unwrap(),
            &shipment,
        )),
    ];
    effects.start_replicas();
    let (accounts, per_account) = (12u64, 40u64);
    // Four parcels a second over the chaos time.
    let orders = (seconds * 4).max(40);
    let counts = Arc::new(AtomicU64::new(0));
    let poison_sent = Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let url_cell = Arc::new(std::sync::Mutex::new(nats.url_up()));
    let done = Arc::new(AtomicBool::new(false));
    // The load: deposits 1..=K for every account, one round at a time, a poison input
    // every few rounds, paced over the chaos time.
    let load = {
        let (counts, poison_sent, url_cell, done) = (
            counts.clone(),
            poison_sent.clone(),
            url_cell.clone(),
            done.clone(),
        );
        let pace = Duration::from_millis(seconds * 1000 / per_account);
        tokio::spawn(async move {
            for n in 1..=per_account {
                for a in 0..accounts {
                    let (subject, ev) = common::ledger_deposit(a, n);
                    let mid = format!("dep-{a}-{n}");
                    publish_until_stored(
                        &url_cell,
                        &subject,
                        &mid,
                        serde_json::to_vec(&ev).unwrap(),
                    )
                    .await;
                    counts.fetch_add(1, Ordering::SeqCst);
                }
                if n % 4 == 0 {
                    let subject = format!("tenant.bank.aggregate.Account.poison-{n}");
                    let mid = format!("poison-{n}");
                    publish_until_stored(&url_cell, &subject, &mid, b"\x01not json".to_vec()).await;
                    poison_sent.lock().unwrap().insert(subject);
                }
                tokio::time::sleep(pace).await;
            }
            done.store(true, Ordering::SeqCst);
        })
    };
    let parcels = Effects::load(url_cell.clone(), orders, seconds);

    let mut c = Counts::default();
    // Each fault with the wall time it was injected at (ms since the epoch).
    let mut faults: Vec<(&'static str, u64)> = Vec::new();
    // The next faults: every kind once (a quiet spell is one) in a random order, then again,
    // so even a short run sees the kinds in the first bag.
    let mut bag: Vec<u64> = Vec::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(seconds) {
        tokio::time::sleep(rng.millis(1000, 3000)).await;
        if bag.is_empty() {
            bag = (0..7).collect();
            for i in (1..bag.len()).rev() {
                bag.swap(i, rng.below(i as u64 + 1) as usize);
            }
        }
        match bag.pop().unwrap() {
            0 => {
                // SIGKILL a replica; restart it on its store, or now and then on an empty one.
                let i = rng.below(2) as usize;
                if let Some(r) = replicas[i].take() {
                    faults.push(("runner_kill", runner::clock::now_ms()));
                    let dir = r.kill();
                    let dir = if rng.below(4) == 0 {
                        c.runner_wipes += 1;
                        tempfile::tempdir().unwrap()
                    } else {
                        dir
                    };
                    c.runner_kills += 1;
                    tokio::time::sleep(rng.millis(200, 2000)).await;
                    replicas[i] = Some(replica(&urls, &format!("c{}", i + 1), dir, &shipment));
                }
            }
            1 => {
                // Freeze a replica past its lease, then let it go on (a zombie).
                let i = rng.below(2) as usize;
                if let Some(r) = &replicas[i] {
                    faults.push(("runner_pause", runner::clock::now_ms()));
                    r.signal("STOP");
                    tokio::time::sleep(rng.millis(1000, 5000)).await;
                    r.signal("CONT");
                    c.runner_pauses += 1;
                }
            }
            2 => {
                // SIGKILL a NATS node, restart it on its store.
                let i = rng.below(nats.nodes() as u64) as usize;
                faults.push(("nats_kill", runner::clock::now_ms()));
                nats.kill(i);
                c.nats_kills += 1;
                tokio::time::sleep(rng.millis(500, 3000)).await;
                nats.start(i);
                effects.thawed("nats");
                *url_cell.lock().unwrap() = nats.url_up();
            }
            3 => {
                let i = rng.below(nats.nodes() as u64) as usize;
                faults.push(("nats_pause", runner::clock::now_ms()));
                nats.signal(i, "STOP");
                tokio::time::sleep(rng.millis(1000, 4000)).await;
                nats.signal(i, "CONT");
                effects.thawed("nats");
                c.nats_pauses += 1;
            }
            4 => {
                // SIGKILL an effect replica (mid-call, likely), restart it on its data dir.
                let i = rng.below(2) as usize;
                faults.push(("effect_kill", runner::clock::now_ms()));
                effects.kill(i, rng.millis(200, 2000)).await;
            }
            5 => {
                // Freeze an effect replica, often past its claims' leases (3 s).
                let i = rng.below(2) as usize;
                faults.push(("effect_pause", runner::clock::now_ms()));
                effects.pause(i, rng.millis(1000, 5000)).await;
            }
            _ => {} // a quiet spell
        }
    }
    // Let the loads finish and the replicas settle.
    let deadline = Instant::now() + Duration::from_secs(240);
    while !done.load(Ordering::SeqCst) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    load.await.unwrap();
    parcels.await.unwrap();
    c.events = counts.load(Ordering::SeqCst);
    let poison = poison_sent.lock().unwrap().clone();
    c.poison = poison.len() as u64;

    // Wait until every acknowledgement is there (or the deadline), then judge.
    let url = nats.url_up();
    let want = accounts * per_account;
    let deadline = Instant::now() + Duration::from_secs(240);
    let acks = loop {
        let seen =
            read_stream_timed(&url, "WORKFLOW_COMMANDS", "tenant.bank.command.Account.*").await;
        if let Some(s) = seen
            && (s.len() as u64 >= want || Instant::now() > deadline)
        {
            break s;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let mut per: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut ids = BTreeSet::new();
    for (subject, id, body, _) in &acks {
        if !ids.insert(id.clone()) {
            c.outputs_stored_twice += 1;
        }
        let n = body["payload"]["n"]
            .as_u64()
            .or_else(|| body["payload"]["n"].as_str().and_then(|v| v.parse().ok()))
            .unwrap_or(0);
        per.entry(subject.rsplit('.').next().unwrap().to_string())
            .or_default()
            .push(n);
    }
    for a in 0..accounts {
        let got = per.remove(&format!("a-{a}")).unwrap_or_default();
        let distinct: BTreeSet<u64> = got.iter().copied().collect();
        c.lost += per_account - distinct.len() as u64;
        c.doubled += (got.len() - distinct.len()) as u64;
        if got.windows(2).any(|w| w[0] >= w[1]) {
            c.out_of_order += 1;
        }
    }
    let dead = loop {
        if let Some(d) = read_stream_once(&url, "RUNNER_DLQ", "tenant.bank.deadletter.>").await {
            let subjects: BTreeSet<String> = d
                .iter()
                .filter_map(|(_, _, b)| b["subject"].as_str().map(str::to_string))
                .collect();
            if subjects.len() as u64 >= c.poison || Instant::now() > deadline {
                break subjects;
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    c.dead_letters = dead.len() as u64;
    c.dead_letters_unexpected =
        dead.difference(&poison).count() as u64 + poison.difference(&dead).count() as u64;

    c.effects = effects.judge(&url, orders, Duration::from_secs(240)).await;
    let ack_times: Vec<u64> = acks.iter().map(|m| m.3).collect();
    c.stalls = stalls(&faults, &ack_times, &c.effects.completion_times);
    drop(replicas);
    drop(effects);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_work_is_lost_or_doubled_under_kills_and_pauses() {
    let seconds: u64 = std::env::var("CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let topology = std::env::var("CHAOS_TOPOLOGY").unwrap_or_else(|_| "both".into());
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(runner::clock::now_ms);
    let topologies: Vec<&str> = match topology.as_str() {
        "both" => vec!["single", "cluster"],
        t => vec![t],
    };
    for t in topologies {
        let started = Instant::now();
        let c = run(t, seconds, seed).await;
        println!(
            "chaos: topology={t} seed={seed} seconds={seconds} took={:.0}s events={} poison={} \
             runner_kills={} runner_wipes={} runner_pauses={} nats_kills={} nats_pauses={} \
             lost={} doubled={} out_of_order={} outputs_stored_twice={} dead_letters={} \
             dead_letters_unexpected={}",
            started.elapsed().as_secs_f64(),
            c.events,
            c.poison,
            c.runner_kills,
            c.runner_wipes,
            c.runner_pauses,
            c.nats_kills,
            c.nats_pauses,
            c.lost,
            c.doubled,
            c.out_of_order,
            c.outputs_stored_twice,
            c.dead_letters,
            c.dead_letters_unexpected
        );
        let e = &c.effects;
        println!(
            "chaos: topology={t} seed={seed} orders={} orders_completed={} orders_lost={} \
             orders_unshipped={} orders_doubled={} orders_failed={} tracking_wrong={} \
             effect_outputs_stored_twice={} effect_kills={} effect_pauses={} effect_commands={} \
             effect_calls={} effect_keys={} effect_unexecuted={} effect_stray_calls={} \
             effect_lease_takes={} effect_reexecuted_after_fault={} effect_over_lease={} \
             effect_overlaps={} effect_overlaps_after_thaw={}",
            e.orders,
            e.completed,
            e.lost,
            e.lost_shipped,
            e.doubled,
            e.failed,
            e.tracking_wrong,
            e.outputs_stored_twice,
            e.kills,
            e.pauses,
            e.commands,
            e.calls,
            e.keys,
            e.unexecuted,
            e.strange_calls,
            e.lease_takes,
            e.reexecuted,
            e.over_lease,
            e.overlaps,
            e.overlaps_after_thaw
        );
        for (kind, s) in &c.stalls {
            let (p50, max) = p50_max(s.iter().filter_map(|s| s.any));
            let (ack_p50, ack_max) = p50_max(s.iter().filter_map(|s| s.ack));
            let (order_p50, order_max) = p50_max(s.iter().filter_map(|s| s.order));
            println!(
                "chaos: topology={t} stall after {kind} n={} p50={p50} max={max} \
                 ack_p50={ack_p50} ack_max={ack_max} order_p50={order_p50} order_max={order_max} \
                 no_output_after={}",
                s.len(),
                s.iter().filter(|s| s.any.is_none()).count()
            );
        }
        assert_eq!(
            (
                c.lost,
                c.doubled,
                c.out_of_order,
                c.outputs_stored_twice,
                c.dead_letters_unexpected
            ),
            (0, 0, 0, 0, 0),
            "chaos found a fault (replay with CHAOS_SEED={seed} CHAOS_TOPOLOGY={t}); counts above"
        );
        assert_eq!(
            e.faults(),
            [0; 10],
            "chaos found an effect fault (replay with CHAOS_SEED={seed} CHAOS_TOPOLOGY={t}): \
             {:#?}",
            e.findings
        );
    }
}
