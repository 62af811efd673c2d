//! Routing and applying inputs inside one write transaction.
//!
//! [`Processor`] turns admitted inputs and due timers into writes on [`Tables`]: new
//! instance state, outbox records, timer entries, dedupe markers, history, and — through
//! [`crate::deadletter::record`] — dead letters and parked keys. Whether an input can be
//! processed at all is decided first, by [`super::admission`]. The processor never commits:
//! the caller adds the checkpoint and commits once per batch, so either all of a batch's
//! effects are durable or none are.
//!
//! Guarantees, given that the caller commits before acknowledging anything:
//! - an input already applied to a saga (dedupe marker) is not applied again;
//! - a key with a pending dead letter is parked: its later inputs are held as dead letters
//!   of kind `parked`, in order, until an operator redrives the first one;
//! - poison never stops the batch: it is recorded with its reason and the batch goes on;
//! - an engine panic is caught and recorded as poison (`engine_panic`), never unwinds
//!   through the transaction.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | the [`Processor`] and its [`Scope`] (partition and cause of each record), dead-letter bookkeeping |
//! | `input.rs` | an input from a stream: admitted, routed, and applied to each instance this partition owns |
//! | `apply.rs` | one input applied to one instance: the key's gates, the engine's transition, its writes |
//! | `timer.rs` | a timer firing read from the inbox, applied if its timer is still pending |
//! | `redrive.rs` | a dead letter applied again for an operator ([`Reapply`](crate::deadletter::Reapply)) |
//!
//! Tracing: each input is applied inside a `saga_input` span (`tenant`, `source` =
//! `stream:seq`, `timer` or `redrive:<id>`) and each saga it reaches inside a `saga_apply`
//! span (`saga`, `correlation_id`), so log lines emitted while applying carry those fields
//! without restating them. Both spans are at debug level because this is the hot path: a
//! span the filter leaves out costs nothing measurable, while an enabled one has its fields
//! formatted by the log layer as it opens, several percent of an input's apply time.

use std::collections::BTreeSet;
use std::sync::Arc;

use libmdbx::RW;

use crate::deadletter::{self, Poison, Refused};
use crate::manifest::Catalog;
use crate::saga::Route;
use crate::storage::{Result, Tables};
use crate::worker::admission::Caps;
use crate::worker::cap;

mod apply;
mod input;
mod redrive;
mod timer;

pub use super::admission::{Limits, MAX_ID_BYTES, MAX_TENANT_BYTES, RawInput, split_subject};
pub use super::tally::Tally;

/// The subject a timer firing carries in the inbox (header `Runner-Subject`); never a
/// subject anyone publishes on.
pub const TIMER_SUBJECT: &str = "runner.timer";

/// Applies inputs to the tables of one write transaction.
pub struct Processor<'a> {
    /// The manifests in force for this batch.
    pub catalog: &'a Catalog,
    /// Limits.
    pub limits: &'a Limits,
    /// Wall clock for bookkeeping (dedupe and dead-letter timestamps), never for saga logic.
    pub now_ms: u64,
    /// What happened.
    pub tally: Tally,
    /// The partition being applied and the current cause.
    pub scope: Scope,
    /// Paused tenants, whose inputs are held (`pause.rs`); read inside the transaction.
    pub paused: Arc<BTreeSet<String>>,
    /// Tenants an instance of which ended, or a timer of which fired or was cancelled, in
    /// this partition since the last [`Processor::release_freed`]: their keys held at a cap
    /// may go (`cap.rs`).
    freed: Vec<String>,
    /// Set while `cap.rs` applies held keys: the inputs it applies were measured against the
    /// cap when it let them go.
    releasing: bool,
}

/// The partition a [`Processor`] applies inputs of: only routes whose key
/// hashes to `partition` are applied (the other routes of one input belong to other
/// partitions, whose owners apply them from their own copy), and every outbox record is
/// written to that partition with its cause.
#[derive(Debug, Clone, Copy)]
pub struct Scope {
    /// This partition.
    pub partition: u32,
    /// P.
    pub count: u32,
    /// The cause of the records written now: the input's SAGA_INBOX sequence, or the
    /// partition checkpoint when a timer fires.
    pub seq: u64,
    /// Records written so far for this cause.
    pub ord: u32,
}

impl Scope {
    /// Partition `partition` of `count`, before any cause.
    pub fn new(partition: u32, count: u32) -> Self {
        Self {
            partition,
            count,
            seq: 0,
            ord: 0,
        }
    }

    /// The one partition of a deployment of one: every key (tools and tests that apply
    /// inputs to a store of their own).
    pub fn whole() -> Self {
        Self::new(0, 1)
    }

    /// Whether a route's key belongs to this partition.
    pub(crate) fn owns(&self, tenant: &str, route: &Route) -> bool {
        super::partition::partition(tenant, &route.saga, &route.correlation_id, self.count)
            == self.partition
    }
}

impl<'a> Processor<'a> {
    /// A processor for one batch of partition `scope`.
    pub fn new(catalog: &'a Catalog, limits: &'a Limits, now_ms: u64, scope: Scope) -> Self {
        Self {
            catalog,
            limits,
            now_ms,
            tally: Tally::default(),
            scope,
            paused: Arc::default(),
            freed: Vec::new(),
            releasing: false,
        }
    }

    /// Applies the keys held at a cap that the instances ended and timers gone since the last
    /// call let go
    /// (`worker/cap.rs`), and what those free in turn. Called after each input of a batch.
    pub fn release_freed(&mut self, tx: &Tables<'_, RW>) -> Result<()> {
        while let Some(tenant) = self.freed.pop() {
            // A paused tenant's held keys wait: its resume calls this again.
            if self.paused.contains(&tenant) {
                continue;
            }
            self.releasing = true;
            let released = cap::release(tx, &tenant, self.place(), None, self);
            self.releasing = false;
            released?;
        }
        Ok(())
    }

    /// Notes that `tenant`'s keys held at its cap in this partition may go now.
    pub(crate) fn freed(&mut self, tenant: &str) {
        self.freed.push(tenant.to_string());
    }

    /// Whether a new instance about to start in this partition goes on under its tenant's
    /// cap (`cap.rs`), releasing first what the cap it came with lets go. Inputs `cap.rs`
    /// applies itself were measured when it let them go; every other input, a redrive or a
    /// resume's release included, is measured here.
    fn cap_admits(&mut self, tx: &Tables<'_, RW>, raw: &RawInput, tenant: &str) -> Result<bool> {
        if self.releasing {
            return Ok(true);
        }
        self.releasing = true;
        let place = self.place();
        // A paused tenant's held keys wait for its resume, whatever is applied meanwhile (an
        // operator's redrive): this input is measured, nothing is released.
        let release = !self.paused.contains(tenant);
        let admitted = cap::admits(tx, tenant, place, Caps::of(raw), release, self);
        self.releasing = false;
        admitted
    }

    /// This partition, for `cap.rs`.
    fn place(&self) -> cap::Place {
        cap::Place {
            partition: self.scope.partition,
            partitions: self.scope.count,
        }
    }

    /// Sets the cause of the records written from now on.
    pub fn cause(&mut self, seq: u64) {
        self.scope.seq = seq;
        self.scope.ord = 0;
    }

    /// The outbox partition and cause of the next record, advancing the rank.
    fn next_slot(&mut self) -> (u16, (u64, u32)) {
        let s = &mut self.scope;
        s.ord += 1;
        (s.partition as u16, (s.seq, s.ord))
    }

    /// Records a dead letter (see [`deadletter::record`]) and counts it.
    pub(crate) fn dead_letter(
        &mut self,
        tx: &Tables<'_, RW>,
        raw: &RawInput,
        tenant: &str,
        k: &'static str,
        reason: String,
        route: Option<&Route>,
    ) -> Result<()> {
        let outbox = self.next_slot();
        let (outbox_seq, record) = deadletter::record(
            tx,
            Poison {
                outbox,
                refused: Refused {
                    tenant,
                    kind: k,
                    reason: &reason,
                    subject: &raw.subject,
                    source: &raw.source,
                    body: &raw.body,
                    at_ms: self.now_ms,
                },
                traceparent: raw.traceparent.as_deref(),
                route,
                stored_ms: raw.stored_ms,
            },
        )?;
        self.tally.wrote(outbox_seq, record);
        self.tally.dead_letters.push(k);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::config::StorageConfig;
    use crate::storage::Store;

    /// A log sink for one test.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("sink").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn log_lines_of_an_input_carry_its_span_fields() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&StorageConfig {
            data_dir: dir.path().to_path_buf(),
            ..StorageConfig::default()
        })
        .expect("store");
        let sink = Sink::default();
        let writer = sink.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .without_time()
            .with_writer(move || writer.clone())
            .finish();
        let (catalog, limits) = (
            Catalog::default(),
            Limits {
                allowed_tenants: Vec::new(),
                max_message_bytes: 1024,
                max_payload: 0,
                max_output_bytes: usize::MAX,
                max_clock_skew_ms: crate::saga::DEFAULT_MAX_CLOCK_SKEW_MS,
                seal: crate::seal::Seal::none(),
            },
        );
        let raw = RawInput {
            subject: "tenant.acme.aggregate.Order.o-1".into(),
            body: bytes::Bytes::from_static(b"not json"),
            traceparent: None,
            header_bytes: 0,
            refused: None,
            live_cap: None,
            timer_cap: None,
            source: "AGGREGATE_EVENTS:7".into(),
            stored_ms: None,
        };
        tracing::subscriber::with_default(subscriber, || {
            store
                .write_blocking(|t| {
                    Processor::new(&catalog, &limits, 1, Scope::whole()).input(t, &raw)
                })
                .expect("applies");
        });
        let log = String::from_utf8(sink.0.lock().expect("sink").clone()).expect("utf8");
        let line = log
            .lines()
            .find(|l| l.contains("Input dead-lettered."))
            .unwrap_or_else(|| panic!("no dead-letter line in {log:?}"));
        assert!(
            line.contains(r#"saga_input{tenant="acme" source=AGGREGATE_EVENTS:7}"#),
            "{line}"
        );
    }
}
