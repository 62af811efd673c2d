//! `runner-bench`: load generator and measuring tool for Runner.
//!
//! - `orders`: publishes sample orders for the example manifests and plays the payment
//!   service (every `charge_card` gets a Succeeded result), for the quick start.
//!
//! - Scenarios that start their own nats-server and `runner` (fresh directories, removed
//!   afterwards) and print one line per measurement:
//!   - `pipeline`: orders through the combined runner with noop effects, at the maximum
//!     rate and at half of it, then the same message flow through `limit` (below); the last
//!     line compares the two.
//!   - `limit`: the order pipeline's messaging with no engine and no state (a shadow on its
//!     own streams), run as a separate process by `pipeline` and `cluster`.
//!   - `cluster`: the pipeline on a three-node NATS cluster (R3 streams) with partitioned
//!     saga replicas, 1 then 3, beside the partitioned limit with and without fencing on the
//!     same cluster; fail-over after SIGKILL of one replica; last, three fresh replicas
//!     open loop at fractions of the three's maximum rate.
//!   - `travel`: whole travel-booking orchestrations, closed loop, some compensated.
//!   - `tenants`: one tenant's flood beside another tenant's trickle (fairness).
//!   - `scale`: the ledger saga with 10 000 … 1 000 000 live instances.
//!   - `timers`: many pending timers coming due; fire lag.
//!   - `payload`: the ledger saga with small and large event bodies.
//!   - `batches`: the broker's cost of one atomic batch against plain publishes.
//! - `gauge`: a fixed amount of CPU work on one core, timed, printed with every
//!   `scripts/bench` run so that rates of different days can be compared.
//!
//! Timing is measured here, by a separate process, never inside tests.

#[path = "runner_bench/batches.rs"]
mod batches;
#[path = "runner_bench/cgroup.rs"]
mod cgroup;
#[path = "runner_bench/cluster.rs"]
mod cluster;
#[path = "runner_bench/gauge.rs"]
mod gauge;
#[path = "runner_bench/goals.rs"]
mod goals;
#[path = "runner_bench/harness.rs"]
mod harness;
#[path = "runner_bench/ledger.rs"]
mod ledger;
#[path = "runner_bench/limit.rs"]
mod limit;
#[path = "runner_bench/pipeline.rs"]
mod pipeline;
#[path = "runner_bench/ports.rs"]
mod ports;
#[path = "runner_bench/probe.rs"]
mod probe;
#[path = "runner_bench/publish.rs"]
mod publish;
#[path = "runner_bench/tenants.rs"]
mod tenants;
#[path = "runner_bench/travel.rs"]
mod travel;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use async_nats::jetstream::{self, consumer::pull};
use clap::{Parser, Subcommand};
use futures::StreamExt;
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "runner-bench",
    about = "Load generator and measuring tool for Runner"
)]
struct Cli {
    /// NATS URL (several, comma-separated, for a cluster).
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Order pipeline through a combined runner vs. the messaging limit (own servers).
    Pipeline(pipeline::Args),
    /// The order pipeline's message flow with no engine (started by `pipeline`, `cluster`).
    Limit(limit::Args),
    /// The pipeline with partitioned saga replicas on a three-node cluster (own servers).
    Cluster(cluster::Args),
    /// Whole travel orchestrations, closed loop (own servers).
    Travel(travel::Args),
    /// One tenant's flood beside another's trickle, on one node and a cluster (own servers).
    Tenants(tenants::Args),
    /// Ledger saga throughput and latency by number of live instances (own servers).
    Scale(ledger::ScaleArgs),
    /// Fire lag of many pending timers (own servers).
    Timers(ledger::TimerArgs),
    /// Ledger saga throughput and latency by event size (own servers).
    Payload(ledger::PayloadArgs),
    /// What one atomic batch costs the broker, against plain publishes (own server).
    Batches(batches::Args),
    /// A fixed amount of CPU work on one core, timed: the machine's speed for this run.
    Gauge(gauge::Args),
    /// Publish sample orders and answer their payment commands.
    Orders {
        /// Orders per tenant.
        #[arg(long, default_value_t = 20)]
        orders: u64,
        /// Tenants.
        #[arg(long, value_delimiter = ',', default_value = "acme,globex")]
        tenants: Vec<String>,
        /// How long to keep answering payment commands (0s: leave them to an effect worker).
        #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
        answer_for: Duration,
    },
}

/// Connects to `urls`: one NATS URL or several, comma-separated (a cluster's nodes).
pub(crate) async fn connect(urls: &str) -> Result<async_nats::Client> {
    connect_as(urls, "runner-bench").await
}

/// Connects naming the connection `name` (the cluster scenario reports traffic by name).
pub(crate) async fn connect_as(urls: &str, name: &str) -> Result<async_nats::Client> {
    let addrs = urls
        .split(',')
        .map(|u| u.trim().parse::<async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("reading NATS URLs {urls}"))?;
    async_nats::ConnectOptions::new()
        .name(name)
        .connect(addrs)
        .await
        .with_context(|| format!("connecting to {urls}"))
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub(crate) fn event(
    tenant: &str,
    typ: &str,
    id: &str,
    event_type: &str,
    payload: serde_json::Value,
) -> serde_json::Value {
    json!({
        "v": 1,
        "event_id": uuid::Uuid::now_v7().to_string(),
        "tenant_id": tenant,
        "event_type": event_type,
        "aggregate_type": typ,
        "aggregate_id": id,
        "timestamp_ms": now_ms(),
        "payload": payload,
        "metadata": {},
    })
}

/// Publishes bodies with windows of outstanding acks.
pub(crate) struct Publisher {
    js: jetstream::Context,
    pending: Vec<jetstream::context::PublishAckFuture>,
    window: usize,
    /// Highest stream sequence acknowledged so far.
    pub(crate) last_seq: u64,
}

impl Publisher {
    pub(crate) fn new(js: jetstream::Context, window: usize) -> Self {
        Self {
            js,
            pending: Vec::new(),
            window,
            last_seq: 0,
        }
    }
    pub(crate) async fn send(
        &mut self,
        subject: String,
        body: &serde_json::Value,
        msg_id: &str,
    ) -> Result<()> {
        let mut h = async_nats::HeaderMap::new();
        h.insert(async_nats::header::NATS_MESSAGE_ID, msg_id);
        self.pending.push(
            self.js
                .publish_with_headers(subject, h, serde_json::to_vec(body)?.into())
                .await?,
        );
        if self.pending.len() >= self.window {
            self.flush().await?;
        }
        Ok(())
    }
    pub(crate) async fn flush(&mut self) -> Result<()> {
        for p in self.pending.drain(..) {
            self.last_seq = self.last_seq.max(p.await?.sequence);
        }
        Ok(())
    }
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    // Scenarios that start their own servers connect later, to the server they start.
    let cli = match cli.cmd {
        Cmd::Pipeline(a) => return pipeline::run(a).await,
        Cmd::Cluster(a) => return cluster::run(a).await,
        Cmd::Travel(a) => return travel::run(a).await,
        Cmd::Tenants(a) => return Box::pin(tenants::run(a)).await,
        Cmd::Scale(a) => return ledger::scale(a).await,
        Cmd::Timers(a) => return ledger::timers(a).await,
        Cmd::Payload(a) => return ledger::payload(a).await,
        Cmd::Batches(a) => return batches::run(a).await,
        Cmd::Gauge(a) => return gauge::run(a),
        cmd => Cli { cmd, ..cli },
    };
    let name = match cli.cmd {
        Cmd::Limit(_) => "limit",
        _ => "runner-bench",
    };
    let client = connect_as(&cli.nats_url, name).await?;
    let js = jetstream::new(client.clone());
    match cli.cmd {
        Cmd::Orders {
            orders,
            tenants,
            answer_for,
        } => orders_demo(client, js, orders, &tenants, answer_for).await,
        Cmd::Limit(a) => limit::run(client, js, a).await,
        Cmd::Pipeline(a) => pipeline::run(a).await,
        Cmd::Cluster(a) => cluster::run(a).await,
        Cmd::Travel(a) => travel::run(a).await,
        Cmd::Tenants(a) => Box::pin(tenants::run(a)).await,
        Cmd::Scale(a) => ledger::scale(a).await,
        Cmd::Timers(a) => ledger::timers(a).await,
        Cmd::Payload(a) => ledger::payload(a).await,
        Cmd::Batches(a) => batches::run(a).await,
        Cmd::Gauge(a) => gauge::run(a),
    }
}

async fn orders_demo(
    client: async_nats::Client,
    js: jetstream::Context,
    orders: u64,
    tenants: &[String],
    answer_for: Duration,
) -> Result<()> {
    let mut commands = client.subscribe("tenant.*.effect.charge_card.*").await?;
    client.flush().await?;
    let mut publisher = Publisher::new(js.clone(), 256);
    for t in tenants {
        for i in 0..orders {
            let id = format!("order-{i}");
            let body = event(
                t,
                "Order",
                &id,
                "OrderPlaced",
                json!({
                    "customer_id": format!("customer-{i}"),
                    "amount_cents": 1000 + i,
                    "items": [{"sku": "book", "qty": 1}],
                }),
            );
            let msg_id = body["event_id"].as_str().unwrap_or_default().to_string();
            publisher
                .send(format!("tenant.{t}.aggregate.Order.{id}"), &body, &msg_id)
                .await?;
        }
    }
    publisher.flush().await?;
    println!(
        "orders: published {} OrderPlaced events",
        orders * tenants.len() as u64
    );
    let deadline = Instant::now() + answer_for;
    let mut answered = 0;
    while let Ok(Some(msg)) = tokio::time::timeout_at(deadline.into(), commands.next()).await {
        let cmd: serde_json::Value = serde_json::from_slice(&msg.payload)?;
        let (t, cid) = (
            cmd["tenant_id"].as_str().unwrap_or("_"),
            cmd["command_id"].as_str().unwrap_or_default(),
        );
        let result = json!({
            "v": 1,
            "event_id": uuid::Uuid::now_v7().to_string(),
            "tenant_id": t,
            "command_id": cid,
            "effect_name": "charge_card",
            "result_type": "Succeeded",
            "payload": {"payment_id": format!("pay-{cid}")},
            "attempts": 1,
            "timestamp_ms": now_ms(),
            "metadata": cmd["metadata"],
        });
        let msg_id = result["event_id"].as_str().unwrap_or_default().to_string();
        publisher
            .send(
                format!("tenant.{t}.effect_result.charge_card.{cid}"),
                &result,
                &msg_id,
            )
            .await?;
        answered += 1;
    }
    publisher.flush().await?;
    println!("orders: answered {answered} charge_card commands with Succeeded");
    Ok(())
}

/// A message seen stored on a stream.
pub(crate) struct Seen {
    pub(crate) subject: String,
    pub(crate) payload: bytes::Bytes,
    pub(crate) seq: u64,
    pub(crate) at: Instant,
}

/// Follows what gets stored on `stream` under `filters` from now on (an ordered consumer:
/// a message is seen only once JetStream has stored it).
pub(crate) async fn tail(
    js: &jetstream::Context,
    stream: &str,
    filters: &[String],
) -> Result<futures::stream::BoxStream<'static, Seen>> {
    let s = js.get_stream(stream).await?;
    let msgs = s
        .create_consumer(pull::OrderedConfig {
            filter_subjects: filters.to_vec(),
            deliver_policy: jetstream::consumer::DeliverPolicy::New,
            ..Default::default()
        })
        .await?
        .messages()
        .await?;
    Ok(msgs
        .filter_map(|m| async move {
            let m = m.ok()?;
            let info = m.info().ok()?;
            // When the broker stored it, not when this watcher got it: a watcher behind a
            // busy server would add its own lag to every latency.
            let now = Instant::now();
            let now_ns = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as i128);
            let behind =
                u64::try_from((now_ns - info.published.unix_timestamp_nanos()).max(0)).unwrap_or(0);
            Some(Seen {
                subject: m.subject.to_string(),
                payload: m.payload.clone(),
                seq: info.stream_sequence,
                at: now.checked_sub(Duration::from_nanos(behind)).unwrap_or(now),
            })
        })
        .boxed())
}

/// p50/p90/p99 of latencies in milliseconds (sorted in place).
pub(crate) fn quantiles(lat: &mut [f64]) -> String {
    lat.sort_by(|a, b| a.total_cmp(b));
    format!(
        "p50={:.1} p90={:.1} p99={:.1} max={:.1}",
        percentile(lat, 0.5),
        percentile(lat, 0.9),
        percentile(lat, 0.99),
        lat.last().copied().unwrap_or(f64::NAN),
    )
}

/// A small deterministic generator (xorshift64*), enough to spread load.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)
    }
}
