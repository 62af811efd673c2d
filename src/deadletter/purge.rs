//! Purging dead letters: removing the ones a filter selects, in one write transaction,
//! without ever leaving a key parked behind a letter that is gone (unless forced, which
//! unparks it).

use super::{DeadLetter, DeadLetterError, DeadLetterStatus};
use crate::storage::Store;

/// Which dead letters a purge removes.
#[derive(Debug, Clone, Default)]
pub struct Purge {
    /// Only this tenant's.
    pub tenant: Option<String>,
    /// Only those recorded before this time (ms since the epoch).
    pub before_ms: Option<u64>,
    /// Only this kind.
    pub kind: Option<String>,
    /// Also remove pending entries that park their key (the key is unparked; inputs held
    /// behind it stay as pending entries of their own).
    pub force: bool,
    /// Report what would go, remove nothing.
    pub dry_run: bool,
}

/// Removes the dead letters `p` selects, in one write transaction, and returns them. A
/// pending entry its key is parked behind is kept unless `force`: removing it would leave
/// the key parked with nothing to redrive. The retention sweep uses this too, with
/// `saga.dead_letter_retention`.
pub fn purge(store: &Store, p: &Purge) -> Result<Vec<DeadLetter>, DeadLetterError> {
    let p = p.clone();
    let p_dry_run = p.dry_run;
    // Counted as a change the partitions' snapshots must be retaken for only when it
    // removed something (the sweep calls this every minute).
    let gone = store.write_logged_blocking(move |t| {
        let mut removed = Vec::new();
        for d in t.dead_letters()? {
            let selected = p.tenant.as_ref().is_none_or(|x| *x == d.tenant)
                && p.before_ms.is_none_or(|b| d.at_ms < b)
                && p.kind.as_ref().is_none_or(|k| *k == d.kind);
            if !selected {
                continue;
            }
            let parks = t.parks_its_key(&d)?;
            // A pending input held behind its key's first letter (parked, or held while its
            // tenant is paused) is as needed as the first: it is applied when that is.
            let held = d.status == DeadLetterStatus::Pending
                && match (&d.saga, &d.correlation_id) {
                    (Some(saga), Some(corr)) => t.parked_by(&d.tenant, saga, corr)?.is_some(),
                    _ => false,
                };
            if (parks || held) && !p.force {
                continue;
            }
            if !p.dry_run {
                if parks && let (Some(saga), Some(corr)) = (&d.saga, &d.correlation_id) {
                    t.unpark(&d.tenant, saga, corr)?;
                }
                t.delete_dead_letter(&d.tenant, d.id)?;
            }
            removed.push(d);
        }
        Ok(removed)
    })?;
    if !gone.is_empty() && !p_dry_run {
        store.note_unlogged();
    }
    Ok(gone)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StorageConfig;

    #[test]
    fn a_purge_counts_as_an_unlogged_write_only_when_it_removed_something() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = StorageConfig {
            data_dir: dir.path().to_path_buf(),
            ..StorageConfig::default()
        };
        let store = Store::open(&cfg).expect("opens");
        let letter = DeadLetter::sample(None, "undecodable");
        store
            .write_blocking(|t| t.push_dead_letter(letter).map(drop))
            .expect("letter");
        let start = store.unlogged_writes();
        let nobody = Purge {
            tenant: Some("nobody".into()),
            ..Default::default()
        };
        assert!(purge(&store, &nobody).expect("purge").is_empty());
        let dry = Purge {
            dry_run: true,
            ..Default::default()
        };
        assert_eq!(purge(&store, &dry).expect("dry run").len(), 1);
        assert_eq!(
            store.unlogged_writes(),
            start,
            "nothing removed, nothing counted"
        );
        assert_eq!(purge(&store, &Purge::default()).expect("purge").len(), 1);
        assert_eq!(store.unlogged_writes(), start + 1);
    }
}
