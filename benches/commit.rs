//! Criterion benchmark of the saga commit path: a batch of inputs applied to a real
//! libmdbx store with full durability (one fsynced transaction per batch), no NATS.
//!
//! `cargo bench --bench commit`. Each iteration applies 256 `ledger` deposits spread over
//! the instances in turn (every instance already exists after the first round) and commits
//! them with the checkpoint, as the saga worker does; throughput is inputs per second. A
//! case without fsync shows what the disk costs.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use runner::config::{Durability, StorageConfig};
use runner::manifest;
use runner::storage::Store;
use runner::worker::apply_inputs;
use runner::worker::process::{Limits, RawInput};
use serde_json::json;

const BATCH: usize = 256;

fn deposit(account: u64, n: u64, seq: u64) -> RawInput {
    let body = json!({
        "v": 1, "event_id": format!("0190{seq:028x}"), "tenant_id": "bench",
        "event_type": "Deposited", "aggregate_type": "Account", "aggregate_id": format!("a{account}"),
        "timestamp_ms": 1_700_000_000_000u64 + seq, "payload": {"n": n, "amount": 1}, "metadata": {},
    });
    RawInput {
        subject: format!("tenant.bench.aggregate.Account.a{account}"),
        body: serde_json::to_vec(&body).unwrap().into(),
        traceparent: None,
        header_bytes: 0,
        refused: None,
        live_cap: None,
        timer_cap: None,
        source: format!("AGG:{seq}"),
        stored_ms: None,
    }
}

fn commit(c: &mut Criterion) {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/manifests/ledger.yaml");
    let catalog = manifest::load(&[manifest]).catalog.expect("catalog");
    let limits = Limits {
        allowed_tenants: Vec::new(),
        max_message_bytes: 1 << 20,
        max_payload: 1 << 20,
        max_output_bytes: usize::MAX,
        max_clock_skew_ms: runner::saga::DEFAULT_MAX_CLOCK_SKEW_MS,
        seal: runner::seal::Seal::none(),
    };
    let mut group = c.benchmark_group("commit");
    group.throughput(Throughput::Elements(BATCH as u64));
    group.sample_size(30);
    // The last case skips fsync, to show how much of a commit is the disk.
    for (instances, durability) in [
        (1_000u64, Durability::Full),
        (20_000, Durability::Full),
        (1_000, Durability::UnsafeNoSync),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&StorageConfig {
            data_dir: dir.path().to_path_buf(),
            durability,
            ..StorageConfig::default()
        })
        .expect("store");
        let mut counts = vec![0u64; instances as usize];
        let mut seq = 0u64;
        let mut next = 0u64;
        let mut make_batch = || {
            (0..BATCH)
                .map(|_| {
                    let a = next % instances;
                    next += 1;
                    seq += 1;
                    counts[a as usize] += 1;
                    (seq, deposit(a, counts[a as usize], seq))
                })
                .collect::<Vec<_>>()
        };
        // Create every instance first, so the measured batches update existing ones.
        for _ in 0..instances.div_ceil(BATCH as u64) {
            let b = make_batch();
            apply_inputs(&store, &catalog, &limits, "bench:AGG", &b).expect("warm");
        }
        group.bench_function(
            format!("batch_256_over_{instances}_instances_{durability:?}"),
            |b| {
                b.iter_batched(
                    &mut make_batch,
                    |batch| {
                        apply_inputs(&store, &catalog, &limits, "bench:AGG", &batch).expect("apply")
                    },
                    criterion::BatchSize::LargeInput,
                )
            },
        );
    }
    group.finish();
}

criterion_group!(benches, commit);
criterion_main!(benches);
