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
//! Tracing: each input is applied inside a `saga_input` span (`tenant`, `source` =
//! `stream:seq`, `timer` or `redrive:<id>`) and each saga it reaches inside a `saga_apply`
//! span (`saga`, `correlation_id`), so log lines emitted while applying carry those fields
//! without restating them. Both spans are at debug level because this is the hot path: a
//! span the filter leaves out costs nothing measurable, while an enabled one has its fields
//! formatted by the log layer as it opens, several percent of an input's apply time.

use std::collections::BTreeSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use libmdbx::RW;
use serde_json::Value as Json;

use super::admission::{self, envelope_malformed};
use super::pause;
use crate::broker::headers;
use crate::deadletter::{self, DeadLetter, Poison, Reapply, Refused, kind};
use crate::manifest::Catalog;
use crate::saga::{self, Input, Route, StepError};
use crate::storage::tables::dedupe::{Applied, instance_fingerprint};
use crate::storage::tables::{HistoryEntry, OutboxRecord, TimerEntry};
use crate::storage::{Result, Tables};
use crate::telemetry::otel;

pub use super::admission::{Limits, MAX_ID_BYTES, MAX_TENANT_BYTES, RawInput, split_subject};
pub use super::tally::Tally;

/// Rate limit of the "wanted by no saga" line.
static UNROUTED_LOG: crate::telemetry::Every = crate::telemetry::Every::new(60_000);

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
    fn owns(&self, tenant: &str, route: &Route) -> bool {
        super::partition::partition(tenant, &route.saga, &route.correlation_id, self.count)
            == self.partition
    }
}

/// Why an input's outputs cannot all be written: together they pass what one transaction
/// writes ([`Limits::max_output_bytes`]), or one of them, with the headers it will be
/// published with, is larger than the broker takes (`broker::headers::record_fits`
/// against [`Limits::max_payload`]; 0 checks only the header limit).
fn over_budget(
    work: &[saga::WorkItem],
    tenant: &str,
    traceparent: Option<&str>,
    limits: &Limits,
) -> Option<String> {
    let one = work.iter().find_map(|w| {
        headers::record_fits(
            &w.msg_id,
            Some(tenant),
            traceparent,
            w.body.as_str().len(),
            limits.max_payload,
        )
        .err()
        .map(|why| format!("its output `{}`: {why}", w.subject))
    });
    one.or_else(|| {
        let all: usize = work.iter().map(|w| w.body.as_str().len()).sum();
        (all > limits.max_output_bytes).then(|| {
            format!(
                "its {} outputs would be {all} bytes in all; one transaction writes at most {} \
                 (saga.max_batch_bytes)",
                work.len(),
                limits.max_output_bytes
            )
        })
    })
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

    /// Applies one input from a stream: admits it ([`admission::admit`]), routes it, and
    /// applies it to every saga instance it reaches.
    pub fn input(&mut self, tx: &Tables<'_, RW>, raw: &RawInput) -> Result<()> {
        let span = tracing::debug_span!(
            "saga_input",
            tenant = split_subject(&raw.subject).map_or("_", |(t, _)| t),
            source = %raw.source,
        );
        let _entered = span.enter();
        let (tenant, input) = match admission::admit(raw, self.limits) {
            Ok(a) => (a.tenant, a.input),
            Err(r) => return self.dead_letter(tx, raw, r.tenant, r.kind, r.reason, None),
        };
        let routes = match catch_unwind(AssertUnwindSafe(|| saga::route(self.catalog, &input))) {
            Ok(Ok(r)) => r,
            Ok(Err(e @ StepError::UncorrelatedReply { .. })) => {
                // It names no instance: no key is parked, so it can neither move nor stop one.
                let k = kind::UNANSWERED_RESULT;
                return self.dead_letter(tx, raw, tenant, k, e.to_string(), None);
            }
            Ok(Err(e)) => {
                let k = if matches!(e, StepError::Poison { .. }) && envelope_malformed(&input) {
                    kind::UNDECODABLE
                } else {
                    kind::EXPRESSION
                };
                return self.dead_letter(tx, raw, tenant, k, e.to_string(), None);
            }
            Err(_) => {
                return self.dead_letter(
                    tx,
                    raw,
                    tenant,
                    kind::ENGINE_PANIC,
                    "the engine panicked while routing".into(),
                    None,
                );
            }
        };
        if routes.is_empty() {
            if saga::is_terminal_event(&raw.subject, &input.body) {
                // Runner's own announcement that an instance ended, read back from the
                // stream it shares with results: nothing to do, nothing wrong.
                return Ok(());
            }
            // No saga wants it (a finished-with event type, a typo in a producer): counted
            // in runner_saga_unrouted_total and named here, at most once a minute.
            self.tally.unrouted += 1;
            if let Some(skipped) = UNROUTED_LOG.ready() {
                tracing::info!(message = "Input wanted by no saga; skipped (counted in runner_saga_unrouted_total).", subject = %raw.subject, event_type = input.body.get("event_type").and_then(Json::as_str).unwrap_or("-"), also_skipped_since_last = skipped);
            }
            return Ok(());
        }
        for route in &routes {
            if !self.scope.owns(tenant, route) {
                continue;
            }
            self.route(tx, raw, tenant, &input, route, false)?;
        }
        Ok(())
    }

    /// Applies a timer firing read from the partition's inbox (partitioned mode: a due
    /// timer is published into the inbox and applied from there, so it has a place in the
    /// partition's log and replays like any input). Its body is the [`TimerEntry`]; a timer
    /// no longer pending (cancelled, or fired by an earlier copy of this message) is ignored.
    pub fn fired_timer(&mut self, tx: &Tables<'_, RW>, raw: &RawInput) -> Result<()> {
        let Ok(t) = serde_json::from_slice::<TimerEntry>(&raw.body) else {
            tracing::warn!(message = "Unreadable timer firing ignored.", source = %raw.source);
            return Ok(());
        };
        let pending = tx
            .timers_of(&t.tenant, &t.saga, &t.correlation_id)?
            .into_iter()
            .any(|e| e == t);
        if !pending {
            self.tally.note(&t.saga, "ignored");
            return Ok(());
        }
        self.timer(tx, &t)
    }

    /// Applies a due timer and removes its schedule entry.
    pub fn timer(&mut self, tx: &Tables<'_, RW>, t: &TimerEntry) -> Result<()> {
        let span = tracing::debug_span!("saga_input", tenant = %t.tenant, source = "timer");
        let _entered = span.enter();
        tx.delete_timer(t)?;
        let input = Input::timer(
            &t.tenant,
            &t.saga,
            &t.correlation_id,
            &t.name,
            &t.timer_id,
            t.due_ms,
        );
        let raw = RawInput {
            subject: format!("tenant.{}.{}", t.tenant, input.subject),
            body: serde_json::to_vec(&input.body).unwrap_or_default().into(),
            traceparent: None,
            header_bytes: 0,
            refused: None,
            source: "timer".into(),
            stored_ms: None, // its time is its due time, which the engine computed
        };
        let route = Route {
            saga: t.saga.clone(),
            correlation_id: t.correlation_id.clone(),
        };
        self.route(tx, &raw, &t.tenant, &input, &route, false)
    }

    /// Applies `input` to one saga instance. With `redrive`, a parked key is not held
    /// (the caller has unparked it and is replaying its held inputs in order).
    pub fn route(
        &mut self,
        tx: &Tables<'_, RW>,
        raw: &RawInput,
        tenant: &str,
        input: &Input,
        route: &Route,
        redrive: bool,
    ) -> Result<()> {
        let (saga, corr) = (route.saga.as_str(), route.correlation_id.as_str());
        let span = tracing::debug_span!("saga_apply", saga, correlation_id = corr);
        let _entered = span.enter();
        let event_id = input
            .body
            .get("event_id")
            .and_then(Json::as_str)
            .unwrap_or_default()
            .to_string();
        if let Err(r) = admission::check_key(tenant, corr, &event_id) {
            self.tally.note(saga, "dead_lettered");
            return self.dead_letter(tx, raw, r.tenant, r.kind, r.reason, None);
        }
        if !event_id.is_empty()
            && let Applied::To(to) = tx.applied(tenant, saga, &event_id)?
        {
            if to.is_some_and(|f| f != instance_fingerprint(corr)) {
                // Not a redelivery: the producer reused an event id for another instance.
                // Dropping it silently would lose that instance's input.
                let why = format!(
                    "event id `{event_id}` was already applied to another instance of saga \
                     `{saga}`; event ids must be unique"
                );
                self.tally.note(saga, "dead_lettered");
                return self.dead_letter(tx, raw, tenant, kind::DUPLICATE_EVENT_ID, why, None);
            }
            self.tally.note(saga, "duplicate");
            return Ok(());
        }
        if !redrive {
            // A paused tenant's inputs, and every later input of a key a pause parks, are
            // held whole until the resume releases them (`pause.rs`).
            let first = tx.parked_by(tenant, saga, corr)?;
            if self.paused.contains(tenant)
                || first.map_or(Ok(false), |f| pause::parked_by_pause(tx, tenant, f))?
            {
                self.tally.note(saga, "held");
                return pause::hold(tx, raw, tenant, route, self.now_ms);
            }
            if let Some(first) = first {
                let why = format!("key is parked behind dead letter {first}");
                return self.dead_letter(tx, raw, tenant, kind::PARKED, why, Some(route));
            }
        }
        let instance = tx.instance(tenant, saga, corr)?;
        let result = catch_unwind(AssertUnwindSafe(|| {
            saga::apply(self.catalog, saga, corr, instance.as_ref(), input)
        }));
        match result {
            Ok(Ok(mut applied)) => {
                // This transition's span: the outputs below carry its trace context.
                let hop = otel::hop(
                    "saga.transition",
                    otel::Kind::Consumer,
                    raw.traceparent.as_deref(),
                    || {
                        vec![
                            otel::attr("runner.tenant", tenant),
                            otel::attr("runner.saga", saga),
                            otel::attr("runner.correlation_id", corr),
                            otel::attr(
                                "runner.state.from",
                                instance.as_ref().map(|i| i.state.as_str()).unwrap_or(""),
                            ),
                            otel::attr("runner.state.to", applied.instance.state.as_str()),
                            otel::attr("runner.source", raw.source.as_str()),
                            otel::attr("messaging.destination.name", raw.subject.as_str()),
                        ]
                    },
                );
                let traceparent = otel::onward(hop.as_ref(), raw.traceparent.as_deref());
                // The manifest's outputs, then the terminal workflow event when the
                // instance ended: all of them go through the outbox in this transaction.
                let emitted = applied.work.len();
                let outputs: Vec<saga::WorkItem> = std::mem::take(&mut applied.work)
                    .into_iter()
                    .chain(applied.finished.take())
                    .collect();
                if let Some(why) = over_budget(&outputs, tenant, traceparent, self.limits) {
                    // Nothing of the transition is written: the broker could never take
                    // this output, and a record stuck in the outbox would hold every later
                    // one. The key is parked like any poison, so its order is kept.
                    return self.poison(tx, raw, tenant, kind::TOO_LARGE, why, route);
                }
                tx.put_instance(
                    &applied.instance,
                    instance.as_ref().map(|i| i.state.as_str()),
                )?;
                for w in outputs {
                    let rec = OutboxRecord {
                        subject: format!("tenant.{tenant}.{}", w.subject),
                        msg_id: w.msg_id,
                        tenant: tenant.to_string(),
                        traceparent: traceparent.map(str::to_string),
                        body: w.body.into_string(),
                        cause: (0, 0),
                    };
                    let (partition, cause) = self.next_slot();
                    let rec = OutboxRecord { cause, ..rec };
                    self.tally.outbox_bytes += rec.body.len() as u64;
                    self.tally.last_outbox = tx.push_outbox(partition, &rec)?;
                    self.tally.outbox += 1;
                }
                for c in &applied.timers_cancelled {
                    tx.delete_timer(&TimerEntry {
                        tenant: tenant.to_string(),
                        saga: saga.to_string(),
                        correlation_id: corr.to_string(),
                        name: c.name.clone(),
                        timer_id: c.timer_id.clone(),
                        due_ms: c.due_ms,
                    })?;
                }
                for s in &applied.timers_set {
                    tx.put_timer(&TimerEntry {
                        tenant: tenant.to_string(),
                        saga: saga.to_string(),
                        correlation_id: corr.to_string(),
                        name: s.name.clone(),
                        timer_id: s.timer_id.clone(),
                        due_ms: s.due_ms,
                    })?;
                }
                if !event_id.is_empty() {
                    tx.mark_applied_to(tenant, saga, &event_id, corr, self.now_ms)?;
                }
                let entry = HistoryEntry {
                    n: applied.instance.applied,
                    event: applied.event.clone(),
                    event_id,
                    from: instance
                        .as_ref()
                        .map(|i| i.state.clone())
                        .unwrap_or_default(),
                    to: applied.instance.state.clone(),
                    at_ms: applied.instance.updated_ms,
                    source: raw.source.clone(),
                    emitted,
                };
                tx.push_history(tenant, saga, corr, &entry)?;
                self.tally.note(saga, "applied");
            }
            Ok(Err(
                StepError::NotStarting
                | StepError::NoTransition { .. }
                | StepError::Finished(_)
                | StepError::StaleTimer(_),
            )) => {
                self.tally.note(saga, "ignored");
            }
            Ok(Err(
                e @ (StepError::UnansweredCommand { .. } | StepError::UncorrelatedReply { .. }),
            )) => {
                // Not parked: a forged result must not be able to stop the saga either.
                self.tally.note(saga, "dead_lettered");
                let why = e.to_string();
                return self.dead_letter(tx, raw, tenant, kind::UNANSWERED_RESULT, why, None);
            }
            Ok(Err(e @ StepError::VersionNotLoaded { .. })) => {
                self.poison(
                    tx,
                    raw,
                    tenant,
                    kind::VERSION_NOT_LOADED,
                    e.to_string(),
                    route,
                )?;
            }
            Ok(Err(e @ (StepError::Poison { .. } | StepError::UnknownSaga(_)))) => {
                let k = if envelope_malformed(input) {
                    kind::UNDECODABLE
                } else {
                    kind::EXPRESSION
                };
                self.poison(tx, raw, tenant, k, e.to_string(), route)?;
            }
            Err(_) => {
                self.poison(
                    tx,
                    raw,
                    tenant,
                    kind::ENGINE_PANIC,
                    "the engine panicked".into(),
                    route,
                )?;
            }
        }
        Ok(())
    }

    fn poison(
        &mut self,
        tx: &Tables<'_, RW>,
        raw: &RawInput,
        tenant: &str,
        k: &'static str,
        why: String,
        route: &Route,
    ) -> Result<()> {
        self.tally.note(&route.saga, "dead_lettered");
        self.dead_letter(tx, raw, tenant, k, why, Some(route))
    }

    /// Records a dead letter (see [`deadletter::record`]) and counts it.
    fn dead_letter(
        &mut self,
        tx: &Tables<'_, RW>,
        raw: &RawInput,
        tenant: &str,
        k: &'static str,
        reason: String,
        route: Option<&Route>,
    ) -> Result<()> {
        let outbox = self.next_slot();
        let outbox_seq = deadletter::record(
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
        self.tally.last_outbox = outbox_seq;
        self.tally.outbox += 1;
        self.tally.dead_letters.push(k);
        Ok(())
    }
}

impl Reapply for Processor<'_> {
    fn reapply(&mut self, tx: &Tables<'_, RW>, dl: &DeadLetter, hold: bool) -> Result<bool> {
        let raw = RawInput {
            subject: dl.subject.clone(),
            body: dl.body.clone().into_bytes().into(),
            traceparent: dl.traceparent.clone(),
            header_bytes: 0,
            refused: None,
            source: format!("redrive:{}", dl.id),
            // The broker's time kept with the letter (older letters: when it was recorded),
            // so a redrive, however late, applies the input within the bound it had.
            stored_ms: dl.stored_ms.or(Some(dl.at_ms)),
        };
        let failed_before = self.tally.dead_letters.len();
        match (&dl.saga, &dl.correlation_id, split_subject(&dl.subject)) {
            (Some(saga), Some(corr), Some((_, rel))) => {
                let span = tracing::debug_span!(
                    "saga_input",
                    tenant = %dl.tenant,
                    source = %raw.source,
                );
                let _entered = span.enter();
                let body: Json = serde_json::from_str(&dl.body).unwrap_or(Json::Null);
                let input = Input::new(rel, body)
                    .with_bound(admission::time_bound(raw.stored_ms, self.limits));
                let route = Route {
                    saga: saga.clone(),
                    correlation_id: corr.clone(),
                };
                if hold && dl.kind == kind::TENANT_PAUSED {
                    // Held again behind an input of its key that failed: still whole.
                    self.tally.note(saga, "held");
                    pause::hold_again(tx, dl, &route, self.now_ms)?;
                } else {
                    self.route(tx, &raw, &dl.tenant, &input, &route, !hold)?;
                }
            }
            _ => self.input(tx, &raw)?,
        }
        Ok(self.tally.dead_letters.len() > failed_before)
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
            },
        );
        let raw = RawInput {
            subject: "tenant.acme.aggregate.Order.o-1".into(),
            body: bytes::Bytes::from_static(b"not json"),
            traceparent: None,
            header_bytes: 0,
            refused: None,
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
