//! The `index` table: saga instances listed by (tenant, saga, state) and by age, without a
//! scan of the `saga` table.
//!
//! Two entries per instance, both with empty values:
//! - by state: `s tenant 0 saga 0 state 0 started_ms(8, big-endian) correlation_id`;
//! - by age: `a tenant 0 saga 0 started_ms(8, big-endian) correlation_id`.
//!
//! Within one (tenant, saga[, state]) prefix the keys are in order of start time, so a
//! listing reads its page in key order and stops at the first instance younger than the
//! `older than` bound: its cost is the page, never the table ([`Tables::list_instances`]).
//! A page's continuation is the position after its last entry, relative to the listing's
//! own prefix, so no cursor can reach another tenant's or saga's entries.
//!
//! Guarantees: the entries are written in the same transaction as the instance
//! ([`Tables::index_instance`], called by `put_instance`) and removed with it (the
//! retention sweep); they are derived data — rebuilt for a partition whose snapshot is
//! imported, and for a whole store written before the index existed
//! ([`Tables::rebuild_index`], run once when the store opens).

use libmdbx::{RW, TransactionKind, WriteFlags};

use super::keys::json;
use super::txn::Tables;
use crate::saga::Instance;
use crate::storage::error::Result;

/// The most entries one page holds.
pub const MAX_PAGE: usize = 1000;

/// The `meta` counter naming the index's layout, so a store from before it is rebuilt.
pub(crate) const INDEX_VERSION_KEY: &str = "instance_index_version";
/// The layout this build writes.
pub(crate) const INDEX_VERSION: u64 = 1;

/// What to list: one tenant's instances of one saga, optionally in one state and started
/// before a time, from a continuation.
#[derive(Debug, Clone, Default)]
pub struct InstanceQuery {
    /// Tenant (required: a listing never spans tenants).
    pub tenant: String,
    /// Saga name.
    pub saga: String,
    /// Only instances in this state.
    pub state: Option<String>,
    /// Only instances started before this time (ms since the epoch).
    pub started_before_ms: Option<u64>,
    /// Where the previous page stopped (its `next`).
    pub after: Option<String>,
    /// Page size (1..=[`MAX_PAGE`]).
    pub limit: usize,
}

/// One page of a listing, oldest first.
#[derive(Debug, Clone, PartialEq)]
pub struct InstancePage {
    /// The instances.
    pub items: Vec<Instance>,
    /// The continuation when more may follow.
    pub next: Option<String>,
}

fn by_state_prefix(tenant: &str, saga: &str, state: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(3 + tenant.len() + saga.len() + state.len());
    k.push(b's');
    for part in [tenant, saga, state] {
        k.extend_from_slice(part.as_bytes());
        k.push(0);
    }
    k
}

fn by_age_prefix(tenant: &str, saga: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(3 + tenant.len() + saga.len());
    k.push(b'a');
    for part in [tenant, saga] {
        k.extend_from_slice(part.as_bytes());
        k.push(0);
    }
    k
}

fn entry(mut prefix: Vec<u8>, started_ms: u64, corr: &str) -> Vec<u8> {
    prefix.extend_from_slice(&started_ms.to_be_bytes());
    prefix.extend_from_slice(corr.as_bytes());
    prefix
}

/// The instance an index key names, `(tenant, saga, correlation_id)`, for snapshots.
pub(crate) fn instance_of_index_key(key: &[u8]) -> Option<[&str; 3]> {
    let (family, rest) = key.split_first()?;
    let fields = match family {
        b's' => 3,
        b'a' => 2,
        _ => return None,
    };
    let mut parts = rest.splitn(fields + 1, |b| *b == 0);
    let tenant = std::str::from_utf8(parts.next()?).ok()?;
    let saga = std::str::from_utf8(parts.next()?).ok()?;
    if fields == 3 {
        parts.next()?;
    }
    let tail = parts.next()?;
    let corr = std::str::from_utf8(tail.get(8..)?).ok()?;
    Some([tenant, saga, corr])
}

/// A continuation as text: the hex of the position within the listing's prefix (also the
/// shape of a dead-letter listing's `next`: [`Tables::walk_dead_letters`]).
pub fn encode_after(suffix: &[u8]) -> String {
    suffix.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `s` can be a continuation (`after`) of a listing; a listing given anything
/// else fails.
pub fn is_continuation(s: &str) -> bool {
    decode_after(s).is_some()
}

/// The position a continuation names; `None` when `s` is not one.
pub fn decode_after(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The fields of a stored instance the index is made of.
#[derive(serde::Deserialize)]
struct Head {
    tenant: String,
    saga: String,
    correlation_id: String,
    state: String,
    started_ms: u64,
}

impl<K: TransactionKind> Tables<'_, K> {
    /// One page of instances matching `q`, oldest first. Reads at most `q.limit + 1` index
    /// entries and `q.limit` instances. A malformed `after` is an error.
    pub fn list_instances(&self, q: &InstanceQuery) -> Result<InstancePage> {
        let limit = q.limit.clamp(1, MAX_PAGE);
        let prefix = match &q.state {
            Some(state) => by_state_prefix(&q.tenant, &q.saga, state),
            None => by_age_prefix(&q.tenant, &q.saga),
        };
        let mut start = prefix.clone();
        if let Some(after) = &q.after {
            let suffix = decode_after(after).ok_or_else(|| {
                crate::storage::error::StorageError::Corrupt(format!(
                    "`{after}` is not a continuation of this listing"
                ))
            })?;
            start.extend_from_slice(&suffix);
            start.push(0); // strictly after it
        }
        let mut cur = self.txn.cursor(&self.index)?;
        let mut items = Vec::new();
        let mut next = None;
        for item in cur.iter_from::<Vec<u8>, Vec<u8>>(&start) {
            let (k, _) = item?;
            let Some(suffix) = k.strip_prefix(prefix.as_slice()) else {
                break;
            };
            let Some(started) = suffix.get(..8) else {
                continue;
            };
            let started = u64::from_be_bytes(started.try_into().unwrap_or([0; 8]));
            if q.started_before_ms.is_some_and(|t| started >= t) {
                break;
            }
            if items.len() == limit {
                next = items.last().map(|i: &Instance| {
                    encode_after(&entry(Vec::new(), i.started_ms, &i.correlation_id))
                });
                break;
            }
            let corr = String::from_utf8_lossy(&suffix[8..]).into_owned();
            if let Some(inst) = self.instance(&q.tenant, &q.saga, &corr)? {
                items.push(inst);
            }
        }
        Ok(InstancePage { items, next })
    }
}

/// Builds the index of a store written before it existed (once: the layout's version is
/// then recorded in `meta`). Runs inside the opening write transaction.
pub(crate) fn build_if_missing(
    txn: &libmdbx::Transaction<'_, RW, libmdbx::NoWriteMap>,
) -> Result<()> {
    let t = Tables::open(txn)?;
    if t.meta(INDEX_VERSION_KEY)? == INDEX_VERSION {
        return Ok(());
    }
    let n = t.rebuild_index(|_| true)?;
    if n > 0 {
        tracing::info!(
            message = "Indexed the stored saga instances.",
            instances = n
        );
    }
    txn.put(
        &t.meta,
        INDEX_VERSION_KEY.as_bytes(),
        INDEX_VERSION.to_be_bytes(),
        WriteFlags::UPSERT,
    )?;
    Ok(())
}

impl Tables<'_, RW> {
    /// Writes `inst`'s index entries; `before` is its state before this write (`None` for a
    /// new instance). Called with every instance write.
    pub(crate) fn index_instance(&self, inst: &Instance, before: Option<&str>) -> Result<()> {
        let (t, s, c) = (&inst.tenant, &inst.saga, &inst.correlation_id);
        if before == Some(inst.state.as_str()) {
            return Ok(());
        }
        if let Some(old) = before {
            let k = entry(by_state_prefix(t, s, old), inst.started_ms, c);
            self.txn.del(&self.index, k, None)?;
        }
        let k = entry(by_state_prefix(t, s, &inst.state), inst.started_ms, c);
        self.txn.put(&self.index, k, [], WriteFlags::UPSERT)?;
        if before.is_none() {
            let k = entry(by_age_prefix(t, s), inst.started_ms, c);
            self.txn.put(&self.index, k, [], WriteFlags::UPSERT)?;
        }
        Ok(())
    }

    /// Removes the index entries of the stored instance `value` (its JSON).
    pub(crate) fn unindex_stored(&self, value: &[u8]) -> Result<()> {
        let h: Head = json(value, "saga instance")?;
        let by_state = entry(
            by_state_prefix(&h.tenant, &h.saga, &h.state),
            h.started_ms,
            &h.correlation_id,
        );
        let by_age = entry(
            by_age_prefix(&h.tenant, &h.saga),
            h.started_ms,
            &h.correlation_id,
        );
        for k in [by_state, by_age] {
            self.txn.del(&self.index, k, None)?;
        }
        Ok(())
    }

    /// Rebuilds the index entries of every instance `keep` accepts (by its tenant, saga
    /// and correlation id) from the `saga` table, after removing theirs. Returns how many
    /// instances were indexed.
    pub(crate) fn rebuild_index(&self, keep: impl Fn([&str; 3]) -> bool) -> Result<usize> {
        let mut doomed = Vec::new();
        {
            let mut cur = self.txn.cursor(&self.index)?;
            for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
                let (k, _) = item?;
                if instance_of_index_key(&k).is_none_or(&keep) {
                    doomed.push(k);
                }
            }
        }
        for k in doomed {
            self.txn.del(&self.index, k, None)?;
        }
        let mut heads = Vec::new();
        {
            let mut cur = self.txn.cursor(&self.saga)?;
            for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
                let (_, v) = item?;
                if v.first() != Some(&b'{') {
                    continue; // a history entry
                }
                let h: Head = json(&v, "saga instance")?;
                if keep([&h.tenant, &h.saga, &h.correlation_id]) {
                    heads.push(h);
                }
            }
        }
        for h in &heads {
            let (t, s, c) = (&h.tenant, &h.saga, &h.correlation_id);
            let k = entry(by_state_prefix(t, s, &h.state), h.started_ms, c);
            self.txn.put(&self.index, k, [], WriteFlags::UPSERT)?;
            let k = entry(by_age_prefix(t, s), h.started_ms, c);
            self.txn.put(&self.index, k, [], WriteFlags::UPSERT)?;
        }
        Ok(heads.len())
    }
}

#[cfg(test)]
mod tests;
