//! Routing is shared: each source stream is routed as shares, each under a lease of its own,
//! spread over the replicas. Three saga replicas on one nats-server (the `ledger` saga, whose
//! acknowledgements carry each deposit's number): every replica routes some shares and
//! together they route all of them; SIGKILL of one replica stalls only the inputs of its
//! shares (and partitions) while every other account's next deposit is applied; the killed
//! shares are taken over after about one lease TTL, and every account ends with each
//! deposit acknowledged once, in order. And while a replica of an earlier release holds a
//! source's single-router lease, no share of that source routes beside it.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::ledger::{self, acknowledged, reached, wait_reached};
use common::{NatsServer, RunnerProc, get_json, jetstream};
use runner::worker::ownership::router::share::{SHARES, share_of};
use runner::worker::partition::partition;

const P: u32 = 12;
const ACCOUNTS: usize = 48;

fn replica(url: &str, node: &str) -> RunnerProc {
    replica_in(tempfile::tempdir().unwrap(), url, node)
}

/// A saga replica named `node` on the data directory `dir`.
fn replica_in(dir: tempfile::TempDir, url: &str, node: &str) -> RunnerProc {
    let p = P.to_string();
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
        &[
            ("RUNNER__PARTITIONS__COUNT", p.as_str()),
            ("RUNNER__PARTITIONS__LEASE_TTL", "5s"),
            ("RUNNER__NODE__ID", node),
            ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
        ],
    )
}

/// The shares and partitions a replica reports holding.
async fn holds(r: &RunnerProc) -> (BTreeSet<String>, BTreeSet<u32>) {
    let info = get_json(&format!("{}/info", r.admin)).await;
    let shares = info["partitions"]["routing"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    let owned = info["partitions"]["owned"]
        .as_object()
        .map(|m| m.keys().map(|k| k.parse().unwrap()).collect())
        .unwrap_or_default();
    (shares, owned)
}

fn accounts() -> Vec<String> {
    ledger::accounts(ACCOUNTS)
}

async fn deposit_all(js: &async_nats::jetstream::Context, n: u64) {
    ledger::deposit_all(js, ACCOUNTS, n).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_spread_over_the_replicas_and_a_killed_router_stalls_only_its_share() {
    let nats = NatsServer::start();
    let url = nats.url();
    let js = jetstream(&url).await;
    let mut replicas: Vec<RunnerProc> = ["r1", "r2", "r3"]
        .iter()
        .map(|n| replica(&url, n))
        .collect();

    // Routing is shared: each replica routes some shares, together all of them (two
    // sources), and the partitions are divided too.
    let total = 2 * SHARES as usize;
    let deadline = Instant::now() + Duration::from_secs(90);
    let held = loop {
        let mut held = Vec::new();
        for r in &replicas {
            held.push(holds(r).await);
        }
        let shares: BTreeSet<&String> = held.iter().flat_map(|(s, _)| s).collect();
        let counts: Vec<usize> = held.iter().map(|(s, _)| s.len()).collect();
        let owned: usize = held.iter().map(|(_, o)| o.len()).sum();
        if shares.len() == total
            && counts.iter().sum::<usize>() == total
            && counts.iter().all(|c| *c >= 2)
            && owned == P as usize
        {
            println!("shares routed per replica: {counts:?}");
            break held;
        }
        assert!(
            Instant::now() < deadline,
            "routing not spread after 90 s: {held:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    // Everyone's first deposit goes through.
    deposit_all(&js, 1).await;
    let names = accounts();
    wait_reached(&js, &names, 1, Duration::from_secs(60)).await;

    // The victim: a replica routing a share of the aggregate stream. Its accounts are those
    // in its shares or its partitions; every other account must not wait for it.
    let victim = held
        .iter()
        .position(|(s, _)| s.iter().any(|s| s.starts_with("AGGREGATE_EVENTS/")))
        .unwrap();
    let (shares, owned) = &held[victim];
    let (mut stalled, mut free) = (Vec::new(), Vec::new());
    for a in 0..ACCOUNTS {
        let (subject, _) = common::ledger_deposit(a, 1);
        let name = format!("a-{a}");
        let share = format!("AGGREGATE_EVENTS/{}", share_of(&subject));
        let p = partition("bank", "ledger", &name, P);
        if shares.contains(&share) {
            stalled.push(name);
        } else if !owned.contains(&p) {
            free.push(name);
        }
    }
    assert!(
        !stalled.is_empty() && !free.is_empty(),
        "{} accounts in the victim's shares, {} clear of it",
        stalled.len(),
        free.len()
    );
    let _ = replicas.remove(victim).kill();
    let killed = Instant::now();
    deposit_all(&js, 2).await;

    // Every account clear of the victim gets its second deposit applied while the victim's
    // shares wait for their leases to expire.
    wait_reached(&js, &free, 2, Duration::from_secs(60)).await;
    let free_after = killed.elapsed();
    let acks = acknowledged(&js).await;
    let waiting = stalled.len() - reached(&acks, &stalled, 2);
    println!(
        "{} accounts clear of the victim applied {free_after:?} after the kill; {waiting} of {} in its shares still waiting",
        free.len(),
        stalled.len()
    );
    assert!(
        waiting > 0,
        "the victim's shares were routed before its leases could expire"
    );

    // Its shares are taken over after about a TTL; every deposit is acknowledged once, in
    // order.
    wait_reached(&js, &names, 2, Duration::from_secs(120)).await;
    println!(
        "every account applied {:?} after the kill",
        killed.elapsed()
    );
    ledger::assert_exactly(&js, ACCOUNTS, 2).await;
    for r in replicas {
        r.stop();
    }
}

/// A replica of an earlier release routes each source with one router under the lease
/// `r.<source>`. While another process holds that lease, no share of the source is routed
/// here (two routers would copy the same inputs); once it is gone, the shares start where
/// the single router's marker says and route what waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_share_routes_while_an_earlier_release_s_single_router_holds_its_lease() {
    let nats = NatsServer::start();
    let url = nats.url();
    let js = jetstream(&url).await;
    // A first start creates the buckets and streams; then the "old release" takes the
    // aggregate stream's single-router lease.
    let first = replica(&url, "new");
    let admin = first.admin.clone();
    common::wait_until("the shares are routed", Duration::from_secs(30), || {
        let admin = admin.clone();
        async move {
            let info = get_json(&format!("{admin}/info")).await;
            info["partitions"]["routing"]
                .as_object()
                .map_or(0, |m| m.len())
                == 2 * SHARES as usize
        }
    })
    .await;
    let data = first.stop();
    let leases = js.get_key_value("RUNNER_LEASES").await.unwrap();
    let old = serde_json::json!({"owner": "old-release", "nonce": "n-1"});
    leases
        .put(
            "r.AGGREGATE_EVENTS",
            serde_json::to_vec(&old).unwrap().into(),
        )
        .await
        .unwrap();

    let mut runner = replica_in(data, &url, "new");
    deposit_all(&js, 1).await;
    common::wait_until("the wait is logged", Duration::from_secs(30), || {
        let logged = runner.logged("A replica of an earlier release routes this source");
        async move { logged }
    })
    .await;
    // Keep the old router's lease alive a while: nothing of the aggregate stream is routed.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        leases
            .put(
                "r.AGGREGATE_EVENTS",
                serde_json::to_vec(&old).unwrap().into(),
            )
            .await
            .unwrap();
    }
    let info = get_json(&format!("{}/info", runner.admin)).await;
    let routing = info["partitions"]["routing"].as_object().unwrap().clone();
    assert!(
        routing.keys().all(|k| !k.starts_with("AGGREGATE_EVENTS/")),
        "a share of the aggregate stream routed beside the old router: {routing:?}"
    );
    assert!(acknowledged(&js).await.is_empty(), "a deposit was routed");

    // The old router is gone: the shares take over and route what waited, once each.
    leases.delete("r.AGGREGATE_EVENTS").await.unwrap();
    let names = accounts();
    wait_reached(&js, &names, 1, Duration::from_secs(60)).await;
    for (account, ns) in acknowledged(&js).await {
        assert_eq!(ns, vec![1], "{account}");
    }
    runner.stop();
}

/// A forged marker on a share's fence (a watermark far past the source) is refused, not
/// obeyed: the share routes nothing rather than skip every input up
/// to the forged watermark, the other shares go on, the refusal is logged once and the
/// share shows as stalled in `/health` and `runner_pipeline_stalled_stages`. An operator
/// resets the fence (`POST /admin/router-fence`, confirmed, at a sequence the source holds)
/// and the waiting inputs are applied, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_share_marker_is_refused_and_an_operator_reset_resumes_routing() {
    let nats = NatsServer::start();
    let url = nats.url();
    let js = jetstream(&url).await;
    let first = replica(&url, "n1");
    deposit_all(&js, 1).await;
    let names = accounts();
    wait_reached(&js, &names, 1, Duration::from_secs(60)).await;
    drop(first);

    // The forgery: the share of account a-0 is "routed" far past the source, under an
    // epoch a lease would beat (so the raise succeeds and only the watermark is wrong).
    let (subject, _) = common::ledger_deposit(0, 1);
    let share = format!("AGGREGATE_EVENTS/{}", share_of(&subject));
    let forged = serde_json::json!({
        "epoch": 1, "owner": "forger", "through": {"seq": 1_000_000, "ord": 0}
    });
    js.publish(
        format!("runner.fence.SAGA_INBOX.{share}"),
        serde_json::to_vec(&forged).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();

    let mut runner = replica(&url, "n2");
    deposit_all(&js, 2).await;
    let (mut held, mut free) = (Vec::new(), Vec::new());
    for a in 0..ACCOUNTS {
        let (subject, _) = common::ledger_deposit(a, 2);
        if format!("AGGREGATE_EVENTS/{}", share_of(&subject)) == share {
            held.push(format!("a-{a}"));
        } else {
            free.push(format!("a-{a}"));
        }
    }
    wait_reached(&js, &free, 2, Duration::from_secs(60)).await;
    common::wait_until("the refusal logged", Duration::from_secs(30), || {
        let logged = runner.logged("Share not routed: its fence cannot be raised.");
        async move { logged }
    })
    .await;
    let admin = runner.admin.clone();
    common::wait_until(
        "the share stalled in /health",
        Duration::from_secs(60),
        || {
            let admin = admin.clone();
            async move { get_json(&format!("{admin}/health")).await["status"] == "degraded" }
        },
    )
    .await;
    assert!(common::metrics::metric(&admin, "runner_pipeline_stalled_stages").await >= 1.0);
    assert_eq!(
        reached(&acknowledged(&js).await, &held, 2),
        0,
        "an input of the forged share was applied"
    );
    let refusals = runner
        .log
        .iter()
        .filter(|l| l.contains("Share not routed"))
        .count();
    assert_eq!(refusals, 1, "the refusal is logged once per episode");

    // The operator's reset: refused unconfirmed or past the source; confirmed at the last
    // sequence the first round reached, the share routes the rest.
    let url_reset = format!("{admin}/admin/router-fence");
    let body = |through: u64, confirm: bool| serde_json::json!({"share": share, "through": through, "confirm": confirm});
    let (code, answer) = common::post_json(&url_reset, &body(ACCOUNTS as u64, false)).await;
    assert_eq!(code, 400, "{answer}");
    assert!(
        answer["error"].as_str().unwrap().contains("not confirmed"),
        "{answer}"
    );
    let (code, answer) = common::post_json(&url_reset, &body(1_000_000, true)).await;
    assert_eq!(code, 400, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .contains("past the last sequence"),
        "{answer}"
    );
    let (code, answer) = common::post_json(&url_reset, &body(ACCOUNTS as u64, true)).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["replaced"]["through"], 1_000_000, "{answer}");
    wait_reached(&js, &names, 2, Duration::from_secs(60)).await;
    for (account, ns) in acknowledged(&js).await {
        assert_eq!(ns, vec![1, 2], "{account}");
    }
    common::wait_until("healthy again", Duration::from_secs(30), || {
        let admin = admin.clone();
        async move { get_json(&format!("{admin}/health")).await["status"] == "ok" }
    })
    .await;
    runner.stop();
}

/// A share marker whose tenant lane claims inputs past the source (a forgery: its watermark
/// is plausible) is refused like a forged watermark: the share is not routed, rather than
/// skipping that tenant's inputs up to the claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_share_marker_whose_lane_claims_past_the_source_is_refused() {
    let nats = NatsServer::start();
    let url = nats.url();
    let js = jetstream(&url).await;
    let (subject, _) = common::ledger_deposit(0, 1);
    let share = format!("AGGREGATE_EVENTS/{}", share_of(&subject));
    let forged = serde_json::json!({
        "epoch": 1, "owner": "forger", "lanes": {"bank": 1_000_000}
    });
    // The streams exist once a replica has started; the forgery goes in before the next.
    drop(replica(&url, "n1"));
    js.publish(
        format!("runner.fence.SAGA_INBOX.{share}"),
        serde_json::to_vec(&forged).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let mut runner = replica(&url, "n2");
    common::wait_until("the refusal logged", Duration::from_secs(30), || {
        let logged = runner.logged("Share not routed: its fence cannot be raised.");
        async move { logged }
    })
    .await;
    let refused = common::metrics::metric(
        &runner.admin,
        "runner_refused_objects_total{object=\"fence_marker\"}",
    )
    .await;
    assert!(refused >= 1.0, "{refused}");
}
