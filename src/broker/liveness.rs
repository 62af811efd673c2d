//! Consumer liveness (DESIGN §9; issue 14 findings 17–18): noticing within seconds that a
//! consumer has stopped delivering, and reopening it with short timeouts.
//!
//! The client recovers an ordered consumer on its own only after missed heartbeats, and then
//! waits out full request timeouts while the cluster elects leaders — tens of seconds, with
//! nothing logged, although the cluster is back within a few. So a consuming loop also
//! watches for itself:
//! - **Stall probe.** When its consumer has delivered nothing for `consumers.stall_check`,
//!   the loop asks the stream for the next message matching its filters after the last
//!   sequence it read (one message-get per filter, answered by the stream leader; "none" is
//!   a small 404). An ordered consumer has no stable name to ask `num_pending` of, and this
//!   question is the same one asked of the stream directly. A message there means the
//!   consumer is stuck: the loop reopens it at its checkpoint at once, logs why and counts
//!   it in `runner_consumer_recreated_total{consumer,reason}`. A probe that fails (no
//!   leader yet) changes nothing; the next one, after the election, finds the message.
//! - **Short reopen timeouts.** Reopen attempts and probes use a JetStream context with
//!   `consumers.reopen_timeout` (default 1 s) instead of `nats.request_timeout`, retried
//!   with the loop's backoff, so an attempt made during an election fails fast and the
//!   next one lands soon after the new leader is in place. The client's own background
//!   recovery inherits that context too.
//!
//! Guarantee: a consumer whose stream holds messages for it delivers again within about
//! `stall_check` + one reopen after the stream is reachable again; an idle stream costs one
//! small request per `stall_check` per consumer.

use std::sync::OnceLock;
use std::time::Duration;

use async_nats::jetstream::{self, stream::LastRawMessageErrorKind};
use prometheus::{IntCounterVec, Opts, Registry};

/// Name of the counter of consumers a loop recreated, by consumer and reason.
pub const CONSUMER_RECREATED_TOTAL: &str = "runner_consumer_recreated_total";

/// The counter, shared by every loop of the process (registered once).
static RECREATED: OnceLock<IntCounterVec> = OnceLock::new();

/// Liveness settings and the counter, for one consuming loop.
#[derive(Clone)]
pub struct Liveness {
    js: jetstream::Context,
    stall_check: Duration,
    recreated: IntCounterVec,
}

/// What a stall probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// The stream holds a message for the consumer at this sequence.
    Pending(u64),
    /// Nothing for it past the position.
    Idle,
    /// The stream did not answer (no leader, timeout): nothing is concluded.
    Unknown(String),
}

impl Liveness {
    /// Liveness for loops on `js`, registering the counter in `registry` on first use.
    pub fn new(
        js: &jetstream::Context,
        registry: &Registry,
        stall_check: Duration,
        reopen_timeout: Duration,
    ) -> Self {
        let recreated = RECREATED
            .get_or_init(|| {
                let c = IntCounterVec::new(
                    Opts::new(
                        CONSUMER_RECREATED_TOTAL,
                        "Consumers a loop recreated because they stopped delivering (reason stalled) or went back before what was read (rewound), by consumer and reason",
                    ),
                    &["consumer", "reason"],
                )
                .expect("valid metric definition");
                if let Err(e) = registry.register(Box::new(c.clone())) {
                    tracing::debug!(message = "Consumer liveness metric not registered.", error = %e);
                }
                c
            })
            .clone();
        let mut js = js.clone();
        js.set_timeout(reopen_timeout);
        Self {
            js,
            stall_check,
            recreated,
        }
    }

    /// The JetStream context for reopening consumers: short request timeouts.
    pub fn context(&self) -> &jetstream::Context {
        &self.js
    }

    /// How long a consumer may deliver nothing before it is probed.
    pub fn stall_check(&self) -> Duration {
        self.stall_check
    }

    /// Whether `stream` holds a message matching one of `filters` after sequence `after`.
    pub async fn probe(&self, stream: &str, filters: &[String], after: u64) -> Probe {
        let s = match self.js.get_stream_no_info(stream).await {
            Ok(s) => s,
            Err(e) => return Probe::Unknown(e.to_string()),
        };
        let mut first: Option<u64> = None;
        for f in filters {
            match s.get_first_raw_message_by_subject(f, after + 1).await {
                Ok(m) => first = Some(first.map_or(m.sequence, |x| x.min(m.sequence))),
                Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {}
                Err(e) => return Probe::Unknown(e.to_string()),
            }
        }
        first.map_or(Probe::Idle, Probe::Pending)
    }

    /// The last sequence stream `stream` holds, or `None` when it did not answer.
    pub async fn last_sequence(&self, stream: &str) -> Option<u64> {
        let s = self.js.get_stream(stream).await.ok()?;
        Some(s.cached_info().state.last_sequence)
    }

    /// Records that the loop of `consumer` reopens its consumer because it delivered a
    /// message at or before what the loop already read: async-nats recreates an ordered
    /// consumer that lost its way before delivering anything from the stream's start
    /// (`DeliverPolicy::All`), not from the start it was opened at. One log line and the
    /// counter, reason `rewound`.
    pub fn rewound(&self, consumer: &str, detail: &str) {
        tracing::warn!(
            message = "Consumer went back before what was read; reopening it at the checkpoint.",
            consumer,
            reason = "rewound",
            detail,
        );
        self.recreated
            .with_label_values(&[consumer, "rewound"])
            .inc();
    }

    /// Records that the loop of `consumer` (a bounded label, e.g. `saga:<stream>`) reopens
    /// its consumer for `reason`: one log line and the counter.
    pub fn recreating(&self, consumer: &str, reason: &'static str, detail: &str) {
        tracing::warn!(
            message = "Consumer stopped delivering; recreating it at the checkpoint.",
            consumer,
            reason,
            detail,
        );
        self.recreated.with_label_values(&[consumer, reason]).inc();
    }
}
