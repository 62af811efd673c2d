//! Applying an input to one saga instance: the gates of its key, the engine's transition,
//! and what that transition writes to the tables of the transaction.
//!
//! Guarantees kept here:
//! - an input whose event id is already applied to this instance is counted as a duplicate
//!   and not applied again; the same id applied to another instance is a dead letter
//!   (`duplicate_event_id`), never silently dropped;
//! - a paused tenant's inputs, and those of a key a pause parks, are held whole; a key
//!   parked behind a dead letter has its later inputs recorded as `parked`, in order;
//! - a transition is written whole — instance, outbox records, timers, dedupe marker,
//!   history — or, when one of its outputs could never be published, not at all (the key is
//!   parked as `too_large`, so its order is kept);
//! - a cancelled timer's row is deleted in the transaction that cancels it;
//! - an engine panic is recorded as poison (`engine_panic`) and never unwinds through the
//!   transaction.

use std::panic::{AssertUnwindSafe, catch_unwind};

use libmdbx::RW;
use serde_json::Value as Json;

use super::{Limits, Processor, RawInput};
use crate::broker::headers;
use crate::deadletter::kind;
use crate::saga::{self, Input, Instance, Route, StepError};
use crate::storage::tables::dedupe::{Applied, MarkerPlace, instance_fingerprint};
use crate::storage::tables::{HistoryEntry, OutboxRecord, TimerEntry};
use crate::storage::{Result, Tables};
use crate::telemetry::otel;
use crate::worker::admission::{self, Caps, envelope_malformed};
use crate::worker::{cap, pause};

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

impl Processor<'_> {
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
        if !self.key_takes(tx, raw, tenant, route, &event_id, redrive)? {
            return Ok(());
        }
        let instance = tx.instance(tenant, saga, corr)?;
        let result = catch_unwind(AssertUnwindSafe(|| {
            saga::apply(self.catalog, saga, corr, instance.as_ref(), input)
        }));
        match result {
            Ok(Ok(applied)) => {
                // A new running instance: within its tenant's cap, or held (`cap.rs`).
                if instance.is_none()
                    && !applied.instance.status.is_final()
                    && !self.cap_admits(tx, raw, tenant)?
                {
                    self.tally.note(saga, "held");
                    let (place, caps) = (self.place(), Caps::of(raw));
                    return cap::hold(tx, raw, tenant, route, place, caps, self.now_ms);
                }
                return self.transition(
                    tx,
                    raw,
                    tenant,
                    route,
                    instance.as_ref(),
                    applied,
                    event_id,
                );
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

    /// The gates of `route`'s key, passed before the engine sees the input: whether the
    /// input goes on to the engine. When it does not, what became of it (a dead letter, a
    /// duplicate, an input held for a pause) is already written and counted.
    fn key_takes(
        &mut self,
        tx: &Tables<'_, RW>,
        raw: &RawInput,
        tenant: &str,
        route: &Route,
        event_id: &str,
        redrive: bool,
    ) -> Result<bool> {
        let (saga, corr) = (route.saga.as_str(), route.correlation_id.as_str());
        if let Err(r) = admission::check_key(tenant, corr, event_id) {
            self.tally.note(saga, "dead_lettered");
            self.dead_letter(tx, raw, r.tenant, r.kind, r.reason, None)?;
            return Ok(false);
        }
        if !event_id.is_empty()
            && let Applied::To(to) = tx.applied(tenant, saga, event_id)?
        {
            if to.is_some_and(|f| f != instance_fingerprint(corr)) {
                // Not a redelivery: the producer reused an event id for another instance.
                // Dropping it silently would lose that instance's input.
                let why = format!(
                    "event id `{event_id}` was already applied to another instance of saga \
                     `{saga}`; event ids must be unique"
                );
                self.tally.note(saga, "dead_lettered");
                self.dead_letter(tx, raw, tenant, kind::DUPLICATE_EVENT_ID, why, None)?;
                return Ok(false);
            }
            self.tally.note(saga, "duplicate");
            return Ok(false);
        }
        if !redrive {
            let first = tx.parked_by(tenant, saga, corr)?;
            if let Some(first) = first
                && cap::parks(tx, tenant, first)?
            {
                // Every later input of a key held at a cap waits whole behind it, in its
                // queue (`cap.rs`), also while its tenant is paused: its release applies
                // the key's inputs in order, and does not run while the tenant is paused.
                self.tally.note(saga, "held");
                let place = self.place();
                cap::hold_behind(tx, raw, tenant, route, place, first, self.now_ms)?;
                return Ok(false);
            }
            // A paused tenant's inputs, and every later input of a key a pause parks, are
            // held whole until the resume releases them (`pause.rs`).
            if self.paused.contains(tenant)
                || first.map_or(Ok(false), |f| pause::parked_by_pause(tx, tenant, f))?
            {
                self.tally.note(saga, "held");
                pause::hold(tx, raw, tenant, route, self.now_ms)?;
                return Ok(false);
            }
            if let Some(first) = first {
                let why = format!("key is parked behind dead letter {first}");
                self.dead_letter(tx, raw, tenant, kind::PARKED, why, Some(route))?;
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Writes the transition the engine made of an input: the new instance, its outputs
    /// through the outbox, its timers, the input's dedupe marker and a history entry — or,
    /// when its outputs are over budget ([`over_budget`]), nothing of it and a poison
    /// record instead. `before` is the instance as it was stored.
    #[allow(clippy::too_many_arguments)]
    fn transition(
        &mut self,
        tx: &Tables<'_, RW>,
        raw: &RawInput,
        tenant: &str,
        route: &Route,
        before: Option<&Instance>,
        mut applied: saga::Applied,
        event_id: String,
    ) -> Result<()> {
        let (saga, corr) = (route.saga.as_str(), route.correlation_id.as_str());
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
                        before.map(|i| i.state.as_str()).unwrap_or(""),
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
        tx.put_instance(&applied.instance, before.map(|i| i.state.as_str()))?;
        tx.count_live(
            tenant,
            self.scope.partition,
            before.map(|i| i.status),
            applied.instance.status,
        )?;
        let ended =
            before.is_some_and(|i| !i.status.is_final()) && applied.instance.status.is_final();
        self.push_outputs(tx, tenant, traceparent, outputs)?;
        let (set, gone) = write_timers(tx, tenant, route, &applied)?;
        tx.count_timers(tenant, self.scope.partition, set, gone)?;
        if ended || gone > set {
            // One of the tenant's running instances ended, or it has fewer timers pending:
            // a key held at a cap may go.
            self.freed.push(tenant.to_string());
        }
        if !event_id.is_empty() {
            let place = MarkerPlace {
                partition: self.scope.partition,
                partitions: self.scope.count,
            };
            tx.mark_applied_to(tenant, saga, &event_id, corr, self.now_ms, place)?;
        }
        let entry = HistoryEntry {
            n: applied.instance.applied,
            event: applied.event.clone(),
            event_id,
            from: before.map(|i| i.state.clone()).unwrap_or_default(),
            to: applied.instance.state.clone(),
            at_ms: applied.instance.updated_ms,
            source: raw.source.clone(),
            emitted,
        };
        tx.push_history(tenant, saga, corr, &entry)?;
        self.tally.note(saga, "applied");
        self.tally.applied_for(tenant);
        Ok(())
    }

    /// Pushes a transition's outputs to this partition's outbox, in order, each with the
    /// next rank of the current cause, and counts them.
    fn push_outputs(
        &mut self,
        tx: &Tables<'_, RW>,
        tenant: &str,
        traceparent: Option<&str>,
        outputs: Vec<saga::WorkItem>,
    ) -> Result<()> {
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
            let seq = tx.push_outbox(partition, &rec)?;
            self.tally.wrote(seq, rec);
        }
        Ok(())
    }

    /// Records a poison input of `route`'s key (which it parks) and counts it.
    pub(super) fn poison(
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
}

/// Writes a transition's timers to the schedule: the cancelled ones' rows deleted (so a
/// cancelled timer never fires), then the ones it set. Returns how many rows it added and
/// how many it removed.
fn write_timers(
    tx: &Tables<'_, RW>,
    tenant: &str,
    route: &Route,
    applied: &saga::Applied,
) -> Result<(u64, u64)> {
    let (mut set, mut gone) = (0, 0);
    let (saga, corr) = (route.saga.as_str(), route.correlation_id.as_str());
    for c in &applied.timers_cancelled {
        gone += u64::from(tx.delete_timer(&TimerEntry {
            tenant: tenant.to_string(),
            saga: saga.to_string(),
            correlation_id: corr.to_string(),
            name: c.name.clone(),
            timer_id: c.timer_id.clone(),
            due_ms: c.due_ms,
        })?);
    }
    for s in &applied.timers_set {
        set += u64::from(tx.put_timer(&TimerEntry {
            tenant: tenant.to_string(),
            saga: saga.to_string(),
            correlation_id: corr.to_string(),
            name: s.name.clone(),
            timer_id: s.timer_id.clone(),
            due_ms: s.due_ms,
        })?);
    }
    Ok((set, gone))
}
