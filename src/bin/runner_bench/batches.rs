//! `batches`: what one atomic batch costs the broker, against plain JetStream publishes, on
//! a nats-server of its own (one node, R1 stream with `allow_atomic`).
//!
//! Partitioned saga mode stores every routed copy and every output through fenced atomic
//! batches, so the broker's cost per batch, not per message, bounds it when batches are
//! small (low load, many partitions). This scenario measures that cost alone: batches of
//! 1, 4, 16 and 64 messages, one in flight at a time, each timed from its first message
//! sent to the commit's answer; then the same number of plain publishes, each awaited
//! before the next. The nats-server's own CPU seconds per batch are printed too.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use runner::broker::batch::{self, BatchMessage};

use crate::harness::{Nats, Programs, WorkDir};
use crate::percentile;
use crate::probe::cpu_seconds;

#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    #[command(flatten)]
    programs: Programs,
    /// Batches per size (and as many plain publishes), at least 1.
    #[arg(long, env = "BENCH_BATCHES", default_value_t = 500,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    count: usize,
}

/// Batch sizes measured, in messages.
const SIZES: [usize; 4] = [1, 4, 16, 64];

/// A body of the size of the order saga's outputs (about 400 B).
const BODY: &[u8] = &[b'x'; 400];

pub(crate) async fn run(a: Args) -> Result<()> {
    let work = WorkDir::new("batches", a.programs.keep)?;
    let nats = Nats::start(&a.programs.nats_server, &work.path).await?;
    let client = async_nats::connect(&nats.url).await?;
    let js = jetstream::new(client.clone());
    js.create_stream(stream::Config {
        name: "BATCHES".into(),
        subjects: vec!["batches.>".into()],
        allow_atomic_publish: true,
        ..Default::default()
    })
    .await
    .context("creating the stream")?;
    let server = nats.pid();
    println!(
        "batches: one nats-server, R1 stream with allow_atomic; {} per size, one in flight, {} B bodies",
        a.count,
        BODY.len()
    );
    for size in SIZES {
        let cpu = cpu_seconds(server);
        let mut ms = Vec::with_capacity(a.count);
        for i in 0..a.count {
            let messages = (0..size)
                .map(|k| BatchMessage {
                    subject: format!("batches.{size}.{k}"),
                    headers: async_nats::HeaderMap::new(),
                    payload: Bytes::from_static(BODY),
                })
                .collect();
            let started = Instant::now();
            batch::publish(
                &client,
                &format!("b{size}-{i}"),
                messages,
                Duration::from_secs(10),
            )
            .await
            .with_context(|| format!("batch {i} of {size}"))?;
            ms.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        let cpu = cpu_seconds(server) - cpu;
        println!(
            "atomic batch of {size}: {} | nats-server cpu per batch {:.2} ms",
            summary(&mut ms),
            cpu * 1000.0 / a.count as f64
        );
    }
    let cpu = cpu_seconds(server);
    let mut ms = Vec::with_capacity(a.count);
    for i in 0..a.count {
        let started = Instant::now();
        js.publish(format!("batches.plain.{i}"), Bytes::from_static(BODY))
            .await?
            .await
            .with_context(|| format!("plain publish {i}"))?;
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    let cpu = cpu_seconds(server) - cpu;
    println!(
        "plain publish: {} | nats-server cpu per publish {:.2} ms",
        summary(&mut ms),
        cpu * 1000.0 / a.count as f64
    );
    Ok(())
}

/// `ms p50=… p90=… p99=… max=…` of `ms`.
fn summary(ms: &mut [f64]) -> String {
    ms.sort_by(f64::total_cmp);
    format!(
        "ms p50={:.2} p90={:.2} p99={:.2} max={:.2}",
        percentile(ms, 0.5),
        percentile(ms, 0.9),
        percentile(ms, 0.99),
        percentile(ms, 1.0)
    )
}
