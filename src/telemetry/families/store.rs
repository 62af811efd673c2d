//! The local store: the pages its write transactions dirty and whether its writes fail.

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use super::reg;
use crate::telemetry::Metrics;
use crate::telemetry::names;

/// The `reason` label values of [`names::STORAGE_WRITE_FAILURES_TOTAL`], in the order of
/// [`crate::storage::WriteFailures`]' fields.
const STORAGE_FAILURE_REASONS: [&str; 2] = ["disk_full", "other"];

/// The store's collectors.
pub(in crate::telemetry) struct Storage {
    pub(in crate::telemetry) store_pages_dirtied: IntCounter,
    pub(in crate::telemetry) storage_write_failing: IntGauge,
    pub(in crate::telemetry) storage_write_failures: IntCounterVec,
}

/// Defines and registers in `r` the collectors of [`Storage`].
pub(in crate::telemetry) fn register(r: &Registry) -> prometheus::Result<Storage> {
    let store_pages_dirtied = reg(
        r,
        IntCounter::new(
            names::STORE_PAGES_DIRTIED_TOTAL,
            "Store pages write transactions added or copied for update (about the pages commits write).",
        )?,
    )?;
    let storage_write_failing = reg(
        r,
        IntGauge::new(
            names::STORAGE_WRITE_FAILING,
            "1 while storage writes fail: the last write transaction failed (read at each scrape).",
        )?,
    )?;
    let storage_write_failures = reg(
        r,
        IntCounterVec::new(
            Opts::new(
                names::STORAGE_WRITE_FAILURES_TOTAL,
                "Write transactions failed in libmdbx, by reason (disk_full: ENOSPC on the data directory's disk; other).",
            ),
            &["reason"],
        )?,
    )?;
    for reason in STORAGE_FAILURE_REASONS {
        storage_write_failures
            .with_label_values(&[reason])
            .inc_by(0);
    }
    Ok(Storage {
        store_pages_dirtied,
        storage_write_failing,
        storage_write_failures,
    })
}

/// Upkeep of the store's counters, which follow counts the store keeps itself.
impl Metrics {
    /// Sets [`names::STORAGE_WRITE_FAILING`] and brings [`names::STORAGE_WRITE_FAILURES_TOTAL`]
    /// up to the store's counts (each failure added once, whatever the order of scrapes).
    pub fn storage_writes(&self, failing: bool, failures: crate::storage::WriteFailures) {
        use std::sync::atomic::Ordering;
        self.storage_write_failing.set(i64::from(failing));
        let totals = [failures.disk_full, failures.other];
        for ((reason, total), seen) in STORAGE_FAILURE_REASONS
            .iter()
            .zip(totals)
            .zip(self.storage_failures_seen.iter())
        {
            let before = seen.fetch_max(total, Ordering::SeqCst);
            if total > before {
                self.storage_write_failures
                    .with_label_values(&[reason])
                    .inc_by(total - before);
            }
        }
    }

    /// Brings [`names::STORE_PAGES_DIRTIED_TOTAL`] up to `total`, libmdbx's running count;
    /// scrapes at the same time add each page once.
    pub fn store_pages_dirtied_upto(&self, total: u64) {
        use std::sync::atomic::Ordering;
        let seen = self.store_pages_seen.fetch_max(total, Ordering::SeqCst);
        if total > seen {
            self.store_pages_dirtied.inc_by(total - seen);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_counter_follows_the_store_s_count_once_whatever_the_order_of_scrapes() {
        let m = Metrics::new("0", "r", "saga").expect("registers");
        m.store_pages_dirtied_upto(10);
        m.store_pages_dirtied_upto(7); // a scrape that read earlier, answering later
        assert_eq!(m.store_pages_dirtied.get(), 10);
        m.store_pages_dirtied_upto(15);
        m.store_pages_dirtied_upto(15);
        assert_eq!(m.store_pages_dirtied.get(), 15);
        assert!(m.encode().contains("runner_store_pages_dirtied_total 15"));
    }

    #[test]
    fn storage_write_failures_are_counted_once_by_reason_and_the_gauge_follows_the_store() {
        use crate::storage::WriteFailures;
        let m = Metrics::new("0", "r", "saga").expect("registers");
        let text = m.encode();
        assert!(text.contains("runner_storage_write_failing 0"), "{text}");
        assert!(
            text.contains(r#"runner_storage_write_failures_total{reason="disk_full"} 0"#),
            "both reasons are exported before any failure: {text}"
        );
        let failures = |disk_full, other| WriteFailures { disk_full, other };
        m.storage_writes(true, failures(3, 1));
        m.storage_writes(true, failures(2, 1)); // a scrape that read earlier, answering later
        let text = m.encode();
        assert!(text.contains("runner_storage_write_failing 1"), "{text}");
        assert!(text.contains(r#"runner_storage_write_failures_total{reason="disk_full"} 3"#));
        assert!(text.contains(r#"runner_storage_write_failures_total{reason="other"} 1"#));
        m.storage_writes(false, failures(3, 1));
        assert!(m.encode().contains("runner_storage_write_failing 0"));
    }
}
