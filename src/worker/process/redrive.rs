//! Redrives: a dead letter applied again when an operator releases its key.
//!
//! [`Reapply`] is how [`crate::deadletter`] hands a letter back to the processor. Guarantees
//! kept here: the letter is applied with the broker time kept with it, so a redrive, however
//! late, applies the input within the time bound it had; an input held for a pause is held
//! again whole when an input of its key ahead of it failed; a letter that names no instance
//! goes through admission and routing again like a new input.

use libmdbx::RW;
use serde_json::Value as Json;

use super::{Processor, RawInput, split_subject};
use crate::deadletter::{DeadLetter, Reapply, kind};
use crate::saga::{Input, Route};
use crate::storage::{Result, Tables};
use crate::worker::{admission, pause};

impl Reapply for Processor<'_> {
    fn reapply(&mut self, tx: &Tables<'_, RW>, dl: &DeadLetter, hold: bool) -> Result<bool> {
        let raw = RawInput {
            subject: dl.subject.clone(),
            body: dl.body.clone().into_bytes().into(),
            traceparent: dl.traceparent.clone(),
            header_bytes: 0,
            refused: None,
            live_cap: None,
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
                if hold && (dl.kind == kind::TENANT_PAUSED || dl.kind == kind::TENANT_CAPPED) {
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
