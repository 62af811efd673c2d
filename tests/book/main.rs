//! The user guide (`docs/book`) is checked here, so that nothing it shows can drift from
//! the program:
//!
//! - every shell block is marked: `run` blocks are executed, chapter by chapter in order,
//!   with the real `runner` and a real nats-server (Getting started from a clean state to a
//!   drained node); `norun` blocks carry a `<!-- norun: why -->` line saying how they are
//!   checked instead;
//! - every YAML, TOML and JSON block is an `{{#include}}` of a file, and every included
//!   manifest passes `runner validate`, every included scenario file `runner test`, every
//!   included configuration the configuration loader; the deliberately broken examples fail
//!   with exactly the messages they show;
//! - the generated pages (manifest keys from the JSON Schema, configuration keys from the
//!   config structs, metrics from their definitions, the retry waits from the backoff
//!   function) are current: `UPDATE_BOOK=1 cargo test --test book` rewrites them;
//! - `mdbook build` succeeds and every internal link and `#anchor` of the result resolves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../common/mod.rs"]
mod common;
mod generate;
mod html;
mod markdown;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use markdown::{Block, blocks, chapters, includes, root, src_dir};

const SHELLS: [&str; 3] = ["bash", "sh", "console"];

fn runner() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_runner"));
    c.current_dir(root());
    c
}

fn all_blocks() -> Vec<Block> {
    chapters().iter().flat_map(|c| blocks(c)).collect()
}

#[test]
fn every_chapter_in_the_summary_exists_and_has_content() {
    let chapters = chapters();
    assert!(chapters.len() >= 12, "{chapters:?}");
    for c in chapters {
        let text = std::fs::read_to_string(&c).unwrap_or_else(|e| panic!("{}: {e}", c.display()));
        assert!(text.lines().count() > 10, "{} is nearly empty", c.display());
    }
}

#[test]
fn code_blocks_are_marked_and_data_is_included_from_checked_files() {
    let mut problems = Vec::new();
    let (mut run, mut norun) = (0, 0);
    for b in all_blocks() {
        if SHELLS.contains(&b.lang.as_str()) {
            match (b.has("run"), b.has("norun")) {
                (true, false) => run += 1,
                (false, true) if b.before.starts_with("<!-- norun:") && b.before.len() > 20 => {
                    norun += 1
                }
                (false, true) => problems.push(format!(
                    "{}: a `norun` block needs a `<!-- norun: how it is checked instead -->` line before it",
                    b.at()
                )),
                _ => problems.push(format!("{}: mark the shell block `run` or `norun`", b.at())),
            }
        } else if ["yaml", "yml", "toml", "json"].contains(&b.lang.as_str()) {
            let only_includes = b
                .body
                .lines()
                .filter(|l| !l.trim().is_empty())
                .all(|l| l.trim().starts_with("{{#include ") && l.trim().ends_with("}}"));
            if !only_includes {
                problems.push(format!(
                    "{}: a {} block must be an {{{{#include}}}} of a file that CI checks",
                    b.at(),
                    b.lang
                ));
            }
        } else if !["text", "promql"].contains(&b.lang.as_str()) {
            problems.push(format!(
                "{}: unexpected block language `{}`",
                b.at(),
                b.lang
            ));
        }
    }
    for c in chapters() {
        for inc in includes(&c) {
            if inc.path.starts_with(src_dir().join("generated")) {
                continue; // checked by generated_pages_are_current
            }
            let Ok(text) = std::fs::read_to_string(&inc.path) else {
                problems.push(format!(
                    "{}: includes missing {}",
                    inc.at,
                    inc.path.display()
                ));
                continue;
            };
            if let Some(a) = &inc.anchor
                && !markdown::has_anchor(&text, a)
            {
                problems.push(format!(
                    "{}: {} has no anchor `{a}`",
                    inc.at,
                    inc.path.display()
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(run >= 15 && norun >= 1, "run {run}, norun {norun}");
}

/// Every file the book includes, by kind.
fn included(ext: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = chapters()
        .iter()
        .flat_map(|c| includes(c))
        .map(|i| markdown::canonical(&i.path))
        .filter(|p| p.to_string_lossy().ends_with(ext))
        .collect();
    out.sort();
    out.dedup();
    out
}

fn is_broken_example(p: &Path) -> bool {
    p.starts_with(markdown::canonical(
        &root().join("docs/book/examples/broken"),
    ))
}

#[test]
fn every_manifest_the_book_shows_validates_and_its_scenarios_pass() {
    let manifests: Vec<PathBuf> = included(".yaml")
        .into_iter()
        .filter(|p| !runner::manifest::is_test_file(p) && !is_broken_example(p))
        .collect();
    assert!(manifests.len() >= 5, "{manifests:?}");
    for m in &manifests {
        let out = runner().arg("validate").arg(m).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{}: {stderr}", m.display());
        assert!(!stderr.contains("warning"), "{}: {stderr}", m.display());
    }
    // Each manifest with scenarios beside it, included or not: the examples are all tested.
    let mut tested = 0;
    for m in &manifests {
        let tests = m.with_file_name(format!(
            "{}.tests.yaml",
            m.file_stem().unwrap().to_string_lossy()
        ));
        if !tests.exists() {
            continue;
        }
        let out = runner().arg("test").arg(&tests).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}: {stdout}{}",
            tests.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.trim_end().ends_with(" passed, 0 failed"), "{stdout}");
        tested += 1;
    }
    assert!(
        tested >= 4,
        "only {tested} example manifests have scenarios"
    );
    for t in included(".tests.yaml")
        .iter()
        .filter(|p| !is_broken_example(p))
    {
        let out = runner().arg("test").arg(t).output().unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            t.display(),
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

#[test]
fn every_configuration_the_book_shows_loads_and_validates() {
    let configs = included(".toml");
    assert!(configs.len() >= 2, "{configs:?}");
    for c in configs {
        let loaded = runner::config::load(Some(&c), Vec::new(), &Default::default());
        assert!(loaded.is_ok(), "{}: {}", c.display(), loaded.unwrap_err());
    }
}

/// The `# run:` and `# expect:` lines of a broken example.
fn directives(text: &str, name: &str) -> Vec<String> {
    let prefix = format!("# {name}: ");
    text.lines()
        .filter_map(|l| l.strip_prefix(&prefix).map(str::to_owned))
        .collect()
}

#[test]
fn broken_examples_fail_with_the_messages_they_show() {
    let dir = root().join("docs/book/examples/broken");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        let args: Vec<String> = match directives(&text, "run").first() {
            Some(line) => line
                .split_whitespace()
                .skip(1) // `runner`
                .map(str::to_owned)
                .collect(),
            None if name.ends_with(".toml") => vec!["run".into(), "--config".into(), name.clone()],
            None if runner::manifest::is_test_file(&path) => vec!["test".into(), name.clone()],
            None => vec!["validate".into(), name.clone()],
        };
        let out = Command::new(env!("CARGO_BIN_EXE_runner"))
            .args(&args)
            .current_dir(&dir)
            .output()
            .unwrap();
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(1), "{name} should fail: {all}");
        let expected = directives(&text, "expect");
        assert!(!expected.is_empty(), "{name} has no `# expect:` line");
        for e in expected {
            assert!(all.contains(&e), "{name}: expected {e:?} in:\n{all}");
        }
        seen += 1;
    }
    assert!(seen >= 5, "{seen} broken examples");
}

/// Compares a generated page with the committed one; rewrites it under `UPDATE_BOOK=1`.
fn check_generated(name: &str, generated: &str) -> Option<String> {
    let path = src_dir().join("generated").join(name);
    let text = format!(
        "<!-- Generated by tests/book (UPDATE_BOOK=1 cargo test --test book); do not edit. -->\n\n{}\n",
        generated.trim_end()
    );
    if std::env::var_os("UPDATE_BOOK").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &text).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    (committed != text).then(|| format!("docs/book/src/generated/{name} is stale"))
}

#[test]
fn generated_pages_are_current() {
    let schema = runner::manifest::json_schema();
    let stale: Vec<String> = [
        ("manifest-keys.md", generate::manifest_keys(&schema)),
        ("config-keys.md", generate::config_keys()),
        ("metrics.md", generate::metrics_table()),
        ("retry-table.md", generate::retry_table()),
    ]
    .iter()
    .filter_map(|(n, g)| check_generated(n, g))
    .collect();
    assert!(
        stale.is_empty(),
        "{}; regenerate with `UPDATE_BOOK=1 cargo test --test book` and commit",
        stale.join(", ")
    );
}

#[test]
fn the_manifest_reference_names_every_schema_key_and_only_those() {
    let schema = runner::manifest::json_schema();
    let page = std::fs::read_to_string(src_dir().join("generated/manifest-keys.md")).unwrap();
    let mut keys = std::collections::BTreeSet::new();
    fn collect(v: &serde_json::Value, out: &mut std::collections::BTreeSet<String>) {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(p) = m.get("properties").and_then(|p| p.as_object()) {
                    out.extend(p.keys().cloned());
                }
                m.values().for_each(|x| collect(x, out));
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| collect(x, out)),
            _ => {}
        }
    }
    collect(&schema, &mut keys);
    for k in &keys {
        assert!(
            page.contains(&format!("| `{k}` |")),
            "the reference lacks key `{k}`"
        );
    }
    for line in page.lines().filter(|l| l.starts_with("| `")) {
        let k = line[3..].split('`').next().unwrap();
        let is_value = ["completed", "failed", "compensated"].contains(&k);
        assert!(
            is_value || keys.contains(k),
            "the reference names `{k}`, which the schema lacks"
        );
    }
    // The schema's provider description names every provider Runner has.
    let desc = schema["$defs"]["EffectDecl"]["properties"]["provider"]["description"]
        .as_str()
        .unwrap();
    for p in runner::manifest::PROVIDERS {
        assert!(
            desc.contains(&format!("`{p}`")),
            "the schema's provider description lacks `{p}`: {desc}"
        );
        let effects = std::fs::read_to_string(src_dir().join("effects.md")).unwrap();
        let has_section = effects
            .lines()
            .any(|l| l.starts_with("### ") && l.contains(&format!("`{p}`")));
        assert!(has_section, "effects.md lacks a section for `{p}`");
    }
}

#[test]
fn the_configuration_reference_has_every_key_of_the_structs_and_no_other() {
    let structs = generate::struct_keys();
    let toml: Vec<(String, String)> = generate::default_toml_keys()
        .into_iter()
        .map(|k| (k.section, k.key))
        .collect();
    for k in structs.keys() {
        assert!(
            toml.contains(k),
            "config/default.toml lacks [{}] {}",
            k.0,
            k.1
        );
    }
    for k in &toml {
        assert!(
            structs.contains_key(k),
            "config/default.toml has [{}] {}, which the config structs lack",
            k.0,
            k.1
        );
    }
    let page = std::fs::read_to_string(src_dir().join("generated/config-keys.md")).unwrap();
    for (section, key) in structs.keys() {
        let env = format!("RUNNER__{}__{}", section.to_uppercase(), key.to_uppercase());
        assert!(
            page.contains(&format!("| `{key}` |")) && page.contains(&env),
            "the reference lacks {section}.{key}"
        );
    }
    // An environment override the reference names really overrides the key.
    let c = runner::config::load(
        None,
        vec![("RUNNER__SAGA__BATCH_SIZE".into(), "7".into())],
        &Default::default(),
    )
    .unwrap();
    assert_eq!(c.saga.batch_size, 7);
    // Every variable the reference names is one the loader knows (an unknown one is
    // refused): each set to its key's default loads, and changes nothing.
    let defaults = runner::config::Config::default();
    for ((section, key), v) in &structs {
        let value = match v {
            serde_json::Value::Null => continue,
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(items) if items.is_empty() => continue,
            serde_json::Value::Array(items) => items
                .iter()
                .map(|i| {
                    i.as_str()
                        .map(str::to_owned)
                        .unwrap_or_else(|| i.to_string())
                })
                .collect::<Vec<_>>()
                .join(","),
            other => other.to_string(),
        };
        let env = format!("RUNNER__{}__{}", section.to_uppercase(), key.to_uppercase());
        let loaded = runner::config::load(
            None,
            vec![(env.clone(), value.clone())],
            &Default::default(),
        );
        match loaded {
            Ok(c) => assert!(c == defaults, "{env}={value} changed the configuration"),
            Err(e) => panic!("{env}={value}: {e}"),
        }
    }
    let unknown = runner::config::load(
        None,
        vec![("RUNNER__SAGA__NO_SUCH_KEY".into(), "1".into())],
        &Default::default(),
    );
    assert!(unknown.is_err(), "an unknown variable must be refused");
}

#[test]
fn the_retry_table_agrees_with_the_formula_the_book_states() {
    use runner::manifest::model::RetryPolicy;
    // The book states min(max_backoff, (base_backoff × 2) ^ n) and quotes examples.
    let p = |base, max| RetryPolicy {
        retry_limit: 9,
        base_backoff: Some(base),
        max_backoff: max,
        enable_jitter: false,
    };
    let waits = |pol: &RetryPolicy| {
        (1..=5)
            .map(|n| runner::saga::retry::backoff_ms(pol, n))
            .collect::<Vec<_>>()
    };
    assert_eq!(waits(&p(10, 30_000)), [20, 400, 8_000, 30_000, 30_000]);
    assert_eq!(waits(&p(100, 5_000)), [200, 5_000, 5_000, 5_000, 5_000]);
    let effects = std::fs::read_to_string(src_dir().join("effects.md")).unwrap();
    assert!(
        effects.contains("4 × 2 s + (200 + 5 000 + 5 000) ms"),
        "the worked total in effects.md"
    );
    let none = RetryPolicy {
        base_backoff: None,
        ..p(1, 1)
    };
    assert_eq!(runner::saga::retry::backoff_ms(&none, 3), 0);
}

#[test]
fn operations_lists_every_dead_letter_kind_and_metric() {
    let ops = std::fs::read_to_string(src_dir().join("operations.md")).unwrap();
    for k in runner::deadletter::kind::ALL {
        assert!(
            ops.contains(&format!("| `{k}` |")),
            "operations.md lacks dead-letter kind `{k}`"
        );
    }
    let metrics = generate::metrics();
    assert!(metrics.len() >= 40, "{}", metrics.len());
    for (name, kind, _, help) in &metrics {
        assert!(kind != "?" && !help.is_empty(), "{name}: {kind} {help}");
    }
    // Every metric the alerts use exists.
    for word in ops.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("runner_") && !word.ends_with('_') {
            let base = word.trim_end_matches("_bucket");
            assert!(
                metrics.iter().any(|(n, ..)| n == base),
                "operations.md names unknown metric {word}"
            );
        }
    }
}

// ---------------------------------------------------------------- running the shell blocks

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

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
        Some(s) => panic!("{chapter}: the commands failed ({s}):\n{output}"),
        None => panic!("{chapter}: the commands did not finish within {limit:?}:\n{output}"),
    }
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
    let out = run_chapter(
        "getting-started.md",
        &[
            ("NATS_PORT", free_port().to_string()),
            ("ADMIN_PORT", free_port().to_string()),
            ("BUREAU_PORT", free_port().to_string()),
            ("WORK", work.path().display().to_string()),
        ],
        // Below nextest's terminate-after (5 × 60 s), so this harness, not nextest, stops
        // the script's process group (nats-server, runner, the bureau) on a hang.
        Duration::from_secs(240),
    );
    // What the chapter says happens, happened.
    for needle in [
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
    let ignored = out
        .lines()
        .find(|l| l.starts_with("runner_saga_transitions_total{outcome=\"ignored\""))
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

// ---------------------------------------------------------------- building the book

/// The pinned mdBook version, from `scripts/setup-deps`.
fn pinned_mdbook() -> String {
    let text = std::fs::read_to_string(root().join("scripts/setup-deps")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("MDBOOK_VERSION="))
        .expect("scripts/setup-deps pins MDBOOK_VERSION")
        .trim()
        .to_owned()
}

fn mdbook() -> PathBuf {
    let candidates = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .chain(std::env::var_os("CARGO_HOME").map(|h| PathBuf::from(h).join("bin")))
        .chain(std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo/bin")))
        .map(|d| d.join("mdbook"))
        .collect::<Vec<_>>();
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "mdbook is not installed: `scripts/setup-deps --test` installs it \
             (cargo install mdbook --locked --version {})",
                pinned_mdbook()
            )
        })
}

#[test]
fn the_book_builds_and_every_internal_link_resolves() {
    let bin = mdbook();
    let version = Command::new(&bin).arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&version.stdout).into_owned();
    assert!(
        version.contains(&pinned_mdbook()),
        "mdbook {version} is not the pinned {}: run `scripts/setup-deps --test`",
        pinned_mdbook()
    );
    let out_dir = tempfile::tempdir().unwrap();
    let out = Command::new(&bin)
        .arg("build")
        .arg(root().join("docs/book"))
        .arg("--dest-dir")
        .arg(out_dir.path())
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "mdbook build failed:\n{log}");
    assert!(
        !log.contains("WARN") && !log.contains("ERROR"),
        "mdbook build warned:\n{log}"
    );
    let (broken, checked) = html::broken_links(out_dir.path());
    assert!(
        broken.is_empty(),
        "{} broken link(s):\n{}",
        broken.len(),
        broken.join("\n")
    );
    assert!(checked > 200, "only {checked} links checked");
    // Includes were expanded: no directive is left in the output.
    let gs = std::fs::read_to_string(out_dir.path().join("getting-started.html")).unwrap();
    assert!(!gs.contains("{{#include") && gs.contains("bureau_deadline"));
}
