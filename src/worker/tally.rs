//! [`Tally`]: what applying a batch did, counted while the transaction runs and turned into
//! metrics only after it commits.
//!
//! Guarantee: the counters of `runner_saga_transitions_total`, `runner_deadletters_total`,
//! `runner_saga_unrouted_total` and `runner_tenant_applied_total` move only for committed
//! work. A batch that fails to
//! commit is re-read and counted once, when it does commit.

use crate::storage::tables::OutboxRecord;
use crate::telemetry::Metrics;

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
    /// Body bytes of the outbox records written (what bounds a transaction's outputs).
    pub outbox_bytes: u64,
    /// (tenant, bytes): the size of the outbox records written ([`OutboxRecord::size`]), per
    /// tenant (what its cap on outbox bytes counts).
    ///
    /// [`OutboxRecord::size`]: crate::storage::tables::OutboxRecord::size
    pub outbox_by_tenant: Vec<(String, u64)>,
    /// The outbox records written, with their sequences, in order: handed to the
    /// partition's relay in memory once the transaction is durable (`relay/fresh.rs`).
    pub written: Vec<(u64, OutboxRecord)>,
    /// (tenant, count): inputs applied, per tenant.
    pub applied: Vec<(String, u64)>,
    /// Tenants a control input resumed (partitioned mode): the node forgets their pause
    /// once this commits, even before its watch of the control bucket says so.
    pub resumed: Vec<String>,
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

    /// Counts outbox record `seq`, just written, and keeps it for the relay.
    pub fn wrote(&mut self, seq: u64, rec: OutboxRecord) {
        self.outbox += 1;
        let bytes = rec.size();
        match self
            .outbox_by_tenant
            .iter_mut()
            .find(|(t, _)| *t == rec.tenant)
        {
            Some(e) => e.1 += bytes,
            None => self.outbox_by_tenant.push((rec.tenant.clone(), bytes)),
        }
        self.written.push((seq, rec));
    }

    /// Counts one input of `tenant` applied to an instance.
    pub fn applied_for(&mut self, tenant: &str) {
        match self.applied.iter_mut().find(|(t, _)| t == tenant) {
            Some(e) => e.1 += 1,
            None => self.applied.push((tenant.to_string(), 1)),
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

    /// Adds a committed batch's counts to the metrics. Call only after the commit.
    pub fn record(&self, m: &Metrics, tenancy: &crate::config::TenancyConfig) {
        for (tenant, n) in &self.applied {
            m.tenant_applied
                .with_label_values(&[&crate::fair::label_of(tenancy, tenant)])
                .inc_by(*n);
        }
        for (saga, outcome, n) in &self.transitions {
            m.saga_transitions
                .with_label_values(&[saga.as_str(), outcome])
                .inc_by(*n);
        }
        for k in &self.dead_letters {
            m.deadletters.with_label_values(&[k]).inc();
        }
        m.saga_unrouted.inc_by(self.unrouted);
    }
}
