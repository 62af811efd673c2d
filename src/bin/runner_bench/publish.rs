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
//! In the batch modes the shadow's partition relays share batches the way the runner's do
//! ([`runner::relay::combine`]): parts of several partitions ready at once go out as one
//! batch, each behind its own marker (and, fenced, its own expected-sequence headers). The
//! routers do not share, like the runner's.
//!
//! Batches keep one publish in flight per fence subject (the broker's rule for replicated
//! streams, which the runner keeps too); a shadow relay or router owns one [`Sink`] per
//! stream and never sends while its previous batch is unanswered.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use async_nats::jetstream;
use runner::broker::batch::{self, BatchMessage, MAX_MESSAGES};
use runner::broker::fence::{Fence, Position, Recheck};
use runner::broker::fenced_batch::{Part, PartOutcome};
use runner::relay::combine::Combiner;
use tokio::sync::mpsc::UnboundedReceiver;

/// How long a batch's answer is awaited.
const BATCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Sends of one window or batch before the shadow gives up.
const ATTEMPTS: u32 = 3;

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
    /// The stream it stores into.
    stream: String,
    /// Batches shared with the shadow's other partition relays (none for a router).
    shared: Option<Arc<Combiner>>,
}

impl Sink {
    /// A sink into `stream` whose fence key is `key`; raises the fence in the batch modes.
    /// Its batches go through `shared` when given.
    pub(crate) async fn open(
        mode: Publish,
        client: &async_nats::Client,
        js: &jetstream::Context,
        stream: &str,
        key: impl std::fmt::Display,
        shared: Option<Arc<Combiner>>,
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
            stream: stream.to_string(),
            shared,
        })
    }

    /// Publishes `messages` in order and returns once every one is stored. A publish whose
    /// answer is lost is sent again (at most [`ATTEMPTS`] times in all), as the runner's
    /// relay does: plain publishes under their `Nats-Msg-Id`; a batch only after the fence
    /// shows it did not land.
    pub(crate) async fn send(&mut self, messages: Vec<BatchMessage>) -> Result<()> {
        if self.fence.is_none() {
            let mut attempt = 1;
            loop {
                match self.send_plain(messages.clone()).await {
                    Ok(()) => return Ok(()),
                    Err(e) if attempt < ATTEMPTS => {
                        eprintln!("limit: plain publishes failed, sending again: {e:#}");
                        attempt += 1;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        let mut rest = messages.into_iter().peekable();
        while rest.peek().is_some() {
            let chunk: Vec<BatchMessage> = rest.by_ref().take(MAX_MESSAGES - 1).collect();
            self.batches += 1;
            let through = Position {
                seq: self.batches,
                ord: 0,
            };
            self.send_batch(chunk, through).await?;
        }
        Ok(())
    }

    async fn send_plain(&self, messages: Vec<BatchMessage>) -> Result<()> {
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
        Ok(())
    }

    /// One batch of `chunk` and a marker at `through`, sent again while the fence shows it
    /// did not land.
    async fn send_batch(&mut self, chunk: Vec<BatchMessage>, through: Position) -> Result<()> {
        let fence = self
            .fence
            .as_mut()
            .context("a batch sink without a fence")?;
        if let Some(shared) = &self.shared {
            let part = Part {
                fence: fence.clone(),
                messages: chunk.clone(),
                position: through,
                expect: self.mode == Publish::Fenced,
            };
            // Not stored shared: sent alone below, the fence telling whether it landed.
            if let PartOutcome::Stored(seq) = shared
                .publish(&self.client, &self.stream, part, BATCH_TIMEOUT)
                .await
            {
                fence.advance(seq, Some(through));
                return Ok(());
            }
        }
        for attempt in 1..=ATTEMPTS {
            let mut batch_msgs = chunk.clone();
            if self.mode == Publish::Fenced
                && let Some(first) = batch_msgs.first_mut()
            {
                first.headers = fence.headers(std::mem::take(&mut first.headers));
            }
            batch_msgs.push(fence.marker(through));
            let marker = batch_msgs.len() - 1;
            let id = uuid::Uuid::new_v4().simple().to_string();
            let e = match batch::publish(&self.client, &id, batch_msgs, BATCH_TIMEOUT).await {
                Ok(stored) => {
                    fence.advance(stored.sequence_of(marker), Some(through));
                    return Ok(());
                }
                Err(e) => e,
            };
            match fence.recheck(&self.js).await {
                Ok(Recheck::Advanced { seq, through: t }) if t >= Some(through) => {
                    fence.advance(seq, t);
                    return Ok(());
                }
                Ok(Recheck::Unchanged) if attempt < ATTEMPTS => {
                    eprintln!(
                        "limit: batch under {} not stored, sending again: {e}",
                        fence.subject()
                    );
                }
                other => bail!(
                    "batch under {} failed ({e}); the fence shows {other:?}",
                    fence.subject()
                ),
            }
        }
        bail!("batch under {} not stored", fence.subject())
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
