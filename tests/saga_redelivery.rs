//! Redelivery and duplicates at the commit layer (real libmdbx, no NATS): inputs that
//! arrive again after later ones were applied are neither applied twice nor out of order,
//! and one event published twice under two sequences is applied once.
#![allow(clippy::unwrap_used)]

mod common;

use runner::worker::apply_inputs;
use runner::worker::process::{Limits, RawInput, Scope};
use serde_json::json;

fn deposit(account: &str, n: u64, event_id: &str, seq: u64) -> (u64, RawInput) {
    let mut ev = common::aggregate_event(
        "bank",
        "Account",
        account,
        "Deposited",
        1_800_000_000_000 + n,
        json!({"n": n, "amount": 10 * n}),
    );
    ev["event_id"] = json!(event_id);
    (
        seq,
        RawInput {
            subject: format!("tenant.bank.aggregate.Account.{account}"),
            body: serde_json::to_vec(&ev).unwrap().into(),
            traceparent: None,
            header_bytes: 0,
            refused: None,
            live_cap: None,
            timer_cap: None,
            source: format!("AGGREGATE_EVENTS:{seq}"),
            stored_ms: None,
        },
    )
}

/// The ledger saga, open limits and a fresh store (kept alive by the returned directory).
fn ledger_store() -> (
    runner::manifest::Catalog,
    Limits,
    tempfile::TempDir,
    runner::storage::Store,
) {
    let report = runner::manifest::load(&[common::repo_root().join("tests/manifests/ledger.yaml")]);
    let limits = Limits {
        allowed_tenants: vec![],
        max_message_bytes: 1 << 20,
        max_payload: 1 << 20,
        max_output_bytes: usize::MAX,
        max_clock_skew_ms: runner::saga::DEFAULT_MAX_CLOCK_SKEW_MS,
        seal: runner::seal::Seal::none(),
    };
    let dir = tempfile::tempdir().unwrap();
    let store = common::open_store(dir.path());
    (report.catalog.unwrap(), limits, dir, store)
}

#[test]
fn late_redeliveries_and_republished_events_apply_once_in_order() {
    let (catalog, limits, _dir, store) = ledger_store();
    let ids: Vec<String> = (0..6)
        .map(|i| format!("0190f000-0000-7000-8000-00000000000{i}"))
        .collect();
    let key = "test:AGGREGATE_EVENTS";

    let (cp, _) = apply_inputs(
        &store,
        &catalog,
        &limits,
        key,
        &[
            deposit("a", 1, &ids[1], 1),
            deposit("a", 2, &ids[2], 2),
            deposit("a", 3, &ids[3], 3),
        ],
    )
    .unwrap();
    assert_eq!(cp, 3);
    // 2 and 3 come again (a late redelivery) ahead of 4: skipped, then 4 applies in order.
    let (cp, tally) = apply_inputs(
        &store,
        &catalog,
        &limits,
        key,
        &[
            deposit("a", 2, &ids[2], 2),
            deposit("a", 3, &ids[3], 3),
            deposit("a", 4, &ids[4], 4),
        ],
    )
    .unwrap();
    assert_eq!(cp, 4);
    assert_eq!(tally.count("applied"), 1);
    assert_eq!(tally.transitions.len(), 1);
    // Event 4 published a second time under a new sequence: a duplicate, not applied.
    let (cp, tally) = apply_inputs(
        &store,
        &catalog,
        &limits,
        key,
        &[deposit("a", 4, &ids[4], 5)],
    )
    .unwrap();
    assert_eq!(cp, 5);
    assert_eq!(
        tally.transitions,
        vec![("ledger".to_string(), "duplicate", 1)]
    );

    let inst = store
        .read_blocking(|t| t.instance("bank", "ledger", "a"))
        .unwrap()
        .unwrap();
    assert_eq!(inst.state, "open");
    assert_eq!(inst.data["count"], json!(4));
    assert_eq!(inst.data["total"], json!(100));
    assert_eq!(inst.applied, 4);
    // One outbox record per applied deposit.
    assert_eq!(store.read_blocking(|t| t.outbox_depth()).unwrap(), 4);
}

#[test]
fn an_id_holding_a_nul_character_is_dead_lettered_not_stored_under_an_aliased_key() {
    let (catalog, limits, _dir, store) = ledger_store();
    let (cp, tally) = apply_inputs(
        &store,
        &catalog,
        &limits,
        "test:AGGREGATE_EVENTS",
        &[
            deposit("a\u{0}b", 1, "0190f000-0000-7000-8000-0000000000a1", 1),
            deposit("c", 1, "0190f000-0000-7000-8000-0000000000a2", 2),
        ],
    )
    .unwrap();
    assert_eq!(cp, 2);
    // Routing refuses it first: a correlation id must be a subject token.
    assert_eq!(tally.dead_letters, vec!["expression"]);
    assert_eq!(tally.count("applied"), 1, "the other input still applies");
    let (instances, letters) = store
        .read_blocking(|t| Ok((t.instances()?, t.dead_letters()?)))
        .unwrap();
    assert_eq!(instances.len(), 1);
    assert_eq!(instances[0].correlation_id, "c");
    let reason = &letters[0].reason;
    assert!(reason.contains("control character"), "{reason}");
    assert!(!reason.contains('\0'), "shown escaped: {reason}");
}

/// Two producers reuse one event id for two different accounts: the second is not a
/// redelivery, so it is dead-lettered with the reason instead of being dropped silently;
/// a true redelivery of the first stays a silent duplicate.
#[test]
fn an_event_id_reused_for_another_instance_is_dead_lettered_not_dropped() {
    let (catalog, limits, _dir, store) = ledger_store();
    let id = "0190f000-0000-7000-8000-0000000000aa";
    store
        .write_blocking(|t| {
            let mut p =
                runner::worker::process::Processor::new(&catalog, &limits, 1, Scope::whole());
            p.input(t, &deposit("acc-1", 1, id, 1).1)?;
            p.input(t, &deposit("acc-2", 1, id, 2).1)?;
            p.input(t, &deposit("acc-1", 1, id, 3).1)?;
            Ok(())
        })
        .unwrap();
    let dead = runner::deadletter::list(&store, None, true).unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].kind, "duplicate_event_id");
    assert_eq!(dead[0].subject, "tenant.bank.aggregate.Account.acc-2");
    assert!(dead[0].reason.contains(id), "{}", dead[0].reason);
    let acc1 = store
        .read_blocking(|t| t.instance("bank", "ledger", "acc-1"))
        .unwrap()
        .unwrap();
    assert_eq!(acc1.data["count"], 1, "the redelivery applied once");
    assert!(
        store
            .read_blocking(|t| t.instance("bank", "ledger", "acc-2"))
            .unwrap()
            .is_none()
    );
}
