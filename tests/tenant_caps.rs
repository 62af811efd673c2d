//! Caps on running instances (`tenancy.live_instance_caps`, `worker/cap.rs`) applied by the
//! saga worker's [`Processor`] to a real libmdbx store, input by input, with the cases a
//! pause, a resume and a held key's later inputs make: the cap holds however an input is
//! applied, a held key's inputs go in their order, and nothing stays held when its turn has
//! come. (`tenant_quotas.rs` runs the cap end to end with the real binary.)
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::sync::Arc;

use runner::config::StorageConfig;
use runner::deadletter::kind;
use runner::manifest::{Catalog, load_str};
use runner::saga::Status;
use runner::storage::Store;
use runner::storage::tables::DeadLetterStatus;
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

/// One partition and tenant `a` capped at one running door.
struct World {
    _dir: tempfile::TempDir,
    store: Store,
    catalog: Catalog,
    limits: Limits,
    paused: Arc<BTreeSet<String>>,
    seq: u64,
}

impl World {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&StorageConfig {
            data_dir: dir.path().to_path_buf(),
            ..StorageConfig::default()
        })
        .unwrap();
        let catalog = load_str(&[("door.yaml", DOOR)]).catalog.unwrap();
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
        }
    }

    /// Applies `raw` as the saga worker applies one input of a batch.
    fn apply(&mut self, raw: RawInput, control: bool) {
        let (catalog, limits, paused) = (&self.catalog, &self.limits, self.paused.clone());
        self.store
            .write_blocking(|t| {
                let mut p = Processor::new(catalog, limits, 1_800_000_000_000, Scope::whole());
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

    /// Door `id` of tenant `a` had `event`, routed with the cap of one.
    fn door(&mut self, id: &str, event: &str) {
        self.seq += 1;
        let body = json!({
            "v": 1, "event_id": format!("ev-{}", self.seq), "tenant_id": "a",
            "event_type": event, "aggregate_type": "Door", "aggregate_id": id,
            "timestamp_ms": 1_800_000_000_000u64 + self.seq, "payload": {}, "metadata": {},
        });
        let raw = RawInput {
            subject: format!("tenant.a.aggregate.Door.{id}"),
            body: serde_json::to_vec(&body).unwrap().into(),
            traceparent: None,
            header_bytes: 0,
            refused: None,
            live_cap: Some(1),
            source: format!("TEST:{}", self.seq),
            stored_ms: None,
        };
        self.apply(raw, false);
    }

    fn pause(&mut self) {
        self.paused = Arc::new(BTreeSet::from(["a".to_string()]));
    }

    /// The resume as it reaches the partition: a control input.
    fn resume(&mut self) {
        self.paused = Arc::default();
        self.seq += 1;
        let body = json!({ "resume": "a", "issued_ms": 1_800_000_000_000u64 });
        let raw = RawInput {
            subject: "runner.control".into(),
            body: serde_json::to_vec(&body).unwrap().into(),
            traceparent: None,
            header_bytes: 0,
            refused: None,
            live_cap: None,
            source: format!("TEST:{}", self.seq),
            stored_ms: Some(1_800_000_000_000),
        };
        self.apply(raw, true);
    }

    fn status(&self, id: &str) -> Option<Status> {
        self.store
            .read_blocking(|t| t.instance("a", "door", id))
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
