//! The packaging files against the real binary: each pod and compose service's runner
//! started with the shipped config and environment on a three-node NATS cluster, its probes,
//! healthchecks and preStop hook run as written, and the compose load generator's orders
//! carried through to the stand-in upstream.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value as Json;

use crate::common::cluster::Cluster;
use crate::common::{self, RunnerProc, jetstream, read_stream, repo_root};
use crate::files::{self, Compose, Dockerfile, K8s, TOKEN, k8s_env, k8s_volumes, retarget};
use crate::tool;

/// The address every probe, hook and healthcheck in the files sends to.
const SHIPPED_ADMIN: &str = "127.0.0.1:8080";

/// Runs `sh -c script` to completion (at most `timeout`); returns its exit code and output.
fn sh(script: &str, env: &[(String, String)], timeout: Duration) -> (Option<i32>, String) {
    let out = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(script)
        .envs(env.iter().cloned())
        .stdout(out.reopen().unwrap())
        .stderr(out.reopen().unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + timeout;
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (
        code,
        std::fs::read_to_string(out.path()).unwrap_or_default(),
    )
}

/// The `host:port` of a runner's admin server.
fn admin_addr(r: &RunnerProc) -> String {
    r.admin.trim_start_matches("http://").to_string()
}

/// GET `path` (with the admin token when `auth`); status and body.
async fn get(r: &RunnerProc, path: &str, auth: bool) -> (u16, String) {
    let mut req = reqwest::Client::new().get(format!("{}{path}", r.admin));
    if auth {
        req = req.bearer_auth(TOKEN);
    }
    let resp = req.send().await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

/// `/info` with the token.
async fn info(r: &RunnerProc) -> Json {
    let (status, body) = get(r, "/info", true).await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Starts a runner as a pod of `workload` named `pod` would run, on `cluster`.
fn start_pod(
    k8s: &K8s,
    workload: &Json,
    pod: &str,
    cluster: &Cluster,
) -> (RunnerProc, Vec<(String, String)>, tempfile::TempDir) {
    let c = files::runner_container(workload);
    let volumes = tempfile::tempdir().unwrap();
    let map = k8s_volumes(k8s, workload, volumes.path());
    let args = files::strings(&c["args"]);
    assert_eq!(args[0], "run");
    let mut extra = map.args(&args[1..]);
    // The config's manifest paths are container paths too: give the same folders on this host.
    let conf_at = args.iter().position(|a| a == "--config").unwrap() + 1;
    let config = map
        .host(&args[conf_at])
        .expect("the config file is on a mounted volume");
    let toml: toml::Table = toml::from_str(&std::fs::read_to_string(config).unwrap()).unwrap();
    for m in files::strings(&serde_json::to_value(&toml["runner"]["manifests"]).unwrap()) {
        let host = map
            .host(&m)
            .unwrap_or_else(|| panic!("{m} is on no mounted volume"));
        extra.extend(["--manifest".to_string(), host.display().to_string()]);
    }
    extra.extend(["--nats-url".to_string(), cluster.urls()]);
    let env = k8s_env(c, pod);
    let envs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let r = RunnerProc::start_in(tempfile::tempdir().unwrap(), &extra, &envs);
    (r, env, volumes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_pods_answer_their_probes_and_drain_through_the_prestop_hook() {
    tool("curl", "Debian: curl");
    let cluster = Cluster::start(3);
    let k8s = K8s::load();
    let pods = [
        ("StatefulSet", "runner-saga", "runner-saga-0", "saga"),
        (
            "Deployment",
            "runner-effect",
            "runner-effect-7d4b9-x2x4q",
            "effect",
        ),
    ];
    for (kind, name, pod, mode) in pods {
        let w = k8s.get(kind, name);
        let c = files::runner_container(w);
        let (mut r, env, _volumes) = start_pod(&k8s, w, pod, &cluster);
        for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
            let path = c[probe]["httpGet"]["path"].as_str().unwrap();
            let (status, body) = get(&r, path, false).await;
            assert_eq!(status, 200, "{name} {probe} {path}: {body}");
        }
        let metrics = w["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
            .as_str()
            .unwrap();
        let (status, body) = get(&r, metrics, false).await;
        assert_eq!(status, 200);
        assert!(body.contains("runner_"), "{name}: metrics");
        let i = info(&r).await;
        assert_eq!(i["node_id"], pod, "{name}: node id from the pod name");
        assert_eq!(i["mode"], mode);
        assert!(i["partitions"]["count"].as_u64().is_some(), "{name}: {i}");
        assert!(
            i["manifests"].to_string().contains("order"),
            "{name}: {}",
            i["manifests"]
        );
        // The token from the Secret guards the admin API: no token, no drain.
        let resp = reqwest::Client::new()
            .post(format!("{}/admin/drain", r.admin))
            .send()
            .await
            .unwrap();
        assert_eq!(
            resp.status().as_u16(),
            401,
            "{name}: drain without the token"
        );
        assert!(r.exited().is_none());

        // The preStop hook as written, aimed at this runner: it drains and waits for the exit.
        let hook = files::strings(&c["lifecycle"]["preStop"]["exec"]["command"]);
        assert_eq!(hook[..2], ["/bin/sh", "-c"]);
        let script = retarget(&hook[2], SHIPPED_ADMIN, &admin_addr(&r));
        let (code, out) = sh(&script, &env, Duration::from_secs(90));
        assert_eq!(code, Some(0), "{name}: preStop hook: {out}");
        assert_eq!(
            r.wait_exit(Duration::from_secs(30)),
            Some(0),
            "{name}: drained cleanly"
        );
        assert!(
            r.logged("admin request"),
            "{name}: the drain came from the hook"
        );
    }
}

/// A free loopback port.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Kills the stand-in upstream when the test ends.
struct Upstream(Child);

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a compose runner service on `cluster`, its calls to upstream hosts going to
/// `proxy` (standing in for the compose network's aliases).
fn start_service(
    compose: &Compose,
    docker: &Dockerfile,
    name: &str,
    cluster: &Cluster,
    proxy: &str,
) -> RunnerProc {
    let copies = docker.copies();
    let cmd = docker.exec_form("CMD");
    assert_eq!(cmd[0], "run");
    let mut extra = copies.args(&cmd[1..]);
    let conf_at = cmd.iter().position(|a| a == "--config").unwrap() + 1;
    let conf = copies.host(&cmd[conf_at]).unwrap();
    let toml: toml::Table = toml::from_str(&std::fs::read_to_string(conf).unwrap()).unwrap();
    for m in files::strings(&serde_json::to_value(&toml["runner"]["manifests"]).unwrap()) {
        let host = copies
            .host(&m)
            .unwrap_or_else(|| panic!("{m} is not in the image"));
        extra.extend(["--manifest".to_string(), host.display().to_string()]);
    }
    extra.extend(["--nats-url".to_string(), cluster.urls()]);
    let mut env = compose.env(name);
    env.push(("http_proxy".into(), proxy.into()));
    env.push(("HTTP_PROXY".into(), proxy.into()));
    let envs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    RunnerProc::start_in(tempfile::tempdir().unwrap(), &extra, &envs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_services_answer_their_healthchecks_and_carry_the_load() {
    tool("curl", "Debian: curl");
    let compose = Compose::load();
    let docker = Dockerfile::load();
    let cluster = Cluster::start(3);

    // The stand-in upstream, as its service runs it, on a free loopback port.
    let up = compose.service("upstream");
    let mut argv = files::strings(&up["command"]);
    let mount = files::strings(&up["volumes"]).remove(0);
    let (src, dest) = mount.split_once(':').unwrap();
    let dest = dest.trim_end_matches(":ro");
    let port = free_port();
    for a in argv.iter_mut() {
        if a == dest {
            *a = repo_root().join("docker").join(src).display().to_string();
        }
    }
    assert_eq!(argv.last().map(String::as_str), Some("80"));
    *argv.last_mut().unwrap() = port.to_string();
    argv.push("127.0.0.1".into());
    let log = tempfile::NamedTempFile::new().unwrap();
    let _upstream = Upstream(
        Command::new(&argv[0])
            .args(&argv[1..])
            .stdout(Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .unwrap(),
    );
    let test = files::strings(&up["healthcheck"]["test"]);
    assert_eq!(test[0], "CMD");
    let probe: Vec<String> = test[1..]
        .iter()
        .map(|a| a.replace("127.0.0.1:80/", &format!("127.0.0.1:{port}/")))
        .collect();
    let healthy = common::eventually(Duration::from_secs(20), || {
        let probe = probe.clone();
        async move {
            Command::new(&probe[0])
                .args(&probe[1..])
                .status()
                .is_ok_and(|s| s.success())
        }
    })
    .await;
    assert!(healthy, "the upstream healthcheck never passed");

    // Every runner service's environment, each kind started once (the others differ only in
    // the node id); the union of their keys is every key the file uses.
    let services = compose.runner_services();
    let started = ["saga-1", "effect-1"];
    let keys = |names: &[&str]| -> std::collections::BTreeSet<String> {
        names
            .iter()
            .flat_map(|n| compose.env(n))
            .map(|(k, _)| k)
            .collect()
    };
    let all: Vec<&str> = services.iter().map(String::as_str).collect();
    assert_eq!(
        keys(&started),
        keys(&all),
        "the started services use every key"
    );
    let proxy = format!("http://127.0.0.1:{port}");
    let mut runners = Vec::new();
    for name in started {
        let r = start_service(&compose, &docker, name, &cluster, &proxy);
        let check = files::strings(&compose.service(name)["healthcheck"]["test"]);
        assert_eq!(check[0], "CMD-SHELL");
        let (code, out) = sh(
            &retarget(&check[1], SHIPPED_ADMIN, &admin_addr(&r)),
            &[],
            Duration::from_secs(20),
        );
        assert_eq!(code, Some(0), "{name}: compose healthcheck: {out}");
        let image_check = docker.one("HEALTHCHECK");
        let image_check = &image_check[image_check.find("CMD ").unwrap() + 4..];
        let (code, out) = sh(
            &retarget(image_check, SHIPPED_ADMIN, &admin_addr(&r)),
            &[],
            Duration::from_secs(20),
        );
        assert_eq!(code, Some(0), "{name}: image HEALTHCHECK: {out}");
        let i = info(&r).await;
        assert_eq!(i["node_id"], name);
        assert_eq!(i["mode"], name.split('-').next().unwrap());
        runners.push(r);
    }

    // The load generator, with the arguments of its service.
    let load = compose.service("load");
    let entry = files::strings(&load["entrypoint"]);
    assert_eq!(entry, ["runner-bench"]);
    let mut args = files::strings(&load["command"]);
    let url_at = args.iter().position(|a| a == "--nats-url").unwrap() + 1;
    args[url_at] = cluster.urls();
    let value = |flag: &str| args[args.iter().position(|a| a == flag).unwrap() + 1].clone();
    let orders: usize = value("--orders").parse().unwrap();
    let tenants = value("--tenants").split(',').count();
    let out = Command::new(env!("CARGO_BIN_EXE_runner-bench"))
        .args(&args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "runner-bench: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Every order goes through charge, stock and shipment at the stand-in, and ends shipped.
    let js = jetstream(&cluster.url(0)).await;
    // Each order publishes its own workflow events (OrderFulfilled) and one terminal event.
    let terminal = |seen: &[common::Seen]| -> Vec<Json> {
        seen.iter()
            .map(|e| e.body.clone())
            .filter(|b| {
                b["event_type"]
                    .as_str()
                    .is_some_and(|t| t.starts_with("Saga"))
            })
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(180);
    let ended = loop {
        let ended =
            terminal(&read_stream(&js, "WORKFLOW_EVENTS", "tenant.*.workflow_event.order.*").await);
        if ended.len() >= orders * tenants || Instant::now() > deadline {
            break ended;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(
        ended.len(),
        orders * tenants,
        "one terminal event per order"
    );
    let ids: std::collections::BTreeSet<String> = ended
        .iter()
        .map(|e| format!("{}/{}", e["tenant_id"], e["correlation_id"]))
        .collect();
    assert_eq!(ids.len(), orders * tenants, "every order ended once");
    for e in &ended {
        assert_eq!(e["event_type"], "SagaCompleted", "{e}");
        assert_eq!(e["payload"]["state"], "shipped", "{e}");
    }
    let calls = std::fs::read_to_string(log.path()).unwrap();
    for host in [
        "payments.internal",
        "warehouse.internal",
        "shipping.internal",
    ] {
        assert!(
            calls.contains(&format!("POST http://{host}/")),
            "no call to {host}:\n{calls}"
        );
    }
    // `docker compose stop` sends SIGTERM: each drains and exits 0.
    for r in runners {
        r.stop();
    }
}
