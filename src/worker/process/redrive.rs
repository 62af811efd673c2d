//! Redrives: a dead letter applied again when an operator releases its key.
//!
//! [`Reapply`] is how [`crate::deadletter`] hands a letter back to the processor. Guarantees
//! kept here: the letter is applied with the broker time kept with it, so a redrive, however
//! late, applies the input within the time bound it had; an input held for a pause is held
//! again whole when an input of its key ahead of it failed, or was held at its tenant's cap
//! (`worker/cap.rs`: a redrive or a resume is measured against the cap like any input); a
//! letter that names no instance goes through admission and routing again like a new input.

use libmdbx::RW;
use serde_json::Value as Json;

use super::{Processor, RawInput, split_subject};
use crate::deadletter::{DeadLetter, Reapply, kind};
use crate::saga::{Input, Route};
use crate::storage::{Result, Tables};
use crate::worker::admission::Caps;
use crate::worker::{admission, cap, pause};

impl Reapply for Processor<'_> {
    fn reapply(&mut self, tx: &Tables<'_, RW>, dl: &DeadLetter, hold: bool) -> Result<bool> {
        let raw = RawInput {
            subject: dl.subject.clone(),
            body: dl.body.clone().into_bytes().into(),
            traceparent: dl.traceparent.clone(),
            header_bytes: 0,
            refused: None,
            live_cap: dl.live_cap,
            timer_cap: dl.timer_cap,
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
                let place = self.place();
                if hold && (dl.kind == kind::TENANT_PAUSED || dl.kind == kind::TENANT_CAPPED) {
                    // Held again behind an input of its key that failed or was held: still
                    // whole, and in the key's queue when a cap holds the key (`cap.rs`).
                    self.tally.note(saga, "held");
                    let kept = RawInput {
                        source: dl.source.clone(),
                        live_cap: dl.live_cap,
                        timer_cap: dl.timer_cap,
                        ..raw
                    };
                    match tx.parked_by(&dl.tenant, saga, corr)? {
                        Some(first) if cap::parks(tx, &dl.tenant, first)? => {
                            let at = self.now_ms;
                            cap::hold_behind(tx, &kept, &dl.tenant, &route, place, first, at)?;
                        }
                        _ if dl.kind == kind::TENANT_CAPPED => {
                            let caps = Caps::kept(dl);
                            cap::hold(tx, &kept, &dl.tenant, &route, place, caps, self.now_ms)?;
                        }
                        _ => pause::hold_again(tx, dl, &route, self.now_ms)?,
                    }
                } else {
                    if dl.kind == kind::TENANT_CAPPED {
                        // Applied now, by whoever: no longer queued at the cap.
                        tx.drop_capped(&dl.tenant, place.partition, dl.id)?;
                    }
                    self.route(tx, &raw, &dl.tenant, &input, &route, !hold)?;
                }
                // The key was unparked for this replay: parked again, by a failure or a hold
                // (a start over its tenant's cap), the inputs behind it must wait too. A
                // failure that parks nothing (a duplicate event id, say), or a dead letter
                // of another key applied meanwhile (a release of held keys), holds nothing.
                return Ok(tx.parked_by(&dl.tenant, saga, corr)?.is_some());
            }
            _ => self.input(tx, &raw)?,
        }
        Ok(self.tally.dead_letters.len() > failed_before)
    }
}
