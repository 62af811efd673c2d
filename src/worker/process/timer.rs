//! Timer firings: a due timer applied to its saga instance like an input.
//!
//! A due timer is published into its partition's inbox (`timers.rs`) and applied from there,
//! in log order, so it replays like any input. Guarantees kept here: a firing whose timer
//! is no longer pending (cancelled, or fired by an earlier copy of the message) is ignored,
//! so a cancelled timer never fires; the schedule entry is deleted in the transaction that
//! applies the firing; the firing's time is the timer's due time, which the engine computed,
//! so replays stay deterministic.

use libmdbx::RW;

use super::{Processor, RawInput};
use crate::saga::{Input, Route};
use crate::storage::tables::TimerEntry;
use crate::storage::{Result, Tables};

impl Processor<'_> {
    /// Applies a timer firing read from the partition's inbox (partitioned mode: a due
    /// timer is published into the inbox and applied from there, so it has a place in the
    /// partition's log and replays like any input). Its body is the [`TimerEntry`]; a timer
    /// no longer pending (cancelled, or fired by an earlier copy of this message) is ignored.
    pub fn fired_timer(&mut self, tx: &Tables<'_, RW>, raw: &RawInput) -> Result<()> {
        let Ok(t) = serde_json::from_slice::<TimerEntry>(&raw.body) else {
            tracing::warn!(message = "Unreadable timer firing ignored.", source = %raw.source);
            return Ok(());
        };
        if !tx.timer_pending(&t)? {
            self.tally.note(&t.saga, "ignored");
            return Ok(());
        }
        self.timer(tx, &t)
    }

    /// Applies a due timer and removes its schedule entry.
    pub fn timer(&mut self, tx: &Tables<'_, RW>, t: &TimerEntry) -> Result<()> {
        let span = tracing::debug_span!("saga_input", tenant = %t.tenant, source = "timer");
        let _entered = span.enter();
        if tx.delete_timer(t)? {
            tx.count_timers(&t.tenant, self.scope.partition, 0, 1)?;
            // One timer fewer pending: a key held at its tenant's timer cap may go.
            self.freed.push(t.tenant.clone());
        }
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
            live_cap: None,
            timer_cap: None,
            source: "timer".into(),
            stored_ms: None, // its time is its due time, which the engine computed
        };
        let route = Route {
            saga: t.saga.clone(),
            correlation_id: t.correlation_id.clone(),
        };
        self.route(tx, &raw, &t.tenant, &input, &route, false)
    }
}
