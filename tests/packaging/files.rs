//! Reading the packaging files (`deploy/k8s/`, `docker/compose.yaml`, `docker/Dockerfile`)
//! the way their consumers would, and laying out on this host what a container would see.
//!
//! Nothing here is a stand-in for the real tools: the YAML is parsed as YAML (merge keys
//! expanded, as Compose does), a ConfigMap volume is written in the kubelet's layout (the
//! real files in a hidden dated folder, `..data` pointing at it, the visible names pointing
//! through `..data`), and every container path a runner is given is mapped to the host
//! directory that holds the same files. Anything a file uses that this module does not know
//! how to map (an unknown `valueFrom`, an unknown `${VAR}`) fails the test instead of being
//! skipped.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use crate::common::repo_root;

/// The admin token the tests hand to every runner, standing in for the Secret's value and
/// for `RUNNER_ADMIN_TOKEN` of the compose file.
pub(crate) const TOKEN: &str = "packaging-test-admin-token-0123456789";

/// A file of the repository as text.
pub(crate) fn read(rel: &str) -> String {
    let path = repo_root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Every non-empty YAML document of a text, as JSON.
pub(crate) fn yaml_docs(what: &str, text: &str) -> Vec<Json> {
    serde_saphyr::from_multiple::<Json>(text)
        .unwrap_or_else(|e| panic!("{what} is not valid YAML: {e}"))
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

/// The YAML files of `deploy/k8s`, sorted.
pub(crate) fn k8s_files() -> Vec<PathBuf> {
    let dir = repo_root().join("deploy/k8s");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
        .collect();
    files.sort();
    files
}

/// The Kubernetes objects of `deploy/k8s` (the kustomization aside), with their file names.
pub(crate) struct K8s {
    /// `(file name, object)` in file order.
    pub(crate) objects: Vec<(String, Json)>,
}

impl K8s {
    /// Parses every YAML file of `deploy/k8s`.
    pub(crate) fn load() -> Self {
        let mut objects = Vec::new();
        for path in k8s_files() {
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            let text = std::fs::read_to_string(&path).unwrap();
            for doc in yaml_docs(&name, &text) {
                if doc["kind"] != "Kustomization" {
                    objects.push((name.clone(), doc));
                }
            }
        }
        Self { objects }
    }

    /// The object of `kind` named `name`; panics when there is none.
    pub(crate) fn get(&self, kind: &str, name: &str) -> &Json {
        self.objects
            .iter()
            .map(|(_, o)| o)
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("deploy/k8s has no {kind} {name}"))
    }

    /// Every object of `kind`.
    pub(crate) fn all(&self, kind: &str) -> Vec<&Json> {
        self.objects
            .iter()
            .map(|(_, o)| o)
            .filter(|o| o["kind"] == kind)
            .collect()
    }
}

/// The pod template's spec of a workload.
pub(crate) fn pod_spec(workload: &Json) -> &Json {
    &workload["spec"]["template"]["spec"]
}

/// The container named `runner` of a workload.
pub(crate) fn runner_container(workload: &Json) -> &Json {
    pod_spec(workload)["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "runner")
        .expect("a container named runner")
}

/// A list of strings from a JSON array.
pub(crate) fn strings(v: &Json) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("expected a list, found {v}"))
        .iter()
        .map(|s| match s {
            Json::String(s) => s.clone(),
            other => other.to_string(),
        })
        .collect()
}

/// The number of a container port given by name or number.
pub(crate) fn port_number(container: &Json, port: &Json) -> u16 {
    if let Some(n) = port.as_u64() {
        return n as u16;
    }
    let name = port.as_str().expect("a port name or number");
    container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port named {name}")) as u16
}

/// The pod's environment as the kubelet would set it, for the pod named `pod_name`:
/// `value`s as written, `fieldRef: metadata.name` as the pod name, and the Secret
/// `runner-admin`'s key `token` as [`TOKEN`]. Any other source fails.
pub(crate) fn k8s_env(container: &Json, pod_name: &str) -> Vec<(String, String)> {
    let Some(list) = container["env"].as_array() else {
        return Vec::new();
    };
    list.iter()
        .map(|e| {
            let name = e["name"].as_str().unwrap().to_string();
            if let Some(v) = e["value"].as_str() {
                return (name, v.to_string());
            }
            let from = &e["valueFrom"];
            let value = if from["fieldRef"]["fieldPath"] == "metadata.name" {
                pod_name.to_string()
            } else if from["secretKeyRef"]["name"] == "runner-admin"
                && from["secretKeyRef"]["key"] == "token"
            {
                TOKEN.to_string()
            } else {
                panic!("{name}: a value source this test does not know: {from}")
            };
            (name, value)
        })
        .collect()
}

/// Writes a ConfigMap volume into `dir` as the kubelet does: the files under a hidden dated
/// folder, `..data` linking to it, and each top-level name linking through `..data`.
/// `items` (the volume's `items`, if any) picks keys and the paths they get.
pub(crate) fn write_configmap_volume(dir: &Path, configmap: &Json, items: Option<&Json>) {
    let data = configmap["data"]
        .as_object()
        .expect("a ConfigMap with data");
    let files: Vec<(String, String)> = match items.and_then(|i| i.as_array()) {
        Some(items) => items
            .iter()
            .map(|i| {
                let key = i["key"].as_str().unwrap();
                let text = data[key].as_str().unwrap_or_else(|| panic!("no key {key}"));
                (i["path"].as_str().unwrap().to_string(), text.to_string())
            })
            .collect(),
        None => data
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
            .collect(),
    };
    let dated = "..2026_01_01_00_00_00.000000001";
    std::fs::create_dir_all(dir.join(dated)).unwrap();
    let mut top = std::collections::BTreeSet::new();
    for (path, text) in &files {
        let target = dir.join(dated).join(path);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::write(&target, text).unwrap();
        top.insert(path.split('/').next().unwrap().to_string());
    }
    std::os::unix::fs::symlink(dated, dir.join("..data")).unwrap();
    for name in top {
        std::os::unix::fs::symlink(format!("..data/{name}"), dir.join(&name)).unwrap();
    }
}

/// Container paths mapped to host paths: `(container prefix, host directory)`.
#[derive(Default)]
pub(crate) struct PathMap(pub(crate) Vec<(String, PathBuf)>);

impl PathMap {
    /// The host path of an absolute container path, through the longest matching prefix.
    pub(crate) fn host(&self, container_path: &str) -> Option<PathBuf> {
        self.0
            .iter()
            .filter(|(prefix, _)| {
                let p = prefix.trim_end_matches('/');
                container_path == p || container_path.starts_with(&format!("{p}/"))
            })
            .max_by_key(|(prefix, _)| prefix.len())
            .map(|(prefix, host)| {
                let rest =
                    container_path[prefix.trim_end_matches('/').len()..].trim_start_matches('/');
                if rest.is_empty() {
                    host.clone()
                } else {
                    host.join(rest)
                }
            })
    }

    /// `args` with every absolute path that lies under a mapped prefix replaced by its host
    /// path.
    pub(crate) fn args(&self, args: &[String]) -> Vec<String> {
        args.iter()
            .map(|a| match self.host(a) {
                Some(p) if a.starts_with('/') => p.display().to_string(),
                _ => a.clone(),
            })
            .collect()
    }
}

/// Lays out a workload's ConfigMap volumes under `dir` (one folder per volume) and maps
/// their mount paths there. Volumes of other kinds (the data volume) are left out: the
/// tests give each runner a data directory of its own.
pub(crate) fn k8s_volumes(k8s: &K8s, workload: &Json, dir: &Path) -> PathMap {
    let spec = pod_spec(workload);
    let mut map = PathMap::default();
    for m in runner_container(workload)["volumeMounts"]
        .as_array()
        .unwrap()
    {
        let name = m["name"].as_str().unwrap();
        let Some(volume) = spec["volumes"]
            .as_array()
            .and_then(|vs| vs.iter().find(|v| v["name"] == name))
        else {
            continue; // a volumeClaimTemplate
        };
        let Some(cm) = volume["configMap"].as_object() else {
            continue;
        };
        let host = dir.join(name);
        std::fs::create_dir_all(&host).unwrap();
        let configmap = k8s.get("ConfigMap", cm["name"].as_str().unwrap());
        write_configmap_volume(&host, configmap, cm.get("items"));
        map.0
            .push((m["mountPath"].as_str().unwrap().to_string(), host));
    }
    map
}

/// `docker/compose.yaml`, parsed (merge keys expanded).
pub(crate) struct Compose(pub(crate) Json);

impl Compose {
    /// Parses the compose file.
    pub(crate) fn load() -> Self {
        let mut docs = yaml_docs("docker/compose.yaml", &read("docker/compose.yaml"));
        assert_eq!(docs.len(), 1, "one document");
        Self(docs.remove(0))
    }

    /// A service; panics when there is none.
    pub(crate) fn service(&self, name: &str) -> &Json {
        let s = &self.0["services"][name];
        assert!(s.is_object(), "compose has no service {name}");
        s
    }

    /// Names of the services whose image is built from docker/Dockerfile and that run
    /// `runner` (not another entrypoint).
    pub(crate) fn runner_services(&self) -> Vec<String> {
        self.0["services"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(_, s)| s["build"]["dockerfile"] == "docker/Dockerfile")
            .filter(|(_, s)| s["entrypoint"].is_null())
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// A service's environment with `${RUNNER_ADMIN_TOKEN…}` interpolated as [`TOKEN`]; any
    /// other interpolation fails.
    pub(crate) fn env(&self, service: &str) -> Vec<(String, String)> {
        let env = &self.service(service)["environment"];
        let pairs: Vec<(String, String)> = match env {
            Json::Object(m) => m
                .iter()
                .map(|(k, v)| {
                    let v = match v {
                        Json::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (k.clone(), v)
                })
                .collect(),
            Json::Array(list) => strings(&Json::Array(list.clone()))
                .into_iter()
                .map(|kv| {
                    let (k, v) = kv.split_once('=').expect("KEY=VALUE");
                    (k.to_string(), v.to_string())
                })
                .collect(),
            Json::Null => Vec::new(),
            other => panic!("environment of {service}: {other}"),
        };
        pairs
            .into_iter()
            .map(|(k, v)| (k, interpolate(&v)))
            .collect()
    }

    /// The port, in the container, of each `host:container` port a service publishes.
    pub(crate) fn published_container_ports(&self, service: &str) -> Vec<u16> {
        match self.service(service)["ports"].as_array() {
            None => Vec::new(),
            Some(ports) => ports
                .iter()
                .map(|p| {
                    let p = p.as_str().expect("short port syntax");
                    p.rsplit(':').next().unwrap().parse().unwrap()
                })
                .collect(),
        }
    }
}

fn interpolate(v: &str) -> String {
    let mut out = String::new();
    let mut rest = v;
    while let Some(at) = rest.find("${") {
        out.push_str(&rest[..at]);
        let end = rest[at..].find('}').expect("closing brace") + at;
        let expr = &rest[at + 2..end];
        let name = expr.split([':', '-', '?']).next().unwrap();
        assert_eq!(
            name, "RUNNER_ADMIN_TOKEN",
            "an interpolation the test does not know: {v}"
        );
        out.push_str(TOKEN);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// `docker/Dockerfile` as instructions (continuation lines joined, comments dropped).
pub(crate) struct Dockerfile(pub(crate) Vec<(String, String)>);

impl Dockerfile {
    /// Parses the Dockerfile.
    pub(crate) fn load() -> Self {
        let mut out = Vec::new();
        let mut current = String::new();
        for line in read("docker/Dockerfile").lines() {
            let t = line.trim();
            if t.starts_with('#') || (t.is_empty() && current.is_empty()) {
                continue;
            }
            match t.strip_suffix('\\') {
                Some(part) => {
                    current.push_str(part);
                    current.push(' ');
                }
                None => {
                    current.push_str(t);
                    let (kw, rest) = current.split_once(' ').unwrap_or((&current, ""));
                    out.push((kw.to_ascii_uppercase(), rest.trim().to_string()));
                    current.clear();
                }
            }
        }
        Self(out)
    }

    /// The instructions of the last stage (the runtime image).
    pub(crate) fn runtime(&self) -> &[(String, String)] {
        let from = self.0.iter().rposition(|(k, _)| k == "FROM").unwrap();
        &self.0[from..]
    }

    /// The argument of the one instruction `kw` of the runtime stage.
    pub(crate) fn one(&self, kw: &str) -> &str {
        let found: Vec<&str> = self
            .runtime()
            .iter()
            .filter(|(k, _)| k == kw)
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(found.len(), 1, "one {kw} in the runtime stage: {found:?}");
        found[0]
    }

    /// An exec-form (JSON array) instruction of the runtime stage.
    pub(crate) fn exec_form(&self, kw: &str) -> Vec<String> {
        strings(&serde_json::from_str(self.one(kw)).expect("exec form"))
    }

    /// Container paths of the runtime image mapped to the repository files copied there.
    pub(crate) fn copies(&self) -> PathMap {
        let mut map = PathMap::default();
        for (k, v) in self.runtime() {
            if k != "COPY" || v.starts_with("--from") {
                continue;
            }
            let parts: Vec<&str> = v.split_whitespace().collect();
            let [src, dest] = parts[..] else {
                panic!("COPY with one source expected: {v}")
            };
            let dest = if dest.ends_with('/') && !src.ends_with('/') {
                format!(
                    "{dest}{}",
                    Path::new(src).file_name().unwrap().to_string_lossy()
                )
            } else {
                dest.to_string()
            };
            map.0.push((dest, repo_root().join(src)));
        }
        map
    }
}

/// `cmd` with `from` (e.g. `127.0.0.1:8080`) replaced by `to`; fails when `from` is absent.
pub(crate) fn retarget(cmd: &str, from: &str, to: &str) -> String {
    assert!(cmd.contains(from), "{cmd:?} does not address {from}");
    cmd.replace(from, to)
}

/// Key/value pairs as a map, for lookups.
pub(crate) fn env_map(env: &[(String, String)]) -> BTreeMap<String, String> {
    env.iter().cloned().collect()
}
