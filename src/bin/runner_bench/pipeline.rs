//! The order pipeline: a combined runner (saga + effect worker, noop effects) against the
//! same message flow with no engine and no state (`limit`).
//!
//! Per order the runner's saga side reads 5 inputs (OrderPlaced, three effect results and
//! its own OrderFulfilled event, which no saga routes) with ordered consumers, applies 4
//! transitions and publishes 6 outputs (charge_card, reserve_stock, Confirm,
//! create_shipment, MarkShipped, OrderFulfilled) through its relay, with `Nats-Msg-Id` and
//! acknowledgements awaited per window; its effect side takes 3 commands from a durable pull
//! consumer and, for each, creates the claim (no read first on a first delivery), updates
//! it by revision with the result, publishes the result awaiting its acknowledgement, and
//! acknowledges the command. `limit` (`limit.rs`) does exactly those consumes, publishes
//! (with bodies of the sizes the runner produced, copied from its streams), KV operations and
//! acks, on streams of its own. [`drive`] (its own file) is shared with the `cluster`
//! scenarios; `run` measures the alternated runner/limit pairs, then the open-loop runs, one
//! step each, and prints the `result:` and `goal:` lines last.

#[path = "pipeline/drive.rs"]
mod drive;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};
use async_nats::jetstream;

use crate::goals;
use crate::harness::{Nats, Programs, Runner, WorkDir};
use crate::probe::{Metrics, Sampler};
pub(crate) use drive::{Drive, Flow, drive};

/// Saga transitions per order on the happy path.
pub(crate) const TRANSITIONS_PER_ORDER: f64 = 4.0;

/// How long a drive waits for the next output before it gives up on the rest.
pub(crate) const QUIET: Duration = Duration::from_secs(30);

#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    #[command(flatten)]
    programs: Programs,
    /// Orders per measurement.
    #[arg(long, env = "BENCH_ORDERS", default_value_t = 20_000)]
    orders: u64,
    /// The order manifest with noop effects.
    #[arg(long, default_value = "bench/order.yaml")]
    manifest: PathBuf,
    /// Runner/limit pairs measured alternately (A B A B …); the ratio reported is the
    /// median of the pairs' ratios.
    #[arg(long, env = "BENCH_PAIRS", default_value_t = 3)]
    pairs: usize,
    /// Open-loop runs after the pairs, as fractions of the median maximum rate (0.5 is the
    /// half-rate latency run; above 1 the offered load exceeds what the runner takes).
    #[arg(
        long,
        env = "BENCH_LOADS",
        value_delimiter = ',',
        default_value = "0.5,0.8,1.2"
    )]
    loads: Vec<f64>,
    /// The maximum rate (orders/s) the open-loop fractions refer to, in place of the median
    /// measured by the pairs: two builds compared at the same offered load.
    #[arg(long, env = "BENCH_RATE")]
    rate: Option<f64>,
}

/// Where an order's time goes, from the runner's own histograms over one run (p50 / p99,
/// ms): the wait of an input between being stored and read, the batch commit, a relay
/// window (publish to acknowledgement), an effect command's wait before a worker starts on
/// it, and the effect call itself.
pub(crate) fn where_time_goes(before: &str, after: &str) -> String {
    where_time_goes_of("runner histograms", before, after)
}

/// [`where_time_goes`] from the histograms `whose` (several runners' scrapes concatenated
/// sum theirs).
pub(crate) fn where_time_goes_of(whose: &str, before: &str, after: &str) -> String {
    let q = |name: &str, p: f64| {
        crate::probe::window_quantile(before, after, name, p)
            .map_or("-".to_string(), |s| format!("{:.1}", s * 1000.0))
    };
    let pair = |name: &str| format!("{}/{}", q(name, 0.5), q(name, 0.99));
    format!(
        "  where the time goes ({whose}, p50/p99 ms): input wait {} | commit {} | relay window {} | effect queue {} | effect call {}",
        pair("runner_saga_input_wait_seconds"),
        pair("runner_saga_commit_seconds"),
        pair("runner_relay_window_seconds"),
        pair("runner_effect_queue_seconds"),
        pair("runner_effect_seconds"),
    )
}

/// The median of `xs` (the mean of the middle two for an even count).
pub(crate) fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Each pair's runner throughput over its limit's.
fn ratios(runner_tps: &[f64], limit_tps: &[f64]) -> Vec<f64> {
    runner_tps
        .iter()
        .zip(limit_tps)
        .map(|(r, l)| r / l)
        .collect()
}

/// Whether an open-loop load is the half-rate run (whose line and goals tooling reads).
fn is_half(load: f64) -> bool {
    (load - 0.5).abs() < 1e-9
}

/// The `result:` line of alternated pairs: medians, the ratios' range, and a ratio above 1
/// flagged as a measurement fault (the engine cannot beat the same message flow without it:
/// the machine's load moved between the two halves of a pair).
pub(crate) fn result_line(runner_tps: &[f64], limit_tps: &[f64]) -> String {
    let ratios = ratios(runner_tps, limit_tps);
    let (lo, hi) = ratios
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), r| {
            (lo.min(*r), hi.max(*r))
        });
    let ratio = median(&ratios);
    let fault = if ratios.iter().any(|r| *r > 1.0) {
        " MEASUREMENT FAULT: a pair's ratio is above 1, so the machine's load changed within it; rerun on a quieter machine"
    } else {
        ""
    };
    format!(
        "result: runner {:.0} transitions/s, messaging limit {:.0}/s, ratio {ratio:.2} (median of {} alternated pairs, range {lo:.2}–{hi:.2}){fault}",
        median(runner_tps),
        median(limit_tps),
        ratios.len(),
    )
}

/// The pipeline's figures beside their goals: the median ratio; at half rate the p99s to
/// the first output and to completion; up to 100 % of the maximum rate, whether completion
/// p99 stays flat and completions keep up with the offered rate ([`goals::open_loop`]).
pub(crate) fn goal_lines(
    runner_tps: &[f64],
    limit_tps: &[f64],
    open_loop: &[goals::OpenLoopRun],
) -> Vec<String> {
    use goals::{Bound, line};
    let mut out = vec![line(
        "pipeline, median ratio to the messaging limit",
        median(&ratios(runner_tps, limit_tps)),
        "",
        Bound::AtLeast,
        goals::PIPELINE_RATIO,
    )];
    if let Some(half) = open_loop.iter().find(|r| is_half(r.load)) {
        out.push(line(
            "half rate, input->first output p99",
            half.first_p99,
            "ms",
            Bound::Below,
            goals::HALF_RATE_FIRST_P99_MS,
        ));
        out.push(line(
            "half rate, input->saga completed p99",
            half.done_p99,
            "ms",
            Bound::Below,
            goals::HALF_RATE_COMPLETED_P99_MS,
        ));
    }
    out.extend(goals::open_loop("open loop", open_loop));
    out
}

pub(crate) async fn run(a: Args) -> Result<()> {
    if let Some(r) = a.rate
        && !(r.is_finite() && r > 0.0)
    {
        // A rate of 0 would mean "as fast as it goes" to the driver: refuse it.
        bail!("BENCH_RATE / --rate must be a positive number of orders/s, got {r}");
    }
    let work = WorkDir::new("pipeline", a.programs.keep)?;
    let nats = Nats::start(&a.programs.nats_server, &work.path).await?;
    println!(
        "pipeline: {} cores, nats-server {}, {} orders per run; order saga (4 transitions, 6 outputs, 3 effect commands per order), noop effects, runner in combined mode, durability full",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        Nats::version(&a.programs.nats_server),
        a.orders,
    );
    let mut runner = Runner::start(
        &a.programs.runner,
        &work.path,
        &nats.url,
        "combined",
        &a.manifest,
        &[],
    )
    .await?;
    let metrics = runner.client();
    let client = async_nats::connect(&nats.url).await?;
    let js = jetstream::new(client.clone());
    let bench = Bench {
        a: &a,
        work: &work,
        nats: &nats,
        runner_pid: runner.proc.pid(),
        metrics: &metrics,
        js: &js,
    };

    // Runner and limit alternate, A B A B …, on the same server with the same inputs, so a
    // change in the machine's load moves both halves of a pair alike. The runner idles
    // while the limit is driven; the limit runs only for its own half (it copies the body
    // sizes the runner produced, so it starts after the runner's first run).
    let pairs = a.pairs.max(1);
    let (mut runner_tps, mut limit_tps, mut sagas) = (Vec::new(), Vec::new(), Vec::new());
    for pair in 1..=pairs {
        let (tps, per_s) = bench.runner_max_rate(pair).await?;
        runner_tps.push(tps);
        sagas.push(per_s);
        limit_tps.push(bench.limit_max_rate(pair).await?);
        println!(
            "pair {pair}: ratio {:.2}",
            runner_tps[pair - 1] / limit_tps[pair - 1]
        );
    }

    // Open loop at fractions of the (median) maximum rate, for latency under load.
    let mut open_loop = Vec::new();
    for (n, load) in a.loads.iter().enumerate() {
        let rate = a.rate.unwrap_or_else(|| median(&sagas)) * load;
        open_loop.push(bench.open_loop(n, *load, rate).await?);
    }
    let store = runner.store_bytes();
    runner.proc.stop(Duration::from_secs(30));
    println!(
        "  runner store: {:.0} MiB on disk",
        store as f64 / 1048576.0
    );
    println!("{}", result_line(&runner_tps, &limit_tps));
    for line in goal_lines(&runner_tps, &limit_tps, &open_loop) {
        println!("{line}");
    }
    Ok(())
}

/// What the runs of one `pipeline` bench share: its settings, directory, server, runner
/// and connection.
struct Bench<'b> {
    a: &'b Args,
    work: &'b WorkDir,
    nats: &'b Nats,
    runner_pid: u32,
    metrics: &'b Metrics,
    js: &'b jetstream::Context,
}

impl Bench<'_> {
    /// Transitions the runner applied so far, of the order saga.
    async fn applied(&self) -> Result<f64> {
        self.metrics
            .sum(
                "runner_saga_transitions_total",
                &[("saga", "order"), ("outcome", "applied")],
            )
            .await
    }

    /// The runner's half of pair `pair`: orders driven as fast as it takes them. Prints
    /// its lines and returns its transitions and sagas per second; fails unless every order
    /// completed.
    async fn runner_max_rate(&self, pair: usize) -> Result<(f64, f64)> {
        let (a, nats, metrics) = (self.a, self.nats, self.metrics);
        let before = self.applied().await?;
        let scraped = metrics.text().await?;
        let sampler = Sampler::start(self.runner_pid);
        let server_cpu = crate::probe::cpu_seconds(nats.pid());
        let flow = Flow::Runner {
            tenant: format!("max{pair}"),
        };
        let mut d = drive(self.js, &flow, a.orders, 0.0, QUIET).await?;
        let usage = sampler.finish().await;
        let server_cpu = crate::probe::cpu_seconds(nats.pid()) - server_cpu;
        let transitions = self.applied().await? - before;
        println!(
            "{}",
            d.line(&format!("pair {pair} runner max rate"), transitions)
        );
        println!("{}", usage.line("  runner", d.elapsed));
        println!("  nats-server: cpu_seconds={server_cpu:.2}");
        let after = metrics.text().await?;
        println!("{}", where_time_goes(&scraped, &after));
        println!("{}", crate::ledger::commits_line(&scraped, &after));
        if d.completed as u64 != a.orders {
            bail!(
                "only {} of {} orders completed; see the runner log in {} (run with --keep)",
                d.completed,
                a.orders,
                self.work.path.display()
            );
        }
        Ok((transitions / d.elapsed, d.sagas_per_s()))
    }

    /// The messaging limit's half of pair `pair`, on a limit process of its own. Prints its
    /// lines and returns its transitions per second.
    async fn limit_max_rate(&self, pair: usize) -> Result<f64> {
        let (a, nats) = (self.a, self.nats);
        // A fresh shadow per pair: it recreates its streams, so the same order ids (and
        // message ids) are new to them, and it does not idle beside the runner's runs.
        let mut shadow = crate::limit::start(
            &nats.url,
            &["--orders".into(), a.orders.to_string()],
            &self.work.path.join(format!("limit-{pair}.log")),
        )?;
        let sampler = Sampler::start(shadow.pid());
        let server_cpu = crate::probe::cpu_seconds(nats.pid());
        let mut d = drive(self.js, &Flow::Limit, a.orders, 0.0, QUIET).await?;
        let usage = sampler.finish().await;
        let server_cpu = crate::probe::cpu_seconds(nats.pid()) - server_cpu;
        shadow.stop(Duration::from_secs(5));
        let done = d.completed as f64 * TRANSITIONS_PER_ORDER;
        println!(
            "{}",
            d.line(&format!("pair {pair} messaging limit max rate"), done)
        );
        println!("{}", usage.line("  limit process", d.elapsed));
        println!("  nats-server: cpu_seconds={server_cpu:.2}");
        Ok(done / d.elapsed)
    }

    /// Open-loop run `n`: orders offered at `rate` per second (`load` of the maximum).
    /// Prints its lines and returns its figures for the goals; fails unless every order
    /// completed.
    async fn open_loop(&self, n: usize, load: f64, rate: f64) -> Result<goals::OpenLoopRun> {
        let (a, metrics) = (self.a, self.metrics);
        let sampler = Sampler::start(self.runner_pid);
        let flow = Flow::Runner {
            tenant: format!("load{n}"),
        };
        let before = self.applied().await?;
        let scraped = metrics.text().await?;
        let mut d = drive(self.js, &flow, a.orders, rate, QUIET).await?;
        let usage = sampler.finish().await;
        let transitions = self.applied().await? - before;
        let breakdown = where_time_goes(&scraped, &metrics.text().await?);
        let label = if is_half(load) {
            format!("runner half rate ({rate:.0} orders/s offered)")
        } else {
            format!(
                "runner at {:.0}% of max rate ({rate:.0} orders/s offered)",
                load * 100.0
            )
        };
        println!("{}", d.line(&label, transitions));
        println!("{}", usage.line("  runner", d.elapsed));
        println!("{breakdown}");
        let (first_p99, done_p99) = d.p99s();
        let run = goals::OpenLoopRun {
            load,
            offered: rate,
            completed: d.steady_per_s(),
            first_p99,
            done_p99,
        };
        if d.completed as u64 != a.orders {
            bail!(
                "only {} of {} orders completed at {label}; see the runner log in {} (run with --keep)",
                d.completed,
                a.orders,
                self.work.path.display()
            );
        }
        Ok(run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_quantile_interpolates_inside_its_bucket() {
        let before = "h_bucket{le=\"0.01\"} 0\nh_bucket{le=\"0.1\"} 0\nh_bucket{le=\"+Inf\"} 0\n";
        let after = "h_bucket{e=\"a\",le=\"0.01\"} 50\nh_bucket{e=\"a\",le=\"0.1\"} 100\nh_bucket{e=\"a\",le=\"+Inf\"} 100\n";
        let p50 = crate::probe::window_quantile(before, after, "h", 0.5).expect("p50");
        assert!((p50 - 0.01).abs() < 1e-9, "{p50}");
        let p75 = crate::probe::window_quantile(before, after, "h", 0.75).expect("p75");
        assert!((p75 - 0.055).abs() < 1e-9, "{p75}");
        assert_eq!(crate::probe::window_quantile(after, after, "h", 0.5), None);
    }

    #[test]
    fn the_result_is_the_median_of_the_pairs_and_a_ratio_above_one_is_a_fault() {
        let line = result_line(&[8000.0, 9000.0, 10000.0], &[10000.0, 12000.0, 10000.0]);
        assert!(
            line.starts_with("result: runner 9000 transitions/s, messaging limit 10000/s, ratio 0.80 (median of 3 alternated pairs, range 0.75–1.00)"),
            "{line}"
        );
        assert!(!line.contains("FAULT"));
        let line = result_line(&[12000.0, 9000.0], &[10000.0, 12000.0]);
        assert!(
            line.contains("ratio 0.97") && line.contains("MEASUREMENT FAULT"),
            "{line}"
        );
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    }
}
