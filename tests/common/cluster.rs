//! A real three-node (or N-node) NATS cluster on loopback, owned by one test.
//!
//! Each node has its own client, cluster (route) and monitoring port and its own store
//! directory; every node lists every other node as a route. Nodes can be started one at a
//! time (to test a cluster that is still forming), stopped (SIGKILL, store kept) and started
//! again on the same ports and store. [`Cluster::wait_formed`] waits until every running node
//! sees a JetStream meta leader and all its peers, through the monitoring endpoint.
//! Dropping the cluster kills every node and removes the stores.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::nats_server_bin;

struct Node {
    name: String,
    client: u16,
    route: u16,
    monitor: u16,
    child: Option<Child>,
}

/// A NATS cluster of child processes.
pub struct Cluster {
    nodes: Vec<Node>,
    dir: tempfile::TempDir,
}

#[path = "../../src/bin/runner_bench/ports.rs"]
mod ports;

/// `k` distinct free loopback ports from below the ephemeral range ([`ports::free_ports`]).
pub fn free_ports(k: usize) -> Vec<u16> {
    ports::free_ports(k).expect("binding a loopback port")
}

impl Cluster {
    /// A cluster of `n` nodes, none started yet.
    pub fn new(n: usize) -> Self {
        let ports = free_ports(3 * n);
        let nodes = (0..n)
            .map(|i| Node {
                name: format!("n{}", i + 1),
                client: ports[3 * i],
                route: ports[3 * i + 1],
                monitor: ports[3 * i + 2],
                child: None,
            })
            .collect();
        Self {
            nodes,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// Starts `n` nodes and waits until the cluster is formed.
    pub fn start(n: usize) -> Self {
        let mut c = Self::new(n);
        for i in 0..n {
            c.start_node(i);
        }
        c.wait_formed(Duration::from_secs(60));
        c
    }

    /// Starts node `i` (again, after [`Cluster::stop_node`]) on its ports and store.
    pub fn start_node(&mut self, i: usize) {
        assert!(self.nodes[i].child.is_none(), "node {i} is running");
        let routes: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, n)| format!("\"nats-route://127.0.0.1:{}\"", n.route))
            .collect();
        let node = &self.nodes[i];
        let store = self.dir.path().join(&node.name);
        let conf = format!(
            "server_name: {name}\nlisten: \"127.0.0.1:{client}\"\nhttp: \"127.0.0.1:{monitor}\"\n\
             jetstream {{ store_dir: \"{store}\" }}\n\
             cluster {{ name: runner_test\n  listen: \"127.0.0.1:{route}\"\n  routes: [{routes}]\n}}\n",
            name = node.name,
            client = node.client,
            monitor = node.monitor,
            route = node.route,
            store = store.display(),
            routes = routes.join(", "),
        );
        let conf_path = self.dir.path().join(format!("{}.conf", node.name));
        std::fs::write(&conf_path, conf).unwrap();
        let log =
            std::fs::File::create(self.dir.path().join(format!("{}.log", node.name))).unwrap();
        let child = Command::new(nats_server_bin())
            .arg("-c")
            .arg(&conf_path)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn nats-server");
        self.nodes[i].child = Some(child);
        wait_port(self.nodes[i].client, Duration::from_secs(20));
    }

    /// Kills node `i` (SIGKILL), keeping its store.
    pub fn stop_node(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends a signal to node `i` ("STOP" freezes it, "CONT" resumes it); false when it is
    /// not running.
    pub fn signal_node(&self, i: usize, sig: &str) -> bool {
        let Some(c) = self.nodes[i].child.as_ref() else {
            return false;
        };
        std::process::Command::new("kill")
            .args([&format!("-{sig}"), &c.id().to_string()])
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Whether node `i` is running.
    pub fn running(&self, i: usize) -> bool {
        self.nodes[i].child.is_some()
    }

    /// The client URL of node `i`.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].client)
    }

    /// Every node's client URL, comma-separated (the form `--nats-url` takes).
    pub fn urls(&self) -> String {
        (0..self.nodes.len())
            .map(|i| self.url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The log of node `i` so far.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{}.log", self.nodes[i].name)))
            .unwrap_or_default()
    }

    /// GET `path` of node `i`'s monitoring endpoint as JSON (None while it does not answer).
    pub fn monitor_json(&self, i: usize, path: &str) -> Option<serde_json::Value> {
        http_json(self.nodes[i].monitor, path)
    }

    /// Waits until every running node reports a JetStream meta leader and the full peer set.
    pub fn wait_formed(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let want = self.nodes.len();
        loop {
            let formed = self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                let Some(jsz) = http_json(n.monitor, "/jsz") else {
                    return false;
                };
                let meta = &jsz["meta_cluster"];
                let leader = meta["leader"].as_str().is_some_and(|l| !l.is_empty());
                let peers = meta["cluster_size"].as_u64().unwrap_or(0) as usize;
                leader && peers >= want
            });
            if formed {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "cluster not formed within {timeout:?}; logs:\n{}",
                (0..self.nodes.len())
                    .map(|i| self.log(i))
                    .collect::<Vec<_>>()
                    .join("\n----\n")
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.stop_node(i);
        }
    }
}

fn wait_port(port: u16, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "nats-server did not listen on {port} within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A blocking GET of the monitoring endpoint (plain HTTP/1.0 over a socket, so it works
/// from any thread without a runtime).
fn http_json(port: u16, path: &str) -> Option<serde_json::Value> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let body = buf.split_once("\r\n\r\n")?.1;
    serde_json::from_str(body).ok()
}
