//! Processes under test: a nats-server (or a cluster of three) and a `runner` per scenario,
//! each in a fresh directory, removed afterwards. What is read off them is in
//! [`crate::probe`].

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::probe::Metrics;

/// Paths of the programs a scenario starts.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct Programs {
    /// The nats-server binary (`scripts/setup-deps` prints it).
    #[arg(long, env = "NATS_SERVER_BIN", default_value = "nats-server")]
    pub(crate) nats_server: PathBuf,
    /// The runner binary.
    #[arg(long, default_value = "target/release/runner")]
    pub(crate) runner: PathBuf,
    /// Keep the scenario's directory (logs, stores) instead of removing it.
    #[arg(long)]
    pub(crate) keep: bool,
}

fn free_port() -> Result<u16> {
    Ok(crate::ports::free_ports(1)?[0])
}

/// A scratch directory removed on drop (unless kept).
pub(crate) struct WorkDir {
    pub(crate) path: PathBuf,
    keep: bool,
}

impl WorkDir {
    pub(crate) fn new(scenario: &str, keep: bool) -> Result<Self> {
        let path = std::env::temp_dir().join(format!(
            "runner-bench-{scenario}-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&path)?;
        Ok(Self { path, keep })
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if self.keep {
            eprintln!("bench: kept {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// A child process killed on drop.
pub(crate) struct Proc {
    child: Child,
}

impl Proc {
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
    /// Kills the process at once (SIGKILL) and reaps it.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
    /// Asks the process to stop (SIGTERM) and waits up to `grace` before killing it.
    pub(crate) fn stop(&mut self, grace: Duration) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let until = Instant::now() + grace;
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A nats-server with JetStream on a free loopback port.
pub(crate) struct Nats {
    pub(crate) url: String,
    proc: Proc,
}

impl Nats {
    pub(crate) async fn start(bin: &Path, dir: &Path) -> Result<Self> {
        let port = free_port()?;
        let log = std::fs::File::create(dir.join("nats.log"))?;
        let child = Command::new(bin)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir.join("js"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let url = format!("nats://127.0.0.1:{port}");
        let proc = Proc { child };
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(c) = async_nats::connect(&url).await {
                // JetStream answers once the server is fully up.
                if async_nats::jetstream::new(c).query_account().await.is_ok() {
                    break;
                }
            }
            if Instant::now() > until {
                bail!("nats-server did not come up on {url}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Self { url, proc })
    }

    /// The server's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.proc.pid()
    }

    pub(crate) fn version(bin: &Path) -> String {
        Command::new(bin)
            .arg("--version")
            .output()
            .map(|o| {
                let v = String::from_utf8_lossy(&o.stdout).trim().to_string();
                v.trim_start_matches("nats-server: ").to_string()
            })
            .unwrap_or_default()
    }
}

/// A nats-server cluster on loopback: every node with its own client, route and monitoring
/// port and store, listing every other node as a route (like `scripts/cluster`).
pub(crate) struct NatsCluster {
    /// Every node's client URL, comma-separated (what `--nats-url` takes).
    pub(crate) urls: String,
    nodes: Vec<Proc>,
    monitors: Vec<u16>,
}

/// Messages and bytes the cluster's clients sent and received, by connection name, summed
/// over every node (routes between the nodes are not counted).
#[derive(Debug, Default, Clone)]
pub(crate) struct Traffic {
    pub(crate) by_name: std::collections::BTreeMap<String, [u64; 4]>,
}

impl Traffic {
    /// What happened between `before` and `self`, per connection name.
    pub(crate) fn since(&self, before: &Traffic) -> Traffic {
        let mut out = Traffic::default();
        for (name, now) in &self.by_name {
            let was = before.by_name.get(name).copied().unwrap_or_default();
            let d: Vec<u64> = now
                .iter()
                .zip(was)
                .map(|(a, b)| a.saturating_sub(b))
                .collect();
            out.by_name.insert(name.clone(), [d[0], d[1], d[2], d[3]]);
        }
        out
    }

    /// One line: messages in (sent by the clients) and out (delivered to them) per `per`
    /// unit of work, by connection name, and in total.
    pub(crate) fn line(&self, per: f64) -> String {
        let per = per.max(1.0);
        let mut total = [0u64; 4];
        let mut parts = Vec::new();
        for (name, t) in &self.by_name {
            if t[0] + t[1] == 0 {
                continue;
            }
            for (a, b) in total.iter_mut().zip(t) {
                *a += b;
            }
            parts.push(format!(
                "{name} in={:.1} out={:.1}",
                t[0] as f64 / per,
                t[1] as f64 / per
            ));
        }
        format!(
            "msgs in={:.1} out={:.1}, KiB in={:.1} out={:.1} ({})",
            total[0] as f64 / per,
            total[1] as f64 / per,
            total[2] as f64 / per / 1024.0,
            total[3] as f64 / per / 1024.0,
            parts.join("; ")
        )
    }
}

impl NatsCluster {
    /// Starts `n` nodes and waits until each reports a JetStream meta leader and all `n`
    /// peers, and JetStream answers.
    pub(crate) async fn start(bin: &Path, dir: &Path, n: usize) -> Result<Self> {
        let ports: Vec<(u16, u16, u16)> = crate::ports::free_ports(3 * n)?
            .chunks(3)
            .map(|p| (p[0], p[1], p[2]))
            .collect();
        let mut nodes = Vec::new();
        for i in 0..ports.len() {
            nodes.push(start_node(bin, dir, &ports, i)?);
        }
        let urls: Vec<String> = ports
            .iter()
            .map(|p| format!("nats://127.0.0.1:{}", p.0))
            .collect();
        let cluster = Self {
            urls: urls.join(","),
            nodes,
            monitors: ports.iter().map(|p| p.2).collect(),
        };
        cluster.wait_formed(dir, n).await?;
        Ok(cluster)
    }

    /// Waits (up to 60 s) until every node reports a meta leader and at least `n` peers,
    /// and JetStream answers a client of the cluster.
    async fn wait_formed(&self, dir: &Path, n: usize) -> Result<()> {
        let http = reqwest::Client::new();
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let mut formed = true;
            for monitor in &self.monitors {
                formed &= node_sees_cluster(&http, *monitor, n).await;
            }
            if formed
                && let Ok(c) = crate::connect(&self.urls).await
                && async_nats::jetstream::new(c).query_account().await.is_ok()
            {
                return Ok(());
            }
            if Instant::now() > until {
                // The work directory goes with the failed run: the nodes' logs are shown.
                let logs: String = (1..=n)
                    .map(|i| {
                        let text = std::fs::read_to_string(dir.join(format!("n{i}.log")))
                            .unwrap_or_default();
                        let tail: Vec<&str> = text.lines().rev().take(20).collect();
                        let tail: Vec<&str> = tail.into_iter().rev().collect();
                        format!("\n--- n{i}.log (last 20 lines)\n{}", tail.join("\n"))
                    })
                    .collect();
                bail!("the NATS cluster did not form within 60 s{logs}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The nodes' process ids.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.nodes.iter().map(Proc::pid).collect()
    }

    /// A node's monitoring endpoint as JSON (Null when it does not answer).
    async fn monitor(&self, node: usize, path: &str) -> serde_json::Value {
        let url = format!("http://127.0.0.1:{}/{path}", self.monitors[node]);
        match reqwest::Client::new()
            .get(url)
            .timeout(Duration::from_secs(5))
            .send()
            .await
        {
            Ok(r) => r.json().await.unwrap_or_default(),
            Err(_) => serde_json::Value::Null,
        }
    }

    /// Client traffic so far, by connection name, over every node ([`Traffic`]).
    pub(crate) async fn traffic(&self) -> Traffic {
        let mut t = Traffic::default();
        for node in 0..self.monitors.len() {
            let connz = self.monitor(node, "connz?limit=4096").await;
            for c in connz["connections"].as_array().into_iter().flatten() {
                let name = c["name"].as_str().unwrap_or("").to_string();
                let name = if name.is_empty() {
                    "(unnamed)".into()
                } else {
                    name
                };
                let e = t.by_name.entry(name).or_default();
                for (i, key) in ["in_msgs", "out_msgs", "in_bytes", "out_bytes"]
                    .iter()
                    .enumerate()
                {
                    e[i] += c[*key].as_u64().unwrap_or(0);
                }
            }
        }
        t
    }

    /// Every stream's stored messages (its last sequence) and every consumer's deliveries
    /// and redeliveries, keyed `stream` and `stream/consumer`, as the stream leaders say.
    pub(crate) async fn counts(&self) -> std::collections::BTreeMap<String, [u64; 2]> {
        let mut out = std::collections::BTreeMap::new();
        for node in 0..self.monitors.len() {
            let jsz = self.monitor(node, "jsz?streams=true&consumers=true").await;
            for acc in jsz["account_details"].as_array().into_iter().flatten() {
                for st in acc["stream_detail"].as_array().into_iter().flatten() {
                    let Some(name) = st["name"].as_str() else {
                        continue;
                    };
                    // Every node reports its copy; the leader's is the furthest along.
                    let mut keep = |key: String, v: [u64; 2]| {
                        let e = out.entry(key).or_insert([0, 0]);
                        *e = [e[0].max(v[0]), e[1].max(v[1])];
                    };
                    keep(
                        name.to_string(),
                        [st["state"]["last_seq"].as_u64().unwrap_or(0), 0],
                    );
                    for c in st["consumer_detail"].as_array().into_iter().flatten() {
                        let cname = c["name"].as_str().unwrap_or("?");
                        let delivered = c["delivered"]["consumer_seq"].as_u64().unwrap_or(0);
                        let redelivered = c["num_redelivered"].as_u64().unwrap_or(0);
                        keep(format!("{name}/{cname}"), [delivered, redelivered]);
                    }
                }
            }
        }
        out
    }

    /// Where every stream's leader is: `STREAM=node` pairs, for reading a run's figures
    /// (a leader beside or away from a client changes what its traffic costs).
    pub(crate) async fn leaders(&self) -> String {
        let mut out = std::collections::BTreeMap::new();
        for node in 0..self.monitors.len() {
            let jsz = self.monitor(node, "jsz?streams=true").await;
            for acc in jsz["account_details"].as_array().into_iter().flatten() {
                for st in acc["stream_detail"].as_array().into_iter().flatten() {
                    if let (Some(name), Some(leader)) =
                        (st["name"].as_str(), st["cluster"]["leader"].as_str())
                    {
                        out.insert(name.to_string(), leader.to_string());
                    }
                }
            }
        }
        out.iter()
            .map(|(s, l)| format!("{s}={l}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Starts node `i` of a cluster whose nodes listen on `ports` (client, route, monitoring):
/// writes its configuration file `n<i+1>.conf`, with every other node as a route, and runs
/// it with its log in `n<i+1>.log`.
fn start_node(bin: &Path, dir: &Path, ports: &[(u16, u16, u16)], i: usize) -> Result<Proc> {
    let (client, route, monitor) = ports[i];
    let routes: Vec<String> = ports
        .iter()
        .enumerate()
        .filter(|(j, _)| *j != i)
        .map(|(_, p)| format!("\"nats-route://127.0.0.1:{}\"", p.1))
        .collect();
    let name = format!("n{}", i + 1);
    // The file, one entry per line of it.
    let conf = [
        format!("server_name: {name}"),
        format!("listen: \"127.0.0.1:{client}\""),
        format!("http: \"127.0.0.1:{monitor}\""),
        format!(
            "jetstream {{ store_dir: \"{}\" }}",
            dir.join(&name).display()
        ),
        "cluster { name: bench".to_string(),
        format!("  listen: \"127.0.0.1:{route}\""),
        format!("  routes: [{}]", routes.join(", ")),
        "}".to_string(),
    ]
    .map(|line| line + "\n")
    .concat();
    let conf_path = dir.join(format!("{name}.conf"));
    std::fs::write(&conf_path, conf)?;
    let child = Command::new(bin)
        .arg("-c")
        .arg(&conf_path)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("{name}.log")))?)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    Ok(Proc { child })
}

/// Whether the node monitored on port `monitor` reports a JetStream meta leader and at
/// least `n` peers (false when it does not answer).
async fn node_sees_cluster(http: &reqwest::Client, monitor: u16, n: usize) -> bool {
    let jsz: serde_json::Value = match http
        .get(format!("http://127.0.0.1:{monitor}/jsz"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
    {
        Ok(r) => r.json().await.unwrap_or_default(),
        Err(_) => serde_json::Value::Null,
    };
    let meta = &jsz["meta_cluster"];
    meta["leader"].as_str().is_some_and(|l| !l.is_empty())
        && meta["cluster_size"].as_u64().unwrap_or(0) as usize >= n
}

/// A running `runner run`.
pub(crate) struct Runner {
    pub(crate) admin: String,
    pub(crate) data_dir: PathBuf,
    pub(crate) proc: Proc,
    http: reqwest::Client,
    /// Its log (warnings and errors): the scenario's directory goes when it fails.
    log: PathBuf,
}

impl Runner {
    /// Starts the runner in `mode` on `manifest` with a fresh data dir under `dir`, and waits
    /// until `/ready` answers 200.
    pub(crate) async fn start(
        bin: &Path,
        dir: &Path,
        nats_url: &str,
        mode: &str,
        manifest: &Path,
        env: &[(&str, &str)],
    ) -> Result<Self> {
        Self::start_named(bin, dir, mode, nats_url, mode, manifest, env).await
    }

    /// [`Runner::start`] with the data dir and log named after `name` (`data-<name>`,
    /// `runner-<name>.log`), for several runners in one directory.
    pub(crate) async fn start_named(
        bin: &Path,
        dir: &Path,
        name: &str,
        nats_url: &str,
        mode: &str,
        manifest: &Path,
        env: &[(&str, &str)],
    ) -> Result<Self> {
        let port = free_port()?;
        let data_dir = dir.join(format!("data-{name}"));
        let log_path = dir.join(format!("runner-{name}.log"));
        let log = std::fs::File::create(&log_path)?;
        let mut cmd = Command::new(bin);
        cmd.args([
            "run",
            "--mode",
            mode,
            "--nats-url",
            nats_url,
            "--admin-addr",
        ])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(&data_dir)
        .arg("--manifest")
        .arg(manifest)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(log);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut r = Self {
            admin: format!("http://127.0.0.1:{port}"),
            data_dir,
            proc: Proc { child },
            http: reqwest::Client::new(),
            log: log_path,
        };
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(resp) = r.http.get(format!("{}/ready", r.admin)).send().await
                && resp.status().is_success()
            {
                return Ok(r);
            }
            if let Ok(Some(status)) = r.proc.child.try_wait() {
                bail!("runner exited with {status} at start; {}", r.log_tail(15));
            }
            if Instant::now() > until {
                bail!("runner did not become ready");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The last `n` lines of its log, for an error message: the scenario's directory, and
    /// the log with it, goes when the scenario fails.
    pub(crate) fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "the end of {}:\n{}",
            self.log.display(),
            lines[lines.len().saturating_sub(n)..].join("\n")
        )
    }

    /// `GET /info` as JSON.
    pub(crate) async fn info(&self) -> Result<serde_json::Value> {
        Ok(self
            .http
            .get(format!("{}/info", self.admin))
            .timeout(Duration::from_secs(2))
            .send()
            .await?
            .json()
            .await?)
    }

    pub(crate) fn client(&self) -> Metrics {
        Metrics::new(format!("{}/metrics", self.admin), self.http.clone())
    }

    /// Size of the files under the data dir (the libmdbx database), in bytes.
    pub(crate) fn store_bytes(&self) -> u64 {
        fn walk(p: &Path) -> u64 {
            std::fs::read_dir(p)
                .map(|d| {
                    d.filter_map(|e| e.ok())
                        .map(|e| match e.metadata() {
                            Ok(m) if m.is_dir() => walk(&e.path()),
                            Ok(m) => m.len(),
                            Err(_) => 0,
                        })
                        .sum()
                })
                .unwrap_or(0)
        }
        walk(&self.data_dir)
    }
}

/// Spawns a child process of this same program (for `limit`).
pub(crate) fn spawn_self(args: &[String], log: &Path) -> Result<(Proc, std::process::ChildStdout)> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log)?)
        .spawn()?;
    let out = child.stdout.take().context("child stdout")?;
    Ok((Proc { child }, out))
}
