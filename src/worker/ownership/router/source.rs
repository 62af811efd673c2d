//! The source consumer of a share's router: opened just after the fence's watermark, and
//! told apart when it must be opened again — an error in a chunk, a stall (a message waits
//! past the watermark that the consumer does not deliver), a rewind (it went back to the
//! stream's start).
//!
//! Also what the consumer reads: the filter the loaded triggers give, opened again when a
//! reload changes it, and what the server skipped for it covered by a marker once idle
//! (`advance`).
//!
//! Guarantee: whichever of these happens, the router reopens at the fence's watermark, so
//! nothing read and not yet covered by a marker is skipped, and nothing is copied twice
//! (the marker records what was copied beyond it); no marker covers a message stored after
//! a reload under the filter before it.

use std::sync::Arc;

use async_nats::jetstream::consumer::pull::OrderedError;
use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use futures::StreamExt;

use super::{Ended, INPUTS_PER_BATCH, READ_AHEAD, Reader, Routing};
use crate::broker::liveness::Probe;
use crate::worker::consume::{ORDERED_PULL_EXPIRY, server_filters};
use crate::worker::pull::ReadAhead;

impl Routing<'_> {
    /// An ordered consumer of the source starting just after the fence's watermark.
    pub(super) async fn open(&mut self) -> Result<Reader, async_nats::Error> {
        let from = self.fence.through().map_or(1, |p| p.seq + 1);
        let stream = self
            .liveness
            .context()
            .get_stream(&self.source.stream)
            .await?;
        let c = stream
            .create_consumer(OrderedConfig {
                filter_subjects: server_filters(&self.filters),
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: from,
                },
                // Short pulls: a consumer lost with its server (a stream leader that
                // died) is noticed by missed heartbeats within seconds, not after the
                // default 30 s pull expiry.
                max_expires: ORDERED_PULL_EXPIRY,
                max_batch: self.pull.open(),
                ..OrderedConfig::default()
            })
            .await?;
        Ok(ReadAhead::new(
            c.messages().await?.ready_chunks(INPUTS_PER_BATCH),
            READ_AHEAD,
            self.pull.bytes(),
        ))
    }

    /// Whether the source holds a message for this router past the fence's watermark that
    /// the consumer has not delivered (logged as a stall to recreate it).
    pub(super) async fn stalled(&self) -> bool {
        let after = self.marked().max(self.read_through);
        let probe = self
            .liveness
            .probe(&self.source.stream, &self.filters, after)
            .await;
        if let Probe::Pending(seq) = probe {
            let detail = format!("message {seq} waits past sequence {after}");
            self.liveness.recreating(&self.label, "stalled", &detail);
            return true;
        }
        false
    }

    /// The messages of a chunk up to its first error; `true` beside them when there was
    /// one (the consumer is then reopened once they are routed).
    pub(super) fn messages(
        &self,
        chunk: Vec<Result<async_nats::jetstream::Message, OrderedError>>,
    ) -> (Vec<async_nats::jetstream::Message>, bool) {
        let mut inputs = Vec::with_capacity(chunk.len());
        for item in chunk {
            match item {
                Ok(msg) => inputs.push(msg),
                Err(e) => {
                    tracing::warn!(message = "Router consumer error; reopening.", source = %self.source.stream, error = %e);
                    return (inputs, true);
                }
            }
        }
        (inputs, false)
    }

    /// Whether the consumer went back to the stream's start (see `Liveness::rewound`): it
    /// would have everything read again, so it is reopened at the fence's watermark.
    pub(super) fn rewound(&self, inputs: &[async_nats::jetstream::Message]) -> bool {
        let first = inputs
            .first()
            .and_then(|m| m.info().ok())
            .map(|i| i.stream_sequence);
        if let (Some(first), Some(through)) = (first, self.fence.through())
            && first <= through.seq
        {
            let detail = format!("delivered {first} after {}", through.seq);
            self.liveness.rewound(&self.label, &detail);
            return true;
        }
        false
    }

    /// Whether the manifests in force now give the consumer other filters than it was opened
    /// with (a reload): logged and taken as the filters to open with, and the consumer is
    /// then reopened at the fence's watermark.
    ///
    /// Every marker covers only messages stored before a look that found the filters
    /// unchanged (a chunk is looked at after it came, [`Routing::advance`] after it read the
    /// source's end), so nothing a reload adds a trigger for and that arrived after the
    /// reload is covered by a marker written under the filters before it.
    pub(super) fn filters_changed(&mut self) -> bool {
        let now = self.state.catalog();
        if Arc::ptr_eq(&now, &self.catalog) {
            return false;
        }
        let filters = self.source.filters_under(&now);
        self.catalog = now;
        if filters == self.filters {
            return false;
        }
        tracing::info!(message = "The manifests in force want other inputs of this source; reopening its consumer.", share = %self.share, was = ?self.filters, now = ?filters);
        self.filters = filters;
        true
    }

    /// Covers what the server skipped for a consumer narrowed to the triggers: when the
    /// source has grown past what was read and none of the new messages is one the filters
    /// take in, the read position moves to the source's last sequence and a marker records
    /// it. The last sequence is read first, so every message at or below it was stored
    /// before the look for a wanted one: a message found missing is not one on its way.
    /// Without this, the watermark would stay at the last wanted input however far the
    /// source went on, and a reload that widens the filters would reopen there and route
    /// old messages to the sagas it adds.
    pub(super) async fn advance(&mut self) -> Result<(), Ended> {
        let after = self.read_through.max(self.marked());
        let Some(last) = self.liveness.last_sequence(&self.source.stream).await else {
            return Ok(());
        };
        if last <= after {
            return Ok(());
        }
        match self
            .liveness
            .probe(&self.source.stream, &self.filters, after)
            .await
        {
            Probe::Idle => {}
            Probe::Pending(seq) if seq > last => {}
            // One is there for the consumer to deliver (the stall check watches that it
            // does), or the stream did not answer: nothing is concluded.
            Probe::Pending(_) | Probe::Unknown(_) => return Ok(()),
        }
        // The filters looked at were still in force after `last` was read: whatever a
        // reload wants that came after it is past `last`.
        if self.filters_changed() {
            return Err(Ended::Reopen);
        }
        self.read_through = last;
        self.mark_if(1).await?;
        // Nothing the filters take in waits past the watermark.
        self.lag().set(0);
        Ok(())
    }

    /// The share's consumer lag gauge.
    pub(super) fn lag(&self) -> prometheus::IntGauge {
        self.state
            .metrics
            .consumer_lag
            .with_label_values(&[&self.source.stream, &self.share.index.to_string()])
    }
}
