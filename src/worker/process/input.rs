//! An input from a stream, routed to the saga instances it reaches.
//!
//! The input is admitted first ([`admission::admit`]); the engine then names the instances
//! it reaches ([`saga::route`]), and each one whose key this partition owns
//! ([`super::Scope`]) has the input applied ([`Processor::route`]). Guarantees kept here:
//! - an input refused at admission, or one the engine cannot route (poison, an uncorrelated
//!   result, an engine panic), is a dead letter that parks no key, and the batch goes on;
//! - an input no saga wants is skipped and counted (`runner_saga_unrouted_total`), never an
//!   error; Runner's own terminal events read back are skipped silently;
//! - the routes of other partitions are left to their owners, who apply them from their
//!   own copy of the input.

use std::panic::{AssertUnwindSafe, catch_unwind};

use libmdbx::RW;
use serde_json::Value as Json;

use super::{Processor, RawInput, split_subject};
use crate::deadletter::kind;
use crate::saga::{self, StepError};
use crate::storage::{Result, Tables};
use crate::worker::admission::{self, envelope_malformed};

/// Rate limit of the "wanted by no saga" line.
static UNROUTED_LOG: crate::telemetry::Every = crate::telemetry::Every::new(60_000);

impl Processor<'_> {
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
}
