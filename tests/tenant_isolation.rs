//! Tenant isolation as properties over the storage API and the operator queries.
//!
//! Random streams of inputs from several tenants — genuine orders and effect results,
//! inputs aimed at another tenant's instances (their correlation ids, their command ids),
//! subject/body tenant mismatches, undecodable bodies — go through the saga worker's
//! [`Processor`] into a real libmdbx store, batch by batch, as the saga worker applies them.
//! After each run, for every tenant:
//! - every instance, dead letter and outbox record filed under a tenant came from that
//!   tenant's own subjects (`tenant.<t>.…`), and its instances equal a model computed from
//!   that tenant's inputs alone;
//! - the tenant-scoped queries (`ops::inspect`, `deadletter::list`, `deadletter::show`,
//!   `ops::redrive`) never return or touch another tenant's rows;
//! - a subject/body mismatch is dead-lettered under the subject's tenant as
//!   `tenant_mismatch` and changes nothing of the body's tenant;
//! - with an allow-list, a tenant not on it gets dead letters of kind `unknown_tenant` and no
//!   instance.
//!
//! The generator is a seeded SplitMix64, so a failure prints the seed that reproduces it.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use runner::config::StorageConfig;
use runner::deadletter::{self, DeadLetterError, kind};
use runner::manifest::{Catalog, load_str};
use runner::ops;

use runner::storage::Store;
use runner::worker::process::{Limits, Processor, RawInput, Scope};
use serde_json::{Value as Json, json};

/// Tenant names chosen to collide if keys were built carelessly: prefixes of each other,
/// case variants, separators the key format uses nearby.
/// `_` is the default tenant of single-tenant deployments (and where dead letters whose
/// tenant cannot be read are filed): it is a tenant like any other here.
const TENANTS: [&str; 7] = ["a", "ab", "A", "a-b", "a_b", "b", "_"];
const IDS: [&str; 4] = ["o-1", "o-10", "o-1-", "O-1"];

fn catalog() -> Catalog {
    let report = load_str(&[("order.yaml", include_str!("../manifests/order.yaml"))]);
    report.catalog.expect("the order manifest compiles")
}

fn store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = StorageConfig {
        data_dir: dir.path().to_path_buf(),
        ..StorageConfig::default()
    };
    let store = Store::open(&cfg).expect("store opens");
    (dir, store)
}

fn raw(subject: String, body: &Json, seq: u64) -> RawInput {
    RawInput {
        subject,
        body: serde_json::to_vec(body).expect("json").into(),
        traceparent: None,
        header_bytes: 0,
        refused: None,
        live_cap: None,
        timer_cap: None,
        source: format!("TEST:{seq}"),
        stored_ms: None,
    }
}

fn order_placed(body_tenant: &str, id: &str, amount: u64, seq: u64) -> Json {
    json!({
        "v": 1, "event_id": format!("ev-{seq}"), "tenant_id": body_tenant,
        "event_type": "OrderPlaced", "aggregate_type": "Order", "aggregate_id": id,
        "timestamp_ms": 1_700_000_000_000u64 + seq,
        "payload": {"customer_id": "c", "amount_cents": amount, "items": [{"sku": "s", "qty": 1}]},
        "metadata": {},
    })
}

/// An effect result answering `command` (an outbox body), published by `publisher`.
fn result_for(publisher: &str, command: &Json, seq: u64) -> (String, Json) {
    let effect = command["effect_name"].as_str().unwrap_or("charge_card");
    let cmd = command["command_id"].as_str().unwrap_or("nope");
    let subject = format!("tenant.{publisher}.effect_result.{effect}.{cmd}");
    let body = json!({
        "v": 1, "event_id": format!("res-{seq}"), "tenant_id": publisher,
        "command_id": cmd, "effect_name": effect, "result_type": "Succeeded",
        "payload": {"payment_id": format!("forged-{seq}"), "reservation_id": "r"},
        "attempts": 1, "timestamp_ms": 1_700_000_000_000u64 + seq,
        "metadata": command["metadata"].clone(),
    });
    (subject, body)
}

/// Tenant of a `tenant.<t>.…` subject.
fn subject_tenant(subject: &str) -> Option<&str> {
    subject.strip_prefix("tenant.")?.split('.').next()
}

/// Everything the store holds, grouped by the tenant it is filed under.
#[derive(Default, Debug)]
struct Filed {
    instances: BTreeMap<String, Vec<runner::saga::Instance>>,
    dead_letters: BTreeMap<String, Vec<deadletter::DeadLetter>>,
    commands: Vec<Json>,
}

fn read_all(store: &Store) -> Filed {
    let mut f = Filed::default();
    let (instances, dls, outbox) = store
        .read_blocking(|t| {
            Ok((
                t.instances()?,
                t.dead_letters()?,
                t.outbox_batch(runner::storage::tables::DEFAULT_PARTITION, 0, usize::MAX)?,
            ))
        })
        .expect("reads");
    for i in instances {
        f.instances.entry(i.tenant.clone()).or_default().push(i);
    }
    for d in dls {
        f.dead_letters.entry(d.tenant.clone()).or_default().push(d);
    }
    for (_, rec) in outbox {
        assert_eq!(
            subject_tenant(&rec.subject),
            Some(rec.tenant.as_str()),
            "outbox record {} filed under tenant {}",
            rec.subject,
            rec.tenant
        );
        let body: Json = serde_json::from_str(&rec.body).unwrap_or(Json::Null);
        if rec.subject.contains(".effect.") {
            assert_eq!(body["tenant_id"], json!(rec.tenant), "command body tenant");
            f.commands.push(body);
        }
    }
    f
}

/// One run: `batches` batches of inputs from random tenants, then every property checked.
fn run(seed: u64, allowed: &[&str]) {
    let mut rng = common::SplitMix(seed);
    let catalog = catalog();
    let limits = Limits {
        allowed_tenants: allowed.iter().map(|s| s.to_string()).collect(),
        max_message_bytes: 1 << 20,
        max_payload: 1 << 20,
        max_output_bytes: usize::MAX,
        max_clock_skew_ms: runner::saga::DEFAULT_MAX_CLOCK_SKEW_MS,
        seal: runner::seal::Seal::none(),
    };
    let (_dir, store) = store();
    // The model: per (tenant, id), the amount of the first order placed (what the instance
    // must hold), from genuine inputs only.
    let mut model: BTreeMap<(String, String), u64> = BTreeMap::new();
    let mut mismatches = 0usize;
    let mut cross = 0usize;
    let mut seq = 0u64;
    for _batch in 0..12 {
        let known = read_all(&store);
        let mut batch = Vec::new();
        for _ in 0..20 {
            seq += 1;
            let t = *rng.pick(&TENANTS);
            let id = *rng.pick(&IDS);
            let roll = rng.next() % 100;
            if roll < 45 {
                let amount = 100 + seq;
                batch.push(raw(
                    format!("tenant.{t}.aggregate.Order.{id}"),
                    &order_placed(t, id, amount, seq),
                    seq,
                ));
                let admitted = allowed.is_empty() || allowed.contains(&t);
                if admitted {
                    model
                        .entry((t.to_string(), id.to_string()))
                        .or_insert(amount);
                }
            } else if roll < 75 && !known.commands.is_empty() {
                // A result for a random command of any tenant, published as `t`: genuine
                // when the command is t's, an attempt to steer another tenant otherwise.
                let cmd = rng.pick(&known.commands).clone();
                if cmd["tenant_id"] != json!(t) {
                    cross += 1;
                }
                let (subject, body) = result_for(t, &cmd, seq);
                batch.push(raw(subject, &body, seq));
            } else if roll < 90 {
                // Subject says t, body says another tenant.
                let other = *rng.pick(&TENANTS);
                if other != t {
                    mismatches += 1;
                    batch.push(raw(
                        format!("tenant.{t}.aggregate.Order.{id}"),
                        &order_placed(other, id, 1, seq),
                        seq,
                    ));
                }
            } else {
                batch.push(RawInput {
                    subject: format!("tenant.{t}.aggregate.Order.{id}"),
                    body: b"\x00not json".to_vec().into(),
                    traceparent: None,
                    header_bytes: 0,
                    refused: None,
                    live_cap: None,
                    timer_cap: None,
                    source: format!("TEST:{seq}"),
                    stored_ms: None,
                });
            }
        }
        store
            .write_blocking(|tx| {
                let mut p = Processor::new(&catalog, &limits, 1_700_000_000_000, Scope::whole());
                for r in &batch {
                    p.input(tx, r)?;
                }
                Ok(())
            })
            .expect("batch commits");
    }

    let filed = read_all(&store);
    // Instances: filed under their own tenant, exactly the model's, with the model's data.
    let mut seen = BTreeSet::new();
    for (tenant, list) in &filed.instances {
        if !allowed.is_empty() {
            assert!(
                allowed.contains(&tenant.as_str()),
                "seed {seed}: instance of {tenant}"
            );
        }
        for i in list {
            let key = (tenant.clone(), i.correlation_id.clone());
            let amount = model.get(&key).unwrap_or_else(|| {
                panic!("seed {seed}: instance {key:?} nobody of {tenant} placed")
            });
            assert_eq!(
                i.data["amount_cents"],
                json!(amount),
                "seed {seed}: instance {key:?} holds another tenant's order"
            );
            seen.insert(key);
        }
    }
    assert_eq!(
        seen,
        model.keys().cloned().collect(),
        "seed {seed}: instances"
    );
    // The run meant something: genuine results moved instances on, and results aimed at
    // other tenants' commands were tried.
    let moved = filed
        .instances
        .values()
        .flatten()
        .filter(|i| i.state != "awaiting_payment")
        .count();
    assert!(
        moved > 0 && cross > 0,
        "seed {seed}: moved {moved}, cross-tenant {cross}"
    );

    // Dead letters: filed under the subject's tenant, mismatches among them.
    let mut mismatch_seen = 0;
    for (tenant, list) in &filed.dead_letters {
        for d in list {
            assert_eq!(
                subject_tenant(&d.subject),
                Some(tenant.as_str()),
                "seed {seed}: dead letter {} filed under {tenant}",
                d.subject
            );
            if d.kind == kind::TENANT_MISMATCH {
                mismatch_seen += 1;
            }
            if !allowed.is_empty() && !allowed.contains(&tenant.as_str()) {
                assert_eq!(d.kind, kind::UNKNOWN_TENANT, "seed {seed}: {d:?}");
            }
        }
    }
    if allowed.is_empty() {
        assert_eq!(mismatch_seen, mismatches, "seed {seed}: tenant mismatches");
    }

    // Tenant-scoped queries never cross tenants.
    for t in TENANTS {
        let mine = deadletter::list(&store, Some(t), true).expect("list");
        assert!(mine.iter().all(|d| d.tenant == t), "seed {seed}: list({t})");
        assert_eq!(
            mine.len(),
            filed.dead_letters.get(t).map_or(0, Vec::len),
            "seed {seed}: list({t}) misses its own"
        );
        for id in IDS {
            match ops::inspect(&store, t, "order", id) {
                Ok(v) => {
                    assert_eq!(v.instance.tenant, t, "seed {seed}: inspect({t}, {id})");
                    assert!(
                        v.timers.iter().all(|x| x.tenant == t),
                        "seed {seed}: timers"
                    );
                }
                Err(_) => assert!(
                    !model.contains_key(&(t.to_string(), id.to_string())),
                    "seed {seed}: inspect({t}, {id}) lost an instance"
                ),
            }
        }
        for (other, list) in &filed.dead_letters {
            if other == t {
                continue;
            }
            for d in list {
                if filed
                    .dead_letters
                    .get(t)
                    .is_some_and(|m| m.iter().any(|x| x.id == d.id))
                {
                    continue; // ids are global; only foreign-only ids prove anything
                }
                assert!(
                    matches!(
                        deadletter::show(&store, t, d.id),
                        Err(DeadLetterError::NotFound { .. })
                    ),
                    "seed {seed}: show({t}, {}) reads {other}'s dead letter",
                    d.id
                );
                let before = deadletter::show(&store, other, d.id).expect("own");
                let r = deadletter::redrive(
                    &store,
                    t,
                    d.id,
                    &mut Processor::new(&catalog, &limits, 1_700_000_000_000, Scope::whole()),
                );
                assert!(
                    matches!(r, Err(DeadLetterError::NotFound { .. })),
                    "seed {seed}: redrive({t}, {}) reached {other}: {r:?}",
                    d.id
                );
                assert_eq!(
                    deadletter::show(&store, other, d.id).expect("own"),
                    before,
                    "seed {seed}: redrive by {t} changed {other}'s dead letter"
                );
            }
        }
    }
}

#[test]
fn tenants_never_read_or_write_each_others_rows() {
    for seed in 1..=12u64 {
        run(seed, &[]);
    }
}

#[test]
fn an_allow_list_keeps_other_tenants_out_entirely() {
    for seed in 100..=105u64 {
        run(seed, &["a", "A"]);
    }
}
