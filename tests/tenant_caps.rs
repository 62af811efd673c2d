//! Caps on running instances and pending timers (`tenancy.live_instance_caps`,
//! `tenancy.pending_timer_caps`, `worker/cap.rs`) applied by the saga worker's [`Processor`]
//! to a real libmdbx store, input by input, with the cases a pause, a resume, timers firing
//! and a held key's later inputs make: a cap holds however an input is applied, a held key's
//! inputs go in their order, the counts stay exact, and nothing stays held when its turn has
//! come. (`tenant_quotas.rs` runs the caps end to end with the real binary.)
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::sync::Arc;

use runner::config::StorageConfig;
use runner::deadletter::kind;
use runner::manifest::{Catalog, load_str};
use runner::saga::Status;
use runner::storage::Store;
use runner::storage::tables::{Counted, DeadLetterStatus, TimerEntry};
use runner::worker::process::{Limits, Processor, RawInput, Scope};
use serde_json::json;

const DOOR: &str = r#"format: 1
sagas:
  - name: door
    version: 1
    triggers: [{ subject: aggregate.Door.*, correlation: event.aggregate_id, start: true }]
    initial_state: closed
    states:
      closed:
        on:
          Opened: { goto: open }
      open:
        on:
          Closed: { goto: shut }
      shut: { terminal: true }
"#;

/// A lock that expires an hour after it is armed unless disarmed first; `Snooze` sets a
/// second timer on a running lock.
const LOCK: &str = r#"format: 1
sagas:
  - name: lock
    version: 1
    triggers: [{ subject: aggregate.Lock.*, correlation: event.aggregate_id, start: true }]
    initial_state: idle
    states:
      idle:
        on:
          Armed: { goto: armed, timers: [{ name: expire, delay_ms: 3600000 }] }
      armed:
        on:
          Snooze: { timers: [{ name: nudge, delay_ms: 600000 }] }
          Disarmed: { goto: off, cancel_timers: [expire, nudge] }
          timer.expire: { goto: expired, cancel_timers: [nudge] }
          timer.nudge: { goto: armed }
      off: { terminal: true }
      expired: { terminal: true }
"#;

/// An input on `subject` with `body`, as the partition's log delivers it: `caps` are the
/// instance and timer caps its router stamped; `stored_ms` the broker's time, when set.
fn raw(
    subject: String,
    body: &impl serde::Serialize,
    source: String,
    caps: (Option<u64>, Option<u64>),
    stored_ms: Option<u64>,
) -> RawInput {
    RawInput {
        subject,
        body: serde_json::to_vec(body).unwrap().into(),
        traceparent: None,
        header_bytes: 0,
        refused: None,
        live_cap: caps.0,
        timer_cap: caps.1,
        source,
        stored_ms,
    }
}

/// One partition and tenant `a` capped at one running door.
struct World {
    _dir: tempfile::TempDir,
    store: Store,
    catalog: Catalog,
    limits: Limits,
    paused: Arc<BTreeSet<String>>,
    seq: u64,
    /// The partition applied (of how many).
    scope: Scope,
}

impl World {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&StorageConfig {
            data_dir: dir.path().to_path_buf(),
            ..StorageConfig::default()
        })
        .unwrap();
        let loaded = load_str(&[("door.yaml", DOOR), ("lock.yaml", LOCK)]);
        let catalog = loaded
            .catalog
            .unwrap_or_else(|| panic!("{:?}", loaded.diagnostics));
        let limits = Limits {
            allowed_tenants: Vec::new(),
            max_message_bytes: 1 << 20,
            max_payload: 0,
            max_output_bytes: usize::MAX,
            max_clock_skew_ms: u64::MAX / 4,
            seal: runner::seal::Seal::none(),
        };
        Self {
            _dir: dir,
            store,
            catalog,
            limits,
            paused: Arc::default(),
            seq: 0,
            scope: Scope::whole(),
        }
    }

    /// Applies `raw` as the saga worker applies one input of a batch.
    fn apply(&mut self, raw: RawInput, control: bool) {
        let (catalog, limits, paused) = (&self.catalog, &self.limits, self.paused.clone());
        self.store
            .write_blocking(|t| {
                let mut p = Processor::new(catalog, limits, 1_800_000_000_000, self.scope);
                p.paused = paused;
                if control {
                    p.control(t, &raw)?;
                } else {
                    p.input(t, &raw)?;
                }
                p.release_freed(t)
            })
            .unwrap();
    }

    /// Door `id` of tenant `a` had `event`, routed with a cap of one running door.
    fn door(&mut self, id: &str, event: &str) {
        self.event("Door", id, event, Some(1), None);
    }

    /// Lock `id` of tenant `a` had `event`, routed with a cap of one pending timer.
    fn lock(&mut self, id: &str, event: &str) {
        self.event("Lock", id, event, None, Some(1));
    }

    fn event(
        &mut self,
        aggregate: &str,
        id: &str,
        event: &str,
        live_cap: Option<u64>,
        timer_cap: Option<u64>,
    ) {
        self.seq += 1;
        let body = json!({
            "v": 1, "event_id": format!("ev-{}", self.seq), "tenant_id": "a",
            "event_type": event, "aggregate_type": aggregate, "aggregate_id": id,
            "timestamp_ms": 1_800_000_000_000u64 + self.seq, "payload": {}, "metadata": {},
        });
        let raw = raw(
            format!("tenant.a.aggregate.{aggregate}.{id}"),
            &body,
            format!("TEST:{}", self.seq),
            (live_cap, timer_cap),
            None,
        );
        self.apply(raw, false);
    }

    /// Fires the pending timer `name` of lock `id`, as its partition's log delivers it.
    fn fire(&mut self, id: &str, name: &str) {
        let timer = self
            .timers()
            .into_iter()
            .find(|t| t.correlation_id == id && t.name == name)
            .unwrap_or_else(|| panic!("no timer {name} of {id}"));
        self.fire_timer(&timer);
    }

    /// Delivers a firing of `timer`, pending or not, as the partition's log does.
    fn fire_timer(&mut self, timer: &TimerEntry) {
        self.seq += 1;
        let raw = raw(
            runner::worker::process::TIMER_SUBJECT.into(),
            timer,
            format!("TEST:{}", self.seq),
            (None, None),
            None,
        );
        let (catalog, limits) = (&self.catalog, &self.limits);
        self.store
            .write_blocking(|t| {
                let mut p = Processor::new(catalog, limits, 1_800_000_000_000, self.scope);
                p.fired_timer(t, &raw)?;
                p.release_freed(t)
            })
            .unwrap();
    }

    /// Every pending timer, from the schedule itself.
    fn timers(&self) -> Vec<TimerEntry> {
        self.store
            .read_blocking(|t| t.due_timers(u64::MAX, usize::MAX))
            .unwrap()
    }

    /// Pending timers of `a` as counted, checked against the schedule's rows.
    fn counted_timers(&self) -> u64 {
        let n = self
            .store
            .read_blocking(|t| t.counted("a", self.scope.partition, Counted::Timers))
            .unwrap();
        assert_eq!(
            n,
            self.timers().len() as u64,
            "the count is the schedule's rows"
        );
        n
    }

    fn pause(&mut self) {
        self.paused = Arc::new(BTreeSet::from(["a".to_string()]));
    }

    /// The resume as it reaches the partition: a control input.
    fn resume(&mut self) {
        self.paused = Arc::default();
        self.seq += 1;
        let body = json!({ "resume": "a", "issued_ms": 1_800_000_000_000u64 });
        let raw = raw(
            "runner.control".into(),
            &body,
            format!("TEST:{}", self.seq),
            (None, None),
            Some(1_800_000_000_000),
        );
        self.apply(raw, true);
    }

    fn status(&self, id: &str) -> Option<Status> {
        self.status_of("door", id)
    }

    fn status_of(&self, saga: &str, id: &str) -> Option<Status> {
        self.store
            .read_blocking(|t| t.instance("a", saga, id))
            .unwrap()
            .map(|i| i.status)
    }

    fn live(&self) -> u64 {
        self.store.read_blocking(|t| t.live("a", 0)).unwrap()
    }

    /// Letters still holding an input of `a`.
    fn pending(&self) -> Vec<(String, String)> {
        self.store
            .read_blocking(|t| t.dead_letters())
            .unwrap()
            .into_iter()
            .filter(|d| d.status == DeadLetterStatus::Pending)
            .map(|d| (d.kind, d.correlation_id.unwrap_or_default()))
            .collect()
    }
}

#[test]
fn an_input_held_behind_a_capped_key_while_paused_goes_with_its_key() {
    let mut w = World::new();
    w.door("d1", "Opened");
    w.door("d2", "Opened");
    assert_eq!(w.live(), 1);
    assert_eq!(w.status("d2"), None, "d2's start is held at the cap");
    w.pause();
    // A later input of the held key, while the tenant is paused: behind its key's first.
    w.door("d2", "Closed");
    w.resume();
    assert_eq!(w.status("d2"), None, "still at the cap after the resume");
    assert_eq!(
        w.pending(),
        [
            (kind::TENANT_CAPPED.to_string(), "d2".to_string()),
            (kind::TENANT_CAPPED.to_string(), "d2".to_string())
        ]
    );
    // d1 ends: d2 starts, then closes, in that order; nothing stays held.
    w.door("d1", "Closed");
    assert_eq!(w.status("d1"), Some(Status::Completed));
    assert_eq!(
        w.status("d2"),
        Some(Status::Completed),
        "d2 opened, then closed"
    );
    assert_eq!(w.live(), 0);
    assert!(w.pending().is_empty(), "{:?}", w.pending());
}

#[test]
fn a_resume_applies_held_starts_under_the_cap_and_holds_the_rest_at_it() {
    let mut w = World::new();
    w.door("d1", "Opened");
    w.pause();
    for d in ["d2", "d3", "d4"] {
        w.door(d, "Opened");
    }
    w.door("d3", "Closed");
    w.resume();
    assert_eq!(w.live(), 1, "the resume does not pass the cap");
    let held: Vec<String> = w.pending().into_iter().map(|(_, c)| c).collect();
    assert_eq!(
        held,
        ["d2", "d3", "d3", "d4"],
        "held again at the cap, d3's close behind it"
    );
    assert!(w.pending().iter().all(|(k, _)| k == kind::TENANT_CAPPED));
    // Each end lets the next key in, its inputs in order.
    w.door("d1", "Closed");
    assert_eq!(w.status("d2"), Some(Status::Running));
    assert_eq!(w.live(), 1);
    w.door("d2", "Closed");
    assert_eq!(
        w.status("d3"),
        Some(Status::Completed),
        "d3 opened and closed"
    );
    assert_eq!(w.status("d4"), Some(Status::Running), "then d4 went in");
    assert_eq!(w.live(), 1);
    assert!(w.pending().is_empty(), "{:?}", w.pending());
}

#[test]
fn a_cap_on_pending_timers_holds_new_locks_until_a_timer_fires_or_is_cancelled() {
    let mut w = World::new();
    w.lock("l1", "Armed");
    assert_eq!(w.counted_timers(), 1);
    w.lock("l2", "Armed");
    assert_eq!(
        w.status_of("lock", "l2"),
        None,
        "l2 would set a second timer: held"
    );
    w.lock("l2", "Disarmed");
    w.lock("l3", "Armed");
    let held: Vec<String> = w.pending().into_iter().map(|(_, c)| c).collect();
    assert_eq!(
        held,
        ["l2", "l2", "l3"],
        "held whole, l2's disarm behind its arm"
    );
    // A running lock is never held for its own timers: it may pass the cap.
    w.lock("l1", "Snooze");
    assert_eq!(
        w.counted_timers(),
        2,
        "l1 set its second timer past the cap"
    );
    // l1 expires: its timer fired and its snooze cancelled, so l2 goes (armed, then
    // disarmed: its timer set and cancelled), and l3 after it, in the same release.
    w.fire("l1", "expire");
    assert_eq!(w.status_of("lock", "l1"), Some(Status::Completed));
    assert_eq!(
        w.status_of("lock", "l2"),
        Some(Status::Completed),
        "armed, then disarmed"
    );
    assert_eq!(w.status_of("lock", "l3"), Some(Status::Running));
    assert_eq!(w.counted_timers(), 1, "only l3's timer is pending");
    assert!(w.pending().is_empty(), "{:?}", w.pending());
    // At the cap again: the next lock waits for l3's disarm, a cancelled timer.
    w.lock("l4", "Armed");
    assert_eq!(w.status_of("lock", "l4"), None);
    w.lock("l3", "Disarmed");
    assert_eq!(w.status_of("lock", "l4"), Some(Status::Running));
    assert_eq!(w.counted_timers(), 1);
    assert!(w.pending().is_empty(), "{:?}", w.pending());
}

#[test]
fn a_timer_that_fired_already_is_not_counted_twice() {
    let mut w = World::new();
    w.lock("l1", "Armed");
    // A second lock, uncapped, keeps a timer pending: a firing counted twice would show.
    w.event("Lock", "l2", "Armed", None, None);
    assert_eq!(w.counted_timers(), 2);
    let timer = w
        .timers()
        .into_iter()
        .find(|t| t.correlation_id == "l1")
        .unwrap();
    w.fire("l1", "expire");
    assert_eq!(w.counted_timers(), 1);
    // The same firing read again (a replay of the partition's log): ignored, count kept.
    w.fire_timer(&timer);
    assert_eq!(w.counted_timers(), 1, "l2's timer is still counted");
}

#[test]
fn a_timer_cap_removed_since_a_key_was_held_does_not_let_it_in_at_once() {
    let mut w = World::new();
    w.event("Lock", "l1", "Armed", Some(5), Some(1));
    w.event("Lock", "l2", "Armed", Some(5), Some(1));
    assert_eq!(w.status_of("lock", "l2"), None, "held at the timer cap");
    // The timer cap is removed; the instance cap stays. A new start goes (nothing caps it
    // at timers now), but l2 keeps the cap it was held at until a timer fires.
    w.event("Lock", "l3", "Armed", Some(5), None);
    assert_eq!(w.status_of("lock", "l3"), Some(Status::Running));
    assert_eq!(w.status_of("lock", "l2"), None, "still held by its own cap");
    assert_eq!(w.counted_timers(), 2);
    w.lock("l1", "Disarmed");
    w.lock("l3", "Disarmed");
    assert_eq!(
        w.status_of("lock", "l2"),
        Some(Status::Running),
        "under its cap again: let in"
    );
    assert!(w.pending().is_empty(), "{:?}", w.pending());
}

#[test]
fn each_partition_holds_its_part_of_the_timer_cap_under_its_own_count() {
    let mut w = World::new();
    // Partition 2 of 4, with a cap of 8: 2 pending timers here, whatever the others hold.
    w.scope = Scope::new(2, 4);
    let here: Vec<String> = (0..)
        .map(|i| format!("l{i}"))
        .filter(|l| runner::worker::partition::partition("a", "lock", l, 4) == 2)
        .take(3)
        .collect();
    for l in &here {
        w.event("Lock", l, "Armed", None, Some(8));
    }
    assert_eq!(w.status_of("lock", &here[1]), Some(Status::Running));
    assert_eq!(
        w.status_of("lock", &here[2]),
        None,
        "the third would pass ⌈8 ÷ 4⌉"
    );
    assert_eq!(w.counted_timers(), 2, "counted under partition 2");
    let elsewhere = w
        .store
        .read_blocking(|t| t.counted("a", 0, Counted::Timers))
        .unwrap();
    assert_eq!(elsewhere, 0, "nothing counted under another partition");
    let reason = w
        .store
        .read_blocking(|t| t.dead_letters())
        .unwrap()
        .into_iter()
        .find(|d| d.status == DeadLetterStatus::Pending)
        .unwrap()
        .reason;
    assert!(
        reason.contains("cap of 8 timers pending (at most 2 in partition 2)"),
        "{reason}"
    );
}

#[test]
fn a_redrive_reaching_another_partition_leaves_the_key_alone() {
    let mut w = World::new();
    let count = 4;
    let home = runner::worker::partition::partition("a", "door", "d2", count);
    let other = (3..)
        .map(|i| format!("d{i}"))
        .find(|d| runner::worker::partition::partition("a", "door", d, count) == home)
        .unwrap();
    w.scope = Scope::new(home, count);
    w.door(&other, "Opened");
    w.door("d2", "Opened");
    let ids = |w: &World| -> Vec<u64> {
        w.store
            .read_blocking(|t| t.dead_letters())
            .unwrap()
            .into_iter()
            .filter(|d| d.status == DeadLetterStatus::Pending)
            .map(|d| d.id)
            .collect()
    };
    let held = ids(&w);
    assert_eq!(held.len(), 1, "d2 is held at the cap");
    let redrive = |w: &mut World| {
        w.seq += 1;
        let body = json!({ "redrive": { "tenant": "a", "saga": "door", "correlation_id": "d2" } });
        let raw = raw(
            "runner.control".into(),
            &body,
            format!("TEST:{}", w.seq),
            (None, None),
            Some(1_800_000_000_000),
        );
        w.apply(raw, true);
    };
    // Published to another partition's inbox: that partition does not apply d2's letters.
    w.scope = Scope::new((home + 1) % count, count);
    redrive(&mut w);
    assert_eq!(ids(&w), held, "the letter is untouched");
    // In its own partition, the redrive applies it: measured against the cap again, it is
    // held again, as a new letter.
    w.scope = Scope::new(home, count);
    redrive(&mut w);
    let again = ids(&w);
    assert_eq!(again.len(), 1);
    assert_ne!(again, held, "redriven, and held anew at the cap");
}
