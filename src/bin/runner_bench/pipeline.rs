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
//! acks, on streams of its own. [`drive`] is shared with the `cluster` scenario.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use async_nats::jetstream;
use futures::StreamExt;
use serde_json::{Value as Json, json};

use crate::goals;
use crate::harness::{Nats, Programs, Runner, WorkDir};
use crate::probe::Sampler;
use crate::{Publisher, event, quantiles, tail};

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

/// Where a drive sends orders and watches their outputs.
#[derive(Clone)]
pub(crate) enum Flow {
    Runner { tenant: String },
    Limit,
}

impl Flow {
    fn input(&self, id: &str) -> String {
        match self {
            Flow::Runner { tenant } => format!("tenant.{tenant}.aggregate.Order.{id}"),
            Flow::Limit => format!("limit.agg.Order.{id}"),
        }
    }
    fn first_output(&self) -> (&'static str, String) {
        match self {
            Flow::Runner { tenant } => (
                "WORKFLOW_COMMANDS",
                format!("tenant.{tenant}.effect.charge_card.*"),
            ),
            Flow::Limit => ("LIMIT_CMD", "limit.cmd.effect.charge_card.*".into()),
        }
    }
    pub(crate) fn final_output(&self) -> (&'static str, String) {
        match self {
            Flow::Runner { tenant } => (
                "WORKFLOW_EVENTS",
                format!("tenant.{tenant}.workflow_event.order.*"),
            ),
            Flow::Limit => ("LIMIT_EVT", "limit.evt.workflow_event.order.*".into()),
        }
    }
    /// The order a seen output belongs to.
    pub(crate) fn order_of(&self, subject: &str, payload: &[u8], first: bool) -> Option<String> {
        if matches!(self, Flow::Runner { .. }) {
            let v: Json = serde_json::from_slice(payload).ok()?;
            if first {
                // The runner's command subject ends with the command id; the body names
                // the order.
                return v["payload"]["order_id"].as_str().map(str::to_owned);
            }
            // The saga's own end event shares the subject with OrderFulfilled; only the
            // latter is the order's final output (counting both ended a drive at half).
            if v["event_type"] != "OrderFulfilled" {
                return None;
            }
        }
        subject.rsplit('.').next().map(str::to_owned)
    }
}

/// What one drive measured.
pub(crate) struct Drive {
    pub(crate) orders: u64,
    pub(crate) completed: usize,
    pub(crate) elapsed: f64,
    /// Whether the orders were offered at a set rate (open loop).
    paced: bool,
    /// Seconds from the first publish to the last.
    offered_for: f64,
    /// When each order completed, in seconds from the first publish.
    done_at: Vec<f64>,
    first: Vec<f64>,
    done: Vec<f64>,
}

impl Drive {
    pub(crate) fn sagas_per_s(&self) -> f64 {
        self.completed as f64 / self.elapsed
    }
    /// Sagas completed per second while the load was offered, past its first quarter
    /// ([`steady_rate`]): what an open-loop run keeps up with, without the warm-up or the
    /// drain after the last publish.
    pub(crate) fn steady_per_s(&self) -> f64 {
        steady_rate(&self.done_at, self.offered_for)
    }
    /// p99 in ms of input → first output and of input → saga completed.
    pub(crate) fn p99s(&mut self) -> (f64, f64) {
        self.first.sort_by(f64::total_cmp);
        self.done.sort_by(f64::total_cmp);
        (
            crate::percentile(&self.first, 0.99),
            crate::percentile(&self.done, 0.99),
        )
    }
    pub(crate) fn line(&mut self, label: &str, transitions: f64) -> String {
        // Only a paced (open-loop) drive has a rate it was offered to keep up with.
        let steady = if self.paced {
            format!(" completed_per_s_while_offered={:.0}", self.steady_per_s())
        } else {
            String::new()
        };
        format!(
            "{label}: orders={} completed={} elapsed={:.2}s transitions_per_s={:.0} sagas_per_s={:.0}{steady} | input->first output stored (charge_card) ms {} | input->saga completed (OrderFulfilled stored) ms {}",
            self.orders,
            self.completed,
            self.elapsed,
            transitions / self.elapsed,
            self.sagas_per_s(),
            quantiles(&mut self.first),
            quantiles(&mut self.done),
        )
    }
}

/// Completions per second in the last three quarters of an offering that lasted
/// `offered_for` seconds, `done_at` holding when each completed (seconds from its start).
/// A system that keeps up completes about as many per second there as were offered; one
/// that falls behind completes fewer. The first quarter is left out so the latency of the
/// first sagas does not count as falling behind, and completions after the last publish
/// (the drain) are left out so a long latency does not either.
pub(crate) fn steady_rate(done_at: &[f64], offered_for: f64) -> f64 {
    let from = offered_for / 4.0;
    let window = offered_for - from;
    if window <= 0.0 {
        return 0.0;
    }
    let n = done_at
        .iter()
        .filter(|t| **t >= from && **t <= offered_for)
        .count();
    n as f64 / window
}

/// Publishes `orders` OrderPlaced events (as fast as acks allow, or at `rate` per second)
/// and waits for every order's first and final outputs, giving up after `quiet` with no
/// output.
pub(crate) async fn drive(
    js: &jetstream::Context,
    flow: &Flow,
    orders: u64,
    rate: f64,
    quiet: Duration,
) -> Result<Drive> {
    let sent: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let mut collectors = Vec::new();
    for first in [true, false] {
        let (stream, filter) = if first {
            flow.first_output()
        } else {
            flow.final_output()
        };
        let mut seen = tail(js, stream, &[filter]).await?;
        let (sent, flow) = (sent.clone(), flow.clone());
        collectors.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(orders as usize);
            let mut ats = Vec::with_capacity(orders as usize);
            let mut last = None;
            let mut counted = std::collections::HashSet::new();
            while (lat.len() as u64) < orders {
                let Ok(Some(m)) = tokio::time::timeout(quiet, seen.next()).await else {
                    break;
                };
                let Some(id) = flow.order_of(&m.subject, &m.payload, first) else {
                    continue;
                };
                // One latency per order, however many outputs of the kind it has.
                if !counted.insert(id.clone()) {
                    continue;
                }
                let t0 = sent.lock().ok().and_then(|s| s.get(&id).copied());
                if let Some(t0) = t0 {
                    lat.push(m.at.duration_since(t0).as_secs_f64() * 1000.0);
                    ats.push(m.at);
                    last = Some(m.at);
                }
            }
            (lat, ats, last)
        }));
    }
    let tenant = match flow {
        Flow::Runner { tenant } => tenant.as_str(),
        Flow::Limit => "limit",
    };
    let mut publisher = Publisher::new(js.clone(), 256);
    let started = Instant::now();
    for i in 0..orders {
        if rate > 0.0 {
            let due = started + Duration::from_secs_f64(i as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        let id = format!("o-{i}");
        let body = event(
            tenant,
            "Order",
            &id,
            "OrderPlaced",
            json!({
                "customer_id": format!("customer-{}", i % 997),
                "amount_cents": 1000 + i % 100,
                "items": [{"sku": "book", "qty": 1}],
            }),
        );
        let msg_id = body["event_id"].as_str().unwrap_or_default().to_string();
        sent.lock()
            .map_err(|_| anyhow::anyhow!("lock"))?
            .insert(id.clone(), Instant::now());
        publisher.send(flow.input(&id), &body, &msg_id).await?;
    }
    publisher.flush().await?;
    let offered_for = started.elapsed().as_secs_f64();
    let (first, _, _) = collectors.remove(0).await?;
    let (done, ats, last) = collectors.remove(0).await?;
    let elapsed = last
        .unwrap_or_else(Instant::now)
        .duration_since(started)
        .as_secs_f64();
    let done_at = ats
        .iter()
        .map(|at| at.duration_since(started).as_secs_f64())
        .collect();
    Ok(Drive {
        orders,
        completed: done.len(),
        elapsed,
        paced: rate > 0.0,
        offered_for,
        done_at,
        first,
        done,
    })
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

    let applied = || {
        metrics.sum(
            "runner_saga_transitions_total",
            &[("saga", "order"), ("outcome", "applied")],
        )
    };
    // Runner and limit alternate, A B A B …, on the same server with the same inputs, so a
    // change in the machine's load moves both halves of a pair alike. The runner idles
    // while the limit is driven; the limit runs only for its own half (it copies the body
    // sizes the runner produced, so it starts after the runner's first run).
    let pairs = a.pairs.max(1);
    let (mut runner_tps, mut limit_tps, mut sagas) = (Vec::new(), Vec::new(), Vec::new());
    for pair in 1..=pairs {
        let before = applied().await?;
        let scraped = metrics.text().await?;
        let sampler = Sampler::start(runner.proc.pid());
        let server_cpu = crate::probe::cpu_seconds(nats.pid());
        let flow = Flow::Runner {
            tenant: format!("max{pair}"),
        };
        let mut d = drive(&js, &flow, a.orders, 0.0, QUIET).await?;
        let usage = sampler.finish().await;
        let server_cpu = crate::probe::cpu_seconds(nats.pid()) - server_cpu;
        let transitions = applied().await? - before;
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
                work.path.display()
            );
        }
        runner_tps.push(transitions / d.elapsed);
        sagas.push(d.sagas_per_s());

        // A fresh shadow per pair: it recreates its streams, so the same order ids (and
        // message ids) are new to them, and it does not idle beside the runner's runs.
        let mut shadow = crate::limit::start(
            &nats.url,
            &["--orders".into(), a.orders.to_string()],
            &work.path.join(format!("limit-{pair}.log")),
        )?;
        let sampler = Sampler::start(shadow.pid());
        let server_cpu = crate::probe::cpu_seconds(nats.pid());
        let mut d = drive(&js, &Flow::Limit, a.orders, 0.0, QUIET).await?;
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
        limit_tps.push(done / d.elapsed);
        println!(
            "pair {pair}: ratio {:.2}",
            runner_tps[pair - 1] / limit_tps[pair - 1]
        );
    }

    // Open loop at fractions of the (median) maximum rate, for latency under load.
    let mut open_loop = Vec::new();
    for (n, load) in a.loads.iter().enumerate() {
        let rate = a.rate.unwrap_or_else(|| median(&sagas)) * load;
        let sampler = Sampler::start(runner.proc.pid());
        let flow = Flow::Runner {
            tenant: format!("load{n}"),
        };
        let before = applied().await?;
        let scraped = metrics.text().await?;
        let mut d = drive(&js, &flow, a.orders, rate, QUIET).await?;
        let usage = sampler.finish().await;
        let transitions = applied().await? - before;
        let breakdown = where_time_goes(&scraped, &metrics.text().await?);
        let label = if is_half(*load) {
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
        open_loop.push(goals::OpenLoopRun {
            load: *load,
            offered: rate,
            completed: d.steady_per_s(),
            first_p99,
            done_p99,
        });
        if d.completed as u64 != a.orders {
            bail!(
                "only {} of {} orders completed at {label}; see the runner log in {} (run with --keep)",
                d.completed,
                a.orders,
                work.path.display()
            );
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_steady_rate_counts_completions_while_offered_past_the_first_quarter() {
        // 10/s offered for 10 s, each completing 2 s after it was sent: 76 of them land in
        // [2.5 s, 10 s], about 10/s; the 19 after the last publish do not count.
        let lagging: Vec<f64> = (0..100).map(|i| i as f64 / 10.0 + 2.0).collect();
        assert!((steady_rate(&lagging, 10.0) - 76.0 / 7.5).abs() < 1e-9);
        // Falling behind: half as many completions over the same window.
        let behind: Vec<f64> = (0..50).map(|i| i as f64 / 5.0 + 0.1).collect();
        assert!((steady_rate(&behind, 10.0) - 38.0 / 7.5).abs() < 1e-9);
        assert_eq!(steady_rate(&[1.0], 0.0), 0.0);
    }

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
