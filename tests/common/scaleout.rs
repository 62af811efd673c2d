//! Helpers for scale-out tests: partitioned replicas on a [`Cluster`], what each owns, and
//! waiting for a balanced assignment.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::RunnerProc;
use super::cluster::Cluster;

/// Partitions in these tests (small, so a test's hand-overs finish quickly).
pub const P: usize = 12;

/// Starts a partitioned saga replica named `node` against every node of `cluster`.
pub fn replica(
    cluster: &Cluster,
    node: &str,
    dir: tempfile::TempDir,
    extra: &[(&str, &str)],
) -> RunnerProc {
    replica_with(
        cluster,
        node,
        dir,
        "saga",
        "tests/manifests/ledger.yaml",
        extra,
    )
}

/// Starts a partitioned replica named `node` in `mode` on `manifests`.
pub fn replica_with(
    cluster: &Cluster,
    node: &str,
    dir: tempfile::TempDir,
    mode: &str,
    manifests: &str,
    extra: &[(&str, &str)],
) -> RunnerProc {
    let p = P.to_string();
    let mut env = vec![
        ("RUNNER__PARTITIONS__COUNT", p.as_str()),
        ("RUNNER__PARTITIONS__LEASE_TTL", "3s"),
        ("RUNNER__STREAMS__REPLICAS", "3"),
        ("RUNNER__NODE__ID", node),
    ];
    env.extend_from_slice(extra);
    RunnerProc::start_in(
        dir,
        &[
            "--mode",
            mode,
            "--nats-url",
            &cluster.urls(),
            "--manifest",
            manifests,
        ],
        &env,
    )
}

/// The partitions a replica reports owning, with their epochs.
pub async fn owned(r: &RunnerProc) -> BTreeMap<u32, u64> {
    let Ok(resp) = reqwest::get(format!("{}/info", r.admin)).await else {
        return BTreeMap::new();
    };
    let Ok(info) = resp.json::<serde_json::Value>().await else {
        return BTreeMap::new();
    };
    info["partitions"]["owned"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.parse().unwrap(), v["epoch"].as_u64().unwrap()))
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until the replicas together own every partition, each within one of the others.
pub async fn wait_balanced(replicas: &[&RunnerProc], timeout: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let mut counts = Vec::new();
        let mut all = BTreeSet::new();
        for r in replicas {
            let o = owned(r).await;
            counts.push(o.len());
            all.extend(o.keys().copied());
        }
        let (lo, hi) = (counts.iter().min().copied(), counts.iter().max().copied());
        if all.len() == P && counts.iter().sum::<usize>() == P && hi.unwrap() - lo.unwrap() <= 1 {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < timeout,
            "not balanced after {timeout:?}: {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The sum of every sample of metric `name` (a name with labels matches exactly those).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Prints (to stderr) every warning and error `r` logged so far, and every partition take
/// and hand-over (with the restored checkpoint and the replay bound), prefixed with `name`:
/// what a failed scale-out assertion needs to be read.
pub fn print_warnings(name: &str, r: &mut RunnerProc) {
    r.logged("");
    for l in r.log.iter().filter(|l| {
        l.contains("\"level\":\"WARN\"")
            || l.contains("\"level\":\"ERROR\"")
            || l.contains("Partition taken")
            || l.contains("Partition handed over")
            || l.contains("Hand-over snapshot")
    }) {
        eprintln!("{name}: {l}");
    }
}
