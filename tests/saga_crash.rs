//! Crash safety: 10 000 events while the runner is SIGKILLed at random moments and
//! restarted on the same data directory, again and again. At the end every instance equals
//! the reference (each account's deposits applied once, in order) and no output is
//! duplicated on the command stream. The restarts alternate the store's write path
//! (`storage.write_map` off, on, off, …), so kills land on both and each reopens what the
//! other left.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::{NatsServer, RunnerProc, aggregate_event, jetstream, read_stream};
use serde_json::json;

const ACCOUNTS: u64 = 200;
const PER_ACCOUNT: u64 = 50;

/// A small deterministic generator, so a failure can be replayed from its seed.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// The `n`th start: odd ones write the store through the memory map.
fn start(dir: tempfile::TempDir, url: &str, n: u32) -> RunnerProc {
    let write_map = if n % 2 == 1 { "true" } else { "false" };
    RunnerProc::saga(
        dir,
        url,
        "tests/manifests/ledger.yaml",
        &[("RUNNER__STORAGE__WRITE_MAP", write_map)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_moments_loses_and_duplicates_nothing() {
    let nats = NatsServer::start();
    let url = nats.url();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("seed {seed}");
    let mut rng = Lcg(seed);
    let mut runner = start(tempfile::tempdir().unwrap(), &url, 0);
    let js = jetstream(&url).await;

    // Publish 10 000 deposits, interleaving accounts, acks awaited in windows.
    let publisher = {
        let js = js.clone();
        tokio::spawn(async move {
            let mut amounts = HashMap::new();
            let mut pending = Vec::new();
            for n in 1..=PER_ACCOUNT {
                for a in 0..ACCOUNTS {
                    let id = format!("a-{a}");
                    let amount = (a * 7 + n * 13) % 100;
                    *amounts.entry(id.clone()).or_insert(0u64) += amount;
                    let ev = aggregate_event(
                        "bank",
                        "Account",
                        &id,
                        "Deposited",
                        1_800_000_000_000 + n,
                        json!({"n": n, "amount": amount}),
                    );
                    let mut h = async_nats::HeaderMap::new();
                    h.insert(
                        async_nats::header::NATS_MESSAGE_ID,
                        ev["event_id"].as_str().unwrap(),
                    );
                    let subject = format!("tenant.bank.aggregate.Account.{id}");
                    pending.push(
                        js.publish_with_headers(
                            subject,
                            h,
                            serde_json::to_vec(&ev).unwrap().into(),
                        )
                        .await
                        .unwrap(),
                    );
                    if pending.len() >= 200 {
                        for p in pending.drain(..) {
                            p.await.unwrap();
                        }
                        tokio::time::sleep(Duration::from_millis(60)).await;
                    }
                }
            }
            for p in pending.drain(..) {
                p.await.unwrap();
            }
            amounts
        })
    };

    // Kill and restart at random moments while the work goes on.
    let total = (ACCOUNTS * PER_ACCOUNT) as usize;
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut kills = 0;
    loop {
        // A start takes its partitions back within about two seconds (the member settles,
        // then reclaims its own leases at once): kills land anywhere in the work after it.
        tokio::time::sleep(Duration::from_millis(1500 + rng.next() % 2500)).await;
        let done = publisher.is_finished()
            && read_stream(&js, "WORKFLOW_COMMANDS", "tenant.>")
                .await
                .len()
                >= total;
        if done && kills >= 5 {
            break;
        }
        assert!(Instant::now() < deadline, "run did not complete in time");
        let dir = runner.kill();
        kills += 1;
        runner = start(dir, &url, kills);
    }
    let amounts = publisher.await.unwrap();
    // The drain is judged on a node that owns its partitions: one stopped before it takes
    // them has nothing of its own to flush (what its store holds waits for the partitions'
    // next owner, which republishes it under the same ids), so wait until the last start
    // owns every partition and has applied every deposit.
    let admin = runner.admin.clone();
    common::wait_until(
        "the last start owns every partition and applied every deposit",
        Duration::from_secs(120),
        || {
            let admin = admin.clone();
            async move { common::saga_progress(&admin, "AGGREGATE_EVENTS").await.0 >= total as u64 }
        },
    )
    .await;
    let dir = runner.stop();
    eprintln!("killed {kills} times");

    // Reference: each account saw deposits 1..=50 once, in order.
    let store = common::open_store(dir.path());
    let instances = store.read_blocking(|t| t.instances()).unwrap();
    // A clean drain leaves nothing behind in the outbox: published records were deleted.
    assert_eq!(store.read_blocking(|t| t.outbox_depth()).unwrap(), 0);
    assert_eq!(instances.len() as u64, ACCOUNTS);
    for i in &instances {
        assert_eq!(
            i.state, "open",
            "{} broke: an input was reordered or applied twice",
            i.correlation_id
        );
        assert_eq!(i.data["count"], json!(PER_ACCOUNT), "{}", i.correlation_id);
        assert_eq!(
            i.data["total"],
            json!(amounts[&i.correlation_id]),
            "{}",
            i.correlation_id
        );
        assert_eq!(i.applied, PER_ACCOUNT, "{}", i.correlation_id);
    }
    let outputs = read_stream(&js, "WORKFLOW_COMMANDS", "tenant.>").await;
    assert_eq!(outputs.len(), total, "outputs lost or duplicated");
    let mut seen = HashSet::new();
    for o in &outputs {
        assert!(seen.insert(o.msg_id.clone().unwrap()), "duplicate msg id");
        let key = (o.subject.clone(), o.body["payload"]["n"].to_string());
        assert!(seen.insert(format!("{key:?}")), "duplicate output {key:?}");
    }
    assert!(kills >= 5);
}
