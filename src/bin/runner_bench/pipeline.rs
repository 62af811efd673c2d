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
//! acknowledges the command. `limit` does exactly those consumes, publishes (with bodies of the sizes
//! the runner produced, copied from its streams), KV operations and acks, on streams of
//! its own.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use async_nats::jetstream::{self, consumer::pull, kv, stream};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{Value as Json, json};

use crate::harness::{Nats, Programs, Runner, Sampler, WorkDir, spawn_self};
use crate::{Publisher, event, now_ms, quantiles, tail};

/// Saga transitions per order on the happy path.
const TRANSITIONS_PER_ORDER: f64 = 4.0;

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
}

/// Where a drive sends orders and watches their outputs.
#[derive(Clone)]
enum Flow {
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
    fn final_output(&self) -> (&'static str, String) {
        match self {
            Flow::Runner { tenant } => (
                "WORKFLOW_EVENTS",
                format!("tenant.{tenant}.workflow_event.order.*"),
            ),
            Flow::Limit => ("LIMIT_EVT", "limit.evt.workflow_event.order.*".into()),
        }
    }
    /// The order a seen output belongs to.
    fn order_of(&self, subject: &str, payload: &[u8], first: bool) -> Option<String> {
        if first && matches!(self, Flow::Runner { .. }) {
            // The runner's command subject ends with the command id; the body names the order.
            let v: Json = serde_json::from_slice(payload).ok()?;
            return v["payload"]["order_id"].as_str().map(str::to_owned);
        }
        subject.rsplit('.').next().map(str::to_owned)
    }
}

/// What one drive measured.
struct Drive {
    orders: u64,
    completed: usize,
    elapsed: f64,
    first: Vec<f64>,
    done: Vec<f64>,
}

impl Drive {
    fn sagas_per_s(&self) -> f64 {
        self.completed as f64 / self.elapsed
    }
    fn line(&mut self, label: &str, transitions: f64) -> String {
        format!(
            "{label}: orders={} completed={} elapsed={:.2}s transitions_per_s={:.0} sagas_per_s={:.0} | input->first output stored (charge_card) ms {} | input->saga completed (OrderFulfilled stored) ms {}",
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

/// Publishes `orders` OrderPlaced events (as fast as acks allow, or at `rate` per second)
/// and waits for every order's first and final outputs.
async fn drive(js: &jetstream::Context, flow: &Flow, orders: u64, rate: f64) -> Result<Drive> {
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
            let mut last = None;
            while (lat.len() as u64) < orders {
                let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(30), seen.next()).await
                else {
                    break;
                };
                let Some(id) = flow.order_of(&m.subject, &m.payload, first) else {
                    continue;
                };
                let t0 = sent.lock().ok().and_then(|s| s.get(&id).copied());
                if let Some(t0) = t0 {
                    lat.push(m.at.duration_since(t0).as_secs_f64() * 1000.0);
                    last = Some(m.at);
                }
            }
            (lat, last)
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
    let (first, _) = collectors.remove(0).await?;
    let (done, last) = collectors.remove(0).await?;
    let elapsed = last
        .unwrap_or_else(Instant::now)
        .duration_since(started)
        .as_secs_f64();
    Ok(Drive {
        orders,
        completed: done.len(),
        elapsed,
        first,
        done,
    })
}

pub(crate) async fn run(a: Args) -> Result<()> {
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

    // (transitions/s, sagas/s) of the max-rate run.
    let mut max: Option<(f64, f64)> = None;
    let applied = || {
        metrics.sum(
            "runner_saga_transitions_total",
            &[("saga", "order"), ("outcome", "applied")],
        )
    };
    for (label, tenant) in [("max", "bench"), ("half", "half")] {
        let rate = max.map_or(0.0, |(_, sagas)| sagas / 2.0);
        let before = applied().await?;
        let sampler = Sampler::start(runner.proc.pid());
        let flow = Flow::Runner {
            tenant: tenant.into(),
        };
        let mut d = drive(&js, &flow, a.orders, rate).await?;
        let usage = sampler.finish().await;
        let transitions = applied().await? - before;
        let label = if rate > 0.0 {
            format!("runner {label} rate ({rate:.0} orders/s offered)")
        } else {
            format!("runner {label} rate")
        };
        println!("{}", d.line(&label, transitions));
        println!("{}", usage.line("  runner", d.elapsed));
        if d.completed as u64 != a.orders {
            bail!(
                "only {} of {} orders completed; see the runner log in {} (run with --keep)",
                d.completed,
                a.orders,
                work.path.display()
            );
        }
        max.get_or_insert((transitions / d.elapsed, d.sagas_per_s()));
    }
    let (runner_tps, _) = max.context("no max-rate run")?;
    let store = runner.store_bytes();
    runner.proc.stop(Duration::from_secs(30));
    println!(
        "  runner store: {:.0} MiB on disk",
        store as f64 / 1048576.0
    );

    // The messaging limit, on the same server, the runner stopped.
    let (mut shadow, out) = spawn_self(
        &[
            "--nats-url".into(),
            nats.url.clone(),
            "limit".into(),
            "--orders".into(),
            a.orders.to_string(),
        ],
        &work.path.join("limit.log"),
    )?;
    let mut lines = BufReader::new(out).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.starts_with("limit: ready") => {
                println!("{l}");
                break;
            }
            Some(Ok(l)) => println!("{l}"),
            _ => bail!("the limit process ended before it was ready"),
        }
    }
    let sampler = Sampler::start(shadow.pid());
    let mut d = drive(&js, &Flow::Limit, a.orders, 0.0).await?;
    let usage = sampler.finish().await;
    let limit_tps = d.completed as f64 * TRANSITIONS_PER_ORDER / d.elapsed;
    println!(
        "{}",
        d.line(
            "messaging limit max rate",
            d.completed as f64 * TRANSITIONS_PER_ORDER
        )
    );
    println!("{}", usage.line("  limit process", d.elapsed));
    shadow.stop(Duration::from_secs(5));
    println!(
        "result: runner {runner_tps:.0} transitions/s, messaging limit {limit_tps:.0}/s, ratio {:.2}",
        runner_tps / limit_tps
    );
    Ok(())
}

/// Bodies of the runner's own outputs, so the shadow moves the same bytes.
struct Templates {
    /// Commands by effect name or aggregate command name.
    commands: HashMap<String, Bytes>,
    /// Effect results by effect name.
    results: HashMap<String, Bytes>,
    /// The OrderFulfilled event.
    fulfilled: Bytes,
}

const COMMAND_KINDS: [&str; 5] = [
    "charge_card",
    "reserve_stock",
    "create_shipment",
    "Confirm",
    "MarkShipped",
];
const EFFECTS: [&str; 3] = ["charge_card", "reserve_stock", "create_shipment"];

/// Copies one message of each kind from the runner's streams (the first and last 2 000 of
/// each); falls back to a 400-byte body when none is found.
async fn sample(js: &jetstream::Context) -> Templates {
    let filler = || Bytes::from(format!("{{\"pad\":\"{}\"}}", "x".repeat(390)));
    let mut commands = HashMap::new();
    let mut results = HashMap::new();
    let mut fulfilled = None;
    for name in ["WORKFLOW_COMMANDS", "WORKFLOW_EVENTS"] {
        let Ok(mut s) = js.get_stream(name).await else {
            continue;
        };
        let Ok(info) = s.info().await else { continue };
        let (first, last) = (info.state.first_sequence, info.state.last_sequence);
        // Early outputs are at the start of the stream, late ones (MarkShipped, OrderFulfilled)
        // at its end.
        let head = first..=last.min(first + 2000);
        let tail = last.saturating_sub(2000).max(first + 2001)..=last;
        for seq in head.chain(tail) {
            let Ok(m) = s.get_raw_message(seq).await else {
                continue;
            };
            let t: Vec<&str> = m.subject.split('.').collect();
            let body: Json = serde_json::from_slice(&m.payload).unwrap_or_default();
            match t.get(2).copied() {
                Some("effect") => {
                    commands
                        .entry(t.get(3).copied().unwrap_or_default().to_string())
                        .or_insert(m.payload.clone());
                }
                Some("command") => {
                    commands
                        .entry(
                            body["command_type"]
                                .as_str()
                                .unwrap_or_default()
                                .to_string(),
                        )
                        .or_insert(m.payload.clone());
                }
                Some("effect_result") => {
                    results
                        .entry(t.get(3).copied().unwrap_or_default().to_string())
                        .or_insert(m.payload.clone());
                }
                Some("workflow_event") if body["event_type"] == "OrderFulfilled" => {
                    fulfilled.get_or_insert(m.payload.clone());
                }
                _ => {}
            }
            if commands.len() >= COMMAND_KINDS.len()
                && results.len() >= EFFECTS.len()
                && fulfilled.is_some()
            {
                break;
            }
        }
    }
    for k in COMMAND_KINDS {
        commands.entry(k.to_string()).or_insert_with(filler);
    }
    for k in EFFECTS {
        results.entry(k.to_string()).or_insert_with(filler);
    }
    Templates {
        commands,
        results,
        fulfilled: fulfilled.unwrap_or_else(filler),
    }
}

/// One output of the shadow saga side.
struct Out {
    subject: String,
    msg_id: String,
    body: Bytes,
}

fn headers(msg_id: &str) -> async_nats::HeaderMap {
    let mut h = async_nats::HeaderMap::new();
    h.insert(async_nats::header::NATS_MESSAGE_ID, msg_id);
    h.insert("Runner-Tenant", "limit");
    h
}

/// `runner-bench limit`: the order pipeline's messaging with no engine and no state.
pub(crate) async fn limit(
    _client: async_nats::Client,
    js: jetstream::Context,
    orders: u64,
) -> Result<()> {
    for (name, subject) in [
        ("LIMIT_AGG", "limit.agg.>"),
        ("LIMIT_CMD", "limit.cmd.>"),
        ("LIMIT_EVT", "limit.evt.>"),
    ] {
        let _ = js.delete_stream(name).await;
        js.create_stream(stream::Config {
            name: name.into(),
            subjects: vec![subject.into()],
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await?;
    }
    let _ = js.delete_key_value("LIMIT_CLAIMS").await;
    let claims = js
        .create_key_value(kv::Config {
            bucket: "LIMIT_CLAIMS".into(),
            history: 1,
            max_age: Duration::from_secs(7 * 86400),
            ..Default::default()
        })
        .await?;
    let t = Arc::new(sample(&js).await);
    let mut sizes: Vec<String> = COMMAND_KINDS
        .iter()
        .map(|k| format!("{k}={}B", t.commands[*k].len()))
        .collect();
    sizes.extend(
        EFFECTS
            .iter()
            .map(|k| format!("{k}_result={}B", t.results[*k].len())),
    );
    sizes.push(format!("OrderFulfilled={}B", t.fulfilled.len()));
    println!(
        "limit: output bodies copied from the runner's streams: {}",
        sizes.join(" ")
    );
    println!("limit: ready");

    // Relay: publishes what the saga loops produce, a window at a time, awaiting the acks.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<Out>>();
    let relay_js = js.clone();
    let relay = tokio::spawn(async move {
        while let Some(mut batch) = rx.recv().await {
            while batch.len() < 1024 {
                match rx.try_recv() {
                    Ok(more) => batch.extend(more),
                    Err(_) => break,
                }
            }
            let mut acks = Vec::with_capacity(batch.len());
            for o in batch {
                acks.push(
                    relay_js
                        .publish_with_headers(o.subject, headers(&o.msg_id), o.body)
                        .await?,
                );
            }
            for a in futures::future::join_all(acks.into_iter().map(|a| a.into_future())).await {
                a?;
            }
        }
        Ok::<_, anyhow::Error>(())
    });

    // Saga side: one ordered consumer per input stream, like the runner's worker.
    let done = Arc::new(AtomicU64::new(0));
    let finished = Arc::new(tokio::sync::Notify::new());
    for (stream, filter) in [("LIMIT_AGG", "limit.agg.>"), ("LIMIT_EVT", "limit.evt.>")] {
        let s = js.get_stream(stream).await?;
        let msgs = s
            .create_consumer(pull::OrderedConfig {
                filter_subjects: vec![filter.into()],
                ..Default::default()
            })
            .await?
            .messages()
            .await?;
        let (t, tx, done, finished) = (t.clone(), tx.clone(), done.clone(), finished.clone());
        tokio::spawn(async move {
            let mut chunks = msgs.ready_chunks(256);
            while let Some(chunk) = chunks.next().await {
                let mut outs = Vec::new();
                for m in chunk.into_iter().flatten() {
                    let tok: Vec<&str> = m.subject.split('.').collect();
                    let id = tok.last().copied().unwrap_or_default();
                    let cmd = |k: &str, sub: String| Out {
                        msg_id: format!("{sub}-{k}"),
                        subject: sub,
                        body: t.commands[k].clone(),
                    };
                    match (tok.get(2).copied(), tok.get(3).copied()) {
                        (Some("Order"), _) => {
                            outs.push(cmd(
                                "charge_card",
                                format!("limit.cmd.effect.charge_card.{id}"),
                            ));
                        }
                        (Some("effect_result"), Some("charge_card")) => outs.push(cmd(
                            "reserve_stock",
                            format!("limit.cmd.effect.reserve_stock.{id}"),
                        )),
                        (Some("effect_result"), Some("reserve_stock")) => {
                            outs.push(cmd("Confirm", format!("limit.cmd.command.Order.{id}")));
                            outs.push(cmd(
                                "create_shipment",
                                format!("limit.cmd.effect.create_shipment.{id}"),
                            ));
                        }
                        (Some("effect_result"), Some("create_shipment")) => {
                            outs.push(cmd("MarkShipped", format!("limit.cmd.command.Order.{id}")));
                            outs.push(Out {
                                subject: format!("limit.evt.workflow_event.order.{id}"),
                                msg_id: format!("fulfilled-{id}"),
                                body: t.fulfilled.clone(),
                            });
                        }
                        (Some("workflow_event"), _)
                            if done.fetch_add(1, Ordering::SeqCst) + 1 >= orders =>
                        {
                            finished.notify_one();
                        }
                        _ => {}
                    }
                }
                if !outs.is_empty() && tx.send(outs).is_err() {
                    return;
                }
            }
        });
    }
    drop(tx);

    // Effect side: a durable pull consumer, up to 64 commands at once, like the worker.
    let cmd_stream = js.get_stream("LIMIT_CMD").await?;
    let consumer = cmd_stream
        .create_consumer(pull::Config {
            durable_name: Some("limit-effect".into()),
            filter_subject: "limit.cmd.effect.>".into(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 1024,
            max_deliver: -1,
            ..Default::default()
        })
        .await?;
    let mut msgs = consumer
        .stream()
        .max_messages_per_batch(64)
        .expires(Duration::from_secs(5))
        .messages()
        .await?;
    let permits = Arc::new(tokio::sync::Semaphore::new(64));
    let owner = format!("limit/{}", uuid::Uuid::new_v4().simple());
    let effects = tokio::spawn({
        let (js, t) = (js.clone(), t.clone());
        async move {
            while let Some(m) = msgs.next().await {
                let Ok(m) = m else { continue };
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    break;
                };
                let (js, t, claims, owner) = (js.clone(), t.clone(), claims.clone(), owner.clone());
                tokio::spawn(async move {
                    if let Err(e) = effect(&js, &t, &claims, &owner, &m).await {
                        eprintln!("limit: effect command failed: {e}");
                    }
                    drop(permit);
                });
            }
        }
    });

    tokio::select! {
        _ = finished.notified() => {}
        r = relay => { r??; bail!("the relay stopped"); }
    }
    effects.abort();
    println!("limit: {} orders through", done.load(Ordering::SeqCst));
    Ok(())
}

/// One effect command, the way the worker does it on a first delivery: claim create, CAS
/// update with the result, result publish (ack awaited), command ack.
async fn effect(
    js: &jetstream::Context,
    t: &Templates,
    claims: &kv::Store,
    owner: &str,
    m: &jetstream::Message,
) -> Result<()> {
    let tok: Vec<&str> = m.subject.split('.').collect();
    let (Some(name), Some(id)) = (tok.get(3), tok.get(4)) else {
        bail!("unexpected subject {}", m.subject);
    };
    let key = format!("limit.{name}-{id}");
    let lease = now_ms() + 15_000;
    let running =
        json!({"owner": owner, "attempt": 1, "lease_expires_ms": lease, "state": "running"});
    let rev = claims
        .create(&key, serde_json::to_vec(&running)?.into())
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    let result = t.results.get(*name).cloned().unwrap_or_default();
    let subject = format!("limit.evt.effect_result.{name}.{id}");
    let msg_id = format!("result-{name}-{id}");
    let done = json!({
        "owner": owner, "attempt": 1, "lease_expires_ms": lease, "state": "done",
        "result": {
            "subject": subject, "msg_id": msg_id,
            "body": serde_json::from_slice::<Json>(&result).unwrap_or_default(),
        },
    });
    claims
        .update(&key, serde_json::to_vec(&done)?.into(), rev)
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    js.publish_with_headers(subject, headers(&msg_id), result)
        .await?
        .await?;
    m.ack().await.map_err(|e| anyhow::anyhow!(e))?;
    Ok(())
}
