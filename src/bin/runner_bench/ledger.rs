//! Curves on the ledger saga (`tests/manifests/ledger.yaml`: one aggregate command out per
//! deposit in, state checked for order), runner in saga mode: throughput and latency by
//! number of live instances (`scale`) and by event size (`payload`); and the fire lag of
//! many pending timers (`timers`, `bench/timers.yaml`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use async_nats::jetstream;
use futures::StreamExt;
use serde_json::{Value as Json, json};

use crate::harness::{Nats, Programs, Runner, WorkDir};
use crate::probe::{Metrics, Sampler, histogram_quantile};
use crate::{Publisher, Rng, event, now_ms, percentile, quantiles, tail};

#[derive(clap::Args, Debug)]
pub(crate) struct ScaleArgs {
    #[command(flatten)]
    programs: Programs,
    /// Live instance counts, grown one after the other.
    #[arg(
        long,
        env = "BENCH_SCALE_SIZES",
        value_delimiter = ',',
        default_value = "10000,100000,1000000"
    )]
    sizes: Vec<u64>,
    /// Events measured at each size, spread at random over all instances.
    #[arg(long, env = "BENCH_SCALE_EVENTS", default_value_t = 100_000)]
    events: u64,
    /// The ledger manifest.
    #[arg(long, default_value = "tests/manifests/ledger.yaml")]
    manifest: PathBuf,
}

/// Event bytes one payload run publishes at most (large events get fewer events).
const PAYLOAD_BYTES: u64 = 768 << 20;

#[derive(clap::Args, Debug)]
pub(crate) struct PayloadArgs {
    #[command(flatten)]
    programs: Programs,
    /// Event body sizes in bytes (the whole JSON envelope).
    #[arg(
        long,
        env = "BENCH_PAYLOAD_SIZES",
        value_delimiter = ',',
        default_value = "256,4096,262144"
    )]
    sizes: Vec<usize>,
    /// Events per measurement.
    #[arg(long, env = "BENCH_PAYLOAD_EVENTS", default_value_t = 20_000)]
    events: u64,
    /// Instances (accounts) the events go round.
    #[arg(long, env = "BENCH_PAYLOAD_ACCOUNTS", default_value_t = 1_000)]
    accounts: u64,
    /// The ledger manifest.
    #[arg(long, default_value = "tests/manifests/ledger.yaml")]
    manifest: PathBuf,
}

#[derive(clap::Args, Debug)]
pub(crate) struct TimerArgs {
    #[command(flatten)]
    programs: Programs,
    /// Pending timers (one saga instance each).
    #[arg(long, env = "BENCH_TIMERS", default_value_t = 100_000)]
    timers: u64,
    /// Seconds over which the timers come due, evenly.
    #[arg(long, env = "BENCH_TIMER_SPREAD_S", default_value_t = 10.0)]
    spread_s: f64,
    /// Seconds from the start of publishing to the first due time (default: enough for the
    /// runner to take in every timer first, at 4 000 per second, at least 5 s).
    #[arg(long, env = "BENCH_TIMER_LEAD_S")]
    lead_s: Option<f64>,
    /// The timer manifest.
    #[arg(long, default_value = "bench/timers.yaml")]
    manifest: PathBuf,
}

/// Waits until the runner has routed `stream` through `seq` into its saga inbox and its
/// relays have published at least `outputs` records (which the inputs' commits wrote).
async fn caught_up(m: &Metrics, stream: &str, seq: u64, outputs: f64) -> Result<()> {
    let until = Instant::now() + Duration::from_secs(600);
    loop {
        let text = m.text().await?;
        let cp =
            crate::probe::metric_sum(&text, "runner_consumer_checkpoint", &[("stream", stream)]);
        let published = crate::probe::metric_sum(&text, "runner_relay_published_total", &[]);
        if cp as u64 >= seq && published >= outputs {
            return Ok(());
        }
        if Instant::now() > until {
            bail!(
                "runner did not catch up: checkpoint {cp} of {seq}, {published} of {outputs} outputs published"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What one ledger drive measured.
struct LedgerRun {
    events: u64,
    outputs: usize,
    elapsed: f64,
    lat: Vec<f64>,
}

impl LedgerRun {
    fn per_s(&self) -> f64 {
        self.outputs as f64 / self.elapsed
    }
}

/// Publishes `events` deposits to the instances `pick` chooses (each the next deposit of
/// its account), as fast as acks allow or at `rate`/s, and times each to its output stored.
async fn ledger_drive(
    js: &jetstream::Context,
    tenant: &str,
    counts: &mut [u32],
    events: u64,
    rate: f64,
    pad: &str,
    mut pick: impl FnMut(u64) -> usize,
) -> Result<LedgerRun> {
    let sent: Arc<Mutex<HashMap<(usize, u32), Instant>>> = Arc::default();
    let mut seen = tail(
        js,
        "WORKFLOW_COMMANDS",
        &[format!("tenant.{tenant}.command.Account.*")],
    )
    .await?;
    let sent_rx = sent.clone();
    let collector = tokio::spawn(async move {
        let mut lat = Vec::with_capacity(events as usize);
        let mut last = None;
        while (lat.len() as u64) < events {
            let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(30), seen.next()).await
            else {
                break;
            };
            let Some(acct) = m
                .subject
                .rsplit('.')
                .next()
                .and_then(|a| a.trim_start_matches('a').parse::<usize>().ok())
            else {
                continue;
            };
            let v: Json = serde_json::from_slice(&m.payload).unwrap_or_default();
            let n = v["payload"]["n"]
                .as_u64()
                .or_else(|| v["payload"]["n"].as_str().and_then(|s| s.parse().ok()))
                .unwrap_or(0) as u32;
            let t0 = sent_rx.lock().ok().and_then(|s| s.get(&(acct, n)).copied());
            if let Some(t0) = t0 {
                lat.push(m.at.duration_since(t0).as_secs_f64() * 1000.0);
                last = Some(m.at);
            }
        }
        (lat, last)
    });
    let mut publisher = Publisher::new(js.clone(), 256);
    let started = Instant::now();
    for i in 0..events {
        if rate > 0.0 {
            tokio::time::sleep_until((started + Duration::from_secs_f64(i as f64 / rate)).into())
                .await;
        }
        let a = pick(i);
        counts[a] += 1;
        let n = counts[a];
        let id = format!("a{a}");
        let body = event(
            tenant,
            "Account",
            &id,
            "Deposited",
            json!({"n": n, "amount": 1, "pad": pad}),
        );
        let msg_id = body["event_id"].as_str().unwrap_or_default().to_string();
        sent.lock()
            .map_err(|_| anyhow::anyhow!("lock"))?
            .insert((a, n), Instant::now());
        publisher
            .send(
                format!("tenant.{tenant}.aggregate.Account.{id}"),
                &body,
                &msg_id,
            )
            .await?;
    }
    publisher.flush().await?;
    let (lat, last) = collector.await?;
    Ok(LedgerRun {
        events,
        outputs: lat.len(),
        elapsed: last
            .unwrap_or_else(Instant::now)
            .duration_since(started)
            .as_secs_f64(),
        lat,
    })
}

/// The runner's batch commits between two scrapes: how many, inputs per commit, the
/// commit's p50/p99 — what bounds a saga-mode runner whose CPU is not saturated — and the
/// store pages they wrote per input.
pub(crate) fn commits_line(before: &str, after: &str) -> String {
    use crate::probe::{metric_sum, window_quantile};
    let delta = |name: &str| metric_sum(after, name, &[]) - metric_sum(before, name, &[]);
    let commits = delta("runner_saga_commit_seconds_count");
    let inputs = delta("runner_saga_batch_size_sum");
    let q = |p: f64| {
        window_quantile(before, after, "runner_saga_commit_seconds", p)
            .map_or("-".to_string(), |s| format!("{:.1}", s * 1000.0))
    };
    let size = |p: f64| {
        window_quantile(before, after, "runner_saga_batch_size", p)
            .map_or("-".to_string(), |n| format!("{n:.0}"))
    };
    format!(
        "  commits during the max-rate run: {commits:.0}, {:.1} inputs each (p10/p50/p90 {}/{}/{}), commit ms p50={} p99={}, {:.1} s committing in all, store pages written per input {:.2}",
        inputs / commits.max(1.0),
        size(0.1),
        size(0.5),
        size(0.9),
        q(0.5),
        q(0.99),
        delta("runner_saga_commit_seconds_sum"),
        delta("runner_store_pages_dirtied_total") / inputs.max(1.0),
    )
}

/// Starts nats-server and a saga-mode runner for a scenario.
async fn saga_runner(
    p: &Programs,
    work: &WorkDir,
    manifest: &std::path::Path,
) -> Result<(Nats, Runner)> {
    let nats = Nats::start(&p.nats_server, &work.path).await?;
    let runner = Runner::start(&p.runner, &work.path, &nats.url, "saga", manifest, &[]).await?;
    Ok((nats, runner))
}

/// The ledger's acknowledgements stored on WORKFLOW_COMMANDS (fence markers, stored on
/// the same stream, not counted).
async fn stored(js: &jetstream::Context) -> Result<u64> {
    use futures::StreamExt;
    let s = js.get_stream("WORKFLOW_COMMANDS").await?;
    let mut subjects = s.info_with_subjects("tenant.*.command.Account.*").await?;
    let mut total = 0u64;
    while let Some(entry) = subjects.next().await {
        total += entry?.1 as u64;
    }
    Ok(total)
}

/// A max-rate run then a half-rate run; prints both, returns both and the runner's peak
/// anonymous memory (MiB) during the max-rate run.
#[allow(clippy::too_many_arguments)]
async fn max_and_half(
    js: &jetstream::Context,
    runner: &Runner,
    label: &str,
    tenant: &str,
    counts: &mut [u32],
    events: u64,
    pad: &str,
    mut pick: impl FnMut(u64) -> usize,
) -> Result<(LedgerRun, LedgerRun, f64)> {
    let metrics = runner.client();
    let before = metrics.text().await?;
    let stored_at_start = stored(js).await?;
    let sampler = Sampler::start(runner.proc.pid());
    let mut max = ledger_drive(js, tenant, counts, events, 0.0, pad, &mut pick).await?;
    let usage = sampler.finish().await;
    let after = metrics.text().await?;
    let half_rate = (max.per_s() / 2.0).max(1.0);
    let mut half = ledger_drive(js, tenant, counts, events, half_rate, pad, &mut pick).await?;
    println!(
        "{label}: max rate {:.0} transitions/s ({} of {} outputs, {:.2}s), ms {} | at half rate ({half_rate:.0}/s) ms {}",
        max.per_s(),
        max.outputs,
        max.events,
        max.elapsed,
        quantiles(&mut max.lat),
        quantiles(&mut half.lat),
    );
    println!(
        "{}, store file {:.0} MiB",
        usage.line("  runner during the max-rate run", max.elapsed),
        runner.store_bytes() as f64 / 1048576.0
    );
    println!("{}", commits_line(&before, &after));
    println!("{}", crate::pipeline::where_time_goes(&before, &after));
    if max.outputs as u64 != events || half.outputs as u64 != events {
        // What the runner stored, against what this process saw: a watcher that falls
        // behind (its pulls of large messages) is not an output the runner failed to make.
        let stored = stored(js).await?.saturating_sub(stored_at_start);
        if stored < 2 * events {
            bail!(
                "{label}: outputs missing: {stored} of {} stored; {}",
                2 * events,
                runner.log_tail(30)
            );
        }
        println!(
            "  note: the bench saw {} and {} of {events} outputs within its wait, but the runner stored all {stored}: latencies cover those seen",
            max.outputs, half.outputs
        );
    }
    Ok((max, half, usage.peak.anon as f64 / 1024.0))
}

pub(crate) async fn scale(a: ScaleArgs) -> Result<()> {
    let work = WorkDir::new("scale", a.programs.keep)?;
    let (nats, runner) = saga_runner(&a.programs, &work, &a.manifest).await?;
    let client = async_nats::connect(&nats.url).await?;
    let js = jetstream::new(client);
    let metrics = runner.client();
    let tenant = "scale";
    println!(
        "scale: ledger saga, saga mode, durability full; {} events per measurement at random over all live instances",
        a.events
    );
    let mut counts: Vec<u32> = Vec::new();
    let mut outputs = 0.0;
    let mut rng = Rng::new(0x5EED);
    let mut measured = Vec::new();
    for size in a.sizes {
        // Grow to `size` instances: one deposit each, through the runner.
        let from = counts.len();
        if size as usize > from {
            counts.resize(size as usize, 0);
            let started = Instant::now();
            let mut p = Publisher::new(js.clone(), 1024);
            for (i, c) in counts.iter_mut().enumerate().skip(from) {
                *c = 1;
                let id = format!("a{i}");
                let body = event(
                    tenant,
                    "Account",
                    &id,
                    "Deposited",
                    json!({"n": 1, "amount": 1}),
                );
                let msg_id = body["event_id"].as_str().unwrap_or_default().to_string();
                p.send(
                    format!("tenant.{tenant}.aggregate.Account.{id}"),
                    &body,
                    &msg_id,
                )
                .await?;
            }
            p.flush().await?;
            outputs += (size as usize - from) as f64;
            caught_up(&metrics, "AGGREGATE_EVENTS", p.last_seq, outputs).await?;
            let s = started.elapsed().as_secs_f64();
            println!(
                "scale: populated {} new instances in {s:.1}s ({:.0}/s through the runner)",
                size as usize - from,
                (size as usize - from) as f64 / s
            );
        }
        let n = counts.len() as u64;
        let (max, _, anon) = max_and_half(
            &js,
            &runner,
            &format!("scale {size} instances"),
            tenant,
            &mut counts,
            a.events,
            "",
            |_| rng.below(n) as usize,
        )
        .await?;
        outputs += 2.0 * a.events as f64;
        let store = runner.store_bytes() as f64;
        println!(
            "  store: {:.0} bytes per live instance (the mapped file, page cache, not the runner's heap)",
            store / n as f64
        );
        measured.push((n, max.per_s(), anon));
    }
    let base = measured.iter().find(|m| m.0 == 10_000);
    let big = measured.iter().find(|m| m.0 == 1_000_000);
    if let (Some(base), Some(big)) = (base, big) {
        use crate::goals::{Bound, SCALE_ANON_MIB, SCALE_RATIO, line};
        let what = "scale, 1 000 000 instances over 10 000, max-rate throughput";
        println!(
            "{}",
            line(what, big.1 / base.1, "", Bound::AtLeast, SCALE_RATIO)
        );
        let what = "scale, runner anonymous memory at 1 000 000 instances";
        println!("{}", line(what, big.2, "MiB", Bound::Below, SCALE_ANON_MIB));
    }
    Ok(())
}

pub(crate) async fn payload(a: PayloadArgs) -> Result<()> {
    let work = WorkDir::new("payload", a.programs.keep)?;
    let (nats, runner) = saga_runner(&a.programs, &work, &a.manifest).await?;
    let client = async_nats::connect(&nats.url).await?;
    let js = jetstream::new(client);
    println!(
        "payload: ledger saga, saga mode, durability full; {} events over {} instances per measurement",
        a.events, a.accounts
    );
    for size in a.sizes {
        let tenant = format!("p{size}");
        // Pad so the whole envelope is `size` bytes.
        let probe = event(
            &tenant,
            "Account",
            &format!("a{}", a.accounts - 1),
            "Deposited",
            json!({"n": 100000, "amount": 1, "pad": ""}),
        );
        let base = serde_json::to_vec(&probe)?.len();
        let pad = "x".repeat(size.saturating_sub(base));
        let mut counts = vec![0u32; a.accounts as usize];
        let accounts = a.accounts;
        // Large events: as many as fit in PAYLOAD_BYTES per run, so the run stays short.
        let events = a.events.min((PAYLOAD_BYTES / size.max(1) as u64).max(100));
        let (_, _, anon) = max_and_half(
            &js,
            &runner,
            &format!("payload {size} B events ({events} per run)"),
            &tenant,
            &mut counts,
            events,
            &pad,
            |i| (i % accounts) as usize,
        )
        .await?;
        if size >= 256 * 1024 {
            println!(
                "{}",
                crate::goals::line(
                    &format!("payload, runner peak anonymous memory with {size} B events"),
                    anon,
                    "MiB",
                    crate::goals::Bound::Below,
                    crate::goals::LARGE_EVENT_ANON_MIB,
                )
            );
        }
    }
    Ok(())
}

pub(crate) async fn timers(a: TimerArgs) -> Result<()> {
    let work = WorkDir::new("timers", a.programs.keep)?;
    let (nats, runner) = saga_runner(&a.programs, &work, &a.manifest).await?;
    let client = async_nats::connect(&nats.url).await?;
    let js = jetstream::new(client);
    let metrics = runner.client();
    let tenant = "timers";
    let lead = a.lead_s.unwrap_or((a.timers as f64 / 4000.0).max(5.0));
    println!(
        "timers: {} reminder sagas, each with one timer; due evenly over {}s starting {lead:.0}s after publishing begins; saga mode",
        a.timers, a.spread_s
    );
    let mut seen = tail(
        &js,
        "WORKFLOW_COMMANDS",
        &[format!("tenant.{tenant}.command.Reminder.*")],
    )
    .await?;
    let base = now_ms() + (lead * 1000.0) as u64;
    let started = Instant::now();
    let mut p = Publisher::new(js.clone(), 1024);
    for i in 0..a.timers {
        let due = base + (i as f64 * a.spread_s * 1000.0 / a.timers as f64) as u64;
        let id = format!("r{i}");
        let body = event(
            tenant,
            "Reminder",
            &id,
            "ReminderSet",
            json!({"due_ms": due}),
        );
        let msg_id = body["event_id"].as_str().unwrap_or_default().to_string();
        p.send(
            format!("tenant.{tenant}.aggregate.Reminder.{id}"),
            &body,
            &msg_id,
        )
        .await?;
    }
    p.flush().await?;
    caught_up(&metrics, "AGGREGATE_EVENTS", p.last_seq, 0.0).await?;
    // The timer loop refreshes its gauge when it polls (saga.timer_poll, 200 ms).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pending = metrics.sum("runner_timers_pending", &[]).await?;
    let taken = started.elapsed().as_secs_f64();
    println!(
        "timers: {} timers taken in by the runner in {taken:.1}s; pending {pending:.0} when the runner last counted{}",
        a.timers,
        if now_ms() > base {
            " (WARNING: some came due before all were taken in; raise BENCH_TIMER_LEAD_S)"
        } else {
            ""
        }
    );
    let sampler = Sampler::start(runner.proc.pid());
    let mut lag = Vec::with_capacity(a.timers as usize);
    let mut last_fire = base;
    while (lag.len() as u64) < a.timers {
        let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(30), seen.next()).await else {
            break;
        };
        let at = now_ms();
        let v: Json = serde_json::from_slice(&m.payload).unwrap_or_default();
        let due = v["payload"]["due_ms"]
            .as_u64()
            .or_else(|| v["payload"]["due_ms"].as_f64().map(|f| f as u64))
            .or_else(|| v["payload"]["due_ms"].as_str().and_then(|s| s.parse().ok()));
        if let Some(due) = due {
            lag.push(at.saturating_sub(due) as f64);
            last_fire = last_fire.max(at);
        }
    }
    let usage = sampler.finish().await;
    let text = metrics.text().await?;
    let hist_p99 = histogram_quantile(&text, "runner_timer_fire_lag_seconds", 0.99);
    let fired = lag.len();
    let window = (last_fire.saturating_sub(base)) as f64 / 1000.0;
    lag.sort_by(|x, y| x.total_cmp(y));
    println!(
        "timers: fired {fired} of {} in {window:.1}s from the first due time ({:.0}/s); fire lag (due -> command stored) ms p50={:.0} p90={:.0} p99={:.0} max={:.0}; runner histogram p99 <= {}",
        a.timers,
        fired as f64 / window.max(1e-9),
        percentile(&lag, 0.5),
        percentile(&lag, 0.9),
        percentile(&lag, 0.99),
        lag.last().copied().unwrap_or(f64::NAN),
        hist_p99.map_or("n/a".into(), |s| format!("{:.0} ms", s * 1000.0)),
    );
    println!(
        "{}",
        usage.line("  runner while timers fired", window.max(1e-9))
    );
    if fired as u64 != a.timers {
        bail!("only {fired} of {} timers fired", a.timers);
    }
    Ok(())
}
