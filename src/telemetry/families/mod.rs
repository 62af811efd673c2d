//! The families of metrics, one submodule each: a family is the set of collectors one part
//! of Runner updates (the saga worker, the routers, the relay, the effect workers, partition
//! ownership, …). Each submodule defines its collectors with their names, help texts,
//! labels and buckets, registers them, and returns them for [`Metrics::new`] to hand out;
//! label values known in advance are created at once, so their series read zero rather than
//! missing before the first event.
//!
//! [`Metrics::new`]: super::Metrics::new

use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts, Registry};

pub(super) mod admin;
pub(super) mod effect;
pub(super) mod ownership;
pub(super) mod recovery;
pub(super) mod relay;
pub(super) mod router;
pub(super) mod saga;
pub(super) mod service;
pub(super) mod store;
pub(super) mod tenant;
pub(super) mod timer;

/// The buckets of every latency histogram, in seconds.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
];

/// Registers `c` in `r` and returns it, for the caller to keep.
fn reg<C: prometheus::core::Collector + Clone + 'static>(
    r: &Registry,
    c: C,
) -> prometheus::Result<C> {
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

/// Defines a histogram with `buckets` and registers it in `r`.
fn hist(r: &Registry, name: &str, help: &str, buckets: &[f64]) -> prometheus::Result<Histogram> {
    reg(
        r,
        Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))?,
    )
}

/// Defines a counter with one series per value of `labels` and registers it in `r`.
fn counters(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    reg(r, IntCounterVec::new(Opts::new(name, help), labels)?)
}
