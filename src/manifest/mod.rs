//! Manifests: the sagas and effects an operator declares in YAML files.
//!
//! Loading is all-or-nothing: [`load`] reads every file under the given paths and returns
//! either a complete [`Catalog`] or the full list of problems found (each with file, line
//! and column). Nothing half-loaded is ever handed to the rest of the runner, so a reload
//! that fails keeps the previous catalog in force.
//!
//! This module is the stable interface the rest of the binary uses (`runner validate`,
//! `/admin/reload`, `/info`). The saga model and the engine grow behind it.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The manifest format version this build understands.
pub const FORMAT_VERSION: u32 = 1;

/// How bad a [`Diagnostic`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The manifest set cannot be used.
    Error,
    /// The manifest set is usable but probably not what the author meant.
    Warning,
}

/// One problem found in a manifest file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Diagnostic {
    /// The file the problem is in.
    pub file: PathBuf,
    /// 1-based line, 0 when unknown.
    pub line: u64,
    /// 1-based column, 0 when unknown.
    pub column: u64,
    /// Error or warning.
    pub severity: Severity,
    /// What is wrong, in one sentence.
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        write!(
            f,
            "{}:{}:{}: {sev}: {}",
            self.file.display(),
            self.line,
            self.column,
            self.message
        )
    }
}

/// A validated set of manifests, ready to run.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    files: Vec<PathBuf>,
    sagas: Vec<(String, u32)>,
    effects: Vec<String>,
}

/// What `/info` shows of a [`Catalog`].
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct CatalogSummary {
    /// Files the catalog was loaded from.
    pub files: Vec<String>,
    /// Saga names with their loaded version.
    pub sagas: Vec<SagaSummary>,
    /// Effect names.
    pub effects: Vec<String>,
}

/// One loaded saga version.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct SagaSummary {
    /// Saga name.
    pub name: String,
    /// Saga version.
    pub version: u32,
}

impl Catalog {
    /// A catalog with nothing in it.
    pub fn empty() -> Self {
        Self::default()
    }

    /// The names and versions shown by `/info`.
    pub fn summary(&self) -> CatalogSummary {
        CatalogSummary {
            files: self.files.iter().map(|f| f.display().to_string()).collect(),
            sagas: self
                .sagas
                .iter()
                .map(|(name, version)| SagaSummary {
                    name: name.clone(),
                    version: *version,
                })
                .collect(),
            effects: self.effects.clone(),
        }
    }
}

/// The result of [`load`]: a catalog when there were no errors, and every diagnostic found.
#[derive(Debug)]
pub struct LoadReport {
    /// `Some` exactly when no diagnostic is an error.
    pub catalog: Option<Catalog>,
    /// Every problem found, errors and warnings, in file order.
    pub diagnostics: Vec<Diagnostic>,
}

impl LoadReport {
    /// The diagnostics that are errors.
    pub fn errors(&self) -> impl Iterator<Item = &Diagnostic> {
        self.diagnostics
            .iter()
            .filter(|d| d.severity == Severity::Error)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    format: u32,
    #[serde(default)]
    sagas: Vec<RawNamed>,
    #[serde(default)]
    effects: Vec<RawNamed>,
}

#[derive(Debug, Deserialize)]
struct RawNamed {
    name: String,
    #[serde(default = "one")]
    version: u32,
}

fn one() -> u32 {
    1
}

/// Lists the manifest files under `paths`: files as given, directories searched recursively
/// for `*.yaml` / `*.yml`, sorted so that loading is deterministic.
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

/// Loads and validates every manifest under `paths`.
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
    let mut catalog = Catalog {
        files: files.clone(),
        ..Catalog::default()
    };
    for file in &files {
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) => {
                diagnostics.push(io_diag(file, &e));
                continue;
            }
        };
        match serde_saphyr::from_str::<RawFile>(&text) {
            Ok(raw) => {
                if raw.format != FORMAT_VERSION {
                    diagnostics.push(Diagnostic {
                        file: file.clone(),
                        line: 0,
                        column: 0,
                        severity: Severity::Error,
                        message: format!(
                            "format {} is not supported (this build reads format {FORMAT_VERSION})",
                            raw.format
                        ),
                    });
                }
                for s in raw.sagas {
                    if catalog
                        .sagas
                        .iter()
                        .any(|(n, v)| *n == s.name && *v == s.version)
                    {
                        diagnostics.push(Diagnostic {
                            file: file.clone(),
                            line: 0,
                            column: 0,
                            severity: Severity::Error,
                            message: format!(
                                "saga `{}` version {} is declared twice",
                                s.name, s.version
                            ),
                        });
                    }
                    catalog.sagas.push((s.name, s.version));
                }
                catalog
                    .effects
                    .extend(raw.effects.into_iter().map(|e| e.name));
            }
            Err(e) => {
                let (line, column) = e
                    .location()
                    .map(|l| (l.line(), l.column()))
                    .unwrap_or((0, 0));
                diagnostics.push(Diagnostic {
                    file: file.clone(),
                    line,
                    column,
                    severity: Severity::Error,
                    message: e.to_string(),
                });
            }
        }
    }
    let ok = !diagnostics.iter().any(|d| d.severity == Severity::Error);
    LoadReport {
        catalog: ok.then_some(catalog),
        diagnostics,
    }
}
