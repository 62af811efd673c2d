//! The packaging files, validated offline: no Docker engine or Kubernetes cluster runs where
//! this suite runs, so each file is checked by the real tool that understands it and against
//! the real binary.
//!
//! - `deploy/k8s/*.yaml` pass `kubernetes-validate --strict` (unknown fields refused) for
//!   Kubernetes 1.33 and for the newest version the validator bundles.
//! - `docker/compose.yaml` passes the compose specification's schema (`check-jsonschema`),
//!   and its NATS config passes `nats-server -t` for each node.
//! - The Dockerfile's dependency layer, run as written with the build swapped for a fetch,
//!   gives a tree Cargo accepts with the locked dependencies; every stub it writes is
//!   touched again before the real build.
//! - Limits and ports agree: the grace periods outlast `runner.drain_timeout`, the startup
//!   windows outlast NATS connection and set-up, every probe, hook, healthcheck, published
//!   port and Service port is the config's admin port, the data directory is on a writable
//!   volume large enough for `storage.max_size`, and the image's user is the pods' user.
//! - The real `runner` is started as each pod and each compose service would start it: the
//!   shipped config and the shipped environment (ConfigMaps written in the kubelet's layout,
//!   the image's files from the Dockerfile's COPY lines), against a three-node NATS cluster,
//!   with only addresses, the data directory and paths moved to this host. The loader
//!   refuses unknown keys from the file and the environment (checked here too), so a runner
//!   that starts accepted every key. Then every probe, healthcheck and the preStop hook runs
//!   as written (curl through `sh`, retargeted to the runner's port), and the compose load
//!   generator's orders go through the saga and effect services to the stand-in upstream.
//!
//! The validators are Python packages that `scripts/setup-deps --test` installs; when one is
//! missing the test fails saying so.

#![allow(clippy::unwrap_used)]

mod common;
#[path = "packaging/files.rs"]
mod files;
#[path = "packaging/live.rs"]
mod live;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use runner::config::{Config, Overrides};

use common::repo_root;
use files::{
    Compose, Dockerfile, K8s, k8s_env, k8s_files, pod_spec, port_number, runner_container,
};

/// Finds a command on `PATH` or in Python's scripts directory (where pip puts it), or fails
/// saying how to install it.
fn tool(name: &str, package: &str) -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Ok(out) = Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('scripts'))",
        ])
        .output()
    {
        dirs.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    }
    dirs.into_iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} not found: the packaging tests need it. Install it with \
                 `scripts/setup-deps --test` (package {package})."
            )
        })
}

/// Runs a command to completion; returns success and stdout + stderr.
fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn kubernetes_objects_pass_strict_schema_validation() {
    let validator = tool("kubernetes-validate", "pip: kubernetes-validate");
    let files = k8s_files();
    let objects = K8s::load().objects.len();
    assert!(objects >= 8, "deploy/k8s holds {objects} objects");
    // 1.33: the oldest version the objects are written for; then the validator's default,
    // the newest it bundles.
    for version in [Some("1.33.0"), None] {
        let mut cmd = Command::new(&validator);
        cmd.arg("--strict");
        if let Some(v) = version {
            cmd.args(["--kubernetes-version", v]);
        }
        let (ok, out) = run(cmd.args(&files));
        assert!(ok, "kubernetes-validate {version:?} failed:\n{out}");
        assert!(!out.contains("ERROR"), "{out}");
        let passed = out
            .lines()
            .filter(|l| l.contains(" passed for resource "))
            .count();
        assert_eq!(
            passed, objects,
            "every object validated, none skipped:\n{out}"
        );
    }
}

#[test]
fn compose_file_passes_the_compose_specification_schema() {
    let checker = tool("check-jsonschema", "pip: check-jsonschema");
    let (ok, out) = run(Command::new(checker)
        .args(["--builtin-schema", "vendor.compose-spec"])
        .arg(repo_root().join("docker/compose.yaml")));
    assert!(ok, "check-jsonschema failed:\n{out}");
    assert!(out.contains("ok -- validation done"), "{out}");
}

#[test]
fn each_nats_node_config_is_accepted_by_nats_server() {
    let compose = Compose::load();
    let nats: Vec<String> = compose.0["services"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, s)| s["image"].as_str().is_some_and(|i| i.starts_with("nats:")))
        .map(|(n, _)| n.clone())
        .collect();
    assert_eq!(nats.len(), 3, "three NATS nodes: {nats:?}");
    let mut names = BTreeSet::new();
    for service in &nats {
        let s = compose.service(service);
        // 2.12 or newer: partitioned saga mode needs 2.12.1 (a 2.12 tag is its newest patch).
        let image = s["image"].as_str().unwrap();
        let tag: Vec<u32> = image["nats:".len()..]
            .split(['-', '.'])
            .take(2)
            .map(|p| p.parse().unwrap())
            .collect();
        assert!(tag >= vec![2, 12], "{service} runs {image}");
        let args = files::strings(&s["command"]);
        let conf_at = args.iter().position(|a| a == "-c").unwrap() + 1;
        let mount = files::strings(&s["volumes"])
            .into_iter()
            .find(|v| v.split(':').nth(1) == Some(args[conf_at].as_str()))
            .expect("the config file is mounted");
        let host = repo_root()
            .join("docker")
            .join(mount.split(':').next().unwrap());
        let env = compose.env(service);
        let (ok, out) = run(Command::new(common::nats_server_bin())
            .arg("-t")
            .arg("-c")
            .arg(&host)
            .envs(env.iter().cloned()));
        assert!(
            ok,
            "nats-server -t refused {} for {service}:\n{out}",
            host.display()
        );
        let text = std::fs::read_to_string(&host).unwrap();
        for other in &nats {
            assert!(
                text.contains(&format!("nats-route://{other}:6222")),
                "route to {other}"
            );
        }
        names.insert(files::env_map(&env)["NATS_SERVER_NAME"].clone());
    }
    assert_eq!(names.len(), 3, "distinct server names: {names:?}");
}

#[test]
fn kustomization_readme_and_volumes_cover_every_object() {
    let text = files::read("deploy/k8s/kustomization.yaml");
    let k = files::yaml_docs("kustomization.yaml", &text).remove(0);
    let listed: BTreeSet<String> = files::strings(&k["resources"]).into_iter().collect();
    let present: BTreeSet<String> = k8s_files()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().to_string())
        .filter(|n| n != "kustomization.yaml")
        .collect();
    assert_eq!(listed, present);

    // The Secret the pods read is the one the README has you create.
    let k8s = K8s::load();
    let readme = files::read("deploy/k8s/README.md");
    for (kind, name) in [
        ("StatefulSet", "runner-saga"),
        ("Deployment", "runner-effect"),
    ] {
        let w = k8s.get(kind, name);
        for e in runner_container(w)["env"].as_array().unwrap() {
            let secret = &e["valueFrom"]["secretKeyRef"];
            if secret.is_object() {
                let create = format!(
                    "create secret generic {} --from-literal={}=",
                    secret["name"].as_str().unwrap(),
                    secret["key"].as_str().unwrap()
                );
                assert!(readme.contains(&create), "README lacks `{create}`");
            }
        }
        // Every manifest of the ConfigMap is mounted (items pick keys: one left out would
        // silently not load).
        let keys: BTreeSet<String> = k8s.get("ConfigMap", "runner-manifests")["data"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        let volume = pod_spec(w)["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["configMap"]["name"] == "runner-manifests")
            .expect("the manifests volume");
        let mounted: BTreeSet<String> = volume["configMap"]["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["key"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(mounted, keys, "{name}: manifests mounted");
    }
}

/// Loads the shipped config through the real loader with a container's environment.
fn load_config(toml: &str, env: &[(String, String)]) -> Result<Config, String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("runner.toml");
    std::fs::write(&path, toml).unwrap();
    runner::config::load(Some(&path), env.iter().cloned(), &Overrides::default())
        .map_err(|e| e.to_string())
}

/// A Kubernetes quantity (`10Gi`, `512Mi`) in bytes.
fn quantity(q: &str) -> u64 {
    let (num, unit) = q.split_at(q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len()));
    let mult = match unit {
        "Gi" => 1 << 30,
        "Mi" => 1 << 20,
        "" => 1,
        other => panic!("unit {other} of {q}"),
    };
    num.parse::<u64>().unwrap() * mult
}

/// The port `cmd` sends requests to on 127.0.0.1.
fn local_port(cmd: &str) -> u16 {
    let at = cmd.find("127.0.0.1:").expect("a request to 127.0.0.1") + "127.0.0.1:".len();
    cmd[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap()
}

#[test]
fn kubernetes_limits_and_ports_agree_with_the_config() {
    let k8s = K8s::load();
    let toml = k8s.get("ConfigMap", "runner-config")["data"]["runner.toml"]
        .as_str()
        .unwrap();
    let docker = Dockerfile::load();
    let image_user: Vec<u64> = docker
        .one("USER")
        .split(':')
        .map(|p| p.parse().expect("numeric USER"))
        .collect();
    assert_ne!(image_user[0], 0, "the image runs as root");
    let workloads = [
        ("StatefulSet", "runner-saga"),
        ("Deployment", "runner-effect"),
    ];
    for (kind, name) in workloads {
        let w = k8s.get(kind, name);
        let c = runner_container(w);
        let spec = pod_spec(w);
        let config = load_config(toml, &k8s_env(c, &format!("{name}-0")))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let drain = config.runner.drain_timeout.get().as_secs_f64();
        let grace = spec["terminationGracePeriodSeconds"]
            .as_f64()
            .expect("a grace period");
        assert!(
            grace > drain,
            "{name}: grace {grace}s must outlast the {drain}s drain"
        );
        let admin = config.admin.addr.port();
        assert_eq!(
            port_number(c, &"admin".into()),
            admin,
            "{name}: containerPort"
        );
        for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
            let p = &c[probe]["httpGet"];
            assert_eq!(port_number(c, &p["port"]), admin, "{name} {probe} port");
        }
        let start = &c["startupProbe"];
        let window =
            start["periodSeconds"].as_f64().unwrap() * start["failureThreshold"].as_f64().unwrap();
        let needed =
            (config.nats.connect_timeout.get() + config.nats.setup_timeout.get()).as_secs_f64();
        assert!(
            window > needed,
            "{name}: startup window {window}s < {needed}s"
        );
        let hook = files::strings(&c["lifecycle"]["preStop"]["exec"]["command"]).join(" ");
        assert_eq!(local_port(&hook), admin, "{name}: preStop port");
        assert!(hook.contains("/admin/drain"), "{name}: preStop drains");
        let ann = &w["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"];
        assert_eq!(ann.as_str().unwrap().parse::<u16>().unwrap(), admin);
        // Security: non-root, the image's user, a read-only root file system.
        let sc = &spec["securityContext"];
        assert_eq!(sc["runAsNonRoot"], true, "{name}");
        assert_eq!(
            sc["runAsUser"].as_u64(),
            Some(image_user[0]),
            "{name}: the image's uid"
        );
        assert_eq!(
            c["securityContext"]["readOnlyRootFilesystem"], true,
            "{name}"
        );
        // The store lies on a writable volume large enough for it.
        let data_dir = config.storage.data_dir.display().to_string();
        let mount = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| data_dir.starts_with(m["mountPath"].as_str().unwrap()))
            .unwrap_or_else(|| panic!("{name}: {data_dir} is on no volume"));
        assert_ne!(mount["readOnly"], true);
        let vol = mount["name"].as_str().unwrap();
        let size = match spec["volumes"]
            .as_array()
            .and_then(|v| v.iter().find(|v| v["name"] == vol))
        {
            Some(v) => v["emptyDir"]["sizeLimit"]
                .as_str()
                .expect("an emptyDir with a sizeLimit"),
            None => w["spec"]["volumeClaimTemplates"]
                .as_array()
                .unwrap()
                .iter()
                .find(|t| t["metadata"]["name"] == vol)
                .expect("a volumeClaimTemplate")["spec"]["resources"]["requests"]["storage"]
                .as_str()
                .unwrap(),
        };
        assert!(
            config.storage.max_size.get() <= quantity(size),
            "{name}: max_size > {size}"
        );
        // Partitioned saga replicas need a stable node id: the pod name.
        assert_eq!(
            config.node.id,
            format!("{name}-0"),
            "{name}: node id from the pod name"
        );
    }
    // Services and PDBs reach the pods they mean to.
    for s in k8s.all("Service") {
        for p in s["spec"]["ports"].as_array().unwrap() {
            assert_eq!(p["targetPort"], "admin", "{}", s["metadata"]["name"]);
        }
    }
    for pdb in k8s.all("PodDisruptionBudget") {
        let want = pdb["spec"]["selector"]["matchLabels"].as_object().unwrap();
        let hits = workloads
            .iter()
            .filter(|(k, n)| {
                let labels = &k8s.get(k, n)["spec"]["template"]["metadata"]["labels"];
                want.iter().all(|(key, v)| &labels[key] == v)
            })
            .count();
        assert_eq!(hits, 1, "{} selects one workload", pdb["metadata"]["name"]);
    }
    assert_eq!(
        k8s.get("StatefulSet", "runner-saga")["spec"]["serviceName"],
        "runner-saga"
    );
    assert!(
        k8s.get("Service", "runner-saga")["spec"]["clusterIP"] == "None",
        "headless"
    );
}

#[test]
fn image_and_compose_limits_and_ports_agree_with_the_config() {
    let docker = Dockerfile::load();
    let compose = Compose::load();
    let image_config = files::read("docker/runner.toml");
    let health = docker.one("HEALTHCHECK");
    let expose: u16 = docker.one("EXPOSE").parse().unwrap();
    let start_period: f64 = health
        .split_whitespace()
        .find_map(|a| a.strip_prefix("--start-period="))
        .map(|s| humantime::parse_duration(s).unwrap().as_secs_f64())
        .expect("a start period");
    let services = compose.runner_services();
    assert_eq!(
        services.len(),
        5,
        "three saga and two effect services: {services:?}"
    );
    for name in &services {
        let s = compose.service(name);
        let config = load_config(&image_config, &compose.env(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let admin = config.admin.addr.port();
        assert_eq!(expose, admin, "EXPOSE");
        assert_eq!(local_port(health), admin, "HEALTHCHECK");
        assert_eq!(
            compose.published_container_ports(name),
            vec![admin],
            "{name}: ports"
        );
        let check = files::strings(&s["healthcheck"]["test"]).join(" ");
        assert_eq!(local_port(&check), admin, "{name}: healthcheck port");
        assert!(check.contains("/health"), "{name}");
        let needed =
            (config.nats.connect_timeout.get() + config.nats.setup_timeout.get()).as_secs_f64();
        let compose_start =
            humantime::parse_duration(s["healthcheck"]["start_period"].as_str().unwrap())
                .unwrap()
                .as_secs_f64();
        assert!(
            start_period > needed && compose_start > needed,
            "{name}: start periods"
        );
        let grace = humantime::parse_duration(s["stop_grace_period"].as_str().unwrap()).unwrap();
        assert!(
            grace > config.runner.drain_timeout.get(),
            "{name}: stop_grace_period"
        );
        assert!(
            config.partitions.enabled.is_none() && config.streams.replicas == 3,
            "{name}: R3 streams, no partition flag"
        );
        assert_eq!(config.node.id, *name, "{name}: node id");
        assert!(
            s["volumes"].as_array().is_some_and(|v| v.len() == 1),
            "{name}: own volume"
        );
    }
    // The stand-in answers for every host the image's manifests call over HTTP.
    let aliases: BTreeSet<String> =
        files::strings(&compose.service("upstream")["networks"]["default"]["aliases"])
            .into_iter()
            .collect();
    for entry in std::fs::read_dir(repo_root().join("manifests")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for url in text.split("url: ").skip(1) {
            if let Some(host) = url.strip_prefix("http://") {
                let host = host.split(['/', ':']).next().unwrap();
                assert!(
                    aliases.contains(host),
                    "{}: {host} is not served",
                    path.display()
                );
            }
        }
    }
    for name in &services {
        if let Some(url) = files::env_map(&compose.env(name)).get("BUREAU_URL") {
            let host = url.trim_start_matches("http://");
            assert!(aliases.contains(host), "{name}: BUREAU_URL {url}");
        }
    }
}

#[test]
fn the_loader_refuses_unknown_keys_from_file_and_environment() {
    // What makes "the runner started, so every key was accepted" true.
    let toml = files::read("docker/runner.toml");
    let token = ("RUNNER__ADMIN__TOKEN".to_string(), files::TOKEN.to_string());
    let with = |k: &str| vec![token.clone(), (k.to_string(), "1".to_string())];
    // The image's config listens on every interface, so it needs the token to load at all.
    assert!(load_config(&toml, &[]).is_err());
    assert!(load_config(&toml, std::slice::from_ref(&token)).is_ok());
    assert!(load_config(&toml, &with("RUNNER__ADMIN__TOKEN_LENGTH")).is_err());
    assert!(load_config(&toml, &with("RUNNER__NOSUCH__KEY")).is_err());
    let typo = toml.replace("[storage]\n", "[storage]\ndatadir = \"x\"\n");
    assert_ne!(typo, toml);
    assert!(load_config(&typo, std::slice::from_ref(&token)).is_err());
}

#[test]
fn dockerfile_dependency_layer_gives_a_tree_cargo_accepts() {
    let docker = Dockerfile::load();
    let mut at = docker
        .0
        .iter()
        .position(|(k, v)| k == "COPY" && v.starts_with("Cargo.toml"))
        .expect("the dependency layer's COPY");
    // The layer's COPY lines (the manifests, then the vendored crate), as Docker copies
    // them: a file into the destination directory, a directory's contents into the
    // destination.
    let dir = tempfile::tempdir().unwrap();
    while docker.0[at].0 == "COPY" {
        let copied: Vec<&str> = docker.0[at].1.split_whitespace().collect();
        let (sources, dest) = copied.split_at(copied.len() - 1);
        for s in sources {
            copy_into(&repo_root().join(s), &dir.path().join(dest[0]));
        }
        at += 1;
    }
    let (kw, stub) = &docker.0[at];
    assert_eq!(kw, "RUN");
    let build = "cargo build --release --locked --bins";
    assert!(stub.contains(build), "{stub}");
    // The stub layer as written, with the build swapped for a fetch: Cargo reads every
    // target and checks the lock file, compiling nothing.
    let host =
        String::from_utf8(Command::new("rustc").arg("-vV").output().unwrap().stdout).unwrap();
    let host = host
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .unwrap()
        .to_string();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let fetch = format!("{cargo} fetch --locked --offline --target {host}");
    let (ok, out) = run(Command::new("sh")
        .arg("-c")
        .arg(stub.replace(build, &fetch))
        .current_dir(dir.path()));
    assert!(ok, "the dependency layer fails:\n{out}");
    // Every stub it wrote is touched after the real sources are copied, so none survives.
    let stubs: BTreeSet<&str> = stub
        .split("> ")
        .skip(1)
        .map(|s| s.split_whitespace().next().unwrap())
        .chain(
            stub.split("touch ")
                .skip(1)
                .map(|s| s.split_whitespace().next().unwrap()),
        )
        .collect();
    let rebuild = docker.0[at + 1..]
        .iter()
        .find(|(k, v)| k == "RUN" && v.contains(build))
        .expect("the real build");
    let touched: BTreeSet<&str> = rebuild.1["touch ".len()..]
        .split("&&")
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    assert!(rebuild.1.starts_with("touch "), "{}", rebuild.1);
    let missing: Vec<_> = stubs.difference(&touched).collect();
    assert!(
        missing.is_empty(),
        "stubs not touched before the real build: {missing:?}"
    );
}

/// `COPY source dest` in a Dockerfile: a file lands in `dest`, a directory's contents are
/// copied into `dest`, recursively.
fn copy_into(source: &Path, dest: &Path) {
    std::fs::create_dir_all(dest).unwrap();
    if source.is_dir() {
        for e in std::fs::read_dir(source).unwrap() {
            let e = e.unwrap();
            if e.path().is_dir() {
                copy_into(&e.path(), &dest.join(e.file_name()));
            } else {
                std::fs::copy(e.path(), dest.join(e.file_name())).unwrap();
            }
        }
    } else {
        std::fs::copy(source, dest.join(source.file_name().unwrap())).unwrap();
    }
}
