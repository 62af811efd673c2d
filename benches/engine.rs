//! Criterion benchmark of the pure saga engine on the shipped order example.
//!
//! `cargo bench --bench engine`. One iteration applies the order happy path (placed, charged,
//! reserved, shipped: 4 transitions); throughput is reported in transitions per second.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use runner::manifest;
use runner::saga::{Input, apply, apply_owned};
use serde_json::json;

/// The allocator the `runner` binary uses (see `src/main.rs`), so the figure is the product's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn inputs(catalog: &manifest::Catalog) -> [Input; 4] {
    let placed = Input::new(
        "aggregate.Order.o-1",
        json!({"v": 1, "event_id": "e0", "tenant_id": "acme", "event_type": "OrderPlaced",
               "aggregate_type": "Order", "aggregate_id": "o-1", "timestamp_ms": 1_700_000_000_000u64,
               "payload": {"customer_id": "c", "amount_cents": 100, "items": [{"sku": "a", "qty": 1}]}}),
    );
    let mut a = apply(catalog, "order", "o-1", None, &placed).unwrap();
    let mut rest = Vec::new();
    for (effect, k) in [
        ("charge_card", 1u64),
        ("reserve_stock", 2),
        ("create_shipment", 3),
    ] {
        let cmd = a
            .work
            .iter()
            .find(|w| w.subject.starts_with(&format!("effect.{effect}.")))
            .unwrap();
        let input = Input::new(
            format!("effect_result.{effect}.{}", cmd.msg_id),
            json!({"v": 1, "event_id": format!("e{k}"), "tenant_id": "acme", "command_id": cmd.msg_id,
                   "effect_name": effect, "result_type": "Succeeded", "timestamp_ms": 1_700_000_000_000u64 + k,
                   "payload": {"payment_id": "p", "reservation_id": "r", "tracking_number": "x"},
                   "metadata": cmd.body["metadata"].clone()}),
        );
        a = apply(catalog, "order", "o-1", Some(&a.instance), &input).unwrap();
        rest.push(input);
    }
    let [r1, r2, r3]: [Input; 3] = rest.try_into().unwrap();
    [placed, r1, r2, r3]
}

fn order_happy_path(c: &mut Criterion) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("manifests");
    let catalog = manifest::load(&[dir]).catalog.expect("catalog");
    let [placed, r1, r2, r3] = inputs(&catalog);
    let mut group = c.benchmark_group("engine");
    group.throughput(Throughput::Elements(4));
    group.bench_function("order_happy_path_4_transitions", |b| {
        b.iter(|| {
            let mut a = apply_owned(&catalog, "order", "o-1", None, black_box(&placed)).unwrap();
            for input in [&r1, &r2, &r3] {
                let inst = Some(a.instance);
                a = apply_owned(&catalog, "order", "o-1", inst, black_box(input)).unwrap();
            }
            a
        })
    });
    group.finish();
}

criterion_group!(benches, order_happy_path);
criterion_main!(benches);
