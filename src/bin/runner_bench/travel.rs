//! Whole travel-booking orchestrations (`bench/travel.yaml`, noop effects), closed loop:
//! a fixed number of sagas in flight, each finished one replaced at once by a new one.
//!
//! A finished orchestration emits nothing (its state becomes `completed` or `compensated`
//! in the store), so completion is observed this way: the bench follows the effect results,
//! which the executor stores straight into their partition's saga inbox
//! (`runner.inbox.<p>.result`), and notes the inbox sequence of each trip's last one (both
//! reservations of the stay stage on success; `cancel_flight` after a compensation); the
//! trip is finished once that partition's committed checkpoint
//! (`runner_partition_checkpoint{partition}`, polled every 5 ms) has passed that sequence,
//! i.e. once the terminal transition is durably committed.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use async_nats::jetstream;
use futures::StreamExt;
use serde_json::{Value as Json, json};

use crate::harness::{Nats, Programs, Runner, WorkDir};
use crate::probe::Sampler;
use crate::{event, quantiles, tail};

#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    #[command(flatten)]
    programs: Programs,
    /// Sagas in flight.
    #[arg(long, env = "BENCH_TRAVEL_IN_FLIGHT", default_value_t = 150)]
    in_flight: u64,
    /// Uncounted sagas first.
    #[arg(long, env = "BENCH_TRAVEL_WARMUP", default_value_t = 200)]
    warmup: u64,
    /// Counted sagas.
    #[arg(long, env = "BENCH_TRAVEL_SAGAS", default_value_t = 2_000)]
    sagas: u64,
    /// Share of trips whose car reservation fails, so they take the compensation path.
    #[arg(long, env = "BENCH_TRAVEL_FAIL_SHARE", default_value_t = 0.1)]
    fail_share: f64,
    /// The travel manifest with noop effects.
    #[arg(long, default_value = "bench/travel.yaml")]
    manifest: PathBuf,
}

const TENANT: &str = "travel";

fn fails(i: u64, share: f64) -> bool {
    ((i + 1) as f64 * share).floor() > (i as f64 * share).floor()
}

struct Trip {
    started: Instant,
    fail: bool,
    /// Reservations of the stay stage seen (success path).
    stay: u8,
}

async fn start_trip(js: &jetstream::Context, i: u64, fail: bool) -> Result<Instant> {
    let id = format!("trip-{i}");
    let body = event(
        TENANT,
        "Trip",
        &id,
        "TripRequested",
        json!({
            "traveller": {"name": format!("traveller {i}"), "loyalty": "gold"},
            "flight": {"from": "LIS", "to": "OSL", "date": "2026-12-01"},
            "hotel": {"city": "Oslo", "nights": 3},
            "car": {"class": "compact"},
            "fail_car": fail,
        }),
    );
    let mut h = async_nats::HeaderMap::new();
    h.insert(
        async_nats::header::NATS_MESSAGE_ID,
        body["event_id"].as_str().unwrap_or_default(),
    );
    let t0 = Instant::now();
    let ack = js
        .publish_with_headers(
            format!("tenant.{TENANT}.aggregate.Trip.{id}"),
            h,
            serde_json::to_vec(&body)?.into(),
        )
        .await?;
    tokio::spawn(async move {
        if let Err(e) = ack.await {
            eprintln!("travel: publish not acknowledged: {e}");
        }
    });
    Ok(t0)
}

pub(crate) async fn run(a: Args) -> Result<()> {
    let work = WorkDir::new("travel", a.programs.keep)?;
    let nats = Nats::start(&a.programs.nats_server, &work.path).await?;
    let runner = Runner::start(
        &a.programs.runner,
        &work.path,
        &nats.url,
        "combined",
        &a.manifest,
        &[],
    )
    .await?;
    println!(
        "travel: closed loop, {} in flight, {} warm-up + {} counted sagas, {:.0}% compensated (car fails), noop effects, combined mode",
        a.in_flight,
        a.warmup,
        a.sagas,
        a.fail_share * 100.0
    );
    let client = async_nats::connect(&nats.url).await?;
    let js = jetstream::new(client);
    let mut results = tail(&js, "SAGA_INBOX", &["runner.inbox.*.result".to_string()]).await?;

    // Checkpoint poller: the committed inbox position of every partition.
    let (cp_tx, mut cp_rx) = tokio::sync::watch::channel(HashMap::<u32, u64>::new());
    let metrics = runner.client();
    let poller = tokio::spawn(async move {
        loop {
            if let Ok(text) = metrics.text().await
                && cp_tx.send(partition_checkpoints(&text)).is_err()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });

    let total = a.warmup + a.sagas;
    let mut trips: HashMap<String, Trip> = HashMap::new();
    let mut next = 0u64;
    // Trips whose last result is stored, by partition and inbox sequence.
    let mut waiting: HashMap<u32, Waiting> = HashMap::new();
    let mut ok_lat = Vec::new();
    let mut comp_lat = Vec::new();
    let mut counted_done = 0u64;
    let mut first_counted: Option<Instant> = None;
    // One counted trip of each path, checked in the store at the end.
    let mut examples: [Option<u64>; 2] = [None, None];
    let mut last_counted = Instant::now();
    let sampler = Sampler::start(runner.proc.pid());
    while next < a.in_flight {
        let fail = fails(next, a.fail_share);
        let t0 = start_trip(&js, next, fail).await?;
        trips.insert(
            format!("trip-{next}"),
            Trip {
                started: t0,
                fail,
                stay: 0,
            },
        );
        next += 1;
    }
    while counted_done < a.sagas {
        tokio::select! {
            m = tokio::time::timeout(Duration::from_secs(30), results.next()) => {
                let Ok(Some(m)) = m else { bail!("no effect result for 30 s; {} of {} counted sagas done (run with --keep for logs)", counted_done, a.sagas) };
                let v: Json = serde_json::from_slice(&m.payload).unwrap_or_default();
                let Some(id) = v["metadata"]["correlation_id"].as_str() else { continue };
                let effect = v["effect_name"].as_str().unwrap_or_default();
                let Some(trip) = trips.get_mut(id) else { continue };
                let last = match (trip.fail, effect) {
                    (false, "reserve_hotel" | "reserve_car") => { trip.stay += 1; trip.stay == 2 }
                    (true, "cancel_flight") => true,
                    _ => false,
                };
                if last {
                    let i: u64 = id.trim_start_matches("trip-").parse().unwrap_or(0);
                    let p: u32 = m.subject.split('.').nth(2).and_then(|p| p.parse().ok()).unwrap_or(0);
                    waiting.entry(p).or_default().entry(m.seq).or_default().push((i, trip.started, trip.fail));
                    trips.remove(id);
                }
            }
            Ok(()) = cp_rx.changed() => {
                let cps = cp_rx.borrow_and_update().clone();
                let now = Instant::now();
                let mut finished = Vec::new();
                for (p, w) in waiting.iter_mut() {
                    let cp = cps.get(p).copied().unwrap_or(0);
                    let later = w.split_off(&(cp + 1));
                    finished.extend(std::mem::replace(w, later).into_values().flatten());
                }
                for (i, t0, fail) in finished {
                    if i >= a.warmup && i < total {
                        first_counted = Some(first_counted.map_or(t0, |f: Instant| f.min(t0)));
                        last_counted = now;
                        counted_done += 1;
                        examples[usize::from(fail)].get_or_insert(i);
                        let ms = now.duration_since(t0).as_secs_f64() * 1000.0;
                        if fail { comp_lat.push(ms) } else { ok_lat.push(ms) }
                    }
                    // Replace it at once (more than `total` keeps the load steady to the end).
                    let fail = fails(next, a.fail_share);
                    let t0 = start_trip(&js, next, fail).await?;
                    trips.insert(format!("trip-{next}"), Trip { started: t0, fail, stay: 0 });
                    next += 1;
                }
            }
        }
    }
    let usage = sampler.finish().await;
    poller.abort();
    let elapsed = last_counted
        .duration_since(first_counted.unwrap_or(last_counted))
        .as_secs_f64();
    let mut all: Vec<f64> = ok_lat.iter().chain(&comp_lat).copied().collect();
    println!(
        "travel: counted={} elapsed={elapsed:.2}s sagas_per_s={:.0} | start->finish ms all {}",
        counted_done,
        counted_done as f64 / elapsed,
        quantiles(&mut all)
    );
    println!(
        "  completed: {} sagas, ms {}",
        ok_lat.len(),
        quantiles(&mut ok_lat)
    );
    println!(
        "  compensated: {} sagas, ms {}",
        comp_lat.len(),
        quantiles(&mut comp_lat)
    );
    println!("{}", usage.line("  runner", elapsed));
    // The completion rule above, checked against the store: `runner inspect` on one trip of
    // each path (it reads the libmdbx file while the runner runs).
    for (i, want) in examples.iter().zip(["completed", "compensated"]) {
        let Some(i) = i else { continue };
        let out = std::process::Command::new(&a.programs.runner)
            .arg("inspect")
            .arg("--data-dir")
            .arg(&runner.data_dir)
            .args(["--tenant", TENANT, "--saga", "travel_booking", "--id"])
            .arg(format!("trip-{i}"))
            .output()?;
        let v: Json = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let state = v
            .pointer("/instance/state")
            .or_else(|| v.get("state"))
            .and_then(Json::as_str)
            .unwrap_or("?");
        println!("  check: trip-{i} is `{state}` in the store (expected `{want}`)");
        if state != want {
            bail!(
                "trip-{i} is `{state}`, not `{want}`: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    Ok(())
}

/// A partition's trips whose last result is stored, by inbox sequence: (trip, start,
/// compensated).
type Waiting = BTreeMap<u64, Vec<(u64, Instant, bool)>>;

/// Every `runner_partition_checkpoint{partition="p"}` sample of a scrape, by partition.
fn partition_checkpoints(text: &str) -> HashMap<u32, u64> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("runner_partition_checkpoint{partition=\"")?;
            let (p, value) = rest.split_once("\"} ")?;
            Some((p.parse().ok()?, value.trim().parse::<f64>().ok()? as u64))
        })
        .collect()
}
