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

use async_nats::jetstream::Message;

use crate::broker::headers;
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
