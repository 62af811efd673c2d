//! `runner-bench limit`: the order pipeline's messaging with no engine and no state, on
//! streams of its own (LIMIT_*), as a separate process started by the `pipeline` and
//! `cluster` scenarios ([`start`]). It does exactly the consumes, publishes (with bodies of
//! the sizes the runner produced, copied from its streams), KV operations and acks the
//! runner does for an order, and nothing else, so a drive through it measures what the
//! broker allows for this message flow on this machine.
//!
//! Saga side: per input, the outputs the order saga would publish (OrderPlaced →
//! charge_card; charge_card result → reserve_stock; reserve_stock result → Confirm and
//! create_shipment; create_shipment result → MarkShipped and OrderFulfilled), handed to a
//! relay that publishes them a window at a time ([`crate::publish::relay`]). Effect side:
//! a durable pull consumer, and per command the claim created, updated by revision with the
//! result, the result published (ack awaited) and the command acknowledged.
//!
//! Two shapes:
//! - **Single** (`--partitions 0`, the `pipeline` scenario): one ordered consumer per input
//!   stream and one relay, like a single saga replica.
//! - **Partitioned** (`--partitions P`, the `cluster` scenario): like partitioned saga mode,
//!   a router per input stream copies each input into the inbox partition of its order
//!   (`limit.inbox.<p>.<source>`, the same FNV-1a partition function as the runner's, one
//!   batch in flight per router); one ordered consumer and one relay per partition read and
//!   publish that partition's share.
//!
//! `--publish` says how the relays and routers store messages: plain windows, atomic
//! batches, or fenced atomic batches ([`crate::publish`]); `--replicas` the replication of
//! the shadow's streams and claims bucket.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::pull, kv, stream};
use bytes::Bytes;
use futures::StreamExt;
use runner::broker::batch::BatchMessage;
use runner::broker::fence_subjects;
use runner::worker::partition::partition;
use runner::worker::pull::next_chunk;
use serde_json::{Value as Json, json};

use crate::harness::{Proc, spawn_self};
use crate::now_ms;
use crate::publish::{Publish, Sink, relay};

#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Stop after this many orders have gone all the way through.
    #[arg(long)]
    orders: u64,
    /// Replicas of the shadow's streams and claims bucket (3 on a three-node cluster).
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Route every input into one of this many inbox partitions first and run one saga
    /// consumer and one relay per partition, like partitioned saga mode (0: no routing).
    #[arg(long, default_value_t = 0)]
    partitions: u32,
    /// How the relays (and routers) store what they publish.
    #[arg(long, value_enum, default_value_t = Publish::Plain)]
    publish: Publish,
    /// Effect commands executed at once. The runner runs `effect.concurrency` (64) per
    /// effect, each effect from its own consumer; the order saga has three effects, so the
    /// shadow's one consumer runs 3 × 64 at once (with 64 it was slower than the runner it
    /// is meant to bound, and pairs read above 1).
    #[arg(long, default_value_t = 192)]
    effect_concurrency: usize,
}

/// Starts `runner-bench limit` with `args` against `nats_url`, echoes its lines up to
/// `limit: ready`, and returns the running process.
pub(crate) fn start(nats_url: &str, args: &[String], log: &Path) -> Result<Proc> {
    let mut all = vec![
        "--nats-url".to_string(),
        nats_url.to_string(),
        "limit".into(),
    ];
    all.extend_from_slice(args);
    let (shadow, out) = spawn_self(&all, log)?;
    let mut lines = BufReader::new(out).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.starts_with("limit: ready") => {
                println!("{l}");
                return Ok(shadow);
            }
            Some(Ok(l)) => println!("{l}"),
            _ => bail!(
                "the limit process ended before it was ready; see {}",
                log.display()
            ),
        }
    }
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

fn headers(msg_id: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(async_nats::header::NATS_MESSAGE_ID, msg_id);
    h.insert("Runner-Tenant", "limit");
    h
}

/// The stream a shadow subject is stored in.
fn stream_of(subject: &str) -> &'static str {
    match subject.split('.').nth(1) {
        Some("cmd") => "LIMIT_CMD",
        Some("evt") => "LIMIT_EVT",
        Some("inbox") => "LIMIT_INBOX",
        _ => "LIMIT_AGG",
    }
}

/// Whether `subject` is an order's final output (OrderFulfilled), which no saga reads.
fn is_final(subject: &str) -> bool {
    subject.split('.').nth(2) == Some("workflow_event")
}

/// The order a shadow input belongs to: the last token of its subject.
fn order_of(subject: &str) -> &str {
    subject.rsplit('.').next().unwrap_or_default()
}

/// What the order saga publishes for an input published on `subject`.
fn outputs(t: &Templates, subject: &str) -> Vec<BatchMessage> {
    let tok: Vec<&str> = subject.split('.').collect();
    let id = order_of(subject);
    let cmd = |k: &str, sub: String| BatchMessage {
        headers: headers(&format!("{sub}-{k}")),
        subject: sub,
        payload: t.commands[k].clone(),
    };
    match (tok.get(2).copied(), tok.get(3).copied()) {
        (Some("Order"), _) => vec![cmd(
            "charge_card",
            format!("limit.cmd.effect.charge_card.{id}"),
        )],
        (Some("effect_result"), Some("charge_card")) => vec![cmd(
            "reserve_stock",
            format!("limit.cmd.effect.reserve_stock.{id}"),
        )],
        (Some("effect_result"), Some("reserve_stock")) => vec![
            cmd("Confirm", format!("limit.cmd.command.Order.{id}")),
            cmd(
                "create_shipment",
                format!("limit.cmd.effect.create_shipment.{id}"),
            ),
        ],
        (Some("effect_result"), Some("create_shipment")) => vec![
            cmd("MarkShipped", format!("limit.cmd.command.Order.{id}")),
            BatchMessage {
                subject: format!("limit.evt.workflow_event.order.{id}"),
                headers: headers(&format!("fulfilled-{id}")),
                payload: t.fulfilled.clone(),
            },
        ],
        _ => Vec::new(),
    }
}

/// Counts orders through; wakes the main task at the target.
struct Done {
    count: AtomicU64,
    target: u64,
    finished: tokio::sync::Notify,
}

impl Done {
    fn one(&self) {
        if self.count.fetch_add(1, Ordering::SeqCst) + 1 >= self.target {
            self.finished.notify_one();
        }
    }
}

/// An ordered consumer's messages on `stream` under `filter`, from the start.
async fn ordered(js: &jetstream::Context, stream: &str, filter: String) -> Result<pull::Ordered> {
    Ok(js
        .get_stream(stream)
        .await?
        .create_consumer(pull::OrderedConfig {
            filter_subjects: vec![filter],
            ..Default::default()
        })
        .await?
        .messages()
        .await?)
}

/// A saga consumer: reads inputs (the original subject from `Runner-Subject` when they were
/// routed) and hands their outputs to its relay; counts final outputs it sees.
fn saga_side(
    msgs: pull::Ordered,
    t: Arc<Templates>,
    tx: tokio::sync::mpsc::UnboundedSender<Vec<BatchMessage>>,
    done: Arc<Done>,
) {
    tokio::spawn(async move {
        let mut chunks = msgs.ready_chunks(256);
        while let Some(chunk) = next_chunk(&mut chunks).await {
            let mut outs = Vec::new();
            for m in chunk.into_iter().flatten() {
                let routed = m.headers.as_ref().and_then(|h| h.get("Runner-Subject"));
                let subject = routed.map_or(m.subject.as_str(), |s| s.as_str());
                if is_final(subject) {
                    done.one();
                    continue;
                }
                outs.extend(outputs(&t, subject));
            }
            if !outs.is_empty() && tx.send(outs).is_err() {
                return;
            }
        }
    });
}

/// The router of one input stream: copies each input into its order's inbox partition, in
/// batches of what is ready (at most 200 inputs), one in flight; counts final outputs.
async fn route(
    msgs: pull::Ordered,
    source: &'static str,
    partitions: u32,
    mut sink: Sink,
    done: Arc<Done>,
) -> Result<()> {
    let mut chunks = msgs.ready_chunks(200);
    while let Some(chunk) = next_chunk(&mut chunks).await {
        let mut copies = Vec::new();
        for m in chunk.into_iter().flatten() {
            if is_final(&m.subject) {
                done.one();
                continue;
            }
            let p = partition("limit", "order", order_of(&m.subject), partitions);
            let seq = m.info().map_or(0, |i| i.stream_sequence);
            let mut h = HeaderMap::new();
            h.insert(
                async_nats::header::NATS_MESSAGE_ID,
                format!("{source}:{seq}:{p}").as_str(),
            );
            h.insert("Runner-Subject", m.subject.as_str());
            copies.push(BatchMessage {
                subject: format!("limit.inbox.{p}.{source}"),
                headers: h,
                payload: m.payload.clone(),
            });
        }
        if !copies.is_empty() {
            sink.send(copies).await?;
        }
    }
    Ok(())
}

/// `runner-bench limit`: the order pipeline's messaging with no engine and no state.
pub(crate) async fn run(client: async_nats::Client, js: jetstream::Context, a: Args) -> Result<()> {
    let inputs = [("LIMIT_AGG", "limit.agg.>"), ("LIMIT_EVT", "limit.evt.>")];
    let _ = js.delete_stream("LIMIT_INBOX").await;
    let mut streams = vec![inputs[0], ("LIMIT_CMD", "limit.cmd.>"), inputs[1]];
    if a.partitions > 0 {
        streams.push(("LIMIT_INBOX", "limit.inbox.>"));
    }
    for (name, subject) in streams {
        let _ = js.delete_stream(name).await;
        let mut subjects = vec![subject.to_string()];
        if a.publish.batches() {
            subjects.push(fence_subjects(name));
        }
        js.create_stream(stream::Config {
            name: name.into(),
            subjects,
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(120),
            num_replicas: a.replicas,
            allow_atomic_publish: a.publish.batches(),
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
            num_replicas: a.replicas,
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

    let done = Arc::new(Done {
        count: AtomicU64::new(0),
        target: a.orders,
        finished: tokio::sync::Notify::new(),
    });
    let mut tasks = tokio::task::JoinSet::new();
    // The partition relays share batches, like the runner's (publish.rs).
    let shared = Arc::new(runner::relay::combine::Combiner::default());
    // One relay per partition (one in all when not routing), each with a sink per output
    // stream under the partition's fence key, fed by the partition's saga consumer.
    for p in 0..a.partitions.max(1) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut sinks = HashMap::new();
        for stream in ["LIMIT_CMD", "LIMIT_EVT"] {
            sinks.insert(
                stream,
                Sink::open(a.publish, &client, &js, stream, p, Some(shared.clone())).await?,
            );
        }
        tasks.spawn(relay(rx, a.publish, sinks, stream_of));
        if a.partitions == 0 {
            for (stream, filter) in inputs {
                let msgs = ordered(&js, stream, filter.into()).await?;
                saga_side(msgs, t.clone(), tx.clone(), done.clone());
            }
        } else {
            let msgs = ordered(&js, "LIMIT_INBOX", format!("limit.inbox.{p}.>")).await?;
            saga_side(msgs, t.clone(), tx, done.clone());
        }
    }
    if a.partitions > 0 {
        for (source, filter) in inputs {
            let sink = Sink::open(a.publish, &client, &js, "LIMIT_INBOX", source, None).await?;
            let msgs = ordered(&js, source, filter.into()).await?;
            tasks.spawn(route(msgs, source, a.partitions, sink, done.clone()));
        }
    }

    // Effect side: a durable pull consumer, as many commands at once as the worker runs
    // for the three effects together.
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
        .max_messages_per_batch(a.effect_concurrency.max(1))
        .expires(Duration::from_secs(5))
        .messages()
        .await?;
    let permits = Arc::new(tokio::sync::Semaphore::new(a.effect_concurrency.max(1)));
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
                        // Like the worker on a transient error: deliver it again soon.
                        eprintln!("limit: effect command failed, delivered again: {e:#}");
                        let again = jetstream::AckKind::Nak(Some(Duration::from_millis(200)));
                        let _ = m.ack_with(again).await;
                    }
                    drop(permit);
                });
            }
        }
    });
    println!("limit: ready");

    loop {
        tokio::select! {
            _ = done.finished.notified() => break,
            r = tasks.join_next(), if !tasks.is_empty() => match r {
                Some(Ok(Err(e))) => return Err(e.context("a shadow relay or router failed")),
                Some(Err(e)) => bail!("a shadow relay or router panicked: {e}"),
                _ => {}
            },
        }
    }
    effects.abort();
    println!(
        "limit: {} orders through",
        done.count.load(Ordering::SeqCst)
    );
    Ok(())
}

/// One effect command, the way the worker does it on a first delivery: claim create, CAS
/// update with the result, result publish (ack awaited), command ack. A command delivered
/// again after a failure finds its claim and goes on from it (the worker reads the claim
/// on a redelivery too), so a lost answer costs a retry, not the order.
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
    let rev = match claims
        .create(&key, serde_json::to_vec(&running)?.into())
        .await
    {
        Ok(rev) => rev,
        Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => claims
            .entry(&key)
            .await?
            .map(|e| e.revision)
            .context("a claim that exists cannot be read")?,
        Err(e) => return Err(e.into()),
    };
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
