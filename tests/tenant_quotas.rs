//! Per-tenant quotas beyond the inbox rate (`tenant_fairness.rs` has that one), against the
//! real binary in combined mode, a real nats-server and a real HTTP upstream:
//! - an effect rate limit (`tenancy.effect_rate_limits`) holds one tenant's calls of one
//!   effect, in order, while another tenant's run; nothing is dropped, each call happens
//!   once, and the held turns, calls and applied inputs are counted per tenant;
//! - the limits are reloaded from the config file without a restart (`runner tenants
//!   reload`), and a file with a bad limit is refused naming its line and key while the
//!   limits in force stay;
//! - a cap on running instances (`tenancy.live_instance_caps`) runs exactly the cap and
//!   holds the rest whole, in order, until others end, a reloaded cap included; and it
//!   holds the same across a replica's death and its partition's take-over;
//! - a cap on pending timers (`tenancy.pending_timer_caps`) starts new sagas only while the
//!   tenant has fewer timers pending than the cap, holds the rest whole until timers fire,
//!   and lets every one of them run, once;
//! - a cap on outbox bytes (`tenancy.outbox_byte_caps`) holds a tenant's new inputs at the
//!   routers while its outputs wait unpublished (the commands stream refusing everything),
//!   lets another tenant's in, and lets the held ones go once the outputs are published.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::jobs::{called, finished, tenant_row};
use common::metrics::{metric, metric_or_zero};
use common::upstream::{Reply, Upstream};
use common::{NatsServer, RunnerProc, jetstream, jobs, read_stream};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_rate_limit_holds_one_tenants_calls_in_order_while_others_run() {
    const JOBS: usize = 12;
    let nats = NatsServer::start();
    let upstream = Upstream::start(Arc::new(|_, _, _| Reply::ok(json!({})))).await;
    let manifests = jobs::manifests(&upstream);
    let runner = RunnerProc::combined(
        &nats.url(),
        manifests.path().to_str().unwrap(),
        &[
            ("RUNNER__TENANCY__EFFECT_RATE_LIMITS__A__PING", "2"),
            ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
            ("RUNNER__PARTITIONS__COUNT", "8"),
        ],
    );
    let js = jetstream(&nats.url()).await;

    let started = Instant::now();
    jobs::start(&js, "a", 0, JOBS as u64).await;
    jobs::start(&js, "b", 0, 3).await;
    let b_done = common::eventually(Duration::from_secs(30), || async {
        finished(&js, "b").await.len() == 3
    })
    .await;
    assert!(b_done, "B's sagas did not finish behind A's held calls");
    let a_when_b_done = called(&upstream, "a").len();
    assert!(
        a_when_b_done < JOBS,
        "all {a_when_b_done} of A's calls ran before B's sagas finished: the limit held nothing"
    );
    let a_done = common::eventually(Duration::from_secs(60), || async {
        finished(&js, "a").await.len() == JOBS
    })
    .await;
    assert!(a_done, "A's held calls did not all run");
    // Ten past the two saved up, at two a second: no sooner than about five seconds.
    assert!(
        started.elapsed() >= Duration::from_secs(4),
        "A's {JOBS} calls ran faster than the limit allows: {:?}",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Each call once, and A's in the order its commands were stored (those after the two
    // saved up start one by one).
    let calls = called(&upstream, "a");
    let mut once = calls.clone();
    once.sort_unstable();
    once.dedup();
    assert_eq!(once.len(), JOBS, "each of A's jobs called once: {calls:?}");
    assert_eq!(calls.len(), JOBS, "no call repeated: {calls:?}");
    let stored: Vec<String> = read_stream(&js, "WORKFLOW_COMMANDS", "tenant.a.effect.ping.*")
        .await
        .iter()
        .map(|s| s.body["payload"]["job"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(stored.len(), JOBS);
    assert_eq!(
        calls[2..],
        stored[2..],
        "A's held calls ran out of their stored order"
    );

    let admin = &runner.admin;
    let held = metric(
        admin,
        "runner_tenant_effect_rate_limited_total{effect=\"ping\",tenant=\"a\"}",
    )
    .await;
    assert!(held >= 1.0, "the held turns were not counted: {held}");
    let a_calls = metric(
        admin,
        "runner_tenant_effect_calls_total{effect=\"ping\",tenant=\"a\"}",
    )
    .await;
    assert_eq!(a_calls, JOBS as f64);
    // B is named nowhere in [tenancy]: its series is `other`.
    let b_calls = metric(
        admin,
        "runner_tenant_effect_calls_total{effect=\"ping\",tenant=\"other\"}",
    )
    .await;
    assert_eq!(b_calls, 3.0);
    // Two transitions per job: the trigger and the ping result.
    let applied = metric(admin, "runner_tenant_applied_total{tenant=\"a\"}").await;
    assert_eq!(applied, (2 * JOBS) as f64);
    let a = tenant_row(admin, "a").await;
    assert_eq!(a["effect_rate_limits_per_s"], json!({"ping": 2.0}), "{a}");
    runner.stop();
}

/// The config file of the reload test, with `[tenancy]` as given.
fn write_config(path: &std::path::Path, tenancy: &str) {
    std::fs::write(
        path,
        format!("[storage]\ndurability = \"unsafe_no_sync\"\n\n[tenancy]\n{tenancy}\n"),
    )
    .unwrap();
}

/// A combined runner reading the config file `config` (which a test rewrites and reloads),
/// with `partitions` partitions.
fn combined_on(
    config: &std::path::Path,
    nats: &NatsServer,
    manifests: &tempfile::TempDir,
    partitions: &str,
) -> RunnerProc {
    RunnerProc::start(
        &[
            "--config",
            config.to_str().unwrap(),
            "--mode",
            "combined",
            "--nats-url",
            &nats.url(),
            "--manifest",
            manifests.path().to_str().unwrap(),
        ],
        &[("RUNNER__PARTITIONS__COUNT", partitions)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_reload_without_a_restart_and_a_bad_file_changes_nothing() {
    const JOBS: usize = 60;
    let nats = NatsServer::start();
    let upstream = Upstream::start(Arc::new(|_, _, _| Reply::ok(json!({})))).await;
    let manifests = jobs::manifests(&upstream);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("runner.toml");
    write_config(&config, "rate_limits = { a = 1.0 }");
    let runner = combined_on(&config, &nats, &manifests, "8");
    let js = jetstream(&nats.url()).await;
    let admin = runner.admin.clone();
    let reload = || {
        common::run_to_exit(
            &["tenants", "--admin", &admin, "reload"],
            &[],
            Duration::from_secs(30),
        )
    };

    // At one a second, A's sixty are held.
    jobs::start(&js, "a", 0, JOBS as u64).await;
    let some = common::eventually(Duration::from_secs(30), || async {
        finished(&js, "a").await.len() >= 2
    })
    .await;
    assert!(some, "A's first sagas did not finish");
    assert_eq!(
        tenant_row(&admin, "a").await["rate_limit_per_s"],
        json!(1.0)
    );

    // A bad limit is refused with its place in the file; the limit in force stays.
    write_config(&config, "rate_limits = { a = -5.0 }");
    let (code, out) = reload();
    assert_ne!(code, Some(0), "a bad limit was accepted: {out}");
    assert!(
        out.contains("tenancy.rate_limits.a") && out.contains("runner.toml:5:"),
        "the refusal does not name the file, line and key: {out}"
    );
    assert_eq!(
        tenant_row(&admin, "a").await["rate_limit_per_s"],
        json!(1.0)
    );
    assert!(
        finished(&js, "a").await.len() < JOBS,
        "A finished while still limited to one a second"
    );

    // Raised in the file and reloaded: A's held sagas go in at the new rate, each once.
    write_config(&config, "rate_limits = { a = 1000.0 }\nweights = { a = 2 }");
    let (code, out) = reload();
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("tenancy.rate_limits.a") && out.contains("tenancy.weights.a"),
        "the reload does not name what changed: {out}"
    );
    let a = tenant_row(&admin, "a").await;
    assert_eq!(a["rate_limit_per_s"], json!(1000.0), "{a}");
    assert_eq!(a["weight"], json!(2), "{a}");
    // At the old limit the rest would take about a minute; this waits at most half that.
    let done = common::eventually(Duration::from_secs(30), || async {
        finished(&js, "a").await.len() == JOBS
    })
    .await;
    assert!(done, "A's held sagas did not go in at the reloaded limit");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut calls = called(&upstream, "a");
    assert_eq!(calls.len(), JOBS, "each job called once");
    calls.sort_unstable();
    calls.dedup();
    assert_eq!(calls.len(), JOBS);

    // A key that only a restart changes is named as such, and not applied; a limit on an
    // effect no manifest declares (misspelt) is applied but answered with a warning.
    write_config(
        &config,
        "rate_limits = { a = 1000.0 }\nread_ahead = 7\neffect_rate_limits.a = { pnig = 1.0 }",
    );
    let (code, out) = reload();
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("at_next_start") && out.contains("tenancy.read_ahead"),
        "a key read at start only is not named: {out}"
    );
    assert!(
        out.contains("tenancy.effect_rate_limits.a.pnig") && out.contains("holds nothing"),
        "a limit on an undeclared effect is not warned of: {out}"
    );
    runner.stop();
}

/// A cap on running instances (`tenancy.live_instance_caps`): with its calls hanging, A runs
/// exactly its cap while its other triggers, and a later input of a held key, are held
/// whole; B runs meanwhile; a reloaded, higher cap lets more of A's in as its next trigger
/// arrives; when the upstream answers, every held saga is applied in order and finishes
/// once, and nothing is held any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_on_running_instances_holds_a_tenants_new_sagas_until_its_others_end() {
    let nats = NatsServer::start();
    let (hold, upstream, manifests) = jobs::held_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("runner.toml");
    write_config(&config, "live_instance_caps = { a = 3 }");
    // One partition, whose part of the cap is the whole cap.
    let runner = combined_on(&config, &nats, &manifests, "1");
    let js = jetstream(&nats.url()).await;
    let admin = runner.admin.clone();
    let row = |t: &'static str| {
        let admin = admin.clone();
        async move { tenant_row(&admin, t).await }
    };

    jobs::start(&js, "a", 0, 10).await;
    jobs::start(&js, "b", 0, 2).await;
    let settled = common::eventually(Duration::from_secs(30), || async {
        called(&upstream, "b").len() == 2 && row("a").await["held_at_cap"] == 7
    })
    .await;
    assert!(
        settled,
        "a: {} b calls: {:?}",
        row("a").await,
        called(&upstream, "b")
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Which three depends on the order the routers' shares copied A's triggers into the
    // inbox; how many does not.
    let a_first = called(&upstream, "a");
    assert_eq!(a_first.len(), 3, "A runs its cap: {a_first:?}");
    let a = row("a").await;
    assert_eq!(a["live_instances"], 3, "{a}");
    assert_eq!(a["live_instance_cap"], 3, "{a}");
    assert_eq!(
        row("b").await["live_instances"],
        2,
        "B is not held by A's cap"
    );
    // A second input of a held key waits whole behind the first.
    let held_key = (0..10)
        .map(|i| format!("a-{i}"))
        .find(|j| !a_first.contains(j))
        .unwrap();
    let again = common::aggregate_event(
        "a",
        "Job",
        &held_key,
        "JobStarted",
        1_800_000_000_999,
        json!({}),
    );
    common::publish_json(&js, &format!("tenant.a.aggregate.Job.{held_key}"), &again).await;
    let behind = common::eventually(Duration::from_secs(30), || async {
        row("a").await["held_at_cap"] == 8
    })
    .await;
    assert!(behind, "{}", row("a").await);
    let held = metric(
        &admin,
        "runner_saga_transitions_total{outcome=\"held\",saga=\"job\"}",
    )
    .await;
    assert_eq!(held, 8.0, "each held input is counted");
    // The same, on the tenant's gauges (set every two seconds from the store).
    let gauges = common::eventually(Duration::from_secs(10), || async {
        metric_or_zero(&admin, "runner_tenant_held_at_cap{tenant=\"a\"}").await == 8.0
            && metric_or_zero(&admin, "runner_tenant_live_instances{tenant=\"a\"}").await == 3.0
    })
    .await;
    assert!(gauges, "runner_tenant_held_at_cap / live_instances of a");
    assert!(
        metric(
            &admin,
            "runner_tenant_oldest_held_at_cap_seconds{tenant=\"a\"}"
        )
        .await
            > 0.0,
        "the oldest held input's age"
    );

    // A raised cap, reloaded, goes with A's inputs copied after it: the next trigger first
    // lets the oldest held keys in, up to the new cap, then waits its turn.
    write_config(&config, "live_instance_caps = { a = 5 }");
    let (code, out) = common::run_to_exit(
        &["tenants", "--admin", &admin, "reload"],
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("tenancy.live_instance_caps"), "{out}");
    jobs::start(&js, "a", 10, 11).await;
    let raised = common::eventually(Duration::from_secs(30), || async {
        called(&upstream, "a").len() == 5
    })
    .await;
    assert!(raised, "{:?}", called(&upstream, "a"));
    let let_in = called(&upstream, "a")[3..].to_vec();
    assert!(
        let_in.iter().all(|j| !a_first.contains(j) && j != "a-10"),
        "held keys go before the trigger that raised the cap: {let_in:?}"
    );
    let a = row("a").await;
    assert_eq!(a["live_instances"], 5, "{a}");
    // Eight held, two keys let in (with the second input of `held_key` if it was one of
    // them), a-10 held behind them.
    let gone = 2 + usize::from(let_in.contains(&held_key));
    assert_eq!(a["held_at_cap"], 8 - gone + 1, "{a}");

    // The upstream answers: every saga finishes once, A's held ones as others end.
    hold.release();
    let done = common::eventually(Duration::from_secs(60), || async {
        finished(&js, "a").await.len() == 11 && finished(&js, "b").await.len() == 2
    })
    .await;
    assert!(done, "a finished {}", finished(&js, "a").await.len());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut calls = called(&upstream, "a");
    assert_eq!(calls.len(), 11, "one call per A saga: {calls:?}");
    calls.sort_unstable();
    calls.dedup();
    assert_eq!(calls.len(), 11, "each A saga called once");
    assert_eq!(finished(&js, "a").await.len(), 11);
    let a = row("a").await;
    assert_eq!(a["live_instances"], 0, "{a}");
    assert_eq!(a["held_at_cap"], 0, "{a}");
    let cleared = common::eventually(Duration::from_secs(10), || async {
        metric(&admin, "runner_tenant_held_at_cap{tenant=\"a\"}").await == 0.0
            && metric(
                &admin,
                "runner_tenant_oldest_held_at_cap_seconds{tenant=\"a\"}",
            )
            .await
                == 0.0
    })
    .await;
    assert!(cleared, "the gauges go back to 0 once nothing is held");
    runner.stop();
}

/// Partitions owned by the replica at `admin`.
async fn owned(admin: &str) -> u64 {
    common::get_json(&format!("{admin}/info")).await["saga_progress"]["partitions_owned"]
        .as_u64()
        .unwrap()
}

/// The cap survives a replica's death: two combined replicas with a partition each and A
/// capped at one running saga per partition; one is killed while A's calls hang, and the
/// survivor, taking its partition over from the store snapshot and the inbox, decides as
/// its predecessor did: no more of A's sagas start, every held one is still held, and when
/// the upstream answers, all of them finish, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_holds_across_a_take_over_and_nothing_held_is_lost() {
    const JOBS: u64 = 8;
    let nats = NatsServer::start();
    let (hold, upstream, manifests) = jobs::held_upstream().await;
    let m = manifests.path().to_str().unwrap();
    let envs = |id: &'static str| {
        [
            ("RUNNER__NODE__ID", id),
            ("RUNNER__PARTITIONS__COUNT", "2"),
            ("RUNNER__TENANCY__LIVE_INSTANCE_CAPS__A", "2"),
            ("RUNNER__PARTITIONS__LEASE_TTL", "3s"),
        ]
    };
    let first = RunnerProc::combined(&nats.url(), m, &envs("first"));
    let second = RunnerProc::combined(&nats.url(), m, &envs("second"));
    let divided = common::eventually(Duration::from_secs(60), || async {
        owned(&first.admin).await == 1 && owned(&second.admin).await == 1
    })
    .await;
    assert!(divided, "the two partitions were not divided");
    let js = jetstream(&nats.url()).await;
    jobs::start(&js, "a", 0, JOBS).await;
    let held_on = |admins: Vec<String>| async move {
        let mut n = 0;
        for a in &admins {
            n += tenant_row(a, "a").await["held_at_cap"]
                .as_u64()
                .unwrap_or(0);
        }
        n
    };
    let admins = vec![first.admin.clone(), second.admin.clone()];
    // One running saga per partition; which keys fall where is the hash's business, so
    // the test reads how many run and how many are held rather than assuming it.
    let settled = common::eventually(Duration::from_secs(30), || async {
        let running = called(&upstream, "a").len() as u64;
        running >= 1 && running + held_on(admins.clone()).await == JOBS
    })
    .await;
    assert!(settled, "calls {:?}", called(&upstream, "a"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let running: BTreeSet<String> = called(&upstream, "a").into_iter().collect();
    assert!(running.len() <= 2, "at most one per partition: {running:?}");
    let held = JOBS - running.len() as u64;

    first.kill();
    let taken = common::eventually(Duration::from_secs(60), || async {
        owned(&second.admin).await == 2
    })
    .await;
    assert!(
        taken,
        "the survivor did not take the dead replica's partition"
    );
    // Whatever the survivor replayed, it started nothing new: the calls are the same jobs
    // (a call may be made again for the same job: its effect command is redelivered), and
    // every held input is held on the survivor.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after: BTreeSet<String> = called(&upstream, "a").into_iter().collect();
    assert_eq!(
        after, running,
        "no saga over the cap started after the take-over"
    );
    assert_eq!(held_on(vec![second.admin.clone()]).await, held);

    hold.release();
    let done = common::eventually(Duration::from_secs(90), || async {
        let mut ids: Vec<String> = finished(&js, "a")
            .await
            .into_iter()
            .map(|s| s.subject)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len() == JOBS as usize
    })
    .await;
    assert!(done, "finished: {}", finished(&js, "a").await.len());
    let a = tenant_row(&second.admin, "a").await;
    assert_eq!(a["held_at_cap"], 0, "{a}");
    assert_eq!(a["live_instances"], 0, "{a}");
    let calls: BTreeSet<String> = called(&upstream, "a").into_iter().collect();
    assert_eq!(calls.len(), JOBS as usize, "every job called: {calls:?}");
    second.stop();
}

/// `runner tenants list` against `admin` (it must succeed) and the cells of `tenant`'s line.
fn listed(admin: &str, tenant: &str) -> (String, Vec<String>) {
    let (code, out) = common::run_to_exit(
        &["tenants", "--admin", admin, "list"],
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{out}");
    let prefix = format!("{tenant} ");
    let cells = out
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    (out, cells)
}

/// The jobs of `tenant` that finished, one entry per `Finish` command, sorted.
async fn finished_jobs(js: &async_nats::jetstream::Context, tenant: &str) -> Vec<String> {
    let mut jobs: Vec<String> = finished(js, tenant)
        .await
        .iter()
        .map(|m| m.subject.rsplit('.').next().unwrap().to_string())
        .collect();
    jobs.sort_unstable();
    jobs
}

/// The `nap` saga: it starts on `JobStarted`, sleeps `delay_ms` on a timer, then sends its
/// job's `Finish` command; `Snooze` sets a second, long timer that the wake cancels.
fn nap_manifests(delay_ms: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let nap = format!(
        r#"format: 1
sagas:
  - name: nap
    version: 1
    triggers:
      - {{ subject: aggregate.Job.*, correlation: event.aggregate_id, start: true }}
    data: {{ job: "${{ event.aggregate_id }}" }}
    initial_state: new
    states:
      new:
        on:
          JobStarted: {{ timers: [{{ name: wake, delay_ms: {delay_ms} }}], goto: napping }}
      napping:
        on:
          Snooze: {{ timers: [{{ name: nudge, delay_ms: 600000 }}] }}
          timer.nudge: {{ goto: napping }}
          timer.wake:
            emit: [{{ command: {{ aggregate_type: Job, command: Finish, aggregate_id: "${{ state.job }}", payload: {{}} }} }}]
            cancel_timers: [nudge]
            goto: done
      done: {{ terminal: true }}
"#
    );
    std::fs::write(dir.path().join("nap.yaml"), nap).unwrap();
    dir
}

/// Publishes `event` for jobs `<tenant>-0` … `<tenant>-<n - 1>`, timed now (the saga's time
/// is the event's, so naps are timed from now).
async fn naps(js: &async_nats::jetstream::Context, tenant: &str, n: u64, event: &str) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for i in 0..n {
        let id = format!("{tenant}-{i}");
        let ev = common::aggregate_event(tenant, "Job", &id, event, now + i, json!({}));
        common::publish_json(js, &format!("tenant.{tenant}.aggregate.Job.{id}"), &ev).await;
    }
}

/// A cap on pending timers (`tenancy.pending_timer_caps`): A, capped at three, starts three
/// naps and holds its other three whole while their timers are pending; B, uncapped, naps
/// meanwhile; `runner tenants list` shows A's timers against the cap. A running nap that
/// sets another timer is not held (A passes its cap by it) while a held nap's later input
/// waits behind its start. As A's timers fire, the held naps start, every one finishing
/// once, and nothing is left pending or held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_on_pending_timers_holds_a_tenants_new_sagas_until_its_timers_fire() {
    let nats = NatsServer::start();
    let manifests = nap_manifests(10_000);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("runner.toml");
    write_config(&config, "pending_timer_caps = { a = 3 }");
    let runner = combined_on(&config, &nats, &manifests, "1");
    let js = jetstream(&nats.url()).await;
    let admin = runner.admin.clone();
    naps(&js, "a", 6, "JobStarted").await;
    naps(&js, "b", 2, "JobStarted").await;
    let a_is = |timers: u64, held: u64| {
        let admin = admin.clone();
        async move {
            let a = tenant_row(&admin, "a").await;
            a["pending_timers"] == timers && a["held_at_cap"] == held
        }
    };
    let at_cap = common::eventually(Duration::from_secs(8), || a_is(3, 3)).await;
    let a = tenant_row(&admin, "a").await;
    assert!(at_cap, "{a}");
    assert_eq!(a["live_instances"], 3, "{a}");
    assert_eq!(a["pending_timer_cap"], 3, "{a}");
    let b = tenant_row(&admin, "b").await;
    assert_eq!(b["pending_timers"], 2, "B is not held by A's cap: {b}");
    assert_eq!(b["held_at_cap"], 0, "{b}");
    let gauges = common::eventually(Duration::from_secs(5), || async {
        metric_or_zero(&admin, "runner_tenant_pending_timers{tenant=\"a\"}").await == 3.0
            && metric_or_zero(&admin, "runner_tenant_held_at_cap{tenant=\"a\"}").await == 3.0
    })
    .await;
    assert!(gauges, "runner_tenant_pending_timers / held_at_cap of a");
    let (out, cells) = listed(&admin, "a");
    assert!(out.contains("TIMERS") && out.contains("TIMER_CAP"), "{out}");
    assert_eq!(
        cells.get(3..5),
        Some(&["3".to_string(), "3".to_string()][..]),
        "TIMERS, TIMER_CAP: {out}"
    );

    // Every nap snoozes: the three running set a second timer each, past the cap; the three
    // held wait whole behind their starts.
    naps(&js, "a", 6, "Snooze").await;
    let snoozed = common::eventually(Duration::from_secs(8), || a_is(6, 6)).await;
    assert!(snoozed, "{}", tenant_row(&admin, "a").await);

    // As A's timers fire, its held naps start and every nap finishes once; each wake
    // cancels its snooze.
    let done = common::eventually(Duration::from_secs(60), || async {
        finished(&js, "a").await.len() >= 6 && finished(&js, "b").await.len() >= 2
    })
    .await;
    assert!(done, "a finished {}", finished(&js, "a").await.len());
    let settled = common::eventually(Duration::from_secs(10), || a_is(0, 0)).await;
    assert!(settled, "{}", tenant_row(&admin, "a").await);
    assert_eq!(
        finished_jobs(&js, "a").await,
        (0..6).map(|i| format!("a-{i}")).collect::<Vec<_>>(),
        "each of A's naps finished exactly once"
    );
    assert_eq!(tenant_row(&admin, "a").await["live_instances"], 0);
    runner.stop();
}

/// A cap on outbox bytes (`tenancy.outbox_byte_caps`): while the commands stream takes
/// nothing, every saga's first output waits in the outbox. A, capped at 1 KiB, offers five
/// jobs: the first few start, until their outputs pass the cap (what goes in before its
/// outputs are counted may pass it); from then on its new inputs wait at the router (counted, and shown by `runner
/// tenants list`), while B, uncapped, gets all of its in. Once the stream takes messages
/// again, the outputs are published, A's held inputs go in, and every job of both tenants
/// finishes exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_on_outbox_bytes_holds_a_tenants_new_inputs_while_its_outputs_wait() {
    let nats = NatsServer::start();
    let upstream = Upstream::start(Arc::new(|_, _, _| Reply::ok(json!({})))).await;
    let manifests = jobs::manifests(&upstream);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("runner.toml");
    write_config(&config, "outbox_byte_caps = { a = \"1KiB\" }");
    let runner = combined_on(&config, &nats, &manifests, "1");
    let js = jetstream(&nats.url()).await;
    let admin = runner.admin.clone();
    jobs::start(&js, "a", 0, 1).await;
    jobs::start(&js, "b", 0, 1).await;
    let up = common::eventually(Duration::from_secs(30), || async {
        finished(&js, "a").await.len() == 1 && finished(&js, "b").await.len() == 1
    })
    .await;
    assert!(up, "the first job of each tenant finishes");

    // The commands stream takes nothing more: every output waits in the outbox.
    let mut stream = js.get_stream("WORKFLOW_COMMANDS").await.unwrap();
    let info = stream.info().await.unwrap().clone();
    let mut limited = info.config.clone();
    limited.max_bytes = i64::try_from(info.state.bytes).unwrap();
    limited.discard = async_nats::jetstream::stream::DiscardPolicy::New;
    js.update_stream(&limited).await.unwrap();
    jobs::start(&js, "a", 1, 6).await;
    let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let full = common::eventually(Duration::from_secs(30), || async {
        let a = tenant_row(&admin, "a").await;
        n(&a["outbox_bytes"]) >= 1024 && n(&a["live_instances"]) + n(&a["waiting_inputs"]) == 5
    })
    .await;
    let a = tenant_row(&admin, "a").await;
    assert!(full, "{a}");
    let started = n(&a["live_instances"]);
    assert!((1..=5).contains(&started), "{a}");
    jobs::start(&js, "a", 6, 21).await;
    jobs::start(&js, "b", 1, 6).await;
    let held = common::eventually(Duration::from_secs(30), || async {
        let (a, b) = (tenant_row(&admin, "a").await, tenant_row(&admin, "b").await);
        b["live_instances"] == 5 && n(&a["waiting_inputs"]) == 20 - started
    })
    .await;
    let a = tenant_row(&admin, "a").await;
    assert!(held, "a: {a} b: {}", tenant_row(&admin, "b").await);
    assert_eq!(
        a["live_instances"], started,
        "none of A's later inputs went in: {a}"
    );
    assert_eq!(a["outbox_byte_cap"], 1024, "{a}");
    // Held, not trickling in: nothing more of A's goes in while its outputs wait.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let a = tenant_row(&admin, "a").await;
    assert_eq!(a["live_instances"], started, "{a}");
    assert_eq!(
        n(&a["waiting_inputs"]),
        20 - started,
        "every held input waits at the router: {a}"
    );
    assert!(
        metric(&admin, "runner_tenant_outbox_capped_total{tenant=\"a\"}").await > 0.0,
        "held turns are counted"
    );
    let gauge = common::eventually(Duration::from_secs(10), || async {
        metric_or_zero(&admin, "runner_tenant_outbox_bytes{tenant=\"a\"}").await >= 1024.0
    })
    .await;
    assert!(gauge, "runner_tenant_outbox_bytes of a");
    let (out, cells) = listed(&admin, "a");
    assert!(
        out.contains("OUTBOX") && out.contains("OUTBOX_CAP"),
        "{out}"
    );
    assert_eq!(
        cells.get(6).map(String::as_str),
        Some("1024"),
        "OUTBOX_CAP: {out}"
    );

    // The stream takes messages again: the outputs go out, A's held inputs go in, and
    // every job finishes exactly once.
    let mut open = limited.clone();
    open.max_bytes = -1;
    js.update_stream(&open).await.unwrap();
    let done = common::eventually(Duration::from_secs(60), || async {
        finished(&js, "a").await.len() >= 21 && finished(&js, "b").await.len() >= 6
    })
    .await;
    assert!(done, "a finished {}", finished(&js, "a").await.len());
    tokio::time::sleep(Duration::from_secs(1)).await;
    for (t, n) in [("a", 21), ("b", 6)] {
        let jobs = finished_jobs(&js, t).await;
        let mut want: Vec<String> = (0..n).map(|i| format!("{t}-{i}")).collect();
        want.sort_unstable();
        assert_eq!(jobs, want, "each of {t}'s jobs finished exactly once");
    }
    let drained = common::eventually(Duration::from_secs(10), || async {
        let a = tenant_row(&admin, "a").await;
        a["outbox_bytes"] == 0 && a["waiting_inputs"] == 0
    })
    .await;
    assert!(drained, "{}", tenant_row(&admin, "a").await);
    runner.stop();
}
