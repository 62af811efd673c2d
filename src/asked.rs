//! What an operator has asked of this node, held in memory for the components that act on
//! it: the tenants paused now (kept in step with the control bucket by
//! `worker/control.rs`, read by the saga worker per batch) and the partition replays asked
//! for (taken by the partition's consuming loop, `worker/replay.rs`).
//!
//! Guarantee: reads are cheap and never block a writer for long — the paused set is an
//! `Arc` swapped under a lock, so a batch reads one consistent set.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::Notify;

/// The tenants paused now, as this node knows them; cheap to read per batch.
#[derive(Debug, Default)]
pub struct Paused(RwLock<Arc<BTreeSet<String>>>);

impl Paused {
    /// The current set.
    pub fn get(&self) -> Arc<BTreeSet<String>> {
        match self.0.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    fn update(&self, f: impl FnOnce(&mut BTreeSet<String>)) {
        let mut g = self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(Arc::make_mut(&mut g));
    }

    /// Marks `tenant` paused here.
    pub fn insert(&self, tenant: &str) {
        self.update(|s| {
            s.insert(tenant.to_string());
        });
    }

    /// Marks `tenant` resumed here.
    pub fn remove(&self, tenant: &str) {
        self.update(|s| {
            s.remove(tenant);
        });
    }
}

/// Replays asked for and not yet done, by partition.
#[derive(Debug, Default)]
pub struct Replays {
    asked: Mutex<HashMap<u32, u64>>,
    wake: Notify,
}

impl Replays {
    /// Asks the loop of partition `p` to read again from inbox sequence `from`.
    pub fn request(&self, p: u32, from: u64) {
        self.asked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(p, from);
        self.wake.notify_waiters();
    }

    /// The replay asked for partition `p`, if any (taking it).
    pub fn take(&self, p: u32) -> Option<u64> {
        self.asked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&p)
    }

    /// Resolves when a replay is asked for (any partition).
    pub async fn asked(&self) {
        self.wake.notified().await;
    }
}
