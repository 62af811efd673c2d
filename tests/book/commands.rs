//! Running the book's `run` blocks: chapter by chapter, as one bash script from the
//! repository root, with the real `runner` and nats-server first on `PATH`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::common;
use super::markdown::{blocks, chapters, root, src_dir};

/// Runs the `run` blocks of one chapter, in order, as one bash script from the repository
/// root, with `runner` and `nats-server` first on `PATH`. Returns the combined output; fails
/// the test on a non-zero exit or after `limit`.
fn run_chapter(chapter: &str, envs: &[(&str, String)], limit: Duration) -> String {
    let file = src_dir().join(chapter);
    let mut script = String::from(
        "set -euo pipefail\n\
         cleanup() { for p in $(jobs -p); do kill \"$p\" 2>/dev/null || true; done; }\n\
         trap cleanup EXIT\n",
    );
    let mut n = 0;
    for b in blocks(&file).iter().filter(|b| b.has("run")) {
        script.push_str(&format!("echo '### book: {}' >&2\n", b.at()));
        script.push_str(&b.body);
        n += 1;
    }
    assert!(n > 0, "{chapter} has no run block");
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_runner"))
        .parent()
        .unwrap()
        .to_path_buf();
    let nats_dir = common::nats_server_bin().parent().unwrap().to_path_buf();
    let path = std::env::join_paths([bin_dir, nats_dir].into_iter().chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))
    .unwrap();
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(&script)
        .current_dir(root())
        .env("PATH", path)
        .stdin(Stdio::null())
        .stdout(log.reopen().unwrap())
        .stderr(log.reopen().unwrap());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > limit {
            let _ = Command::new("kill")
                .arg("--")
                .arg(format!("-{}", child.id()))
                .status();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = std::fs::read_to_string(log.path()).unwrap_or_default();
    match status {
        Some(s) if s.success() => output,
        Some(s) => panic!(
            "{chapter}: the commands failed ({s}):\n{output}{}",
            work_logs(envs)
        ),
        None => panic!(
            "{chapter}: the commands did not finish within {limit:?}:\n{output}{}",
            work_logs(envs)
        ),
    }
}

/// The end of every `*.log` the chapter wrote under `$WORK` (the runner's, nats-server's, a
/// stand-in service's), so a failure shows what the background processes said.
fn work_logs(envs: &[(&str, String)]) -> String {
    let Some((_, work)) = envs.iter().find(|(k, _)| *k == "WORK") else {
        return String::new();
    };
    let mut out = String::new();
    let mut logs: Vec<_> = std::fs::read_dir(work)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    logs.sort();
    for p in logs {
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(60).collect();
        out.push_str(&format!(
            "\n--- {} (last {} lines)\n",
            p.display(),
            tail.len()
        ));
        for l in tail.into_iter().rev() {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

/// The structure of a JSON value: object keys (ids replaced), value types, arrays by their
/// first element.
fn shape(v: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        J::Object(m) => J::Object(
            m.iter()
                .map(|(k, x)| {
                    let k = if uuid::Uuid::parse_str(k).is_ok() {
                        "<id>".to_owned()
                    } else {
                        k.clone()
                    };
                    (k, shape(x))
                })
                .collect(),
        ),
        J::Array(a) => J::Array(a.first().map(shape).into_iter().collect()),
        J::String(_) => J::String("string".into()),
        J::Number(_) => J::String("number".into()),
        J::Bool(_) => J::String("bool".into()),
        J::Null => J::Null,
    }
}

#[test]
fn getting_started_runs_from_a_clean_state_to_a_drained_node() {
    let work = tempfile::tempdir().unwrap();
    let ports = common::cluster::free_ports(3);
    let out = run_chapter(
        "getting-started.md",
        &[
            ("NATS_PORT", ports[0].to_string()),
            ("ADMIN_PORT", ports[1].to_string()),
            ("BUREAU_PORT", ports[2].to_string()),
            ("WORK", work.path().display().to_string()),
        ],
        // Below nextest's terminate-after (5 × 60 s), so this harness, not nextest, stops
        // the script's process group (nats-server, runner, the bureau) on a hang.
        Duration::from_secs(240),
    );
    // What the chapter says happens, happened.
    for needle in [
        // The demo's closing account.
        "orders shipped:       20 of 20",
        "dead letters:         0",
        "ok: 1 file(s), 1 saga version(s), 1 effect(s), 0 warning(s)",
        " passed, 0 failed",
        "published tenant.acme.aggregate.Loan.l-100 to AGGREGATE_EVENTS",
        "\"state\": \"approved\"",
        "runner_saga_transitions_total{outcome=\"ignored\",saga=\"loan\"}",
        "unknown_tenant",
        "1 dead letter(s)",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in:\n{out}");
    }
    // The last scrape the chapter shows (every outcome's series exists from the start, at 0).
    let ignored = out
        .lines()
        .rfind(|l| l.starts_with("runner_saga_transitions_total{outcome=\"ignored\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(
        ignored >= 1,
        "the late bureau answer was not ignored:\n{out}"
    );
    // The withdrawn loan's bureau call was not cancelled: the bureau was still asked.
    let bureau = std::fs::read_to_string(work.path().join("bureau.log")).unwrap();
    assert!(bureau.contains("applicant=a-slow-1"), "{bureau}");
    // A timer is due at the input's timestamp plus its delay (the request of l-500).
    let l500: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(work.path().join("l-500.json")).unwrap())
            .unwrap();
    assert_eq!(
        l500["instance"]["timers"]["bureau_deadline"]["due_ms"]
            .as_u64()
            .unwrap(),
        l500["instance"]["started_ms"].as_u64().unwrap() + 120_000,
        "{l500}"
    );
    assert!(
        out.contains("\"kind\": \"unknown_tenant\""),
        "dlq show: {out}"
    );
    // The inspect output the book shows has the shape the real one has.
    for (real, shown) in [
        ("l-100.json", "inspect-l-100.json"),
        ("l-500.json", "inspect-l-500.json"),
    ] {
        let real_text = std::fs::read_to_string(work.path().join(real)).unwrap();
        let real: serde_json::Value = serde_json::from_str(&real_text).unwrap();
        let shown_path = root().join("docs/book/examples/loan").join(shown);
        if std::env::var_os("UPDATE_BOOK").is_some() {
            std::fs::write(&shown_path, &real_text).unwrap();
        }
        let shown: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&shown_path).unwrap()).unwrap();
        assert_eq!(
            shape(&real),
            shape(&shown),
            "{} differs in shape from a real `runner inspect`",
            shown_path.display()
        );
    }
}

#[test]
fn the_other_chapters_commands_run() {
    let mut ran = 0;
    for c in chapters() {
        let name = c.file_name().unwrap().to_string_lossy().into_owned();
        if name == "getting-started.md" || !blocks(&c).iter().any(|b| b.has("run")) {
            continue;
        }
        let out = run_chapter(&name, &[], Duration::from_secs(120));
        assert!(!out.is_empty(), "{name} printed nothing");
        ran += 1;
    }
    assert!(ran >= 2, "{ran} chapters with commands");
}
