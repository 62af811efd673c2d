//! The drive of the order flow, shared by the `pipeline` and `cluster` scenarios: orders
//! published at full speed or at a set rate, and every order's first and final outputs
//! watched, on the runner's streams or on the messaging limit's ([`Flow`]).
//!
//! Owns [`drive`] and what it measured ([`Drive`]): latencies from publish to the first
//! output (`charge_card`) and to completion (`OrderFulfilled` stored), and the steady
//! completion rate of an open-loop run ([`steady_rate`]).
//!
//! Guarantees: each order counts once per kind of output, however many outputs of that kind
//! it has; a drive ends when every order completed or after `quiet` with no output, never
//! waiting on an order that is lost.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use async_nats::jetstream;
use futures::StreamExt;
use serde_json::{Value as Json, json};

use crate::{Publisher, event, quantiles, tail};

/// Where a drive sends orders and watches their outputs.
#[derive(Clone)]
pub(crate) enum Flow {
    Runner { tenant: String },
    Limit,
}

impl Flow {
    fn input(&self, id: &str) -> String {
        match self {
            Flow::Runner { tenant } => format!("tenant.{tenant}.aggregate.Order.{id}"),
            Flow::Limit => format!("limit.agg.Order.{id}"),
        }
    }
    fn first_output(&self) -> (&'static str, String) {
        match self {
            Flow::Runner { tenant } => (
                "WORKFLOW_COMMANDS",
                format!("tenant.{tenant}.effect.charge_card.*"),
            ),
            Flow::Limit => ("LIMIT_CMD", "limit.cmd.effect.charge_card.*".into()),
        }
    }
    pub(crate) fn final_output(&self) -> (&'static str, String) {
        match self {
            Flow::Runner { tenant } => (
                "WORKFLOW_EVENTS",
                format!("tenant.{tenant}.workflow_event.order.*"),
            ),
            Flow::Limit => ("LIMIT_EVT", "limit.evt.workflow_event.order.*".into()),
        }
    }
    /// The order a seen output belongs to.
    pub(crate) fn order_of(&self, subject: &str, payload: &[u8], first: bool) -> Option<String> {
        if matches!(self, Flow::Runner { .. }) {
            let v: Json = serde_json::from_slice(payload).ok()?;
            if first {
                // The runner's command subject ends with the command id; the body names
                // the order.
                return v["payload"]["order_id"].as_str().map(str::to_owned);
            }
            // The saga's own end event shares the subject with OrderFulfilled; only the
            // latter is the order's final output (counting both ended a drive at half).
            if v["event_type"] != "OrderFulfilled" {
                return None;
            }
        }
        subject.rsplit('.').next().map(str::to_owned)
    }
}

/// What one drive measured.
pub(crate) struct Drive {
    pub(crate) orders: u64,
    pub(crate) completed: usize,
    pub(crate) elapsed: f64,
    /// Whether the orders were offered at a set rate (open loop).
    paced: bool,
    /// Seconds from the first publish to the last.
    offered_for: f64,
    /// When each order completed, in seconds from the first publish.
    done_at: Vec<f64>,
    first: Vec<f64>,
    done: Vec<f64>,
}

impl Drive {
    pub(crate) fn sagas_per_s(&self) -> f64 {
        self.completed as f64 / self.elapsed
    }
    /// Sagas completed per second while the load was offered, past its first quarter
    /// ([`steady_rate`]): what an open-loop run keeps up with, without the warm-up or the
    /// drain after the last publish.
    pub(crate) fn steady_per_s(&self) -> f64 {
        steady_rate(&self.done_at, self.offered_for)
    }
    /// The `q` quantile in ms of input → saga completed (NaN when none completed).
    pub(crate) fn done_quantile(&mut self, q: f64) -> f64 {
        self.done.sort_by(f64::total_cmp);
        crate::percentile(&self.done, q)
    }
    /// p99 in ms of input → first output and of input → saga completed.
    pub(crate) fn p99s(&mut self) -> (f64, f64) {
        self.first.sort_by(f64::total_cmp);
        self.done.sort_by(f64::total_cmp);
        (
            crate::percentile(&self.first, 0.99),
            crate::percentile(&self.done, 0.99),
        )
    }
    pub(crate) fn line(&mut self, label: &str, transitions: f64) -> String {
        // Only a paced (open-loop) drive has a rate it was offered to keep up with.
        let steady = if self.paced {
            format!(" completed_per_s_while_offered={:.0}", self.steady_per_s())
        } else {
            String::new()
        };
        format!(
            "{label}: orders={} completed={} elapsed={:.2}s transitions_per_s={:.0} sagas_per_s={:.0}{steady} | input->first output stored (charge_card) ms {} | input->saga completed (OrderFulfilled stored) ms {}",
            self.orders,
            self.completed,
            self.elapsed,
            transitions / self.elapsed,
            self.sagas_per_s(),
            quantiles(&mut self.first),
            quantiles(&mut self.done),
        )
    }
}

/// Completions per second in the last three quarters of an offering that lasted
/// `offered_for` seconds, `done_at` holding when each completed (seconds from its start).
/// A system that keeps up completes about as many per second there as were offered; one
/// that falls behind completes fewer. The first quarter is left out so the latency of the
/// first sagas does not count as falling behind, and completions after the last publish
/// (the drain) are left out so a long latency does not either.
pub(crate) fn steady_rate(done_at: &[f64], offered_for: f64) -> f64 {
    let from = offered_for / 4.0;
    let window = offered_for - from;
    if window <= 0.0 {
        return 0.0;
    }
    let n = done_at
        .iter()
        .filter(|t| **t >= from && **t <= offered_for)
        .count();
    n as f64 / window
}

/// Publishes `orders` OrderPlaced events (as fast as acks allow, or at `rate` per second)
/// and waits for every order's first and final outputs, giving up after `quiet` with no
/// output.
pub(crate) async fn drive(
    js: &jetstream::Context,
    flow: &Flow,
    orders: u64,
    rate: f64,
    quiet: Duration,
) -> Result<Drive> {
    let sent: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let mut collectors = Vec::new();
    for first in [true, false] {
        let (stream, filter) = if first {
            flow.first_output()
        } else {
            flow.final_output()
        };
        let mut seen = tail(js, stream, &[filter]).await?;
        let (sent, flow) = (sent.clone(), flow.clone());
        collectors.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(orders as usize);
            let mut ats = Vec::with_capacity(orders as usize);
            let mut last = None;
            let mut counted = std::collections::HashSet::new();
            while (lat.len() as u64) < orders {
                let Ok(Some(m)) = tokio::time::timeout(quiet, seen.next()).await else {
                    break;
                };
                let Some(id) = flow.order_of(&m.subject, &m.payload, first) else {
                    continue;
                };
                // One latency per order, however many outputs of the kind it has.
                if !counted.insert(id.clone()) {
                    continue;
                }
                let t0 = sent.lock().ok().and_then(|s| s.get(&id).copied());
                if let Some(t0) = t0 {
                    lat.push(m.at.duration_since(t0).as_secs_f64() * 1000.0);
                    ats.push(m.at);
                    last = Some(m.at);
                }
            }
            (lat, ats, last)
        }));
    }
    let tenant = match flow {
        Flow::Runner { tenant } => tenant.as_str(),
        Flow::Limit => "limit",
    };
    let mut publisher = Publisher::new(js.clone(), 256);
    let started = Instant::now();
    for i in 0..orders {
        if rate > 0.0 {
            let due = started + Duration::from_secs_f64(i as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        let id = format!("o-{i}");
        let body = event(
            tenant,
            "Order",
            &id,
            "OrderPlaced",
            json!({
                "customer_id": format!("customer-{}", i % 997),
                "amount_cents": 1000 + i % 100,
                "items": [{"sku": "book", "qty": 1}],
            }),
        );
        let msg_id = body["event_id"].as_str().unwrap_or_default().to_string();
        sent.lock()
            .map_err(|_| anyhow::anyhow!("lock"))?
            .insert(id.clone(), Instant::now());
        publisher.send(flow.input(&id), &body, &msg_id).await?;
    }
    publisher.flush().await?;
    let offered_for = started.elapsed().as_secs_f64();
    let (first, _, _) = collectors.remove(0).await?;
    let (done, ats, last) = collectors.remove(0).await?;
    let elapsed = last
        .unwrap_or_else(Instant::now)
        .duration_since(started)
        .as_secs_f64();
    let done_at = ats
        .iter()
        .map(|at| at.duration_since(started).as_secs_f64())
        .collect();
    Ok(Drive {
        orders,
        completed: done.len(),
        elapsed,
        paced: rate > 0.0,
        offered_for,
        done_at,
        first,
        done,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_steady_rate_counts_completions_while_offered_past_the_first_quarter() {
        // 10/s offered for 10 s, each completing 2 s after it was sent: 76 of them land in
        // [2.5 s, 10 s], about 10/s; the 19 after the last publish do not count.
        let lagging: Vec<f64> = (0..100).map(|i| i as f64 / 10.0 + 2.0).collect();
        assert!((steady_rate(&lagging, 10.0) - 76.0 / 7.5).abs() < 1e-9);
        // Falling behind: half as many completions over the same window.
        let behind: Vec<f64> = (0..50).map(|i| i as f64 / 5.0 + 0.1).collect();
        assert!((steady_rate(&behind, 10.0) - 38.0 / 7.5).abs() < 1e-9);
        assert_eq!(steady_rate(&[1.0], 0.0), 0.0);
    }
}
