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
//!
//! | file | checks |
//! |---|---|
//! | `main.rs` | the chapters, their code blocks and includes; manifests, scenarios, configurations and broken examples |
//! | `references.rs` | the generated pages and the references against the schema, the config structs, the metrics and the backoff |
//! | `commands.rs` | runs the `run` blocks (Getting started end to end, then the other chapters) |
//! | `build.rs` | `mdbook build` with the pinned version, and the links of the result (`html.rs`) |
//! | `markdown.rs`, `generate.rs` | reading the Markdown sources; computing the generated pages |
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod build;
mod commands;
#[path = "../common/mod.rs"]
mod common;
mod generate;
mod html;
mod markdown;
mod references;

use std::path::{Path, PathBuf};
use std::process::Command;

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
        } else if !["text", "promql", "mermaid"].contains(&b.lang.as_str()) {
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
