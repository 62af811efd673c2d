//! The `cluster` scenario: the order pipeline (`bench/order.yaml`, noop effects) on a
//! three-node nats-server cluster on loopback with R3 streams, run by partitioned runner
//! replicas, beside the messaging limit of the same flow on the same cluster in the same run.
//!
//! Each replica is `runner run --mode combined` with `partitions.enabled`: it owns its
//! share of the P saga partitions under leases, routes inputs into the saga inbox, publishes
//! through fenced atomic batches, and takes effect commands from the durable consumers it
//! shares with the others.
//!
//! 1. **Throughput by replica count** (default 1, then 3): replicas are added (never
//!    restarted) until there are as many as the step asks; once they hold all P partitions,
//!    balanced within one, and a router for each source, N orders are driven at the maximum rate ([`crate::pipeline::drive`]).
//!    Transitions/s are the applied transitions summed over the replicas' metrics, divided by
//!    the time from the first publish to the last OrderFulfilled stored.
//!    Last of all (after the limit, step 3), as many fresh replicas as the largest count
//!    open loop at fractions of the sagas/s that count reached (`cluster_load.rs`).
//! 2. **Fail-over**: N orders again; once a third are complete the last replica is killed
//!    (SIGKILL). Reported: which routers it held; when a survivor is first seen owning one of
//!    its partitions and when the survivors hold all P and every router (their `/info`,
//!    polled every 50 ms, so up to that much late); when an order of its partitions completes again (the first OrderFulfilled of
//!    such an order stored after a survivor took one of them — earlier ones can be the
//!    killed replica's last batch); how many orders were waiting in its partitions; whether
//!    any order completed twice.
//! 3. **The messaging limit**, the replicas gone: `runner-bench limit` partitioned like the
//!    runner (routers into an inbox of P partitions, one consumer and relay per partition),
//!    on R3 streams, in three variants: fenced atomic batches (the runner's way; the ratio's
//!    denominator), the same batches without the expected-sequence header, and plain
//!    publishes with no batches and no markers. The first two differ only by the header;
//!    the last shows what batching and markers cost on top. They run in interleaved rounds
//!    (default 3), so load that comes and goes on the machine hits them alike, and each is
//!    reported by its median.

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use async_nats::jetstream;
use futures::StreamExt;
use runner::worker::partition::partition;

use crate::cgroup::Cap;
use crate::harness::{Nats, NatsCluster, Programs, Runner, WorkDir};
use crate::pipeline::{Flow, QUIET, TRANSITIONS_PER_ORDER, drive, median};
use crate::probe::{Sampler, cpu_seconds};
use crate::tail;

#[path = "cluster_load.rs"]
mod load;

#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    #[command(flatten)]
    programs: Programs,
    /// Orders per measurement.
    #[arg(long, env = "BENCH_CLUSTER_ORDERS", default_value_t = 10_000)]
    orders: u64,
    /// Replica counts measured in turn (replicas are added, never restarted).
    #[arg(
        long,
        env = "BENCH_CLUSTER_REPLICAS",
        value_delimiter = ',',
        default_value = "1,3"
    )]
    replicas: Vec<usize>,
    /// Partitions P.
    #[arg(long, env = "BENCH_CLUSTER_PARTITIONS", default_value_t = 64)]
    partitions: u32,
    /// The replicas' lease TTL: a killed replica's partitions are free this long after its
    /// last renewal.
    #[arg(long, env = "BENCH_CLUSTER_LEASE_TTL", default_value = "10s", value_parser = humantime::parse_duration)]
    lease_ttl: Duration,
    /// The replicas' `effect.ack_wait` (default: the runner's, 20 s). Effect commands the
    /// killed replica had taken are delivered again only after it.
    #[arg(long, env = "BENCH_CLUSTER_EFFECT_ACK_WAIT", value_parser = humantime::parse_duration)]
    effect_ack_wait: Option<Duration>,
    /// The replicas' `effect.lease_ttl` (default: the runner's, 15 s). A command the killed
    /// replica had claimed is executed again only once its claim lease has run out.
    #[arg(long, env = "BENCH_CLUSTER_EFFECT_LEASE_TTL", value_parser = humantime::parse_duration)]
    effect_lease_ttl: Option<Duration>,
    /// Cores each replica may use (cgroup v1 `cpu.cfs_quota_us`, needs root), the same cap
    /// for every replica count; unset: uncapped. Three NATS nodes use most of this
    /// machine, so only capped replicas show what adding replicas adds.
    #[arg(long, env = "BENCH_CLUSTER_CPU")]
    cpu: Option<f64>,
    /// Orders of the fail-over run (0 skips it; default: as many as a measurement).
    #[arg(long, env = "BENCH_CLUSTER_FAILOVER_ORDERS")]
    failover_orders: Option<u64>,
    /// Rounds of the three limit variants (interleaved; each reported by its median).
    #[arg(long, env = "BENCH_CLUSTER_LIMIT_ROUNDS", default_value_t = 3)]
    limit_rounds: usize,
    /// The order manifest with noop effects.
    #[arg(long, default_value = "bench/order.yaml")]
    manifest: PathBuf,
    #[command(flatten)]
    load: load::LoadArgs,
}

/// Nodes in the NATS cluster (and replicas of every stream).
const NODES: usize = 3;
/// Source streams a partitioned deployment routes (AGGREGATE_EVENTS, WORKFLOW_EVENTS).
const SOURCES: usize = 2;

pub(crate) async fn run(a: Args) -> Result<()> {
    let mut counts: Vec<usize> = a.replicas.iter().copied().filter(|n| *n > 0).collect();
    counts.sort_unstable();
    counts.dedup();
    if counts.is_empty() || a.partitions == 0 {
        bail!("cluster: need at least one replica count above 0 and at least one partition");
    }
    let open_plan = a.load.plan(a.orders)?;
    let work = WorkDir::new("cluster", a.programs.keep)?;
    let cluster = NatsCluster::start(&a.programs.nats_server, &work.path, NODES).await?;
    println!(
        "cluster: {} cores, nats-server {}, {NODES}-node cluster on loopback, R{NODES} streams; {} orders per run; order saga (4 transitions, 6 outputs, 3 effect commands per order), noop effects; runner replicas in combined mode, partitioned (P={}, lease TTL {}), durability full",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        Nats::version(&a.programs.nats_server),
        a.orders,
        a.partitions,
        humantime::format_duration(a.lease_ttl),
    );
    let js = jetstream::new(crate::connect(&cluster.urls).await?);
    let settle = a.lease_ttl * 2 + Duration::from_secs(60);
    match a.cpu {
        Some(cores) => println!(
            "cluster: each replica capped at {cores} of a core (cgroup v1 cpu.cfs_quota_us), the same for every replica count"
        ),
        None => println!("cluster: replicas uncapped (BENCH_CLUSTER_CPU unset)"),
    }

    // Declared before the replicas, so the caps are removed after the replicas are gone.
    let mut caps: Vec<Cap> = Vec::new();
    let mut replicas: Vec<Runner> = Vec::new();
    let (mut runner_tps, mut max_sagas) = (Vec::new(), f64::NAN);
    for &n in &counts {
        while replicas.len() < n {
            let name = format!("r{}", replicas.len() + 1);
            replicas.push(start_replica(&a, &work.path, &cluster.urls, &name, &mut caps).await?);
        }
        let took = wait_owned(&replicas, a.partitions, true, settle).await?;
        println!(
            "cluster: {n} replica(s) hold all {} partitions, balanced within one, and every router, {:.1}s after the last one was ready",
            a.partitions,
            took.as_secs_f64()
        );
        let (tps, sagas) = measure(&js, &replicas, &cluster, a.orders).await?;
        runner_tps.push((n, tps));
        max_sagas = sagas;
    }
    let largest = replicas.len();

    let failover_orders = a.failover_orders.unwrap_or(a.orders);
    let failover = if failover_orders > 0 && replicas.len() >= 2 {
        Some(failover(&js, &mut replicas, &a, failover_orders).await?)
    } else {
        println!("cluster: fail-over skipped (needs 2 or more replicas and orders above 0)");
        None
    };
    // The runner is measured; the limit runs with no replica left.
    replicas.clear();

    // Rounds of the three variants, interleaved, so load that comes and goes on the machine
    // hits them alike; each is reported by its median.
    let variants = ["fenced", "batch", "plain"];
    let mut limits: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 1..=a.limit_rounds.max(1) {
        for (i, publish) in variants.iter().enumerate() {
            let label = format!("{publish}, round {round}");
            limits[i].push(limit(&js, &cluster, &work.path, &a, publish, &label).await?);
        }
    }
    let per_round = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (fenced, batch, plain) = (median(&limits[0]), median(&limits[1]), median(&limits[2]));

    // The open loop last, on fresh replicas, so the limit runs after the same work as in
    // earlier versions of this scenario (the open loop's orders ahead of it made it slower).
    let open_loop = if let Some((loads, orders)) = &open_plan {
        for i in 0..largest {
            let name = format!("open{}", i + 1);
            replicas.push(start_replica(&a, &work.path, &cluster.urls, &name, &mut caps).await?);
        }
        let took = wait_owned(&replicas, a.partitions, true, settle).await?;
        let (replayed, quiet) = load::caught_up(&replicas, settle).await?;
        println!(
            "cluster: {largest} fresh replica(s) for the open loop hold all {} partitions, {:.1}s after the last one was ready; caught up (inputs replayed since their snapshots: {replayed:.0}) {:.1}s later",
            a.partitions,
            took.as_secs_f64(),
            quiet.as_secs_f64()
        );
        let runs = load::open_loop(&js, &replicas, &cluster, (loads, *orders), max_sagas).await?;
        replicas.clear();
        runs
    } else {
        println!("cluster: open loop skipped (BENCH_CLUSTER_LOADS empty or 0, or no orders)");
        Vec::new()
    };
    let open_what = format!("cluster, {largest} replicas, open loop");
    for (n, tps) in &runner_tps {
        println!(
            "result: cluster replicas={n} runner {tps:.0} transitions/s, messaging limit {fenced:.0}/s, ratio {:.2}",
            tps / fenced
        );
    }
    scaling(&runner_tps, a.cpu);
    if let Some((n, tps)) = runner_tps.iter().find(|(n, _)| *n == 3) {
        println!(
            "{}",
            crate::goals::line(
                &format!("cluster, {n} replicas, ratio to the fenced limit"),
                tps / fenced,
                "",
                crate::goals::Bound::AtLeast,
                crate::goals::CLUSTER_RATIO,
            )
        );
    }
    for line in crate::goals::open_loop(&open_what, &open_loop) {
        println!("{line}");
    }
    println!(
        "fencing cost: limit with fence {fenced:.0}/s, without {batch:.0}/s (the same atomic batches and markers, no expected-sequence header; {:+.0}%); plain publishes, no batches: {plain:.0}/s ({:+.0}% for fenced batches); medians of {} round(s): fenced {}, without {}, plain {}",
        100.0 * (fenced / batch - 1.0),
        100.0 * (fenced / plain - 1.0),
        limits[0].len(),
        per_round(&limits[0]),
        per_round(&limits[1]),
        per_round(&limits[2]),
    );
    if let Some(line) = failover {
        println!("{line}");
    }
    Ok(())
}

/// Starts partitioned replica `name` against every node of the cluster.
/// The `scaling:` line, the most replicas over one, and with a CPU cap its goal line.
fn scaling(runner_tps: &[(usize, f64)], cpu: Option<f64>) {
    let (Some((1, one)), Some((n, most))) = (runner_tps.first(), runner_tps.last()) else {
        return;
    };
    if *n < 2 {
        return;
    }
    let cap = cpu.map_or("uncapped".to_string(), |c| {
        format!("each capped at {c} of a core")
    });
    println!(
        "scaling: {n} replicas {most:.0} transitions/s, 1 replica {one:.0}/s: {:.2}x, efficiency {:.2} ({cap})",
        most / one,
        most / one / *n as f64
    );
    if cpu.is_some() {
        println!(
            "{}",
            crate::goals::line(
                &format!("cluster, {n} capped replicas over one"),
                most / one,
                "x",
                crate::goals::Bound::AtLeast,
                // 0.8 × 3 printed as 2.4, not 2.4000000000000004.
                (crate::goals::CAPPED_SCALING * *n as f64 * 100.0).round() / 100.0,
            )
        );
    }
}

/// Capped at `a.cpu` cores when set; its cap joins `caps`.
async fn start_replica(
    a: &Args,
    dir: &Path,
    urls: &str,
    name: &str,
    caps: &mut Vec<Cap>,
) -> Result<Runner> {
    let (p, ttl) = (
        a.partitions.to_string(),
        humantime::format_duration(a.lease_ttl).to_string(),
    );
    let replicas = NODES.to_string();
    let human = |d: Option<Duration>| d.map(|d| humantime::format_duration(d).to_string());
    let (ack_wait, effect_lease) = (human(a.effect_ack_wait), human(a.effect_lease_ttl));
    let mut env = vec![
        ("RUNNER__PARTITIONS__COUNT", p.as_str()),
        ("RUNNER__PARTITIONS__LEASE_TTL", ttl.as_str()),
        ("RUNNER__STREAMS__REPLICAS", replicas.as_str()),
        ("RUNNER__NODE__ID", name),
    ];
    if let Some(w) = &ack_wait {
        env.push(("RUNNER__EFFECT__ACK_WAIT", w.as_str()));
    }
    if let Some(l) = &effect_lease {
        env.push(("RUNNER__EFFECT__LEASE_TTL", l.as_str()));
    }
    let bin = &a.programs.runner;
    let runner = Runner::start_named(bin, dir, name, urls, "combined", &a.manifest, &env).await?;
    if let Some(cores) = a.cpu {
        let group = format!("{}-{name}", std::process::id());
        caps.push(Cap::new(&group, runner.proc.pid(), cores)?);
    }
    Ok(runner)
}

/// What a replica holds: partitions and routed sources.
#[derive(Default)]
struct Held {
    partitions: BTreeSet<u32>,
    routers: BTreeSet<String>,
}

/// What a replica reports holding (`/info` → `partitions.owned`, `partitions.routing`).
async fn held(r: &Runner) -> Held {
    let Ok(info) = r.info().await else {
        return Held::default();
    };
    let keys = |v: &serde_json::Value| -> Vec<String> {
        v.as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    };
    Held {
        partitions: keys(&info["partitions"]["owned"])
            .iter()
            .filter_map(|k| k.parse().ok())
            .collect(),
        routers: keys(&info["partitions"]["routing"]).into_iter().collect(),
    }
}

/// Whether `replicas` together hold each of the `p` partitions once and a router for every
/// source; also the partitions each holds.
async fn whole(replicas: &[Runner], p: u32) -> (bool, Vec<BTreeSet<u32>>) {
    let (mut each, mut all, mut routers) = (Vec::new(), BTreeSet::new(), BTreeSet::new());
    for r in replicas {
        let h = held(r).await;
        all.extend(h.partitions.iter().copied());
        routers.extend(h.routers);
        each.push(h.partitions);
    }
    let sum: usize = each.iter().map(BTreeSet::len).sum();
    let whole = all.len() == p as usize && sum == p as usize && routers.len() >= SOURCES;
    (whole, each)
}

/// Waits until `replicas` together hold each of the `p` partitions once and every router
/// (and, if `balanced`, each replica within one partition of the others); returns how long
/// that took.
async fn wait_owned(
    replicas: &[Runner],
    p: u32,
    balanced: bool,
    timeout: Duration,
) -> Result<Duration> {
    let started = Instant::now();
    loop {
        let (whole, each) = whole(replicas, p).await;
        let counts: Vec<usize> = each.iter().map(BTreeSet::len).collect();
        let (lo, hi) = (
            counts.iter().min().copied().unwrap_or(0),
            counts.iter().max().copied().unwrap_or(0),
        );
        if whole && (!balanced || hi - lo <= 1) {
            return Ok(started.elapsed());
        }
        if started.elapsed() > timeout {
            bail!(
                "partitions and routers not all held after {timeout:?}: partitions per replica {counts:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Applied order transitions summed over `replicas`.
async fn applied(replicas: &[Runner]) -> Result<f64> {
    let mut sum = 0.0;
    for r in replicas {
        sum += r
            .client()
            .sum(
                "runner_saga_transitions_total",
                &[("saga", "order"), ("outcome", "applied")],
            )
            .await?;
    }
    Ok(sum)
}

/// Drives `orders` orders at the maximum rate through `replicas`; prints the drive and the
/// CPU of the replicas and of the NATS nodes; returns transitions/s and sagas/s.
async fn measure(
    js: &jetstream::Context,
    replicas: &[Runner],
    cluster: &NatsCluster,
    orders: u64,
) -> Result<(f64, f64)> {
    let n = replicas.len();
    let before = applied(replicas).await?;
    let watch = load::Watch::start(replicas, cluster);
    let traffic0 = cluster.traffic().await;
    let counts0 = cluster.counts().await;
    let flow = Flow::Runner {
        tenant: format!("c{n}"),
    };
    let mut d = drive(js, &flow, orders, 0.0, QUIET).await?;
    let traffic = cluster.traffic().await.since(&traffic0);
    let counts = cluster.counts().await;
    let usage = watch.finish(d.elapsed).await;
    let transitions = applied(replicas).await? - before;
    println!(
        "{}",
        d.line(&format!("runner, {n} replica(s), max rate"), transitions)
    );
    println!("{usage}");
    println!("  nats per order: {}", traffic.line(orders as f64));
    println!("  stream leaders: {}", cluster.leaders().await);
    // Ordered consumers come and go with their names: only durable ones and streams last.
    let per: Vec<String> = counts
        .iter()
        .filter_map(|(k, v)| {
            let was = counts0.get(k)?;
            let (d, r) = (v[0].saturating_sub(was[0]), v[1].saturating_sub(was[1]));
            (d > 0).then(|| {
                format!(
                    "{k}={:.2}/{:.2}",
                    d as f64 / orders as f64,
                    r as f64 / orders as f64
                )
            })
        })
        .collect();
    println!(
        "  per order, stored or delivered/redelivered: {}",
        per.join(" ")
    );
    if d.completed as u64 != orders {
        bail!(
            "only {} of {orders} orders completed with {n} replica(s) (run with --keep for the logs)",
            d.completed
        );
    }
    Ok((transitions / d.elapsed, d.sagas_per_s()))
}

/// The fail-over run (module doc, step 2); returns its summary line (printed last).
async fn failover(
    js: &jetstream::Context,
    replicas: &mut Vec<Runner>,
    a: &Args,
    orders: u64,
) -> Result<String> {
    let p = a.partitions;
    let tenant = "failover";
    let ack_wait = a.effect_ack_wait.unwrap_or(Duration::from_secs(30));
    let effect_lease = a.effect_lease_ttl.unwrap_or(Duration::from_secs(15));
    let quiet = QUIET.max(a.lease_ttl * 3 + ack_wait + effect_lease + Duration::from_secs(30));
    // Every OrderFulfilled of this run, with the instant it was seen stored.
    let flow = Flow::Runner {
        tenant: tenant.to_owned(),
    };
    let (stream, filter) = flow.final_output();
    let mut seen = tail(js, stream, &[filter]).await?;
    let done = Arc::new(AtomicUsize::new(0));
    let completions: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let collector = tokio::spawn({
        let (done, completions, flow) = (done.clone(), completions.clone(), flow.clone());
        async move {
            let mut distinct = HashSet::new();
            while distinct.len() < orders as usize {
                let Ok(Some(m)) = tokio::time::timeout(quiet, seen.next()).await else {
                    break;
                };
                // Only OrderFulfilled completes an order (the saga's own SagaCompleted
                // shares its subject).
                let Some(id) = flow.order_of(m.subject.as_str(), &m.payload, false) else {
                    continue;
                };
                distinct.insert(id.clone());
                done.store(distinct.len(), Ordering::SeqCst);
                if let Ok(mut c) = completions.lock() {
                    c.push((id, m.at));
                }
            }
        }
    });
    let driver = tokio::spawn({
        let js = js.clone();
        async move { drive(&js, &flow, orders, 0.0, quiet).await }
    });

    // Kill the last replica once a third of the orders are complete.
    let third = (orders as usize / 3).max(1);
    let wait_until = Instant::now() + quiet;
    while done.load(Ordering::SeqCst) < third {
        if driver.is_finished() || Instant::now() > wait_until {
            bail!("the fail-over run did not reach a third of its orders");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let victim_at = replicas.len() - 1;
    let victim = held(&replicas[victim_at]).await;
    let victim_parts = victim.partitions;
    let victim_name = format!("r{}", replicas.len());
    replicas[victim_at].proc.kill();
    let killed = Instant::now();
    let done_at_kill = done.load(Ordering::SeqCst);
    replicas.truncate(victim_at);

    // Poll the survivors until they hold every partition and router.
    let (mut first_taken, mut all_owned) = (None, None);
    let deadline = killed + a.lease_ttl * 3 + Duration::from_secs(60);
    while all_owned.is_none() {
        let (whole, each) = whole(replicas, p).await;
        let now = Instant::now();
        if first_taken.is_none() && each.iter().any(|o| !o.is_disjoint(&victim_parts)) {
            first_taken = Some(now);
        }
        if whole {
            all_owned = Some(now);
        }
        if now > deadline {
            bail!("the survivors did not hold every partition and router in time");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut d = driver.await??;
    collector.await?;
    let completions = completions.lock().map(|c| c.clone()).unwrap_or_default();

    let in_victim = |id: &str| victim_parts.contains(&partition(tenant, "order", id, p));
    let taken = first_taken.unwrap_or(killed);
    let resumed = completions
        .iter()
        .filter(|(id, at)| *at >= taken && in_victim(id))
        .map(|(_, at)| at.duration_since(killed))
        .min();
    let before_kill: HashSet<&str> = completions
        .iter()
        .filter(|(_, at)| *at < killed)
        .map(|(id, _)| id.as_str())
        .collect();
    let waiting = (0..orders)
        .map(|i| format!("o-{i}"))
        .filter(|id| in_victim(id) && !before_kill.contains(id.as_str()))
        .count();
    let last = completions.iter().map(|(_, at)| *at).max();
    let distinct: HashSet<&str> = completions.iter().map(|(id, _)| id.as_str()).collect();
    let duplicates = completions.len() - distinct.len();
    let transitions = d.completed as f64 * TRANSITIONS_PER_ORDER;
    println!("{}", d.line("runner, fail-over run", transitions));
    let secs = |t: Option<Instant>| {
        t.map_or("never".into(), |t| {
            format!("{:.1}s", t.duration_since(killed).as_secs_f64())
        })
    };
    let line = format!(
        "fail-over: SIGKILL of {victim_name} (owning {} of {p} partitions, {waiting} orders waiting in them; routing {}) after {done_at_kill} of {orders} orders completed, lease TTL {}; a survivor owned one of its partitions after {}, all {p} and every router held after {}; its orders completing again after {}; the last order completed after {} (effect commands the killed replica had taken come again after effect.ack_wait, {}, and run again once its claim lease, effect.lease_ttl {}, has run out); {} of {orders} completed, {duplicates} completed twice",
        victim_parts.len(),
        if victim.routers.is_empty() {
            "no source".to_string()
        } else {
            victim
                .routers
                .iter()
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        },
        humantime::format_duration(a.lease_ttl),
        secs(first_taken),
        secs(all_owned),
        resumed.map_or("never".into(), |r| format!("{:.1}s", r.as_secs_f64())),
        secs(last.filter(|t| *t > killed)),
        humantime::format_duration(ack_wait),
        humantime::format_duration(effect_lease),
        distinct.len(),
    );
    if distinct.len() as u64 != orders {
        bail!(
            "the fail-over run completed {} of {orders} orders",
            distinct.len()
        );
    }
    Ok(line)
}

/// One run of the partitioned messaging limit on the cluster with `publish` (fenced, batch,
/// plain); returns transitions/s.
async fn limit(
    js: &jetstream::Context,
    cluster: &NatsCluster,
    dir: &Path,
    a: &Args,
    publish: &str,
    label: &str,
) -> Result<f64> {
    let args: Vec<String> = [
        "--orders",
        &a.orders.to_string(),
        "--replicas",
        &NODES.to_string(),
        "--partitions",
        &a.partitions.to_string(),
        "--publish",
        publish,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let log = dir.join(format!("limit-{}.log", label.replace([',', ' '], "")));
    let mut shadow = crate::limit::start(&cluster.urls, &args, &log)?;
    let sampler = Sampler::start(shadow.pid());
    let nats_cpu = || cluster.pids().into_iter().map(cpu_seconds).sum::<f64>();
    let nats0 = nats_cpu();
    let traffic0 = cluster.traffic().await;
    let mut d = drive(js, &Flow::Limit, a.orders, 0.0, QUIET).await?;
    let traffic = cluster.traffic().await.since(&traffic0);
    let nats = nats_cpu() - nats0;
    let usage = sampler.finish().await;
    let transitions = d.completed as f64 * TRANSITIONS_PER_ORDER;
    println!(
        "{}",
        d.line(
            &format!("messaging limit ({label}), partitioned, max rate"),
            transitions
        )
    );
    println!("{}", usage.line("  limit process", d.elapsed));
    println!(
        "  nats nodes: cpu_seconds={nats:.2}; per order: {}",
        traffic.line(a.orders as f64)
    );
    shadow.stop(Duration::from_secs(5));
    if d.completed as u64 != a.orders {
        // The scenario's directory goes with it (unless --keep): show the log's end here.
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        bail!(
            "the limit ({label}) completed only {} of {} orders; the end of its log:\n{}",
            d.completed,
            a.orders,
            lines[lines.len().saturating_sub(20)..].join("\n")
        );
    }
    Ok(transitions / d.elapsed)
}

/// Partitions of a replica started by [`start_replica_named`] (the runner's default).
const DEFAULT_PARTITIONS: u32 = 64;

/// A replica of an R3 deployment on `urls` with the runner's defaults otherwise (another
/// scenario's deployment: uncapped, default partitions and lease TTL).
pub(crate) async fn start_replica_named(
    bin: &Path,
    dir: &Path,
    urls: &str,
    name: &str,
    manifest: &Path,
) -> Result<Runner> {
    let replicas = NODES.to_string();
    let env = [
        ("RUNNER__STREAMS__REPLICAS", replicas.as_str()),
        ("RUNNER__NODE__ID", name),
    ];
    Runner::start_named(bin, dir, name, urls, "combined", manifest, &env).await
}

/// Waits until replicas started by [`start_replica_named`] hold every partition and router,
/// balanced within one partition.
pub(crate) async fn wait_spread(replicas: &[Runner], timeout: Duration) -> Result<Duration> {
    wait_owned(replicas, DEFAULT_PARTITIONS, true, timeout).await
}
