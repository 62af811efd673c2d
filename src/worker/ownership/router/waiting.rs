//! A source input as a router keeps it while it waits in its tenant's lane: what routing
//! needs of the consumer's message, copied out of it as it is read.
//!
//! **Guarantee.** A waiting input pins no read buffer of the connection. A consumer's message
//! shares its subject and body with the buffer it was read into, so a lane of messages kept
//! alive every buffer they arrived in, with everything read beside them (the other shares'
//! messages, the other consumers'): a router holding a quarter of a 100 000-event burst held
//! about all of it. Its subject and a small body are copied out; a body of 16 KiB or more is
//! shared, as a saga input reader shares it ([`body_of`]), since it fills its buffer itself.
//! The lanes bound waiting inputs by count and body bytes (`crate::fair`); those bounds are
//! now what they hold.
//!
//! Also how a chunk the consumer delivered joins the lanes: this share's inputs each in its
//! tenant's lane, those a marker shows copied skipped, the read position moved past the
//! chunk; a chunk that came after a reload changed the filter, or from a consumer that went
//! back, is not taken (the consumer is reopened at the watermark).

use async_nats::jetstream::Message;
use async_nats::jetstream::consumer::pull::OrderedError;

use super::{Ended, READ_AHEAD, Reader, Routing};
use crate::broker::headers;
use crate::fair::tenant_of;
use crate::worker::admission::RawInput;
use crate::worker::consume::body_of;

/// One input waiting to be copied into the inbox.
#[derive(Debug, Clone)]
pub(super) struct Waiting {
    /// Its sequence in the source stream.
    pub(super) seq: u64,
    /// Messages the consumer had yet to deliver when it was read (the router's lag).
    pub(super) pending: u64,
    /// The input as the inbox copies carry it: subject, body, valid `traceparent`, header
    /// block size (counted with the body against the size bounds), the broker's stored time
    /// and its `stream:seq` source.
    pub(super) input: RawInput,
}

impl Waiting {
    /// What routing needs of `msg` read from `stream`, owned; `None` when it carries no
    /// JetStream metadata.
    pub(super) fn of(msg: &Message, stream: &str) -> Option<Self> {
        let info = msg.info().ok()?;
        let seq = info.stream_sequence;
        Some(Self {
            seq,
            pending: info.pending,
            input: RawInput {
                subject: msg.subject.to_string(),
                body: body_of(&msg.payload),
                traceparent: headers::traceparent(msg.headers.as_ref()),
                header_bytes: headers::block_bytes(msg.headers.as_ref()),
                refused: None,
                live_cap: None,
                timer_cap: None,
                source: format!("{stream}:{seq}"),
                stored_ms: Some(headers::stored_ms(&info)),
            },
        })
    }
}

impl Routing<'_> {
    /// Puts `chunk` in the lanes, then every chunk the consumer has ready too, up to
    /// [`READ_AHEAD`] messages or full lanes, before a batch is chosen: under another
    /// tenant's burst, reading keeps up with the stream instead of taking one chunk per
    /// look at admission, so a tenant's input stored behind the burst reaches its lane
    /// soon. Returns whether a message failed (reading stops there).
    pub(super) fn take_ready(
        &mut self,
        chunk: Vec<Result<async_nats::jetstream::Message, OrderedError>>,
        reader: &mut Reader,
    ) -> Result<bool, Ended> {
        let mut read = chunk.len();
        let mut failed = self.take_chunk(chunk)?;
        while !failed && read < READ_AHEAD && !self.lanes.full() {
            match futures::FutureExt::now_or_never(reader.next()) {
                Some(Some(chunk)) => {
                    read += chunk.len();
                    failed = self.take_chunk(chunk)?;
                }
                // Ended: reopened at the fence's watermark, like any end.
                Some(None) => return Err(Ended::Reopen),
                None => break,
            }
        }
        Ok(failed)
    }

    /// One chunk into the lanes; a rewound consumer ends reading (reopened).
    fn take_chunk(
        &mut self,
        chunk: Vec<Result<async_nats::jetstream::Message, OrderedError>>,
    ) -> Result<bool, Ended> {
        // Looked at after the chunk came: what it covers was stored before the manifests
        // that filtered it were replaced, if they were.
        if self.filters_changed() {
            return Err(Ended::Reopen);
        }
        let (inputs, failed) = self.messages(chunk);
        if self.rewound(&inputs) {
            return Err(Ended::Reopen);
        }
        self.take_in(inputs);
        Ok(failed)
    }

    /// Puts this share's inputs of a chunk in their tenants' lanes (those the fence's
    /// marker shows copied already are skipped) and moves the read position past it.
    fn take_in(&mut self, inputs: Vec<async_nats::jetstream::Message>) {
        let Some(read) = inputs
            .last()
            .and_then(|m| m.info().ok())
            .map(|i| i.stream_sequence)
        else {
            return;
        };
        self.pull.observe(inputs.iter().map(|m| m.payload.len()));
        for m in inputs {
            if !self.share.holds(m.subject.as_str()) {
                continue;
            }
            let Some(w) = Waiting::of(&m, &self.share.source.stream) else {
                continue;
            };
            let tenant = tenant_of(&w.input.subject).to_string();
            if !self.lanes.done(&tenant, w.seq) {
                self.lanes.push(&tenant, w.seq, w.input.body.len(), w);
            }
        }
        self.read_through = self.read_through.max(read);
    }
}
