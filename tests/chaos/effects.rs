//! The chaos test's effect workload: parcels shipped through one HTTP effect
//! (`tests/manifests/chaos_shipment.yaml`) by two effect-mode replicas, against an upstream
//! this test serves, while the schedule kills and freezes those replicas too.
//!
//! What an upstream can see of a lease: every call carries `Idempotency-Key` (the command
//! id) and the headers the manifest renders, and nothing of the claim. The claim's attempt
//! number and its fencing revision (`src/effect/claim.rs`) stay between the worker and the
//! claims bucket, so the upstream cannot tell which lease a call was made under. What is
//! checked instead:
//!
//! - **Executions per lease**: the claim of a finished command keeps how many times its
//!   lease was taken (`attempt`: 1 for the first executor, one more per take-over), and its
//!   result how many calls the last holder made (`attempts`, more than 1 only after a
//!   retryable failure). Every command must have been called upstream at most
//!   `attempt + attempts - 1` times: once per lease taken, plus the last holder's retries.
//!   The upstream here never fails, so a retry can only follow a transport error.
//! - **No overlap**: no two calls of one command are at the upstream at the same time. Calls
//!   are held 0.2 to 0.8 s, well under the 3 s lease, and a worker calls right after it takes
//!   the lease, so two overlapping calls mean two executors held the lease at once. The one
//!   exception the design admits: an executor frozen between taking the lease and sending
//!   its call sends it when thawed, on a lease that may have run out meanwhile and been
//!   taken over; no fence reaches the upstream to refuse it. So each effect process carries
//!   its own name (`CHAOS_EXECUTOR`, sent as `X-Chaos-Executor` through the manifest's
//!   secrets), and an overlap where a call started within a second after its own process
//!   was thawed, or a NATS node thawed or restarted (a claim write answered late), is
//!   counted apart (`effect_overlaps_after_thaw`, printed); every other overlap
//!   (`effect_overlaps`) fails the test.
//!
//! And of the orders: every parcel placed ends its saga exactly once, completed (one
//! `SagaCompleted`, one `MarkShipped` carrying the tracking number the upstream gave for its
//! command), every ship command was called upstream at least once, and no upstream call
//! carries a key that is no command's.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::common::upstream::{Hit, Reply, Upstream};
use crate::common::{RunnerProc, read_stream_once, read_stream_timed};

/// Tenant of the effect workload.
const TENANT: &str = "shop";
/// Lease of an effect claim here (short, so take-overs happen within the chaos time).
const LEASE_TTL: &str = "3s";
/// How long JetStream waits for a command's ack: a dead worker's commands come back soon
/// after their leases lapse.
const ACK_WAIT: &str = "5s";
/// How soon after a thaw a call may still have been sent on a lease that ran out.
const THAW_WINDOW: Duration = Duration::from_secs(1);

/// How long the upstream holds a call: 200 to 800 ms, fixed per key and try.
fn hold(key: &str, nth: usize) -> Duration {
    let h = key
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
        .wrapping_add(nth as u64 * 7919);
    Duration::from_millis(200 + h % 600)
}

/// The upstream, served on a runtime of its own (its own thread), so the chaos loop, which
/// blocks while processes start, never delays an answer or the times it records.
struct Host {
    up: Upstream,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Host {
    fn start() -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let up = Upstream::start(Arc::new(|path, key, nth| match path {
                    "/ship" => {
                        Reply::ok(json!({ "tracking": format!("trk-{key}") })).after(hold(key, nth))
                    }
                    _ => Reply::status(404),
                }))
                .await;
                tx.send(up).unwrap();
                let _ = stopped.await;
            });
        });
        Self {
            up: rx.recv().unwrap(),
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The effect side of one chaos run: the upstream, the manifest pointing at it and the
/// effect replicas.
pub(crate) struct Effects {
    host: Host,
    dir: tempfile::TempDir,
    urls: String,
    replicas: Vec<Option<RunnerProc>>,
    incarnations: Vec<u32>,
    /// (process name or "nats", when it was thawed or restarted).
    thaws: Arc<Mutex<Vec<(String, Instant)>>>,
    pub(crate) kills: u64,
    pub(crate) pauses: u64,
}

fn executor(i: usize, incarnation: u32) -> String {
    format!("e{}.{incarnation}", i + 1)
}

fn effect_replica(
    urls: &str,
    manifest: &str,
    i: usize,
    incarnation: u32,
    dir: tempfile::TempDir,
) -> RunnerProc {
    let replicas = if urls.contains(',') { "3" } else { "1" };
    let node = format!("e{}", i + 1);
    let name = executor(i, incarnation);
    RunnerProc::start_in(
        dir,
        &[
            "--mode",
            "effect",
            "--nats-url",
            urls,
            "--manifest",
            manifest,
        ],
        &[
            ("RUNNER__PARTITIONS__COUNT", "8"),
            ("RUNNER__STREAMS__REPLICAS", replicas),
            ("RUNNER__NATS__CONNECT_TIMEOUT", "120s"),
            ("RUNNER__NATS__SETUP_TIMEOUT", "120s"),
            ("RUNNER__NODE__ID", &node),
            ("RUNNER__EFFECT__LEASE_TTL", LEASE_TTL),
            ("RUNNER__EFFECT__ACK_WAIT", ACK_WAIT),
            ("CHAOS_EXECUTOR", &name),
        ],
    )
}

impl Effects {
    /// Starts the upstream and writes the manifest pointing at it; the effect replicas start
    /// with [`Effects::start_replicas`], once the saga replicas made the streams.
    pub(crate) fn new(urls: &str) -> Self {
        let host = Host::start();
        let dir = tempfile::tempdir().unwrap();
        let text = std::fs::read_to_string(
            crate::common::repo_root().join("tests/manifests/chaos_shipment.yaml"),
        )
        .unwrap()
        .replace("http://chaos-upstream.invalid", &host.up.base);
        assert!(
            !text.contains(".invalid"),
            "a host this test does not serve"
        );
        std::fs::write(dir.path().join("chaos_shipment.yaml"), text).unwrap();
        Self {
            host,
            dir,
            urls: urls.to_string(),
            replicas: Vec::new(),
            incarnations: vec![1, 1],
            thaws: Arc::new(Mutex::new(Vec::new())),
            kills: 0,
            pauses: 0,
        }
    }

    /// The manifest (saga replicas load it too).
    pub(crate) fn manifest(&self) -> String {
        self.dir
            .path()
            .join("chaos_shipment.yaml")
            .to_str()
            .unwrap()
            .to_string()
    }

    /// Starts the two effect replicas.
    pub(crate) fn start_replicas(&mut self) {
        let m = self.manifest();
        self.replicas = (0..2)
            .map(|i| {
                Some(effect_replica(
                    &self.urls,
                    &m,
                    i,
                    self.incarnations[i],
                    tempfile::tempdir().unwrap(),
                ))
            })
            .collect();
    }

    /// SIGKILLs effect replica `i`, waits `down`, and starts it again on its data dir.
    pub(crate) async fn kill(&mut self, i: usize, down: Duration) {
        if let Some(r) = self.replicas[i].take() {
            let dir = r.kill();
            self.kills += 1;
            tokio::time::sleep(down).await;
            self.incarnations[i] += 1;
            let m = self.manifest();
            self.replicas[i] = Some(effect_replica(&self.urls, &m, i, self.incarnations[i], dir));
        }
    }

    /// Freezes effect replica `i` for `frozen` (past its leases when longer than 3 s), then
    /// lets it go on.
    pub(crate) async fn pause(&mut self, i: usize, frozen: Duration) {
        if let Some(r) = &self.replicas[i] {
            r.signal("STOP");
            tokio::time::sleep(frozen).await;
            r.signal("CONT");
            self.thawed(&executor(i, self.incarnations[i]));
            self.pauses += 1;
        }
    }

    /// Notes that `who` (a process name, or "nats") just came back.
    pub(crate) fn thawed(&self, who: &str) {
        self.thaws
            .lock()
            .unwrap()
            .push((who.to_string(), Instant::now()));
    }

    /// Places parcels `p-0..orders`, paced over `seconds`.
    pub(crate) fn load(
        url_cell: Arc<Mutex<String>>,
        orders: u64,
        seconds: u64,
    ) -> tokio::task::JoinHandle<()> {
        let pace = Duration::from_millis(seconds * 1000 / orders.max(1));
        tokio::spawn(async move {
            for i in 0..orders {
                let id = format!("p-{i}");
                let mut ev = crate::common::aggregate_event(
                    TENANT,
                    "Parcel",
                    &id,
                    "ParcelPlaced",
                    1_800_000_000_000 + i,
                    json!({ "weight": 1 + i % 5 }),
                );
                ev["event_id"] = json!(format!("parcel-{i}"));
                crate::publish_until_stored(
                    &url_cell,
                    &format!("tenant.{TENANT}.aggregate.Parcel.{id}"),
                    &format!("parcel-{i}"),
                    serde_json::to_vec(&ev).unwrap(),
                )
                .await;
                tokio::time::sleep(pace).await;
            }
        })
    }

    /// Waits (up to `timeout`) until every parcel's saga ended, then judges the run.
    pub(crate) async fn judge(&self, url: &str, orders: u64, timeout: Duration) -> EffectCounts {
        let deadline = Instant::now() + timeout;
        let ended = loop {
            let seen = read_stream_timed(
                url,
                "WORKFLOW_EVENTS",
                &format!("tenant.{TENANT}.workflow_event.shipment.*"),
            )
            .await;
            if let Some(s) = seen {
                let distinct: BTreeSet<&str> = s.iter().map(|m| m.0.as_str()).collect();
                if distinct.len() as u64 >= orders || Instant::now() > deadline {
                    break s;
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        };
        let mut c = EffectCounts {
            orders,
            kills: self.kills,
            pauses: self.pauses,
            ..Default::default()
        };

        // Sagas: one SagaCompleted per parcel, nothing else.
        let mut completed: BTreeMap<String, u64> = BTreeMap::new();
        for (subject, _, body, stored) in &ended {
            let parcel = subject.rsplit('.').next().unwrap().to_string();
            match body["event_type"].as_str() {
                Some("SagaCompleted") => {
                    *completed.entry(parcel).or_default() += 1;
                    c.completion_times.push(*stored);
                }
                other => {
                    c.failed += 1;
                    c.findings
                        .push(format!("parcel {parcel} ended with {other:?}: {body}"));
                }
            }
        }
        for i in 0..orders {
            match completed.get(&format!("p-{i}")) {
                None => c.lost += 1,
                Some(n) => c.doubled += n - 1,
            }
        }
        c.completed = completed.len() as u64;

        // The ship commands, and the MarkShipped each completion emitted.
        let commands = read_until(
            url,
            "WORKFLOW_COMMANDS",
            &format!("tenant.{TENANT}.effect.ship.*"),
        )
        .await;
        let mut command_of: BTreeMap<String, String> = BTreeMap::new();
        let mut ids = BTreeSet::new();
        for (_, id, body) in &commands {
            if !ids.insert(id.clone()) {
                c.outputs_stored_twice += 1;
            }
            let command_id = body["command_id"].as_str().unwrap_or_default().to_string();
            let parcel = body["metadata"]["correlation_id"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            if let Some(before) = command_of.insert(parcel.clone(), command_id.clone())
                && before != command_id
            {
                c.doubled += 1;
                c.findings.push(format!(
                    "parcel {parcel}: two ship commands, {before} and {command_id}"
                ));
            }
        }
        c.commands = command_of.len() as u64;
        let shipped = read_until(
            url,
            "WORKFLOW_COMMANDS",
            &format!("tenant.{TENANT}.command.Parcel.*"),
        )
        .await;
        let mut marked: BTreeMap<String, u64> = BTreeMap::new();
        for (subject, id, body) in &shipped {
            if !ids.insert(id.clone()) {
                c.outputs_stored_twice += 1;
            }
            let parcel = subject.rsplit('.').next().unwrap().to_string();
            *marked.entry(parcel.clone()).or_default() += 1;
            let want = command_of.get(&parcel).map(|k| format!("trk-{k}"));
            if body["payload"]["tracking"].as_str() != want.as_deref() {
                c.tracking_wrong += 1;
                c.findings.push(format!(
                    "parcel {parcel}: shipped with {} instead of {want:?}",
                    body["payload"]["tracking"]
                ));
            }
        }
        for i in 0..orders {
            match marked.get(&format!("p-{i}")) {
                None => c.lost_shipped += 1,
                Some(n) => c.doubled += n - 1,
            }
        }

        // The claims: how often each command's lease was taken.
        let claims = read_until(
            url,
            "KV_RUNNER_EFFECT_CLAIMS",
            &format!("$KV.RUNNER_EFFECT_CLAIMS.{TENANT}.>"),
        )
        .await;
        let mut leases: BTreeMap<String, (u64, u64, String)> = BTreeMap::new();
        for (subject, _, body) in &claims {
            let key = subject.rsplit('.').next().unwrap().to_string();
            let attempt = body["attempt"].as_u64().unwrap_or(0);
            let calls = body["result"]["body"]["attempts"].as_u64().unwrap_or(1);
            let state = body["state"].as_str().unwrap_or_default().to_string();
            leases.insert(key, (attempt, calls, state));
        }

        // The upstream's calls, per key.
        let hits = self.host.up.hits();
        c.calls = hits.len() as u64;
        let mut per_key: BTreeMap<String, Vec<Hit>> = BTreeMap::new();
        for h in hits {
            per_key
                .entry(h.key.clone().unwrap_or_default())
                .or_default()
                .push(h);
        }
        c.keys = per_key.len() as u64;
        let known: BTreeSet<&String> = command_of.values().collect();
        for (key, calls) in &per_key {
            if !known.contains(key) {
                c.strange_calls += calls.len() as u64;
                c.findings.push(format!(
                    "{} calls with key {key:?}, no command's",
                    calls.len()
                ));
            }
        }
        for key in &known {
            if !per_key.contains_key(*key) {
                c.unexecuted += 1;
                c.findings
                    .push(format!("command {key} never called upstream"));
            }
        }
        let thaws = self.thaws.lock().unwrap().clone();
        let just_thawed = |h: &Hit| {
            let me = h
                .headers
                .get("x-chaos-executor")
                .cloned()
                .unwrap_or_default();
            thaws.iter().any(|(who, at)| {
                (*who == me || who == "nats") && *at <= h.at && h.at <= *at + THAW_WINDOW
            })
        };
        let now = Instant::now();
        for (key, calls) in &mut per_key {
            let (attempt, last_calls, state) = leases.get(key).cloned().unwrap_or_default();
            c.lease_takes += attempt;
            if calls.len() > 1 {
                c.reexecuted += 1;
            }
            let bound = attempt + last_calls.saturating_sub(1);
            if calls.len() as u64 > bound {
                c.over_lease += 1;
                c.findings.push(format!(
                    "command {key}: {} calls upstream, lease taken {attempt} times, last holder \
                     made {last_calls} calls, claim {state:?}; callers {:?}",
                    calls.len(),
                    callers(calls)
                ));
            }
            calls.sort_by_key(|h| h.at);
            for (i, a) in calls.iter().enumerate() {
                for b in &calls[i + 1..] {
                    if b.at < a.ended.unwrap_or(now) {
                        if just_thawed(a) || just_thawed(b) {
                            c.overlaps_after_thaw += 1;
                        } else {
                            c.overlaps += 1;
                            c.findings.push(format!(
                                "command {key}: calls overlap: {:?} from {:?} and {:?} from {:?} \
                                 ({:?} apart)",
                                a.headers.get("x-chaos-executor"),
                                a.at,
                                b.headers.get("x-chaos-executor"),
                                b.at,
                                b.at - a.at
                            ));
                        }
                    }
                }
            }
        }
        c
    }
}

/// Who made each call of one command, in order.
fn callers(calls: &[Hit]) -> Vec<String> {
    calls
        .iter()
        .map(|h| {
            h.headers
                .get("x-chaos-executor")
                .cloned()
                .unwrap_or_default()
        })
        .collect()
}

/// Reads `stream`/`filter`, retrying while the servers do not answer.
async fn read_until(
    url: &str,
    stream: &str,
    filter: &str,
) -> Vec<(String, String, serde_json::Value)> {
    for _ in 0..60 {
        if let Some(v) = read_stream_once(url, stream, filter).await {
            return v;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    panic!("{stream} ({filter}) could not be read for a minute");
}

/// What the effect workload came to.
#[derive(Default, Debug)]
pub(crate) struct EffectCounts {
    pub(crate) orders: u64,
    pub(crate) completed: u64,
    pub(crate) lost: u64,
    pub(crate) lost_shipped: u64,
    pub(crate) doubled: u64,
    pub(crate) failed: u64,
    pub(crate) tracking_wrong: u64,
    pub(crate) outputs_stored_twice: u64,
    pub(crate) commands: u64,
    pub(crate) calls: u64,
    pub(crate) keys: u64,
    pub(crate) unexecuted: u64,
    pub(crate) strange_calls: u64,
    pub(crate) lease_takes: u64,
    pub(crate) reexecuted: u64,
    pub(crate) over_lease: u64,
    pub(crate) overlaps: u64,
    pub(crate) overlaps_after_thaw: u64,
    pub(crate) kills: u64,
    pub(crate) pauses: u64,
    /// When each completion was stored (ms since the epoch).
    pub(crate) completion_times: Vec<u64>,
    /// What went wrong, for the failure message.
    pub(crate) findings: Vec<String>,
}

impl EffectCounts {
    /// The counts that must be zero.
    pub(crate) fn faults(&self) -> [u64; 10] {
        [
            self.lost,
            self.lost_shipped,
            self.doubled,
            self.failed,
            self.tracking_wrong,
            self.outputs_stored_twice,
            self.unexecuted,
            self.strange_calls,
            self.over_lease,
            self.overlaps,
        ]
    }
}
