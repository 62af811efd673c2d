//! The `cluster` scenario's open loop (a child module of `cluster.rs`, run last): as many
//! fresh replicas as the largest replica count are offered orders at fractions of the
//! sagas/s that count reached at the maximum rate (by default 50 %, 80 % and 120 %), each
//! run on a tenant of its own so runs do not mix. It runs after the messaging limit's
//! rounds so that its orders do not sit in the cluster ahead of them. Per run: the drive's
//! line (the offered rate in its label; completed sagas/s; input → first output and →
//! completion), the replicas' and the NATS nodes' CPU, and where the time goes by the
//! replicas' own histograms, summed over them. Up to 100 % completions should keep up with
//! the offered rate and completion latency stay flat; above it the backlog should grow in
//! new inputs only (the input wait), not in sagas already started. A run up to 100 % in
//! which not every order completes ends the scenario; above 100 % what completed is
//! reported.

use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use async_nats::jetstream;

use super::applied;
use crate::goals::OpenLoopRun;
use crate::harness::{NatsCluster, Runner};
use crate::pipeline::{Flow, QUIET, drive, where_time_goes_of};
use crate::probe::{Sampler, cpu_seconds, metric_sum};

#[derive(clap::Args, Debug)]
pub(crate) struct LoadArgs {
    /// Open-loop runs on the largest replica count, as fractions of its maximum rate
    /// (comma-separated; empty or 0 skips them).
    #[arg(long, env = "BENCH_CLUSTER_LOADS", default_value = "0.5,0.8,1.2")]
    loads: String,
    /// Orders per open-loop run (default: as many as a measurement).
    #[arg(long, env = "BENCH_CLUSTER_LOAD_ORDERS")]
    load_orders: Option<u64>,
}

impl LoadArgs {
    /// The loads to run and the orders per run, `orders` unless set apart; None when the
    /// open loop is skipped (no load above 0, or no orders). Checked before anything starts.
    pub(super) fn plan(&self, orders: u64) -> Result<Option<(Vec<f64>, u64)>> {
        let (loads, orders) = (
            parse_loads(&self.loads)?,
            self.load_orders.unwrap_or(orders),
        );
        Ok((!loads.is_empty() && orders > 0).then_some((loads, orders)))
    }
}

/// Loads from a comma-separated list: empty parts and zeros are dropped (so an empty value
/// or `0` runs none); anything else must be a finite number above 0.
fn parse_loads(s: &str) -> Result<Vec<f64>> {
    let mut loads = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let load: f64 = part
            .parse()
            .map_err(|_| anyhow!("BENCH_CLUSTER_LOADS: '{part}' is not a number"))?;
        if !load.is_finite() || load < 0.0 {
            bail!("BENCH_CLUSTER_LOADS: '{part}' is not a fraction of the maximum rate");
        }
        if load > 0.0 {
            loads.push(load);
        }
    }
    Ok(loads)
}

/// The replicas' CPU and memory and the NATS nodes' CPU over one run.
pub(super) struct Watch {
    samplers: Vec<Sampler>,
    nats: Vec<u32>,
    nats0: f64,
}

fn cpu_of(pids: &[u32]) -> f64 {
    pids.iter().copied().map(cpu_seconds).sum()
}

impl Watch {
    pub(super) fn start(replicas: &[Runner], cluster: &NatsCluster) -> Self {
        let nats = cluster.pids();
        Self {
            samplers: replicas
                .iter()
                .map(|r| Sampler::start(r.proc.pid()))
                .collect(),
            nats0: cpu_of(&nats),
            nats,
        }
    }

    /// Stops watching; the line of what the replicas (together) and the nodes used over a
    /// run of `elapsed` seconds.
    pub(super) async fn finish(self, elapsed: f64) -> String {
        let (mut cpu, mut peak) = (0.0, 0u64);
        for s in self.samplers {
            let u = s.finish().await;
            cpu += u.cpu;
            peak = peak.max(u.peak.rss);
        }
        let nats = cpu_of(&self.nats) - self.nats0;
        let share = |c: f64| 100.0 * c / elapsed.max(1e-9);
        format!(
            "  replicas: cpu_seconds={cpu:.2} ({:.0}% of one core, all together), peak_rss={:.0}MiB (largest); nats nodes: cpu_seconds={nats:.2} ({:.0}% of one core)",
            share(cpu),
            peak as f64 / 1024.0,
            share(nats),
        )
    }
}

/// Waits until `replicas` that took partitions over have caught up — no inbox message
/// unread and no input replayed for two looks a second apart — so their replay does not
/// run inside a measurement; returns the inputs replayed and how long it took.
pub(super) async fn caught_up(replicas: &[Runner], limit: Duration) -> Result<(f64, Duration)> {
    let started = Instant::now();
    let (mut last, mut still) = (f64::NAN, 0);
    loop {
        let (mut lag, mut replayed) = (0.0, 0.0);
        for r in replicas {
            let text = r.client().text().await?;
            lag += metric_sum(&text, "runner_partition_lag", &[]);
            replayed += metric_sum(&text, "runner_partition_replayed_inputs_total", &[]);
        }
        still = if lag == 0.0 && replayed == last {
            still + 1
        } else {
            0
        };
        if still >= 2 {
            return Ok((replayed, started.elapsed()));
        }
        if started.elapsed() > limit {
            bail!(
                "cluster: fresh replicas still replaying after {limit:?} (lag {lag}, replayed {replayed})"
            );
        }
        last = replayed;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Every replica's `/metrics`, concatenated (histogram buckets then sum over replicas).
async fn scrape(replicas: &[Runner]) -> Result<String> {
    let mut all = String::new();
    for r in replicas {
        all.push_str(&r.client().text().await?);
        all.push('\n');
    }
    Ok(all)
}

/// The open-loop runs (module doc) on `replicas`, `orders` each at the fractions `loads`
/// of `max_sagas` orders/s ([`LoadArgs::plan`]); returns them for the goals.
pub(super) async fn open_loop(
    js: &jetstream::Context,
    replicas: &[Runner],
    cluster: &NatsCluster,
    (loads, orders): (&[f64], u64),
    max_sagas: f64,
) -> Result<Vec<OpenLoopRun>> {
    if !(max_sagas.is_finite() && max_sagas > 0.0) {
        bail!("cluster: no maximum rate to take the open loop's fractions of ({max_sagas})");
    }
    let n = replicas.len();
    let whose = format!("{n} replicas' histograms, summed");
    let mut runs = Vec::new();
    for (i, &load) in loads.iter().enumerate() {
        let rate = max_sagas * load;
        let flow = Flow::Runner {
            tenant: format!("open{i}"),
        };
        let before = applied(replicas).await?;
        let scraped = scrape(replicas).await?;
        let watch = Watch::start(replicas, cluster);
        let mut d = drive(js, &flow, orders, rate, QUIET).await?;
        let usage = watch.finish(d.elapsed).await;
        let transitions = applied(replicas).await? - before;
        let breakdown = where_time_goes_of(&whose, &scraped, &scrape(replicas).await?);
        let label = format!(
            "runner, {n} replica(s), open loop at {:.0}% of max rate ({rate:.0} orders/s offered)",
            load * 100.0
        );
        println!("{}", d.line(&label, transitions));
        println!("{usage}");
        println!("{breakdown}");
        let (first_p99, done_p99) = d.p99s();
        runs.push(OpenLoopRun {
            load,
            offered: rate,
            completed: d.steady_per_s(),
            first_p99,
            done_p99,
        });
        if d.completed as u64 != orders {
            if load <= 1.0 + 1e-9 {
                bail!(
                    "only {} of {orders} orders completed with {n} replica(s) at {:.0}% of the maximum rate, none for {}s (run with --keep for the logs)",
                    d.completed,
                    load * 100.0,
                    QUIET.as_secs()
                );
            }
            println!(
                "  above the maximum rate: {} of {orders} orders completed, then none for {}s",
                d.completed,
                QUIET.as_secs()
            );
        }
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_parse_from_a_list_and_empty_or_zero_runs_none() {
        assert_eq!(parse_loads("0.5,0.8,1.2").expect("loads"), [0.5, 0.8, 1.2]);
        assert_eq!(parse_loads(" 0.5 , 1 ,").expect("loads"), [0.5, 1.0]);
        assert!(parse_loads("").expect("loads").is_empty());
        assert!(parse_loads("0").expect("loads").is_empty());
        assert!(parse_loads("half").is_err());
        assert!(parse_loads("-0.5").is_err());
        assert!(parse_loads("inf").is_err());
    }
}
