//! Building the book with the pinned mdBook, and checking every internal link of the result.

use std::path::PathBuf;
use std::process::Command;

use super::html;
use super::markdown::root;

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
