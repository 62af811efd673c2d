//! What this replica does in partitioned mode, as the rest of the process sees it: its node
//! mode (switchable at run time through the admin API) and the partitions and router
//! sources it holds now, with their epochs.
//!
//! Written only by the ownership task and the routers (`worker/ownership/`,
//! `worker/ownership/router/`) and by the admin API (the mode); read by `/info`, the timer loop and
//! the metrics. It is a report, never the authority: leases in the KV bucket decide who owns
//! what, and fences at the broker enforce it.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use serde::Serialize;
use tokio::sync::watch;

/// What a replica takes part in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeMode {
    /// Routes sources and owns partitions (the default).
    Full,
    /// Routes sources; owns no partition (hands over what it holds).
    RouterOnly,
    /// Neither: hands over every partition and router it holds.
    Disabled,
}

impl NodeMode {
    /// The mode's name in config, the admin API and `/info`.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeMode::Full => "full",
            NodeMode::RouterOnly => "router_only",
            NodeMode::Disabled => "disabled",
        }
    }

    /// Parses a mode name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "full" => Some(NodeMode::Full),
            "router_only" => Some(NodeMode::RouterOnly),
            "disabled" => Some(NodeMode::Disabled),
            _ => None,
        }
    }

    /// Whether this mode owns partitions.
    pub fn owns_partitions(self) -> bool {
        self == NodeMode::Full
    }

    /// Whether this mode routes sources.
    pub fn routes(self) -> bool {
        self != NodeMode::Disabled
    }

    fn code(self) -> u8 {
        self as u8
    }

    fn from_code(c: u8) -> Self {
        match c {
            1 => NodeMode::RouterOnly,
            2 => NodeMode::Disabled,
            _ => NodeMode::Full,
        }
    }
}

/// A partition this replica owns.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct OwnedPartition {
    /// Lease epoch.
    pub epoch: u64,
    /// Wall-clock ms when it was taken.
    pub since_ms: u64,
}

/// This replica's place in partitioned mode.
#[derive(Debug)]
pub struct Placement {
    mode: AtomicU8,
    changed: watch::Sender<NodeMode>,
    owned: Mutex<BTreeMap<u32, OwnedPartition>>,
    routing: Mutex<BTreeMap<String, u64>>,
    /// Replicas owning partitions, as the ownership task last saw them (0 before it looked).
    members: AtomicUsize,
}

impl Default for Placement {
    fn default() -> Self {
        Self {
            mode: AtomicU8::new(NodeMode::Full.code()),
            changed: watch::channel(NodeMode::Full).0,
            owned: Mutex::new(BTreeMap::new()),
            routing: Mutex::new(BTreeMap::new()),
            members: AtomicUsize::new(0),
        }
    }
}

impl Placement {
    /// The node mode now.
    pub fn mode(&self) -> NodeMode {
        NodeMode::from_code(self.mode.load(Ordering::SeqCst))
    }

    /// Switches the node mode; the ownership task and routers act on it within a tick.
    pub fn set_mode(&self, mode: NodeMode) {
        self.mode.store(mode.code(), Ordering::SeqCst);
        self.changed.send_replace(mode);
    }

    /// Wakes when the mode changes.
    pub fn watch_mode(&self) -> watch::Receiver<NodeMode> {
        self.changed.subscribe()
    }

    /// Partitions owned now.
    pub fn owned(&self) -> BTreeMap<u32, OwnedPartition> {
        lock(&self.owned).clone()
    }

    /// Whether partition `p` is owned now.
    pub fn owns(&self, p: u32) -> bool {
        lock(&self.owned).contains_key(&p)
    }

    /// Records that partition `p` is owned under `epoch`.
    pub fn took(&self, p: u32, epoch: u64, since_ms: u64) {
        lock(&self.owned).insert(p, OwnedPartition { epoch, since_ms });
    }

    /// Records that partition `p` is no longer owned.
    pub fn gave_up(&self, p: u32) {
        lock(&self.owned).remove(&p);
    }

    /// How many replicas own partitions, this one counted whether it does or not (at least
    /// 1): what the routers divide their shares by.
    pub fn members(&self) -> usize {
        let seen = self.members.load(Ordering::SeqCst);
        if self.mode().owns_partitions() {
            seen.max(1)
        } else {
            seen + 1
        }
    }

    /// Records how many replicas the ownership task sees owning partitions.
    pub fn set_members(&self, n: usize) {
        self.members.store(n, Ordering::SeqCst);
    }

    /// Router shares held now (`<source>:<share>`), with their epochs.
    pub fn routing(&self) -> BTreeMap<String, u64> {
        lock(&self.routing).clone()
    }

    /// Records whether this replica routes the share named `source` (`Some(epoch)`) or not.
    pub fn set_routing(&self, source: &str, epoch: Option<u64>) {
        let mut g = lock(&self.routing);
        match epoch {
            Some(e) => {
                g.insert(source.to_string(), e);
            }
            None => {
                g.remove(source);
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_round_trip_and_default_to_full() {
        let p = Placement::default();
        assert_eq!(p.mode(), NodeMode::Full);
        for m in [NodeMode::RouterOnly, NodeMode::Disabled, NodeMode::Full] {
            p.set_mode(m);
            assert_eq!(p.mode(), m);
            assert_eq!(NodeMode::parse(m.as_str()), Some(m));
        }
        assert_eq!(NodeMode::parse("half"), None);
    }

    #[test]
    fn owned_partitions_are_recorded_and_removed() {
        let p = Placement::default();
        p.took(3, 17, 1);
        assert!(p.owns(3));
        assert_eq!(p.owned().get(&3).map(|o| o.epoch), Some(17));
        p.gave_up(3);
        assert!(!p.owns(3));
    }
}
