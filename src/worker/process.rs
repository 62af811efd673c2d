//! Applying inputs inside one write transaction.
//!
//! [`Processor`] turns raw inputs (a subject and a body) and due timers into writes on
//! [`Tables`]: new instance state, outbox records, timer entries, dedupe markers, dead
//! letters and parked keys. It never commits: the caller adds the checkpoint and commits
//! once per batch, so either all of a batch's effects are durable or none are.
//!
//! Guarantees, given that the caller commits before acknowledging anything:
//! - an input already applied to a saga (dedupe marker) is not applied again;
//! - a key with a pending dead letter is parked: its later inputs are held as dead letters
//!   of kind `parked`, in order, until an operator redrives the first one;
//! - poison never stops the batch: it is recorded with its reason and the batch goes on.

use std::panic::{AssertUnwindSafe, catch_unwind};

use libmdbx::RW;
use serde_json::Value as Json;

use crate::deadletter::{self, DeadLetter, Poison, Reapply, kind};
use crate::manifest::Catalog;
use crate::saga::{self, Input, Route, StepError};
use crate::storage::tables::{DEFAULT_PARTITION, HistoryEntry, OutboxRecord, TimerEntry};
use crate::storage::{Result, Tables};

/// Longest tenant token accepted.
pub const MAX_TENANT_BYTES: usize = 128;
/// Longest correlation id or event id accepted.
pub const MAX_ID_BYTES: usize = 512;

/// One input as it came off a stream.
#[derive(Debug, Clone)]
pub struct RawInput {
    /// Full subject, `tenant.<t>.…`.
    pub subject: String,
    /// Body bytes.
    pub body: Vec<u8>,
    /// `traceparent` header, if any.
    pub traceparent: Option<String>,
    /// `stream:seq`, for dead letters.
    pub source: String,
}

/// Per-batch tally, for metrics and logs.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// (saga, outcome label, count): routed applications, counted per pair.
    pub transitions: Vec<(String, &'static str, u64)>,
    /// Dead letters by kind.
    pub dead_letters: Vec<&'static str>,
    /// Inputs no saga wanted.
    pub unrouted: u64,
    /// Outbox records written.
    pub outbox: u64,
    /// Highest outbox sequence written (0 when none).
    pub last_outbox: u64,
}

impl Tally {
    /// Counts one routed application of `saga` with `outcome`.
    pub fn note(&mut self, saga: &str, outcome: &'static str) {
        match self
            .transitions
            .iter_mut()
            .find(|(s, o, _)| s == saga && *o == outcome)
        {
            Some(e) => e.2 += 1,
            None => self.transitions.push((saga.to_string(), outcome, 1)),
        }
    }
    /// Applications with `outcome`, over all sagas.
    pub fn count(&self, outcome: &str) -> u64 {
        self.transitions
            .iter()
            .filter(|(_, o, _)| *o == outcome)
            .map(|(_, _, n)| n)
            .sum()
    }
}

/// Settings the processor needs.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Allowed tenants; empty means any.
    pub allowed_tenants: Vec<String>,
    /// Largest accepted body.
    pub max_message_bytes: usize,
}

impl Limits {
    /// The limits configured for this process.
    pub fn from_config(c: &crate::config::Config) -> Self {
        Self {
            allowed_tenants: c.tenancy.allowed.clone(),
            max_message_bytes: usize::try_from(c.saga.max_message_bytes.get())
                .unwrap_or(usize::MAX),
        }
    }
}

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
}

/// Splits `tenant.<t>.<rest>` into (t, rest).
pub fn split_subject(subject: &str) -> Option<(&str, &str)> {
    let rest = subject.strip_prefix("tenant.")?;
    let (t, rel) = rest.split_once('.')?;
    (!t.is_empty() && !rel.is_empty() && !t.contains('\0')).then_some((t, rel))
}

impl<'a> Processor<'a> {
    /// A processor for one batch.
    pub fn new(catalog: &'a Catalog, limits: &'a Limits, now_ms: u64) -> Self {
        Self {
            catalog,
            limits,
            now_ms,
            tally: Tally::default(),
        }
    }

    /// Applies one input from a stream.
    pub fn input(&mut self, tx: &Tables<'_, RW>, raw: &RawInput) -> Result<()> {
        let dl_tenant = "_";
        let Some((tenant, rel)) = split_subject(&raw.subject) else {
            return self.dead_letter(
                tx,
                raw,
                dl_tenant,
                kind::UNDECODABLE,
                "subject is not tenant.<t>.…".into(),
                None,
            );
        };
        if tenant.len() > MAX_TENANT_BYTES {
            let why = format!(
                "tenant token is {} bytes; the limit is {MAX_TENANT_BYTES}",
                tenant.len()
            );
            return self.dead_letter(tx, raw, dl_tenant, kind::TOO_LARGE, why, None);
        }
        if raw.body.len() > self.limits.max_message_bytes {
            let why = format!(
                "body is {} bytes; the limit is {}",
                raw.body.len(),
                self.limits.max_message_bytes
            );
            return self.dead_letter(tx, raw, tenant, kind::TOO_LARGE, why, None);
        }
        if !self.limits.allowed_tenants.is_empty()
            && !self.limits.allowed_tenants.iter().any(|t| t == tenant)
        {
            return self.dead_letter(
                tx,
                raw,
                tenant,
                kind::UNKNOWN_TENANT,
                format!("tenant `{tenant}` is not served here"),
                None,
            );
        }
        let body: Json = match serde_json::from_slice(&raw.body) {
            Ok(b @ Json::Object(_)) => b,
            Ok(_) => {
                return self.dead_letter(
                    tx,
                    raw,
                    tenant,
                    kind::UNDECODABLE,
                    "body is not a JSON object".into(),
                    None,
                );
            }
            Err(e) => {
                return self.dead_letter(
                    tx,
                    raw,
                    tenant,
                    kind::UNDECODABLE,
                    format!("body is not JSON: {e}"),
                    None,
                );
            }
        };
        match body.get("tenant_id").and_then(Json::as_str) {
            Some(t) if t == tenant => {}
            Some(t) => {
                let why = format!("subject tenant `{tenant}` differs from body tenant `{t}`");
                return self.dead_letter(tx, raw, tenant, kind::TENANT_MISMATCH, why, None);
            }
            None => {
                return self.dead_letter(
                    tx,
                    raw,
                    tenant,
                    kind::UNDECODABLE,
                    "body has no tenant_id".into(),
                    None,
                );
            }
        }
        let input = Input::new(rel, body);
        let routes = match catch_unwind(AssertUnwindSafe(|| saga::route(self.catalog, &input))) {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                let k = if matches!(e, StepError::Poison { .. }) && input_malformed(&input) {
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
            self.tally.unrouted += 1;
            return Ok(());
        }
        for route in &routes {
            self.route(tx, raw, tenant, &input, route, false)?;
        }
        Ok(())
    }

    /// Applies a due timer and removes its schedule entry.
    pub fn timer(&mut self, tx: &Tables<'_, RW>, t: &TimerEntry) -> Result<()> {
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
            body: serde_json::to_vec(&input.body).unwrap_or_default(),
            traceparent: None,
            source: "timer".into(),
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
        let event_id = input
            .body
            .get("event_id")
            .and_then(Json::as_str)
            .unwrap_or_default()
            .to_string();
        // Keys are bounded (libmdbx refuses keys over about 2 KiB, which would fail the whole
        // batch again and again): an over-long id is poison, not a storage error.
        if corr.len() > MAX_ID_BYTES || event_id.len() > MAX_ID_BYTES {
            let why = format!(
                "correlation id ({} bytes) or event id ({} bytes) is over the {MAX_ID_BYTES}-byte limit",
                corr.len(),
                event_id.len()
            );
            self.tally.note(saga, "dead_lettered");
            return self.dead_letter(tx, raw, tenant, kind::TOO_LARGE, why, None);
        }
        // Keys separate their parts with 0x00, so an id holding one could alias another key.
        if corr.contains('\0') || event_id.contains('\0') {
            self.tally.note(saga, "dead_lettered");
            let why = "correlation id or event id contains a NUL character".to_string();
            return self.dead_letter(tx, raw, tenant, kind::UNDECODABLE, why, None);
        }
        if !event_id.is_empty() && tx.is_applied(tenant, saga, &event_id)? {
            self.tally.note(saga, "duplicate");
            return Ok(());
        }
        if !redrive && let Some(first) = tx.parked_by(tenant, saga, corr)? {
            let why = format!("key is parked behind dead letter {first}");
            return self.dead_letter(tx, raw, tenant, kind::PARKED, why, Some(route));
        }
        let instance = tx.instance(tenant, saga, corr)?;
        let result = catch_unwind(AssertUnwindSafe(|| {
            saga::apply(self.catalog, saga, corr, instance.as_ref(), input)
        }));
        match result {
            Ok(Ok(applied)) => {
                tx.put_instance(&applied.instance)?;
                for w in &applied.work {
                    let rec = OutboxRecord {
                        subject: format!("tenant.{tenant}.{}", w.subject),
                        msg_id: w.msg_id.clone(),
                        tenant: tenant.to_string(),
                        traceparent: raw.traceparent.clone(),
                        body: serde_json::to_string(&w.body).unwrap_or_default(),
                    };
                    self.tally.last_outbox = tx.push_outbox(DEFAULT_PARTITION, &rec)?;
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
                    tx.mark_applied(tenant, saga, &event_id, self.now_ms)?;
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
                    emitted: applied.work.len(),
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
                let k = if input_malformed(input) {
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
        let recorded = deadletter::record(
            tx,
            Poison {
                tenant,
                kind: k,
                reason: &reason,
                subject: &raw.subject,
                source: &raw.source,
                body: &raw.body,
                traceparent: raw.traceparent.as_deref(),
                route,
                at_ms: self.now_ms,
            },
        )?;
        self.tally.last_outbox = recorded.outbox_seq;
        self.tally.outbox += 1;
        self.tally.dead_letters.push(k);
        Ok(())
    }
}

/// Whether the envelope lacks what every input needs (versus an expression failing on a
/// well-formed input).
fn input_malformed(input: &Input) -> bool {
    let b = &input.body;
    b.get("v").and_then(Json::as_u64) != Some(1)
        || b.get("event_id")
            .and_then(Json::as_str)
            .is_none_or(str::is_empty)
        || b.get("timestamp_ms").and_then(Json::as_u64).is_none()
}

impl Reapply for Processor<'_> {
    fn reapply(&mut self, tx: &Tables<'_, RW>, dl: &DeadLetter, hold: bool) -> Result<bool> {
        let raw = RawInput {
            subject: dl.subject.clone(),
            body: dl.body.clone().into_bytes(),
            traceparent: dl.traceparent.clone(),
            source: format!("redrive:{}", dl.id),
        };
        let failed_before = self.tally.dead_letters.len();
        match (&dl.saga, &dl.correlation_id, split_subject(&dl.subject)) {
            (Some(saga), Some(corr), Some((_, rel))) => {
                let body: Json = serde_json::from_str(&dl.body).unwrap_or(Json::Null);
                let input = Input::new(rel, body);
                let route = Route {
                    saga: saga.clone(),
                    correlation_id: corr.clone(),
                };
                self.route(tx, &raw, &dl.tenant, &input, &route, !hold)?;
            }
            _ => self.input(tx, &raw)?,
        }
        Ok(self.tally.dead_letters.len() > failed_before)
    }
}
