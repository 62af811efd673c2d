//! Stalled stages: the parts of the saga pipeline that move records on (the relays, the
//! routers) report here when a send fails and when one succeeds, so `/health` can say that a
//! node is stuck although it is connected and its store answers.
//!
//! Guarantee: a stage that has failed on every attempt, with none succeeding, for at least
//! [`STALLED_AFTER`] is listed by [`Stalls::stalled`] (and counted by
//! `runner_pipeline_stalled_stages` at each scrape) until its next success or until it stops
//! (a drained partition's relay, a router that lost its lease: [`Stalls::gone`]). The
//! record is in memory only: a restart starts with nothing stalled, and a stage that is
//! still stuck is listed again after [`STALLED_AFTER`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a stage must fail without a success to count as stalled: longer than the
/// leader elections and reconnects a healthy cluster goes through (a few seconds each).
pub const STALLED_AFTER: Duration = Duration::from_secs(30);

/// Since when each failing stage has failed, by stage name (`relay`, `relay.p<N>`,
/// `router.<stream>`).
#[derive(Debug, Default)]
pub struct Stalls {
    failing: Mutex<HashMap<String, (Instant, String)>>,
}

impl Stalls {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Instant, String)>> {
        match self.failing.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// `stage` failed with `why`; the episode starts now unless one is under way. True when
    /// it starts now (a caller logs once per episode, not once per try).
    pub fn failed(&self, stage: &str, why: impl std::fmt::Display) -> bool {
        let mut m = self.map();
        match m.get_mut(stage) {
            Some((_, last)) => {
                *last = why.to_string();
                false
            }
            None => {
                m.insert(stage.to_string(), (Instant::now(), why.to_string()));
                true
            }
        }
    }

    /// `stage` moved records on: its episode, if any, is over.
    pub fn progressed(&self, stage: &str) {
        let mut m = self.map();
        if !m.is_empty() {
            m.remove(stage);
        }
    }

    /// `stage` stopped (it no longer owns its work): forget it.
    pub fn gone(&self, stage: &str) {
        self.progressed(stage);
    }

    /// The stages failing for at least `after`: name, how long, the last failure.
    pub fn stalled(&self, after: Duration) -> Vec<(String, Duration, String)> {
        let mut out: Vec<_> = self
            .map()
            .iter()
            .map(|(k, (since, why))| (k.clone(), since.elapsed(), why.clone()))
            .filter(|(_, d, _)| *d >= after)
            .collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_is_stalled_from_its_first_failure_until_it_progresses() {
        let s = Stalls::default();
        s.failed("relay", "max payload");
        std::thread::sleep(Duration::from_millis(20));
        s.failed("relay", "again");
        s.failed("router.AGG", "timeout");
        let stalled = s.stalled(Duration::from_millis(15));
        assert_eq!(stalled.len(), 1, "{stalled:?}");
        assert_eq!(stalled[0].0, "relay");
        assert_eq!(stalled[0].2, "again");
        assert_eq!(s.stalled(Duration::ZERO).len(), 2);
        s.progressed("relay");
        s.gone("router.AGG");
        assert!(s.stalled(Duration::ZERO).is_empty());
    }
}
