//! Circuit breakers, one per upstream (an effect name), local to the process.
//!
//! Closed: calls go through; `failure_threshold` consecutive failures that say something
//! about the upstream's health (retryable errors, timeouts — not 4xx answers) open it.
//! Open: calls fail at once without touching the upstream, for `open_ms`. Then half-open:
//! one probe call goes through; its success closes the circuit, its failure opens it again.
//! The state of each is the gauge `runner_effect_circuit_state` (0 closed, 1 open,
//! 2 half-open).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus::IntGaugeVec;

use crate::manifest::model::CircuitBreaker;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed,
    Open(Instant),
    HalfOpen,
}

#[derive(Debug)]
struct Entry {
    failures: u32,
    state: State,
}

/// All breakers of the process.
#[derive(Debug)]
pub struct Breakers {
    map: Mutex<HashMap<String, Entry>>,
    gauge: IntGaugeVec,
}

impl Breakers {
    /// Breakers reporting to `gauge` (label `effect`).
    pub fn new(gauge: IntGaugeVec) -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
            gauge,
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut HashMap<String, Entry>) -> R) -> R {
        match self.map.lock() {
            Ok(mut g) => f(&mut g),
            Err(p) => f(&mut p.into_inner()),
        }
    }

    fn show(&self, name: &str, s: State) {
        let v = match s {
            State::Closed => 0,
            State::Open(_) => 1,
            State::HalfOpen => 2,
        };
        self.gauge.with_label_values(&[name]).set(v);
    }

    /// Whether a call to `name` may go out now.
    pub fn allow(&self, name: &str, cfg: Option<&CircuitBreaker>) -> bool {
        let Some(cfg) = cfg else { return true };
        let (ok, state) = self.with(|m| {
            let e = m.entry(name.to_string()).or_insert(Entry {
                failures: 0,
                state: State::Closed,
            });
            match e.state {
                State::Closed => (true, e.state),
                State::Open(since) if since.elapsed() >= Duration::from_millis(cfg.open_ms) => {
                    e.state = State::HalfOpen;
                    (true, e.state)
                }
                // Open, or half-open with its probe already out.
                _ => (false, e.state),
            }
        });
        self.show(name, state);
        ok
    }

    /// Records the outcome of a call that went out. `health_failure`: a failure that says
    /// the upstream is unwell; a success or a fatal answer closes the circuit.
    pub fn record(&self, name: &str, cfg: Option<&CircuitBreaker>, health_failure: bool) {
        let Some(cfg) = cfg else { return };
        let state = self.with(|m| {
            let e = m.entry(name.to_string()).or_insert(Entry {
                failures: 0,
                state: State::Closed,
            });
            if health_failure {
                e.failures = e.failures.saturating_add(1);
                if e.state == State::HalfOpen || e.failures >= cfg.failure_threshold.max(1) {
                    if !matches!(e.state, State::Open(_)) {
                        tracing::warn!(
                            message = "Circuit opened.",
                            effect = name,
                            failures = e.failures
                        );
                    }
                    e.state = State::Open(Instant::now());
                }
            } else {
                if e.state != State::Closed {
                    tracing::info!(message = "Circuit closed.", effect = name);
                }
                e.failures = 0;
                e.state = State::Closed;
            }
            e.state
        });
        self.show(name, state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Opts;

    #[test]
    fn opens_after_threshold_probes_after_open_ms_and_closes_on_success() {
        let g = IntGaugeVec::new(Opts::new("t", "t"), &["effect"]).expect("gauge");
        let b = Breakers::new(g.clone());
        let cfg = CircuitBreaker {
            failure_threshold: 2,
            open_ms: 50,
        };
        assert!(b.allow("x", Some(&cfg)));
        b.record("x", Some(&cfg), true);
        assert!(b.allow("x", Some(&cfg)));
        b.record("x", Some(&cfg), true);
        assert!(!b.allow("x", Some(&cfg)));
        assert_eq!(g.with_label_values(&["x"]).get(), 1);
        std::thread::sleep(Duration::from_millis(60));
        assert!(b.allow("x", Some(&cfg)), "half-open lets one probe out");
        assert!(!b.allow("x", Some(&cfg)), "only one probe");
        b.record("x", Some(&cfg), false);
        assert_eq!(g.with_label_values(&["x"]).get(), 0);
        assert!(b.allow("x", Some(&cfg)));
        assert!(b.allow("other", None));
    }
}
