//! The fence's markers and headers, without a broker (the protocol against a real one is
//! `tests/fence.rs`).
#![allow(clippy::unwrap_used)]

use super::*;

#[test]
fn fence_subject_names_the_partition() {
    assert_eq!(fence_subject("S", 0), "runner.fence.S.0");
    assert_eq!(fence_subject("OUT", 17), "runner.fence.OUT.17");
}

#[test]
fn headers_add_exactly_the_two_fence_headers() {
    let fence = Fence {
        stream: "S".into(),
        subject: fence_subject("S", 3),
        epoch: 9,
        seq: 42,
        owner: "r1".into(),
        through: None,
        lanes: BTreeMap::new(),
        staged: None,
        unmarked: None,
        marked_at: None,
    };
    let mut base = HeaderMap::new();
    base.insert("Nats-Msg-Id", "m-1");
    base.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, "7");
    let h = fence.headers(base);
    assert_eq!(
        h.get_all(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE)
            .map(|v| v.as_str().to_string())
            .collect::<Vec<_>>(),
        vec!["42"]
    );
    assert_eq!(
        h.get(EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT)
            .map(|v| v.as_str()),
        Some("runner.fence.S.3")
    );
    assert_eq!(h.get("Nats-Msg-Id").map(|v| v.as_str()), Some("m-1"));
    assert_eq!(h.iter().count(), 3);
}

#[test]
fn a_marker_is_its_epoch_and_owner() {
    let json: serde_json::Value = serde_json::to_value(Marker {
        epoch: 5,
        owner: "r1".into(),
        through: None,
        lanes: BTreeMap::new(),
    })
    .unwrap();
    assert_eq!(json, serde_json::json!({"epoch": 5, "owner": "r1"}));
    let with: Marker = serde_json::from_value(
        serde_json::json!({"epoch": 5, "owner": "r1", "through": {"seq": 9, "ord": 2}}),
    )
    .unwrap();
    assert_eq!(with.through, Some(Position { seq: 9, ord: 2 }));
    assert!(with.lanes.is_empty());
}

#[test]
fn staged_lanes_are_the_fences_once_their_marker_is_stored() {
    let mut fence = Fence {
        stream: "S".into(),
        subject: fence_subject("S", "r"),
        epoch: 2,
        seq: 10,
        owner: "r1".into(),
        through: Some(Position { seq: 4, ord: 0 }),
        lanes: BTreeMap::from([("a".to_string(), 6)]),
        staged: None,
        unmarked: None,
        marked_at: None,
    };
    let marker = |f: &Fence| -> Marker {
        serde_json::from_slice(&f.marker(Position { seq: 5, ord: 0 }).payload).unwrap()
    };
    // Unstaged, a marker carries the lanes it has.
    assert_eq!(marker(&fence).lanes, BTreeMap::from([("a".to_string(), 6)]));
    fence.stage_lanes(BTreeMap::from([("b".to_string(), 9)]));
    assert_eq!(marker(&fence).lanes, BTreeMap::from([("b".to_string(), 9)]));
    // Not stored yet: the fence still knows only the last marker's lanes.
    assert_eq!(fence.lanes(), &BTreeMap::from([("a".to_string(), 6)]));
    fence.advance(11, Some(Position { seq: 5, ord: 0 }));
    assert_eq!(fence.lanes(), &BTreeMap::from([("b".to_string(), 9)]));
    assert_eq!(fence.through(), Some(Position { seq: 5, ord: 0 }));
}
