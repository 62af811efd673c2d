//! Fair turns across tenants: work read but not yet started, in one first-in first-out
//! lane per tenant, and which of it goes next.
//!
//! Two queues use it, both in front of a bounded resource, both reading their stream in
//! order but starting work in turns:
//! - a share's router of the aggregate stream (`worker/ownership/router/`): while new
//!   triggers are held (`worker/admit.rs`) it reads on into the lanes, so a tenant whose
//!   inputs sit behind another tenant's backlog in the source is not held behind it;
//! - an effect's fetch loop (`effect/mod.rs`): it reads up to `effect.read_ahead` commands
//!   ahead of its free slots, so a tenant's command does not wait for another tenant's
//!   queue of commands to run first.
//!
//! **Guarantees.**
//! - **Order per tenant**, hence per key (a key belongs to one tenant): a lane gives up only
//!   its oldest item.
//! - **Weighted turns.** A turn takes up to the tenant's weight (`tenancy.weights`, default 1)
//!   of its items, then passes to the next tenant waiting, across calls: with room for one
//!   item at a time, tenants still alternate. A tenant alone takes all the room.
//! - **Exact progress** (the router's use). [`Lanes::progress`] is what the fence's marker
//!   records: `through`, below which every message of the source is taken or was never
//!   this reader's, and per tenant the last item taken beyond it. A reader resuming from
//!   that marker ([`Lanes::done`]) takes nothing twice and skips nothing, whatever order
//!   the tenants went in.
//! - **Bounded.** [`Lanes::full`] once the given count or bytes wait: the reader then stops
//!   reading until some are taken. A tenant's backlog larger than that still delays the
//!   tenants behind it in the stream.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Instant;

/// The tenant token of a subject (`tenant.<t>.…`); "" for any other shape (such an item
/// still goes through, in a lane of its own).
pub fn tenant_of(subject: &str) -> &str {
    let mut tokens = subject.split('.');
    match (tokens.next(), tokens.next()) {
        (Some("tenant"), Some(t)) => t,
        _ => "",
    }
}

/// What [`Lanes::take_within_rates`] took.
#[derive(Debug)]
pub struct Taken<T> {
    /// The items, in the order taken.
    pub items: Vec<T>,
    /// How many each tenant gave.
    pub given: BTreeMap<String, usize>,
    /// The tenants that waited with no token under their rate, and their rates.
    pub limited: Vec<(String, f64)>,
}

/// One waiting item: its stream sequence, its size, when it was read (or last refreshed),
/// and the item.
struct Waiting<T> {
    seq: u64,
    bytes: usize,
    read_at: Instant,
    item: T,
}

/// The lanes of one reader.
pub struct Lanes<T> {
    lanes: HashMap<String, VecDeque<Waiting<T>>>,
    /// Tenants with inputs waiting, the one whose turn it is first.
    turns: VecDeque<String>,
    /// What is left of the current turn (inputs).
    left: u32,
    waiting: usize,
    bytes: usize,
    max_waiting: usize,
    max_bytes: usize,
    /// Per tenant, the last input copied (possibly beyond the floor).
    copied: BTreeMap<String, u64>,
}

impl<T> Lanes<T> {
    /// Empty lanes holding at most `max_waiting` inputs and `max_bytes` of bodies.
    pub fn new(max_waiting: usize, max_bytes: usize) -> Self {
        Self {
            lanes: HashMap::new(),
            turns: VecDeque::new(),
            left: 0,
            waiting: 0,
            bytes: 0,
            max_waiting: max_waiting.max(1),
            max_bytes: max_bytes.max(1),
            copied: BTreeMap::new(),
        }
    }

    /// Drops what waits and starts again from a fence's marker lanes (a consumer reopened at
    /// the fence's watermark reads the dropped inputs again).
    pub fn reset(&mut self, marker: &BTreeMap<String, u64>) {
        self.lanes.clear();
        self.turns.clear();
        self.left = 0;
        self.waiting = 0;
        self.bytes = 0;
        self.copied = marker.clone();
    }

    /// Whether `seq`, an input of `tenant`, is copied already beyond the fence's watermark
    /// (by the marker's lanes, or by this router since).
    pub fn done(&self, tenant: &str, seq: u64) -> bool {
        self.copied.get(tenant).is_some_and(|last| seq <= *last)
    }

    /// Queues `item` (source sequence `seq`, `bytes` long) in its tenant's lane.
    pub fn push(&mut self, tenant: &str, seq: u64, bytes: usize, item: T) {
        let lane = match self.lanes.get_mut(tenant) {
            Some(lane) => lane,
            None => self.lanes.entry(tenant.to_string()).or_default(),
        };
        if lane.is_empty() {
            self.turns.push_back(tenant.to_string());
        }
        self.bytes += bytes;
        self.waiting += 1;
        lane.push_back(Waiting {
            seq,
            bytes,
            read_at: Instant::now(),
            item,
        });
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.waiting == 0
    }

    /// How many items wait.
    pub fn len(&self) -> usize {
        self.waiting
    }

    /// Whether reading should pause until some of what waits is copied.
    pub fn full(&self) -> bool {
        self.waiting >= self.max_waiting || self.bytes >= self.max_bytes
    }

    /// Takes up to `room` items in weighted turns (`weight` of a tenant, at least 1), each
    /// tenant's in arrival order; notes them as taken (call [`Lanes::progress`] after).
    pub fn take(&mut self, room: usize, weight: impl Fn(&str) -> u32) -> Vec<T> {
        self.take_capped(room, weight, |_| usize::MAX).0
    }

    /// [`Lanes::take`] with at most `cap(tenant)` items of each tenant (a tenant at its cap
    /// keeps its place and passes its turn); returns what each tenant gave too.
    pub fn take_capped(
        &mut self,
        room: usize,
        weight: impl Fn(&str) -> u32,
        cap: impl Fn(&str) -> usize,
    ) -> (Vec<T>, BTreeMap<String, usize>) {
        let mut out = Vec::with_capacity(room.min(self.waiting));
        let mut given: BTreeMap<String, usize> = BTreeMap::new();
        // Turns passed in a row by tenants at their caps: a whole round of them ends it.
        let mut passed = 0;
        while out.len() < room && passed < self.turns.len() {
            let Some(tenant) = self.turns.front().cloned() else {
                break;
            };
            let so_far = given.get(&tenant).copied().unwrap_or(0);
            if so_far >= cap(&tenant) {
                self.turns.rotate_left(1);
                self.left = 0;
                passed += 1;
                continue;
            }
            passed = 0;
            if self.left == 0 {
                self.left = weight(&tenant).max(1);
            }
            let lane = self.lanes.get_mut(&tenant);
            let Some(w) = lane.and_then(VecDeque::pop_front) else {
                self.turns.pop_front();
                self.left = 0;
                continue;
            };
            self.waiting -= 1;
            self.bytes -= w.bytes;
            self.copied.insert(tenant.clone(), w.seq);
            *given.entry(tenant.clone()).or_default() += 1;
            out.push(w.item);
            self.left -= 1;
            let emptied = self.lanes.get(&tenant).is_none_or(VecDeque::is_empty);
            if emptied {
                self.lanes.remove(&tenant);
                self.turns.pop_front();
                self.left = 0;
            } else if self.left == 0 {
                self.turns.rotate_left(1);
            }
        }
        (out, given)
    }

    /// [`Lanes::take_capped`] under rate limits: a tenant with a rate (`rate(tenant)`, per
    /// second) takes no more than the whole tokens `buckets` holds for it, reserved before
    /// the turns and given back after for what it did not take. A tenant with no token
    /// passes its turn and is named in [`Taken::limited`], with its rate.
    pub fn take_within_rates(
        &mut self,
        room: usize,
        weight: impl Fn(&str) -> u32,
        cap: impl Fn(&str) -> usize,
        buckets: &crate::quota::Buckets,
        rate: impl Fn(&str) -> Option<f64>,
    ) -> Taken<T> {
        let allowed: HashMap<String, (usize, f64)> = self
            .tenants()
            .filter_map(|t| rate(t).map(|r| (t.to_string(), (buckets.reserve(t, r), r))))
            .collect();
        let (items, given) = self.take_capped(room, weight, |t| {
            cap(t).min(allowed.get(t).map_or(usize::MAX, |(n, _)| *n))
        });
        let mut limited = Vec::new();
        for (t, (reserved, r)) in allowed {
            let used = given.get(&t).copied().unwrap_or(0);
            buckets.refund(&t, reserved.saturating_sub(used));
            if reserved == 0 {
                limited.push((t, r));
            }
        }
        Taken {
            items,
            given,
            limited,
        }
    }

    /// Items of `tenant` waiting.
    pub fn len_of(&self, tenant: &str) -> usize {
        self.lanes.get(tenant).map_or(0, VecDeque::len)
    }

    /// The tenants with items waiting.
    pub fn tenants(&self) -> impl Iterator<Item = &str> {
        self.turns.iter().map(String::as_str)
    }

    /// The marker after what was taken, given that the source is read through `read`:
    /// `through` (just below the oldest input still waiting, else `read`) and the lanes
    /// copied beyond it. Forgets the lanes it covers.
    pub fn progress(&mut self, read: u64) -> (u64, BTreeMap<String, u64>) {
        let through = self
            .lanes
            .values()
            .filter_map(|l| l.front().map(|w| w.seq.saturating_sub(1)))
            .min()
            .unwrap_or(read)
            .min(read);
        self.copied.retain(|_, last| *last > through);
        (through, self.copied.clone())
    }

    /// The items that waited `age` or longer since they were read or last returned here,
    /// their clocks restarted (an effect loop tells the broker it still holds them).
    pub fn stale(&mut self, age: std::time::Duration) -> Vec<&T> {
        let now = Instant::now();
        let mut out = Vec::new();
        for lane in self.lanes.values_mut() {
            for w in lane.iter_mut() {
                if now.duration_since(w.read_at) >= age {
                    w.read_at = now;
                    out.push(&w.item);
                }
            }
        }
        out
    }

    /// Everything waiting, taken out (a reader that stops hands it back).
    pub fn take_all(&mut self) -> Vec<T> {
        self.turns.clear();
        self.left = 0;
        self.waiting = 0;
        self.bytes = 0;
        self.lanes
            .drain()
            .flat_map(|(_, lane)| lane.into_iter().map(|w| w.item))
            .collect()
    }

    /// Per tenant with items waiting: how many, and how long the oldest has waited here.
    pub fn waiting_by_tenant(&self) -> Vec<(&str, usize, f64)> {
        self.lanes
            .iter()
            .filter_map(|(t, l)| {
                let oldest = l.front()?.read_at.elapsed().as_secs_f64();
                Some((t.as_str(), l.len(), oldest))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lanes of plain sequences, filled from `(tenant, seq)`.
    fn lanes(inputs: &[(&str, u64)]) -> Lanes<u64> {
        let mut l = Lanes::new(100, 1 << 20);
        for (t, seq) in inputs {
            l.push(t, *seq, 10, *seq);
        }
        l
    }

    #[test]
    fn a_tenant_out_of_tokens_passes_its_turn_and_gets_back_what_it_did_not_take() {
        let mut l = lanes(&[("a", 1), ("a", 2), ("a", 3), ("b", 4), ("c", 5), ("c", 6)]);
        let buckets = crate::quota::Buckets::default();
        // a: 2 tokens (a burst of one second at 2/s); b: none left; c: no limit.
        assert_eq!(buckets.reserve("b", 1.0), 1);
        let rate = |t: &str| match t {
            "a" => Some(2.0),
            "b" => Some(1.0),
            _ => None,
        };
        let t = l.take_within_rates(10, |_| 1, |_| usize::MAX, &buckets, rate);
        assert_eq!(t.items, [1, 5, 2, 6], "a twice, b held, c all");
        assert_eq!(t.limited, [("b".to_string(), 1.0)]);
        assert_eq!(t.given.get("a"), Some(&2));
        // A cap below the tokens: a takes one, and its other token goes back.
        let mut l = lanes(&[("a", 1), ("a", 2)]);
        let buckets = crate::quota::Buckets::default();
        let t = l.take_within_rates(10, |_| 1, |_| 1, &buckets, rate);
        assert_eq!(t.items, [1]);
        assert!(t.limited.is_empty());
        assert_eq!(
            buckets.reserve("a", 2.0),
            1,
            "the unused token was refunded"
        );
    }

    #[test]
    fn the_tenant_is_the_subjects_second_token() {
        assert_eq!(tenant_of("tenant.acme.aggregate.Order.1"), "acme");
        assert_eq!(tenant_of("orders.1"), "");
        assert_eq!(tenant_of("tenant"), "");
    }

    #[test]
    fn tenants_take_turns_and_each_keeps_its_order() {
        // A's backlog read first, B's two inputs behind it in the source.
        let mut l = lanes(&[("a", 1), ("a", 2), ("a", 3), ("a", 4), ("b", 5), ("b", 6)]);
        // Room for one at a time: A, then B, then A, then B.
        let one = |l: &mut Lanes<u64>| l.take(1, |_| 1);
        assert_eq!(one(&mut l), vec![1]);
        assert_eq!(one(&mut l), vec![5]);
        assert_eq!(one(&mut l), vec![2]);
        assert_eq!(one(&mut l), vec![6]);
        // B is done: A alone takes all the room.
        assert_eq!(l.take(10, |_| 1), vec![3, 4]);
        assert!(l.is_empty());
    }

    #[test]
    fn a_heavier_tenant_takes_more_per_turn() {
        let mut l = lanes(&[("a", 1), ("a", 2), ("a", 3), ("b", 4), ("b", 5), ("b", 6)]);
        let weight = |t: &str| if t == "b" { 2 } else { 1 };
        assert_eq!(l.take(6, weight), vec![1, 4, 5, 2, 6, 3]);
    }

    #[test]
    fn progress_covers_up_to_the_oldest_input_waiting_and_records_the_lanes_beyond() {
        // A's two inputs first in the source, then B's two; read through 4.
        let mut l = lanes(&[("a", 1), ("a", 2), ("b", 3), ("b", 4)]);
        assert_eq!(l.take(1, |_| 1), vec![1]);
        assert_eq!(l.progress(4), (1, BTreeMap::new()));
        // B's turn: its 3 goes before A's 2, so the marker records B beyond the floor.
        assert_eq!(l.take(1, |_| 1), vec![3]);
        let (through, beyond) = l.progress(4);
        assert_eq!(through, 1);
        assert_eq!(beyond, BTreeMap::from([("b".to_string(), 3)]));
        // A router resuming from that marker skips B's 3 and copies A's 2.
        let mut resumed: Lanes<u64> = Lanes::new(100, 1 << 20);
        resumed.reset(&beyond);
        assert!(resumed.done("b", 3));
        assert!(!resumed.done("a", 2) && !resumed.done("b", 4));
        // A's 2: everything through 3 is copied, nothing is recorded beyond.
        assert_eq!(l.take(1, |_| 1), vec![2]);
        assert_eq!(l.progress(4), (3, BTreeMap::new()));
        assert_eq!(l.take(1, |_| 1), vec![4]);
        assert_eq!(l.progress(4), (4, BTreeMap::new()));
    }

    #[test]
    fn a_tenant_at_its_cap_passes_its_turn_and_keeps_its_place() {
        let mut l = lanes(&[("a", 1), ("a", 2), ("b", 3), ("a", 4), ("b", 5)]);
        let (taken, given) = l.take_capped(10, |_| 1, |t| if t == "a" { 1 } else { usize::MAX });
        assert_eq!(taken, vec![1, 3, 5]);
        assert_eq!(
            given,
            BTreeMap::from([("a".to_string(), 1), ("b".to_string(), 2)])
        );
        // A's 2 and 4 still wait, in order.
        assert_eq!(l.take(10, |_| 1), vec![2, 4]);
        // Nobody under a cap: nothing is taken, and the call ends.
        let mut l = lanes(&[("a", 1)]);
        assert!(l.take_capped(10, |_| 1, |_| 0).0.is_empty());
        assert_eq!(l.len(), 1);
    }

    #[test]
    fn a_rate_limit_is_reserved_once_across_readers_and_refunded_when_unused() {
        let u = Usage::default();
        // Two a second, two saved up: the first reader gets both, the second none.
        assert_eq!(u.allowances().reserve("a", 2.0), 2);
        assert_eq!(u.allowances().reserve("a", 2.0), 0);
        // One of them was not let in: it goes back.
        u.allowances().refund("a", 1);
        assert_eq!(u.allowances().reserve("a", 2.0), 1);
        // Counted by what went in, per tenant.
        let metrics = crate::telemetry::Metrics::new("t", "t", "saga").expect("metrics");
        let tenancy = crate::config::TenancyConfig::default();
        u.let_in(&BTreeMap::from([("a".to_string(), 3)]), &tenancy, &metrics);
        assert_eq!(u.snapshot()["a"].inputs_let_in, 3);
        // Not named in [tenancy]: counted as `other`.
        assert_eq!(metrics.tenant_inputs.with_label_values(&["other"]).get(), 3);
    }

    #[test]
    fn lanes_are_full_at_either_bound() {
        let mut l: Lanes<u64> = Lanes::new(2, 25);
        l.push("a", 1, 10, 1);
        assert!(!l.full());
        l.push("a", 2, 10, 2);
        assert!(l.full(), "two inputs");
        l.take(1, |_| 1);
        assert!(!l.full());
        l.push("b", 3, 20, 3);
        assert!(l.full(), "30 bytes");
        assert_eq!(l.waiting_by_tenant().len(), 2);
    }
}

/// What each tenant uses of this node's door into the saga inbox, as its routers report it:
/// new inputs waiting (by reader, summed), the oldest's wait, what went in; and each rate
/// limited tenant's allowance (`tenancy.rate_limits`, inputs per second on this node, a
/// second's worth at most saved up). Shown by `GET /admin/tenants` and the `runner_tenant_*`
/// metrics.
#[derive(Debug, Default)]
pub struct Usage {
    inner: std::sync::Mutex<UsageInner>,
    /// Per rate-limited tenant, what it may let in now.
    allowances: crate::quota::Buckets,
}

#[derive(Debug, Default)]
struct UsageInner {
    /// Per reader (a router's share), per tenant: inputs waiting and the oldest's wait.
    waiting: HashMap<String, Vec<(String, usize, f64)>>,
    let_in: BTreeMap<String, u64>,
    /// Metric labels given a value so far (set to zero when their tenants stop waiting).
    labels: std::collections::BTreeSet<String>,
}

/// One tenant's use, as [`Usage::snapshot`] reports it.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct TenantUsage {
    /// New inputs read and waiting to go in.
    pub waiting_inputs: usize,
    /// How long the oldest of them has waited, seconds.
    pub oldest_wait_s: f64,
    /// New inputs let in since the node started.
    pub inputs_let_in: u64,
}

/// The metric label of `tenant`: its name when `[tenancy]` names it (allowed, weighted,
/// rate-limited for inputs or effect calls, or the default tenant), else `other`, so the
/// label stays bounded.
pub fn label_of(tenancy: &crate::config::TenancyConfig, tenant: &str) -> String {
    let named = tenant == tenancy.default_tenant
        || tenancy.allowed.iter().any(|t| t == tenant)
        || tenancy.weights.contains_key(tenant)
        || tenancy.rate_limits.contains_key(tenant)
        || tenancy.effect_rate_limits.contains_key(tenant)
        || tenancy.live_instance_caps.contains_key(tenant)
        || tenancy.pending_timer_caps.contains_key(tenant)
        || tenancy.outbox_byte_caps.contains_key(tenant);
    if named { tenant } else { "other" }.to_string()
}

impl Usage {
    fn lock(&self) -> std::sync::MutexGuard<'_, UsageInner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Replaces what `reader` reports waiting, and the gauges with it.
    pub fn report(
        &self,
        reader: &str,
        waiting: Vec<(String, usize, f64)>,
        tenancy: &crate::config::TenancyConfig,
        metrics: &crate::telemetry::Metrics,
    ) {
        let mut u = self.lock();
        if waiting.is_empty() && !u.waiting.contains_key(reader) {
            return;
        }
        if waiting.is_empty() {
            u.waiting.remove(reader);
        } else {
            u.waiting.insert(reader.to_string(), waiting);
        }
        let mut by_label: BTreeMap<String, (i64, f64)> = BTreeMap::new();
        for (t, n, oldest) in u.waiting.values().flatten() {
            let e = by_label.entry(label_of(tenancy, t)).or_default();
            e.0 += i64::try_from(*n).unwrap_or(i64::MAX);
            e.1 = e.1.max(*oldest);
        }
        for label in &u.labels {
            if !by_label.contains_key(label) {
                metrics.tenant_waiting.with_label_values(&[label]).set(0);
                metrics
                    .tenant_oldest_wait
                    .with_label_values(&[label])
                    .set(0.0);
            }
        }
        for (label, (n, oldest)) in &by_label {
            metrics.tenant_waiting.with_label_values(&[label]).set(*n);
            metrics
                .tenant_oldest_wait
                .with_label_values(&[label])
                .set(*oldest);
        }
        u.labels.extend(by_label.into_keys());
    }

    /// The node's token buckets of new inputs, by tenant, under `tenancy.rate_limits`
    /// ([`Lanes::take_within_rates`]); one set for every share's router, so that the
    /// routers of several shares never let in the same allowance twice.
    pub fn allowances(&self) -> &crate::quota::Buckets {
        &self.allowances
    }

    /// Notes what each tenant let in (counted).
    pub fn let_in(
        &self,
        given: &BTreeMap<String, usize>,
        tenancy: &crate::config::TenancyConfig,
        metrics: &crate::telemetry::Metrics,
    ) {
        let mut u = self.lock();
        for (t, n) in given {
            *u.let_in.entry(t.clone()).or_default() += *n as u64;
            metrics
                .tenant_inputs
                .with_label_values(&[&label_of(tenancy, t)])
                .inc_by(*n as u64);
        }
    }

    /// Every tenant seen: what waits and what went in.
    pub fn snapshot(&self) -> BTreeMap<String, TenantUsage> {
        let u = self.lock();
        let mut out: BTreeMap<String, TenantUsage> = BTreeMap::new();
        for (t, n) in &u.let_in {
            out.entry(t.clone()).or_default().inputs_let_in = *n;
        }
        for (t, n, oldest) in u.waiting.values().flatten() {
            let e = out.entry(t.clone()).or_default();
            e.waiting_inputs += n;
            e.oldest_wait_s = e.oldest_wait_s.max(*oldest);
        }
        out
    }
}
