//! Loading: from paths (or in-memory texts) to a [`LoadReport`].
//!
//! Guarantee: loading is all-or-nothing and reproducible. Files are listed in sorted order
//! (test-case files skipped), every file is parsed and compiled even after a failure, the
//! diagnostics come out sorted by place, and the catalog is handed out only when none of
//! them is an error.

use std::path::{Path, PathBuf};

use super::{Diagnostic, LoadReport, Severity, compile};

/// Lists the manifest files under `paths`: files as given, directories searched recursively
/// for `*.yaml` / `*.yml` (hidden entries skipped), sorted so that loading is deterministic.
pub fn collect_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>, Diagnostic> {
    let mut out = Vec::new();
    for p in paths {
        collect_into(p, &mut out)?;
    }
    out.sort();
    out.dedup();
    Ok(out)
}

fn collect_into(p: &Path, out: &mut Vec<PathBuf>) -> Result<(), Diagnostic> {
    let meta = std::fs::metadata(p).map_err(|e| io_diag(p, &e))?;
    if meta.is_dir() {
        let entries = std::fs::read_dir(p).map_err(|e| io_diag(p, &e))?;
        for entry in entries {
            let entry = entry.map_err(|e| io_diag(p, &e))?;
            // Hidden entries are not manifests: a Kubernetes ConfigMap volume keeps a
            // second copy of every file under `..data` and `..<timestamp>`, and editors
            // leave `.name.yaml` files; a path named explicitly is still read.
            if entry.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let path = entry.path();
            if path.is_dir() {
                collect_into(&path, out)?;
            } else if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml")
            ) {
                out.push(path);
            }
        }
    } else {
        out.push(p.to_path_buf());
    }
    Ok(())
}

fn io_diag(p: &Path, e: &std::io::Error) -> Diagnostic {
    Diagnostic {
        file: p.to_path_buf(),
        line: 0,
        column: 0,
        severity: Severity::Error,
        message: format!("cannot read: {e}"),
    }
}

/// Orders diagnostics by file, line and column (stable: same place keeps discovery order).
fn sort(diagnostics: &mut [Diagnostic]) {
    diagnostics.sort_by(|a, b| (&a.file, a.line, a.column).cmp(&(&b.file, b.line, b.column)));
}

/// Whether a path names a test-case file (`*.tests.yaml` / `*.tests.yml`), which
/// `runner test` reads and manifest loading skips.
pub fn is_test_file(p: &Path) -> bool {
    p.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with(".tests.yaml") || n.ends_with(".tests.yml"))
}

/// The paths `runner test` loads manifests from: `paths` as given, plus, for each test-case
/// file named directly (`order.tests.yaml`), the manifest beside it with the same stem
/// (`order.yaml` or `order.yml`) when one exists. So `runner test manifests/order.tests.yaml`
/// runs against `manifests/order.yaml` without naming it.
pub fn with_manifests_beside(paths: &[PathBuf]) -> Vec<PathBuf> {
    let mut out = paths.to_vec();
    for p in paths.iter().filter(|p| is_test_file(p)) {
        let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let stem = name
            .trim_end_matches(".tests.yaml")
            .trim_end_matches(".tests.yml");
        let beside = ["yaml", "yml"]
            .iter()
            .map(|ext| p.with_file_name(format!("{stem}.{ext}")))
            .find(|m| m.is_file());
        if let Some(m) = beside
            && !out.contains(&m)
        {
            out.push(m);
        }
    }
    out
}

/// Loads and validates every manifest under `paths` (test-case files are skipped).
pub fn load(paths: &[PathBuf]) -> LoadReport {
    let files = match collect_files(paths) {
        Ok(f) => f,
        Err(d) => {
            return LoadReport {
                catalog: None,
                diagnostics: vec![d],
            };
        }
    };
    let mut diagnostics = Vec::new();
    let mut parsed = Vec::new();
    for file in files.into_iter().filter(|f| !is_test_file(f)) {
        match std::fs::read_to_string(&file) {
            Ok(text) => {
                if let Some(m) = compile::parse(&file, &text, &mut diagnostics) {
                    parsed.push((file, m));
                }
            }
            Err(e) => diagnostics.push(io_diag(&file, &e)),
        }
    }
    let catalog = compile::compile(parsed, &mut diagnostics);
    sort(&mut diagnostics);
    let ok = !diagnostics.iter().any(|d| d.severity == Severity::Error);
    LoadReport {
        catalog: ok.then_some(catalog),
        diagnostics,
    }
}

/// Loads manifests from in-memory texts (`(file name, YAML)`), as [`load`] does from disk.
pub fn load_str(sources: &[(&str, &str)]) -> LoadReport {
    let mut diagnostics = Vec::new();
    let mut parsed = Vec::new();
    for (name, text) in sources {
        let file = PathBuf::from(name);
        if let Some(m) = compile::parse(&file, text, &mut diagnostics) {
            parsed.push((file, m));
        }
    }
    let catalog = compile::compile(parsed, &mut diagnostics);
    sort(&mut diagnostics);
    let ok = !diagnostics.iter().any(|d| d.severity == Severity::Error);
    LoadReport {
        catalog: ok.then_some(catalog),
        diagnostics,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configmap_volume_is_read_once() {
        // The layout the kubelet writes: the real files under `..<timestamp>`, `..data`
        // pointing at it, and a symlink per key at the top.
        let dir = tempfile::tempdir().expect("tempdir");
        let stamp = dir.path().join("..2026_11_25_12_00_00.1");
        std::fs::create_dir(&stamp).expect("mkdir");
        std::fs::write(stamp.join("order.yaml"), "format: 1\n").expect("write");
        std::os::unix::fs::symlink(&stamp, dir.path().join("..data")).expect("symlink");
        std::os::unix::fs::symlink(
            dir.path().join("..data/order.yaml"),
            dir.path().join("order.yaml"),
        )
        .expect("symlink");
        std::fs::write(dir.path().join(".draft.yaml"), "not: loaded\n").expect("write");
        let files = collect_files(&[dir.path().to_path_buf()]).expect("listed");
        assert_eq!(files, vec![dir.path().join("order.yaml")]);
        // Named explicitly, a hidden file is read.
        let named = collect_files(&[dir.path().join(".draft.yaml")]).expect("listed");
        assert_eq!(named.len(), 1);
    }
}
