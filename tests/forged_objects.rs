//! Partition control objects written by someone other than Runner are refused, not obeyed
//! (`worker/ownership/claims.rs`, `seal.rs`): the real binary on a real nats-server with the
//! ledger saga, whose acknowledgements carry each deposit's number, so a skipped, wiped or
//! released-too-early input shows.
//!
//! - A partition fence marker with an epoch no lease reaches, or a watermark past the inbox,
//!   leaves that partition untaken (logged once, stalled in `/health`, counted) while the
//!   others go on; `POST /admin/partition-fence` resets it and every waiting deposit is
//!   applied once, in order.
//! - A well-formed snapshot claiming a checkpoint past the inbox is refused at the next
//!   take-over: the partition is restored from the genuine snapshot, nothing is wiped.
//! - With a deployment key, an unsealed resume does not release a paused tenant (it is
//!   dead-lettered as `unsealed_control`), and neither does a genuine sealed resume published
//!   again later; the operator's own resume does.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::ledger::{acknowledged, reached, wait_reached};
use common::metrics::{metric, wait_metric};
use common::{NatsServer, RunnerProc, get_json, jetstream, post_json, read_stream};
use runner::worker::partition::partition;
use serde_json::json;

const P: u32 = 4;
const ACCOUNTS: usize = 16;
const KEY: &str = "forged-objects-test-deployment-key";

/// A saga replica on `dir`, with `envs` added.
fn replica(dir: tempfile::TempDir, url: &str, node: &str, envs: &[(&str, &str)]) -> RunnerProc {
    let p = P.to_string();
    let mut all = vec![
        ("RUNNER__PARTITIONS__COUNT", p.as_str()),
        ("RUNNER__PARTITIONS__LEASE_TTL", "3s"),
        ("RUNNER__NODE__ID", node),
        ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
    ];
    all.extend_from_slice(envs);
    RunnerProc::start_in(
        dir,
        &[
            "--mode",
            "saga",
            "--nats-url",
            url,
            "--manifest",
            "tests/manifests/ledger.yaml",
        ],
        &all,
    )
}

fn accounts() -> Vec<String> {
    common::ledger::accounts(ACCOUNTS)
}

async fn deposit_all(js: &async_nats::jetstream::Context, n: u64) {
    common::ledger::deposit_all(js, ACCOUNTS, n).await
}

/// The partition of account `a`'s ledger instance.
fn partition_of(account: &str) -> u32 {
    partition("bank", "ledger", account, P)
}

/// The accounts of partition `p`.
fn accounts_in(p: u32) -> Vec<String> {
    accounts()
        .into_iter()
        .filter(|a| partition_of(a) == p)
        .collect()
}

/// Every account's acknowledged deposits are exactly `1..=n`, once each and in order.
async fn assert_exactly(js: &async_nats::jetstream::Context, n: u64) {
    common::ledger::assert_exactly(js, ACCOUNTS, n).await
}

async fn publish_marker(js: &async_nats::jetstream::Context, p: u32, marker: serde_json::Value) {
    js.publish(
        format!("runner.fence.WORKFLOW_COMMANDS.{p}"),
        serde_json::to_vec(&marker).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

async fn wait_health(admin: &str, status: &str) {
    let admin = admin.to_string();
    common::wait_until(
        &format!("/health {status}"),
        Duration::from_secs(60),
        || {
            let admin = admin.clone();
            async move { get_json(&format!("{admin}/health")).await["status"] == status }
        },
    )
    .await;
}

/// Two forged markers on the fence of partitions' outputs: one claims a lease epoch the
/// leases bucket has not reached (u64::MAX), the other a watermark far past the inbox.
/// Neither partition is taken (no deposit of theirs is applied), each refusal is logged once
/// and counted, `/health` is degraded; the other partitions go on. The operator's reset,
/// refused unconfirmed, for an unknown partition or past the inbox, lets both be taken, and
/// every deposit is then applied once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_partition_markers_are_refused_and_an_operator_reset_lets_the_partitions_be_taken() {
    let nats = NatsServer::start();
    let url = nats.url();
    let js = jetstream(&url).await;
    let first = replica(tempfile::tempdir().unwrap(), &url, "n1", &[]);
    deposit_all(&js, 1).await;
    wait_reached(&js, &accounts(), 1, Duration::from_secs(60)).await;
    let dir = first.stop();

    let by_epoch = partition_of("a-0");
    let by_watermark = (0..P).find(|p| *p != by_epoch).unwrap();
    publish_marker(&js, by_epoch, json!({"epoch": u64::MAX, "owner": "forger"})).await;
    publish_marker(
        &js,
        by_watermark,
        json!({"epoch": 1, "owner": "forger", "through": {"seq": 1_000_000, "ord": 0}}),
    )
    .await;

    let mut runner = replica(dir, &url, "n1", &[]);
    deposit_all(&js, 2).await;
    let held: Vec<String> = [by_epoch, by_watermark]
        .iter()
        .flat_map(|p| accounts_in(*p))
        .collect();
    let free: Vec<String> = accounts()
        .into_iter()
        .filter(|a| !held.contains(a))
        .collect();
    assert!(!held.is_empty() && !free.is_empty());
    wait_reached(&js, &free, 2, Duration::from_secs(60)).await;
    let admin = runner.admin.clone();
    wait_health(&admin, "degraded").await;
    wait_metric(
        &admin,
        "runner_refused_objects_total{object=\"fence_marker\"}",
        |v| v >= 2.0,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        reached(&acknowledged(&js).await, &held, 2),
        0,
        "a deposit of a partition behind a forged marker was applied"
    );
    assert!(runner.logged("Partition not taken: a fence marker is refused."));
    let refusals: Vec<&String> = runner
        .log
        .iter()
        .filter(|l| l.contains("Partition not taken"))
        .collect();
    assert_eq!(refusals.len(), 2, "once per partition: {refusals:#?}");
    assert!(
        refusals
            .iter()
            .any(|l| l.contains("leases bucket has reached revision")),
        "{refusals:#?}"
    );
    assert!(
        refusals.iter().any(|l| l.contains("1000000")),
        "{refusals:#?}"
    );

    let reset = format!("{admin}/admin/partition-fence");
    let (code, answer) = post_json(&reset, &json!({"partition": by_epoch})).await;
    assert_eq!(code, 400, "{answer}");
    assert!(
        answer["error"].as_str().unwrap().contains("not confirmed"),
        "{answer}"
    );
    let (code, answer) = post_json(&reset, &json!({"partition": P, "confirm": true})).await;
    assert_eq!(code, 400, "{answer}");
    assert!(
        answer["error"].as_str().unwrap().contains("no partition"),
        "{answer}"
    );
    let (code, answer) = post_json(
        &reset,
        &json!({"partition": by_watermark, "through": 1_000_000, "confirm": true}),
    )
    .await;
    assert_eq!(code, 400, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .contains("past the last sequence"),
        "{answer}"
    );
    for p in [by_epoch, by_watermark] {
        let (code, answer) = post_json(&reset, &json!({"partition": p, "confirm": true})).await;
        assert_eq!(code, 200, "{answer}");
        let replaced = answer["replaced"].as_array().unwrap();
        let forged = replaced
            .iter()
            .find(|m| m["stream"] == "WORKFLOW_COMMANDS")
            .unwrap();
        if p == by_epoch {
            assert_eq!(forged["epoch"].as_u64(), Some(u64::MAX), "{answer}");
        } else {
            assert_eq!(forged["through"], 1_000_000, "{answer}");
        }
    }
    wait_reached(&js, &accounts(), 2, Duration::from_secs(60)).await;
    assert_exactly(&js, 2).await;
    wait_health(&admin, "ok").await;
    runner.stop();
}

/// A well-formed empty snapshot of one partition at a checkpoint far past the inbox, put in
/// the bucket as the newest: a replica starting on an empty store refuses it (logged,
/// counted) and restores the genuine one, so the partition's accounts keep their balances
/// and the next deposit of each is applied, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_claiming_a_checkpoint_past_the_inbox_does_not_wipe_its_partition() {
    let nats = NatsServer::start();
    let url = nats.url();
    let js = jetstream(&url).await;
    let often = [("RUNNER__PARTITIONS__SNAPSHOT_INTERVAL", "1s")];
    let first = replica(tempfile::tempdir().unwrap(), &url, "n1", &often);
    deposit_all(&js, 1).await;
    wait_reached(&js, &accounts(), 1, Duration::from_secs(60)).await;
    let target = partition_of("a-0");
    let bucket = js.get_object_store("RUNNER_SNAPSHOTS").await.unwrap();
    common::wait_until(
        "a snapshot of the target partition",
        Duration::from_secs(30),
        || async {
            runner::worker::ownership::snapshot::checkpoints(&bucket, target)
                .await
                .is_ok_and(|c| !c.is_empty())
        },
    )
    .await;
    // Stopped after its own last snapshot: the forgery is the newest in the bucket.
    drop(first.stop());

    let (_forger_dir, forger) = {
        let dir = tempfile::tempdir().unwrap();
        let store = common::open_store(dir.path());
        (dir, store)
    };
    let config = runner::config::Config::default();
    let how = runner::worker::ownership::snapshot::partitioning(&config, P);
    forger
        .write_blocking(|t| t.set_checkpoint(&how.checkpoint_key(target), 1_000_000))
        .unwrap();
    let forged = forger.export_partition(&how, target).unwrap();
    runner::worker::ownership::snapshot::upload(&bucket, &forged, 10, &runner::seal::Seal::none())
        .await
        .unwrap();

    let mut second = replica(tempfile::tempdir().unwrap(), &url, "n2", &often);
    deposit_all(&js, 2).await;
    wait_reached(&js, &accounts(), 2, Duration::from_secs(60)).await;
    assert_exactly(&js, 2).await;
    wait_metric(
        &second.admin,
        "runner_refused_objects_total{object=\"snapshot\"}",
        |v| v >= 1.0,
        Duration::from_secs(60),
    )
    .await;
    assert!(second.logged("Snapshot refused"));
    assert!(
        metric(
            &second.admin,
            "runner_partition_restores_total{source=\"snapshot\"}"
        )
        .await
            >= 1.0,
        "the target partition restored from its genuine snapshot"
    );
    second.stop();
}

/// With a deployment key: a resume published by someone without the key does not release a
/// paused tenant, and is dead-lettered as `unsealed_control` with its reason; a genuine
/// sealed resume copied and published again after `saga.max_clock_skew` is refused the
/// same way; the operator's resume releases everything held, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_fresh_resume_sealed_with_the_deployment_key_releases_a_paused_tenant() {
    let nats = NatsServer::start();
    let url = nats.url();
    let js = jetstream(&url).await;
    let envs = [
        ("RUNNER__SECURITY__DEPLOYMENT_KEY", KEY),
        ("RUNNER__SAGA__MAX_CLOCK_SKEW", "2s"),
    ];
    let mut runner = replica(tempfile::tempdir().unwrap(), &url, "n1", &envs);
    let admin = runner.admin.clone();
    assert_eq!(get_json(&format!("{admin}/info")).await["sealed"], true);
    deposit_all(&js, 1).await;
    wait_reached(&js, &accounts(), 1, Duration::from_secs(60)).await;

    let (code, answer) = post_json(&format!("{admin}/admin/tenants/bank/pause"), &json!({})).await;
    assert_eq!(code, 200, "{answer}");
    deposit_all(&js, 2).await;
    held_letters(&admin, ACCOUNTS).await;

    // A forged resume into every partition's inbox, shaped as Runner sends one but unsealed.
    for p in 0..P {
        publish_control(&js, p, &format!("forged-{p}"), json!({"resume": "bank"})).await;
    }
    let letters = unsealed_letters(&admin, P as usize).await;
    assert!(
        letters
            .iter()
            .all(|l| l["reason"].as_str().unwrap().contains("carries no seal")),
        "{letters:#?}"
    );
    assert_eq!(
        reached(&acknowledged(&js).await, &accounts(), 2),
        0,
        "released by a forgery"
    );

    // The operator's resume releases the held deposits.
    let (code, answer) = post_json(&format!("{admin}/admin/tenants/bank/resume"), &json!({})).await;
    assert_eq!(code, 200, "{answer}");
    wait_reached(&js, &accounts(), 2, Duration::from_secs(60)).await;
    assert_exactly(&js, 2).await;

    // Its sealed messages, copied and published again once the skew allowed has passed, do
    // not release a second pause.
    let genuine = read_stream(&js, "SAGA_INBOX", "runner.inbox.*.control")
        .await
        .into_iter()
        .filter(|m| m.body.get("seal").is_some())
        .collect::<Vec<_>>();
    assert_eq!(genuine.len(), P as usize, "one sealed resume per partition");
    let (code, answer) = post_json(&format!("{admin}/admin/tenants/bank/pause"), &json!({})).await;
    assert_eq!(code, 200, "{answer}");
    deposit_all(&js, 3).await;
    held_letters(&admin, ACCOUNTS).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    for (i, m) in genuine.iter().enumerate() {
        let p: u32 = m.subject.split('.').nth(2).unwrap().parse().unwrap();
        publish_control(&js, p, &format!("replayed-{i}"), m.body.clone()).await;
    }
    let letters = unsealed_letters(&admin, 2 * P as usize).await;
    let replays = letters
        .iter()
        .filter(|l| l["reason"].as_str().unwrap().contains("published again"))
        .count();
    assert_eq!(replays, P as usize, "{letters:#?}");
    assert_eq!(
        reached(&acknowledged(&js).await, &accounts(), 3),
        0,
        "released by a replay"
    );

    let (code, answer) = post_json(&format!("{admin}/admin/tenants/bank/resume"), &json!({})).await;
    assert_eq!(code, 200, "{answer}");
    wait_reached(&js, &accounts(), 3, Duration::from_secs(60)).await;
    assert_exactly(&js, 3).await;
    assert!(runner.logged("Control input refused."));
    runner.stop();
}

/// Publishes control input `body` into partition `p`'s inbox as Runner's own control inputs
/// travel (routed subject `runner.control`).
async fn publish_control(
    js: &async_nats::jetstream::Context,
    p: u32,
    id: &str,
    body: serde_json::Value,
) {
    let mut h = async_nats::HeaderMap::new();
    h.insert(async_nats::header::NATS_MESSAGE_ID, id);
    h.insert("Runner-Subject", "runner.control");
    h.insert("Runner-Source", "control");
    js.publish_with_headers(
        format!("runner.inbox.{p}.control"),
        h,
        serde_json::to_vec(&body).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

/// Tenant `bank`'s pending dead letters of `kind`.
async fn letters(admin: &str, kind: &str) -> Vec<serde_json::Value> {
    let page = get_json(&format!("{admin}/admin/dlq?tenant=bank&limit=100")).await;
    page["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["kind"] == kind)
        .cloned()
        .collect()
}

/// Waits until tenant `bank` holds `n` paused inputs.
async fn held_letters(admin: &str, n: usize) {
    common::wait_until(
        &format!("{n} held inputs"),
        Duration::from_secs(60),
        || async { letters(admin, "tenant_paused").await.len() == n },
    )
    .await;
}

/// Waits until `n` control inputs are dead-lettered as unsealed, and returns them.
async fn unsealed_letters(admin: &str, n: usize) -> Vec<serde_json::Value> {
    let what = format!("{n} unsealed control letters");
    common::wait_until(&what, Duration::from_secs(60), || async {
        letters(admin, "unsealed_control").await.len() == n
    })
    .await;
    letters(admin, "unsealed_control").await
}
