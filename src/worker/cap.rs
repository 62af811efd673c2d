//! Caps per tenant on running instances (`tenancy.live_instance_caps`) and on pending
//! timers (`tenancy.pending_timer_caps`): an input that would start one more instance of a
//! tenant at either cap is held whole, and applied when the tenant is under both again.
//!
//! **Where a cap is decided.** In the commit of the partition that owns the new instance's
//! key, from that partition's own state and log, so every owner that applies the same inputs
//! decides the same way (a successor replaying the inbox holds exactly what its predecessor
//! held, and its fenced relay's watermark never hides an output the predecessor did not
//! publish):
//! - the caps an input is measured by travel with it: its router stamps the caps in force
//!   on the copy (headers `Runner-Live-Cap`, `Runner-Timer-Cap`), so a cap reloaded later
//!   applies to inputs copied later, and a replay reads the same stamps;
//! - each of the P partitions lets the tenant reach at most its part of a cap,
//!   ⌈cap ÷ P⌉ ([`allowance`]), counted exactly in the store (`storage/tables/live.rs`).
//!   The deployment therefore runs at most P·⌈cap ÷ P⌉ of the tenant's instances: within
//!   P − 1 of the cap, and P for a cap below P (each partition lets one run). A tenant whose
//!   keys spread over the partitions gets close to the cap before any input is held.
//! - **Only starts are held.** The timer cap holds new instances, never a running one's
//!   inputs: a running instance held for its own timers could wait on the very timers that
//!   would free room. Running instances may therefore set timers past the cap; the tenant
//!   starts nothing new until enough of them fire or are cancelled.
//!
//! **What holding does.** The input is kept whole as a letter of kind `tenant_capped` that
//! parks its key, and the key joins the partition's queue for the tenant
//! (`storage/tables/capped.rs`). Every later input of that key is held whole behind it, so
//! the key's order is kept; other keys of the tenant, and other tenants, go on. A held input
//! is counted as `runner_saga_transitions_total{outcome="held"}` and shown per tenant by
//! `GET /admin/tenants` (`held_at_cap`). Nothing is dropped or failed.
//!
//! **Release.** When one of the tenant's instances in the partition ends, or one of its
//! timers there fires or is cancelled, the oldest held key is applied, its inputs in
//! arrival order, while the tenant is under the allowances of the caps that key came with.
//! An input that would start an instance first releases what the caps it came with let go
//! (a raised cap), so held keys go before newer ones; at most [`MOST_PER_RELEASE`] keys per
//! input. A cap removed lets no held key in at once: they go as the tenant's instances end
//! and timers fire (to let them in sooner, raise the cap first). A paused tenant's held keys
//! wait for its resume, which releases them.
//! Every other way an input is applied again (an operator's redrive, a resume's release) is
//! measured against the caps like a new input: a start over one is held again, and the
//! inputs of its key behind it with it.

use libmdbx::RW;

use super::admission::{Caps, RawInput};
use super::pause::{self, Held};
use crate::deadletter::{self, DeadLetterError, Reapply, kind};
use crate::saga::Route;
use crate::storage::tables::{Counted, DeadLetterStatus};
use crate::storage::{Result, Tables};

/// Most held keys one release applies: a cap removed or raised far lets the rest go at the
/// tenant's next inputs and ends, so one input's transaction stays bounded.
pub const MOST_PER_RELEASE: usize = 64;

/// Running instances a tenant with cap `cap` may have in each of `partitions` partitions:
/// ⌈cap ÷ partitions⌉, at least 1.
pub fn allowance(cap: u64, partitions: u32) -> u64 {
    cap.div_ceil(u64::from(partitions.max(1))).max(1)
}

/// The partition being applied: which, and of how many.
#[derive(Debug, Clone, Copy)]
pub struct Place {
    /// The partition.
    pub partition: u32,
    /// P.
    pub partitions: u32,
}

/// A cap a tenant has reached in a partition, with its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reached {
    /// As many running instances as the partition's part of this cap.
    Live(u64),
    /// As many pending timers as the partition's part of this cap.
    Timers(u64),
}

/// The first of `caps` that `tenant` has reached in `place`, if any.
fn reached(tx: &Tables<'_, RW>, tenant: &str, place: Place, caps: Caps) -> Result<Option<Reached>> {
    let at = |cap: u64, what| -> Result<bool> {
        Ok(tx.counted(tenant, place.partition, what)? >= allowance(cap, place.partitions))
    };
    if let Some(cap) = caps.live
        && at(cap, Counted::Live)?
    {
        return Ok(Some(Reached::Live(cap)));
    }
    if let Some(cap) = caps.timers
        && at(cap, Counted::Timers)?
    {
        return Ok(Some(Reached::Timers(cap)));
    }
    Ok(None)
}

/// Whether an input of `tenant` that starts an instance in `place` goes on, measured by the
/// caps `caps` it came with. With `release`, lets go first what those caps allow of the
/// held keys, oldest first, through `worker`. An input that came with no cap goes on and
/// releases nothing: it may be of a tenant without a cap, or one applied again from a
/// letter that kept none.
pub fn admits(
    tx: &Tables<'_, RW>,
    tenant: &str,
    place: Place,
    caps: Caps,
    release_first: bool,
    worker: &mut impl Reapply,
) -> Result<bool> {
    if caps.none() {
        return Ok(true);
    }
    if release_first {
        release(tx, tenant, place, Some(caps), worker)?;
    }
    Ok(reached(tx, tenant, place, caps)?.is_none())
}

/// Holds `raw`, which would start an instance of `tenant` at `route` over one of its caps
/// `caps`: a `tenant_capped` letter that parks the key, queued for release.
pub fn hold(
    tx: &Tables<'_, RW>,
    raw: &RawInput,
    tenant: &str,
    route: &Route,
    place: Place,
    caps: Caps,
    at_ms: u64,
) -> Result<()> {
    let (p, part) = (place.partition, |cap| allowance(cap, place.partitions));
    let reason = match reached(tx, tenant, place, caps)? {
        Some(Reached::Live(cap)) => format!(
            "tenant `{tenant}` runs its cap of {cap} instances (at most {} in partition {p}); \
             held until one of them ends",
            part(cap)
        ),
        Some(Reached::Timers(cap)) => format!(
            "tenant `{tenant}` has its cap of {cap} timers pending (at most {} in partition \
             {p}); held until one of them fires or is cancelled",
            part(cap)
        ),
        // Held again as it was (a release behind a key held anew): its caps decide later.
        None => format!("tenant `{tenant}` was at a cap in partition {p}; held in order"),
    };
    let why = Held {
        kind: kind::TENANT_CAPPED,
        reason,
        caps,
    };
    let parked = tx
        .parked_by(tenant, &route.saga, &route.correlation_id)?
        .is_some();
    let first = pause::hold_as(tx, raw, tenant, route, at_ms, why)?;
    if !parked {
        tx.push_capped(tenant, place.partition, first)?;
    }
    // (A key parked by a failure keeps this input behind that letter, for its operator's
    // redrive: queued here it would be released out of its order.)
    Ok(())
}

/// Whether the letter `first` that parks a key of `tenant` holds it at a cap (so a later
/// input of the key is held whole behind it: [`hold_behind`]).
pub fn parks(tx: &Tables<'_, RW>, tenant: &str, first: u64) -> Result<bool> {
    Ok(tx
        .dead_letter(tenant, first)?
        .is_some_and(|d| d.kind == kind::TENANT_CAPPED && d.status == DeadLetterStatus::Pending))
}

/// Holds `raw` whole behind the key parked at a cap by letter `first`.
pub fn hold_behind(
    tx: &Tables<'_, RW>,
    raw: &RawInput,
    tenant: &str,
    route: &Route,
    place: Place,
    first: u64,
    at_ms: u64,
) -> Result<()> {
    let why = Held {
        kind: kind::TENANT_CAPPED,
        reason: format!("held behind letter {first}, an input held at the tenant's cap"),
        caps: Caps::default(),
    };
    let id = pause::hold_as(tx, raw, tenant, route, at_ms, why)?;
    tx.behind_capped(tenant, place.partition, first, id)?;
    Ok(())
}

/// Applies `tenant`'s held keys in `place`, oldest first, while it is under the
/// allowances of `caps` and, for a cap `caps` does not set, of the one each key came with;
/// returns the keys applied.
pub fn release(
    tx: &Tables<'_, RW>,
    tenant: &str,
    place: Place,
    caps: Option<Caps>,
    worker: &mut impl Reapply,
) -> Result<usize> {
    let mut released = 0;
    while released < MOST_PER_RELEASE
        && let Some(key) = tx.oldest_capped(tenant, place.partition)?
    {
        let first = tx
            .dead_letter(tenant, key.first)?
            .filter(|d| d.status == DeadLetterStatus::Pending);
        let Some(first) = first else {
            // Released another way (an operator's redrive): nothing left to hold.
            tx.drop_capped(tenant, place.partition, key.first)?;
            continue;
        };
        // A cap the releasing input came without (removed since) is the key's own.
        let caps = caps.map_or(Caps::kept(&first), |c| c.or(Caps::kept(&first)));
        if reached(tx, tenant, place, caps)?.is_some() {
            break;
        }
        let mut letters = vec![first];
        for id in key.behind {
            if let Some(d) = tx
                .dead_letter(tenant, id)?
                .filter(|d| d.status == DeadLetterStatus::Pending)
            {
                letters.push(d);
            }
        }
        tx.drop_capped(tenant, place.partition, key.first)?;
        match deadletter::replay_key(tx, letters, worker)? {
            Ok(_) => released += 1,
            // Held inputs are kept whole, so this cannot be; were it so, the key stays
            // parked for its operator rather than be applied in part.
            Err(DeadLetterError::Storage(e)) => return Err(e),
            Err(e) => {
                tracing::warn!(message = "A key held at its tenant's cap was left parked.", tenant = %tenant, error = %e)
            }
        }
    }
    Ok(released)
}

#[cfg(test)]
mod tests {
    use super::allowance;

    #[test]
    fn each_partition_runs_its_part_of_the_cap_rounded_up() {
        assert_eq!(allowance(10, 1), 10);
        assert_eq!(allowance(10, 4), 3);
        assert_eq!(allowance(8, 4), 2);
        assert_eq!(allowance(1, 64), 1);
        assert_eq!(allowance(1000, 64), 16);
        assert_eq!(allowance(5, 0), 5);
    }
}
