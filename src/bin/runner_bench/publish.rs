//! How the messaging-limit shadow (`limit.rs`) stores what it publishes on the saga side:
//! its relay's outputs and, when it routes, its inbox copies.
//!
//! Three ways, so the cost of each part of fencing can be told apart:
//! - [`Publish::Plain`]: every message published with its `Nats-Msg-Id`, a window at a time,
//!   the acks of a window awaited together (the single-node relay's way, and the shadow's
//!   way in the `pipeline` scenario).
//! - [`Publish::Batch`]: atomic batches ([`runner::broker::batch`]), each ending with a
//!   marker on the publisher's fence subject, but without the expected-sequence headers:
//!   what fencing costs in batching and markers alone.
//! - [`Publish::Fenced`]: the same batches with the first message carrying
//!   `Nats-Expected-Last-Subject-Sequence(-Subject)` on the fence subject, the fence raised
//!   first and advanced to each batch's marker ([`runner::broker::fence`]): exactly what the
//!   fenced relay and the routers of partitioned mode do, retries aside.
//!
//! Batches keep one publish in flight per fence subject (the broker's rule for replicated
//! streams, which the runner keeps too); a shadow relay or router owns one [`Sink`] per
//! stream and never sends while its previous batch is unanswered.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result};
use async_nats::jetstream;
use runner::broker::batch::{self, BatchMessage, MAX_MESSAGES};
use runner::broker::fence::{Fence, Position};
use tokio::sync::mpsc::UnboundedReceiver;

/// How long a batch's answer is awaited.
const BATCH_TIMEOUT: Duration = Duration::from_secs(10);

/// The way a shadow publisher stores its messages.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Publish {
    /// Windows of plain publishes with `Nats-Msg-Id`, acks awaited per window.
    Plain,
    /// Atomic batches ending with a marker, no expected-sequence headers.
    Batch,
    /// Fenced atomic batches: expected-sequence headers on the fence subject and a marker.
    Fenced,
}

impl Publish {
    /// Whether the streams must allow atomic batches and capture fence subjects.
    pub(crate) fn batches(self) -> bool {
        self != Publish::Plain
    }
}

/// One publisher into one stream under one fence key (a partition or a router's source).
pub(crate) struct Sink {
    mode: Publish,
    client: async_nats::Client,
    js: jetstream::Context,
    /// Raised once at open in the batch modes (its marker is every batch's last message).
    fence: Option<Fence>,
    /// Batches stored so far, the watermark each marker records.
    batches: u64,
}

impl Sink {
    /// A sink into `stream` whose fence key is `key`; raises the fence in the batch modes.
    pub(crate) async fn open(
        mode: Publish,
        client: &async_nats::Client,
        js: &jetstream::Context,
        stream: &str,
        key: impl std::fmt::Display,
    ) -> Result<Self> {
        let fence = if mode.batches() {
            Some(
                Fence::raise(js, stream, &key, 1, "limit")
                    .await
                    .with_context(|| format!("raising the fence of {key} in {stream}"))?,
            )
        } else {
            None
        };
        Ok(Self {
            mode,
            client: client.clone(),
            js: js.clone(),
            fence,
            batches: 0,
        })
    }

    /// Publishes `messages` in order and returns once every one is stored.
    pub(crate) async fn send(&mut self, messages: Vec<BatchMessage>) -> Result<()> {
        let Some(fence) = self.fence.as_mut() else {
            let mut acks = Vec::with_capacity(messages.len());
            for m in messages {
                acks.push(
                    self.js
                        .publish_with_headers(m.subject, m.headers, m.payload)
                        .await?,
                );
            }
            for a in futures::future::join_all(acks.into_iter().map(|a| a.into_future())).await {
                a?;
            }
            return Ok(());
        };
        let mut rest = messages.into_iter().peekable();
        while rest.peek().is_some() {
            let mut chunk: Vec<BatchMessage> = rest.by_ref().take(MAX_MESSAGES - 1).collect();
            self.batches += 1;
            let through = Position {
                seq: self.batches,
                ord: 0,
            };
            if self.mode == Publish::Fenced
                && let Some(first) = chunk.first_mut()
            {
                first.headers = fence.headers(std::mem::take(&mut first.headers));
            }
            chunk.push(fence.marker(through));
            let marker = chunk.len() - 1;
            let id = uuid::Uuid::new_v4().simple().to_string();
            let stored = batch::publish(&self.client, &id, chunk, BATCH_TIMEOUT)
                .await
                .with_context(|| format!("batch under {}", fence.subject()))?;
            fence.advance(stored.sequence_of(marker), Some(through));
        }
        Ok(())
    }
}

/// The relay of one shadow partition (or the single relay when the shadow does not route):
/// takes what its saga side produced, up to 1 024 messages at a time, and publishes them —
/// in plain mode all at once, in the batch modes as one batch per run of consecutive
/// messages bound for the same stream, through that stream's sink. One window in flight.
pub(crate) async fn relay(
    mut rx: UnboundedReceiver<Vec<BatchMessage>>,
    mode: Publish,
    mut sinks: HashMap<&'static str, Sink>,
    stream_of: fn(&str) -> &'static str,
) -> Result<()> {
    while let Some(mut window) = rx.recv().await {
        while window.len() < 1024 {
            match rx.try_recv() {
                Ok(more) => window.extend(more),
                Err(_) => break,
            }
        }
        if mode == Publish::Plain {
            // Any sink will do: plain publishes go to whichever stream captures them.
            let sink = sinks.values_mut().next().context("a relay without sinks")?;
            sink.send(window).await?;
            continue;
        }
        let mut run: Vec<BatchMessage> = Vec::new();
        let mut current = "";
        for m in window {
            let stream = stream_of(&m.subject);
            if stream != current && !run.is_empty() {
                let sink = sinks.get_mut(current).context("no sink for a stream")?;
                sink.send(std::mem::take(&mut run)).await?;
            }
            current = stream;
            run.push(m);
        }
        if !run.is_empty() {
            let sink = sinks.get_mut(current).context("no sink for a stream")?;
            sink.send(run).await?;
        }
    }
    Ok(())
}
