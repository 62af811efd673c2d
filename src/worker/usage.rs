//! What each tenant holds on this node's partitions, for the metrics: its running saga
//! instances (`runner_tenant_live_instances`), its pending timers
//! (`runner_tenant_pending_timers`), the bytes of its outputs waiting in the node's outboxes
//! (`runner_tenant_outbox_bytes`, from the relays' counts), the inputs held at its caps on them
//! (`runner_tenant_held_at_cap`) and how long the oldest has been held
//! (`runner_tenant_oldest_held_at_cap_seconds`).
//!
//! Guarantee: every [`EVERY`] the gauges are set from one read transaction of the store, over
//! the partitions the node owns then, with the `tenant` label bounded as for every tenant
//! metric (a tenant `[tenancy]` names, else `other`); a series whose tenant holds nothing any
//! more is set back to 0, not left at its last value. The counts are exact in the store
//! (`storage/tables/live.rs`, `capped.rs`); the gauges lag them by at most [`EVERY`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::fair::label_of;
use crate::runtime::AppState;

/// How often the gauges are set.
const EVERY: Duration = Duration::from_secs(2);

/// Per label: running instances, pending timers, inputs held at a cap, and the oldest held
/// input's age, s.
#[derive(Default)]
struct Row {
    live: u64,
    timers: u64,
    outbox: u64,
    held: u64,
    oldest_s: f64,
}

/// Sets the gauges every [`EVERY`] until `cancel` fires.
pub(crate) async fn run(state: Arc<AppState>, cancel: CancellationToken) {
    let mut shown: BTreeSet<String> = BTreeSet::new();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(EVERY) => {}
        }
        let owned = state.placement.owned();
        let read = state
            .store
            .read(move |t| {
                let mine = |p| owned.contains_key(&p);
                let live = t.counts_by_tenant(mine)?;
                let mut held = BTreeMap::new();
                for (tenant, h) in t.capped_by_tenant(mine)? {
                    // (A row whose letter was applied another way is dropped at the next
                    // release; it has no age.)
                    let since = t
                        .dead_letter(&tenant, h.oldest)?
                        .filter(|d| d.status == crate::storage::tables::DeadLetterStatus::Pending)
                        .map(|d| d.at_ms);
                    held.insert(tenant, (h.inputs, since));
                }
                Ok((live, held))
            })
            .await;
        let (live, held) = match read {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(message = "Cannot read what each tenant holds.", error = %e);
                continue;
            }
        };
        let tenancy = state.limits.get();
        let now = crate::clock::now_ms();
        let mut rows: BTreeMap<String, Row> = BTreeMap::new();
        for (t, n) in state.relays.bytes_by_tenant() {
            rows.entry(label_of(&tenancy, &t)).or_default().outbox += n;
        }
        for (t, n) in live {
            let row = rows.entry(label_of(&tenancy, &t)).or_default();
            row.live += n.live;
            row.timers += n.timers;
        }
        for (t, (n, since)) in held {
            let row = rows.entry(label_of(&tenancy, &t)).or_default();
            row.held += n;
            let age = since.map_or(0.0, |s| now.saturating_sub(s) as f64 / 1000.0);
            row.oldest_s = row.oldest_s.max(age);
        }
        let m = &state.metrics;
        for gone in shown.iter().filter(|l| !rows.contains_key(*l)) {
            m.tenant_live.with_label_values(&[gone]).set(0);
            m.tenant_timers.with_label_values(&[gone]).set(0);
            m.tenant_outbox_bytes.with_label_values(&[gone]).set(0);
            m.tenant_held_at_cap.with_label_values(&[gone]).set(0);
            m.tenant_oldest_held_at_cap
                .with_label_values(&[gone])
                .set(0.0);
        }
        for (label, row) in &rows {
            m.tenant_live
                .with_label_values(&[label])
                .set(i64::try_from(row.live).unwrap_or(i64::MAX));
            m.tenant_timers
                .with_label_values(&[label])
                .set(i64::try_from(row.timers).unwrap_or(i64::MAX));
            m.tenant_outbox_bytes
                .with_label_values(&[label])
                .set(i64::try_from(row.outbox).unwrap_or(i64::MAX));
            m.tenant_held_at_cap
                .with_label_values(&[label])
                .set(i64::try_from(row.held).unwrap_or(i64::MAX));
            m.tenant_oldest_held_at_cap
                .with_label_values(&[label])
                .set(row.oldest_s);
        }
        shown = rows.into_keys().collect();
    }
}
