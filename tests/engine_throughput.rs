//! Throughput of the pure engine on the order example (not a pass/fail test).
//!
//! Run: `cargo test --release --test engine_throughput -- --ignored --nocapture`.
//! It applies the order happy path (4 transitions per order: placed, charged, reserved,
//! shipped) for 20 000 orders on one thread, timing only the engine (inputs are built
//! beforehand), and prints transitions per second. A criterion
//! benchmark would need a new dev-dependency; this measurement needs none.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Instant;

use runner::manifest;
use runner::saga::{Input, apply};
use serde_json::json;

#[test]
#[ignore = "measurement; run explicitly with --ignored"]
fn order_transitions_per_second() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("manifests");
    let catalog = manifest::load(&[dir]).catalog.expect("catalog");
    let orders = 20_000u64;
    // Build every input first (ids depend on earlier outputs), then time only `apply`.
    let mut inputs: Vec<(String, [Input; 4])> = Vec::with_capacity(orders as usize);
    for n in 0..orders {
        let id = format!("o-{n}");
        let t = 1_700_000_000_000 + n;
        let placed = Input::new(
            format!("aggregate.Order.{id}"),
            json!({"v": 1, "event_id": format!("e{n}"), "tenant_id": "acme", "event_type": "OrderPlaced",
                   "aggregate_type": "Order", "aggregate_id": id, "timestamp_ms": t,
                   "payload": {"customer_id": "c", "amount_cents": 100, "items": [{"sku": "a", "qty": 1}]}}),
        );
        let mut a = apply(&catalog, "order", &id, None, &placed).unwrap();
        let mut rest = Vec::new();
        for (effect, k) in [
            ("charge_card", 1),
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
                json!({"v": 1, "event_id": format!("e{n}-{k}"), "tenant_id": "acme", "command_id": cmd.msg_id,
                       "effect_name": effect, "result_type": "Succeeded", "timestamp_ms": t + k,
                       "payload": {"payment_id": "p", "reservation_id": "r", "tracking_number": "x"},
                       "metadata": cmd.body["metadata"].clone()}),
            );
            a = apply(&catalog, "order", &id, Some(&a.instance), &input).unwrap();
            rest.push(input);
        }
        let [r1, r2, r3]: [Input; 3] = rest.try_into().unwrap();
        inputs.push((id, [placed, r1, r2, r3]));
    }
    let start = Instant::now();
    let mut transitions = 0u64;
    for (id, [placed, r1, r2, r3]) in &inputs {
        let mut a = apply(&catalog, "order", id, None, placed).unwrap();
        for input in [r1, r2, r3] {
            a = apply(&catalog, "order", id, Some(&a.instance), input).unwrap();
        }
        transitions += 4;
        assert_eq!(a.instance.state, "shipped");
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{transitions} transitions in {secs:.3} s = {:.0} transitions/s",
        transitions as f64 / secs
    );
}
