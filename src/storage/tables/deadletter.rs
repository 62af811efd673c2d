//! The `deadletter` and `parked` tables: stored dead letters (`tenant 0 id:u64`, each a
//! [`DeadLetter`] as JSON) and the instance keys parked behind one (`tenant 0 saga 0
//! correlation_id`, holding the id of the dead letter that parked the key).
//!
//! Guarantee: ids come from one counter in `meta`, assigned in the recording transaction,
//! so they increase in the order dead letters were committed and a tenant's entries list
//! oldest first. A listing walks them in that key order from a position
//! ([`Tables::walk_dead_letters`]), reading only what it hands over, never the whole table.
//! The protocol around these rows (what parks a key, how a redrive replays it) is
//! [`crate::deadletter`]'s.

use std::borrow::Cow;

use libmdbx::{RW, TransactionKind, WriteFlags};
use serde::{Deserialize, Serialize};

use super::keys::{DEADLETTER_ID, instance_key, json, to_json, u64_of};
use super::txn::Tables;
use crate::storage::error::Result;

/// Where a dead letter stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterStatus {
    /// Waiting for an operator.
    Pending,
    /// Redriven and processed.
    Redriven,
}

/// A dead-lettered input with its reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// Id, increasing.
    pub id: u64,
    /// Tenant (from the subject; `_` when none could be read).
    pub tenant: String,
    /// Reason class: `undecodable`, `tenant_mismatch`, `unknown_tenant`, `too_large`,
    /// `expression`, `version_not_loaded`, `parked` (held behind an earlier dead letter), ...
    pub kind: String,
    /// What went wrong, for a person.
    pub reason: String,
    /// The original subject.
    pub subject: String,
    /// The input's stream and sequence (`stream:seq`), or `timer` for a timer.
    pub source: String,
    /// The original body as text (lossy if it was not UTF-8), or, when it was longer than
    /// [`crate::deadletter::EXCERPT_BYTES`], its first bytes: see `body_bytes`.
    pub body: String,
    /// The original body's size when `body` is only an excerpt of it; the whole input is
    /// then fetched from its source stream and sequence while the stream keeps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_bytes: Option<u64>,
    /// The original `traceparent`, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The saga instance this concerns, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saga: Option<String>,
    /// The instance key, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    /// How many times it was attempted.
    pub attempts: u32,
    /// When it was dead-lettered, ms since the epoch.
    pub at_ms: u64,
    /// Pending or redriven.
    pub status: DeadLetterStatus,
    /// When the broker stored the input (its JetStream timestamp, for a routed copy its
    /// source's), ms since the epoch, when known: a redrive applies the input's time within
    /// `saga.max_clock_skew` of it, as its first application did. Absent on letters kept
    /// before it was recorded (a redrive then bounds by `at_ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_ms: Option<u64>,
    /// On an input held whole (kinds `tenant_capped`, `tenant_paused`): the cap on its
    /// tenant's running instances it came with, which it is measured by when applied later
    /// (`worker/cap.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live_cap: Option<u64>,
    /// Likewise, the cap on its tenant's pending timers it came with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timer_cap: Option<u64>,
}

#[cfg(test)]
impl DeadLetter {
    /// A pending letter of tenant `acme` for tests: of kind `kind`, naming instance
    /// `order`/`corr` when given (id assigned when pushed).
    pub(crate) fn sample(corr: Option<&str>, kind: &str) -> Self {
        Self {
            id: 0,
            tenant: "acme".into(),
            kind: kind.into(),
            reason: "test".into(),
            subject: "tenant.acme.x".into(),
            source: "S:1".into(),
            body: "{}".into(),
            body_bytes: None,
            traceparent: None,
            saga: corr.map(|_| "order".to_string()),
            correlation_id: corr.map(str::to_string),
            attempts: 1,
            at_ms: 5,
            status: DeadLetterStatus::Pending,
            stored_ms: None,
            live_cap: None,
            timer_cap: None,
        }
    }
}

fn deadletter_key(tenant: &str, id: u64) -> Vec<u8> {
    let mut k = tenant.as_bytes().to_vec();
    k.push(0);
    k.extend_from_slice(&id.to_be_bytes());
    k
}

impl<K: TransactionKind> Tables<'_, K> {
    /// One dead letter.
    pub fn dead_letter(&self, tenant: &str, id: u64) -> Result<Option<DeadLetter>> {
        let v: Option<Vec<u8>> = self.txn.get(&self.deadletter, deadletter_key(tenant, id))?;
        v.map(|b| json(&b, "dead letter")).transpose()
    }

    /// Walks the stored dead letters in key order — one tenant's, oldest first, or every
    /// tenant's, by tenant then id — starting strictly after `after`, a position this walk
    /// handed out earlier. `visit` gets each letter's position (relative to the tenant's
    /// entries when `tenant` is given, so no position reaches another tenant's) and its
    /// stored bytes, borrowed from the store, and returns whether to go on. Returns `true`
    /// when the letters ran out, `false` when `visit` stopped the walk. Reads nothing it
    /// does not hand to `visit`, beyond the one key that ends a tenant's entries.
    pub fn walk_dead_letters(
        &self,
        tenant: Option<&str>,
        after: Option<&[u8]>,
        mut visit: impl FnMut(&[u8], &[u8]) -> Result<bool>,
    ) -> Result<bool> {
        let mut prefix = Vec::new();
        if let Some(t) = tenant {
            prefix.extend_from_slice(t.as_bytes());
            prefix.push(0);
        }
        let mut start = prefix.clone();
        if let Some(a) = after {
            start.extend_from_slice(a);
            start.push(0); // strictly after it
        }
        let mut cur = self.txn.cursor(&self.deadletter)?;
        for item in cur.iter_from::<Cow<'_, [u8]>, Cow<'_, [u8]>>(&start) {
            let (k, v) = item?;
            let Some(position) = k.strip_prefix(prefix.as_slice()) else {
                return Ok(true);
            };
            if !visit(position, &v)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Every dead letter, by tenant then id: the whole table in memory, for the protocol's
    /// own passes (purge, release) and tests. The operator's listings page with
    /// [`Tables::walk_dead_letters`] instead.
    pub fn dead_letters(&self) -> Result<Vec<DeadLetter>> {
        let mut cur = self.txn.cursor(&self.deadletter)?;
        let mut out = Vec::new();
        for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
            let (_, v) = item?;
            out.push(json(&v, "dead letter")?);
        }
        Ok(out)
    }

    /// The dead letter that parked an instance key, if parked.
    pub fn parked_by(&self, tenant: &str, saga: &str, corr: &str) -> Result<Option<u64>> {
        let v: Option<Vec<u8>> = self
            .txn
            .get(&self.parked, instance_key(tenant, saga, corr))?;
        v.map(|b| u64_of(&b, "parked")).transpose()
    }
}

impl Tables<'_, RW> {
    /// Stores a new dead letter, assigning its id.
    pub fn push_dead_letter(&self, mut dl: DeadLetter) -> Result<DeadLetter> {
        let id = self.meta(DEADLETTER_ID)? + 1;
        self.txn.put(
            &self.meta,
            DEADLETTER_ID.as_bytes(),
            id.to_be_bytes(),
            WriteFlags::UPSERT,
        )?;
        dl.id = id;
        self.put_dead_letter(&dl)?;
        Ok(dl)
    }

    /// Rewrites a dead letter (status change).
    pub fn put_dead_letter(&self, dl: &DeadLetter) -> Result<()> {
        Ok(self.txn.put(
            &self.deadletter,
            deadletter_key(&dl.tenant, dl.id),
            to_json(dl)?,
            WriteFlags::UPSERT,
        )?)
    }

    /// Parks an instance key behind dead letter `id`.
    pub fn park(&self, tenant: &str, saga: &str, corr: &str, id: u64) -> Result<()> {
        let key = instance_key(tenant, saga, corr);
        Ok(self
            .txn
            .put(&self.parked, key, id.to_be_bytes(), WriteFlags::UPSERT)?)
    }

    /// Unparks an instance key.
    pub fn unpark(&self, tenant: &str, saga: &str, corr: &str) -> Result<()> {
        self.txn
            .del(&self.parked, instance_key(tenant, saga, corr), None)?;
        Ok(())
    }

    /// Removes a dead letter (the caller decides whether it may go: see
    /// [`Tables::parks_its_key`]).
    pub fn delete_dead_letter(&self, tenant: &str, id: u64) -> Result<()> {
        self.txn
            .del(&self.deadletter, deadletter_key(tenant, id), None)?;
        Ok(())
    }
}

impl<K: TransactionKind> Tables<'_, K> {
    /// Whether `dl` is the pending dead letter its instance key is parked behind: removing
    /// it would leave the key parked with nothing to redrive.
    pub fn parks_its_key(&self, dl: &DeadLetter) -> Result<bool> {
        let (Some(saga), Some(corr)) = (&dl.saga, &dl.correlation_id) else {
            return Ok(false);
        };
        Ok(dl.status == DeadLetterStatus::Pending
            && self.parked_by(&dl.tenant, saga, corr)? == Some(dl.id))
    }
}
