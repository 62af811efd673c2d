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
use bytes::Bytes;

use crate::broker::headers;
use crate::worker::consume::body_of;

/// One input waiting to be copied into the inbox.
#[derive(Debug, Clone)]
pub(super) struct Waiting {
    /// Its sequence in the source stream.
    pub(super) seq: u64,
    /// Messages the consumer had yet to deliver when it was read (the router's lag).
    pub(super) pending: u64,
    /// When the broker stored it, in Unix milliseconds.
    pub(super) stored_ms: u64,
    /// The subject it was published on.
    pub(super) subject: String,
    /// Its body.
    pub(super) body: Bytes,
    /// Its valid `traceparent`, if any.
    pub(super) traceparent: Option<String>,
    /// The size of its header block, counted with the body against the size bounds.
    pub(super) header_bytes: usize,
}

impl Waiting {
    /// What routing needs of `msg`, owned; `None` when it carries no JetStream metadata.
    pub(super) fn of(msg: &Message) -> Option<Self> {
        let info = msg.info().ok()?;
        Some(Self {
            seq: info.stream_sequence,
            pending: info.pending,
            stored_ms: headers::stored_ms(&info),
            subject: msg.subject.to_string(),
            body: body_of(&msg.payload),
            traceparent: headers::traceparent(msg.headers.as_ref()),
            header_bytes: headers::block_bytes(msg.headers.as_ref()),
        })
    }
}
