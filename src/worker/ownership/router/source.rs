//! The source consumer of a share's router: opened just after the fence's watermark, and
//! told apart when it must be opened again — an error in a chunk, a stall (a message waits
//! past the watermark that the consumer does not deliver), a rewind (it went back to the
//! stream's start).
//!
//! Guarantee: whichever of these happens, the router reopens at the fence's watermark, so
//! nothing read and not yet covered by a marker is skipped, and nothing is copied twice
//! (the marker records what was copied beyond it).

use async_nats::jetstream::consumer::pull::OrderedError;
use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use futures::StreamExt;

use super::{INPUTS_PER_BATCH, READ_AHEAD, Reader, Routing};
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
            self.max_pull_bytes,
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
}
