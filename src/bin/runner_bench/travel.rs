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
//!
//! `run` keeps the load ([`Load`]: the trips in flight, each finished one replaced), the
//! trips waiting for their checkpoint, and the counted figures ([`Counted`]) apart, and
//! checks one trip of each path in the store at the end.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use async_nats::jetstream;
use futures::StreamExt;
use serde_json::{Value as Json, json};

use crate::harness::{Nats, Programs, Runner, WorkDir};
use crate::probe::Sampler;
use crate::{Seen, event, quantiles, tail};

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
    let (poller, mut cp_rx) = poll_checkpoints(&runner);

    let mut load = Load {
        trips: HashMap::new(),
        next: 0,
        fail_share: a.fail_share,
    };
    // Trips whose last result is stored, by partition and inbox sequence.
    let mut waiting: HashMap<u32, Waiting> = HashMap::new();
    let mut counted = Counted::new(a.warmup, a.warmup + a.sagas);
    let sampler = Sampler::start(runner.proc.pid());
    while load.next < a.in_flight {
        load.start_next(&js).await?;
    }
    while counted.done < a.sagas {
        tokio::select! {
            m = tokio::time::timeout(Duration::from_secs(30), results.next()) => {
                let Ok(Some(m)) = m else { bail!("no effect result for 30 s; {} of {} counted sagas done (run with --keep for logs)", counted.done, a.sagas) };
                load.on_result(&m, &mut waiting);
            }
            Ok(()) = cp_rx.changed() => {
                let cps = cp_rx.borrow_and_update().clone();
                let now = Instant::now();
                for (i, t0, fail) in committed(&mut waiting, &cps) {
                    counted.note(i, t0, fail, now);
                    // Replace it at once (trips past the counted ones keep the load steady to the end).
                    load.start_next(&js).await?;
                }
            }
        }
    }
    let usage = sampler.finish().await;
    poller.abort();
    let elapsed = counted.report();
    println!("{}", usage.line("  runner", elapsed));
    check_examples(&a.programs.runner, &runner.data_dir, &counted.examples)
}

/// Starts the checkpoint poller: the committed inbox position of every partition, read
/// off the runner's metrics every 5 ms.
fn poll_checkpoints(
    runner: &Runner,
) -> (
    tokio::task::JoinHandle<()>,
    tokio::sync::watch::Receiver<HashMap<u32, u64>>,
) {
    let (cp_tx, cp_rx) = tokio::sync::watch::channel(HashMap::<u32, u64>::new());
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
    (poller, cp_rx)
}

/// The trips in flight, and the number of the next one to start.
struct Load {
    trips: HashMap<String, Trip>,
    next: u64,
    fail_share: f64,
}

impl Load {
    /// Starts trip `next` (failing its car reservation for its share) and puts it in flight.
    async fn start_next(&mut self, js: &jetstream::Context) -> Result<()> {
        let fail = fails(self.next, self.fail_share);
        let t0 = start_trip(js, self.next, fail).await?;
        self.trips.insert(
            format!("trip-{}", self.next),
            Trip {
                started: t0,
                fail,
                stay: 0,
            },
        );
        self.next += 1;
        Ok(())
    }

    /// Follows one effect result: when it is its trip's last, the trip leaves the flight
    /// and waits in `waiting` for its partition's checkpoint to pass the result.
    fn on_result(&mut self, m: &Seen, waiting: &mut HashMap<u32, Waiting>) {
        let v: Json = serde_json::from_slice(&m.payload).unwrap_or_default();
        let Some(id) = v["metadata"]["correlation_id"].as_str() else {
            return;
        };
        let effect = v["effect_name"].as_str().unwrap_or_default();
        let Some(trip) = self.trips.get_mut(id) else {
            return;
        };
        let last = match (trip.fail, effect) {
            (false, "reserve_hotel" | "reserve_car") => {
                trip.stay += 1;
                trip.stay == 2
            }
            (true, "cancel_flight") => true,
            _ => false,
        };
        if last {
            let i: u64 = id.trim_start_matches("trip-").parse().unwrap_or(0);
            let p: u32 = m
                .subject
                .split('.')
                .nth(2)
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            waiting
                .entry(p)
                .or_default()
                .entry(m.seq)
                .or_default()
                .push((i, trip.started, trip.fail));
            self.trips.remove(id);
        }
    }
}

/// Takes out of `waiting` the trips whose partition's checkpoint in `cps` has passed their
/// last result: the trips finished, as (trip, start, compensated).
fn committed(
    waiting: &mut HashMap<u32, Waiting>,
    cps: &HashMap<u32, u64>,
) -> Vec<(u64, Instant, bool)> {
    let mut finished = Vec::new();
    for (p, w) in waiting.iter_mut() {
        let cp = cps.get(p).copied().unwrap_or(0);
        let later = w.split_off(&(cp + 1));
        finished.extend(std::mem::replace(w, later).into_values().flatten());
    }
    finished
}

/// The counted trips' figures: trips `from..to` are counted, the warm-up before them and
/// the replacements after them are not.
struct Counted {
    from: u64,
    to: u64,
    ok_lat: Vec<f64>,
    comp_lat: Vec<f64>,
    done: u64,
    first: Option<Instant>,
    last: Instant,
    /// One counted trip of each path, checked in the store at the end.
    examples: [Option<u64>; 2],
}

impl Counted {
    fn new(from: u64, to: u64) -> Self {
        Self {
            from,
            to,
            ok_lat: Vec::new(),
            comp_lat: Vec::new(),
            done: 0,
            first: None,
            last: Instant::now(),
            examples: [None, None],
        }
    }

    /// Notes trip `i`, started at `t0`, as finished `now`, if it is counted.
    fn note(&mut self, i: u64, t0: Instant, fail: bool, now: Instant) {
        if i >= self.from && i < self.to {
            self.first = Some(self.first.map_or(t0, |f: Instant| f.min(t0)));
            self.last = now;
            self.done += 1;
            self.examples[usize::from(fail)].get_or_insert(i);
            let ms = now.duration_since(t0).as_secs_f64() * 1000.0;
            if fail {
                self.comp_lat.push(ms)
            } else {
                self.ok_lat.push(ms)
            }
        }
    }

    /// Prints the counted trips' lines; returns the seconds from the first counted trip's
    /// start to the last one's finish.
    fn report(&mut self) -> f64 {
        let elapsed = self
            .last
            .duration_since(self.first.unwrap_or(self.last))
            .as_secs_f64();
        let mut all: Vec<f64> = self.ok_lat.iter().chain(&self.comp_lat).copied().collect();
        println!(
            "travel: counted={} elapsed={elapsed:.2}s sagas_per_s={:.0} | start->finish ms all {}",
            self.done,
            self.done as f64 / elapsed,
            quantiles(&mut all)
        );
        println!(
            "  completed: {} sagas, ms {}",
            self.ok_lat.len(),
            quantiles(&mut self.ok_lat)
        );
        println!(
            "  compensated: {} sagas, ms {}",
            self.comp_lat.len(),
            quantiles(&mut self.comp_lat)
        );
        elapsed
    }
}

/// The completion rule above, checked against the store: `runner inspect` on one trip of
/// each path (it reads the libmdbx file while the runner runs).
fn check_examples(runner: &Path, data_dir: &Path, examples: &[Option<u64>; 2]) -> Result<()> {
    for (i, want) in examples.iter().zip(["completed", "compensated"]) {
        let Some(i) = i else { continue };
        let out = std::process::Command::new(runner)
            .arg("inspect")
            .arg("--data-dir")
            .arg(data_dir)
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
