//! `runner-bench gauge`: a fixed amount of CPU work on one thread, timed, so that rates
//! measured on different days can be put side by side. This machine's speed moves by up to
//! 2× from one day to the next; a rate divided by the gauge of its run moves much less.
//!
//! The work is a unit of what the runner's CPU does per input, with no I/O and no other
//! thread: parse a fixed order event (about 400 bytes of JSON) into a value tree, read
//! three fields, write it back out, and hash what was written with SHA-256. The unit never
//! changes; a change to it would make old gauges incomparable, so it is versioned in the
//! line it prints (`gauge v1`).
//!
//! What it is not: a measure of the broker or of the disk, or of more than one core. It
//! says how fast one core of this machine was while the run was measured.

use std::time::Instant;

use anyhow::Result;
use sha2::{Digest, Sha256};

/// Units per timed pass.
const UNITS: u32 = 50_000;
/// Timed passes; the median is reported.
const PASSES: usize = 5;

#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    /// Label printed with the figure (for example `before` or `after`).
    #[arg(long, default_value = "")]
    label: String,
}

/// The fixed order event every unit parses.
const EVENT: &str = r#"{"v":1,"event_id":"0b6f8a52-6c1d-4f57-9d7e-3e2f1a9c4d10","tenant_id":"acme","aggregate_type":"Order","aggregate_id":"o-123456","event_type":"OrderPlaced","occurred_at":"2026-11-28T08:00:00Z","payload":{"order_id":"o-123456","customer_id":"c-98765","amount_cents":12999,"currency":"EUR","items":[{"sku":"book-1","qty":1,"price_cents":4999},{"sku":"pen-7","qty":4,"price_cents":2000}],"shipping":{"country":"DE","zip":"10115","express":false}}}"#;

/// One unit of work; returns a byte of the digest so that nothing is optimised away.
fn unit(i: u32) -> u8 {
    let mut v: serde_json::Value = serde_json::from_str(EVENT).expect("fixed JSON");
    let amount = v["payload"]["amount_cents"].as_u64().unwrap_or(0);
    let items = v["payload"]["items"].as_array().map_or(0, Vec::len) as u64;
    v["payload"]["amount_cents"] = (amount + u64::from(i % 7) + items).into();
    let out = serde_json::to_vec(&v).expect("serialises");
    Sha256::digest(&out)[0]
}

/// Units per second on one thread: the median of [`PASSES`] timed passes after a warm-up.
pub(crate) fn measure() -> f64 {
    let mut sink = 0u8;
    for i in 0..UNITS / 10 {
        sink ^= unit(i);
    }
    let mut rates: Vec<f64> = (0..PASSES)
        .map(|_| {
            let started = Instant::now();
            for i in 0..UNITS {
                sink ^= unit(i);
            }
            f64::from(UNITS) / started.elapsed().as_secs_f64()
        })
        .collect();
    std::hint::black_box(sink);
    rates.sort_by(f64::total_cmp);
    rates[PASSES / 2]
}

/// Prints the gauge line.
pub(crate) fn run(a: Args) -> Result<()> {
    let rate = measure();
    let label = if a.label.is_empty() {
        String::new()
    } else {
        format!(" ({})", a.label)
    };
    println!(
        "gauge v1{label}: {:.1} k units/s on one core (fixed JSON parse, write and SHA-256 of a 400 B event; divide a rate by it to compare days)",
        rate / 1000.0
    );
    Ok(())
}
