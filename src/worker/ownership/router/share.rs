//! Router shares: each source stream is routed as [`SHARES`] shares, each under a lease and
//! a fence of its own, so routing is spread over the replicas and a router that dies stalls
//! only its share, for about one lease TTL.
//!
//! **The split.** A message belongs to share `FNV-1a-32(subject) mod SHARES`
//! ([`share_of`]). Every message of one subject — one aggregate — is in one share, so a
//! share's router copies an aggregate's inputs in the order the source stored them. Inputs
//! of different aggregates that reach one saga instance go through different shares: the
//! inbox stores them in the order their routers delivered them, and every later owner of
//! the partition applies them in that stored order.
//!
//! **Progress.** Each share reads the whole source and copies its own messages; its fence
//! marker records the last source sequence it has handled, its own messages and the others'
//! alike. A marker covering only other shares' messages is written when the share has been
//! idle a moment or after [`SKIPPED_MARK_EVERY`] of them, so the fence never trails the
//! source by much and a restarted share rereads little.
//!
//! **From one router per source.** A share with no marker of its own starts after the
//! marker of the source's former single router (fence key `<source>`, which the in-place
//! upgrade also writes), so nothing that router copied is copied again. While a replica of
//! an earlier release still holds that router's lease, no share of the source is routed
//! here.
//!
//! **Spread.** A replica takes a free share only while it routes fewer than its quota,
//! ⌈shares of every source ÷ members⌉; one above its quota gives back its last share
//! (releasing the lease), which a replica below quota takes within a third of a TTL.
//!
//! **Admission.** Each share of the aggregate stream lets in at most its part
//! (⌈room ÷ [`SHARES`]⌉) of the room under `saga.max_queued_work`, so the shares together
//! stay near the bound.

use std::fmt;

use crate::placement::Placement;
use crate::worker::consume::Source;
use crate::worker::partition::partition;

/// Shares per source stream. Fixed: the fences and the split depend on it, so changing it
/// would move messages between shares.
pub const SHARES: u32 = 4;

/// A share's markers covering only other shares' messages are written at least this many
/// source sequences apart.
pub(super) const SKIPPED_MARK_EVERY: u64 = 1000;

/// The share of the message published on `subject`.
pub fn share_of(subject: &str) -> u32 {
    partition(subject, "", "", SHARES)
}

/// One share of one source.
#[derive(Debug, Clone)]
pub struct Share {
    /// The source stream and its filters.
    pub source: Source,
    /// Which share, in `0..SHARES`.
    pub index: u32,
}

impl Share {
    /// Every share of `source`.
    pub fn all(source: &Source) -> Vec<Share> {
        (0..SHARES)
            .map(|index| Share {
                source: source.clone(),
                index,
            })
            .collect()
    }

    /// Whether the message published on `subject` is this share's.
    pub fn holds(&self, subject: &str) -> bool {
        share_of(subject) == self.index
    }

    /// Its lease key in the leases bucket.
    pub fn lease_key(&self) -> String {
        format!("r.{self}")
    }

    /// The source stream's name.
    pub fn stream(&self) -> &str {
        &self.source.stream
    }
}

/// `<source>/<index>`: the share's name in logs, `/info`, its fence key (one subject token,
/// since stream names hold no dot; nor a slash, so no stream is named like a share) and its
/// stalled stage. Every character is one a KV key may hold.
impl fmt::Display for Share {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.source.stream, self.index)
    }
}

/// The most shares one replica routes while `members` replicas own partitions (a replica
/// that owns none, router-only, counts itself when it is not among them).
pub(super) fn quota(placement: &Placement, sources: usize) -> usize {
    let total = sources * SHARES as usize;
    let members = placement.members().max(1);
    total.div_ceil(members)
}

/// Whether this replica may take one more share now.
pub(super) fn may_take(placement: &Placement, sources: usize) -> bool {
    placement.routing().len() < quota(placement, sources)
}

/// Whether `share` should be given back: this replica routes more than its quota and
/// `share` is the last (by name) of those it routes.
pub(super) fn give_back(placement: &Placement, sources: usize, share: &Share) -> bool {
    let routing = placement.routing();
    routing.len() > quota(placement, sources)
        && routing.keys().next_back() == Some(&share.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source() -> Source {
        Source {
            stream: "AGG".into(),
            filters: vec!["tenant.*.aggregate.>".into()],
        }
    }

    #[test]
    fn one_subject_is_always_in_one_share_and_shares_are_used_evenly() {
        let mut counts = [0u32; SHARES as usize];
        for i in 0..4000 {
            let subject = format!("tenant.t.aggregate.Order.o-{i}");
            let s = share_of(&subject);
            assert_eq!(s, share_of(&subject));
            counts[s as usize] += 1;
        }
        // 1000 expected in each; a fair hash stays well within a quarter of it.
        assert!(counts.iter().all(|c| (750..1250).contains(c)), "{counts:?}");
    }

    #[test]
    fn a_share_holds_exactly_its_subjects_and_is_named_by_source_and_index() {
        let shares = Share::all(&source());
        assert_eq!(shares.len(), SHARES as usize);
        let subject = "tenant.t.aggregate.Order.o-1";
        assert_eq!(shares.iter().filter(|s| s.holds(subject)).count(), 1);
        assert_eq!(shares[2].to_string(), "AGG/2");
        assert_eq!(shares[2].lease_key(), "r.AGG/2");
    }

    #[test]
    fn the_quota_spreads_every_share_over_the_members_and_the_last_goes_back() {
        let p = Placement::default();
        // Two sources of four shares: alone, a replica routes all eight.
        assert_eq!(quota(&p, 2), 8);
        p.set_members(3);
        assert_eq!(quota(&p, 2), 3);
        let shares = Share::all(&source());
        for s in &shares {
            p.set_routing(&s.to_string(), Some(1));
        }
        assert!(!may_take(&p, 2));
        // Four held, quota three: only the last by name goes back.
        assert!(give_back(&p, 2, &shares[3]));
        assert!(!give_back(&p, 2, &shares[0]));
        p.set_routing(&shares[3].to_string(), None);
        assert!(!give_back(&p, 2, &shares[2]));
    }
}
